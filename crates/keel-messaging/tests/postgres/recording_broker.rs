//! A broker for relay tests: records every publish call in order, and can
//! "die" in the middle of a batch.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use async_trait::async_trait;
use keel_messaging::broker::{Broker, BrokerError, Message, SubscribeOptions, Subscription};
use parking_lot::Mutex;

/// Every message published, in publish order, shared by all relays.
#[derive(Debug, Default)]
pub struct Recorded {
    pub messages: Mutex<Vec<Message>>,
    pub published: tokio::sync::Notify,
}

impl Recorded {
    pub fn ids(&self) -> Vec<String> {
        self.messages.lock().iter().map(|m| m.id.clone()).collect()
    }

    pub fn len(&self) -> usize {
        self.messages.lock().len()
    }
}

/// Records publishes; forwards them to `inner` when there is one (with a
/// fresh message id per publish when `fresh_ids`, so a consumer sees every
/// republish and its inbox must absorb it).
pub struct RecordingBroker {
    pub recorded: Arc<Recorded>,
    pub inner: Option<Arc<dyn Broker>>,
    pub fresh_ids: bool,
    /// When set, the next publish forwards only the first half of its batch
    /// and then never returns: the relay process dies mid-batch.
    pub die_mid_batch: AtomicBool,
    pub died: tokio::sync::Notify,
    publishes: AtomicU64,
}

impl RecordingBroker {
    pub fn new(recorded: Arc<Recorded>, inner: Option<Arc<dyn Broker>>) -> Self {
        Self {
            recorded,
            inner,
            fresh_ids: false,
            die_mid_batch: AtomicBool::new(false),
            died: tokio::sync::Notify::new(),
            publishes: AtomicU64::new(0),
        }
    }

    pub fn with_fresh_ids(mut self) -> Self {
        self.fresh_ids = true;
        self
    }

    async fn forward(&self, messages: &[Message]) -> Result<(), BrokerError> {
        let n = self.publishes.fetch_add(1, Ordering::SeqCst);
        let sent: Vec<Message> = messages
            .iter()
            .map(|m| {
                let mut m = m.clone();
                if self.fresh_ids {
                    m.id = format!("{}#{n}", m.id);
                }
                m
            })
            .collect();
        if let Some(inner) = &self.inner {
            inner.publish(&sent).await?;
        }
        self.recorded
            .messages
            .lock()
            .extend(messages.iter().cloned());
        self.recorded.published.notify_waiters();
        Ok(())
    }
}

#[async_trait]
impl Broker for RecordingBroker {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        if messages.len() > 1 && self.die_mid_batch.swap(false, Ordering::SeqCst) {
            self.forward(&messages[..messages.len() / 2]).await?;
            self.died.notify_one();
            std::future::pending::<()>().await;
        }
        self.forward(messages).await
    }

    async fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        match &self.inner {
            Some(inner) => inner.subscribe(options).await,
            None => Err(BrokerError::Unavailable(
                "a recording broker has no subscribers".into(),
            )),
        }
    }
}
