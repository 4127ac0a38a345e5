//! Parked outbox rows: a row the relay gave up on holds back only its own
//! key, and an operator replays or discards it; a failed publish releases
//! its rows and counts the attempt that may end in parking.

use keel_store::ParkedFilter;
use keel_store::{OutboxAdminStore, OutboxStore};

use super::now_ms;
use super::outbox::{LEASE, append_committed, claim_ids, event_ids, id_of, record, row_ids};

/// Parks `k1-first` of `k1-first, k1-second, k2-first` (K-1, K-1, K-2) and
/// releases the others; returns the parked row's id.
async fn park_first_of_k1<S: OutboxStore + OutboxAdminStore>(store: &S) -> i64 {
    append_committed(
        store,
        &[
            record("k1-first", "K-1"),
            record("k1-second", "K-1"),
            record("k2-first", "K-2"),
        ],
    )
    .await;
    let claimed = claim_ids(store, "relay-a").await;
    assert_eq!(claimed.len(), 3);
    let parked = id_of(&claimed, "k1-first");
    assert!(
        store
            .outbox_park(parked, "broker refused the request: key has a line break")
            .await
            .expect("park"),
        "an unpublished, unparked row parks"
    );
    let others: Vec<i64> = claimed
        .iter()
        .map(|(_, id)| *id)
        .filter(|id| *id != parked)
        .collect();
    store
        .outbox_release("relay-a", &others)
        .await
        .expect("release");
    parked
}

/// A parked row is never claimed again, nor is a later row of its key;
/// other keys are claimed as usual. It is listed with its error, its
/// attempts and the rows waiting behind it, and counted apart from the
/// unpublished rows.
pub async fn parked_row_holds_back_only_its_key<S: OutboxStore + OutboxAdminStore>(store: &S) {
    let before = now_ms() - chrono::TimeDelta::seconds(1);
    let parked = park_first_of_k1(store).await;

    for relay in ["relay-a", "relay-b"] {
        let claimed = claim_ids(store, relay).await;
        let events: Vec<&str> = claimed.iter().map(|(e, _)| e.as_str()).collect();
        assert_eq!(
            events,
            ["k2-first"],
            "{relay}: k1-second waits behind the parked k1-first; K-2 flows"
        );
        let ids: Vec<i64> = claimed.iter().map(|(_, id)| *id).collect();
        store.outbox_release(relay, &ids).await.expect("release");
    }

    let stats = store.outbox_stats().await.expect("stats");
    assert_eq!(stats.parked, 1, "the parked row is counted as parked");
    assert_eq!(stats.unpublished, 2, "k1-second and k2-first still wait");

    let list = store
        .outbox_parked(&ParkedFilter::default())
        .await
        .expect("list parked");
    assert_eq!(list.len(), 1, "{list:?}");
    let row = &list[0];
    assert_eq!(row.id, parked);
    assert_eq!(
        row.record,
        record("k1-first", "K-1"),
        "the event, unchanged"
    );
    assert_eq!(row.attempts, 1, "the refusal is an attempt");
    assert!(row.last_error.contains("line break"), "{}", row.last_error);
    assert_eq!(row.held_back, 1, "k1-second waits behind it");
    assert!(row.parked_at >= before && row.parked_at >= row.created_at);
    assert_eq!(
        store
            .outbox_parked_get(parked)
            .await
            .expect("get parked")
            .as_ref(),
        Some(row)
    );
    assert!(
        !store.outbox_park(parked, "again").await.expect("park"),
        "a parked row does not park twice"
    );
}

/// Replaying (unparking) a parked row makes it claimable again with no
/// attempts, and, keeping its id, it comes before the rows of its key that
/// waited behind it.
pub async fn unparked_row_is_claimed_first_in_its_key<S: OutboxStore + OutboxAdminStore>(
    store: &S,
) {
    let parked = park_first_of_k1(store).await;
    assert!(store.outbox_unpark(parked).await.expect("unpark"));
    assert!(
        !store.outbox_unpark(parked).await.expect("unpark"),
        "only a parked row unparks"
    );
    let claimed = store
        .outbox_claim("relay-b", 100, LEASE)
        .await
        .expect("claim");
    assert_eq!(
        event_ids(&claimed),
        ["k1-first", "k1-second", "k2-first"],
        "the replayed row first, in id order"
    );
    assert_eq!(claimed[0].attempts, 0, "a replay starts counting again");
    assert!(
        store
            .outbox_parked_get(parked)
            .await
            .expect("get")
            .is_none()
    );
    let stats = store.outbox_stats().await.expect("stats");
    assert_eq!((stats.unpublished, stats.parked), (3, 0));
}

