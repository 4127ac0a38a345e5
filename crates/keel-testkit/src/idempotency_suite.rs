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
//! [`IdempotencyStore`]: keel_store::IdempotencyStore

use bytes::Bytes;
use chrono::{DateTime, Duration, Utc};
use keel_store::StoreError;
use keel_store::{IdempotencyBegin, IdempotencyClaim, IdempotencyStore, StoredResponse};

use crate::store_suite::now_ms;

fn in_a_day() -> DateTime<Utc> {
    now_ms() + Duration::hours(24)
}

/// The owner of most claims below.
const A: &str = "owner-a";

/// A claim by [`A`], locked and alive for a day.
fn claim<'a>(principal: &'a str, key: &'a str, fingerprint: &'a str) -> IdempotencyClaim<'a> {
    IdempotencyClaim {
        principal,
        key,
        fingerprint,
        owner: A,
        locked_until: in_a_day(),
        expires_at: in_a_day(),
    }
}

async fn begin<S: IdempotencyStore>(store: &S, claim: IdempotencyClaim<'_>) -> IdempotencyBegin {
    store.idempotency_begin(&claim).await.expect("begin")
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
    let first = begin(store, claim("alice", "k1", "fp")).await;
    assert_eq!(first, IdempotencyBegin::Started);
    let second = begin(store, claim("alice", "k1", "fp")).await;
    assert_eq!(second, IdempotencyBegin::InFlight);
}

/// A completed key replays its response exactly: status, headers in order
/// (duplicates kept) and body bytes.
pub async fn completed_key_replays_the_response<S: IdempotencyStore>(store: &S) {
    begin(store, claim("alice", "k1", "fp")).await;
    store
        .idempotency_complete("alice", "k1", A, &response())
        .await
        .expect("complete");
    for _ in 0..2 {
        let again = begin(store, claim("alice", "k1", "fp")).await;
        assert_eq!(again, IdempotencyBegin::Completed(response()));
    }
}

/// A key completed inside the caller's transaction replays only once that
/// transaction commits: rolled back, the key is still in flight under its
/// owner; and only the owner can complete it there either.
pub async fn complete_in_a_transaction_lands_with_its_commit<S: IdempotencyStore>(store: &S) {
    begin(store, claim("alice", "k1", "fp")).await;
    let mut tx = store.begin().await.expect("begin a transaction");
    store
        .idempotency_complete_in(&mut tx, "alice", "k1", A, &response())
        .await
        .expect("complete in the transaction");
    store.rollback(tx).await.expect("rollback");
    let again = begin(store, claim("alice", "k1", "fp")).await;
    assert_eq!(again, IdempotencyBegin::InFlight, "rolled back with its tx");

    let mut tx = store.begin().await.expect("begin a transaction");
    let other = store
        .idempotency_complete_in(&mut tx, "alice", "k1", "owner-b", &response())
        .await;
    assert!(matches!(other, Err(StoreError::NotFound(_))), "{other:?}");
    store
        .idempotency_complete_in(&mut tx, "alice", "k1", A, &response())
        .await
        .expect("complete in the transaction");
    store.commit(tx).await.expect("commit");
    let replayed = begin(store, claim("alice", "k1", "fp")).await;
    assert_eq!(replayed, IdempotencyBegin::Completed(response()));
}

/// The same key with another fingerprint is a mismatch, whether the first
/// request is in flight or completed, and does not disturb it.
pub async fn other_fingerprint_is_a_mismatch<S: IdempotencyStore>(store: &S) {
    begin(store, claim("alice", "k1", "fp-a")).await;
    let clash = begin(store, claim("alice", "k1", "fp-b")).await;
    assert_eq!(clash, IdempotencyBegin::Mismatch, "in flight");
    store
        .idempotency_complete("alice", "k1", A, &response())
        .await
        .expect("complete");
    let clash = begin(store, claim("alice", "k1", "fp-b")).await;
    assert_eq!(clash, IdempotencyBegin::Mismatch, "completed");
    let same = begin(store, claim("alice", "k1", "fp-a")).await;
    assert_eq!(same, IdempotencyBegin::Completed(response()));
}

/// The same key from two principals is two keys.
pub async fn keys_are_scoped_per_principal<S: IdempotencyStore>(store: &S) {
    begin(store, claim("alice", "k1", "fp-a")).await;
    store
        .idempotency_complete("alice", "k1", A, &response())
        .await
        .expect("complete");
    let bob = begin(store, claim("bob", "k1", "fp-b")).await;
    assert_eq!(bob, IdempotencyBegin::Started);
}

