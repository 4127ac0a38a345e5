//! The delivery log: resend, replay, listing, pruning.

use keel_store::StoreError;
use keel_store::{DeliveryFilter, DeliveryStatus, WebhookDelivery, WebhookStore};

use super::*;

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
    let d = delivery(store, id).await;
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
            let (code, status) = if c.delivery.event_id == "evt-3" {
                (200, DeliveryStatus::Succeeded)
            } else {
                (500, DeliveryStatus::Failed)
            };
            outcome(c.delivery.id, 1, t(51), Some(code), status, None)
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
