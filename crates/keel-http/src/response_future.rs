//! The response future of the edge's middleware that must await inside
//! `call` (load shedding, deadlines, trace context, idempotency).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::http::Response;

/// A boxed response future: the middleware that use it read the request,
/// await state and then the inner service, a state machine not worth
/// naming when one allocation per request is cheap beside the I/O.
pub struct ResponseFuture<E> {
    inner: Pin<Box<dyn Future<Output = Result<Response<Body>, E>> + Send>>,
}

impl<E> ResponseFuture<E> {
    pub(crate) fn new(
        future: impl Future<Output = Result<Response<Body>, E>> + Send + 'static,
    ) -> Self {
        Self {
            inner: Box::pin(future),
        }
    }
}

impl<E> std::fmt::Debug for ResponseFuture<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}

impl<E> Future for ResponseFuture<E> {
    type Output = Result<Response<Body>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}
