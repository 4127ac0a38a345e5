//! The [`EventLogStore`] conformance suite: what every backend behind
//! `keel-http`'s real-time push (long polling, SSE, WebSocket) must do.
//!
//! Resumption is the whole point of the log: a client says "I have
//! everything up to seq 41" and must get 42, 43, ... with nothing skipped and
//! nothing repeated. So the suite checks, through the trait alone, that seqs
//! are per stream, contiguous, in commit order also under concurrency, never
//! reused after trimming, and that a rolled-back append leaves no trace; and
//! that both retention rules delete in bounded batches.
//!
//! Run it from a backend's integration tests with
//! [`event_log_conformance_tests!`](crate::event_log_conformance_tests),
//! giving an async expression that makes a *fresh, empty* store (or a
//! [`Fixture`](crate::store_suite::Fixture)):
//!
//! ```ignore
//! keel_testkit::event_log_conformance_tests!(async {
//!     let dir = tempfile::tempdir().expect("temp dir");
//!     let store = SqliteStore::open(dir.path().join("keel.db")).await.expect("open");
//!     keel_testkit::store_suite::Fixture::new(store).keep_alive(dir)
//! });
//! ```
//!
//! [`EventLogStore`]: keel_store::EventLogStore

use chrono::Duration;
use keel_store::{EventLogStore, LoggedEvent};
use serde_json::json;

use crate::store_suite::now_ms;

/// Appends one event to `stream` in its own transaction; returns its seq.
pub async fn append<S: EventLogStore>(
    store: &S,
    stream: &str,
    event_type: &str,
    data: serde_json::Value,
) -> i64 {
    let mut tx = store.begin().await.expect("begin");
    let seq = store
        .event_log_append(&mut tx, stream, event_type, &data)
        .await
        .expect("event_log_append");
    store.commit(tx).await.expect("commit");
    seq
}

async fn seqs<S: EventLogStore>(store: &S, stream: &str, after: i64) -> Vec<i64> {
    store
        .event_log_read_after(stream, after, 10_000)
        .await
        .expect("read_after")
        .iter()
        .map(|e| e.seq)
        .collect()
}

/// Seqs start at 1 and go up by one per stream; streams do not share them.
pub async fn seqs_are_contiguous_per_stream<S: EventLogStore>(store: &S) {
    for expected in 1..=3 {
        assert_eq!(
            append(store, "user-a", "note", json!(expected)).await,
            expected
        );
    }
    assert_eq!(
        append(store, "user-b", "note", json!(1)).await,
        1,
        "own counter"
    );
    assert_eq!(append(store, "user-a", "note", json!(4)).await, 4);
    assert_eq!(seqs(store, "user-a", 0).await, vec![1, 2, 3, 4]);
    assert_eq!(seqs(store, "user-b", 0).await, vec![1]);
    assert_eq!(store.event_log_last_seq("user-a").await.expect("last"), 4);
    assert_eq!(store.event_log_last_seq("user-b").await.expect("last"), 1);
}

/// An event reads back field for field, oldest first, after the cursor,
/// at most `limit` at a time.
pub async fn read_after_returns_events_in_order<S: EventLogStore>(store: &S) {
    let before = now_ms();
    let data = json!({ "orderId": "A-4471", "total": 82.10, "tags": ["ü", "→"], "n": null });
    append(store, "user-a", "order.placed", data.clone()).await;
    append(
        store,
        "user-a",
        "order.paid",
        json!({ "orderId": "A-4471" }),
    )
    .await;
    append(store, "user-a", "order.shipped", json!("plain string")).await;
    let after = now_ms() + Duration::milliseconds(1);

    let all = store
        .event_log_read_after("user-a", 0, 100)
        .await
        .expect("read");
    let types: Vec<&str> = all.iter().map(|e| e.event_type.as_str()).collect();
    assert_eq!(types, ["order.placed", "order.paid", "order.shipped"]);
    let first: &LoggedEvent = &all[0];
    assert_eq!(first.seq, 1);
    assert_eq!(first.data, data);
    assert!(first.at >= before && first.at <= after, "at {:?}", first.at);

    let page = store
        .event_log_read_after("user-a", 1, 1)
        .await
        .expect("read");
    assert_eq!(page.len(), 1);
    assert_eq!(page[0].seq, 2);
    assert!(
        store
            .event_log_read_after("user-a", 3, 10)
            .await
            .expect("read")
            .is_empty()
    );
    assert!(
        store
            .event_log_read_after("user-a", 99, 10)
            .await
            .expect("read")
            .is_empty()
    );
    assert!(
        store
            .event_log_read_after("user-a", 0, 0)
            .await
            .expect("read")
            .is_empty()
    );
    assert!(
        store
            .event_log_read_after("nobody", 0, 10)
            .await
            .expect("read")
            .is_empty()
    );
    assert_eq!(
        seqs(store, "user-a", -5).await,
        vec![1, 2, 3],
        "negative = from the start"
    );
}

