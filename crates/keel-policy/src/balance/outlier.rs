//! Outlier detection: ejecting endpoints that keep failing, within a cap,
//! and taking them back when their time is up.

use std::sync::atomic::Ordering;
use std::time::Duration;

use keel_core::clock::Instant;

use super::Balancer;
use super::picked::Outcome;
use super::slot::Slot;

impl<E> Balancer<E> {
    /// Returns `slot` to the pool if it is still ejected until `until`
    /// (only one caller wins), and forgives its failures in a row.
    #[cold]
    pub(super) fn readmit(&self, slot: &Slot<E>, until: u64) {
        if !slot.readmit(until) {
            return;
        }
        let shared = &*self.shared;
        slot.succeed();
        slot.history().last_return = Some(shared.instant(until));
        let left = shared
            .ejected
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| n.checked_sub(1))
            .map_or(0, |n| n - 1);
        shared.ejected_gauge.set(left as f64);
        tracing::info!(balancer = %shared.name, position = slot.position, "endpoint returned to the pool");
    }

    /// Records a finished request against its endpoint.
    pub(crate) fn observe(&self, slot: &Slot<E>, outcome: Outcome, rtt: Duration, now: Instant) {
        let shared = &*self.shared;
        let now_ns = shared.nanos(now);
        match outcome {
            Outcome::Answered => {
                slot.observe(rtt, now_ns, shared.decay_ns, false);
                slot.succeed();
            }
            Outcome::Failed => {
                slot.observe(rtt, now_ns, shared.decay_ns, true);
                if slot.fail() >= shared.config.consecutive_failures {
                    self.try_eject(slot, now);
                }
            }
            Outcome::Cancelled => slot.observe(rtt, now_ns, shared.decay_ns, true),
            Outcome::NotSent => {}
        }
    }

    /// Ejects `slot` unless it is already out or the cap is reached.
    #[cold]
    fn try_eject(&self, slot: &Slot<E>, now: Instant) {
        let shared = &*self.shared;
        // During a wide outage every failure lands here; most can stop early.
        if shared.ejected.load(Ordering::Acquire) >= shared.max_ejected(self.len()) {
            return;
        }
        let _ejecting = shared.ejecting.lock();
        let now_ns = shared.nanos(now);
        let slots = shared.slots.read();
        let mut member = false;
        for other in slots.iter() {
            self.in_pool(other, now_ns);
            member |= std::ptr::eq(&**other, slot);
        }
        if !member || slot.ejected_until() != 0 {
            return;
        }
        let ejected = shared.ejected.load(Ordering::Acquire);
        let cap = shared.max_ejected(slots.len());
        if ejected >= cap {
            tracing::debug!(balancer = %shared.name, position = slot.position, cap, "not ejected: the ejection cap is reached");
            return;
        }
        let duration = self.ejection_time(slot, now);
        slot.eject(shared.nanos(now.checked_add(duration).unwrap_or(now)));
        let now_ejected = shared.ejected.fetch_add(1, Ordering::AcqRel) + 1;
        shared.ejections_total.increment(1);
        shared.ejected_gauge.set(now_ejected as f64);
        tracing::warn!(
            balancer = %shared.name,
            position = slot.position,
            ?duration,
            consecutive_failures = shared.config.consecutive_failures,
            "endpoint ejected"
        );
    }

    /// How long this ejection lasts: the base time for each ejection still
    /// on record, this one included, up to the maximum.
    fn ejection_time(&self, slot: &Slot<E>, now: Instant) -> Duration {
        let config = &self.shared.config;
        let mut history = slot.history();
        if let Some(back) = history.last_return {
            let healthy = now.saturating_duration_since(back).as_nanos();
            let forgiven = healthy / config.interval.as_nanos().max(1);
            let forgiven = u32::try_from(forgiven).unwrap_or(u32::MAX);
            history.times_ejected = history.times_ejected.saturating_sub(forgiven);
        }
        history.times_ejected = history.times_ejected.saturating_add(1);
        config
            .base_ejection_time
            .saturating_mul(history.times_ejected)
            .min(config.max_ejection_time)
    }
}
