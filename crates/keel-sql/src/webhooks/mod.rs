//! Webhook endpoints, deliveries and the delivery log: the storage behind
//! `keel-http`'s webhook sender.
//!
//! A delivery is a row queued in the caller's transaction (waking the
//! senders of other processes at commit, where the backend has wake-ups)
//! and leased by a worker, so a customer's slow endpoint is never inside the
//! request that caused the event, and a crashed worker's deliveries come
//! back when their lease ends. The fan-out (which endpoints an event goes
//! to, and that a disabled endpoint's copy waits as `disabled`) is decided
//! here, once.
//!
//! The claim is where the databases differ ([`WebhookBackend`]): for every
//! enabled endpoint it takes at most `per_endpoint` of its oldest due
//! deliveries, numbers them after the endpoint's deliveries already in
//! flight, and leases the oldest due of those that fit, up to `limit`;
//! SQLite does it in one statement on its single writer, PostgreSQL under a
//! transaction-scoped advisory lock so that the in-flight counts include
//! the claim running next door.
//!
//! Completion is batched: one transaction records any number of attempts
//! and moves their deliveries (only while the worker still holds the lease)
//! from a JSON array each ([`Dialect::json_records`](crate::Dialect::json_records)), and moves each
//! endpoint's failure window once.

mod complete;
mod deliveries;
mod endpoints;

use std::future::Future;

use chrono::{DateTime, Utc};
use keel_store::StoreError;

use crate::backend::{Row, SqlBackend};

pub use complete::complete;
pub use deliveries::{
    attempts, claim_due, delivery_get, delivery_list, enqueue, failing_since, prune, replay, resend,
};
pub use endpoints::{
    endpoint_create, endpoint_delete, endpoint_disable, endpoint_enable, endpoint_get,
    endpoint_list, endpoint_rotate_secret, endpoint_update,
};

/// The columns of an endpoint, as every query here reads them.
pub const ENDPOINT_COLUMNS: &str = "id, url, description, event_types, secrets, enabled, \
    disabled_reason, disabled_at, failing_since, last_success_at, created_at, updated_at, tenant, format";

/// The columns of a delivery, as [`WebhookBackend::claim_rows`] returns them.
pub const DELIVERY_COLUMNS: &str = "id, endpoint_id, event_id, event_type, payload, status, \
    attempts, next_attempt_at, created_at, updated_at, leased_by, leased_until, traceparent";

/// What only the backend knows how to do with its webhook deliveries.
pub trait WebhookBackend: SqlBackend {
    /// Leases due deliveries to `worker` until `until`, given the time
    /// `now`, at most `limit` in all and at most `per_endpoint` in flight
    /// per endpoint (see the module docs), and returns them with
    /// [`DELIVERY_COLUMNS`].
    fn claim_rows<'a>(
        &'a self,
        worker: &'a str,
        until: DateTime<Utc>,
        now: DateTime<Utc>,
        limit: usize,
        per_endpoint: usize,
    ) -> impl Future<Output = Result<Vec<Row<Self>>, StoreError>> + Send + 'a;
}

/// How a `NotFound` names an endpoint.
pub(crate) fn endpoint_name(id: &str) -> String {
    format!("webhook endpoint {id:?}")
}

pub(crate) fn not_found_endpoint(id: &str) -> StoreError {
    StoreError::NotFound(endpoint_name(id))
}

