//! Endpoints: create, read, update, rotate, disable, enable, delete.

use keel_store::StoreError;
use keel_store::{DeliveryStatus, WebhookSecret, WebhookStore};

use super::*;

/// Endpoints read back field for field; ids are unique; updates change the
/// settings only; unknown ids are `NotFound`.
pub async fn endpoints_round_trip<S: WebhookStore>(store: &S) {
    let a = endpoint("ep-a", &["order.*"]);
    let mut b = endpoint("ep-b", &[]);
    b.created_at = t(1);
    b.updated_at = t(1);
    b.format = keel_store::WebhookFormat::CloudeventsBinary;
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
    let stored = endpoint_named(store, "ep-a").await;
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
    let ep = endpoint_named(store, "ep").await;
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
    let ep = endpoint_named(store, "ep").await;
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
