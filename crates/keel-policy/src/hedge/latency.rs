//! A percentile of recent successful latencies, read with one atomic load.
//!
//! Successes write into a fixed ring of samples (no allocation, no lock);
//! every quarter window the percentile is recomputed from a copy into a
//! scratch buffer allocated once, by whichever caller gets its lock first
//! (the others skip: a slightly stale delay is fine, a wait is not).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use parking_lot::Mutex;

pub(crate) struct LatencyWindow {
    samples: Box<[AtomicU64]>,
    recorded: AtomicU64,
    current_nanos: AtomicU64,
    scratch: Mutex<Vec<u64>>,
    quantile: f64,
    min_samples: u64,
    recompute_every: u64,
}

impl LatencyWindow {
    /// A window of `window` samples (at least 1) that reports the
    /// `percentile` (in (0, 100]) once it has `min_samples`, and `fallback` before.
    pub(crate) fn new(percentile: f64, window: u32, min_samples: u32, fallback: Duration) -> Self {
        let len = usize::try_from(window.max(1)).unwrap_or(1);
        Self {
            samples: (0..len).map(|_| AtomicU64::new(0)).collect(),
            recorded: AtomicU64::new(0),
            current_nanos: AtomicU64::new(nanos(fallback)),
            scratch: Mutex::new(Vec::with_capacity(len)),
            quantile: percentile / 100.0,
            min_samples: u64::from(min_samples.max(1)),
            recompute_every: u64::from((window / 4).max(1)),
        }
    }

    /// The current percentile, or the fallback until enough samples exist.
    #[inline]
    pub(crate) fn delay(&self) -> Duration {
        Duration::from_nanos(self.current_nanos.load(Ordering::Relaxed))
    }

    pub(crate) fn record(&self, latency: Duration) {
        let n = self.recorded.fetch_add(1, Ordering::Relaxed);
        let len = self.samples.len() as u64;
        if let Some(slot) = usize::try_from(n % len)
            .ok()
            .and_then(|i| self.samples.get(i))
        {
            slot.store(nanos(latency), Ordering::Relaxed);
        }
        let count = n + 1;
        if count == self.min_samples
            || (count > self.min_samples && count.is_multiple_of(self.recompute_every))
        {
            self.recompute(count);
        }
    }

    fn recompute(&self, count: u64) {
        let Some(mut scratch) = self.scratch.try_lock() else {
            return;
        };
        let filled = usize::try_from(count)
            .unwrap_or(usize::MAX)
            .min(self.samples.len());
        scratch.clear();
        scratch.extend(
            self.samples[..filled]
                .iter()
                .map(|s| s.load(Ordering::Relaxed)),
        );
        let rank = ((self.quantile * filled as f64).ceil() as usize).clamp(1, filled) - 1;
        let (_, value, _) = scratch.select_nth_unstable(rank);
        self.current_nanos.store(*value, Ordering::Relaxed);
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
