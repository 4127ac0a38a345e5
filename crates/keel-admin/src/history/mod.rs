//! A short history of what changed: per consumer group, per dependency,
//! for the outbox and for the order as a whole, sampled from the process's
//! own metrics into bounded rings, in memory.
//!
//! During an incident the questions are about change: is the lag growing
//! or draining, when did the payments breaker open and how often has it
//! flapped, did processing time jump after the deploy. A scrape-based
//! dashboard answers them only where one is installed and reachable; this
//! history is part of the server, so the console, the admin API
//! (`GET /admin/api/history`) and `keel status --watch` show the same
//! picture anywhere the server runs.
//!
//! How it works:
//! - [`History::recorder`] wraps the process's metrics recorder (the
//!   Prometheus exporter). It hands the few metrics the history reads a
//!   second, in-process copy and passes every other metric through
//!   untouched.
//! - [`History::run`] samples the copies every interval (5 s by default):
//!   counters become per-interval counts or rates, gauges their reading,
//!   histograms their count and exact p50/p99 over the interval's values
//!   (which are then dropped).
//! - Each subject keeps the newest 180 fine points (15 minutes at 5 s) and
//!   1,440 coarse points (24 hours at 1 minute). A coarse point merges its
//!   fine ones: counts add up, gauges and tail percentiles keep their worst
//!   (a short spike stays visible in the day's view), rates and medians
//!   average.
//! - A breaker's point holds the worst state it was in during the
//!   interval, read from its transition counters, so an open that lasted
//!   less than an interval still shows.
//!
//! Memory is bounded: at most [`DEFAULT_MAX_SUBJECTS`] subjects (their
//! names come from metric labels the application chose, never from client
//! input; past the bound a new subject is not kept and is counted), each
//! about 127 KiB at the defaults (measured by the crate's `history` benchmark).
//!
//! ```no_run
//! # async fn demo(store: keel_sqlite::store::SqliteStore) {
//! use keel_admin::Admin;
//! use keel_admin::history::History;
//!
//! let history = History::builder().build();
//! metrics::set_global_recorder(history.recorder(metrics::NoopRecorder)).ok();
//! tokio::spawn(history.clone().run(std::future::pending()));
//! let admin = Admin::builder(store).history(history).build();
//! # let _ = admin; }
//! ```

mod json;
mod sample;
mod series;
mod tap;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use metrics::Key;
use parking_lot::Mutex;

pub use json::{HistoryJson, HistoryQuery, SubjectJson};
pub use series::{Measure, Point, SubjectKind};
pub use tap::HistoryRecorder;

use series::Ring;

/// How often the history samples by default: every 5 seconds.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(5);

/// Fine points kept per subject by default: 180 (15 minutes at 5 s).
pub const DEFAULT_FINE_POINTS: usize = 180;

/// Fine points merged into one coarse point by default: 12 (1 minute).
pub const DEFAULT_COARSE_EVERY: usize = 12;

/// Coarse points kept per subject by default: 1,440 (24 hours at 1 min).
pub const DEFAULT_COARSE_POINTS: usize = 1440;

/// Subjects kept at most by default: 64.
pub const DEFAULT_MAX_SUBJECTS: usize = 64;

/// Which ring a query reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Resolution {
    /// Every sample (15 minutes at 5 s by default).
    #[default]
    Fine,
    /// Merged samples (24 hours at 1 minute by default).
    Coarse,
}

impl Resolution {
    /// `fine` or `coarse`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fine => "fine",
            Self::Coarse => "coarse",
        }
    }
}

/// Builds a [`History`]; every setting has the default named by its
/// constant.
#[derive(Debug, Clone)]
pub struct HistoryBuilder {
    interval: Duration,
    fine_points: usize,
    coarse_every: usize,
    coarse_points: usize,
    max_subjects: usize,
}

impl Default for HistoryBuilder {
    fn default() -> Self {
        Self {
            interval: DEFAULT_INTERVAL,
            fine_points: DEFAULT_FINE_POINTS,
            coarse_every: DEFAULT_COARSE_EVERY,
            coarse_points: DEFAULT_COARSE_POINTS,
            max_subjects: DEFAULT_MAX_SUBJECTS,
        }
    }
}

impl HistoryBuilder {
    /// How often to sample (at least 100 ms).
    pub fn interval(mut self, every: Duration) -> Self {
        self.interval = every.max(Duration::from_millis(100));
        self
    }

    /// Fine points kept per subject (at least 2).
    pub fn fine_points(mut self, points: usize) -> Self {
        self.fine_points = points.max(2);
        self
    }

    /// Fine points merged into one coarse point (at least 1).
    pub fn coarse_every(mut self, fine_points: usize) -> Self {
        self.coarse_every = fine_points.max(1);
        self
    }

    /// Coarse points kept per subject (at least 2).
    pub fn coarse_points(mut self, points: usize) -> Self {
        self.coarse_points = points.max(2);
        self
    }

    /// Subjects kept at most (at least 1).
    pub fn max_subjects(mut self, subjects: usize) -> Self {
        self.max_subjects = subjects.max(1);
        self
    }

    /// The history, empty until its [`run`](History::run) samples.
    pub fn build(self) -> History {
        History {
            inner: Arc::new(Inner {
                copies: Arc::new(metrics_util::registry::Registry::atomic()),
                config: self,
                state: Mutex::default(),
            }),
        }
    }
}

