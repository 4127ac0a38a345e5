//! A broker that fails and slows down on command: the embedded broker
//! behind keel-policy's [`FaultInjection`], for publishes (the relay's
//! side) and receives (the consumer's side).
//!
//! During a scheduled broker outage a share of calls fails as
//! [`BrokerError::Unavailable`] before reaching the broker (nothing was
//! published, nothing leased) and a share waits first, as a congested or
//! restarting broker does: the relay must back off and publish later, the
//! consumer must keep receiving, and nothing may be lost on the way.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keel_core::PolicyError;
use keel_policy::ConfigError;
use keel_policy::chaos::{ChaosExperiment, FaultInjection};
use keel_store::broker::{
    Backlog, Broker, BrokerError, Delivery, Message, MessageRetention, SubscribeOptions,
    Subscription,
};

/// The experiment every call through [`FaultyBroker`] belongs to.
const EXPERIMENT: &str = "keel-chaos-broker";

/// The broker's two injectors, switched on and off together.
#[derive(Debug, Clone)]
pub struct BrokerFaults {
    publish: FaultInjection,
    receive: FaultInjection,
}

impl BrokerFaults {
    /// Injectors that, once [enabled](Self::set_enabled), fail
    /// `abort_percent` of the calls and delay `delay_percent` of them by
    /// `delay`; seeded, so the dice repeat with the seed.
    pub fn new(
        seed: u64,
        abort_percent: f64,
        delay_percent: f64,
        delay: Duration,
    ) -> Result<Self, ConfigError> {
        let build = |name: &str, seed: u64| {
            FaultInjection::builder(name)
                .experiment(EXPERIMENT)
                .abort(abort_percent)
                .delay(delay_percent, delay)
                .seed(seed)
                .build()
        };
        Ok(Self {
            publish: build("broker-publish", seed)?,
            receive: build("broker-receive", seed.rotate_left(17))?,
        })
    }

    /// Starts or ends an outage.
    pub fn set_enabled(&self, enabled: bool) {
        self.publish.set_enabled(enabled);
        self.receive.set_enabled(enabled);
    }

    /// Whether an outage is on.
    pub fn is_enabled(&self) -> bool {
        self.publish.is_enabled()
    }
}

fn unavailable(err: PolicyError<BrokerError>) -> BrokerError {
    match err {
        PolicyError::Inner(e) => e,
        PolicyError::Rejected(r) => BrokerError::Unavailable(r.to_string().into()),
    }
}

/// `inner` behind the faults.
pub struct FaultyBroker {
    inner: Arc<dyn Broker>,
    faults: BrokerFaults,
}

impl FaultyBroker {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Broker>, faults: BrokerFaults) -> Self {
        Self { inner, faults }
    }
}

#[async_trait]
impl Broker for FaultyBroker {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        let call = self.faults.publish.call(|| self.inner.publish(messages));
        ChaosExperiment::scope(EXPERIMENT, call)
            .await
            .map_err(unavailable)
    }

    fn group_start(&self) -> keel_store::broker::GroupStart {
        self.inner.group_start()
    }

    async fn declare_group(&self, options: &SubscribeOptions) -> Result<(), BrokerError> {
        self.inner.declare_group(options).await
    }

    async fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        let inner = self.inner.subscribe(options).await?;
        Ok(Box::new(FaultySubscription {
            inner,
            faults: self.faults.receive.clone(),
        }))
    }

    /// The inner broker's rules: faults are injected into I/O, not into
    /// what the broker could ever accept.
    fn validate(&self, message: &Message) -> Result<(), BrokerError> {
        self.inner.validate(message)
    }

    fn retention(&self) -> MessageRetention {
        self.inner.retention()
    }

    async fn ping(&self) -> Result<(), BrokerError> {
        self.inner.ping().await
    }

    async fn backlog(&self, topic: &str, group: &str) -> Result<Option<Backlog>, BrokerError> {
        self.inner.backlog(topic, group).await
    }
}

struct FaultySubscription {
    inner: Box<dyn Subscription>,
    faults: FaultInjection,
}

#[async_trait]
impl Subscription for FaultySubscription {
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>, BrokerError> {
        let inner = &mut self.inner;
        let call = self.faults.call(|| inner.receive(max, wait));
        ChaosExperiment::scope(EXPERIMENT, call)
            .await
            .map_err(unavailable)
    }
}

#[cfg(test)]
mod tests {
    use keel_sqlite::SqliteBroker;

    use super::*;

    fn message(id: &str) -> Message {
        Message::new(id, "t", "k", bytes::Bytes::from_static(b"{}"))
    }

    #[tokio::test]
    async fn fails_only_while_enabled_and_loses_nothing() {
        let inner: Arc<dyn Broker> = Arc::new(SqliteBroker::open_in_memory().await.unwrap());
        let faults = BrokerFaults::new(1, 100.0, 0.0, Duration::from_millis(1)).unwrap();
        let broker = FaultyBroker::new(Arc::clone(&inner), faults.clone());
        let mut sub = broker
            .subscribe(SubscribeOptions::new("t", "g"))
            .await
            .unwrap();
        broker.publish(&[message("m-1")]).await.unwrap();
        faults.set_enabled(true);
        assert!(matches!(
            broker.publish(&[message("m-2")]).await,
            Err(BrokerError::Unavailable(_))
        ));
        assert!(matches!(
            sub.receive(10, Duration::from_millis(10)).await,
            Err(BrokerError::Unavailable(_))
        ));
        faults.set_enabled(false);
        let got = sub.receive(10, Duration::from_millis(200)).await.unwrap();
        let ids: Vec<&str> = got.iter().map(|d| d.message.id.as_str()).collect();
        assert_eq!(ids, ["m-1"], "the refused publish never reached the broker");
    }
}