/// A released key starts again; releasing a completed key (or none) changes
/// nothing and is not an error.
pub async fn release_frees_only_in_flight_keys<S: IdempotencyStore>(store: &S) {
    begin(store, claim("alice", "k1", "fp")).await;
    store
        .idempotency_release("alice", "k1", A)
        .await
        .expect("release");
    let again = begin(store, claim("alice", "k1", "fp-other")).await;
    assert_eq!(again, IdempotencyBegin::Started, "a released key is free");
    store
        .idempotency_complete("alice", "k1", A, &response())
        .await
        .expect("complete");
    store
        .idempotency_release("alice", "k1", A)
        .await
        .expect("release of a completed key");
    store
        .idempotency_release("alice", "never", A)
        .await
        .expect("release of no key");
    let replay = begin(store, claim("alice", "k1", "fp-other")).await;
    assert_eq!(replay, IdempotencyBegin::Completed(response()));
}

/// Completing a key that is not in flight is `NotFound`, and stores nothing.
pub async fn complete_requires_an_in_flight_key<S: IdempotencyStore>(store: &S) {
    let err = store
        .idempotency_complete("alice", "nope", A, &response())
        .await
        .expect_err("complete without begin");
    assert!(
        matches!(err, keel_store::StoreError::NotFound(_)),
        "{err:?}"
    );
    let fresh = begin(store, claim("alice", "nope", "fp")).await;
    assert_eq!(fresh, IdempotencyBegin::Started);
}

/// After its expiry a key starts afresh, even with another fingerprint.
pub async fn expired_key_starts_afresh<S: IdempotencyStore>(store: &S) {
    let past = now_ms() - Duration::milliseconds(1);
    begin(
        store,
        IdempotencyClaim {
            expires_at: past,
            locked_until: past,
            ..claim("alice", "k1", "fp-a")
        },
    )
    .await;
    let in_flight_expired = begin(
        store,
        IdempotencyClaim {
            expires_at: past,
            locked_until: past,
            ..claim("alice", "k1", "fp-b")
        },
    )
    .await;
    assert_eq!(in_flight_expired, IdempotencyBegin::Started);
    store
        .idempotency_complete("alice", "k1", A, &response())
        .await
        .expect("complete");
    let completed_expired = begin(store, claim("alice", "k1", "fp-c")).await;
    assert_eq!(completed_expired, IdempotencyBegin::Started);
}

/// A claim by `owner` whose lock has already passed (its process died).
fn abandoned<'a>(key: &'a str, owner: &'a str) -> IdempotencyClaim<'a> {
    IdempotencyClaim {
        owner,
        locked_until: now_ms() - Duration::milliseconds(1),
        ..claim("alice", key, "fp")
    }
}

/// An in-flight key whose lock has passed (its process died) is taken over
/// by a retry of the same request, but still refuses another request; the
/// new lock holds.
pub async fn abandoned_lock_is_taken_over<S: IdempotencyStore>(store: &S) {
    let started = begin(store, abandoned("k1", "dead")).await;
    assert_eq!(started, IdempotencyBegin::Started);
    let other = begin(store, claim("alice", "k1", "fp-other")).await;
    assert_eq!(other, IdempotencyBegin::Mismatch);
    let retry = begin(store, claim("alice", "k1", "fp")).await;
    assert_eq!(retry, IdempotencyBegin::Started, "lock passed: taken over");
    let held = begin(
        store,
        IdempotencyClaim {
            owner: "owner-c",
            ..claim("alice", "k1", "fp")
        },
    )
    .await;
    assert_eq!(held, IdempotencyBegin::InFlight, "the new lock holds");
}

/// Only the owner renews, completes or releases its key: a holder that lost
/// the key to a takeover changes nothing, and its successor's answer is
/// the one replayed.
pub async fn only_the_owner_settles_a_key<S: IdempotencyStore>(store: &S) {
    begin(store, abandoned("k1", "dead")).await;
    assert_eq!(
        begin(store, claim("alice", "k1", "fp")).await,
        IdempotencyBegin::Started
    );
    let renewed = store
        .idempotency_renew("alice", "k1", "dead", in_a_day())
        .await
        .expect("renew");
    assert!(!renewed, "the old holder's renewal is refused");
    let err = store
        .idempotency_complete("alice", "k1", "dead", &response())
        .await
        .expect_err("the old holder cannot complete");
    assert!(
        matches!(err, keel_store::StoreError::NotFound(_)),
        "{err:?}"
    );
    store
        .idempotency_release("alice", "k1", "dead")
        .await
        .expect("a stale release is not an error");
    let still = begin(
        store,
        IdempotencyClaim {
            owner: "owner-c",
            ..claim("alice", "k1", "fp")
        },
    )
    .await;
    assert_eq!(
        still,
        IdempotencyBegin::InFlight,
        "a stale release freed nothing"
    );
    let renewed = store
        .idempotency_renew("alice", "k1", A, in_a_day())
        .await
        .expect("renew");
    assert!(renewed, "the holder renews");
    store
        .idempotency_complete("alice", "k1", A, &response())
        .await
        .expect("the holder completes");
    let renewed = store
        .idempotency_renew("alice", "k1", A, in_a_day())
        .await
        .expect("renew");
    assert!(!renewed, "a completed key is no one's to renew");
    assert_eq!(
        begin(store, claim("alice", "k1", "fp")).await,
        IdempotencyBegin::Completed(response())
    );
}

