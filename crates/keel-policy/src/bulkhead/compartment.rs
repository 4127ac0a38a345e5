//! One bulkhead compartment: its slots, wait queue and counts.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use keel_core::{Deadline, Name, Rejected, clock};
use tokio::time::Instant;

use super::BulkheadStats;
use crate::slots::gate::{Gate, Shut};
use crate::slots::{Gated, Slot};

/// What every compartment of one bulkhead obeys, and where it reports.
#[derive(Debug)]
pub(super) struct Rules {
    pub(super) name: Name,
    pub(super) max_concurrent: usize,
    pub(super) max_waiting: usize,
    pub(super) max_wait: Duration,
    pub(super) rejected_total: metrics::Counter,
}

impl Rules {
    pub(super) fn new(name: Name, config: &super::BulkheadConfig) -> Self {
        let rejected_total =
            metrics::counter!("keel_bulkhead_rejected_total", "name" => name.as_str());
        Self {
            name,
            max_concurrent: config.max_concurrent,
            max_waiting: config.max_waiting,
            max_wait: config.max_wait,
            rejected_total,
        }
    }
}

/// Slots, the calls waiting for one, and the counts behind
/// [`BulkheadStats`].
#[derive(Debug)]
pub(super) struct Compartment {
    gate: Gate,
    accepted: AtomicU64,
    rejected: AtomicU64,
}

/// Why a call was refused.
#[derive(Debug, Clone, Copy)]
enum Refusal {
    QueueFull,
    WaitedTooLong,
    DeadlinePassed,
}

/// A slot borrowed from a compartment, freed when dropped.
#[derive(Debug)]
pub(super) struct Permit<'a>(&'a Compartment);

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        self.0.gate.leave();
    }
}

impl Gated for Compartment {
    fn gate(&self) -> &Gate {
        &self.gate
    }
}

impl Compartment {
    pub(super) fn new(rules: &Rules) -> Self {
        Self {
            gate: Gate::new(rules.max_concurrent, rules.max_waiting),
            accepted: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
        }
    }

    /// Takes a free slot if there is one, without waiting.
    #[inline]
    fn try_enter(&self) -> Option<Permit<'_>> {
        if !self.gate.try_enter() {
            return None;
        }
        self.accepted.fetch_add(1, Relaxed);
        Some(Permit(self))
    }

    /// Takes a slot, waiting in the bounded queue if the rules allow.
    #[inline]
    pub(super) async fn enter(&self, rules: &Rules) -> Result<Permit<'_>, Rejected> {
        match self.try_enter() {
            Some(permit) => Ok(permit),
            None => self.wait(rules).await,
        }
    }

    /// Like [`enter`](Self::enter), for a slot that outlives the borrow.
    pub(super) async fn enter_owned(self: Arc<Self>, rules: &Rules) -> Result<Slot, Rejected> {
        std::mem::forget(self.enter(rules).await?);
        Ok(Slot::entered(self))
    }

    /// Takes a free slot that outlives the borrow, without waiting.
    #[inline]
    pub(super) fn try_enter_owned(self: &Arc<Self>) -> Option<Slot> {
        std::mem::forget(self.try_enter()?);
        Some(Slot::entered(Arc::clone(self) as Arc<dyn Gated>))
    }

    /// Whether a call that found no free slot may wait for one.
    pub(super) fn can_queue(&self) -> bool {
        self.gate.can_wait()
    }

    async fn wait(&self, rules: &Rules) -> Result<Permit<'_>, Rejected> {
        if !self.gate.can_wait() {
            return Err(self.refuse(rules, Refusal::QueueFull));
        }
        let (until, refusal) = wait_bound(rules.max_wait);
        match self.gate.wait(until).await {
            Ok(()) => {
                self.accepted.fetch_add(1, Relaxed);
                Ok(Permit(self))
            }
            Err(Shut::QueueFull) => Err(self.refuse(rules, Refusal::QueueFull)),
            Err(Shut::TimedOut) => Err(self.refuse(rules, refusal)),
        }
    }

    /// Counts and reports a refusal of a call that found the bulkhead full.
    pub(super) fn refuse_full(&self, rules: &Rules) -> Rejected {
        self.refuse(rules, Refusal::QueueFull)
    }

    fn refuse(&self, rules: &Rules, refusal: Refusal) -> Rejected {
        self.rejected.fetch_add(1, Relaxed);
        rules.rejected_total.increment(1);
        tracing::debug!(bulkhead = %rules.name, reason = ?refusal, "bulkhead refused a call");
        match refusal {
            Refusal::DeadlinePassed => Rejected::DeadlineExceeded,
            Refusal::QueueFull | Refusal::WaitedTooLong => {
                Rejected::BulkheadFull { name: rules.name }
            }
        }
    }

    /// Whether no call holds or waits for a slot here, and none can start
    /// to: the caller holds the only handle.
    pub(super) fn is_idle(self: &Arc<Self>) -> bool {
        Arc::strong_count(self) == 1
    }

    pub(super) fn stats(&self, max_concurrent: usize) -> BulkheadStats {
        let accepted = self.accepted.load(Relaxed);
        let rejected = self.rejected.load(Relaxed);
        let waiting = self.gate.waiting();
        let active = self.gate.active().min(max_concurrent);
        BulkheadStats {
            total: accepted + rejected + waiting as u64,
            accepted,
            rejected,
            active,
            available: max_concurrent - active,
            waiting,
        }
    }
}

/// The instant a waiting call gives up, and what it is told: the bulkhead's
/// own `max_wait`, or the caller's deadline if that comes first.
fn wait_bound(max_wait: Duration) -> (Instant, Refusal) {
    let now = clock::now();
    let own = now
        .checked_add(max_wait)
        .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365));
    match Deadline::current() {
        Some(deadline) if deadline.instant() < own => (deadline.instant(), Refusal::DeadlinePassed),
        _ => (own, Refusal::WaitedTooLong),
    }
}
