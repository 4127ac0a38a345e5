//! The rate limiters as tower middleware.

use std::fmt;
use std::hash::Hash;
use std::task::{Context, Poll};

use keel_core::BoxError;
use tower_layer::Layer;
use tower_service::Service;

use super::{KeyedRateLimiter, RateLimiter, ResponseFuture};

/// Applies a [`RateLimiter`] to a tower service; every service it makes
/// shares the limit.
#[derive(Debug, Clone)]
pub struct RateLimitLayer {
    limiter: RateLimiter,
}

impl RateLimitLayer {
    /// A layer sharing `limiter`.
    pub fn new(limiter: RateLimiter) -> Self {
        Self { limiter }
    }
}

impl<S> Layer<S> for RateLimitLayer {
    type Service = RateLimitService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimitService {
            inner,
            limiter: self.limiter.clone(),
        }
    }
}

/// A tower service whose calls are refused with a boxed
/// [`Rejected::RateLimited`](keel_core::Rejected::RateLimited) beyond the
/// limit. Readiness is the inner service's; the limit is taken in `call`.
#[derive(Debug, Clone)]
pub struct RateLimitService<S> {
    inner: S,
    limiter: RateLimiter,
}

impl<S> RateLimitService<S> {
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

impl<S, Req> Service<Req> for RateLimitService<S>
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
        match self.limiter.check() {
            Ok(()) => ResponseFuture::allowed(self.inner.call(req)),
            Err(rejected) => ResponseFuture::refused(rejected),
        }
    }
}

/// Applies a [`KeyedRateLimiter`] to a tower service, with the key taken
/// from each request by `key_of`.
pub struct KeyedRateLimitLayer<K: Hash + Eq + Clone, F> {
    limiter: KeyedRateLimiter<K>,
    key_of: F,
}

impl<K: Hash + Eq + Clone, F> KeyedRateLimitLayer<K, F> {
    /// A layer limiting each key `key_of(&request)` with `limiter`.
    pub fn new(limiter: KeyedRateLimiter<K>, key_of: F) -> Self {
        Self { limiter, key_of }
    }
}

impl<K: Hash + Eq + Clone, F: Clone> Clone for KeyedRateLimitLayer<K, F> {
    fn clone(&self) -> Self {
        Self::new(self.limiter.clone(), self.key_of.clone())
    }
}

impl<K: Hash + Eq + Clone, F> fmt::Debug for KeyedRateLimitLayer<K, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedRateLimitLayer")
            .field("limiter", &self.limiter)
            .finish_non_exhaustive()
    }
}

impl<S, K: Hash + Eq + Clone, F: Clone> Layer<S> for KeyedRateLimitLayer<K, F> {
    type Service = KeyedRateLimitService<S, K, F>;

    fn layer(&self, inner: S) -> Self::Service {
        KeyedRateLimitService {
            inner,
            limiter: self.limiter.clone(),
            key_of: self.key_of.clone(),
        }
    }
}

/// A tower service limiting each request's key; refusals are boxed
/// [`Rejected::RateLimited`](keel_core::Rejected::RateLimited).
pub struct KeyedRateLimitService<S, K: Hash + Eq + Clone, F> {
    inner: S,
    limiter: KeyedRateLimiter<K>,
    key_of: F,
}

impl<S, K: Hash + Eq + Clone, F> KeyedRateLimitService<S, K, F> {
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

impl<S, K, F, Req> Service<Req> for KeyedRateLimitService<S, K, F>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    K: Hash + Eq + Clone,
    F: Fn(&Req) -> K,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        let key = (self.key_of)(&req);
        match self.limiter.check_key(&key) {
            Ok(()) => ResponseFuture::allowed(self.inner.call(req)),
            Err(rejected) => ResponseFuture::refused(rejected),
        }
    }
}

impl<S: Clone, K: Hash + Eq + Clone, F: Clone> Clone for KeyedRateLimitService<S, K, F> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            limiter: self.limiter.clone(),
            key_of: self.key_of.clone(),
        }
    }
}

impl<S: fmt::Debug, K: Hash + Eq + Clone, F> fmt::Debug for KeyedRateLimitService<S, K, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedRateLimitService")
            .field("inner", &self.inner)
            .field("limiter", &self.limiter)
            .finish_non_exhaustive()
    }
}
