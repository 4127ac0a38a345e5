//! Webhook endpoints, their deliveries and the delivery log.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{Store, StoreError};

/// A signing secret of a webhook endpoint.
///
/// The text is a Standard Webhooks secret (`whsec_` + base64 of the key
/// bytes) or any other string, used as the key bytes as it is.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WebhookSecret {
    /// The secret's text form (`whsec_...`).
    pub secret: String,
    /// When it was added.
    pub created_at: DateTime<Utc>,
    /// After this time it no longer signs (`None`: until it is rotated out).
    pub expires_at: Option<DateTime<Utc>>,
}

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret itself (logs, panics, test output).
        f.debug_struct("WebhookSecret")
            .field("secret", &"<redacted>")
            .field("created_at", &self.created_at)
            .field("expires_at", &self.expires_at)
            .finish()
    }
}

impl WebhookSecret {
    /// Whether the secret still signs at `now`.
    pub fn is_active_at(&self, now: DateTime<Utc>) -> bool {
        self.expires_at.is_none_or(|expires| expires > now)
    }
}

/// A customer's webhook endpoint: where deliveries go and how they are signed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookEndpoint {
    /// The endpoint id.
    pub id: String,
    /// The URL deliveries are POSTed to.
    pub url: String,
    /// A human description (may be empty).
    pub description: String,
    /// The event types it subscribes to: exact names (`order.paid`) or
    /// prefixes ending in `.*` (`order.*`); empty means every type.
    pub event_types: Vec<String>,
    /// Its signing secrets, oldest first: at most two, so that a rotation
    /// can sign with the old and the new one during a grace period.
    pub secrets: Vec<WebhookSecret>,
    /// Whether deliveries are sent to it.
    pub enabled: bool,
    /// Why it was disabled (`410 Gone`, a failure window, an operator).
    pub disabled_reason: Option<String>,
    /// When it was disabled.
    pub disabled_at: Option<DateTime<Utc>>,
    /// Since when every attempt to it has failed: the time of the first
    /// failed attempt after its last successful one (`None` while healthy).
    pub failing_since: Option<DateTime<Utc>>,
    /// When an attempt to it last succeeded.
    pub last_success_at: Option<DateTime<Utc>>,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Last change of its settings, secrets or state.
    pub updated_at: DateTime<Utc>,
    /// The tenant that owns it: only that tenant's callers see, change or
    /// resend it (empty: no tenant, managed by operators only).
    pub tenant: String,
    /// How its deliveries are put on the wire.
    pub format: WebhookFormat,
}

/// How a webhook is put on the wire. Every format is signed the same way
/// (Standard Webhooks `webhook-id`, `webhook-timestamp` and
/// `webhook-signature` over the exact body sent); they differ in what the
/// body and headers hold, so a receiver uses the SDK it already has.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WebhookFormat {
    /// The Standard Webhooks payload, `application/json`:
    /// `{"id","type","timestamp","sequence"?,"source"?,"data"}`.
    #[default]
    StandardWebhooks,
    /// A CloudEvents 1.0 event in structured mode:
    /// `application/cloudevents+json`, attributes and `data` in the body.
    CloudeventsStructured,
    /// A CloudEvents 1.0 event in binary mode: attributes as `ce-*`
    /// headers, `data` alone as the `application/json` body.
    CloudeventsBinary,
    /// "Fetch, don't trust": the Standard Webhooks payload with `data`
    /// cut down to its identifiers (scalar `id`, `…Id` and `…_id` fields),
    /// so nothing sensitive travels to the endpoint; the receiver fetches
    /// the resource from the sender's authenticated API.
    StandardWebhooksThin,
}

impl WebhookFormat {
    /// Every format.
    pub const ALL: [Self; 4] = [
        Self::StandardWebhooks,
        Self::CloudeventsStructured,
        Self::CloudeventsBinary,
        Self::StandardWebhooksThin,
    ];

    /// The stored (and API) name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::StandardWebhooks => "standard-webhooks",
            Self::CloudeventsStructured => "cloudevents-structured",
            Self::CloudeventsBinary => "cloudevents-binary",
            Self::StandardWebhooksThin => "standard-webhooks-thin",
        }
    }

    /// Parses the stored name.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.as_str() == name)
    }
}

