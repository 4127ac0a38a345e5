//! The tower form of [`Fallback`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use keel_core::BoxError;
use keel_core::error::classify;
use pin_project_lite::pin_project;
use tower_layer::Layer;
use tower_service::Service;

use super::Fallback;

/// Answers the wrapped service's handled errors with a handler
/// `Fn(BoxError) -> Result<Response, BoxError>`.
///
/// Errors are classified with [`classify`], so boxed
/// [`Rejected`](keel_core::Rejected) refusals from layers below (breaker,
/// timeout, bulkhead) are recognised. The handler is synchronous: serve
/// something you already have (a cached value, a default), not another call.
pub struct FallbackLayer<H> {
    shared: Arc<Shared<H>>,
}

struct Shared<H> {
    policy: Fallback,
    handler: H,
}

impl<H> Clone for FallbackLayer<H> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<H> fmt::Debug for FallbackLayer<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FallbackLayer")
            .field("policy", &self.shared.policy)
            .finish_non_exhaustive()
    }
}

impl<H> FallbackLayer<H> {
    /// A layer answering `policy`'s handled errors with `handler`.
    pub fn new(policy: Fallback, handler: H) -> Self {
        Self {
            shared: Arc::new(Shared { policy, handler }),
        }
    }
}

impl<S, H> Layer<S> for FallbackLayer<H> {
    type Service = FallbackService<S, H>;

    fn layer(&self, inner: S) -> Self::Service {
        FallbackService {
            inner,
            shared: self.shared.clone(),
        }
    }
}

/// A service whose handled errors are replaced by a fallback; see
/// [`FallbackLayer`].
pub struct FallbackService<S, H> {
    inner: S,
    shared: Arc<Shared<H>>,
}

impl<S: Clone, H> Clone for FallbackService<S, H> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            shared: self.shared.clone(),
        }
    }
}

impl<S: fmt::Debug, H> fmt::Debug for FallbackService<S, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FallbackService")
            .field("inner", &self.inner)
            .field("policy", &self.shared.policy)
            .finish_non_exhaustive()
    }
}

impl<S, H> FallbackService<S, H> {
    /// Wraps `inner`, answering `policy`'s handled errors with `handler`.
    pub fn new(inner: S, policy: Fallback, handler: H) -> Self {
        FallbackLayer::new(policy, handler).layer(inner)
    }

    keel_core::inner_service_accessors!(inner: S);
}

impl<S, H, Req> Service<Req> for FallbackService<S, H>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    H: Fn(BoxError) -> Result<S::Response, BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, H>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        ResponseFuture {
            inner: self.inner.call(req),
            shared: self.shared.clone(),
        }
    }
}

pin_project! {
    /// The response future of a [`FallbackService`].
    pub struct ResponseFuture<F, H> {
        #[pin]
        inner: F,
        shared: Arc<Shared<H>>,
    }
}

impl<F, H, T, E> Future for ResponseFuture<F, H>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
    H: Fn(BoxError) -> Result<T, BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        Poll::Ready(match ready!(this.inner.poll(cx)) {
            Ok(response) => Ok(response),
            Err(err) => {
                let err = err.into();
                if this.shared.policy.should_serve(classify(err.as_ref())) {
                    (this.shared.handler)(err)
                } else {
                    Err(err)
                }
            }
        })
    }
}
