//! The bulkhead as tower middleware.

use std::hash::Hash;

use keel_core::Rejected;
use tower_layer::Layer;

use super::{Bulkhead, KeyedBulkhead};
use crate::admission::{AdmitCall, AdmitLayer, AdmitService, Keyed};
use crate::slots::{Slot, SlotService};

/// Applies a [`Bulkhead`] to a tower service. Every service it makes shares
/// the bulkhead's slots.
#[derive(Debug, Clone)]
pub struct BulkheadLayer {
    bulkhead: Bulkhead,
}

impl BulkheadLayer {
    /// A layer sharing `bulkhead`.
    pub fn new(bulkhead: Bulkhead) -> Self {
        Self { bulkhead }
    }
}

impl<S> Layer<S> for BulkheadLayer {
    type Service = BulkheadService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        BulkheadService::new(inner, self.bulkhead.clone())
    }
}

/// A tower service whose calls run in a [`Bulkhead`]'s slots.
///
/// The slot is taken in `poll_ready` (waiting there if the bulkhead allows
/// waiting), so a full bulkhead answers at once: `poll_ready` is ready and
/// the call fails with a boxed [`Rejected::BulkheadFull`](keel_core::Rejected::BulkheadFull).
pub type BulkheadService<S> = SlotService<S, Bulkhead>;

/// Applies a [`KeyedBulkhead`] to a tower service, with the key (tenant,
/// user, route) taken from each request by `key_of`.
///
/// The keyed services never wait: a request whose compartment is full is
/// refused at once with a boxed [`Rejected::BulkheadFull`](keel_core::Rejected::BulkheadFull), so a noisy
/// tenant gets fast `503`s instead of holding connections. (Waiting, if
/// configured, applies to [`KeyedBulkhead::call`].)
pub type KeyedBulkheadLayer<K, F> = AdmitLayer<Keyed<KeyedBulkhead<K>, F>>;

/// A tower service whose calls run in their key's compartment of a
/// [`KeyedBulkhead`]; see [`KeyedBulkheadLayer`].
pub type KeyedBulkheadService<S, K, F> = AdmitService<S, Keyed<KeyedBulkhead<K>, F>>;

impl<K, F> AdmitLayer<Keyed<KeyedBulkhead<K>, F>> {
    /// A layer giving each key `key_of(&request)` its compartment of
    /// `bulkhead`.
    pub fn new(bulkhead: KeyedBulkhead<K>, key_of: F) -> Self {
        Self::admitting(Keyed::new(bulkhead, key_of))
    }
}

impl<Req, K, F> AdmitCall<Req> for Keyed<KeyedBulkhead<K>, F>
where
    K: Hash + Eq + Clone,
    F: Fn(&Req) -> K + Clone,
{
    type Permit = Slot;

    fn admit(&self, req: &Req) -> Result<Slot, Rejected> {
        self.policy.try_enter_owned(&(self.key_of)(req))
    }
}
