//! A `tower::Layer` that puts the six controls in front of any HTTP service, for Rust services
//! that embed Tollgate instead of running the proxy.
//!
//! The layer reads the body (up to a limit), asks a function for the request's facts (identity
//! and token counts), makes one admission, and either answers 429/400 itself or calls the inner
//! service with an [`AdmissionHandle`] in the request's extensions. The inner service settles
//! with the real usage through the handle; if it never does, the admission is released when the
//! last clone of the handle is dropped (keep one in a streamed body to hold the lease until the
//! stream ends).

mod future;
mod layer;
mod service;

pub use future::ResponseFuture;
pub use layer::{Admission, AdmissionLayer, FactsFn};
pub use service::AdmissionHandle;
