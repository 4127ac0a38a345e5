//! Dead letters and failure history: nothing a consumer gave up on is lost,
//! and each is settled (replayed or discarded) at most once.

use std::collections::HashMap;

use chrono::{DateTime, TimeDelta, Utc};
use keel_store::broker::Message;
use keel_store::{AttemptError, DeadLetter, DeadLetterFilter, DeadLetterStatus};
use keel_store::{DeadLetterStore, StoreError};

use super::now_ms;

/// A pending dead letter `id` of a message on `topic`, dead at `dead_at`,
/// with three failed attempts.
pub fn letter(id: &str, topic: &str, error_kind: &str, dead_at: DateTime<Utc>) -> DeadLetter {
    let message = Message::new(format!("msg-{id}"), topic, "A-1", r#"{"orderId":"A-1"}"#)
        .with_header("ce-type", "com.acme.orders.placed.v1");
    let attempts = (1..=3)
        .map(|attempt| AttemptError {
            attempt,
            error: format!("attempt {attempt}: payments timed out\ncaused by: connect refused"),
            at: dead_at - TimeDelta::seconds(i64::from(4 - attempt)),
        })
        .collect();
    DeadLetter {
        id: id.to_owned(),
        message,
        group: "billing".to_owned(),
        error_kind: error_kind.to_owned(),
        attempts,
        dead_at,
        status: DeadLetterStatus::Pending,
    }
}

fn ids(letters: &[DeadLetter]) -> Vec<&str> {
    letters.iter().map(|l| l.id.as_str()).collect()
}

async fn settle_committed<S: DeadLetterStore>(store: &S, id: &str, to: DeadLetterStatus) -> bool {
    let mut tx = store.begin().await.expect("begin");
    let settled = store
        .dead_letter_settle(&mut tx, id, to)
        .await
        .expect("settle");
    store.commit(tx).await.expect("commit");
    settled
}

/// A dead letter comes back exactly as stored (message, headers, payload,
/// group, kind, full error history); an unknown id is `None`; an id is
/// unique.
pub async fn put_then_get_round_trips<S: DeadLetterStore>(store: &S) {
    let stored = letter("dl-1", "orders", "poison", now_ms());
    store.dead_letter_put(&stored).await.expect("put");
    let loaded = store.dead_letter_get("dl-1").await.expect("get");
    assert_eq!(loaded.as_ref(), Some(&stored));
    assert_eq!(store.dead_letter_get("dl-404").await.expect("get"), None);

    let err = store
        .dead_letter_put(&stored)
        .await
        .expect_err("a duplicate dead-letter id must fail");
    assert!(matches!(err, StoreError::Conflict(_)), "got {err:?}");
}

/// Listing is oldest first and filters by topic, error kind and status,
/// each alone or together, with a limit.
pub async fn list_filters_and_orders_oldest_first<S: DeadLetterStore>(store: &S) {
    let t0 = now_ms() - TimeDelta::hours(1);
    // Stored out of time order on purpose.
    let letters = [
        letter("dl-c", "orders", "poison", t0 + TimeDelta::minutes(3)),
        letter("dl-a", "orders", "malformed", t0 + TimeDelta::minutes(1)),
        letter("dl-d", "payments", "poison", t0 + TimeDelta::minutes(4)),
        letter(
            "dl-b",
            "payments",
            "too_many_attempts",
            t0 + TimeDelta::minutes(2),
        ),
    ];
    for l in &letters {
        store.dead_letter_put(l).await.expect("put");
    }
    assert!(settle_committed(store, "dl-c", DeadLetterStatus::Discarded).await);

    let list = |filter: DeadLetterFilter| async move {
        store.dead_letter_list(&filter).await.expect("list")
    };
    assert_eq!(
        ids(&list(DeadLetterFilter::default()).await),
        ["dl-a", "dl-b", "dl-c", "dl-d"]
    );
    let by_topic = DeadLetterFilter {
        topic: Some("orders".into()),
        ..Default::default()
    };
    assert_eq!(ids(&list(by_topic).await), ["dl-a", "dl-c"]);
    let by_kind = DeadLetterFilter {
        error_kind: Some("poison".into()),
        ..Default::default()
    };
    assert_eq!(ids(&list(by_kind).await), ["dl-c", "dl-d"]);
    let pending = DeadLetterFilter {
        status: Some(DeadLetterStatus::Pending),
        ..Default::default()
    };
    assert_eq!(ids(&list(pending).await), ["dl-a", "dl-b", "dl-d"]);
    let combined = DeadLetterFilter {
        topic: Some("payments".into()),
        error_kind: Some("poison".into()),
        status: Some(DeadLetterStatus::Pending),
        limit: None,
    };
    assert_eq!(ids(&list(combined).await), ["dl-d"]);
    let limited = DeadLetterFilter {
        limit: Some(2),
        ..Default::default()
    };
    assert_eq!(ids(&list(limited).await), ["dl-a", "dl-b"]);

    let discarded = store
        .dead_letter_get("dl-c")
        .await
        .expect("get")
        .expect("dl-c");
    assert_eq!(discarded.status, DeadLetterStatus::Discarded);
}

/// Settling (replay or discard) happens once: the second attempt, whatever
/// its target status, is refused, so a letter cannot be replayed twice.
pub async fn settles_only_once<S: DeadLetterStore>(store: &S) {
    store
        .dead_letter_put(&letter("dl-1", "orders", "poison", now_ms()))
        .await
        .expect("put");
    assert!(settle_committed(store, "dl-1", DeadLetterStatus::Replayed).await);
    assert!(!settle_committed(store, "dl-1", DeadLetterStatus::Replayed).await);
    assert!(!settle_committed(store, "dl-1", DeadLetterStatus::Discarded).await);
    let stored = store
        .dead_letter_get("dl-1")
        .await
        .expect("get")
        .expect("dl-1");
    assert_eq!(
        stored.status,
        DeadLetterStatus::Replayed,
        "the first settlement stands"
    );
    assert!(
        !settle_committed(store, "dl-404", DeadLetterStatus::Discarded).await,
        "an unknown letter is not settled"
    );
}

/// The status change commits with the caller's transaction (e.g. with the
/// replay's outbox row) or not at all.
pub async fn settle_rolls_back_with_its_transaction<S: DeadLetterStore>(store: &S) {
    store
        .dead_letter_put(&letter("dl-1", "orders", "poison", now_ms()))
        .await
        .expect("put");
    let mut tx = store.begin().await.expect("begin");
    assert!(
        store
            .dead_letter_settle(&mut tx, "dl-1", DeadLetterStatus::Replayed)
            .await
            .expect("settle")
    );
    store.rollback(tx).await.expect("rollback");

    let stored = store
        .dead_letter_get("dl-1")
        .await
        .expect("get")
        .expect("dl-1");
    assert_eq!(stored.status, DeadLetterStatus::Pending, "rolled back");
    assert!(settle_committed(store, "dl-1", DeadLetterStatus::Replayed).await);
}

/// Counts are of pending letters, by error kind.
pub async fn counts_pending_by_error_kind<S: DeadLetterStore>(store: &S) {
    let t = now_ms();
    for (id, kind) in [
        ("dl-1", "poison"),
        ("dl-2", "poison"),
        ("dl-3", "malformed"),
        ("dl-4", "expired"),
    ] {
        store
            .dead_letter_put(&letter(id, "orders", kind, t))
            .await
            .expect("put");
    }
    assert!(settle_committed(store, "dl-4", DeadLetterStatus::Discarded).await);

    let counts: HashMap<String, u64> = store
        .dead_letter_counts()
        .await
        .expect("counts")
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .collect();
    let expected = HashMap::from([("poison".to_owned(), 2), ("malformed".to_owned(), 1)]);
    assert_eq!(counts, expected);
}

/// Failed attempts are remembered per (group, message), oldest first, and
/// cleared independently.
pub async fn failure_history_is_per_group_and_message<S: DeadLetterStore>(store: &S) {
    let t = now_ms();
    let attempt = |n: u32| AttemptError {
        attempt: n,
        error: format!("attempt {n} failed"),
        at: t + TimeDelta::milliseconds(i64::from(n) * 10),
    };
    for n in 1..=3 {
        store
            .failure_record("billing", "msg-1", &attempt(n))
            .await
            .expect("record");
    }
    store
        .failure_record("shipping", "msg-1", &attempt(1))
        .await
        .expect("record");
    store
        .failure_record("billing", "msg-2", &attempt(1))
        .await
        .expect("record");

    let history = store
        .failure_history("billing", "msg-1")
        .await
        .expect("history");
    assert_eq!(history, [attempt(1), attempt(2), attempt(3)]);
    assert!(
        store
            .failure_history("nobody", "msg-1")
            .await
            .expect("history")
            .is_empty()
    );

    store
        .failure_clear("billing", "msg-1")
        .await
        .expect("clear");
    assert!(
        store
            .failure_history("billing", "msg-1")
            .await
            .expect("history")
            .is_empty()
    );
    assert_eq!(
        store
            .failure_history("shipping", "msg-1")
            .await
            .expect("history"),
        [attempt(1)],
        "another group's history is kept"
    );
    assert_eq!(
        store
            .failure_history("billing", "msg-2")
            .await
            .expect("history"),
        [attempt(1)],
        "another message's history is kept"
    );
}
