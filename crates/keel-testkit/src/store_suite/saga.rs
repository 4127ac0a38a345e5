//! Saga instances: created once, saved with optimistic concurrency, found
//! when due and by the operator.

use std::collections::HashMap;

use chrono::{DateTime, TimeDelta, Utc};
use keel_messaging::store::{SagaFilter, SagaRecord, SagaStatus};
use keel_messaging::{MessagingStore, StoreError};

use super::now_ms;

/// A fresh saga `id` of kind `order_fulfilment`, running, version 1, due at
/// `due`, created and updated at `at`.
pub fn saga(id: &str, status: SagaStatus, at: DateTime<Utc>, due: DateTime<Utc>) -> SagaRecord {
    SagaRecord {
        id: id.to_owned(),
        kind: "order_fulfilment".to_owned(),
        status,
        step: 0,
        data: serde_json::json!({ "orderId": id, "totalMinor": 8210, "items": [{ "sku": "TT-01", "qty": 2 }] }),
        attempts: 0,
        last_error: None,
        next_attempt_at: due,
        created_at: at,
        updated_at: at,
        version: 1,
    }
}

async fn insert_committed<S: MessagingStore>(store: &S, record: &SagaRecord) -> bool {
    let mut tx = store.begin().await.expect("begin");
    let inserted = store.saga_insert(&mut tx, record).await.expect("insert");
    store.commit(tx).await.expect("commit");
    inserted
}

fn ids(sagas: &[SagaRecord]) -> Vec<&str> {
    sagas.iter().map(|s| s.id.as_str()).collect()
}

/// Inserting a saga id twice (a redelivered trigger) keeps the first and
/// reports `false`; the saga comes back exactly as inserted.
pub async fn insert_is_idempotent<S: MessagingStore>(store: &S) {
    let t = now_ms();
    let first = saga("saga-1", SagaStatus::Running, t, t);
    assert!(insert_committed(store, &first).await);

    let mut second = first.clone();
    second.data = serde_json::json!({ "other": true });
    second.step = 3;
    assert!(
        !insert_committed(store, &second).await,
        "the duplicate is not an error"
    );

    let loaded = store.saga_get("saga-1").await.expect("get");
    assert_eq!(loaded.as_ref(), Some(&first), "the first insert stands");
    assert_eq!(store.saga_get("saga-404").await.expect("get"), None);
}

/// A saga inserted in a transaction that rolls back does not exist.
pub async fn rolled_back_insert_leaves_nothing<S: MessagingStore>(store: &S) {
    let t = now_ms();
    let mut tx = store.begin().await.expect("begin");
    assert!(
        store
            .saga_insert(&mut tx, &saga("saga-1", SagaStatus::Running, t, t))
            .await
            .expect("insert")
    );
    store.rollback(tx).await.expect("rollback");
    assert_eq!(store.saga_get("saga-1").await.expect("get"), None);
    assert!(insert_committed(store, &saga("saga-1", SagaStatus::Running, t, t)).await);
}

/// A save succeeds only on top of the version it was loaded at: of two
/// workers that loaded the same version, the second to save loses.
pub async fn save_is_optimistic_on_version<S: MessagingStore>(store: &S) {
    let t = now_ms();
    assert!(insert_committed(store, &saga("saga-1", SagaStatus::Running, t, t)).await);
    let loaded = store
        .saga_get("saga-1")
        .await
        .expect("get")
        .expect("saga-1");

    let mut worker_a = loaded.clone();
    worker_a.version += 1;
    worker_a.step = 1;
    worker_a.attempts = 2;
    worker_a.last_error = Some("payments timed out".to_owned());
    worker_a.next_attempt_at = t + TimeDelta::seconds(30);
    worker_a.updated_at = t + TimeDelta::seconds(1);
    worker_a.data["paymentId"] = serde_json::json!("pay-9");
    let mut worker_b = loaded.clone();
    worker_b.version += 1;
    worker_b.status = SagaStatus::Compensating;

    assert!(
        store.saga_save(&worker_a).await.expect("save"),
        "first save wins"
    );
    assert!(
        !store.saga_save(&worker_b).await.expect("save"),
        "stale save loses"
    );
    assert!(
        !store.saga_save(&worker_a).await.expect("save"),
        "the same version twice loses"
    );

    let stored = store
        .saga_get("saga-1")
        .await
        .expect("get")
        .expect("saga-1");
    assert_eq!(stored, worker_a, "the winner's state is stored, whole");

    let mut next = stored.clone();
    next.version += 1;
    next.status = SagaStatus::Completed;
    assert!(store.saga_save(&next).await.expect("save"), "saves chain");

    let mut missing = saga("saga-404", SagaStatus::Running, t, t);
    missing.version = 2;
    let err = store.saga_save(&missing).await.expect_err("no such saga");
    assert!(matches!(err, StoreError::NotFound(_)), "got {err:?}");
}

