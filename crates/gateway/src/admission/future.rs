//! The response future.

use futures_util::future::BoxFuture;

/// The future of an [`super::Admission`] call.
pub type ResponseFuture<E> = BoxFuture<'static, Result<axum::response::Response, E>>;