/// An unknown stream's last seq is 0.
pub async fn last_seq_of_unknown_stream_is_zero<S: EventLogStore>(store: &S) {
    assert_eq!(store.event_log_last_seq("nobody").await.expect("last"), 0);
}

/// A rolled-back append leaves no event and no hole in the seqs.
pub async fn rolled_back_append_leaves_no_hole<S: EventLogStore>(store: &S) {
    append(store, "user-a", "note", json!(1)).await;
    let mut tx = store.begin().await.expect("begin");
    let seq = store
        .event_log_append(&mut tx, "user-a", "note", &json!("rolled back"))
        .await
        .expect("append");
    assert_eq!(seq, 2);
    store.rollback(tx).await.expect("rollback");
    assert_eq!(seqs(store, "user-a", 0).await, vec![1]);
    assert_eq!(store.event_log_last_seq("user-a").await.expect("last"), 1);
    assert_eq!(
        append(store, "user-a", "note", json!(2)).await,
        2,
        "no hole"
    );
}

/// Several events appended in one transaction get consecutive seqs and
/// commit together.
pub async fn appends_in_one_transaction_commit_together<S: EventLogStore>(store: &S) {
    let mut tx = store.begin().await.expect("begin");
    let mut got = Vec::new();
    for i in 0..3 {
        got.push(
            store
                .event_log_append(&mut tx, "user-a", "note", &json!(i))
                .await
                .expect("append"),
        );
    }
    assert_eq!(got, vec![1, 2, 3]);
    store.commit(tx).await.expect("commit");
    assert_eq!(seqs(store, "user-a", 0).await, vec![1, 2, 3]);
}

/// Concurrent appenders to one stream get distinct seqs that are exactly
/// 1..=n, and the log holds each once, in seq order.
pub async fn concurrent_appends_get_contiguous_seqs<S: EventLogStore>(store: &S) {
    const TASKS: i64 = 8;
    const EACH: i64 = 10;
    let mut handles = Vec::new();
    for task in 0..TASKS {
        let store = store.clone();
        handles.push(tokio::spawn(async move {
            let mut got = Vec::new();
            for i in 0..EACH {
                got.push(append(&store, "user-a", "note", json!([task, i])).await);
            }
            got
        }));
    }
    let mut all = Vec::new();
    for handle in handles {
        let got = handle.await.expect("task");
        assert!(
            got.windows(2).all(|w| w[0] < w[1]),
            "one task's seqs increase: {got:?}"
        );
        all.extend(got);
    }
    all.sort_unstable();
    assert_eq!(all, (1..=TASKS * EACH).collect::<Vec<_>>());
    assert_eq!(seqs(store, "user-a", 0).await, all);
}

