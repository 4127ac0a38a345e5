//! A metrics recorder for assertions: every counter, gauge and histogram
//! sample a test's code emits, readable by name and labels.
//!
//! A key is the metric's name followed by `,label=value` for each label in
//! the order the code emits them: `keel_fallback_total,fallback=pricing,reason=rejected`.
//! Use it locally (`metrics::with_local_recorder(&recorder, || ...)`) for
//! what a constructor registers, or install it for the whole process with
//! [`MetricsRecorder::global`] for work done on other tasks; under nextest
//! every test is a process of its own, under `cargo test` they share it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use parking_lot::{Mutex, MutexGuard};

/// Counters and gauges by key, and every histogram sample. Cheap to
/// clone: clones share the values.
#[derive(Debug, Clone, Default)]
pub struct MetricsRecorder {
    cells: Arc<Mutex<HashMap<String, Arc<AtomicU64>>>>,
    histograms: Arc<Mutex<HashMap<String, Arc<Samples>>>>,
}

/// A histogram's samples, in the order they were recorded.
#[derive(Debug, Default)]
struct Samples(Mutex<Vec<f64>>);

impl metrics::HistogramFn for Samples {
    fn record(&self, value: f64) {
        self.0.lock().push(value);
    }
}

impl MetricsRecorder {
    /// An empty recorder.
    pub fn new() -> Self {
        Self::default()
    }

    /// The process-wide recorder, installed as the global one on first use.
    ///
    /// # Panics
    ///
    /// If another global recorder was installed first.
    pub fn global() -> &'static Self {
        static GLOBAL: OnceLock<MetricsRecorder> = OnceLock::new();
        GLOBAL.get_or_init(|| {
            let recorder = Self::new();
            metrics::set_global_recorder(recorder.clone())
                .expect("another global metrics recorder was installed first");
            recorder
        })
    }

    /// The counter under `key` (0 if it was never touched).
    pub fn counter(&self, key: &str) -> u64 {
        self.lock()
            .get(key)
            .map_or(0, |cell| cell.load(Ordering::SeqCst))
    }

    /// The sum of every counter of metric `name` with a label that starts
    /// with `label` (`key=value`, or a prefix of it: `range=link-local`
    /// matches `range=link-local (169.254.0.0/16)`), whatever its other
    /// labels.
    pub fn sum(&self, name: &str, label: &str) -> u64 {
        let carries = |key: &str| {
            key.strip_prefix(name)
                .and_then(|rest| rest.strip_prefix(','))
                .is_some_and(|labels| {
                    labels.starts_with(label) || labels.contains(&format!(",{label}"))
                })
        };
        self.lock()
            .iter()
            .filter(|(key, _)| carries(key))
            .map(|(_, cell)| cell.load(Ordering::SeqCst))
            .sum()
    }

    /// The gauge under `key` (0.0 if it was never set).
    pub fn gauge(&self, key: &str) -> f64 {
        f64::from_bits(self.counter(key))
    }

    /// Every sample recorded under histogram `key`, in order.
    pub fn samples(&self, key: &str) -> Vec<f64> {
        self.histograms
            .lock()
            .get(key)
            .map_or_else(Vec::new, |samples| samples.0.lock().clone())
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Arc<AtomicU64>>> {
        self.cells.lock()
    }

    fn cell(&self, key: &Key) -> Arc<AtomicU64> {
        self.lock().entry(key_name(key)).or_default().clone()
    }
}

/// `name,label=value,...` in the order the code emits the labels.
fn key_name(key: &Key) -> String {
    let mut name = key.name().to_owned();
    for label in key.labels() {
        name.push_str(&format!(",{}={}", label.key(), label.value()));
    }
    name
}

impl Recorder for MetricsRecorder {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        Counter::from_arc(self.cell(key))
    }

    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::from_arc(self.cell(key))
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        let samples = self
            .histograms
            .lock()
            .entry(key_name(key))
            .or_default()
            .clone();
        Histogram::from_arc(samples)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_gauges_are_read_by_name_and_labels() {
        let recorder = MetricsRecorder::new();
        metrics::with_local_recorder(&recorder, || {
            metrics::counter!("calls_total", "dependency" => "pricing").increment(2);
            metrics::counter!("calls_total", "dependency" => "pricing").increment(1);
            metrics::gauge!("limit").set(12.5);
            metrics::histogram!("latency_seconds", "dependency" => "pricing").record(0.25);
        });
        assert_eq!(
            recorder.samples("latency_seconds,dependency=pricing"),
            [0.25]
        );
        assert!(recorder.samples("latency_seconds").is_empty());
        assert_eq!(recorder.counter("calls_total,dependency=pricing"), 3);
        assert_eq!(recorder.counter("calls_total,dependency=other"), 0);
        assert_eq!(recorder.gauge("limit"), 12.5);
        assert_eq!(recorder.sum("calls_total", "dependency=pricing"), 3);
        assert_eq!(
            recorder.sum("calls_total", "dependency=pri"),
            3,
            "a prefix of the value"
        );
        assert_eq!(
            recorder.sum("calls", "dependency=pricing"),
            0,
            "names match whole"
        );
    }
}