impl WebhookEndpoint {
    /// A new endpoint as registered at `now`: enabled, signing with
    /// `secret` (stored as given, so sealed if the store seals), every event
    /// type, no tenant, the default format, no delivery history yet. Set the
    /// rest with struct update syntax.
    pub fn registered(
        id: impl Into<String>,
        url: impl Into<String>,
        secret: impl Into<String>,
        now: DateTime<Utc>,
    ) -> Self {
        Self {
            id: id.into(),
            url: url.into(),
            description: String::new(),
            event_types: Vec::new(),
            secrets: vec![WebhookSecret {
                secret: secret.into(),
                created_at: now,
                expires_at: None,
            }],
            enabled: true,
            disabled_reason: None,
            disabled_at: None,
            failing_since: None,
            last_success_at: None,
            created_at: now,
            updated_at: now,
            tenant: String::new(),
            format: WebhookFormat::default(),
        }
    }

    /// Whether it subscribes to `event_type`: no filter, an exact name, or a
    /// `prefix.*` pattern whose prefix (dot included) starts the type.
    pub fn subscribes_to(&self, event_type: &str) -> bool {
        self.event_types.is_empty()
            || self.event_types.iter().any(|pattern| {
                pattern == event_type
                    || pattern == "*"
                    || pattern.strip_suffix('*').is_some_and(|prefix| {
                        prefix.ends_with('.') && event_type.starts_with(prefix)
                    })
            })
    }

    /// The secrets that sign at `now`, oldest first.
    pub fn active_secrets(&self, now: DateTime<Utc>) -> impl Iterator<Item = &WebhookSecret> {
        self.secrets.iter().filter(move |s| s.is_active_at(now))
    }
}

/// Where a webhook delivery is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryStatus {
    /// Waiting for its next attempt (or being attempted under a lease).
    Pending,
    /// The endpoint answered `2xx`.
    Succeeded,
    /// Every attempt of the retry schedule failed.
    Failed,
    /// Not sent because its endpoint is (or was) disabled; a replay
    /// re-queues it once the endpoint is enabled again.
    Disabled,
}

impl DeliveryStatus {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Disabled => "disabled",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "pending" => Self::Pending,
            "succeeded" => Self::Succeeded,
            "failed" => Self::Failed,
            "disabled" => Self::Disabled,
            _ => return None,
        })
    }
}

/// An event to deliver to every subscribed endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookMessage {
    /// The event id: the `webhook-id` receivers dedupe on, the same in
    /// every attempt and for every endpoint.
    pub event_id: String,
    /// The event type endpoints subscribe to.
    pub event_type: String,
    /// The exact body to send (and sign).
    pub payload: Bytes,
    /// The trace it was queued in (a W3C `traceparent`): each attempt's
    /// span is a child of it. It is not sent to the endpoint.
    pub traceparent: Option<String>,
}

/// One event queued for one endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookDelivery {
    /// The delivery id, increasing in creation order.
    pub id: i64,
    /// The endpoint it goes to.
    pub endpoint_id: String,
    /// The event id (`webhook-id`).
    pub event_id: String,
    /// The event type.
    pub event_type: String,
    /// The body.
    pub payload: Bytes,
    /// Where it is.
    pub status: DeliveryStatus,
    /// Attempts made since it was (re)queued.
    pub attempts: u32,
    /// Not attempted before this time.
    pub next_attempt_at: DateTime<Utc>,
    /// When it was queued.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
    /// The worker attempting it now, if any.
    pub leased_by: Option<String>,
    /// Until when that worker holds it; afterwards another worker may.
    pub leased_until: Option<DateTime<Utc>>,
    /// The trace it was queued in (a W3C `traceparent`).
    pub traceparent: Option<String>,
}

/// A due delivery leased to a worker, with its endpoint (URL, secrets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedDelivery {
    /// The delivery.
    pub delivery: WebhookDelivery,
    /// Its endpoint as it was when claimed.
    pub endpoint: WebhookEndpoint,
}

/// One attempt at a delivery, as the delivery log shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryAttempt {
    /// The delivery.
    pub delivery_id: i64,
    /// The attempt's number since the delivery was (re)queued, from 1.
    pub attempt: u32,
    /// When it started.
    pub at: DateTime<Utc>,
    /// The URL finally requested (after redirects).
    pub url: String,
    /// The request headers sent (the body is the delivery's payload).
    pub request_headers: Vec<(String, String)>,
    /// The response status, if a response came.
    pub response_status: Option<u16>,
    /// The start of the response body (truncated by the sender).
    pub response_body: Option<String>,
    /// How long the attempt took.
    pub latency: Duration,
    /// What went wrong, if anything did (timeout, refused, SSRF guard, ...).
    pub error: Option<String>,
}

impl DeliveryAttempt {
    /// Whether the endpoint accepted the delivery (`2xx`).
    pub fn succeeded(&self) -> bool {
        self.response_status
            .is_some_and(|status| (200..300).contains(&status))
    }
}

