//! The Broker conformance suite (keel-testkit) against the embedded SQLite
//! broker: a fresh database file per scenario.

#![cfg(feature = "broker")]

use async_trait::async_trait;
use keel_messaging::broker::{
    Backlog, Broker, BrokerError, Message, SubscribeOptions, Subscription,
};
use keel_sqlite::broker::SqliteBroker;
use tempfile::TempDir;

/// A broker in a temporary directory that is removed with it.
struct TempBroker {
    broker: SqliteBroker,
    _dir: TempDir,
}

#[async_trait]
impl Broker for TempBroker {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        self.broker.publish(messages).await
    }

    async fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        self.broker.subscribe(options).await
    }

    async fn ping(&self) -> Result<(), BrokerError> {
        self.broker.ping().await
    }

    async fn backlog(&self, topic: &str, group: &str) -> Result<Option<Backlog>, BrokerError> {
        self.broker.backlog(topic, group).await
    }
}

async fn make_broker() -> TempBroker {
    let dir = tempfile::tempdir().expect("temp dir");
    let broker = SqliteBroker::open(dir.path().join("broker.db"))
        .await
        .expect("open the broker");
    TempBroker { broker, _dir: dir }
}

keel_testkit::broker_conformance_tests!(async { make_broker().await });