/// Seqs are never reused: after every event was trimmed, the next append
/// continues where the stream was.
pub async fn seqs_survive_trimming<S: EventLogStore>(store: &S) {
    for i in 1..=3 {
        append(store, "user-a", "note", json!(i)).await;
    }
    let later = now_ms() + Duration::seconds(1);
    assert_eq!(store.event_log_trim(later, 100).await.expect("trim"), 3);
    assert!(seqs(store, "user-a", 0).await.is_empty());
    assert_eq!(store.event_log_last_seq("user-a").await.expect("last"), 3);
    assert_eq!(append(store, "user-a", "note", json!(4)).await, 4);
}

/// Age retention deletes events older than the cut-off, oldest first, at
/// most `batch` at a time, and leaves newer ones.
pub async fn trim_by_age_deletes_in_batches<S: EventLogStore>(store: &S) {
    for i in 1..=5 {
        append(store, "user-a", "note", json!(i)).await;
    }
    let cut = now_ms() + Duration::milliseconds(1);
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    append(store, "user-b", "note", json!("new")).await;

    let long_ago = now_ms() - Duration::hours(1);
    assert_eq!(store.event_log_trim(long_ago, 100).await.expect("trim"), 0);
    assert_eq!(store.event_log_trim(cut, 0).await.expect("trim"), 0);
    assert_eq!(store.event_log_trim(cut, 3).await.expect("trim"), 3);
    assert_eq!(
        seqs(store, "user-a", 0).await,
        vec![4, 5],
        "oldest went first"
    );
    assert_eq!(store.event_log_trim(cut, 3).await.expect("trim"), 2);
    assert_eq!(store.event_log_trim(cut, 3).await.expect("trim"), 0);
    assert_eq!(seqs(store, "user-b", 0).await, vec![1], "newer events stay");
}

/// Count retention keeps each stream's newest `keep` events, deleting at
/// most `batch` per call.
pub async fn trim_keep_last_keeps_newest_per_stream<S: EventLogStore>(store: &S) {
    for i in 1..=6 {
        append(store, "user-a", "note", json!(i)).await;
    }
    for i in 1..=2 {
        append(store, "user-b", "note", json!(i)).await;
    }
    assert_eq!(store.event_log_trim_keep_last(2, 0).await.expect("trim"), 0);
    assert_eq!(store.event_log_trim_keep_last(2, 3).await.expect("trim"), 3);
    assert_eq!(store.event_log_trim_keep_last(2, 3).await.expect("trim"), 1);
    assert_eq!(store.event_log_trim_keep_last(2, 3).await.expect("trim"), 0);
    assert_eq!(seqs(store, "user-a", 0).await, vec![5, 6]);
    assert_eq!(
        seqs(store, "user-b", 0).await,
        vec![1, 2],
        "under the limit"
    );
    assert_eq!(append(store, "user-a", "note", json!(7)).await, 7);
}

/// Expands into one `#[tokio::test]` per [`EventLogStore`] behaviour, each
/// against the store made by `$make` (an async expression yielding a store
/// or a [`Fixture`](crate::store_suite::Fixture)). The tests are named
/// `event_log_conformance::<behaviour>`. See the
/// [module docs](crate::event_log_suite).
///
/// [`EventLogStore`]: keel_store::EventLogStore
#[macro_export]
macro_rules! event_log_conformance_tests {
    ($make:expr) => {
        $crate::__event_log_conformance_tests! {
            $make;
            seqs_are_contiguous_per_stream,
            read_after_returns_events_in_order,
            last_seq_of_unknown_stream_is_zero,
            rolled_back_append_leaves_no_hole,
            appends_in_one_transaction_commit_together,
            concurrent_appends_get_contiguous_seqs,
            seqs_survive_trimming,
            trim_by_age_deletes_in_batches,
            trim_keep_last_keeps_newest_per_stream,
        }
    };
}

/// The expansion of [`event_log_conformance_tests!`]; not for direct use.
#[doc(hidden)]
#[macro_export]
macro_rules! __event_log_conformance_tests {
    ($make:expr; $($test:ident),* $(,)?) => {
        mod event_log_conformance {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    let fixture = $crate::store_suite::Fixture::from($make.await);
                    $crate::event_log_suite::$test(fixture.store()).await;
                }
            )*
        }
    };
}
