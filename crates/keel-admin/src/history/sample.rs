//! One sample: the copies of the tracked metrics turned into a value per
//! measure of every subject they name.

use std::collections::{BTreeMap, HashMap};

use metrics::Key;

use super::series::{Measure, SubjectKind};
use super::tap::{Copies, gauge_value};

type Subject = (SubjectKind, String);

/// What one subject's metrics said during the interval.
struct Reading {
    kind: SubjectKind,
    values: Vec<f64>,
    /// Histogram values, by the percentile measures they feed.
    durations: Vec<f64>,
    breaker: Option<f64>,
    was_open: u64,
    was_half_open: u64,
}

impl Reading {
    fn new(kind: SubjectKind) -> Self {
        Self {
            kind,
            values: vec![f64::NAN; kind.measures().len()],
            durations: Vec::new(),
            breaker: None,
            was_open: 0,
            was_half_open: 0,
        }
    }

    /// Adds `value` to `measure` (a measure with nothing yet starts at 0).
    fn add(&mut self, measure: Measure, value: f64) {
        if let Some(i) = self.kind.index_of(measure) {
            let slot = &mut self.values[i];
            *slot = if slot.is_nan() { value } else { *slot + value };
        }
    }

    fn max(&mut self, measure: Measure, value: f64) {
        if let Some(i) = self.kind.index_of(measure) {
            let slot = &mut self.values[i];
            *slot = if slot.is_nan() {
                value
            } else {
                slot.max(value)
            };
        }
    }

    /// The percentiles of the interval's durations, and the breaker's
    /// worst state.
    fn finish(mut self) -> Box<[f64]> {
        let (p50, p99) = match self.kind {
            SubjectKind::ConsumerGroup => (Measure::ProcessingP50, Measure::ProcessingP99),
            SubjectKind::Dependency => (Measure::LatencyP50, Measure::LatencyP99),
            SubjectKind::Order => (Measure::CriticalP50, Measure::CriticalP99),
            SubjectKind::Outbox => return self.values.into(),
        };
        if !self.durations.is_empty() {
            self.durations.sort_unstable_by(f64::total_cmp);
            let (median, tail) = (
                quantile(&self.durations, 0.5),
                quantile(&self.durations, 0.99),
            );
            self.max(p50, median);
            self.max(p99, tail);
        }
        if let Some(now) = self.breaker {
            let worst = if self.was_open > 0 {
                2.0
            } else if self.was_half_open > 0 {
                now.max(1.0)
            } else {
                now
            };
            self.max(Measure::BreakerState, worst);
        }
        self.values.into()
    }
}

/// The value at `q` of sorted `values` (nearest rank).
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Which subject a tracked metric's key belongs to.
fn subject_of(key: &Key) -> Option<Subject> {
    let label = |name: &str| {
        key.labels()
            .find(|l| l.key() == name)
            .map(|l| l.value().to_owned())
    };
    let name = key.name();
    if name.starts_with("keel_consumer_") {
        Some((SubjectKind::ConsumerGroup, label("group")?))
    } else if name.starts_with("keel_breaker_") {
        Some((SubjectKind::Dependency, label("name")?))
    } else if name == "keel_client_call_duration_seconds" {
        Some((SubjectKind::Dependency, label("dependency")?))
    } else if name.starts_with("keel_outbox_") {
        Some((SubjectKind::Outbox, "outbox".to_owned()))
    } else if name == "keel_order_critical_seconds" {
        Some((SubjectKind::Order, "orders".to_owned()))
    } else {
        None
    }
}

/// The breaker gauge's encoding (closed 0, open 1, half-open 2, forced
/// open 3, disabled 4) as the history's (closed 0, half-open 1, open 2).
fn breaker_level(gauge: f64) -> f64 {
    match gauge as u8 {
        1 | 3 => 2.0,
        2 => 1.0,
        _ => 0.0,
    }
}