/// A renewed lock holds past the one it replaced: a key claimed with a lock
/// that has passed, then renewed, is not taken over.
pub async fn a_renewed_lock_holds<S: IdempotencyStore>(store: &S) {
    begin(store, abandoned("k1", A)).await;
    let renewed = store
        .idempotency_renew("alice", "k1", A, in_a_day())
        .await
        .expect("renew");
    assert!(renewed);
    let retry = begin(
        store,
        IdempotencyClaim {
            owner: "owner-b",
            ..claim("alice", "k1", "fp")
        },
    )
    .await;
    assert_eq!(retry, IdempotencyBegin::InFlight);
}

/// Of many concurrent retries of an abandoned key, exactly one takes it
/// over.
pub async fn concurrent_takeovers_start_exactly_once<S: IdempotencyStore>(store: &S) {
    begin(store, abandoned("race", "dead")).await;
    let started = race(store, "race").await;
    assert_eq!(started, 1, "exactly one retry may take the key over");
}

/// Begins `key` from 20 tasks at once, each its own owner; how many started.
async fn race<S: IdempotencyStore>(store: &S, key: &'static str) -> usize {
    const TASKS: usize = 20;
    let barrier = std::sync::Arc::new(tokio::sync::Barrier::new(TASKS));
    let mut handles = Vec::new();
    for task in 0..TASKS {
        let store = store.clone();
        let barrier = barrier.clone();
        handles.push(tokio::spawn(async move {
            let owner = format!("owner-{task}");
            barrier.wait().await;
            let claim = IdempotencyClaim {
                owner: &owner,
                ..claim("alice", key, "fp")
            };
            begin(&store, claim).await
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
    started
}

/// Of many concurrent begins for one key, exactly one starts.
pub async fn concurrent_begins_start_exactly_once<S: IdempotencyStore>(store: &S) {
    assert_eq!(
        race(store, "race").await,
        1,
        "exactly one begin may start the key"
    );
}

/// Prune deletes expired keys (in flight or completed), at most `batch` at
/// a time, and leaves live ones.
pub async fn prune_deletes_expired_keys_in_batches<S: IdempotencyStore>(store: &S) {
    let past = now_ms() - Duration::seconds(10);
    for i in 0..5 {
        begin(
            store,
            IdempotencyClaim {
                expires_at: past,
                locked_until: past,
                ..claim("alice", &format!("old-{i}"), "fp")
            },
        )
        .await;
    }
    store
        .idempotency_complete("alice", "old-0", A, &response())
        .await
        .expect("complete");
    begin(store, claim("alice", "live", "fp")).await;
    let now = now_ms();
    assert_eq!(store.idempotency_prune(now, 0).await.expect("prune"), 0);
    assert_eq!(store.idempotency_prune(now, 3).await.expect("prune"), 3);
    assert_eq!(store.idempotency_prune(now, 3).await.expect("prune"), 2);
    assert_eq!(store.idempotency_prune(now, 3).await.expect("prune"), 0);
    let live = begin(store, claim("alice", "live", "fp")).await;
    assert_eq!(
        live,
        IdempotencyBegin::InFlight,
        "live keys survive pruning"
    );
    for i in 0..5 {
        let fresh = begin(store, claim("alice", &format!("old-{i}"), "fp2")).await;
        assert_eq!(fresh, IdempotencyBegin::Started, "old-{i} was pruned");
    }
}

/// Expands into one `#[tokio::test]` per [`IdempotencyStore`] behaviour,
/// each against the store made by `$make` (an async expression yielding a
/// store or a [`Fixture`](crate::store_suite::Fixture)). The tests are named
/// `idempotency_conformance::<behaviour>`. See the
/// [module docs](crate::idempotency_suite).
///
/// [`IdempotencyStore`]: keel_store::IdempotencyStore
#[macro_export]
macro_rules! idempotency_conformance_tests {
    ($make:expr) => {
        $crate::__idempotency_conformance_tests! {
            $make;
            new_key_starts_then_is_in_flight,
            completed_key_replays_the_response,
            complete_in_a_transaction_lands_with_its_commit,
            other_fingerprint_is_a_mismatch,
            keys_are_scoped_per_principal,
            release_frees_only_in_flight_keys,
            complete_requires_an_in_flight_key,
            expired_key_starts_afresh,
            abandoned_lock_is_taken_over,
            only_the_owner_settles_a_key,
            a_renewed_lock_holds,
            concurrent_begins_start_exactly_once,
            concurrent_takeovers_start_exactly_once,
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
