//! The adaptive limit as tower middleware.

use std::task::{Context, Poll};

use keel_core::BoxError;
use tower_layer::Layer;
use tower_service::Service;

use super::{AdaptiveLimit, ResponseFuture};

/// Applies an [`AdaptiveLimit`] to a tower service; every service it makes
/// shares the limit.
#[derive(Debug, Clone)]
pub struct AdaptiveLimitLayer {
    limit: AdaptiveLimit,
}

impl AdaptiveLimitLayer {
    /// A layer sharing `limit`.
    pub fn new(limit: AdaptiveLimit) -> Self {
        Self { limit }
    }
}

impl<S> Layer<S> for AdaptiveLimitLayer {
    type Service = AdaptiveLimitService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        AdaptiveLimitService {
            inner,
            limit: self.limit.clone(),
        }
    }
}

/// A tower service admitting calls up to an [`AdaptiveLimit`]; calls beyond
/// it fail at once with a boxed
/// [`Rejected::Overloaded`](keel_core::Rejected::Overloaded). Inner errors
/// are classified with [`keel_core::error::classify`] to decide whether
/// they count as drops.
#[derive(Debug, Clone)]
pub struct AdaptiveLimitService<S> {
    inner: S,
    limit: AdaptiveLimit,
}

impl<S> AdaptiveLimitService<S> {
    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, Req> Service<Req> for AdaptiveLimitService<S>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        match self.limit.enter_owned() {
            Ok(in_flight) => ResponseFuture::admitted(self.inner.call(req), in_flight),
            Err(rejected) => ResponseFuture::refused(rejected),
        }
    }
}
