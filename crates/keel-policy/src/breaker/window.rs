//! The sliding windows that failure and slow-call rates are computed over.
//!
//! The count-based window takes no lock: a ring of one-byte slots, a cursor
//! bumped with `fetch_add`, and counters kept equal to the slots' contents
//! because every slot change is a `swap` whose difference is then applied to
//! them. Concurrent recorders (and a concurrent clear) can therefore make a
//! counter lag for a moment, never drift. A success landing on a success is
//! not even written, and a success into a full window of successes does not
//! even turn the ring, so a healthy dependency's calls record with loads only.
//! The slot index is a multiply-based remainder ([`FastRem`]): a hardware
//! divide would cost more than the rest of the call. The `u32` cursor wraps
//! after 2³² calls; the slots written around the wrap are then not exactly
//! the last N for one turn of the ring, which no rate notices.
//!
//! The time-based window aggregates per second under a short lock: expiring
//! a second and counting into the current one must be seen together.

use std::sync::atomic::{AtomicI64, AtomicU8, AtomicU32, Ordering::*};

use parking_lot::Mutex;

use super::SlidingWindow;

const OCCUPIED: u8 = 1;
const FAILED: u8 = 2;
const SLOW: u8 = 4;

/// One recorded call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Sample {
    pub(super) failed: bool,
    pub(super) slow: bool,
}

impl Sample {
    fn bits(self) -> u8 {
        OCCUPIED | if self.failed { FAILED } else { 0 } | if self.slow { SLOW } else { 0 }
    }
}

/// The window's calls, failures and slow calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Tally {
    pub(super) calls: u64,
    pub(super) failures: u64,
    pub(super) slow: u64,
}

impl Tally {
    fn add(&mut self, sample: Sample) {
        self.calls += 1;
        self.failures += u64::from(sample.failed);
        self.slow += u64::from(sample.slow);
    }

    fn subtract(&mut self, other: Tally) {
        self.calls = self.calls.saturating_sub(other.calls);
        self.failures = self.failures.saturating_sub(other.failures);
        self.slow = self.slow.saturating_sub(other.slow);
    }
}

#[derive(Debug)]
pub(super) enum Window {
    Count(CountWindow),
    Time(TimeWindow),
    Off,
}

impl Window {
    pub(super) fn new(kind: SlidingWindow) -> Self {
        match kind {
            SlidingWindow::Count { size } => Self::Count(CountWindow::new(size)),
            SlidingWindow::Time { seconds } => Self::Time(TimeWindow::new(seconds)),
            SlidingWindow::Off => Self::Off,
        }
    }

    pub(super) fn is_timed(&self) -> bool {
        matches!(self, Self::Time(_))
    }

    /// Records a call; returns the window's tally when the rates may have
    /// risen (so that the caller evaluates them), `None` when they cannot.
    #[inline]
    pub(super) fn record(&self, sample: Sample, now_secs: u64) -> Option<Tally> {
        match self {
            Self::Count(w) => w.record(sample).then(|| w.tally()),
            Self::Time(w) => Some(w.record(sample, now_secs)),
            Self::Off => None,
        }
    }

    /// Whether the window holds nothing but successes, to its capacity (a
    /// time window always counts, so never).
    #[inline]
    pub(super) fn all_succeeded(&self) -> bool {
        match self {
            Self::Count(w) => w.all_succeeded(),
            Self::Time(_) => false,
            Self::Off => true,
        }
    }

    pub(super) fn tally(&self, now_secs: u64) -> Tally {
        match self {
            Self::Count(w) => w.tally(),
            Self::Time(w) => w.tally(now_secs),
            Self::Off => Tally::default(),
        }
    }

    pub(super) fn clear(&self) {
        match self {
            Self::Count(w) => w.clear(),
            Self::Time(w) => w.clear(),
            Self::Off => {}
        }
    }
}

/// Keeps a value alone on its cache line(s), so that writes to it do not
/// slow down readers of its neighbours.
#[derive(Debug, Default)]
#[repr(align(128))]
pub(super) struct CachePadded<T>(pub(super) T);

#[derive(Debug)]
pub(super) struct CountWindow {
    cursor: CachePadded<AtomicU32>,
    slots: Box<[AtomicU8]>,
    rem: FastRem,
    occupied: AtomicI64,
    failed: AtomicI64,
    slow: AtomicI64,
}

impl CountWindow {
    fn new(size: u32) -> Self {
        Self {
            cursor: CachePadded(AtomicU32::new(0)),
            slots: (0..size.max(1)).map(|_| AtomicU8::new(0)).collect(),
            rem: FastRem::new(size.max(1)),
            occupied: AtomicI64::new(0),
            failed: AtomicI64::new(0),
            slow: AtomicI64::new(0),
        }
    }

