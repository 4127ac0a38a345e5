//! The transactional outbox: what commits is published, in order, once per
//! relay lease; what rolls back never is.

use std::time::Duration;

use bytes::Bytes;
use keel_store::broker::Headers;
use keel_store::{OutboxAdminStore, OutboxStore, StoreError};
use keel_store::{OutboxRecord, PendingOutbox};

use super::now_ms;

/// A long lease: it does not run out during a test.
pub(super) const LEASE: Duration = Duration::from_secs(60);

/// An event for entity `key` on topic `orders`, with a traceparent header.
pub fn record(event_id: &str, key: &str) -> OutboxRecord {
    let mut headers = Headers::new();
    headers.insert("event-id".to_owned(), event_id.to_owned());
    headers.insert(
        "traceparent".to_owned(),
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned(),
    );
    OutboxRecord {
        event_id: event_id.to_owned(),
        topic: "orders".to_owned(),
        partition_key: key.to_owned(),
        headers,
        payload: Bytes::from(format!(r#"{{"event":"{event_id}","key":"{key}"}}"#)),
    }
}

/// Appends `records` in one transaction and commits it.
pub async fn append_committed<S: OutboxStore + OutboxAdminStore>(
    store: &S,
    records: &[OutboxRecord],
) {
    let mut tx = store.begin().await.expect("begin");
    store
        .outbox_append(&mut tx, records)
        .await
        .expect("outbox_append");
    store.commit(tx).await.expect("commit");
}

pub(super) fn event_ids(claimed: &[PendingOutbox]) -> Vec<&str> {
    claimed.iter().map(|p| p.record.event_id.as_str()).collect()
}

pub(super) fn row_ids(claimed: &[PendingOutbox]) -> Vec<i64> {
    claimed.iter().map(|p| p.id).collect()
}

/// An event appended in a committed transaction is claimed, exactly as
/// written (id, topic, key, headers, payload) and with its creation time.
pub async fn committed_append_is_claimable<S: OutboxStore + OutboxAdminStore>(store: &S) {
    let before = now_ms() - chrono::TimeDelta::seconds(1);
    let event = record("e-1", "A-1");
    append_committed(store, std::slice::from_ref(&event)).await;
    let after = now_ms() + chrono::TimeDelta::seconds(1);

    let claimed = store
        .outbox_claim("relay-a", 10, LEASE)
        .await
        .expect("claim");
    assert_eq!(claimed.len(), 1, "the committed event is claimable");
    assert_eq!(claimed[0].record, event, "the event comes back unchanged");
    assert!(
        claimed[0].created_at >= before && claimed[0].created_at <= after,
        "created_at {} is the append time",
        claimed[0].created_at
    );
}

/// An event whose transaction rolled back, explicitly or by being dropped,
/// is never claimed and leaves no trace (its event id is free again).
pub async fn rolled_back_append_is_never_claimable<S: OutboxStore + OutboxAdminStore>(store: &S) {
    let mut tx = store.begin().await.expect("begin");
    store
        .outbox_append(&mut tx, &[record("e-rolled-back", "A-1")])
        .await
        .expect("append");
    store.rollback(tx).await.expect("rollback");

    let mut tx = store.begin().await.expect("begin");
    store
        .outbox_append(&mut tx, &[record("e-dropped", "A-1")])
        .await
        .expect("append");
    drop(tx);

    let claimed = store
        .outbox_claim("relay-a", 10, LEASE)
        .await
        .expect("claim");
    assert!(
        claimed.is_empty(),
        "nothing from an aborted transaction: {claimed:?}"
    );
    assert_eq!(store.outbox_stats().await.expect("stats").unpublished, 0);

    append_committed(store, &[record("e-rolled-back", "A-1")]).await;
    let claimed = store
        .outbox_claim("relay-a", 10, LEASE)
        .await
        .expect("claim");
    assert_eq!(event_ids(&claimed), ["e-rolled-back"]);
}

/// Rows are claimed lowest id first, ids follow commit order and the order
/// of records within one append, and `limit` takes a prefix. (Every event
/// has its own key here, so per-key order does not hold any row back.)
pub async fn claims_in_id_order<S: OutboxStore + OutboxAdminStore>(store: &S) {
    let mut expected = Vec::new();
    for i in 0..5 {
        let id = format!("e-{i}");
        append_committed(store, &[record(&id, &format!("K-{i}"))]).await;
        expected.push(id);
    }
    let batch: Vec<_> = (5..9)
        .map(|i| record(&format!("e-{i}"), &format!("K-{i}")))
        .collect();
    append_committed(store, &batch).await;
    expected.extend(batch.iter().map(|r| r.event_id.clone()));

    let first = store
        .outbox_claim("relay-a", 3, LEASE)
        .await
        .expect("claim");
    assert_eq!(
        event_ids(&first),
        expected[..3],
        "limit takes the lowest ids"
    );

    let rest = store
        .outbox_claim("relay-b", 100, LEASE)
        .await
        .expect("claim");
    assert_eq!(event_ids(&rest), expected[3..], "the rest, in order");
    let mut ids = row_ids(&first);
    ids.extend(row_ids(&rest));
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids increase: {ids:?}");
}

/// Rows leased by one relay are skipped by the others until released.
pub async fn lease_excludes_other_relays<S: OutboxStore + OutboxAdminStore>(store: &S) {
    append_committed(store, &[record("e-1", "A-1"), record("e-2", "A-2")]).await;
    let a = store
        .outbox_claim("relay-a", 10, LEASE)
        .await
        .expect("claim");
    assert_eq!(event_ids(&a), ["e-1", "e-2"]);

    let b = store
        .outbox_claim("relay-b", 10, LEASE)
        .await
        .expect("claim");
    assert!(b.is_empty(), "relay-b must not get leased rows: {b:?}");

    store
        .outbox_release("relay-a", &row_ids(&a))
        .await
        .expect("release");
    let b = store
        .outbox_claim("relay-b", 10, LEASE)
        .await
        .expect("claim");
    assert_eq!(event_ids(&b), ["e-1", "e-2"], "released rows go to relay-b");
}

/// A relay claiming again gets its own leased rows back (a restarted relay
/// with the same name resumes at once instead of waiting out its lease).
pub async fn relay_reclaims_its_own_lease<S: OutboxStore + OutboxAdminStore>(store: &S) {
    append_committed(store, &[record("e-1", "A-1"), record("e-2", "A-1")]).await;
    let first = store
        .outbox_claim("relay-a", 10, LEASE)
        .await
        .expect("claim");
    let again = store
        .outbox_claim("relay-a", 10, LEASE)
        .await
        .expect("claim");
    assert_eq!(event_ids(&first), event_ids(&again));
}

/// A relay slower than its lease gives back only what it still holds: a
/// row another relay claimed since stays that relay's, whether the slow one
/// releases it or counts a failed publish on it.
pub async fn a_stale_release_leaves_the_new_claim<S: OutboxStore + OutboxAdminStore>(store: &S) {
    append_committed(store, &[record("e-1", "A-1")]).await;
    let short = Duration::from_millis(300);
    let a = store
        .outbox_claim("relay-a", 10, short)
        .await
        .expect("claim");
    tokio::time::sleep(short + Duration::from_millis(300)).await;
    let b = store
        .outbox_claim("relay-b", 10, LEASE)
        .await
        .expect("claim");
    assert_eq!(event_ids(&b), ["e-1"], "the expired lease is taken over");

    store
        .outbox_release_failed("relay-a", &row_ids(&a), "publish timed out")
        .await
        .expect("release");
    store
        .outbox_release("relay-a", &row_ids(&a))
        .await
        .expect("release");
    let c = store
        .outbox_claim("relay-c", 10, LEASE)
        .await
        .expect("claim");
    assert!(c.is_empty(), "relay-b's claim stands: {c:?}");

    store
        .outbox_release("relay-b", &row_ids(&b))
        .await
        .expect("release");
    let c = store
        .outbox_claim("relay-c", 10, LEASE)
        .await
        .expect("claim");
    assert_eq!(event_ids(&c), ["e-1"], "its holder gave it back");
    assert_eq!(c[0].attempts, 0, "the stale failure was not counted");
}

/// A lease runs out: a relay that died holding rows does not hold them
/// forever.
pub async fn expired_lease_is_claimable_again<S: OutboxStore + OutboxAdminStore>(store: &S) {
    append_committed(store, &[record("e-1", "A-1")]).await;
    let short = Duration::from_millis(300);
    let a = store
        .outbox_claim("relay-a", 10, short)
        .await
        .expect("claim");
    assert_eq!(a.len(), 1);
    let b = store
        .outbox_claim("relay-b", 10, LEASE)
        .await
        .expect("claim");
    assert!(b.is_empty(), "the lease is still live");

    tokio::time::sleep(short + Duration::from_millis(300)).await;
    let b = store
        .outbox_claim("relay-b", 10, LEASE)
        .await
        .expect("claim");
    assert_eq!(event_ids(&b), ["e-1"], "the expired lease is taken over");
}

/// With two relays, a row is not handed out while an earlier unpublished
/// row of its partition key is leased by the other relay; other keys are
/// not held up.
pub async fn per_key_order_holds_across_relays<S: OutboxStore + OutboxAdminStore>(store: &S) {
    append_committed(
        store,
        &[
            record("k1-first", "K-1"),
            record("k1-second", "K-1"),
            record("k2-first", "K-2"),
        ],
    )
    .await;
    let a = store
        .outbox_claim("relay-a", 1, LEASE)
        .await
        .expect("claim");
    assert_eq!(event_ids(&a), ["k1-first"]);

    let b = store
        .outbox_claim("relay-b", 10, LEASE)
        .await
        .expect("claim");
    assert_eq!(
        event_ids(&b),
        ["k2-first"],
        "k1-second must wait for k1-first, leased by relay-a"
    );

    store
        .outbox_mark_published(&row_ids(&a))
        .await
        .expect("mark");
    let b = store
        .outbox_claim("relay-b", 10, LEASE)
        .await
        .expect("claim");
    assert_eq!(
        event_ids(&b),
        ["k1-second", "k2-first"],
        "once k1-first is published, k1-second is free (and relay-b keeps k2-first)"
    );
}

/// Published rows are never claimed again and no longer count as
/// unpublished; marking twice is harmless.
pub async fn published_rows_are_not_claimed_and_leave_stats<S: OutboxStore + OutboxAdminStore>(
    store: &S,
) {
    append_committed(
        store,
        &[
            record("e-1", "A-1"),
            record("e-2", "A-2"),
            record("e-3", "A-3"),
        ],
    )
    .await;
    assert_eq!(store.outbox_stats().await.expect("stats").unpublished, 3);

    let a = store
        .outbox_claim("relay-a", 10, LEASE)
        .await
        .expect("claim");
    let ids = row_ids(&a);
    store.outbox_mark_published(&ids[..2]).await.expect("mark");
    store
        .outbox_release("relay-a", &ids[2..])
        .await
        .expect("release");

    let stats = store.outbox_stats().await.expect("stats");
    assert_eq!(stats.unpublished, 1);
    assert!(stats.oldest_unpublished_age.is_some());

    let b = store
        .outbox_claim("relay-b", 10, LEASE)
        .await
        .expect("claim");
    assert_eq!(event_ids(&b), ["e-3"], "published rows are not claimed");

    store.outbox_mark_published(&ids).await.expect("mark all");
    store.outbox_mark_published(&ids).await.expect("mark again");
    let stats = store.outbox_stats().await.expect("stats");
    assert_eq!(stats.unpublished, 0);
    assert_eq!(
        stats.oldest_unpublished_age, None,
        "no lag when nothing waits"
    );
    let c = store
        .outbox_claim("relay-c", 10, LEASE)
        .await
        .expect("claim");
    assert!(c.is_empty());
}

/// The oldest unpublished row's age is the relay lag, and it grows while
/// nothing is published.
pub async fn stats_report_relay_lag<S: OutboxStore + OutboxAdminStore>(store: &S) {
    let empty = store.outbox_stats().await.expect("stats");
    assert_eq!(empty.unpublished, 0);
    assert_eq!(empty.oldest_unpublished_age, None);

    append_committed(store, &[record("e-1", "A-1")]).await;
    tokio::time::sleep(Duration::from_millis(120)).await;
    append_committed(store, &[record("e-2", "A-1")]).await;
    let stats = store.outbox_stats().await.expect("stats");
    assert_eq!(stats.unpublished, 2);
    let lag = stats.oldest_unpublished_age.expect("lag");
    assert!(
        lag >= Duration::from_millis(100) && lag < Duration::from_secs(30),
        "the lag is the oldest row's age: {lag:?}"
    );
}

/// Prune deletes at most `batch` published rows older than `before` per
/// call, never an unpublished one.
pub async fn prune_deletes_in_bounded_batches<S: OutboxStore + OutboxAdminStore>(store: &S) {
    let records: Vec<_> = (0..10)
        .map(|i| record(&format!("e-{i}"), &format!("K-{i}")))
        .collect();
    append_committed(store, &records).await;
    let before_publishing = now_ms() - chrono::TimeDelta::seconds(5);
    let claimed = store
        .outbox_claim("relay-a", 10, LEASE)
        .await
        .expect("claim");
    let ids = row_ids(&claimed);
    store.outbox_mark_published(&ids[..7]).await.expect("mark");
    store
        .outbox_release("relay-a", &ids[7..])
        .await
        .expect("release");

    let none = store
        .outbox_prune(before_publishing, 100)
        .await
        .expect("prune");
    assert_eq!(none, 0, "rows published after `before` are kept");

    let later = now_ms() + chrono::TimeDelta::minutes(1);
    let mut deleted = Vec::new();
    for _ in 0..4 {
        deleted.push(store.outbox_prune(later, 3).await.expect("prune"));
    }
    assert_eq!(deleted, [3, 3, 1, 0], "bounded batches until none is left");

    let stats = store.outbox_stats().await.expect("stats");
    assert_eq!(stats.unpublished, 3, "unpublished rows are never pruned");
    let rest = store
        .outbox_claim("relay-b", 10, LEASE)
        .await
        .expect("claim");
    assert_eq!(event_ids(&rest), ["e-7", "e-8", "e-9"]);
}

/// An event id is unique in the outbox: appending it twice is a conflict.
pub async fn duplicate_event_id_is_a_conflict<S: OutboxStore + OutboxAdminStore>(store: &S) {
    append_committed(store, &[record("e-1", "A-1")]).await;
    let mut tx = store.begin().await.expect("begin");
    let err = store
        .outbox_append(&mut tx, &[record("e-1", "A-1")])
        .await
        .expect_err("a duplicate event id must fail");
    assert!(matches!(err, StoreError::Conflict(_)), "got {err:?}");
    drop(tx);
    assert_eq!(store.outbox_stats().await.expect("stats").unpublished, 1);
}

/// A row whose transaction commits after a higher id was committed (and
/// even claimed and published) is still claimed: the relay never skips it.
///
/// Backends that serialize write transactions (SQLite) cannot produce this
/// interleaving; for them the test checks that the second writer waits (or
/// reports the store busy) and that nothing is lost either way.
pub async fn late_commit_of_lower_id_is_not_skipped<S: OutboxStore + OutboxAdminStore>(store: &S) {
    let mut slow = store.begin().await.expect("begin");
    store
        .outbox_append(&mut slow, &[record("e-slow", "A-1")])
        .await
        .expect("append");

    let fast = tokio::time::timeout(Duration::from_millis(500), async {
        let mut tx = store.begin().await?;
        store
            .outbox_append(&mut tx, &[record("e-fast", "A-2")])
            .await?;
        store.commit(tx).await
    })
    .await;
    let concurrent = matches!(fast, Ok(Ok(())));
    match &fast {
        Ok(Ok(())) | Err(_) | Ok(Err(StoreError::Unavailable(_))) => {}
        Ok(Err(other)) => panic!("a concurrent writer failed: {other:?}"),
    }
    if concurrent {
        let claimed = store
            .outbox_claim("relay-a", 10, LEASE)
            .await
            .expect("claim");
        assert_eq!(event_ids(&claimed), ["e-fast"], "only committed rows");
        store
            .outbox_mark_published(&row_ids(&claimed))
            .await
            .expect("mark");
    }
    store.commit(slow).await.expect("commit slow");

    let claimed = store
        .outbox_claim("relay-a", 10, LEASE)
        .await
        .expect("claim");
    assert_eq!(
        event_ids(&claimed),
        ["e-slow"],
        "the late commit is claimed, not skipped"
    );
}

/// Claims everything for `relay` and returns the row id of each event id.
pub(super) async fn claim_ids<S: OutboxStore + OutboxAdminStore>(
    store: &S,
    relay: &str,
) -> Vec<(String, i64)> {
    store
        .outbox_claim(relay, 100, LEASE)
        .await
        .expect("claim")
        .iter()
        .map(|p| (p.record.event_id.clone(), p.id))
        .collect()
}

pub(super) fn id_of(claimed: &[(String, i64)], event_id: &str) -> i64 {
    claimed
        .iter()
        .find(|(e, _)| e == event_id)
        .map(|(_, id)| *id)
        .unwrap_or_else(|| panic!("{event_id} was not claimed: {claimed:?}"))
}

/// The publication record lists published rows only, lowest id first,
/// paged by the last id seen; a pruned row leaves it.
pub async fn published_rows_are_listed_in_id_order<S: OutboxStore + OutboxAdminStore>(store: &S) {
    append_committed(
        store,
        &[
            record("e-1", "A-1"),
            record("e-2", "A-2"),
            record("e-3", "A-3"),
        ],
    )
    .await;
    let claimed = store
        .outbox_claim("relay-a", 10, LEASE)
        .await
        .expect("claim");
    let ids = row_ids(&claimed);
    assert_eq!(store.outbox_published(0, 10).await.expect("published"), []);
    store
        .outbox_mark_published(&[ids[2], ids[0]])
        .await
        .expect("mark");
    let published = store.outbox_published(0, 10).await.expect("published");
    let listed: Vec<(i64, &str)> = published
        .iter()
        .map(|p| (p.id, p.event_id.as_str()))
        .collect();
    assert_eq!(listed, [(ids[0], "e-1"), (ids[2], "e-3")]);
    let first = store.outbox_published(0, 1).await.expect("page 1");
    assert_eq!(first.len(), 1);
    let rest = store
        .outbox_published(first[0].id, 10)
        .await
        .expect("page 2");
    assert_eq!(rest, published[1..]);

    let later = now_ms() + chrono::TimeDelta::seconds(60);
    store.outbox_prune(later, 100).await.expect("prune");
    assert_eq!(store.outbox_published(0, 10).await.expect("published"), []);
}
