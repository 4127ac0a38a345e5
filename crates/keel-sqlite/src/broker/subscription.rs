//! A consumer group's subscription: lease what is deliverable, or wait.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keel_core::clock;
use keel_core::clock::Instant;
use keel_store::broker::{BrokerError, Delivery, SubscribeOptions, Subscription};

use super::Inner;
use super::db::{GroupRef, LeaseBatch};
use super::delivery::SqliteDeliveryControl;

/// One consumer of a group. Several subscriptions of the same group (in this
/// process or others) share the group's messages.
pub(super) struct SqliteSubscription {
    inner: Arc<Inner>,
    group: GroupRef,
    options: SubscribeOptions,
    /// When an expiring group was last marked as read.
    seen: Instant,
}

impl SqliteSubscription {
    pub(super) fn new(inner: Arc<Inner>, group: GroupRef, options: SubscribeOptions) -> Self {
        Self {
            inner,
            group,
            options,
            seen: clock::now(),
        }
    }

    /// Keeps an expiring group alive: marks it read once a quarter of its
    /// expiry has passed. A group swept meanwhile (this process stalled
    /// longer than the expiry) is subscribed again, so the member goes on
    /// reading whatever is published from then on.
    async fn keep_alive(&mut self) -> Result<(), BrokerError> {
        let Some(idle) = self.options.expire_after_idle else {
            return Ok(());
        };
        let now = clock::now();
        if now.saturating_duration_since(self.seen) < idle / 4 {
            return Ok(());
        }
        if !self.inner.db.touch(self.group.group_id).await? {
            tracing::warn!(topic = %self.options.topic, group = %self.options.group,
                "an expiring group was swept while a member still read it; subscribing again");
            let (topic, group_id) = self
                .inner
                .db
                .subscribe(&self.options.topic, &self.options.group, Some(idle))
                .await?;
            self.group.topic = topic;
            self.group.group_id = group_id;
        }
        self.seen = now;
        Ok(())
    }

    fn deliveries(&self, batch: LeaseBatch) -> Vec<Delivery> {
        let redelivered = batch.leased.iter().filter(|l| l.delivery_count > 1).count();
        let labels = [
            ("topic", self.group.topic.name.to_string()),
            ("group", self.group.name.to_string()),
        ];
        metrics::counter!("keel_broker_delivered_total", &labels)
            .increment(batch.leased.len() as u64);
        if redelivered > 0 {
            metrics::counter!("keel_broker_redelivered_total", &labels)
                .increment(redelivered as u64);
        }
        tracing::trace!(
            topic = %self.group.topic.name,
            group = %self.group.name,
            count = batch.leased.len(),
            redelivered,
            "leased messages"
        );
        batch
            .leased
            .into_iter()
            .map(|leased| {
                let control = SqliteDeliveryControl::new(
                    self.inner.settler.clone(),
                    self.group.topic.clone(),
                    self.group.group_id,
                    leased.seq,
                    leased.delivery_count,
                );
                let count = u32::try_from(leased.delivery_count).unwrap_or(u32::MAX);
                let delivery = Delivery::new(leased.message, count, Box::new(control));
                match chrono::DateTime::from_timestamp_millis(leased.published_at) {
                    Some(at) => delivery.with_received_at(at),
                    None => delivery,
                }
            })
            .collect()
    }
}

#[async_trait]
impl Subscription for SqliteSubscription {
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>, BrokerError> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let max = max.min(super::MAX_RECEIVE);
        let deadline = clock::now()
            .checked_add(wait)
            .unwrap_or_else(|| clock::now() + Duration::from_secs(86_400 * 365));
        let poll = self.inner.options.poll_interval;
        let pull_batch = self.inner.options.pull_batch;
        loop {
            self.keep_alive().await?;
            // Listen before looking, so a publish between the look and the
            // wait still wakes us.
            let changed = self.group.topic.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();

            let batch = self
                .inner
                .db
                .lease(&self.group, max, self.options.lease, pull_batch)
                .await?;
            if !batch.leased.is_empty() {
                return Ok(self.deliveries(batch));
            }
            let now = clock::now();
            if now >= deadline {
                return Ok(Vec::new());
            }
            if batch.pulled {
                // Only blocked messages came in; look further right away.
                tokio::task::yield_now().await;
                continue;
            }
            // Another process may publish without waking us: poll. And a
            // nacked or leased message becomes visible on its own: wake then.
            let mut wake_at = deadline.min(now + poll);
            if let Some(visible_ms) = batch.next_visible_ms {
                wake_at = wake_at.min(self.inner.db.clock.instant_at(visible_ms));
            }
            tokio::select! {
                () = &mut changed => {}
                () = tokio::time::sleep_until(wake_at) => {}
            }
        }
    }
}