/// The result of one attempt, to be recorded by
/// [`WebhookDeliveryStore::webhook_complete`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryOutcome {
    /// The attempt, for the log; `attempt.attempt` becomes the delivery's
    /// attempt count.
    pub attempt: DeliveryAttempt,
    /// The delivery's new status.
    pub status: DeliveryStatus,
    /// With [`DeliveryStatus::Pending`]: when to try again.
    pub next_attempt_at: Option<DateTime<Utc>>,
}

/// Which deliveries to list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeliveryFilter {
    /// Only this endpoint's.
    pub endpoint_id: Option<String>,
    /// Only this event's.
    pub event_id: Option<String>,
    /// Only this status.
    pub status: Option<DeliveryStatus>,
    /// Only deliveries queued at or after this time.
    pub created_from: Option<DateTime<Utc>>,
    /// Only deliveries queued before this time.
    pub created_before: Option<DateTime<Utc>>,
    /// Only deliveries with a smaller id (keyset paging, newest first).
    pub before_id: Option<i64>,
    /// At most this many (default 100).
    pub limit: Option<usize>,
}

/// Webhook endpoints, as the management API creates, changes and
/// removes them (and the worker disables one that keeps failing).
///
/// A `pending` delivery always belongs to an enabled endpoint: disabling an
/// endpoint turns its pending deliveries `disabled`, enqueueing for a
/// disabled endpoint creates `disabled` rows, and a resend or replay for a
/// disabled endpoint is refused. A replay after re-enabling recovers them.
#[async_trait]
pub trait WebhookEndpointStore: Store {
    /// Creates an endpoint. [`StoreError::Conflict`] if the id exists.
    async fn webhook_endpoint_create(&self, endpoint: &WebhookEndpoint) -> Result<(), StoreError>;
    /// One endpoint.
    async fn webhook_endpoint_get(&self, id: &str) -> Result<Option<WebhookEndpoint>, StoreError>;
    /// Every endpoint, oldest first.
    async fn webhook_endpoint_list(&self) -> Result<Vec<WebhookEndpoint>, StoreError>;
    /// Saves an endpoint's URL, description and event types (not its
    /// secrets or state), setting `updated_at` to `now`.
    /// [`StoreError::NotFound`] if there is no such endpoint.
    async fn webhook_endpoint_update(
        &self,
        endpoint: &WebhookEndpoint,
        now: DateTime<Utc>,
    ) -> Result<(), StoreError>;
    /// Rotates an endpoint's secret in one atomic step: `secret` becomes the
    /// newest; the newest of the current secrets keeps signing until
    /// `previous_expires_at` (or its own earlier expiry); every other secret
    /// is dropped, so at most two are ever stored. Returns the endpoint.
    /// [`StoreError::NotFound`] if there is no such endpoint.
    async fn webhook_endpoint_rotate_secret(
        &self,
        id: &str,
        secret: &WebhookSecret,
        previous_expires_at: DateTime<Utc>,
    ) -> Result<WebhookEndpoint, StoreError>;
    /// Disables an endpoint with a reason, and turns its pending deliveries
    /// `disabled` (releasing their leases), atomically. `false` if it was
    /// already disabled (nothing changes). [`StoreError::NotFound`] if there
    /// is no such endpoint.
    async fn webhook_endpoint_disable(
        &self,
        id: &str,
        reason: &str,
        at: DateTime<Utc>,
    ) -> Result<bool, StoreError>;
    /// Enables an endpoint again, clearing its disabled reason and its
    /// failure window. Its `disabled` deliveries stay so until a replay.
    /// `false` if it was enabled. [`StoreError::NotFound`] if there is no
    /// such endpoint.
    async fn webhook_endpoint_enable(
        &self,
        id: &str,
        at: DateTime<Utc>,
    ) -> Result<bool, StoreError>;
    /// Deletes an endpoint with its deliveries and their attempts. `false`
    /// if there was no such endpoint.
    async fn webhook_endpoint_delete(&self, id: &str) -> Result<bool, StoreError>;
}

