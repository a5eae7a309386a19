//! The keys an instance knows: a key's record and its life (issued, rotated, revoked, expired),
//! and the registry the request path finds a bearer in. What changes them in the shared store
//! is the keys module's.

pub mod life;
pub mod record;
pub mod registry;

pub use life::{KeyRecord, Refusal, Secret};
pub use record::{Issued, NewKey, Rotation};
pub use registry::{Found, Registry};
