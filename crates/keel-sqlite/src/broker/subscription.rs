//! A consumer group's subscription: lease what is deliverable, or wait.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keel_core::clock;
use keel_messaging::broker::{BrokerError, Delivery, Subscription};

use super::Inner;
use super::db::{GroupRef, LeaseBatch};
use super::delivery::SqliteDeliveryControl;

/// One consumer of a group. Several subscriptions of the same group (in this
/// process or others) share the group's messages.
pub(super) struct SqliteSubscription {
    inner: Arc<Inner>,
    group: GroupRef,
    lease: Duration,
}

impl SqliteSubscription {
    pub(super) fn new(inner: Arc<Inner>, group: GroupRef, lease: Duration) -> Self {
        Self {
            inner,
            group,
            lease,
        }
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
                Delivery::new(leased.message, count, Box::new(control))
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
            // Listen before looking, so a publish between the look and the
            // wait still wakes us.
            let changed = self.group.topic.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();

            let batch = self
                .inner
                .db
                .lease(&self.group, max, self.lease, pull_batch)
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
