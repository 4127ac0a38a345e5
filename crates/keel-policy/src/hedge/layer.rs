//! The tower form of [`Hedge`]: [`HedgeLayer`] and [`HedgeService`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use keel_core::BoxError;
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use super::future::HedgeFuture;
use super::{Hedge, Shared};
use crate::retry::attempts::{BoxErrorFuture, ServiceAttempts};

/// Applies a [`Hedge`] to a service whose requests can be cloned.
pub struct HedgeLayer {
    hedge: Hedge,
}

impl HedgeLayer {
    /// A layer applying `hedge`; all services it wraps share its budget and
    /// latency window.
    pub fn new(hedge: Hedge) -> Self {
        Self { hedge }
    }
}

impl Clone for HedgeLayer {
    fn clone(&self) -> Self {
        Self {
            hedge: self.hedge.clone(),
        }
    }
}

impl fmt::Debug for HedgeLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HedgeLayer")
            .field("hedge", &self.hedge)
            .finish()
    }
}

impl<S> Layer<S> for HedgeLayer {
    type Service = HedgeService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        HedgeService {
            inner,
            hedge: self.hedge.clone(),
        }
    }
}

/// A service that sends a request again when its inner service is slow to
/// answer, as decided by a [`Hedge`], and returns the first success. Its
/// errors are the inner service's, boxed.
pub struct HedgeService<S> {
    inner: S,
    hedge: Hedge,
}

impl<S: Clone> Clone for HedgeService<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            hedge: self.hedge.clone(),
        }
    }
}

impl<S: fmt::Debug> fmt::Debug for HedgeService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HedgeService")
            .field("inner", &self.inner)
            .field("hedge", &self.hedge)
            .finish()
    }
}

impl<S> HedgeService<S> {
    /// Wraps `inner` with `hedge`.
    pub fn new(inner: S, hedge: Hedge) -> Self {
        Self { inner, hedge }
    }

    keel_core::inner_service_accessors!(inner: S);
}

impl<S, Req> Service<Req> for HedgeService<S>
where
    S: Service<Req> + Clone,
    S::Error: Into<BoxError>,
    Req: Clone,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S, Req>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Req) -> Self::Future {
        let shared = Arc::clone(self.hedge.shared());
        shared.record_request();
        // The ready service makes the first attempt; a clone (readied again
        // before each hedge) takes its place here.
        let clone = self.inner.clone();
        let mut ready = std::mem::replace(&mut self.inner, clone);
        let first = BoxErrorFuture::new(ready.call(request.clone()));
        let started = shared.start_clock();
        ResponseFuture {
            inner: HedgeFuture::started(
                shared,
                ServiceAttempts::new(ready, request),
                first,
                started,
            ),
        }
    }
}

type Engine<S, Req> = HedgeFuture<Arc<Shared>, ServiceAttempts<S, Req>>;

pin_project! {
    /// The response future of a [`HedgeService`].
    pub struct ResponseFuture<S, Req>
    where
        S: Service<Req>,
        S::Error: Into<BoxError>,
        Req: Clone,
    {
        #[pin]
        inner: Engine<S, Req>,
    }
}

impl<S, Req> Future for ResponseFuture<S, Req>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    Req: Clone,
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

impl<S, Req> fmt::Debug for ResponseFuture<S, Req>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    Req: Clone,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("hedge::ResponseFuture")
    }
}
