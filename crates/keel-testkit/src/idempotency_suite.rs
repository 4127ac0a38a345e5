//! The [`IdempotencyStore`] conformance suite: what every backend behind the
//! HTTP Idempotency-Key layer must do, written once and run against each.
//!
//! The layer's promises (concurrent duplicates execute once, a retry gets
//! the first response byte for byte, a reused key with another request is
//! refused) are only as good as the store's atomicity, so the suite checks
//! exactly that, through the trait alone.
//!
//! Run it from a backend's integration tests with
//! [`idempotency_conformance_tests!`](crate::idempotency_conformance_tests),
//! giving an async expression that makes a *fresh, empty* store (or a
//! [`Fixture`](crate::store_suite::Fixture)):
//!
//! ```ignore
//! keel_testkit::idempotency_conformance_tests!(async {
//!     let dir = tempfile::tempdir().expect("temp dir");
//!     let store = SqliteStore::open(dir.path().join("keel.db")).await.expect("open");
//!     keel_testkit::store_suite::Fixture::new(store).keep_alive(dir)
//! });
//! ```
//!
//! [`IdempotencyStore`]: keel_messaging::store::IdempotencyStore

use bytes::Bytes;
use chrono::{DateTime, Duration, Utc};
use keel_messaging::store::{IdempotencyBegin, IdempotencyStore, StoredResponse};

use crate::store_suite::now_ms;

fn in_a_day() -> DateTime<Utc> {
    now_ms() + Duration::hours(24)
}

fn response() -> StoredResponse {
    StoredResponse {
        status: 201,
        headers: vec![
            ("content-type".into(), "application/json".into()),
            ("location".into(), "/orders/A-1".into()),
            ("x-dup".into(), "1".into()),
            ("x-dup".into(), "2".into()),
        ],
        // Not valid UTF-8 on purpose: the body is bytes, not text.
        body: Bytes::from_static(b"{\"id\":\"A-1\"}\xff\x00"),
    }
}

/// A new key starts; asking again while it is in flight says so.
pub async fn new_key_starts_then_is_in_flight<S: IdempotencyStore>(store: &S) {
    let first = store
        .idempotency_begin("alice", "k1", "fp", in_a_day())
        .await
        .expect("begin");
    assert_eq!(first, IdempotencyBegin::Started);
    let second = store
        .idempotency_begin("alice", "k1", "fp", in_a_day())
        .await
        .expect("begin");
    assert_eq!(second, IdempotencyBegin::InFlight);
}

/// A completed key replays its response exactly: status, headers in order
/// (duplicates kept) and body bytes.
pub async fn completed_key_replays_the_response<S: IdempotencyStore>(store: &S) {
    store
        .idempotency_begin("alice", "k1", "fp", in_a_day())
        .await
        .expect("begin");
    store
        .idempotency_complete("alice", "k1", &response())
        .await
        .expect("complete");
    for _ in 0..2 {
        let again = store
            .idempotency_begin("alice", "k1", "fp", in_a_day())
            .await
            .expect("begin");
        assert_eq!(again, IdempotencyBegin::Completed(response()));
    }
}

/// The same key with another fingerprint is a mismatch, whether the first
/// request is in flight or completed, and does not disturb it.
pub async fn other_fingerprint_is_a_mismatch<S: IdempotencyStore>(store: &S) {
    store
        .idempotency_begin("alice", "k1", "fp-a", in_a_day())
        .await
        .expect("begin");
    let clash = store
        .idempotency_begin("alice", "k1", "fp-b", in_a_day())
        .await
        .expect("begin");
    assert_eq!(clash, IdempotencyBegin::Mismatch, "in flight");
    store
        .idempotency_complete("alice", "k1", &response())
        .await
        .expect("complete");
    let clash = store
        .idempotency_begin("alice", "k1", "fp-b", in_a_day())
        .await
        .expect("begin");
    assert_eq!(clash, IdempotencyBegin::Mismatch, "completed");
    let same = store
        .idempotency_begin("alice", "k1", "fp-a", in_a_day())
        .await
        .expect("begin");
    assert_eq!(same, IdempotencyBegin::Completed(response()));
}

