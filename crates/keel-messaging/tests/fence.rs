//! Fencing tokens from SqliteStore, checked by a SQLite resource with a
//! conditional write (`... where id = $2 and fence < $1`).

use std::collections::HashSet;

use keel_messaging::fence::{FencedLock, FencingToken, StaleToken};
use keel_messaging::store::FenceStore;
use keel_sqlite::store::SqliteStore;
use sqlx::SqlitePool;
use tempfile::TempDir;

/// The fenced write, concretely, for SQLite: the resource refuses a token
/// that is not newer than the last one it accepted.
async fn fenced_update(
    pool: &SqlitePool,
    invoice: &str,
    status: &str,
    token: FencingToken,
) -> Result<(), StaleToken> {
    let done =
        sqlx::query("UPDATE invoices SET status = ?3, fence = ?1 WHERE id = ?2 AND fence < ?1")
            .bind(token.as_i64())
            .bind(invoice)
            .bind(status)
            .execute(pool)
            .await
            .expect("the update runs");
    token.check_rows(done.rows_affected())
}

/// The upsert form: create the row with the token, or update it only with
/// a newer one.
async fn fenced_upsert(
    pool: &SqlitePool,
    invoice: &str,
    status: &str,
    token: FencingToken,
) -> Result<(), StaleToken> {
    let done = sqlx::query(
        "INSERT INTO invoices (id, status, fence) VALUES (?2, ?3, ?1)
         ON CONFLICT (id) DO UPDATE SET status = excluded.status, fence = excluded.fence
         WHERE invoices.fence < excluded.fence",
    )
    .bind(token.as_i64())
    .bind(invoice)
    .bind(status)
    .execute(pool)
    .await
    .expect("the upsert runs");
    token.check_rows(done.rows_affected())
}

async fn open(dir: &TempDir) -> SqliteStore {
    let store = SqliteStore::open(dir.path().join("app.db")).await.unwrap();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS invoices (
             id TEXT PRIMARY KEY, status TEXT NOT NULL, fence INTEGER NOT NULL DEFAULT 0)",
    )
    .execute(store.pool())
    .await
    .unwrap();
    store
}

async fn row(pool: &SqlitePool, id: &str) -> (String, i64) {
    sqlx::query_as("SELECT status, fence FROM invoices WHERE id = ?1")
        .bind(id)
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_stale_holder_writing_after_the_new_holder_changes_zero_rows() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir).await;
    let lock = FencedLock::new(store.clone());
    for _ in 0..40 {
        lock.acquire("invoice:7").await.unwrap();
    }
    sqlx::query("INSERT INTO invoices (id, status) VALUES ('inv-7', 'open')")
        .execute(store.pool())
        .await
        .unwrap();

    // The old holder gets 41, then pauses (GC, a stalled VM) past its lease.
    let old = lock.acquire("invoice:7").await.unwrap();
    // Someone else acquires and writes.
    let new = lock.acquire("invoice:7").await.unwrap();
    assert_eq!((old.get(), new.get()), (41, 42));
    fenced_update(store.pool(), "inv-7", "charged by 42", new)
        .await
        .unwrap();

    // The old holder wakes up and writes: refused by the resource.
    let err = fenced_update(store.pool(), "inv-7", "charged by 41", old)
        .await
        .unwrap_err();
    assert_eq!(err.token, old);
    assert_eq!(
        row(store.pool(), "inv-7").await,
        ("charged by 42".into(), 42)
    );

    // The current holder may write again only with a newer token.
    assert!(
        fenced_update(store.pool(), "inv-7", "again", new)
            .await
            .is_err()
    );
    let newer = lock.acquire("invoice:7").await.unwrap();
    fenced_update(store.pool(), "inv-7", "refunded by 43", newer)
        .await
        .unwrap();
    assert_eq!(
        row(store.pool(), "inv-7").await,
        ("refunded by 43".into(), 43)
    );
}

#[tokio::test]
async fn the_upsert_form_creates_with_the_token_and_refuses_older_ones() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir).await;
    let lock = FencedLock::new(store.clone());
    let old = lock.acquire("invoice:8").await.unwrap();
    let new = lock.acquire("invoice:8").await.unwrap();
    fenced_upsert(store.pool(), "inv-8", "new", new)
        .await
        .unwrap();
    assert!(
        fenced_upsert(store.pool(), "inv-8", "old", old)
            .await
            .is_err()
    );
    assert_eq!(
        row(store.pool(), "inv-8").await,
        ("new".into(), new.as_i64())
    );
}

#[tokio::test]
async fn tokens_keep_growing_across_restarts_and_per_resource() {
    let dir = tempfile::tempdir().unwrap();
    let before = {
        let store = open(&dir).await;
        let t = store.fence_next("leader").await.unwrap();
        store.close().await;
        t
    };
    let store = open(&dir).await;
    let after = store.fence_next("leader").await.unwrap();
    assert!(after > before, "{after} after restart, {before} before");
    assert_eq!(store.fence_next("another").await.unwrap(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_acquirers_never_share_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let store = open(&dir).await;
    let mut tasks = Vec::new();
    for _ in 0..50 {
        let lock = FencedLock::new(store.clone());
        tasks.push(tokio::spawn(async move {
            lock.acquire("invoice:9").await.unwrap()
        }));
    }
    let mut seen = HashSet::new();
    for t in tasks {
        assert!(
            seen.insert(t.await.unwrap()),
            "a token was handed out twice"
        );
    }
    assert_eq!(seen.len(), 50);
    assert_eq!(seen.iter().max().unwrap().get(), 50);
}