    /// Returns whether the rates may have risen: the call failed or was
    /// slow, or it filled an empty slot (the window is still filling).
    #[inline]
    fn record(&self, sample: Sample) -> bool {
        if sample.bits() == OCCUPIED && self.all_succeeded() {
            return false;
        }
        let seq = self.cursor.0.fetch_add(1, Relaxed);
        let Some(slot) = self.slot(seq) else {
            return false;
        };
        let new = sample.bits();
        // Rewriting an identical byte would only bounce the cache line.
        let old = match slot.load(Relaxed) {
            same if same == new => same,
            _ => slot.swap(new, AcqRel),
        };
        self.apply(old, new);
        old & OCCUPIED == 0 || new & (FAILED | SLOW) != 0
    }

    /// A full window of plain successes looks the same however far the
    /// ring has turned, so another success need not turn it: the healthy
    /// steady state records with loads only, and callers on many threads do
    /// not fight over the cursor's cache line.
    #[inline]
    fn all_succeeded(&self) -> bool {
        self.failed.load(Relaxed) == 0
            && self.slow.load(Relaxed) == 0
            && self.occupied.load(Relaxed) == self.slots.len() as i64
    }

    #[inline]
    fn slot(&self, seq: u32) -> Option<&AtomicU8> {
        self.slots.get(self.rem.of(seq) as usize)
    }

    #[inline]
    fn apply(&self, old: u8, new: u8) {
        for (bit, counter) in [
            (OCCUPIED, &self.occupied),
            (FAILED, &self.failed),
            (SLOW, &self.slow),
        ] {
            let delta = i64::from(new & bit != 0) - i64::from(old & bit != 0);
            if delta != 0 {
                counter.fetch_add(delta, AcqRel);
            }
        }
    }

    fn tally(&self) -> Tally {
        let len = self.slots.len() as u64;
        let read = |c: &AtomicI64| u64::try_from(c.load(Acquire)).unwrap_or(0).min(len);
        Tally {
            calls: read(&self.occupied),
            failures: read(&self.failed),
            slow: read(&self.slow),
        }
    }

    fn clear(&self) {
        for slot in self.slots.iter() {
            let old = slot.swap(0, AcqRel);
            self.apply(old, 0);
        }
        self.cursor.0.store(0, Relaxed);
    }
}

/// `n % divisor` by multiplication (Lemire, Kaser and Kurz, "Faster
/// remainder by direct computation", 2019); exact for every `u32`.
#[derive(Debug, Clone, Copy)]
pub(super) struct FastRem {
    divisor: u64,
    magic: u64,
}

impl FastRem {
    pub(super) fn new(divisor: u32) -> Self {
        let divisor = u64::from(divisor.max(1));
        Self {
            divisor,
            magic: (u64::MAX / divisor).wrapping_add(1),
        }
    }

    #[inline]
    pub(super) fn of(self, n: u32) -> u32 {
        let fraction = self.magic.wrapping_mul(u64::from(n));
        ((u128::from(fraction) * u128::from(self.divisor)) >> 64) as u32
    }
}

#[derive(Debug)]
pub(super) struct TimeWindow {
    buckets: Mutex<Buckets>,
}

#[derive(Debug)]
struct Buckets {
    per_second: Box<[Tally]>,
    newest_second: u64,
    total: Tally,
}

impl TimeWindow {
    fn new(seconds: u32) -> Self {
        let per_second = vec![Tally::default(); seconds.max(1) as usize].into_boxed_slice();
        Self {
            buckets: Mutex::new(Buckets {
                per_second,
                newest_second: 0,
                total: Tally::default(),
            }),
        }
    }

    fn record(&self, sample: Sample, now_secs: u64) -> Tally {
        let mut buckets = self.buckets.lock();
        buckets.advance(now_secs);
        let newest = buckets.newest_second;
        if let Some(bucket) = buckets.bucket(newest) {
            bucket.add(sample);
        }
        buckets.total.add(sample);
        buckets.total
    }

    fn tally(&self, now_secs: u64) -> Tally {
        let mut buckets = self.buckets.lock();
        buckets.advance(now_secs);
        buckets.total
    }

    fn clear(&self) {
        let mut buckets = self.buckets.lock();
        buckets.per_second.fill(Tally::default());
        buckets.total = Tally::default();
    }
}

impl Buckets {
    fn bucket(&mut self, second: u64) -> Option<&mut Tally> {
        let len = self.per_second.len() as u64;
        let index = second.checked_rem(len)?;
        self.per_second.get_mut(index as usize)
    }

    /// Moves the window's end to `now_secs`, emptying the seconds that fell
    /// out of it. A caller that read the clock a moment before another one
    /// counts into the newest second instead of going back in time.
    fn advance(&mut self, now_secs: u64) {
        let len = self.per_second.len() as u64;
        let expired = now_secs.saturating_sub(self.newest_second).min(len);
        for second in now_secs - expired + 1..=now_secs {
            if let Some(bucket) = self.bucket(second) {
                let old = std::mem::take(bucket);
                self.total.subtract(old);
            }
        }
        self.newest_second = self.newest_second.max(now_secs);
    }
}