/// Discarding a parked row deletes it and frees the later rows of its key;
/// a row that is not parked cannot be discarded.
pub async fn discarded_row_frees_its_key<S: OutboxStore + OutboxAdminStore>(store: &S) {
    let parked = park_first_of_k1(store).await;
    let claimed = claim_ids(store, "relay-b").await;
    let k2 = id_of(&claimed, "k2-first");
    assert!(
        !store.outbox_discard(k2).await.expect("discard"),
        "an unparked row is not discarded"
    );
    store
        .outbox_release("relay-b", &[k2])
        .await
        .expect("release");

    assert!(store.outbox_discard(parked).await.expect("discard"));
    assert!(
        !store.outbox_discard(parked).await.expect("discard"),
        "gone"
    );
    let claimed = store
        .outbox_claim("relay-b", 100, LEASE)
        .await
        .expect("claim");
    assert_eq!(
        event_ids(&claimed),
        ["k1-second", "k2-first"],
        "K-1 flows again"
    );
    let stats = store.outbox_stats().await.expect("stats");
    assert_eq!((stats.unpublished, stats.parked), (2, 0));
    assert!(
        store
            .outbox_parked(&ParkedFilter::default())
            .await
            .expect("list")
            .is_empty()
    );
}

/// A failed publish that may pass releases the rows at once (another
/// relay can take them) and counts an attempt on each, with the error;
/// the count comes back with the next claim.
pub async fn failed_release_counts_attempts<S: OutboxStore + OutboxAdminStore>(store: &S) {
    append_committed(store, &[record("e-1", "A-1"), record("e-2", "A-2")]).await;
    for attempt in 1..=2u32 {
        let claimed = store
            .outbox_claim("relay-a", 100, LEASE)
            .await
            .expect("claim");
        assert!(claimed.iter().all(|p| p.attempts == attempt - 1));
        store
            .outbox_release_failed(
                "relay-a",
                &row_ids(&claimed),
                "broker unavailable: restarting",
            )
            .await
            .expect("release failed");
    }
    let claimed = store
        .outbox_claim("relay-b", 100, LEASE)
        .await
        .expect("claim");
    assert_eq!(
        event_ids(&claimed),
        ["e-1", "e-2"],
        "released, not left leased"
    );
    assert!(
        claimed.iter().all(|p| p.attempts == 2),
        "two failed attempts each: {claimed:?}"
    );
    assert!(
        store
            .outbox_park(claimed[0].id, "refused")
            .await
            .expect("park")
    );
    let parked = store
        .outbox_parked(&ParkedFilter::default())
        .await
        .expect("list");
    assert_eq!(parked[0].attempts, 3);
    assert_eq!(parked[0].last_error, "refused", "the latest error");
    assert_eq!(
        store.outbox_stats().await.expect("stats").unpublished,
        1,
        "failed rows still count as unpublished; only parked ones do not"
    );
}

/// The parked list is lowest id first and honours its topic filter and
/// limit; a published row is never parked.
pub async fn parked_list_filters_by_topic_and_limit<S: OutboxStore + OutboxAdminStore>(store: &S) {
    let mut payments = record("p-1", "P-1");
    payments.topic = "payments".to_owned();
    append_committed(
        store,
        &[
            record("o-1", "O-1"),
            payments,
            record("o-2", "O-2"),
            record("o-3", "O-3"),
        ],
    )
    .await;
    let claimed = claim_ids(store, "relay-a").await;
    let published = id_of(&claimed, "o-3");
    store
        .outbox_mark_published(&[published])
        .await
        .expect("mark");
    assert!(
        !store.outbox_park(published, "late").await.expect("park"),
        "a published row is never parked"
    );
    for event in ["o-1", "p-1", "o-2"] {
        assert!(
            store
                .outbox_park(id_of(&claimed, event), "refused")
                .await
                .expect("park")
        );
    }
    let events = |rows: Vec<keel_store::ParkedOutbox>| {
        rows.into_iter()
            .map(|r| r.record.event_id)
            .collect::<Vec<_>>()
    };
    let all = store
        .outbox_parked(&ParkedFilter::default())
        .await
        .expect("list");
    assert_eq!(events(all), ["o-1", "p-1", "o-2"]);
    let orders = store
        .outbox_parked(&ParkedFilter {
            topic: Some("orders".to_owned()),
            limit: None,
        })
        .await
        .expect("list");
    assert_eq!(events(orders), ["o-1", "o-2"]);
    let first = store
        .outbox_parked(&ParkedFilter {
            topic: None,
            limit: Some(1),
        })
        .await
        .expect("list");
    assert_eq!(events(first), ["o-1"]);
    assert!(
        store
            .outbox_parked_get(published)
            .await
            .expect("get")
            .is_none()
    );
}
