//! What the history keeps: subjects (a consumer group, a dependency, the
//! outbox, the order), each with a fixed list of measures, and the rings
//! their points go into.

use std::collections::VecDeque;

use serde::Serialize;

/// What a history row is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SubjectKind {
    /// A consumer group (the `group` label of the consumer's metrics).
    ConsumerGroup,
    /// A dependency called through a breaker or `keel-client` (the
    /// `dependency` or breaker `name` label).
    Dependency,
    /// The transactional outbox.
    Outbox,
    /// The order, from intake to settled (the reference shop's
    /// `keel_order_critical_seconds`).
    Order,
}

impl SubjectKind {
    /// Every kind, in the order the console shows them.
    pub const ALL: [SubjectKind; 4] = [
        Self::ConsumerGroup,
        Self::Dependency,
        Self::Outbox,
        Self::Order,
    ];

    /// The measures a subject of this kind has, in the order of its
    /// points' values.
    pub fn measures(self) -> &'static [Measure] {
        use Measure::*;
        match self {
            Self::ConsumerGroup => &[
                Throughput,
                Lag,
                InFlight,
                ProcessingP50,
                ProcessingP99,
                Retries,
                DeadLetters,
            ],
            Self::Dependency => &[
                Calls,
                Failures,
                LatencyP50,
                LatencyP99,
                Refused,
                BreakerState,
                Transitions,
            ],
            Self::Outbox => &[Unpublished, OldestAge, Published],
            Self::Order => &[Settled, CriticalP50, CriticalP99],
        }
    }

    /// The stable name used in URLs and JSON (`consumer_group`, ...).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ConsumerGroup => "consumer_group",
            Self::Dependency => "dependency",
            Self::Outbox => "outbox",
            Self::Order => "order",
        }
    }

    /// The kind named `name` (see [`as_str`](Self::as_str)).
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == name)
    }

    /// Where `measure` sits in this kind's points, if it has it.
    pub fn index_of(self, measure: Measure) -> Option<usize> {
        self.measures().iter().position(|m| *m == measure)
    }
}

/// One measure of a subject, per interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Measure {
    /// Messages handled per second.
    Throughput,
    /// Unfinished messages (the last reading in the interval).
    Lag,
    /// Messages being handled right now.
    InFlight,
    /// Median handler time, seconds.
    ProcessingP50,
    /// 99th-percentile handler time, seconds.
    ProcessingP99,
    /// Deliveries retried in the interval.
    Retries,
    /// Messages dead-lettered in the interval.
    DeadLetters,
    /// Calls per second.
    Calls,
    /// Failed calls per second.
    Failures,
    /// Median call time, seconds.
    LatencyP50,
    /// 99th-percentile call time, seconds.
    LatencyP99,
    /// Calls refused by an open breaker in the interval.
    Refused,
    /// The breaker's worst state in the interval: 0 closed, 1 half-open,
    /// 2 open (forced open counts as open, disabled as closed).
    BreakerState,
    /// Breaker state changes in the interval.
    Transitions,
    /// Outbox rows not yet published.
    Unpublished,
    /// Age of the oldest unpublished outbox row, seconds.
    OldestAge,
    /// Outbox rows published per second.
    Published,
    /// Orders settled per second.
    Settled,
    /// Median time from intake to settled, seconds.
    CriticalP50,
    /// 99th-percentile time from intake to settled, seconds.
    CriticalP99,
}

