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
//! [`WebhookStore`]: keel_messaging::store::WebhookStore

use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use keel_messaging::StoreError;
use keel_messaging::store::{
    DeliveryAttempt, DeliveryFilter, DeliveryOutcome, DeliveryStatus, WebhookDelivery,
    WebhookEndpoint, WebhookMessage, WebhookSecret, WebhookStore,
};

use crate::store_suite::at_ms;

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
        id: id.to_owned(),
        url: format!("https://hooks.example.com/{id}"),
        description: format!("endpoint {id}"),
        event_types: event_types.iter().map(|s| (*s).to_owned()).collect(),
        secrets: vec![WebhookSecret {
            secret: "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".to_owned(),
            created_at: t0(),
            expires_at: None,
        }],
        enabled: true,
        disabled_reason: None,
        disabled_at: None,
        failing_since: None,
        last_success_at: None,
        created_at: t0(),
        updated_at: t0(),
        tenant: String::new(),
        format: Default::default(),
    }
}

/// A message for event `event_id` of `event_type`.
pub fn message(event_id: &str, event_type: &str) -> WebhookMessage {
    WebhookMessage {
        event_id: event_id.to_owned(),
        event_type: event_type.to_owned(),
        payload: Bytes::from(format!(
            r#"{{"id":"{event_id}","type":"{event_type}","data":{{}}}}"#
        )),
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

/// Endpoints read back field for field; ids are unique; updates change the
/// settings only; unknown ids are `NotFound`.
pub async fn endpoints_round_trip<S: WebhookStore>(store: &S) {
    let a = endpoint("ep-a", &["order.*"]);
    let mut b = endpoint("ep-b", &[]);
    b.created_at = t(1);
    b.updated_at = t(1);
    b.format = keel_messaging::store::WebhookFormat::CloudeventsBinary;
    create(store, &a).await;
    create(store, &b).await;
    assert_eq!(
        store.webhook_endpoint_get("ep-a").await.expect("get"),
        Some(a.clone())
    );
    assert_eq!(store.webhook_endpoint_get("nope").await.expect("get"), None);
    assert_eq!(
        store.webhook_endpoint_list().await.expect("list"),
        vec![a.clone(), b]
    );
    let err = store
        .webhook_endpoint_create(&a)
        .await
        .expect_err("duplicate id");
    assert!(matches!(err, StoreError::Conflict(_)), "{err:?}");

    let mut changed = a.clone();
    changed.url = "https://new.example.com/hook".into();
    changed.description = "moved".into();
    changed.event_types = vec!["invoice.paid".into()];
    changed.enabled = false; // not an update's business
    changed.secrets.clear(); // nor this
    store
        .webhook_endpoint_update(&changed, t(5))
        .await
        .expect("update");
    let stored = store
        .webhook_endpoint_get("ep-a")
        .await
        .expect("get")
        .expect("endpoint");
    assert_eq!(stored.url, changed.url);
    assert_eq!(stored.description, "moved");
    assert_eq!(stored.event_types, vec!["invoice.paid".to_owned()]);
    assert!(stored.enabled);
    assert_eq!(stored.secrets, a.secrets);
    assert_eq!(stored.updated_at, t(5));

    let err = store
        .webhook_endpoint_update(&endpoint("ghost", &[]), t(5))
        .await
        .expect_err("unknown");
    assert!(matches!(err, StoreError::NotFound(_)), "{err:?}");
}

/// A rotation keeps the newest current secret until the grace period ends
/// and drops every older one: never more than two secrets.
pub async fn rotation_keeps_at_most_two_secrets<S: WebhookStore>(store: &S) {
    create(store, &endpoint("ep", &[])).await;
    let second = WebhookSecret {
        secret: "whsec_c2Vjb25kIHNlY3JldCBrZXkgYnl0ZXM=".into(),
        created_at: t(10),
        expires_at: None,
    };
    let rotated = store
        .webhook_endpoint_rotate_secret("ep", &second, t(3600))
        .await
        .expect("rotate");
    assert_eq!(rotated.secrets.len(), 2);
    assert_eq!(
        rotated.secrets[0].expires_at,
        Some(t(3600)),
        "old one signs until the grace ends"
    );
    assert_eq!(rotated.secrets[1], second);
    let active: Vec<_> = rotated.active_secrets(t(60)).collect();
    assert_eq!(active.len(), 2, "both sign during the grace period");
    let active: Vec<_> = rotated.active_secrets(t(3600)).collect();
    assert_eq!(active, vec![&second], "only the new one afterwards");

    let third = WebhookSecret {
        secret: "whsec_dGhpcmQgc2VjcmV0IGtleSBieXRlcyEh".into(),
        created_at: t(20),
        expires_at: None,
    };
    let rotated = store
        .webhook_endpoint_rotate_secret("ep", &third, t(7200))
        .await
        .expect("rotate");
    assert_eq!(rotated.secrets.len(), 2, "the oldest secret is dropped");
    assert_eq!(rotated.secrets[0].secret, second.secret);
    assert_eq!(rotated.secrets[0].expires_at, Some(t(7200)));
    assert_eq!(rotated.secrets[1], third);
    assert_eq!(
        store.webhook_endpoint_get("ep").await.expect("get"),
        Some(rotated)
    );

    let err = store
        .webhook_endpoint_rotate_secret("ghost", &third, t(1))
        .await
        .expect_err("unknown");
    assert!(matches!(err, StoreError::NotFound(_)), "{err:?}");
}

/// One delivery per subscribed endpoint: pending for enabled ones,
/// disabled for disabled ones, none for endpoints filtering the type out.
pub async fn enqueue_fans_out_to_subscribed_endpoints<S: WebhookStore>(store: &S) {
    create(store, &endpoint("all", &[])).await;
    create(store, &endpoint("orders", &["order.*"])).await;
    create(store, &endpoint("invoices", &["invoice.paid"])).await;
    create(store, &endpoint("off", &[])).await;
    assert!(
        store
            .webhook_endpoint_disable("off", "operator", t0())
            .await
            .expect("disable")
    );

    let queued = enqueue(store, &[message("evt-1", "order.paid")], t0()).await;
    assert_eq!(queued, 2, "all + orders");
    for id in ["all", "orders"] {
        let list = deliveries(store, id).await;
        assert_eq!(list.len(), 1, "{id}");
        let d = &list[0];
        assert_eq!((d.status, d.attempts), (DeliveryStatus::Pending, 0));
        assert_eq!(
            (d.event_id.as_str(), d.event_type.as_str()),
            ("evt-1", "order.paid")
        );
        assert_eq!(d.payload, message("evt-1", "order.paid").payload);
        assert_eq!((d.next_attempt_at, d.created_at), (t0(), t0()));
        assert_eq!((d.leased_by.as_deref(), d.leased_until), (None, None));
    }
    assert!(
        deliveries(store, "invoices").await.is_empty(),
        "filtered out"
    );
    let off = deliveries(store, "off").await;
    assert_eq!(off.len(), 1);
    assert_eq!(
        off[0].status,
        DeliveryStatus::Disabled,
        "kept for a later replay"
    );

    // `order.*` does not match `orders.paid` or `order` itself.
    enqueue(
        store,
        &[message("evt-2", "orders.paid"), message("evt-3", "order")],
        t0(),
    )
    .await;
    assert_eq!(deliveries(store, "orders").await.len(), 1);
    assert_eq!(deliveries(store, "all").await.len(), 3);
}

/// The same event queued again (a redelivered outbox event) creates
/// nothing; a rolled-back enqueue leaves nothing.
pub async fn enqueue_is_idempotent_and_transactional<S: WebhookStore>(store: &S) {
    create(store, &endpoint("ep", &[])).await;
    assert_eq!(enqueue(store, &[message("evt-1", "a")], t0()).await, 1);
    assert_eq!(enqueue(store, &[message("evt-1", "a")], t(5)).await, 0);
    assert_eq!(deliveries(store, "ep").await.len(), 1);

    let mut tx = store.begin().await.expect("begin");
    let queued = store
        .webhook_enqueue(&mut tx, &[message("evt-2", "a")], t0())
        .await
        .expect("enqueue");
    assert_eq!(queued, 1);
    store.rollback(tx).await.expect("rollback");
    assert_eq!(
        deliveries(store, "ep").await.len(),
        1,
        "rolled back with the caller"
    );
    assert_eq!(enqueue(store, &[], t0()).await, 0);
}

/// A claim leases due deliveries only, oldest due first; leased ones are
/// skipped by every worker until the lease ends.
pub async fn claim_leases_due_deliveries<S: WebhookStore>(store: &S) {
    create(store, &endpoint("ep", &[])).await;
    enqueue(store, &[message("evt-1", "a")], t(0)).await;
    enqueue(store, &[message("evt-2", "a")], t(1)).await;
    enqueue(store, &[message("evt-3", "a")], t(100)).await;

    let claimed = store
        .webhook_claim_due("w1", t(10), 10, 10, LEASE)
        .await
        .expect("claim");
    let events: Vec<_> = claimed
        .iter()
        .map(|c| c.delivery.event_id.as_str())
        .collect();
    assert_eq!(events, ["evt-1", "evt-2"], "due only, oldest first");
    assert_eq!(claimed[0].endpoint, endpoint("ep", &[]));
    assert_eq!(claimed[0].delivery.leased_by.as_deref(), Some("w1"));
    assert_eq!(
        claimed[0].delivery.leased_until,
        Some(t(10) + chrono::Duration::seconds(60))
    );

    let again = store
        .webhook_claim_due("w2", t(20), 10, 10, LEASE)
        .await
        .expect("claim");
    assert!(again.is_empty(), "leased deliveries are skipped: {again:?}");
    // The lease ended: another worker takes them over (w1 presumed dead).
    let taken = store
        .webhook_claim_due("w2", t(71), 10, 10, LEASE)
        .await
        .expect("claim");
    assert_eq!(taken.len(), 2);
    assert!(
        taken
            .iter()
            .all(|c| c.delivery.leased_by.as_deref() == Some("w2"))
    );
    let later = store
        .webhook_claim_due("w3", t(120), 10, 10, LEASE)
        .await
        .expect("claim");
    let events: Vec<_> = later.iter().map(|c| c.delivery.event_id.as_str()).collect();
    assert_eq!(events, ["evt-3"]);
    assert!(
        store
            .webhook_claim_due("w3", t(200), 0, 10, LEASE)
            .await
            .expect("claim")
            .is_empty()
    );
}

/// No endpoint ever has more than `per_endpoint` deliveries in flight,
/// across claims and workers, and `limit` bounds each claim.
pub async fn claim_bounds_deliveries_in_flight_per_endpoint<S: WebhookStore>(store: &S) {
    create(store, &endpoint("a", &[])).await;
    create(store, &endpoint("b", &[])).await;
    let messages: Vec<_> = (0..10).map(|i| message(&format!("evt-{i}"), "x")).collect();
    enqueue(store, &messages, t0()).await;

    let first = store
        .webhook_claim_due("w1", t(1), 100, 3, LEASE)
        .await
        .expect("claim");
    let count = |claimed: &[keel_messaging::store::ClaimedDelivery], ep: &str| {
        claimed
            .iter()
            .filter(|c| c.delivery.endpoint_id == ep)
            .count()
    };
    assert_eq!((count(&first, "a"), count(&first, "b")), (3, 3));
    let second = store
        .webhook_claim_due("w2", t(2), 100, 3, LEASE)
        .await
        .expect("claim");
    assert!(
        second.is_empty(),
        "both endpoints are at their limit: {second:?}"
    );

    // One of a's finishes: exactly one more of a's may go.
    let done = first
        .iter()
        .find(|c| c.delivery.endpoint_id == "a")
        .expect("a");
    let applied = store
        .webhook_complete(
            "w1",
            &[outcome(
                done.delivery.id,
                1,
                t(3),
                Some(200),
                DeliveryStatus::Succeeded,
                None,
            )],
        )
        .await
        .expect("complete");
    assert_eq!(applied, 1);
    let third = store
        .webhook_claim_due("w2", t(4), 100, 3, LEASE)
        .await
        .expect("claim");
    assert_eq!((count(&third, "a"), count(&third, "b")), (1, 0));

    let limited = store
        .webhook_claim_due("w3", t(100), 2, 10, LEASE)
        .await
        .expect("claim");
    assert_eq!(limited.len(), 2, "limit bounds the claim");
}

/// Completion logs each attempt, moves the delivery and releases its lease,
/// and keeps the endpoint's failure window.
pub async fn complete_records_attempts_and_failure_window<S: WebhookStore>(store: &S) {
    create(store, &endpoint("ep", &[])).await;
    enqueue(store, &[message("evt-1", "a"), message("evt-2", "a")], t0()).await;
    let claimed = store
        .webhook_claim_due("w", t(1), 10, 10, LEASE)
        .await
        .expect("claim");
    let (d1, d2) = (claimed[0].delivery.id, claimed[1].delivery.id);
    assert_eq!(
        store.webhook_failing_since("ep").await.expect("window"),
        None
    );

    let applied = store
        .webhook_complete(
            "w",
            &[
                outcome(d1, 1, t(2), Some(500), DeliveryStatus::Pending, Some(t(7))),
                outcome(d2, 1, t(3), None, DeliveryStatus::Pending, Some(t(8))),
            ],
        )
        .await
        .expect("complete");
    assert_eq!(applied, 2);
    let first = store
        .webhook_delivery_get(d1)
        .await
        .expect("get")
        .expect("delivery");
    assert_eq!(
        (first.status, first.attempts, first.next_attempt_at),
        (DeliveryStatus::Pending, 1, t(7))
    );
    assert_eq!((first.leased_by, first.leased_until), (None, None));
    assert_eq!(first.updated_at, t(2));
    assert_eq!(
        store.webhook_failing_since("ep").await.expect("window"),
        Some(t(2))
    );
    assert_eq!(
        store.webhook_attempts(d2).await.expect("attempts"),
        vec![attempt(d2, 1, t(3), None)]
    );

    let claimed = store
        .webhook_claim_due("w", t(10), 10, 10, LEASE)
        .await
        .expect("claim");
    assert_eq!(claimed.len(), 2);
    store
        .webhook_complete(
            "w",
            &[
                outcome(d1, 2, t(11), Some(503), DeliveryStatus::Failed, None),
                outcome(d2, 2, t(12), Some(204), DeliveryStatus::Succeeded, None),
            ],
        )
        .await
        .expect("complete");
    let first = store
        .webhook_delivery_get(d1)
        .await
        .expect("get")
        .expect("delivery");
    assert_eq!((first.status, first.attempts), (DeliveryStatus::Failed, 2));
    let second = store
        .webhook_delivery_get(d2)
        .await
        .expect("get")
        .expect("delivery");
    assert_eq!(
        (second.status, second.attempts),
        (DeliveryStatus::Succeeded, 2)
    );
    assert_eq!(
        store.webhook_attempts(d1).await.expect("attempts"),
        vec![
            attempt(d1, 1, t(2), Some(500)),
            attempt(d1, 2, t(11), Some(503))
        ],
        "the log keeps every attempt, oldest first"
    );
    assert_eq!(
        store.webhook_failing_since("ep").await.expect("window"),
        None,
        "a success ends it"
    );
    let ep = store
        .webhook_endpoint_get("ep")
        .await
        .expect("get")
        .expect("endpoint");
    assert_eq!(ep.last_success_at, Some(t(12)));
    assert!(
        store
            .webhook_claim_due("w", t(100), 10, 10, LEASE)
            .await
            .expect("claim")
            .is_empty()
    );

    let err = store
        .webhook_failing_since("ghost")
        .await
        .expect_err("unknown");
    assert!(matches!(err, StoreError::NotFound(_)), "{err:?}");
}

/// A failure after the latest success starts a new window at that failure.
pub async fn failure_window_restarts_after_a_success<S: WebhookStore>(store: &S) {
    create(store, &endpoint("ep", &[])).await;
    let messages: Vec<_> = (0..3).map(|i| message(&format!("evt-{i}"), "a")).collect();
    enqueue(store, &messages, t0()).await;
    let c = store
        .webhook_claim_due("w", t(1), 10, 10, LEASE)
        .await
        .expect("claim");
    store
        .webhook_complete(
            "w",
            &[
                outcome(
                    c[0].delivery.id,
                    1,
                    t(2),
                    Some(500),
                    DeliveryStatus::Pending,
                    Some(t(50)),
                ),
                outcome(
                    c[1].delivery.id,
                    1,
                    t(3),
                    Some(200),
                    DeliveryStatus::Succeeded,
                    None,
                ),
                outcome(
                    c[2].delivery.id,
                    1,
                    t(4),
                    Some(502),
                    DeliveryStatus::Pending,
                    Some(t(50)),
                ),
            ],
        )
        .await
        .expect("complete");
    assert_eq!(
        store.webhook_failing_since("ep").await.expect("window"),
        Some(t(4))
    );
}

/// A completion by a worker whose lease another worker took over is logged
/// but changes nothing; so is one for a delivery disabled meanwhile.
pub async fn completion_without_the_lease_changes_nothing<S: WebhookStore>(store: &S) {
    create(store, &endpoint("ep", &[])).await;
    enqueue(store, &[message("evt-1", "a")], t0()).await;
    let id = store
        .webhook_claim_due("w1", t(1), 1, 1, Duration::from_secs(5))
        .await
        .expect("claim")[0]
        .delivery
        .id;
    let taken = store
        .webhook_claim_due("w2", t(10), 1, 1, LEASE)
        .await
        .expect("claim");
    assert_eq!(taken.len(), 1, "w1's lease ended");
    let applied = store
        .webhook_complete(
            "w1",
            &[outcome(
                id,
                1,
                t(11),
                Some(200),
                DeliveryStatus::Succeeded,
                None,
            )],
        )
        .await
        .expect("complete");
    assert_eq!(applied, 0);
    let d = store
        .webhook_delivery_get(id)
        .await
        .expect("get")
        .expect("delivery");
    assert_eq!(
        (d.status, d.leased_by.as_deref()),
        (DeliveryStatus::Pending, Some("w2"))
    );
    assert_eq!(
        store.webhook_attempts(id).await.expect("attempts").len(),
        1,
        "still logged"
    );

    assert!(
        store
            .webhook_endpoint_disable("ep", "gone", t(12))
            .await
            .expect("disable")
    );
    let applied = store
        .webhook_complete(
            "w2",
            &[outcome(
                id,
                1,
                t(13),
                Some(500),
                DeliveryStatus::Pending,
                Some(t(20)),
            )],
        )
        .await
        .expect("complete");
    assert_eq!(applied, 0);
    let d = store
        .webhook_delivery_get(id)
        .await
        .expect("get")
        .expect("delivery");
    assert_eq!(d.status, DeliveryStatus::Disabled);
}

/// Disabling parks pending deliveries (and keeps them out of claims);
/// enabling clears the reason and the failure window; new events flow again.
pub async fn disable_and_enable<S: WebhookStore>(store: &S) {
    create(store, &endpoint("ep", &[])).await;
    enqueue(store, &[message("evt-1", "a"), message("evt-2", "a")], t0()).await;
    store
        .webhook_claim_due("w", t(1), 1, 10, LEASE)
        .await
        .expect("claim");
    let c = store
        .webhook_claim_due("w", t(1), 1, 10, LEASE)
        .await
        .expect("claim");
    store
        .webhook_complete(
            "w",
            &[outcome(
                c[0].delivery.id,
                1,
                t(2),
                Some(500),
                DeliveryStatus::Pending,
                Some(t(3)),
            )],
        )
        .await
        .expect("complete");

    assert!(
        store
            .webhook_endpoint_disable("ep", "410 Gone", t(5))
            .await
            .expect("disable")
    );
    assert!(
        !store
            .webhook_endpoint_disable("ep", "again", t(6))
            .await
            .expect("disable")
    );
    let ep = store
        .webhook_endpoint_get("ep")
        .await
        .expect("get")
        .expect("endpoint");
    assert!(!ep.enabled);
    assert_eq!(ep.disabled_reason.as_deref(), Some("410 Gone"));
    assert_eq!(ep.disabled_at, Some(t(5)));
    for d in deliveries(store, "ep").await {
        assert_eq!(d.status, DeliveryStatus::Disabled);
        assert_eq!(d.leased_until, None, "leases released");
    }
    assert!(
        store
            .webhook_claim_due("w", t(100), 10, 10, LEASE)
            .await
            .expect("claim")
            .is_empty()
    );

    assert!(
        store
            .webhook_endpoint_enable("ep", t(7))
            .await
            .expect("enable")
    );
    assert!(
        !store
            .webhook_endpoint_enable("ep", t(8))
            .await
            .expect("enable")
    );
    let ep = store
        .webhook_endpoint_get("ep")
        .await
        .expect("get")
        .expect("endpoint");
    assert!(ep.enabled);
    assert_eq!(
        (ep.disabled_reason, ep.disabled_at, ep.failing_since),
        (None, None, None)
    );
    assert!(
        store
            .webhook_claim_due("w", t(100), 10, 10, LEASE)
            .await
            .expect("claim")
            .is_empty(),
        "parked deliveries wait for a replay"
    );
    assert_eq!(enqueue(store, &[message("evt-3", "a")], t(9)).await, 1);
    assert_eq!(
        store
            .webhook_claim_due("w", t(100), 10, 10, LEASE)
            .await
            .expect("claim")
            .len(),
        1
    );

    for result in [
        store.webhook_endpoint_disable("ghost", "x", t0()).await,
        store.webhook_endpoint_enable("ghost", t0()).await,
    ] {
        assert!(matches!(result, Err(StoreError::NotFound(_))), "{result:?}");
    }
}

/// A resend re-queues one delivery from scratch, unless it is in flight or
/// its endpoint is disabled.
pub async fn resend_requeues_one_delivery<S: WebhookStore>(store: &S) {
    create(store, &endpoint("ep", &[])).await;
    enqueue(store, &[message("evt-1", "a")], t0()).await;
    let id = store
        .webhook_claim_due("w", t(1), 1, 1, LEASE)
        .await
        .expect("claim")[0]
        .delivery
        .id;
    assert!(
        !store.webhook_resend(id, t(2)).await.expect("resend"),
        "in flight"
    );
    store
        .webhook_complete(
            "w",
            &[outcome(
                id,
                1,
                t(3),
                Some(200),
                DeliveryStatus::Succeeded,
                None,
            )],
        )
        .await
        .expect("complete");

    assert!(store.webhook_resend(id, t(100)).await.expect("resend"));
    let d = store
        .webhook_delivery_get(id)
        .await
        .expect("get")
        .expect("delivery");
    assert_eq!(
        (d.status, d.attempts, d.next_attempt_at),
        (DeliveryStatus::Pending, 0, t(100))
    );
    let again = store
        .webhook_claim_due("w", t(100), 10, 10, LEASE)
        .await
        .expect("claim");
    assert_eq!(again.len(), 1);
    assert_eq!(again[0].delivery.id, id);
    store
        .webhook_complete(
            "w",
            &[outcome(
                id,
                1,
                t(101),
                Some(200),
                DeliveryStatus::Succeeded,
                None,
            )],
        )
        .await
        .expect("complete");
    assert_eq!(
        store.webhook_attempts(id).await.expect("attempts").len(),
        2,
        "both rounds logged"
    );

    store
        .webhook_endpoint_disable("ep", "operator", t(200))
        .await
        .expect("disable");
    assert!(
        !store.webhook_resend(id, t(201)).await.expect("resend"),
        "endpoint disabled"
    );
    let err = store
        .webhook_resend(9_999_999, t(1))
        .await
        .expect_err("unknown");
    assert!(matches!(err, StoreError::NotFound(_)), "{err:?}");
}

/// A replay re-queues the failed and disabled deliveries queued in the time
/// range (and the succeeded ones when asked), and nothing else.
pub async fn replay_requeues_a_time_range<S: WebhookStore>(store: &S) {
    create(store, &endpoint("ep", &[])).await;
    create(store, &endpoint("other", &[])).await;
    for (i, at) in [(1, 10), (2, 20), (3, 30), (4, 40)] {
        enqueue(store, &[message(&format!("evt-{i}"), "a")], t(at)).await;
    }
    // evt-1..3 fail on ep (evt-3 succeeds on it instead), then ep is disabled.
    let claimed = store
        .webhook_claim_due("w", t(50), 100, 100, LEASE)
        .await
        .expect("claim");
    let outcomes: Vec<_> = claimed
        .iter()
        .filter(|c| c.delivery.endpoint_id == "ep" && c.delivery.event_id != "evt-4")
        .map(|c| {
            if c.delivery.event_id == "evt-3" {
                outcome(
                    c.delivery.id,
                    1,
                    t(51),
                    Some(200),
                    DeliveryStatus::Succeeded,
                    None,
                )
            } else {
                outcome(
                    c.delivery.id,
                    1,
                    t(51),
                    Some(500),
                    DeliveryStatus::Failed,
                    None,
                )
            }
        })
        .collect();
    store
        .webhook_complete("w", &outcomes)
        .await
        .expect("complete");
    store
        .webhook_endpoint_disable("ep", "failing", t(60))
        .await
        .expect("disable");
    let err = store
        .webhook_replay("ep", t(0), t(100), false, t(61))
        .await
        .expect_err("disabled");
    assert!(matches!(err, StoreError::Conflict(_)), "{err:?}");
    store
        .webhook_endpoint_enable("ep", t(62))
        .await
        .expect("enable");

    // [20 s, 40 s): evt-2 (failed) and evt-3 (succeeded, not asked for).
    assert_eq!(
        store
            .webhook_replay("ep", t(20), t(40), false, t(70))
            .await
            .expect("replay"),
        1
    );
    let by_event = |list: Vec<WebhookDelivery>| {
        list.into_iter()
            .map(|d| (d.event_id, d.status))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        by_event(deliveries(store, "ep").await),
        vec![
            ("evt-1".to_owned(), DeliveryStatus::Failed),
            ("evt-2".to_owned(), DeliveryStatus::Pending),
            ("evt-3".to_owned(), DeliveryStatus::Succeeded),
            ("evt-4".to_owned(), DeliveryStatus::Disabled),
        ]
    );
    let filter = DeliveryFilter {
        endpoint_id: Some("ep".into()),
        event_id: Some("evt-2".into()),
        ..DeliveryFilter::default()
    };
    let replayed = store.webhook_delivery_list(&filter).await.expect("list");
    assert_eq!(
        (replayed[0].attempts, replayed[0].next_attempt_at),
        (0, t(70))
    );

    // Everything from 0 s, succeeded ones included; pending ones untouched.
    assert_eq!(
        store
            .webhook_replay("ep", t(0), t(100), true, t(80))
            .await
            .expect("replay"),
        3
    );
    assert!(
        deliveries(store, "ep")
            .await
            .iter()
            .all(|d| d.status == DeliveryStatus::Pending)
    );
    assert_eq!(
        by_event(deliveries(store, "other").await).len(),
        4,
        "other endpoints are not touched"
    );
    let err = store
        .webhook_replay("ghost", t(0), t(1), false, t(1))
        .await
        .expect_err("unknown");
    assert!(matches!(err, StoreError::NotFound(_)), "{err:?}");
}

/// The delivery list filters and pages newest first.
pub async fn delivery_list_filters_and_pages<S: WebhookStore>(store: &S) {
    create(store, &endpoint("a", &[])).await;
    create(store, &endpoint("b", &["only.this"])).await;
    for i in 0..5 {
        enqueue(store, &[message(&format!("evt-{i}"), "x")], t(i)).await;
    }
    let all = store
        .webhook_delivery_list(&DeliveryFilter::default())
        .await
        .expect("list");
    assert_eq!(all.len(), 5);
    assert!(all.windows(2).all(|w| w[0].id > w[1].id), "newest first");

    let page = store
        .webhook_delivery_list(&DeliveryFilter {
            limit: Some(2),
            ..DeliveryFilter::default()
        })
        .await
        .expect("list");
    let next = store
        .webhook_delivery_list(&DeliveryFilter {
            limit: Some(2),
            before_id: Some(page[1].id),
            ..DeliveryFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(
        next[0].id, all[2].id,
        "keyset paging continues where the page ended"
    );

    let ranged = store
        .webhook_delivery_list(&DeliveryFilter {
            endpoint_id: Some("a".into()),
            created_from: Some(t(1)),
            created_before: Some(t(3)),
            ..DeliveryFilter::default()
        })
        .await
        .expect("list");
    let events: Vec<_> = ranged.iter().map(|d| d.event_id.as_str()).collect();
    assert_eq!(events, ["evt-2", "evt-1"]);

    let c = store
        .webhook_claim_due("w", t(10), 1, 10, LEASE)
        .await
        .expect("claim");
    store
        .webhook_complete(
            "w",
            &[outcome(
                c[0].delivery.id,
                1,
                t(11),
                Some(200),
                DeliveryStatus::Succeeded,
                None,
            )],
        )
        .await
        .expect("complete");
    let succeeded = store
        .webhook_delivery_list(&DeliveryFilter {
            status: Some(DeliveryStatus::Succeeded),
            ..DeliveryFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(succeeded.len(), 1);
    assert_eq!(succeeded[0].event_id, "evt-0");
    assert!(
        store
            .webhook_delivery_list(&DeliveryFilter {
                endpoint_id: Some("b".into()),
                ..DeliveryFilter::default()
            })
            .await
            .expect("list")
            .is_empty()
    );
}

/// Pruning deletes finished deliveries older than the cut-off with their
/// attempts, in batches, and never a pending one.
pub async fn prune_deletes_finished_deliveries<S: WebhookStore>(store: &S) {
    create(store, &endpoint("ep", &[])).await;
    let messages: Vec<_> = (0..4).map(|i| message(&format!("evt-{i}"), "x")).collect();
    enqueue(store, &messages, t0()).await;
    let c = store
        .webhook_claim_due("w", t(1), 3, 10, LEASE)
        .await
        .expect("claim");
    let outcomes: Vec<_> = c
        .iter()
        .map(|c| {
            outcome(
                c.delivery.id,
                1,
                t(2),
                Some(200),
                DeliveryStatus::Succeeded,
                None,
            )
        })
        .collect();
    store
        .webhook_complete("w", &outcomes)
        .await
        .expect("complete");
    assert_eq!(
        store.webhook_prune(t(2), 10).await.expect("prune"),
        0,
        "not before the cut-off"
    );
    assert_eq!(store.webhook_prune(t(3), 0).await.expect("prune"), 0);
    assert_eq!(store.webhook_prune(t(3), 2).await.expect("prune"), 2);
    assert_eq!(store.webhook_prune(t(3), 2).await.expect("prune"), 1);
    assert_eq!(
        store.webhook_prune(t(1000), 10).await.expect("prune"),
        0,
        "pending stays"
    );
    let left = deliveries(store, "ep").await;
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].status, DeliveryStatus::Pending);
    assert!(
        store
            .webhook_attempts(c[0].delivery.id)
            .await
            .expect("attempts")
            .is_empty()
    );
}

/// Deleting an endpoint deletes its deliveries and their log.
pub async fn delete_endpoint_removes_its_deliveries<S: WebhookStore>(store: &S) {
    create(store, &endpoint("ep", &[])).await;
    create(store, &endpoint("keep", &[])).await;
    enqueue(store, &[message("evt-1", "x")], t0()).await;
    let c = store
        .webhook_claim_due("w", t(1), 10, 10, LEASE)
        .await
        .expect("claim");
    let mine = c
        .iter()
        .find(|c| c.delivery.endpoint_id == "ep")
        .expect("ep's");
    store
        .webhook_complete(
            "w",
            &[outcome(
                mine.delivery.id,
                1,
                t(2),
                Some(500),
                DeliveryStatus::Failed,
                None,
            )],
        )
        .await
        .expect("complete");
    assert!(store.webhook_endpoint_delete("ep").await.expect("delete"));
    assert!(!store.webhook_endpoint_delete("ep").await.expect("delete"));
    assert_eq!(store.webhook_endpoint_get("ep").await.expect("get"), None);
    assert_eq!(
        store
            .webhook_delivery_get(mine.delivery.id)
            .await
            .expect("get"),
        None
    );
    assert!(
        store
            .webhook_attempts(mine.delivery.id)
            .await
            .expect("attempts")
            .is_empty()
    );
    assert_eq!(deliveries(store, "keep").await.len(), 1);
}

/// Expands into one `#[tokio::test]` per [`WebhookStore`] behaviour, each
/// against the store made by `$make` (an async expression yielding a store
/// or a [`Fixture`](crate::store_suite::Fixture)). The tests are named
/// `webhook_conformance::<behaviour>`. See the [module docs](crate::webhook_suite).
///
/// [`WebhookStore`]: keel_messaging::store::WebhookStore
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
