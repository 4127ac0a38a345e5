//! The tower layer and service.

use std::task::{Context, Poll};

use keel_core::BoxError;
use tower_layer::Layer;
use tower_service::Service;

use super::CircuitBreaker;
use super::future::ResponseFuture;

/// Puts a [`CircuitBreaker`] in front of a service.
#[derive(Debug, Clone)]
pub struct CircuitBreakerLayer {
    breaker: CircuitBreaker,
}

impl CircuitBreakerLayer {
    /// A layer sharing `breaker` (and its state) with every service it wraps.
    pub fn new(breaker: CircuitBreaker) -> Self {
        Self { breaker }
    }
}

impl<S> Layer<S> for CircuitBreakerLayer {
    type Service = CircuitBreakerService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CircuitBreakerService {
            inner,
            breaker: self.breaker.clone(),
        }
    }
}

/// A service guarded by a [`CircuitBreaker`].
///
/// `poll_ready` only asks the inner service: permission is taken in `call`,
/// which answers a refused request with a ready future failing with a boxed
/// [`Rejected::CircuitOpen`](keel_core::Rejected::CircuitOpen). Taking it in
/// `poll_ready` would hold a half-open probe slot for a request that may
/// never be made.
#[derive(Debug, Clone)]
pub struct CircuitBreakerService<S> {
    inner: S,
    breaker: CircuitBreaker,
}

impl<S> CircuitBreakerService<S> {
    /// Wraps `inner` with `breaker`.
    pub fn new(inner: S, breaker: CircuitBreaker) -> Self {
        Self { inner, breaker }
    }

    /// The breaker.
    pub fn breaker(&self) -> &CircuitBreaker {
        &self.breaker
    }

    /// The inner service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The inner service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S, Req> Service<Req> for CircuitBreakerService<S>
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

    fn call(&mut self, request: Req) -> Self::Future {
        match self.breaker.try_acquire_owned() {
            Ok(permit) => ResponseFuture::called(self.inner.call(request), permit),
            Err(rejected) => ResponseFuture::rejected(rejected),
        }
    }
}
