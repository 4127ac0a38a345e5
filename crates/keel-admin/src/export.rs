//! The gauges read from storage, kept current for Prometheus on a
//! schedule.
//!
//! Counters move when something happens; a dead letter, a stuck saga or a
//! consumer group falling behind is a *state*, and nothing happens while it
//! sits there. Were the `keel_dead_letters_pending` gauge set only when an
//! operator opens the console, an alert on it would fire exactly when
//! someone is already looking. [`GaugeExport`] reads those states every
//! interval (15 s by default, Prometheus' usual scrape) whether or not
//! anyone asks, and sets:
//!
//! | gauge | labels | from |
//! |---|---|---|
//! | `keel_dead_letters_pending` | `kind` | the dead-letter store |
//! | `keel_sagas` | `status` | the saga store |
//! | `keel_outbox_unpublished`, `keel_outbox_parked`, `keel_outbox_lag_seconds` | | the outbox |
//! | `keel_webhook_endpoints` | `state` (`enabled`, `disabled`) | the webhook endpoints |
//! | `keel_<name>` for every registered [`GaugeSource`](crate::GaugeSource) reading | its labels | e.g. `keel_consumer_lag{topic, group}` from [`BrokerLag`](crate::BrokerLag) |
//!
//! A kind or status that had letters or sagas and has none any more is set
//! to 0, not left at its last value: a gauge that never comes down is an
//! alert that never resolves. Every process that runs an export reports the
//! same shared figures, so alert rules aggregate them with `max`, not
//! `sum`. A failed read is logged and leaves its gauges as they were; the
//! next tick tries again.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use crate::AdminStore;
use keel_store::SagaStatus;
use parking_lot::Mutex;

use crate::Admin;

/// How often [`GaugeExport`] reads its gauges by default.
pub const DEFAULT_EXPORT_INTERVAL: Duration = Duration::from_secs(15);

/// Sets the storage-backed gauges every interval; see the
/// [module docs](self). Made by [`Admin::gauge_export`].
pub struct GaugeExport<S> {
    admin: Admin<S>,
    every: Duration,
    dead_letter_kinds: Mutex<BTreeSet<String>>,
    source_series: Mutex<BTreeSet<Series>>,
}

/// A source gauge's name and labels, to zero it when it stops reporting.
type Series = (String, BTreeMap<String, String>);

impl<S> std::fmt::Debug for GaugeExport<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GaugeExport")
            .field("every", &self.every)
            .finish_non_exhaustive()
    }
}

impl<S: AdminStore> GaugeExport<S> {
    pub(crate) fn new(admin: Admin<S>) -> Self {
        Self {
            admin,
            every: DEFAULT_EXPORT_INTERVAL,
            dead_letter_kinds: Mutex::default(),
            source_series: Mutex::default(),
        }
    }

    /// Reads the gauges every `every` instead of every 15 s. Match it to
    /// the scrape interval: reading more often only loads the database.
    pub fn every(mut self, every: Duration) -> Self {
        self.every = every.max(Duration::from_millis(10));
        self
    }

    /// Refreshes every gauge now, then every interval until `shutdown`
    /// completes.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) {
        keel_core::clock::every(self.every, shutdown, || self.refresh()).await;
    }

    /// Reads and sets every gauge once.
    pub async fn refresh(&self) {
        self.dead_letters().await;
        self.sagas().await;
        self.lag().await;
        #[cfg(feature = "webhooks")]
        self.webhook_endpoints().await;
    }

    async fn dead_letters(&self) {
        let counts = match self.admin.dead_letter_counts().await {
            Ok(counts) => counts,
            Err(error) => return tracing::warn!(%error, "could not count dead letters"),
        };
        let mut seen = self.dead_letter_kinds.lock();
        for gone in seen.iter().filter(|kind| !counts.contains_key(*kind)) {
            metrics::gauge!("keel_dead_letters_pending", "kind" => gone.clone()).set(0.0);
        }
        *seen = counts.into_keys().collect();
    }

    async fn sagas(&self) {
        let counts = match self.admin.saga_counts().await {
            Ok(counts) => counts,
            Err(error) => return tracing::warn!(%error, "could not count sagas"),
        };
        for status in SagaStatus::ALL {
            let n = counts.get(status.as_str()).copied().unwrap_or(0);
            metrics::gauge!("keel_sagas", "status" => status.as_str()).set(n as f64);
        }
    }

    async fn lag(&self) {
        let lag = match self.admin.lag().await {
            Ok(lag) => lag,
            Err(error) => return tracing::warn!(%error, "could not read the outbox backlog"),
        };
        metrics::gauge!("keel_outbox_unpublished").set(lag.outbox.unpublished as f64);
        metrics::gauge!("keel_outbox_parked").set(lag.outbox.parked as f64);
        let age_ms = lag.outbox.oldest_unpublished_age_ms.unwrap_or(0);
        metrics::gauge!("keel_outbox_lag_seconds").set(age_ms as f64 / 1000.0);
        let mut now = BTreeSet::new();
        for gauge in lag.gauges {
            let series = (format!("keel_{}", gauge.name), gauge.labels);
            set_series(&series, gauge.value);
            now.insert(series);
        }
        let mut seen = self.source_series.lock();
        for gone in seen.difference(&now) {
            set_series(gone, 0.0);
        }
        *seen = now;
    }

    #[cfg(feature = "webhooks")]
    async fn webhook_endpoints(&self) {
        let endpoints = match self.admin.store().webhook_endpoint_list().await {
            Ok(endpoints) => endpoints,
            Err(error) => return tracing::warn!(%error, "could not list webhook endpoints"),
        };
        let disabled = endpoints.iter().filter(|e| e.disabled_at.is_some()).count();
        let enabled = endpoints.len() - disabled;
        for (state, n) in [("enabled", enabled), ("disabled", disabled)] {
            metrics::gauge!("keel_webhook_endpoints", "state" => state).set(n as f64);
        }
    }
}

fn set_series((name, labels): &Series, value: f64) {
    let labels: Vec<(String, String)> =
        labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    metrics::gauge!(name.clone(), &labels).set(value);
}
