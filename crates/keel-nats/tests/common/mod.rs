//! Shared test helpers: a broker on the test server with a stream prefix of
//! its own (so parallel tests on one server never see each other's
//! streams), and the lock that keeps server restarts away from other tests.
//!
//! Tests run in parallel processes against one nats-server. A test that
//! restarts the server takes [`ServerLock::exclusive`]; every other test
//! holds [`ServerLock::shared`] for as long as its broker lives, so no
//! scenario sees a restart it did not ask for.

#![allow(dead_code, unreachable_pub)]

use std::fs::File;
use std::path::PathBuf;

use async_trait::async_trait;
use keel_messaging::broker::{Broker, BrokerError, Message, SubscribeOptions, Subscription};
use keel_nats::{NatsBroker, NatsBrokerOptions};

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

/// A file lock on the test servers' directory (none outside services.sh).
pub struct ServerLock {
    _file: Option<File>,
}

impl ServerLock {
    fn path() -> Option<PathBuf> {
        let dir = std::env::var_os("KEEL_TEST_SERVICES_DIR")?;
        Some(PathBuf::from(dir).join("keel-nats-restart.lock"))
    }

    async fn take(exclusive: bool) -> Self {
        let Some(path) = Self::path() else {
            return Self { _file: None };
        };
        let file = tokio::task::spawn_blocking(move || {
            let file = File::options()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .expect("open the restart lock file");
            if exclusive {
                file.lock().expect("lock the restart lock file");
            } else {
                file.lock_shared().expect("lock the restart lock file");
            }
            file
        })
        .await
        .expect("the lock task panicked");
        Self { _file: Some(file) }
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

    async fn ping(&self) -> Result<(), BrokerError> {
        self.broker.ping().await
    }
}

/// A broker on the test server, or `None` (skip) when there is none.
pub async fn fresh_broker() -> Option<TestBroker> {
    let url = keel_testkit::services::nats_url()?;
    let lock = ServerLock::shared().await;
    let broker = NatsBroker::connect(&url, test_options())
        .await
        .expect("connect to the test NATS server");
    Some(TestBroker {
        broker,
        url,
        _lock: lock,
    })
}