/// The same key from two principals is two keys.
pub async fn keys_are_scoped_per_principal<S: IdempotencyStore>(store: &S) {
    store
        .idempotency_begin("alice", "k1", "fp-a", in_a_day())
        .await
        .expect("begin");
    store
        .idempotency_complete("alice", "k1", &response())
        .await
        .expect("complete");
    let bob = store
        .idempotency_begin("bob", "k1", "fp-b", in_a_day())
        .await
        .expect("begin");
    assert_eq!(bob, IdempotencyBegin::Started);
}

/// A released key starts again; releasing a completed key (or none) changes
/// nothing and is not an error.
pub async fn release_frees_only_in_flight_keys<S: IdempotencyStore>(store: &S) {
    store
        .idempotency_begin("alice", "k1", "fp", in_a_day())
        .await
        .expect("begin");
    store
        .idempotency_release("alice", "k1")
        .await
        .expect("release");
    let again = store
        .idempotency_begin("alice", "k1", "fp-other", in_a_day())
        .await
        .expect("begin");
    assert_eq!(again, IdempotencyBegin::Started, "a released key is free");
    store
        .idempotency_complete("alice", "k1", &response())
        .await
        .expect("complete");
    store
        .idempotency_release("alice", "k1")
        .await
        .expect("release of a completed key");
    store
        .idempotency_release("alice", "never")
        .await
        .expect("release of no key");
    let replay = store
        .idempotency_begin("alice", "k1", "fp-other", in_a_day())
        .await
        .expect("begin");
    assert_eq!(replay, IdempotencyBegin::Completed(response()));
}

/// Completing a key that is not in flight is `NotFound`, and stores nothing.
pub async fn complete_requires_an_in_flight_key<S: IdempotencyStore>(store: &S) {
    let err = store
        .idempotency_complete("alice", "nope", &response())
        .await
        .expect_err("complete without begin");
    assert!(
        matches!(err, keel_messaging::StoreError::NotFound(_)),
        "{err:?}"
    );
    let fresh = store
        .idempotency_begin("alice", "nope", "fp", in_a_day())
        .await
        .expect("begin");
    assert_eq!(fresh, IdempotencyBegin::Started);
}

/// After its expiry a key starts afresh, even with another fingerprint.
pub async fn expired_key_starts_afresh<S: IdempotencyStore>(store: &S) {
    let past = now_ms() - Duration::milliseconds(1);
    store
        .idempotency_begin("alice", "k1", "fp-a", past)
        .await
        .expect("begin");
    let in_flight_expired = store
        .idempotency_begin("alice", "k1", "fp-b", past)
        .await
        .expect("begin");
    assert_eq!(in_flight_expired, IdempotencyBegin::Started);
    store
        .idempotency_complete("alice", "k1", &response())
        .await
        .expect("complete");
    let completed_expired = store
        .idempotency_begin("alice", "k1", "fp-c", in_a_day())
        .await
        .expect("begin");
    assert_eq!(completed_expired, IdempotencyBegin::Started);
}

/// An in-flight key whose lock has passed (its process died) is taken over
/// by a retry of the same request, but still refuses another request.
pub async fn abandoned_lock_is_taken_over<S: IdempotencyStore>(store: &S) {
    let lock_passed = now_ms() - Duration::milliseconds(1);
    let started = store
        .idempotency_begin_locked("alice", "k1", "fp", lock_passed, in_a_day())
        .await
        .expect("begin");
    assert_eq!(started, IdempotencyBegin::Started);
    let other = store
        .idempotency_begin_locked("alice", "k1", "fp-other", in_a_day(), in_a_day())
        .await
        .expect("begin");
    assert_eq!(other, IdempotencyBegin::Mismatch);
    let retry = store
        .idempotency_begin_locked("alice", "k1", "fp", in_a_day(), in_a_day())
        .await
        .expect("begin");
    assert_eq!(retry, IdempotencyBegin::Started, "lock passed: taken over");
    let held = store
        .idempotency_begin_locked("alice", "k1", "fp", in_a_day(), in_a_day())
        .await
        .expect("begin");
    assert_eq!(held, IdempotencyBegin::InFlight, "the new lock holds");
}

