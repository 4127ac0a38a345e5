//! The adaptive limit as tower middleware.

use keel_core::Rejected;

use super::{AdaptiveLimit, InFlightCall};
use crate::admission::{AdmitCall, AdmitLayer, AdmitService};

/// Applies an [`AdaptiveLimit`] to a tower service; every service it makes
/// shares the limit.
pub type AdaptiveLimitLayer = AdmitLayer<AdaptiveLimit>;

/// A tower service admitting calls up to an [`AdaptiveLimit`]; calls beyond
/// it fail at once with a boxed
/// [`Rejected::Overloaded`](keel_core::Rejected::Overloaded). Inner errors
/// are classified with [`keel_core::error::classify`] to decide whether
/// they count as drops.
pub type AdaptiveLimitService<S> = AdmitService<S, AdaptiveLimit>;

impl AdmitLayer<AdaptiveLimit> {
    /// A layer sharing `limit`.
    pub fn new(limit: AdaptiveLimit) -> Self {
        Self::admitting(limit)
    }
}

impl<Req> AdmitCall<Req> for AdaptiveLimit {
    type Permit = InFlightCall;

    fn admit(&self, _req: &Req) -> Result<InFlightCall, Rejected> {
        self.enter_owned()
    }
}
