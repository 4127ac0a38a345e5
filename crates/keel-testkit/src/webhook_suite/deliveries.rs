//! Deliveries: queued in the caller's transaction, claimed under a lease, completed.

use std::time::Duration;

use keel_store::StoreError;
use keel_store::{DeliveryStatus, WebhookStore};

use super::*;

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
        assert_eq!(
            d.traceparent.as_deref(),
            Some(TRACEPARENT),
            "its trace kept"
        );
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
    let count = |claimed: &[keel_store::ClaimedDelivery], ep: &str| {
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
    let first = delivery(store, d1).await;
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
    let first = delivery(store, d1).await;
    assert_eq!((first.status, first.attempts), (DeliveryStatus::Failed, 2));
    let second = delivery(store, d2).await;
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
    let ep = endpoint_named(store, "ep").await;
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
    let d = delivery(store, id).await;
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
    let d = delivery(store, id).await;
    assert_eq!(d.status, DeliveryStatus::Disabled);
}
