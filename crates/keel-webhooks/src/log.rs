//! The delivery log: what was sent, what came back, and the operator's
//! levers, manual resend and replay of a time range.
//!
//! Every attempt is recorded with the request headers sent, the response
//! status, the start of the response body (truncated by the worker, 4 KiB by
//! default) and the latency, so "why did my endpoint not get event X?" is
//! answered from the log, not by guessing. After an outage, the endpoint's
//! owner fixes it and asks for a replay of the window they missed.

use chrono::{DateTime, Utc};
use keel_store::StoreError;
use keel_store::{
    DeliveryAttempt, DeliveryFilter, WebhookDelivery, WebhookEndpointStore, WebhookLogStore,
};

use super::endpoints::{Endpoints, not_found};
use super::error::WebhookError;

impl<S: WebhookLogStore + WebhookEndpointStore> Endpoints<S> {
    /// Deliveries matching `filter`, newest first (the per-endpoint log:
    /// set `filter.endpoint_id`).
    pub async fn deliveries(
        &self,
        filter: &DeliveryFilter,
    ) -> Result<Vec<WebhookDelivery>, WebhookError> {
        Ok(self.store.webhook_delivery_list(filter).await?)
    }

    /// One delivery.
    pub async fn delivery(&self, id: i64) -> Result<WebhookDelivery, WebhookError> {
        self.store
            .webhook_delivery_get(id)
            .await?
            .ok_or(WebhookError::DeliveryNotFound(id))
    }

    /// The attempts of a delivery, oldest first.
    pub async fn attempts(&self, delivery_id: i64) -> Result<Vec<DeliveryAttempt>, WebhookError> {
        Ok(self.store.webhook_attempts(delivery_id).await?)
    }

    /// Sends one delivery again, from a fresh retry schedule, with the same
    /// `webhook-id` (a receiver that processed it already dedupes it).
    /// [`WebhookError::Conflict`] while it is being attempted or its
    /// endpoint is disabled.
    pub async fn resend(&self, delivery_id: i64) -> Result<(), WebhookError> {
        let now = self.clock.now();
        match self.store.webhook_resend(delivery_id, now).await {
            Ok(true) => {
                metrics::counter!("keel_webhook_resends_total").increment(1);
                tracing::info!(delivery = delivery_id, "webhook delivery resent");
                Ok(())
            }
            Ok(false) => {
                let delivery = self.delivery(delivery_id).await?;
                let endpoint = self.get(&delivery.endpoint_id).await?;
                Err(WebhookError::Conflict(if endpoint.enabled {
                    format!(
                        "webhook delivery {delivery_id} is being attempted right now; try again in a moment"
                    )
                } else {
                    format!(
                        "webhook endpoint {:?} is disabled ({}): enable it before resending",
                        endpoint.id,
                        endpoint
                            .disabled_reason
                            .as_deref()
                            .unwrap_or("no reason given")
                    )
                }))
            }
            Err(StoreError::NotFound(_)) => Err(WebhookError::DeliveryNotFound(delivery_id)),
            Err(other) => Err(other.into()),
        }
    }

    /// Queues again every failed or disabled delivery of `endpoint_id`
    /// queued in `[from, to)` (an outage window); returns how many.
    pub async fn replay(
        &self,
        endpoint_id: &str,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
    ) -> Result<u64, WebhookError> {
        self.replay_with(endpoint_id, from, to, false).await
    }

    /// Like [`replay`](Self::replay), and with `include_succeeded` also the
    /// deliveries that succeeded (a receiver that lost its data).
    pub async fn replay_with(
        &self,
        endpoint_id: &str,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        include_succeeded: bool,
    ) -> Result<u64, WebhookError> {
        if from >= to {
            return Err(WebhookError::invalid(
                "replay range",
                "`from` must be before `to`",
            ));
        }
        let replayed = match self
            .store
            .webhook_replay(endpoint_id, from, to, include_succeeded, self.clock.now())
            .await
        {
            Ok(n) => n,
            Err(StoreError::Conflict(reason)) => return Err(WebhookError::Conflict(reason)),
            Err(other) => return Err(not_found(other, endpoint_id)),
        };
        metrics::counter!("keel_webhook_replayed_total").increment(replayed);
        tracing::info!(endpoint = endpoint_id, %from, %to, replayed, "webhook deliveries replayed");
        Ok(replayed)
    }
}