/// The server's short history; see the [module docs](self). Cheap to
/// clone: clones share the rings.
#[derive(Clone)]
pub struct History {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for History {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("History")
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

struct Inner {
    copies: tap::Copies,
    config: HistoryBuilder,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    subjects: BTreeMap<(SubjectKind, String), Track>,
    counters: HashMap<Key, u64>,
    samples: u64,
    /// Subjects of the latest sample not kept, past the bound.
    dropped_subjects: u64,
}

/// One subject's rings, and the fine points not yet merged.
struct Track {
    fine: Ring,
    coarse: Ring,
    pending: Vec<Point>,
}

impl History {
    /// A builder with the defaults.
    pub fn builder() -> HistoryBuilder {
        HistoryBuilder::default()
    }

    /// `inner` (the process's exporter), with a copy of the metrics this
    /// history reads kept for it. Install the result as the global
    /// recorder before any metric handle is made: handles made earlier go
    /// elsewhere and are never seen. Run the sampler ([`run`](Self::run))
    /// beside it: only a sample drains the histogram values the copies
    /// collect.
    pub fn recorder<R: metrics::Recorder>(&self, inner: R) -> HistoryRecorder<R> {
        HistoryRecorder::new(inner, Arc::clone(&self.inner.copies))
    }

    /// The sampling interval.
    pub fn interval(&self) -> Duration {
        self.inner.config.interval
    }

    /// How far back a full ring at `resolution` reaches (15 minutes and
    /// 24 hours at the defaults).
    pub fn span(&self, resolution: Resolution) -> Duration {
        let c = &self.inner.config;
        match resolution {
            Resolution::Fine => c.interval * c.fine_points as u32,
            Resolution::Coarse => c.interval * (c.coarse_every * c.coarse_points) as u32,
        }
    }

    /// Samples every interval until `shutdown` completes.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) {
        let every = self.inner.config.interval;
        keel_core::clock::every(every, shutdown, || {
            self.sample_now();
            std::future::ready(())
        })
        .await;
    }

    /// Takes one sample now (what [`run`](Self::run) does every interval).
    pub fn sample_now(&self) {
        let at_ms = keel_core::clock::unix_millis();
        self.sample_at(at_ms);
    }

    fn sample_at(&self, at_ms: u64) {
        let config = &self.inner.config;
        let mut state = self.inner.state.lock();
        let readings = sample::read(
            &self.inner.copies,
            &mut state.counters,
            config.interval.as_secs_f64(),
        );
        state.samples += 1;
        let merge_now = state.samples.is_multiple_of(config.coarse_every as u64);
        let mut dropped = 0;
        for ((kind, name), values) in readings {
            let key = (kind, name);
            if !state.subjects.contains_key(&key) {
                if state.subjects.len() >= config.max_subjects {
                    dropped += 1;
                    continue;
                }
                state.subjects.insert(
                    key.clone(),
                    Track {
                        fine: Ring::new(config.fine_points),
                        coarse: Ring::new(config.coarse_points),
                        pending: Vec::with_capacity(config.coarse_every),
                    },
                );
            }
            let Some(track) = state.subjects.get_mut(&key) else {
                continue;
            };
            let point = Point { at_ms, values };
            track.fine.push(point.clone());
            track.pending.push(point);
            if merge_now {
                let merged = series::merge(kind, &track.pending, at_ms);
                track.coarse.push(merged);
                track.pending.clear();
            }
        }
        state.dropped_subjects = dropped;
    }

    /// Every subject with its points at `resolution`, optionally only
    /// those of one kind and name.
    pub fn snapshot(&self, query: &HistoryQuery) -> HistoryJson {
        let state = self.inner.state.lock();
        let config = &self.inner.config;
        let interval = match query.resolution {
            Resolution::Fine => config.interval,
            Resolution::Coarse => config.interval * config.coarse_every as u32,
        };
        let subjects = state
            .subjects
            .iter()
            .filter(|((kind, name), _)| query.matches(*kind, name))
            .map(|((kind, name), track)| {
                let ring = match query.resolution {
                    Resolution::Fine => &track.fine,
                    Resolution::Coarse => &track.coarse,
                };
                SubjectJson::new(*kind, name, ring)
            })
            .collect();
        HistoryJson {
            resolution: query.resolution.as_str(),
            interval_seconds: interval.as_secs_f64(),
            subjects,
            dropped_subjects: state.dropped_subjects,
        }
    }

    /// One measure of one subject at fine resolution, oldest first (empty
    /// if the subject is unknown).
    pub fn series(&self, kind: SubjectKind, name: &str, measure: Measure) -> Vec<f64> {
        let Some(index) = kind.index_of(measure) else {
            return Vec::new();
        };
        let state = self.inner.state.lock();
        state
            .subjects
            .get(&(kind, name.to_owned()))
            .map(|t| t.fine.points().map(|p| p.values[index]).collect())
            .unwrap_or_default()
    }

    /// The names of the subjects of `kind`, sorted.
    pub fn names(&self, kind: SubjectKind) -> Vec<String> {
        let state = self.inner.state.lock();
        state
            .subjects
            .keys()
            .filter(|(k, _)| *k == kind)
            .map(|(_, name)| name.clone())
            .collect()
    }

    /// Bytes the rings hold now (points and their values), for the
    /// history's own cost.
    pub fn memory_bytes(&self) -> usize {
        let state = self.inner.state.lock();
        state
            .subjects
            .iter()
            .map(|((kind, name), track)| {
                let per_point =
                    std::mem::size_of::<Point>() + kind.measures().len() * size_of::<f64>();
                name.len() + per_point * (track.fine.len() + track.coarse.len())
            })
            .sum()
    }
}

#[cfg(test)]
mod tests;
