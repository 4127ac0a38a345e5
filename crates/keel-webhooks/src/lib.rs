//! Webhooks, sent and received: signed deliveries queued through the store,
//! retried over hours, guarded against SSRF and logged; and an extractor
//! that verifies, dedupes and hands incoming webhooks on.
//!
//! The two checklists, for sending and for receiving, and where each item
//! lives:
//!
//! | sending | here |
//! |---|---|
//! | never send inline from the request that caused the event | [`WebhookOutbox::enqueue`] writes deliveries in the caller's transaction; a [`DeliveryWorker`] sends them |
//! | sign timestamp + raw body with HMAC-SHA256, per-endpoint secret | [`signing`]: Standard Webhooks by default, the `t=<timestamp>,v1=<hex>` format as an option |
//! | two active secrets so customers can rotate without downtime | [`Endpoints::rotate_secret`]: both sign during a grace period |
//! | include an event id; delivery is at least once | `webhook-id` and the body's `id`, the same in every attempt |
//! | include a sequence number or occurredAt | the body's `timestamp` (occurred at) and optional `sequence` ([`WebhookEvent`]) |
//! | retry with exponential backoff and jitter over hours or days | [`WorkerOptions::backoff`]: 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, 10 h, ±20%; `Retry-After` honoured within bounds |
//! | cap the per-attempt timeout hard and the payload size | 10 s for the whole attempt; 256 KiB payloads |
//! | after the window: disable the endpoint, email a human, offer replay | failure window (5 days) or `410 Gone` → disabled + [`EndpointDisabled`] event; [`Endpoints::replay`] |
//! | expose a delivery log with request, response and manual re-send | [`Endpoints::deliveries`], [`Endpoints::attempts`], [`Endpoints::resend`] |
//! | "fetch, don't trust" for sensitive data | payloads are capped; send ids and let receivers call your API |
//! | SSRF: block private ranges, 169.254.169.254, re-validate after redirects | [`ssrf`]: resolved and checked by the guard, connections pinned to checked addresses, every redirect hop checked |
//!
//! | receiving | here |
//! |---|---|
//! | verify the signature on the RAW body, in constant time | [`VerifiedWebhook`] / [`signing::Verifier`] |
//! | reject stale timestamps | ±5 minutes, `400` |
//! | deduplicate on the event id | an in-memory window, or the store's inbox ([`WebhookReceiver::outbox_route`]) |
//! | return 2xx immediately, process asynchronously | [`WebhookReceiver::channel_route`], [`WebhookReceiver::outbox_route`] |
//! | tolerate out-of-order arrival | order by the body's `timestamp` or `sequence` |
//!
//! # Sending, end to end
//!
//! ```text
//! business tx ─ WebhookOutbox::enqueue ─ one delivery row per subscribed endpoint (same commit)
//!                                                     │
//! DeliveryWorker ─ claim due rows (lease, ≤ 16 per endpoint) ─ sign ─ POST via the SSRF-guarded client
//!               └ record attempts in batches ─ succeeded / retry at next_attempt_at / failed / endpoint disabled
//! ```
//!
//! Events consumed from the broker (the outbox-consumer path) are queued by
//! [`WebhookFanout`], a consumer handler, in the consumer's transaction.
//!
//! The worker polls for due rows ([`WorkerOptions::poll_interval`]);
//! [`DeliveryWorker::notify`] after a commit makes it claim at once, and a
//! store's cross-process wake-up (PostgreSQL's `LISTEN`) can call it too.

#![cfg_attr(docsrs, feature(doc_cfg))]
mod attempt;
mod clock;
mod endpoints;
mod error;
mod log;
mod options;
pub mod receiver;
pub mod sealing;
mod sender;
pub mod signing;
pub mod ssrf;
pub mod wire;
mod worker;

pub use clock::WallClock;
pub use endpoints::{
    DEFAULT_ROTATION_GRACE, Endpoints, MAX_DESCRIPTION_LEN, MAX_EVENT_TYPES, NewEndpoint,
};
pub use error::WebhookError;
pub use options::{
    DEFAULT_BATCH, DEFAULT_DRAIN_TIMEOUT, DEFAULT_FAILURE_WINDOW, DEFAULT_JITTER,
    DEFAULT_MAX_IN_FLIGHT, DEFAULT_MAX_REDIRECTS, DEFAULT_MAX_RESPONSE_BODY,
    DEFAULT_MAX_RETRY_AFTER, DEFAULT_PER_ENDPOINT, DEFAULT_POLL_INTERVAL, DEFAULT_SCHEDULE,
    DEFAULT_TIMEOUT, DisableReason, DisabledCallback, EndpointDisabled, LEASE_MARGIN,
    WorkerOptions,
};
pub use receiver::{VerifiedWebhook, WebhookReceiver, WebhookRejection};
pub use sender::{
    DEFAULT_MAX_PAYLOAD, MAX_EVENT_TYPE_LEN, WebhookEvent, WebhookFanout, WebhookOutbox,
};
pub use wire::DEFAULT_SOURCE;
pub use worker::{BatchReport, DeliveryWorker};

/// The storage types, re-exported so using webhooks needs no direct
/// dependency on `keel-messaging`'s module paths.
pub use keel_store::{
    DeliveryAttempt, DeliveryFilter, DeliveryStatus, WebhookDelivery, WebhookEndpoint,
    WebhookFormat, WebhookStore,
};