/// Reads every copy once: counters as the change since the last read
/// (kept in `last`), gauges as they are, histograms drained.
pub(super) fn read(
    copies: &Copies,
    last: &mut HashMap<Key, u64>,
    interval_secs: f64,
) -> Vec<(Subject, Box<[f64]>)> {
    let mut readings: BTreeMap<Subject, Reading> = BTreeMap::new();
    copies.visit_counters(|key, total| {
        let total = total.load(std::sync::atomic::Ordering::Relaxed);
        let before = last.insert(key.clone(), total).unwrap_or(0);
        // A counter only shrinks when it was made again from zero.
        let delta = if total >= before {
            total - before
        } else {
            total
        };
        if let Some(r) = reading(&mut readings, key) {
            counter(r, key, delta, interval_secs);
        }
    });
    copies.visit_gauges(|key, value| {
        if let Some(r) = reading(&mut readings, key) {
            gauge(r, key.name(), gauge_value(value));
        }
    });
    let mut drained = Vec::new();
    copies.visit_histograms(|key, bucket| {
        if let Some(r) = reading(&mut readings, key) {
            drained.clear();
            bucket.clear_with(|values| drained.extend_from_slice(values));
            // An idle interval is a rate of 0, not an unknown one.
            histogram(r, key, &drained, interval_secs);
        }
    });
    readings
        .into_iter()
        .map(|(subject, r)| (subject, r.finish()))
        .collect()
}

/// The reading of the subject `key` belongs to, made on first use.
fn reading<'a>(readings: &'a mut BTreeMap<Subject, Reading>, key: &Key) -> Option<&'a mut Reading> {
    let subject = subject_of(key)?;
    let kind = subject.0;
    Some(
        readings
            .entry(subject)
            .or_insert_with(|| Reading::new(kind)),
    )
}

fn counter(r: &mut Reading, key: &Key, delta: u64, interval_secs: f64) {
    let n = delta as f64;
    match key.name() {
        "keel_consumer_retries_total" => r.add(Measure::Retries, n),
        "keel_consumer_dead_lettered_total" => r.add(Measure::DeadLetters, n),
        "keel_breaker_rejected_total" => r.add(Measure::Refused, n),
        "keel_outbox_published_total" => r.add(Measure::Published, n / interval_secs),
        "keel_breaker_transitions_total" => {
            r.add(Measure::Transitions, n);
            // A state the breaker entered, or left, during the interval is
            // one it was in during the interval.
            let state = |name: &str| key.labels().find(|l| l.key() == name).map(|l| l.value());
            for state in [state("from"), state("to")] {
                match state {
                    Some("open" | "forced_open") => r.was_open += delta,
                    Some("half_open") => r.was_half_open += delta,
                    _ => {}
                }
            }
        }
        _ => {}
    }
}

fn gauge(r: &mut Reading, name: &str, value: f64) {
    match name {
        "keel_consumer_lag" => r.add(Measure::Lag, value),
        "keel_consumer_in_flight" => r.add(Measure::InFlight, value.max(0.0)),
        "keel_outbox_unpublished" => r.add(Measure::Unpublished, value),
        "keel_outbox_lag_seconds" => r.max(Measure::OldestAge, value),
        "keel_breaker_state" => {
            let level = breaker_level(value);
            r.breaker = Some(r.breaker.map_or(level, |b| b.max(level)));
        }
        _ => {}
    }
}

fn histogram(r: &mut Reading, key: &Key, values: &[f64], interval_secs: f64) {
    let rate = values.len() as f64 / interval_secs;
    match key.name() {
        "keel_consumer_handler_seconds" => r.add(Measure::Throughput, rate),
        "keel_order_critical_seconds" => r.add(Measure::Settled, rate),
        "keel_client_call_duration_seconds" => {
            r.add(Measure::Calls, rate);
            let failed = key
                .labels()
                .any(|l| l.key() == "outcome" && l.value() != "ok");
            r.add(Measure::Failures, if failed { rate } else { 0.0 });
        }
        _ => return,
    }
    r.durations.extend_from_slice(values);
}