/// Of many concurrent begins for one key, exactly one starts.
pub async fn concurrent_begins_start_exactly_once<S: IdempotencyStore>(store: &S) {
    const TASKS: usize = 20;
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(TASKS));
    let mut handles = Vec::new();
    for _ in 0..TASKS {
        let store = store.clone();
        let barrier = barrier.clone();
        handles.push(tokio::spawn(async move {
            barrier.wait().await;
            store
                .idempotency_begin("alice", "race", "fp", in_a_day())
                .await
                .expect("begin")
        }));
    }
    let mut started = 0;
    for handle in handles {
        match handle.await.expect("task") {
            IdempotencyBegin::Started => started += 1,
            IdempotencyBegin::InFlight => {}
            other => panic!("unexpected outcome {other:?}"),
        }
    }
    assert_eq!(started, 1, "exactly one begin may start the key");
}

/// Prune deletes expired keys (in flight or completed), at most `batch` at
/// a time, and leaves live ones.
pub async fn prune_deletes_expired_keys_in_batches<S: IdempotencyStore>(store: &S) {
    let past = now_ms() - Duration::seconds(10);
    for i in 0..5 {
        store
            .idempotency_begin("alice", &format!("old-{i}"), "fp", past)
            .await
            .expect("begin");
    }
    store
        .idempotency_complete("alice", "old-0", &response())
        .await
        .expect("complete");
    store
        .idempotency_begin("alice", "live", "fp", in_a_day())
        .await
        .expect("begin");
    let now = now_ms();
    assert_eq!(store.idempotency_prune(now, 0).await.expect("prune"), 0);
    assert_eq!(store.idempotency_prune(now, 3).await.expect("prune"), 3);
    assert_eq!(store.idempotency_prune(now, 3).await.expect("prune"), 2);
    assert_eq!(store.idempotency_prune(now, 3).await.expect("prune"), 0);
    let live = store
        .idempotency_begin("alice", "live", "fp", in_a_day())
        .await
        .expect("begin");
    assert_eq!(
        live,
        IdempotencyBegin::InFlight,
        "live keys survive pruning"
    );
    for i in 0..5 {
        let fresh = store
            .idempotency_begin("alice", &format!("old-{i}"), "fp2", in_a_day())
            .await
            .expect("begin");
        assert_eq!(fresh, IdempotencyBegin::Started, "old-{i} was pruned");
    }
}

/// Expands into one `#[tokio::test]` per [`IdempotencyStore`] behaviour,
/// each against the store made by `$make` (an async expression yielding a
/// store or a [`Fixture`](crate::store_suite::Fixture)). The tests are named
/// `idempotency_conformance::<behaviour>`. See the
/// [module docs](crate::idempotency_suite).
///
/// [`IdempotencyStore`]: keel_messaging::store::IdempotencyStore
#[macro_export]
macro_rules! idempotency_conformance_tests {
    ($make:expr) => {
        $crate::__idempotency_conformance_tests! {
            $make;
            new_key_starts_then_is_in_flight,
            completed_key_replays_the_response,
            other_fingerprint_is_a_mismatch,
            keys_are_scoped_per_principal,
            release_frees_only_in_flight_keys,
            complete_requires_an_in_flight_key,
            expired_key_starts_afresh,
            abandoned_lock_is_taken_over,
            concurrent_begins_start_exactly_once,
            prune_deletes_expired_keys_in_batches,
        }
    };
}

/// The expansion of [`idempotency_conformance_tests!`]; not for direct use.
#[doc(hidden)]
#[macro_export]
macro_rules! __idempotency_conformance_tests {
    ($make:expr; $($test:ident),* $(,)?) => {
        mod idempotency_conformance {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    let fixture = $crate::store_suite::Fixture::from($make.await);
                    $crate::idempotency_suite::$test(fixture.store()).await;
                }
            )*
        }
    };
}
