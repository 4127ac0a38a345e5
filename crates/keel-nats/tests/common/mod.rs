//! Shared test helpers: a broker on the test server with a stream prefix of
//! its own (so parallel tests on one server never see each other's
//! streams), and the lock that keeps server restarts away from other tests.
//!
//! Tests run in parallel processes against one nats-server. A test that
//! restarts the server takes [`ServerLock::exclusive`]; every other test
//! holds [`ServerLock::shared`] for as long as its broker lives, so no
//! scenario sees a restart it did not ask for.

#![allow(dead_code, unreachable_pub)]

use async_trait::async_trait;
use keel_nats::{NatsBroker, NatsBrokerOptions};
use keel_store::broker::{Backlog, Broker, BrokerError, Message, SubscribeOptions, Subscription};
use keel_testkit::services::{self, Service};

/// A fresh, unique stream prefix.
pub fn unique_prefix() -> String {
    let id = keel_core::id::new_id().simple().to_string();
    // The tail of a UUIDv7 is random; its head is the clock.
    format!("t{}", &id[id.len() - 24..])
}

/// Options with a unique prefix.
pub fn test_options() -> NatsBrokerOptions {
    NatsBrokerOptions::new().stream_prefix(unique_prefix())
}

/// The shared server lock of keel-testkit, taken off the runtime's threads.
pub struct ServerLock {
    _lock: services::ServerLock,
}

impl ServerLock {
    async fn take(exclusive: bool) -> Self {
        let lock = tokio::task::spawn_blocking(move || {
            if exclusive {
                services::ServerLock::exclusive(Service::Nats)
            } else {
                services::ServerLock::shared(Service::Nats)
            }
        })
        .await
        .expect("the lock task panicked");
        Self { _lock: lock }
    }

    /// Held by tests that only need the server up.
    pub async fn shared() -> Self {
        Self::take(false).await
    }

    /// Held by a test that restarts the server.
    pub async fn exclusive() -> Self {
        Self::take(true).await
    }
}

/// A [`NatsBroker`] that holds the shared server lock while it lives.
pub struct TestBroker {
    pub broker: NatsBroker,
    pub url: String,
    _lock: ServerLock,
}

#[async_trait]
impl Broker for TestBroker {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        self.broker.publish(messages).await
    }

    async fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        self.broker.subscribe(options).await
    }

    fn validate(&self, message: &Message) -> Result<(), BrokerError> {
        self.broker.validate(message)
    }

    fn retention(&self) -> keel_store::broker::MessageRetention {
        self.broker.retention()
    }

    async fn ping(&self) -> Result<(), BrokerError> {
        self.broker.ping().await
    }

    async fn backlog(&self, topic: &str, group: &str) -> Result<Option<Backlog>, BrokerError> {
        self.broker.backlog(topic, group).await
    }

    async fn sweep_expired(&self) -> Result<u64, BrokerError> {
        self.broker.sweep_expired().await
    }

    async fn remove_group(&self, topic: &str, group: &str) -> Result<(), BrokerError> {
        self.broker.remove_group(topic, group).await
    }
}

/// A broker on the test server, or `None` (skip) when there is none.
pub async fn fresh_broker() -> Option<TestBroker> {
    let url = keel_testkit::services::nats_url()?;
    let lock = ServerLock::shared().await;
    let broker = test_options()
        .open(&url)
        .await
        .expect("connect to the test NATS server");
    Some(TestBroker {
        broker,
        url,
        _lock: lock,
    })
}
