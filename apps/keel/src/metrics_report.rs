//! The process's metrics recorder, readable from inside: `/metrics` renders
//! it, the demo's report sums its counters, and the console's history
//! samples a copy of the few it graphs.
//!
//! The recorder must be installed before any policy is built: metric
//! handles created earlier go to the no-op recorder and are lost.

use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Duration;

use keel_admin::history::History;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

/// Request latency buckets, in seconds: histograms, not summaries, so
/// percentiles can be aggregated across processes and routes.
const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The latencies rendered as histograms: the edge's requests, and every
/// outgoing call by dependency (HTTP attempts and calls, attempts by subset)
/// and by gRPC method, the figures a timeout is sized from and a canary is
/// judged by.
const LATENCY_HISTOGRAMS: &[&str] = &[
    "keel_http_request_duration_seconds",
    "keel_client_attempt_duration_seconds",
    "keel_client_call_duration_seconds",
    "keel_client_subset_attempt_duration_seconds",
    "keel_grpc_client_duration_seconds",
];

/// What the process records its metrics into.
#[derive(Clone)]
struct Installed {
    prometheus: PrometheusHandle,
    history: Option<History>,
}

static INSTALLED: OnceLock<Option<Installed>> = OnceLock::new();

/// Installs the Prometheus recorder once per process and returns its
/// handle (`None` if another recorder was installed first).
pub fn install() -> Option<PrometheusHandle> {
    install_once(None)
}

/// Installs the recorder once per process, the Prometheus exporter wrapped
/// by the console's [`History`] sampling every `interval`, and returns the
/// Prometheus handle. The caller must run [`history`]'s sampler: the
/// copies it keeps are drained only by sampling. Whichever install comes
/// first wins.
pub fn install_with_history(interval: Duration) -> Option<PrometheusHandle> {
    install_once(Some(interval))
}

fn install_once(history_interval: Option<Duration>) -> Option<PrometheusHandle> {
    INSTALLED
        .get_or_init(|| {
            let mut builder = PrometheusBuilder::new();
            for metric in LATENCY_HISTOGRAMS {
                builder = builder
                    .set_buckets_for_metric(Matcher::Full((*metric).to_owned()), LATENCY_BUCKETS)
                    .ok()?;
            }
            let exporter = builder.build_recorder();
            let prometheus = exporter.handle();
            let history = match history_interval {
                Some(every) => {
                    let history = History::builder().interval(every).build();
                    metrics::set_global_recorder(history.recorder(exporter)).ok()?;
                    Some(history)
                }
                None => {
                    metrics::set_global_recorder(exporter).ok()?;
                    None
                }
            };
            Some(Installed {
                prometheus,
                history,
            })
        })
        .as_ref()
        .map(|i| i.prometheus.clone())
}

/// The history the recorder keeps (`None` unless installed by
/// [`install_with_history`]).
pub fn history() -> Option<History> {
    INSTALLED.get()?.as_ref()?.history.clone()
}

/// The Prometheus text exposition of every metric (empty without a
/// recorder).
pub fn render() -> String {
    install().map(|h| h.render()).unwrap_or_default()
}

/// Every sample of the rendered metrics: `(name, labels, value)`.
pub fn samples(text: &str) -> Vec<(String, String, f64)> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|line| {
            let (series, value) = line.rsplit_once(' ')?;
            let value: f64 = value.parse().ok()?;
            let (name, labels) = match series.split_once('{') {
                Some((n, rest)) => (n, rest.trim_end_matches('}')),
                None => (series, ""),
            };
            Some((name.to_owned(), labels.to_owned(), value))
        })
        .collect()
}

/// Counter totals by metric name, summed over labels, from a snapshot.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Totals(BTreeMap<String, f64>);

impl Totals {
    /// Reads the recorder now.
    pub fn now() -> Self {
        Self::from_text(&render())
    }

    /// Sums the samples of `text`.
    pub fn from_text(text: &str) -> Self {
        let mut totals = BTreeMap::new();
        for (name, _, value) in samples(text) {
            *totals.entry(name).or_insert(0.0) += value;
        }
        Self(totals)
    }

    /// The total of `name` (0 if never recorded).
    pub fn get(&self, name: &str) -> u64 {
        self.0.get(name).copied().unwrap_or(0.0).max(0.0) as u64
    }

    /// The total of `name` over samples whose labels contain `label`.
    pub fn with_label(text: &str, name: &str, label: &str) -> u64 {
        samples(text)
            .into_iter()
            .filter(|(n, l, _)| n == name && l.contains(label))
            .map(|(_, _, v)| v)
            .sum::<f64>()
            .max(0.0) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_counters_over_labels() {
        let text = "# TYPE keel_retry_attempts_total counter\n\
                    keel_retry_attempts_total{name=\"payments\"} 3\n\
                    keel_retry_attempts_total{name=\"inventory\"} 2\n\
                    keel_outbox_published_total 7\n";
        let totals = Totals::from_text(text);
        assert_eq!(totals.get("keel_retry_attempts_total"), 5);
        assert_eq!(totals.get("keel_outbox_published_total"), 7);
        assert_eq!(totals.get("missing"), 0);
        assert_eq!(
            Totals::with_label(text, "keel_retry_attempts_total", "payments"),
            3
        );
    }
}
