//! Pluggable gauges: consumer lag, queue depths, anything an operator
//! should see next to the outbox backlog.
//!
//! The consumer runtime keeps no lag figure of its own (how far behind a
//! group is depends on the broker: pending rows in SQLite, a consumer's
//! `num_pending` in JetStream), so the application registers a
//! [`GaugeSource`] that asks its broker — [`BrokerLag`] does it through
//! [`Broker::backlog`] — and the admin API and the console show whatever it
//! reports.

use std::collections::BTreeMap;
use std::sync::Arc;

use async_trait::async_trait;
use keel_store::broker::Broker;
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

/// Consumer lag of the given consumer groups, asked of their broker
/// ([`Broker::backlog`]): per group, `consumer_lag` (every unfinished
/// message) and `consumer_lag_in_flight` (those held by a member right
/// now),
/// labelled with `topic` and `group`. A group the broker cannot count is
/// left out; a broker error is logged and leaves its groups out.
///
/// ```
/// # use std::sync::Arc;
/// # use keel_store::broker::Broker;
/// # fn lag(broker: Arc<dyn Broker>) {
/// use keel_admin::BrokerLag;
/// let lag = BrokerLag::new(broker).group("orders", "fulfilment").group("orders", "billing");
/// // Admin::builder(store).gauges(lag)
/// # let _ = lag; }
/// ```
#[derive(Clone)]
pub struct BrokerLag {
    broker: Arc<dyn Broker>,
    groups: Vec<(String, String)>,
}

impl std::fmt::Debug for BrokerLag {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BrokerLag")
            .field("groups", &self.groups)
            .finish_non_exhaustive()
    }
}

impl BrokerLag {
    /// Lag read from `broker`, of no group yet.
    pub fn new(broker: Arc<dyn Broker>) -> Self {
        Self {
            broker,
            groups: Vec::new(),
        }
    }

    /// Adds the consumer group `group` of `topic`.
    pub fn group(mut self, topic: impl Into<String>, group: impl Into<String>) -> Self {
        self.groups.push((topic.into(), group.into()));
        self
    }
}

#[async_trait]
impl GaugeSource for BrokerLag {
    async fn gauges(&self) -> Vec<Gauge> {
        let mut gauges = Vec::with_capacity(self.groups.len() * 2);
        for (topic, group) in &self.groups {
            let backlog = match self.broker.backlog(topic, group).await {
                Ok(Some(backlog)) => backlog,
                Ok(None) => continue,
                Err(error) => {
                    tracing::warn!(%error, topic, group, "could not read a consumer group's lag");
                    continue;
                }
            };
            for (name, value) in [
                ("consumer_lag", backlog.total()),
                ("consumer_lag_in_flight", backlog.in_flight),
            ] {
                gauges.push(
                    Gauge::new(name, value as f64)
                        .label("topic", topic)
                        .label("group", group)
                        .unit("messages"),
                );
            }
        }
        gauges
    }
}
