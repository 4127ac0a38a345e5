//! The [`WebhookStore`] conformance suite: what every backend behind the
//! webhook sender must do.
//!
//! The sender's promises rest on a few storage properties, checked here
//! through the trait alone: deliveries are queued in the caller's
//! transaction (and vanish with its rollback), once per endpoint and event;
//! a claim leases only due deliveries of enabled endpoints and never puts
//! more than `per_endpoint` of one endpoint in flight; a completion counts
//! only while its lease is held; a disabled endpoint has no pending
//! deliveries; resend and replay re-queue exactly what they say.
//!
//! Every time is passed in explicitly, so the tests need no clock.
//!
//! Run it from a backend's integration tests with
//! [`webhook_conformance_tests!`](crate::webhook_conformance_tests), giving
//! an async expression that makes a *fresh, empty* store (or a
//! [`Fixture`](crate::store_suite::Fixture)):
//!
//! ```ignore
//! keel_testkit::webhook_conformance_tests!(async {
//!     let dir = tempfile::tempdir().expect("temp dir");
//!     let store = SqliteStore::open(dir.path().join("keel.db")).await.expect("open");
//!     keel_testkit::store_suite::Fixture::new(store).keep_alive(dir)
//! });
//! ```
//!
//! [`WebhookStore`]: keel_store::WebhookStore

use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use keel_store::{
    DeliveryAttempt, DeliveryFilter, DeliveryOutcome, DeliveryStatus, WebhookDelivery,
    WebhookEndpoint, WebhookMessage, WebhookStore,
};

use crate::store_suite::at_ms;

mod deliveries;
mod endpoints;
mod log;

pub use deliveries::*;
pub use endpoints::*;
pub use log::*;

/// The suite's "now": a fixed instant, so every test is deterministic.
pub fn t0() -> DateTime<Utc> {
    at_ms(1_800_000_000_000)
}

/// `t0` plus `secs` seconds.
pub fn t(secs: i64) -> DateTime<Utc> {
    t0() + chrono::Duration::seconds(secs)
}

const LEASE: Duration = Duration::from_secs(60);

/// An enabled endpoint `id` subscribed to `event_types` (empty: all), with
/// one secret.
pub fn endpoint(id: &str, event_types: &[&str]) -> WebhookEndpoint {
    WebhookEndpoint {
        description: format!("endpoint {id}"),
        event_types: event_types.iter().map(|s| (*s).to_owned()).collect(),
        ..WebhookEndpoint::registered(
            id,
            format!("https://hooks.example.com/{id}"),
            "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
            t0(),
        )
    }
}

/// The trace every [`message`] was queued in.
pub const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// A message for event `event_id` of `event_type`.
pub fn message(event_id: &str, event_type: &str) -> WebhookMessage {
    WebhookMessage {
        event_id: event_id.to_owned(),
        event_type: event_type.to_owned(),
        payload: Bytes::from(format!(
            r#"{{"id":"{event_id}","type":"{event_type}","data":{{}}}}"#
        )),
        traceparent: Some(TRACEPARENT.to_owned()),
    }
}

async fn create<S: WebhookStore>(store: &S, endpoint: &WebhookEndpoint) {
    store
        .webhook_endpoint_create(endpoint)
        .await
        .expect("webhook_endpoint_create");
}

/// Queues `messages` at `now` in a transaction of its own.
pub async fn enqueue<S: WebhookStore>(
    store: &S,
    messages: &[WebhookMessage],
    now: DateTime<Utc>,
) -> u64 {
    let mut tx = store.begin().await.expect("begin");
    let queued = store
        .webhook_enqueue(&mut tx, messages, now)
        .await
        .expect("webhook_enqueue");
    store.commit(tx).await.expect("commit");
    queued
}

/// Delivery `id`, which must exist.
async fn delivery<S: WebhookStore>(store: &S, id: i64) -> WebhookDelivery {
    store
        .webhook_delivery_get(id)
        .await
        .expect("webhook_delivery_get")
        .expect("the delivery exists")
}

/// Endpoint `id`, which must exist.
async fn endpoint_named<S: WebhookStore>(store: &S, id: &str) -> WebhookEndpoint {
    store
        .webhook_endpoint_get(id)
        .await
        .expect("webhook_endpoint_get")
        .expect("the endpoint exists")
}

async fn deliveries<S: WebhookStore>(store: &S, endpoint_id: &str) -> Vec<WebhookDelivery> {
    let mut list = store
        .webhook_delivery_list(&DeliveryFilter {
            endpoint_id: Some(endpoint_id.to_owned()),
            ..DeliveryFilter::default()
        })
        .await
        .expect("webhook_delivery_list");
    list.reverse();
    list
}

/// An attempt at `delivery_id` answered with `status` (or no response).
pub fn attempt(
    delivery_id: i64,
    n: u32,
    at: DateTime<Utc>,
    status: Option<u16>,
) -> DeliveryAttempt {
    DeliveryAttempt {
        delivery_id,
        attempt: n,
        at,
        url: "https://hooks.example.com/a".to_owned(),
        request_headers: vec![
            ("webhook-id".to_owned(), "evt-1".to_owned()),
            ("webhook-timestamp".to_owned(), at.timestamp().to_string()),
        ],
        response_status: status,
        response_body: status.map(|s| format!("status {s}")),
        latency: Duration::from_millis(12),
        error: status.is_none().then(|| "timed out after 10s".to_owned()),
    }
}

fn outcome(
    delivery_id: i64,
    n: u32,
    at: DateTime<Utc>,
    http: Option<u16>,
    status: DeliveryStatus,
    next: Option<DateTime<Utc>>,
) -> DeliveryOutcome {
    DeliveryOutcome {
        attempt: attempt(delivery_id, n, at, http),
        status,
        next_attempt_at: next,
    }
}

/// Expands into one `#[tokio::test]` per [`WebhookStore`] behaviour, each
/// against the store made by `$make` (an async expression yielding a store
/// or a [`Fixture`](crate::store_suite::Fixture)). The tests are named
/// `webhook_conformance::<behaviour>`. See the [module docs](crate::webhook_suite).
///
/// [`WebhookStore`]: keel_store::WebhookStore
#[macro_export]
macro_rules! webhook_conformance_tests {
    ($make:expr) => {
        $crate::__webhook_conformance_tests! {
            $make;
            endpoints_round_trip,
            rotation_keeps_at_most_two_secrets,
            enqueue_fans_out_to_subscribed_endpoints,
            enqueue_is_idempotent_and_transactional,
            claim_leases_due_deliveries,
            claim_bounds_deliveries_in_flight_per_endpoint,
            complete_records_attempts_and_failure_window,
            failure_window_restarts_after_a_success,
            completion_without_the_lease_changes_nothing,
            disable_and_enable,
            resend_requeues_one_delivery,
            replay_requeues_a_time_range,
            delivery_list_filters_and_pages,
            prune_deletes_finished_deliveries,
            delete_endpoint_removes_its_deliveries,
        }
    };
}

/// The expansion of [`webhook_conformance_tests!`]; not for direct use.
#[doc(hidden)]
#[macro_export]
macro_rules! __webhook_conformance_tests {
    ($make:expr; $($test:ident),* $(,)?) => {
        mod webhook_conformance {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    let fixture = $crate::store_suite::Fixture::from($make.await);
                    $crate::webhook_suite::$test(fixture.store()).await;
                }
            )*
        }
    };
}
