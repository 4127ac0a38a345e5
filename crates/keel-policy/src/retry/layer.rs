//! The tower form of [`Retry`]: [`RetryLayer`] and [`RetryService`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use keel_core::BoxError;
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use super::attempts::{BoxErrorFuture, ServiceAttempts};
use super::future::RetryFuture;
use super::{ByClass, Retry, RetryPolicy, Shared};

/// Applies a [`Retry`] to a service whose requests can be cloned.
pub struct RetryLayer<P = ByClass> {
    retry: Retry<P>,
}

impl<P> RetryLayer<P> {
    /// A layer applying `retry`; all services it wraps share its budget.
    pub fn new(retry: Retry<P>) -> Self {
        Self { retry }
    }
}

impl<P> Clone for RetryLayer<P> {
    fn clone(&self) -> Self {
        Self {
            retry: self.retry.clone(),
        }
    }
}

impl<P> fmt::Debug for RetryLayer<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryLayer")
            .field("retry", &self.retry)
            .finish()
    }
}

impl<S, P> Layer<S> for RetryLayer<P> {
    type Service = RetryService<S, P>;

    fn layer(&self, inner: S) -> Self::Service {
        RetryService {
            inner,
            retry: self.retry.clone(),
        }
    }
}

/// A service that retries its inner service's failures, as decided by a
/// [`Retry`]. Its errors are [`BoxError`]s: the inner service's, untouched,
/// or a boxed [`Rejected`](keel_core::Rejected). Errors are classified with
/// [`keel_core::error::classify`] (through `BoxError`'s [`Classify`](keel_core::Classify)).
pub struct RetryService<S, P = ByClass> {
    inner: S,
    retry: Retry<P>,
}

impl<S: Clone, P> Clone for RetryService<S, P> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            retry: self.retry.clone(),
        }
    }
}

impl<S: fmt::Debug, P> fmt::Debug for RetryService<S, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryService")
            .field("inner", &self.inner)
            .field("retry", &self.retry)
            .finish()
    }
}

impl<S, P> RetryService<S, P> {
    /// Wraps `inner` with `retry`.
    pub fn new(inner: S, retry: Retry<P>) -> Self {
        Self { inner, retry }
    }

    keel_core::inner_service_accessors!(inner: S);
}

impl<S, P, Req> Service<Req> for RetryService<S, P>
where
    S: Service<Req> + Clone,
    S::Error: Into<BoxError>,
    Req: Clone,
    P: RetryPolicy<S::Response, BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S, Req, P>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Req) -> Self::Future {
        let shared = Arc::clone(self.retry.shared());
        shared.record_request();
        // The ready service makes the first attempt; a clone (readied again
        // before each retry) takes its place here.
        let clone = self.inner.clone();
        let mut ready = std::mem::replace(&mut self.inner, clone);
        let first = BoxErrorFuture::new(ready.call(request.clone()));
        ResponseFuture {
            inner: RetryFuture::new(shared, ServiceAttempts::new(ready, request), Some(first)),
        }
    }
}

type Engine<S, Req, P> = RetryFuture<Arc<Shared<P>>, ServiceAttempts<S, Req>>;

pin_project! {
    /// The response future of a [`RetryService`].
    pub struct ResponseFuture<S, Req, P>
    where
        S: Service<Req>,
        S::Error: Into<BoxError>,
        Req: Clone,
    {
        #[pin]
        inner: Engine<S, Req, P>,
    }
}

impl<S, Req, P> Future for ResponseFuture<S, Req, P>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    Req: Clone,
    P: RetryPolicy<S::Response, BoxError>,
{
    type Output = Result<S::Response, BoxError>;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.project()
            .inner
            .poll(cx)
            .map_err(keel_core::PolicyError::into_box_error)
    }
}

impl<S, Req, P> fmt::Debug for ResponseFuture<S, Req, P>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    Req: Clone,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("retry::ResponseFuture")
    }
}