/// Queued deliveries, as the sender and the workers use them.
///
/// Deliveries are *queued*, never sent inline: [`webhook_enqueue`] writes
/// one row per subscribed endpoint inside the caller's transaction (the one
/// that writes the business change, or an outbox consumer's), and workers
/// lease due rows with [`webhook_claim_due`], send them, and record each
/// attempt with [`webhook_complete`].
///
/// [`webhook_enqueue`]: WebhookDeliveryStore::webhook_enqueue
/// [`webhook_claim_due`]: WebhookDeliveryStore::webhook_claim_due
/// [`webhook_complete`]: WebhookDeliveryStore::webhook_complete
#[async_trait]
pub trait WebhookDeliveryStore: Store {
    /// Queues `messages` inside the caller's transaction: for each message,
    /// one delivery per endpoint that [subscribes](WebhookEndpoint::subscribes_to)
    /// to its type, due at `now`, `pending` for an enabled endpoint and
    /// `disabled` for a disabled one. A message already queued for an
    /// endpoint (same event id) is skipped, so a redelivered event queues
    /// nothing twice. Returns how many `pending` deliveries were created.
    async fn webhook_enqueue(
        &self,
        tx: &mut Self::Tx,
        messages: &[WebhookMessage],
        now: DateTime<Utc>,
    ) -> Result<u64, StoreError>;
    /// Leases up to `limit` due deliveries (pending, `next_attempt_at <=
    /// now`, not leased or with an expired lease) to `worker` until `now +
    /// lease`, oldest due first, with their endpoints. No endpoint ever has
    /// more than `per_endpoint` deliveries under a live lease, counting
    /// those of every worker: that bounds the concurrency each receiver
    /// sees.
    async fn webhook_claim_due(
        &self,
        worker: &str,
        now: DateTime<Utc>,
        limit: usize,
        per_endpoint: usize,
        lease: Duration,
    ) -> Result<Vec<ClaimedDelivery>, StoreError>;
    /// Records attempts in one transaction: each attempt is added to the
    /// delivery log; its delivery takes the outcome's status, attempt count
    /// and next attempt time and loses its lease, but only while `worker`
    /// still holds it and it is pending (a delivery re-leased by another
    /// worker after this lease expired, or disabled meanwhile, is left as it
    /// is); its endpoint's failure window is updated (a `2xx` ends it, a
    /// failure starts it if it is not running). Returns how many deliveries
    /// were updated.
    async fn webhook_complete(
        &self,
        worker: &str,
        outcomes: &[DeliveryOutcome],
    ) -> Result<u64, StoreError>;
    /// The endpoint's failure window: since when every attempt to it has
    /// failed (`None` while its last attempt succeeded or it had none).
    /// [`StoreError::NotFound`] if there is no such endpoint.
    async fn webhook_failing_since(
        &self,
        endpoint_id: &str,
    ) -> Result<Option<DateTime<Utc>>, StoreError>;
    /// Deletes up to `batch` finished (succeeded, failed or disabled)
    /// deliveries last changed before `before`, with their attempts;
    /// returns how many deliveries.
    async fn webhook_prune(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError>;
}

/// The delivery log, as an operator reads it and sends deliveries again.
#[async_trait]
pub trait WebhookLogStore: Store {
    /// One delivery.
    async fn webhook_delivery_get(&self, id: i64) -> Result<Option<WebhookDelivery>, StoreError>;
    /// Deliveries matching `filter`, newest (highest id) first.
    async fn webhook_delivery_list(
        &self,
        filter: &DeliveryFilter,
    ) -> Result<Vec<WebhookDelivery>, StoreError>;
    /// The attempts of a delivery, oldest first.
    async fn webhook_attempts(&self, delivery_id: i64) -> Result<Vec<DeliveryAttempt>, StoreError>;
    /// Queues one delivery again (manual resend): pending, no attempts, due
    /// at `now`. `false` if it is being attempted right now (live lease) or
    /// its endpoint is disabled. [`StoreError::NotFound`] if there is no
    /// such delivery.
    async fn webhook_resend(
        &self,
        delivery_id: i64,
        now: DateTime<Utc>,
    ) -> Result<bool, StoreError>;
    /// Queues again (like a resend) every delivery of `endpoint_id` queued
    /// in `[from, to)` that failed or was disabled, and also those that
    /// succeeded if `include_succeeded`. Pending ones are left alone.
    /// Returns how many. [`StoreError::NotFound`] if there is no such
    /// endpoint, [`StoreError::Conflict`] if it is disabled.
    async fn webhook_replay(
        &self,
        endpoint_id: &str,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        include_succeeded: bool,
        now: DateTime<Utc>,
    ) -> Result<u64, StoreError>;
}

/// Every webhook capability in one bound: endpoints, deliveries and the
/// log. Code that needs only one of them asks for that one.
pub trait WebhookStore: WebhookEndpointStore + WebhookDeliveryStore + WebhookLogStore {}

impl<S> WebhookStore for S where S: WebhookEndpointStore + WebhookDeliveryStore + WebhookLogStore {}