/// Due sagas are the unfinished ones whose next attempt time has come,
/// most overdue first, at most `limit`. Stuck sagas are retried too.
pub async fn due_returns_unfinished_due_sagas_oldest_first<S: MessagingStore>(store: &S) {
    let now = now_ms();
    let min = TimeDelta::minutes;
    for record in [
        saga(
            "due-2",
            SagaStatus::Compensating,
            now - min(10),
            now - min(2),
        ),
        saga("later", SagaStatus::Running, now - min(10), now + min(5)),
        saga("due-1", SagaStatus::Running, now - min(10), now - min(3)),
        saga("done", SagaStatus::Completed, now - min(10), now - min(9)),
        saga(
            "undone",
            SagaStatus::Compensated,
            now - min(10),
            now - min(8),
        ),
        saga(
            "cancelled",
            SagaStatus::Cancelled,
            now - min(10),
            now - min(7),
        ),
        saga("due-3", SagaStatus::Stuck, now - min(10), now - min(1)),
        saga("due-now", SagaStatus::Running, now - min(10), now),
    ] {
        assert!(insert_committed(store, &record).await);
    }
    let due = store.saga_due(now, 100).await.expect("due");
    assert_eq!(ids(&due), ["due-1", "due-2", "due-3", "due-now"]);
    let first_two = store.saga_due(now, 2).await.expect("due");
    assert_eq!(ids(&first_two), ["due-1", "due-2"]);
    let later = store.saga_due(now + min(10), 100).await.expect("due");
    assert_eq!(ids(&later), ["due-1", "due-2", "due-3", "due-now", "later"]);
}

/// The operator view filters by status and by "not updated since", oldest
/// update first, with a limit.
pub async fn list_filters_by_status_and_age<S: MessagingStore>(store: &S) {
    let now = now_ms();
    let min = TimeDelta::minutes;
    for record in [
        saga("stuck-new", SagaStatus::Stuck, now - min(1), now),
        saga("running-old", SagaStatus::Running, now - min(50), now),
        saga("stuck-old", SagaStatus::Stuck, now - min(40), now),
        saga("done", SagaStatus::Completed, now - min(30), now),
    ] {
        assert!(insert_committed(store, &record).await);
    }
    let list = |filter: SagaFilter| async move { store.saga_list(&filter).await.expect("list") };

    assert_eq!(
        ids(&list(SagaFilter::default()).await),
        ["running-old", "stuck-old", "done", "stuck-new"]
    );
    let stuck = SagaFilter {
        status: Some(SagaStatus::Stuck),
        ..Default::default()
    };
    assert_eq!(ids(&list(stuck).await), ["stuck-old", "stuck-new"]);
    let stuck_long = SagaFilter {
        status: Some(SagaStatus::Stuck),
        updated_before: Some(now - min(10)),
        limit: None,
    };
    assert_eq!(ids(&list(stuck_long).await), ["stuck-old"]);
    let old = SagaFilter {
        updated_before: Some(now - min(35)),
        ..Default::default()
    };
    assert_eq!(ids(&list(old).await), ["running-old", "stuck-old"]);
    let limited = SagaFilter {
        limit: Some(1),
        ..Default::default()
    };
    assert_eq!(ids(&list(limited).await), ["running-old"]);
}

/// Counts by status.
pub async fn counts_by_status<S: MessagingStore>(store: &S) {
    let t = now_ms();
    for (id, status) in [
        ("s-1", SagaStatus::Running),
        ("s-2", SagaStatus::Running),
        ("s-3", SagaStatus::Stuck),
        ("s-4", SagaStatus::Completed),
    ] {
        assert!(insert_committed(store, &saga(id, status, t, t)).await);
    }
    let counts: HashMap<SagaStatus, u64> = store
        .saga_counts()
        .await
        .expect("counts")
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .collect();
    let expected = HashMap::from([
        (SagaStatus::Running, 2),
        (SagaStatus::Stuck, 1),
        (SagaStatus::Completed, 1),
    ]);
    assert_eq!(counts, expected);
}
