//! A broker on the test server under a prefix of its own, so parallel tests
//! never see each other's exchanges and queues.

#![allow(dead_code, unreachable_pub)]

use keel_rabbitmq::{RabbitBroker, RabbitBrokerOptions};
use keel_testkit::services::{self, Service};

/// A fresh, unique name prefix.
pub fn unique_prefix() -> String {
    let id = keel_core::id::new_id().simple().to_string();
    // The tail of a UUIDv7 is random; its head is the clock.
    format!("t{}", &id[id.len() - 16..])
}

/// Options for the test server under a unique prefix, with four shards.
pub fn test_options(url: &str) -> RabbitBrokerOptions {
    RabbitBrokerOptions::new(url)
        .prefix(unique_prefix())
        .shards(4)
}

/// Keeps the server's crash tests away while this test process runs
/// (nextest runs each test in a process of its own).
static SHARED: std::sync::OnceLock<services::ServerLock> = std::sync::OnceLock::new();

/// A broker on the test server, or `None` without one.
pub async fn fresh_broker() -> Option<RabbitBroker> {
    Some(fresh_broker_and_prefix().await?.0)
}

/// A broker on the test server and the prefix of its names, or `None`
/// without a server.
pub async fn fresh_broker_and_prefix() -> Option<(RabbitBroker, String)> {
    let url = services::rabbitmq_url()?;
    if SHARED.get().is_none() {
        let lock = tokio::task::spawn_blocking(|| services::ServerLock::shared(Service::RabbitMq))
            .await
            .expect("the lock task panicked");
        let _ = SHARED.set(lock);
    }
    let prefix = unique_prefix();
    let broker = RabbitBroker::connect(test_options(&url).prefix(&prefix))
        .await
        .expect("connect to the test RabbitMQ");
    Some((broker, prefix))
}
