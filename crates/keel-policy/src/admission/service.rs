//! The tower layer and service of the policies that decide in `call`.

use std::task::{Context, Poll};

use keel_core::{BoxError, Rejected};
use tower_layer::Layer;
use tower_service::Service;

use super::{Permit, ResponseFuture};

/// A policy that admits or refuses each request as it is called, without
/// waiting: readiness stays the inner service's.
pub trait AdmitCall<Req>: Clone {
    /// What an admitted call holds while it runs.
    type Permit: Permit;

    /// Admits `req` now, or says why not.
    fn admit(&self, req: &Req) -> Result<Self::Permit, Rejected>;
}

/// Applies an [`AdmitCall`] policy to a tower service; every service it makes
/// shares the policy (its limits, counts and metrics).
#[derive(Debug, Clone)]
pub struct AdmitLayer<A> {
    policy: A,
}

impl<A> AdmitLayer<A> {
    /// A layer sharing `policy`.
    pub fn admitting(policy: A) -> Self {
        Self { policy }
    }
}

impl<S, A: Clone> Layer<S> for AdmitLayer<A> {
    type Service = AdmitService<S, A>;

    fn layer(&self, inner: S) -> Self::Service {
        AdmitService {
            inner,
            policy: self.policy.clone(),
        }
    }
}

/// A tower service whose calls are admitted by an [`AdmitCall`] policy;
/// refused calls fail at once with the policy's boxed [`Rejected`], and the
/// inner service's errors are boxed as they are.
#[derive(Debug, Clone)]
pub struct AdmitService<S, A> {
    inner: S,
    policy: A,
}

impl<S, A> AdmitService<S, A> {
    keel_core::inner_service_accessors!(inner: S);
}

impl<S, A, Req> Service<Req> for AdmitService<S, A>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    A: AdmitCall<Req>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future, A::Permit>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        match self.policy.admit(&req) {
            Ok(permit) => ResponseFuture::admitted(self.inner.call(req), permit),
            Err(rejected) => ResponseFuture::refused(rejected),
        }
    }
}

/// A keyed policy with the function that takes each request's key (tenant,
/// client address, route): the keyed rate limiter's and keyed bulkhead's
/// [`AdmitCall`].
#[cfg(any(feature = "bulkhead", feature = "rate-limit"))]
#[derive(Clone)]
pub struct Keyed<P, F> {
    pub(crate) policy: P,
    pub(crate) key_of: F,
}

#[cfg(any(feature = "bulkhead", feature = "rate-limit"))]
impl<P, F> Keyed<P, F> {
    /// `policy`, keyed by `key_of(&request)`.
    pub fn new(policy: P, key_of: F) -> Self {
        Self { policy, key_of }
    }
}

#[cfg(any(feature = "bulkhead", feature = "rate-limit"))]
impl<P: std::fmt::Debug, F> std::fmt::Debug for Keyed<P, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keyed")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}
