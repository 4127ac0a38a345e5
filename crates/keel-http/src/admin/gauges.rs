//! Pluggable gauges: consumer lag, queue depths, anything an operator
//! should see next to the outbox backlog.
//!
//! The consumer runtime keeps no lag figure of its own (how far behind a
//! group is depends on the broker: pending messages in SQLite, a stream's
//! `num_pending` in JetStream), so the application registers a
//! [`GaugeSource`] that asks its broker, and the admin API and the console
//! show whatever it reports.

use std::collections::BTreeMap;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

/// One reading, e.g. `consumer_lag{group="billing", topic="orders"} = 12`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gauge {
    /// What is measured (`consumer_lag`, `webhook_queue`).
    pub name: String,
    /// Which one (`group`, `topic`, ...).
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    /// The value.
    pub value: f64,
    /// The unit (`messages`, `ms`), if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unit: Option<String>,
}

impl Gauge {
    /// A reading of `name` with no labels or unit.
    pub fn new(name: impl Into<String>, value: f64) -> Self {
        Self {
            name: name.into(),
            labels: BTreeMap::new(),
            value,
            unit: None,
        }
    }

    /// Adds a label.
    pub fn label(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.labels.insert(key.into(), value.into());
        self
    }

    /// Sets the unit.
    pub fn unit(mut self, unit: impl Into<String>) -> Self {
        self.unit = Some(unit.into());
        self
    }
}

/// Something that reports gauges when asked (once per admin request or
/// console refresh, so keep it cheap). A source that fails should log and
/// return what it has: a broken gauge must not break the console.
#[async_trait]
pub trait GaugeSource: Send + Sync + 'static {
    /// The current readings.
    async fn gauges(&self) -> Vec<Gauge>;
}

/// A [`GaugeSource`] made from a synchronous closure (see
/// [`AdminBuilder::gauges_fn`](super::AdminBuilder::gauges_fn)).
pub struct FnGauges<F>(pub F);

impl<F> std::fmt::Debug for FnGauges<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FnGauges")
    }
}

#[async_trait]
impl<F> GaugeSource for FnGauges<F>
where
    F: Fn() -> Vec<Gauge> + Send + Sync + 'static,
{
    async fn gauges(&self) -> Vec<Gauge> {
        (self.0)()
    }
}