impl Measure {
    /// The stable name used in JSON (`throughput`, `lag`, ...).
    pub fn as_str(self) -> &'static str {
        use Measure::*;
        match self {
            Throughput => "throughput",
            Lag => "lag",
            InFlight => "in_flight",
            ProcessingP50 => "processing_p50",
            ProcessingP99 => "processing_p99",
            Retries => "retries",
            DeadLetters => "dead_letters",
            Calls => "calls",
            Failures => "failures",
            LatencyP50 => "latency_p50",
            LatencyP99 => "latency_p99",
            Refused => "refused",
            BreakerState => "breaker_state",
            Transitions => "transitions",
            Unpublished => "unpublished",
            OldestAge => "oldest_age",
            Published => "published",
            Settled => "settled",
            CriticalP50 => "critical_p50",
            CriticalP99 => "critical_p99",
        }
    }

    /// A short label for graphs, with its unit.
    pub fn label(self) -> &'static str {
        use Measure::*;
        match self {
            Throughput => "handled/s",
            Lag => "lag",
            InFlight => "in flight",
            ProcessingP50 => "processing p50 (s)",
            ProcessingP99 => "processing p99 (s)",
            Retries => "retries",
            DeadLetters => "dead letters",
            Calls => "calls/s",
            Failures => "failures/s",
            LatencyP50 => "latency p50 (s)",
            LatencyP99 => "latency p99 (s)",
            Refused => "refused by breaker",
            BreakerState => "breaker",
            Transitions => "breaker transitions",
            Unpublished => "unpublished",
            OldestAge => "oldest unpublished (s)",
            Published => "published/s",
            Settled => "settled/s",
            CriticalP50 => "intake→settled p50 (s)",
            CriticalP99 => "intake→settled p99 (s)",
        }
    }

    /// How fine points merge into a coarse one: counts add up, a gauge or
    /// a tail percentile keeps its worst (so a short spike stays visible
    /// in the day's view), rates and medians average.
    pub(crate) fn merge(self) -> Merge {
        use Measure::*;
        match self {
            Retries | DeadLetters | Refused | Transitions => Merge::Sum,
            Lag | InFlight | ProcessingP99 | LatencyP99 | BreakerState | Unpublished
            | OldestAge | CriticalP99 => Merge::Max,
            Throughput | ProcessingP50 | Calls | Failures | LatencyP50 | Published | Settled
            | CriticalP50 => Merge::Mean,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Merge {
    Sum,
    Max,
    Mean,
}

/// One sample of a subject: when, and a value per measure of its kind
/// (`NaN` where the interval had nothing to say, e.g. no call to take a
/// percentile of).
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    /// Unix milliseconds at the end of the interval.
    pub at_ms: u64,
    /// One value per [`SubjectKind::measures`].
    pub values: Box<[f64]>,
}

/// The newest `capacity` points, oldest first.
#[derive(Debug, Clone)]
pub(crate) struct Ring {
    points: VecDeque<Point>,
    capacity: usize,
}

impl Ring {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            points: VecDeque::with_capacity(capacity),
            capacity,
        }
    }

    pub(crate) fn push(&mut self, point: Point) {
        if self.points.len() == self.capacity {
            self.points.pop_front();
        }
        self.points.push_back(point);
    }

    pub(crate) fn points(&self) -> impl ExactSizeIterator<Item = &Point> {
        self.points.iter()
    }

    pub(crate) fn len(&self) -> usize {
        self.points.len()
    }
}

/// Merges fine points into one coarse point, measure by measure.
pub(crate) fn merge(kind: SubjectKind, points: &[Point], at_ms: u64) -> Point {
    let values = kind
        .measures()
        .iter()
        .enumerate()
        .map(|(i, measure)| {
            let known = points.iter().map(|p| p.values[i]).filter(|v| !v.is_nan());
            let (count, folded) =
                known.fold((0usize, 0.0f64), |(n, acc), v| match measure.merge() {
                    Merge::Max if n > 0 => (n + 1, acc.max(v)),
                    _ => (n + 1, acc + v),
                });
            match (count, measure.merge()) {
                (0, _) => f64::NAN,
                (n, Merge::Mean) => folded / n as f64,
                _ => folded,
            }
        })
        .collect();
    Point { at_ms, values }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(at_ms: u64, values: &[f64]) -> Point {
        Point {
            at_ms,
            values: values.into(),
        }
    }

    #[test]
    fn a_ring_keeps_the_newest_points() {
        let mut ring = Ring::new(2);
        for at in 1..=3 {
            ring.push(point(at, &[0.0]));
        }
        let kept: Vec<u64> = ring.points().map(|p| p.at_ms).collect();
        assert_eq!(kept, [2, 3]);
    }

    #[test]
    fn merging_adds_counts_keeps_the_worst_gauge_and_averages_rates() {
        let nan = f64::NAN;
        // Throughput, lag, in flight, p50, p99, retries, dead letters.
        let fine = [
            point(5, &[10.0, 3.0, 1.0, 0.1, 0.5, 1.0, nan]),
            point(10, &[20.0, 9.0, 0.0, nan, 0.2, 2.0, nan]),
        ];
        let coarse = merge(SubjectKind::ConsumerGroup, &fine, 10);
        assert_eq!(coarse.at_ms, 10);
        assert_eq!(&coarse.values[..6], &[15.0, 9.0, 1.0, 0.1, 0.5, 3.0]);
        assert!(coarse.values[6].is_nan(), "nothing known stays unknown");
    }

    #[test]
    fn every_kind_names_its_measures_once() {
        for kind in SubjectKind::ALL {
            let mut names: Vec<_> = kind.measures().iter().map(|m| m.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            assert_eq!(names.len(), kind.measures().len());
            assert_eq!(SubjectKind::parse(kind.as_str()), Some(kind));
        }
    }
}
