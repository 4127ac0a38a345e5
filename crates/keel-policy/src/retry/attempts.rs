//! Starting one more attempt of a call: from a closure, or from a tower
//! service with a clone of the request. Retry and hedging share this so the
//! async API and the tower layer run the same state machine.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use keel_core::BoxError;
use pin_project_lite::pin_project;
use tower_service::Service;

/// A source of attempts for one call.
pub(crate) trait Attempts {
    type Ok;
    type Error;
    type Future: Future<Output = Result<Self::Ok, Self::Error>>;

    /// Starts an attempt once the source is ready (a service may not be).
    fn poll_start(&mut self, cx: &mut Context<'_>) -> Poll<Result<Self::Future, Self::Error>>;
}

/// Attempts made by calling a closure.
pub(crate) struct FnAttempts<F>(pub(crate) F);

impl<F, Fut, T, E> Attempts for FnAttempts<F>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    type Ok = T;
    type Error = E;
    type Future = Fut;

    #[inline]
    fn poll_start(&mut self, _: &mut Context<'_>) -> Poll<Result<Fut, E>> {
        Poll::Ready(Ok((self.0)()))
    }
}

/// Attempts made by calling a service with a clone of the request.
pub(crate) struct ServiceAttempts<S, Req> {
    service: S,
    request: Req,
}

impl<S, Req> ServiceAttempts<S, Req> {
    pub(crate) fn new(service: S, request: Req) -> Self {
        Self { service, request }
    }
}

impl<S, Req> Attempts for ServiceAttempts<S, Req>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    Req: Clone,
{
    type Ok = S::Response;
    type Error = BoxError;
    type Future = BoxErrorFuture<S::Future>;

    fn poll_start(&mut self, cx: &mut Context<'_>) -> Poll<Result<Self::Future, BoxError>> {
        ready!(self.service.poll_ready(cx)).map_err(Into::into)?;
        Poll::Ready(Ok(BoxErrorFuture::new(
            self.service.call(self.request.clone()),
        )))
    }
}

pin_project! {
    /// A service's response future with its error boxed.
    pub(crate) struct BoxErrorFuture<F> {
        #[pin]
        inner: F,
    }
}

impl<F> BoxErrorFuture<F> {
    pub(crate) fn new(inner: F) -> Self {
        Self { inner }
    }
}

impl<F, T, E> Future for BoxErrorFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project().inner.poll(cx).map_err(Into::into)
    }
}
