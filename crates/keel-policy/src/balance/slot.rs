//! One endpoint's load and health, updated lock-free on the hot path.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use keel_core::clock::Instant;
use parking_lot::Mutex;

/// An endpoint and what the balancer knows about it.
///
/// The latency estimate is two atomics rather than one locked pair: two
/// completions racing on the same endpoint may lose one sample, which a
/// moving estimate shrugs off, and no pick ever waits for a lock.
#[derive(Debug)]
pub(crate) struct Slot<E> {
    pub(crate) endpoint: E,
    /// Where the endpoint was inserted; stable while nothing is removed.
    pub(crate) position: usize,
    in_flight: AtomicUsize,
    rtt_ns: AtomicU64,
    rtt_stamp: AtomicU64,
    consecutive_failures: AtomicU32,
    /// Clock nanos until which the endpoint is ejected; 0 while in the pool.
    ejected_until: AtomicU64,
    history: Mutex<History>,
}

/// Past ejections, for the growing ejection time.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct History {
    pub(crate) times_ejected: u32,
    pub(crate) last_return: Option<Instant>,
}

impl<E> Slot<E> {
    pub(crate) fn new(endpoint: E, position: usize, default_rtt: Duration, now_ns: u64) -> Self {
        Self {
            endpoint,
            position,
            in_flight: AtomicUsize::new(0),
            rtt_ns: AtomicU64::new(duration_ns(default_rtt).to_bits()),
            rtt_stamp: AtomicU64::new(now_ns),
            consecutive_failures: AtomicU32::new(0),
            ejected_until: AtomicU64::new(0),
            history: Mutex::new(History::default()),
        }
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::Relaxed)
    }

    pub(crate) fn start(&self) {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn finish(&self) {
        self.in_flight.fetch_sub(1, Ordering::Relaxed);
    }

    /// The latency estimate at `now_ns`, decayed towards zero since it was
    /// last updated so that an endpoint that was slow once is tried again.
    pub(crate) fn rtt_ns(&self, now_ns: u64, decay_ns: f64) -> f64 {
        let rtt = f64::from_bits(self.rtt_ns.load(Ordering::Relaxed));
        let stamp = self.rtt_stamp.load(Ordering::Relaxed);
        rtt * decay_weight(now_ns.saturating_sub(stamp), decay_ns)
    }

    /// Folds in a latency sample: a new peak is taken at once, a lower one
    /// moves the estimate by how long it has been since the last sample.
    ///
    /// With `peak_only` (failures, cancelled calls), a lower sample freezes
    /// the estimate where it was instead: an endpoint that fails fast must
    /// not look fast, or it would attract the traffic it then fails.
    pub(crate) fn observe(&self, rtt: Duration, now_ns: u64, decay_ns: f64, peak_only: bool) {
        let sample = duration_ns(rtt);
        let prior = f64::from_bits(self.rtt_ns.load(Ordering::Relaxed));
        let stamp = self.rtt_stamp.load(Ordering::Relaxed);
        let next = if sample > prior {
            sample
        } else if peak_only {
            prior
        } else {
            let weight = decay_weight(now_ns.saturating_sub(stamp), decay_ns);
            prior * weight + sample * (1.0 - weight)
        };
        self.rtt_ns.store(next.to_bits(), Ordering::Relaxed);
        self.rtt_stamp.store(now_ns, Ordering::Relaxed);
    }

    /// Counts a failure; returns the number in a row.
    pub(crate) fn fail(&self) -> u32 {
        self.consecutive_failures
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1)
    }

    pub(crate) fn succeed(&self) {
        if self.consecutive_failures.load(Ordering::Relaxed) != 0 {
            self.consecutive_failures.store(0, Ordering::Relaxed);
        }
    }

    pub(crate) fn consecutive_failures(&self) -> u32 {
        self.consecutive_failures.load(Ordering::Relaxed)
    }

    /// The nanos until which the endpoint is ejected, 0 if it is in the pool.
    pub(crate) fn ejected_until(&self) -> u64 {
        self.ejected_until.load(Ordering::Acquire)
    }

    /// Ejects until `until_ns` (at least 1). Only under the ejection lock.
    pub(crate) fn eject(&self, until_ns: u64) {
        self.consecutive_failures.store(0, Ordering::Relaxed);
        self.ejected_until.store(until_ns.max(1), Ordering::Release);
    }

    /// Returns the endpoint to the pool if it is still ejected until
    /// `until_ns`; true if this call did it (exactly one caller wins).
    pub(crate) fn readmit(&self, until_ns: u64) -> bool {
        until_ns != 0
            && self
                .ejected_until
                .compare_exchange(until_ns, 0, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
    }

    pub(crate) fn history(&self) -> parking_lot::MutexGuard<'_, History> {
        self.history.lock()
    }
}

/// How much of an estimate survives `elapsed_ns`: `e^(-elapsed/decay)`.
#[inline]
fn decay_weight(elapsed_ns: u64, decay_ns: f64) -> f64 {
    if elapsed_ns == 0 {
        return 1.0;
    }
    (-(elapsed_ns as f64) / decay_ns).exp()
}

fn duration_ns(d: Duration) -> f64 {
    d.as_nanos() as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    const DECAY: f64 = 10e9;

    fn slot() -> Slot<()> {
        Slot::new((), 0, Duration::from_millis(30), 0)
    }

    #[test]
    fn a_peak_is_taken_at_once_and_decays_later() {
        let s = slot();
        s.observe(Duration::from_millis(100), 1_000, DECAY, false);
        assert_eq!(s.rtt_ns(1_000, DECAY), 100e6);
        let later = 1_000 + 10_000_000_000;
        let decayed = s.rtt_ns(later, DECAY);
        assert!(
            (decayed - 100e6 / std::f64::consts::E).abs() < 1e3,
            "{decayed}"
        );
    }

    #[test]
    fn lower_samples_move_the_estimate_by_elapsed_time() {
        let s = slot();
        s.observe(Duration::from_millis(10), 5_000_000_000, DECAY, false);
        let rtt = s.rtt_ns(5_000_000_000, DECAY);
        assert!(rtt < 30e6 && rtt > 10e6, "{rtt}");
    }

    #[test]
    fn peak_only_samples_never_lower_the_estimate() {
        let s = slot();
        s.observe(Duration::from_millis(1), 5_000_000_000, DECAY, true);
        assert_eq!(s.rtt_ns(5_000_000_000, DECAY), 30e6, "frozen, not decayed");
        s.observe(Duration::from_millis(90), 5_000_000_000, DECAY, true);
        assert_eq!(s.rtt_ns(5_000_000_000, DECAY), 90e6);
    }

    #[test]
    fn only_one_readmission_wins() {
        let s = slot();
        s.eject(42);
        assert!(!s.readmit(41));
        assert!(s.readmit(42));
        assert!(!s.readmit(42));
        assert_eq!(s.ejected_until(), 0);
    }
}
