//! What the bulkhead and load shedding share: counted slots with a bounded
//! wait queue (`gate`), a slot held apart from any borrow ([`Slot`]), and
//! the tower service that takes a slot in `poll_ready` and holds it until
//! the response is in ([`SlotService`]). The two policies differ only in
//! how they refuse (a full bulkhead, an overloaded queue) and how long a
//! call may wait; that is the [`Admit`] they hand the service.
//!
//! Users meet these types as [`BulkheadService`](crate::bulkhead::BulkheadService)
//! and [`LoadShedService`](crate::shed::LoadShedService); a [`Slot`] can only
//! be taken through one of those policies.

pub(crate) mod gate;
mod service;

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use keel_core::{BoxError, Rejected};

use crate::admission::Permit;

pub use service::SlotService;

use gate::Gate;

/// Something that owns a [`Gate`] and outlives the slots taken from it.
pub(crate) trait Gated: Send + Sync + 'static {
    /// The gate slots are taken from.
    fn gate(&self) -> &Gate;
}

/// A slot held apart from any borrow (for tower services and keyed
/// compartments), freed when dropped.
pub struct Slot(Arc<dyn Gated>);

impl Slot {
    /// A slot of `holder`'s gate, which the caller has just entered.
    pub(crate) fn entered(holder: Arc<dyn Gated>) -> Self {
        Self(holder)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.gate().leave();
    }
}

/// A slot is freed as soon as its call's response is in.
impl Permit for Slot {
    fn release(self, _error: Option<&BoxError>) {}
}

/// The response future of a [`SlotService`]: the bulkhead's and load
/// shedding's.
pub type ResponseFuture<F> = crate::admission::ResponseFuture<F, Slot>;

impl fmt::Debug for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Slot").finish_non_exhaustive()
    }
}

/// A policy that admits calls into slots: the bulkhead, load shedding.
pub trait Admit: Clone + Send + Sync + 'static {
    /// A slot, if one is free now.
    fn try_enter_owned(&self) -> Option<Slot>;
    /// Whether a call may wait for a slot.
    fn can_queue(&self) -> bool;
    /// Waits for a slot, as long as the policy allows.
    fn enter_owned(self) -> impl Future<Output = Result<Slot, Rejected>> + Send + 'static;
    /// The refusal of a call that may neither enter nor wait.
    fn refuse(&self) -> Rejected;
}
