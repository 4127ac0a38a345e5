//! The idempotent consumer's inbox: one effect per (event, handler), decided
//! in the effect's own transaction.

use keel_store::InboxStore;

use super::now_ms;

/// Records `event_id` for `handler` in a transaction of its own and commits
/// it; returns whether it was new.
async fn record_committed<S: InboxStore>(store: &S, event_id: &str, handler: &str) -> bool {
    let mut tx = store.begin().await.expect("begin");
    let fresh = store
        .inbox_record(&mut tx, event_id, handler)
        .await
        .expect("inbox_record");
    store.commit(tx).await.expect("commit");
    fresh
}

/// The first record of an event by a handler is new; every later one, in
/// the same transaction or another, is a duplicate.
pub async fn records_once_per_event_and_handler<S: InboxStore>(store: &S) {
    let mut tx = store.begin().await.expect("begin");
    assert!(
        store
            .inbox_record(&mut tx, "e-1", "billing")
            .await
            .expect("record"),
        "first delivery is processed"
    );
    assert!(
        !store
            .inbox_record(&mut tx, "e-1", "billing")
            .await
            .expect("record"),
        "a duplicate within the same transaction is seen"
    );
    store.commit(tx).await.expect("commit");

    for delivery in 2..=3 {
        assert!(
            !record_committed(store, "e-1", "billing").await,
            "delivery {delivery} is a duplicate"
        );
    }
    assert!(
        record_committed(store, "e-2", "billing").await,
        "another event is new"
    );
}

/// Two handlers of the same event each process it once.
pub async fn two_handlers_each_process_the_same_event<S: InboxStore>(store: &S) {
    assert!(record_committed(store, "e-1", "billing").await);
    assert!(record_committed(store, "e-1", "shipping").await);
    assert!(!record_committed(store, "e-1", "billing").await);
    assert!(!record_committed(store, "e-1", "shipping").await);
}

/// An inbox row rolls back with its transaction: the effect did not happen,
/// so the redelivery must be processed.
pub async fn rolled_back_record_can_be_recorded_again<S: InboxStore>(store: &S) {
    let mut tx = store.begin().await.expect("begin");
    assert!(
        store
            .inbox_record(&mut tx, "e-1", "billing")
            .await
            .expect("record")
    );
    store.rollback(tx).await.expect("rollback");

    let mut tx = store.begin().await.expect("begin");
    assert!(
        store
            .inbox_record(&mut tx, "e-1", "billing")
            .await
            .expect("record")
    );
    drop(tx);

    assert!(
        record_committed(store, "e-1", "billing").await,
        "after two aborted attempts the event is still new"
    );
    assert!(!record_committed(store, "e-1", "billing").await);
}

/// Prune deletes at most `batch` rows older than `before` per call; a
/// pruned event is new again (which is why the window must outlast
/// redelivery).
pub async fn prune_deletes_in_bounded_batches<S: InboxStore>(store: &S) {
    for i in 0..5 {
        assert!(record_committed(store, &format!("e-{i}"), "billing").await);
    }
    let past = now_ms() - chrono::TimeDelta::minutes(1);
    assert_eq!(store.inbox_prune(past, 100).await.expect("prune"), 0);

    let later = now_ms() + chrono::TimeDelta::minutes(1);
    let mut deleted = Vec::new();
    for _ in 0..4 {
        deleted.push(store.inbox_prune(later, 2).await.expect("prune"));
    }
    assert_eq!(deleted, [2, 2, 1, 0]);
    assert!(record_committed(store, "e-0", "billing").await);
}
