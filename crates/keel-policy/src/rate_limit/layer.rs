//! The rate limiters as tower middleware.

use std::hash::Hash;

use keel_core::Rejected;

use super::{KeyedRateLimiter, RateLimiter};
use crate::admission::{AdmitCall, AdmitLayer, AdmitService, Keyed};

/// Applies a [`RateLimiter`] to a tower service; every service it makes
/// shares the limit.
pub type RateLimitLayer = AdmitLayer<RateLimiter>;

/// A tower service whose calls are refused with a boxed
/// [`Rejected::RateLimited`](keel_core::Rejected::RateLimited) beyond the
/// limit. Readiness is the inner service's; the limit is taken in `call`.
pub type RateLimitService<S> = AdmitService<S, RateLimiter>;

/// Applies a [`KeyedRateLimiter`] to a tower service, with the key taken
/// from each request by `key_of`.
pub type KeyedRateLimitLayer<K, F> = AdmitLayer<Keyed<KeyedRateLimiter<K>, F>>;

/// A tower service limiting each request's key; refusals are boxed
/// [`Rejected::RateLimited`](keel_core::Rejected::RateLimited).
pub type KeyedRateLimitService<S, K, F> = AdmitService<S, Keyed<KeyedRateLimiter<K>, F>>;

impl AdmitLayer<RateLimiter> {
    /// A layer sharing `limiter`.
    pub fn new(limiter: RateLimiter) -> Self {
        Self::admitting(limiter)
    }
}

impl<K: Hash + Eq + Clone, F> AdmitLayer<Keyed<KeyedRateLimiter<K>, F>> {
    /// A layer limiting each key `key_of(&request)` with `limiter`.
    pub fn new(limiter: KeyedRateLimiter<K>, key_of: F) -> Self {
        Self::admitting(Keyed::new(limiter, key_of))
    }
}

impl<Req> AdmitCall<Req> for RateLimiter {
    type Permit = ();

    fn admit(&self, _req: &Req) -> Result<(), Rejected> {
        self.check()
    }
}

impl<Req, K, F> AdmitCall<Req> for Keyed<KeyedRateLimiter<K>, F>
where
    K: Hash + Eq + Clone,
    F: Fn(&Req) -> K + Clone,
{
    type Permit = ();

    fn admit(&self, req: &Req) -> Result<(), Rejected> {
        self.policy.check_key(&(self.key_of)(req))
    }
}