/// Implements the three webhook stores (and so
/// [`WebhookStore`](keel_store::WebhookStore)) for a [`WebhookBackend`].
#[macro_export]
macro_rules! webhook_store {
    ($store:ty) => {
        #[$crate::__private::async_trait]
        impl $crate::__private::store::WebhookEndpointStore for $store {
            async fn webhook_endpoint_create(
                &self,
                endpoint: &$crate::__private::store::WebhookEndpoint,
            ) -> ::std::result::Result<(), $crate::__private::StoreError> {
                $crate::webhooks::endpoint_create(self, endpoint).await
            }
            async fn webhook_endpoint_get(
                &self,
                id: &str,
            ) -> ::std::result::Result<
                ::std::option::Option<$crate::__private::store::WebhookEndpoint>,
                $crate::__private::StoreError,
            > {
                $crate::webhooks::endpoint_get(self, id).await
            }
            async fn webhook_endpoint_list(
                &self,
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::__private::store::WebhookEndpoint>,
                $crate::__private::StoreError,
            > {
                $crate::webhooks::endpoint_list(self).await
            }
            async fn webhook_endpoint_update(
                &self,
                endpoint: &$crate::__private::store::WebhookEndpoint,
                now: $crate::__private::DateTime<$crate::__private::Utc>,
            ) -> ::std::result::Result<(), $crate::__private::StoreError> {
                $crate::webhooks::endpoint_update(self, endpoint, now).await
            }
            async fn webhook_endpoint_rotate_secret(
                &self,
                id: &str,
                secret: &$crate::__private::store::WebhookSecret,
                previous_expires_at: $crate::__private::DateTime<$crate::__private::Utc>,
            ) -> ::std::result::Result<
                $crate::__private::store::WebhookEndpoint,
                $crate::__private::StoreError,
            > {
                $crate::webhooks::endpoint_rotate_secret(self, id, secret, previous_expires_at)
                    .await
            }
            async fn webhook_endpoint_disable(
                &self,
                id: &str,
                reason: &str,
                at: $crate::__private::DateTime<$crate::__private::Utc>,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::webhooks::endpoint_disable(self, id, reason, at).await
            }
            async fn webhook_endpoint_enable(
                &self,
                id: &str,
                at: $crate::__private::DateTime<$crate::__private::Utc>,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::webhooks::endpoint_enable(self, id, at).await
            }
            async fn webhook_endpoint_delete(
                &self,
                id: &str,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::webhooks::endpoint_delete(self, id).await
            }
        }

        #[$crate::__private::async_trait]
        impl $crate::__private::store::WebhookDeliveryStore for $store {
            async fn webhook_enqueue(
                &self,
                tx: &mut <Self as $crate::__private::store::Store>::Tx,
                messages: &[$crate::__private::store::WebhookMessage],
                now: $crate::__private::DateTime<$crate::__private::Utc>,
            ) -> ::std::result::Result<u64, $crate::__private::StoreError> {
                $crate::webhooks::enqueue(self, tx, messages, now).await
            }
            async fn webhook_claim_due(
                &self,
                worker: &str,
                now: $crate::__private::DateTime<$crate::__private::Utc>,
                limit: usize,
                per_endpoint: usize,
                lease: ::std::time::Duration,
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::__private::store::ClaimedDelivery>,
                $crate::__private::StoreError,
            > {
                $crate::webhooks::claim_due(self, worker, now, limit, per_endpoint, lease).await
            }
            async fn webhook_complete(
                &self,
                worker: &str,
                outcomes: &[$crate::__private::store::DeliveryOutcome],
            ) -> ::std::result::Result<u64, $crate::__private::StoreError> {
                $crate::webhooks::complete(self, worker, outcomes).await
            }
            async fn webhook_failing_since(
                &self,
                endpoint_id: &str,
            ) -> ::std::result::Result<
                ::std::option::Option<$crate::__private::DateTime<$crate::__private::Utc>>,
                $crate::__private::StoreError,
            > {
                $crate::webhooks::failing_since(self, endpoint_id).await
            }
            async fn webhook_prune(
                &self,
                before: $crate::__private::DateTime<$crate::__private::Utc>,
                batch: usize,
            ) -> ::std::result::Result<u64, $crate::__private::StoreError> {
                $crate::webhooks::prune(self, before, batch).await
            }
        }

        #[$crate::__private::async_trait]
        impl $crate::__private::store::WebhookLogStore for $store {
            async fn webhook_delivery_get(
                &self,
                id: i64,
            ) -> ::std::result::Result<
                ::std::option::Option<$crate::__private::store::WebhookDelivery>,
                $crate::__private::StoreError,
            > {
                $crate::webhooks::delivery_get(self, id).await
            }
            async fn webhook_delivery_list(
                &self,
                filter: &$crate::__private::store::DeliveryFilter,
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::__private::store::WebhookDelivery>,
                $crate::__private::StoreError,
            > {
                $crate::webhooks::delivery_list(self, filter).await
            }
            async fn webhook_attempts(
                &self,
                delivery_id: i64,
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::__private::store::DeliveryAttempt>,
                $crate::__private::StoreError,
            > {
                $crate::webhooks::attempts(self, delivery_id).await
            }
            async fn webhook_resend(
                &self,
                delivery_id: i64,
                now: $crate::__private::DateTime<$crate::__private::Utc>,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::webhooks::resend(self, delivery_id, now).await
            }
            async fn webhook_replay(
                &self,
                endpoint_id: &str,
                from: $crate::__private::DateTime<$crate::__private::Utc>,
                to: $crate::__private::DateTime<$crate::__private::Utc>,
                include_succeeded: bool,
                now: $crate::__private::DateTime<$crate::__private::Utc>,
            ) -> ::std::result::Result<u64, $crate::__private::StoreError> {
                $crate::webhooks::replay(self, endpoint_id, from, to, include_succeeded, now).await
            }
        }
    };
}
