//! SQLite-specific behaviour of the store: what the conformance suite cannot
//! see through the traits (pragmas, indexes, locking, files, restarts).

use std::num::NonZeroU32;
use std::path::Path;
use std::time::Duration;

use keel_core::{Classify, ErrorClass};
use keel_store::StoreError;
use keel_store::{FenceStore, OutboxRecord, OutboxStore, Store};
use sqlx::Row;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use super::error::is_busy;
use super::{SqliteDialect, SqliteStore, SqliteStoreOptions, outbox};

fn record(event_id: &str, key: &str) -> OutboxRecord {
    OutboxRecord {
        event_id: event_id.to_owned(),
        topic: "orders".to_owned(),
        partition_key: key.to_owned(),
        headers: Default::default(),
        payload: bytes::Bytes::from_static(b"{}"),
    }
}

async fn append(store: &SqliteStore, records: &[OutboxRecord]) {
    let mut tx = store.begin().await.expect("begin");
    store.outbox_append(&mut tx, records).await.expect("append");
    store.commit(tx).await.expect("commit");
}

/// A second, independent pool on the same file (another process, or the
/// broker's pool).
async fn raw_pool(path: &Path, connections: u32) -> SqlitePool {
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .busy_timeout(Duration::from_secs(5));
    SqlitePoolOptions::new()
        .max_connections(connections)
        .connect_with(options)
        .await
        .expect("raw pool")
}

async fn pragma(pool: &SqlitePool, name: &str) -> String {
    let row = sqlx::query(sqlx::AssertSqlSafe(format!("PRAGMA {name}")))
        .fetch_one(pool)
        .await
        .expect("pragma");
    row.try_get::<String, _>(0)
        .or_else(|_| row.try_get::<i64, _>(0).map(|n| n.to_string()))
        .expect("pragma value")
}

async fn query_plan(pool: &SqlitePool, sql: &str, binds: usize) -> String {
    let explain = format!("EXPLAIN QUERY PLAN {sql}");
    let mut plan =
        sqlx::query_as::<_, (i64, i64, i64, String)>(sqlx::AssertSqlSafe(explain.as_str()));
    for _ in 0..binds {
        plan = plan.bind(0_i64);
    }
    let rows = plan.fetch_all(pool).await.expect("explain");
    rows.into_iter()
        .map(|(_, _, _, detail)| detail)
        .collect::<Vec<_>>()
        .join("\n")
}

#[tokio::test]
async fn file_store_uses_wal_full_sync_foreign_keys_and_memory_journals() {
    let dir = tempfile::tempdir().expect("dir");
    let store = SqliteStore::open(dir.path().join("keel.db"))
        .await
        .expect("open");
    assert_eq!(store.file(), Some(dir.path().join("keel.db").as_path()));
    assert_eq!(pragma(store.pool(), "journal_mode").await, "wal");
    assert_eq!(pragma(store.pool(), "synchronous").await, "2", "FULL");
    assert_eq!(pragma(store.pool(), "foreign_keys").await, "1");
    assert_eq!(pragma(store.pool(), "busy_timeout").await, "5000");
    assert_eq!(
        pragma(store.pool(), "temp_store").await,
        "2",
        "the writer's statement journals in memory"
    );
    assert_eq!(pragma(store.read_pool(), "query_only").await, "1");
    store.ready().await.expect("ready");
}

#[tokio::test]
async fn synchronous_and_busy_timeout_are_configurable() {
    let dir = tempfile::tempdir().expect("dir");
    let store = SqliteStoreOptions::new()
        .synchronous(SqliteSynchronous::Normal)
        .busy_timeout(Duration::from_millis(250))
        .read_connections(NonZeroU32::MIN)
        .open(dir.path().join("keel.db"))
        .await
        .expect("open");
    assert_eq!(pragma(store.pool(), "synchronous").await, "1", "NORMAL");
    assert_eq!(pragma(store.pool(), "busy_timeout").await, "250");
}

#[tokio::test]
async fn reads_outside_transactions_cannot_write() {
    let dir = tempfile::tempdir().expect("dir");
    let store = SqliteStore::open(dir.path().join("keel.db"))
        .await
        .expect("open");
    let err = sqlx::query("INSERT INTO keel_fences (resource, last_token) VALUES ('x', 1)")
        .execute(store.read_pool())
        .await
        .expect_err("query_only");
    assert!(err.to_string().contains("readonly"), "{err}");
}

#[tokio::test]
async fn fencing_tokens_keep_growing_across_reopen() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("keel.db");
    let store = SqliteStore::open(&path).await.expect("open");
    let mut last = 0;
    for _ in 0..3 {
        last = store.fence_next("invoice:1").await.expect("token");
    }
    store.close().await;
    drop(store);

    let reopened = SqliteStore::open(&path).await.expect("reopen");
    let next = reopened.fence_next("invoice:1").await.expect("token");
    assert!(next > last, "{next} after restart must exceed {last}");
}

#[tokio::test]
async fn reopening_keeps_rows_and_migrates_once() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("keel.db");
    let store = SqliteStore::open(&path).await.expect("open");
    append(&store, &[record("e-1", "A-1")]).await;
    store.close().await;

    let reopened = SqliteStore::open(&path).await.expect("reopen");
    reopened.ready().await.expect("ready");
    assert_eq!(reopened.outbox_stats().await.expect("stats").unpublished, 1);
}

#[tokio::test]
async fn migrations_ignore_the_brokers_versions_in_a_shared_file() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("keel.db");
    let store = SqliteStore::open(&path).await.expect("open");
    // What the broker's migrator leaves behind in the same table.
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (2001, 'broker', 1, x'00', 0)",
    )
    .execute(store.pool())
    .await
    .expect("fake broker migration");
    store.close().await;

    let reopened = SqliteStore::open(&path)
        .await
        .expect("reopen beside the broker");
    reopened.ready().await.expect("ready");
}

#[tokio::test]
async fn concurrent_opens_of_a_new_file_all_succeed() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("keel.db");
    let opens = (0..4).map(|_| {
        let path = path.clone();
        tokio::spawn(async move { SqliteStore::open(path).await })
    });
    for open in opens {
        let store = open.await.expect("task").expect("open");
        store.ready().await.expect("ready");
    }
}

#[tokio::test]
async fn hot_queries_use_the_partial_indexes() {
    let store = SqliteStore::open_in_memory().await.expect("open");
    let pool = store.pool();

    let claim = query_plan(pool, outbox::CLAIM_SQL, 4).await;
    let scans_unpublished = |plan: &str| {
        plan.lines()
            .any(|l| l.ends_with("USING INDEX keel_outbox_unpublished"))
    };
    assert!(scans_unpublished(&claim), "claim scan:\n{claim}");
    assert!(
        claim.contains("keel_outbox_unpublished_key"),
        "per-key check:\n{claim}"
    );
    assert!(
        !claim
            .lines()
            .any(|l| l.starts_with("SCAN") && !l.contains("USING")),
        "no table scan:\n{claim}"
    );

    let prune = query_plan(pool, &keel_sql::outbox::prune_sql::<SqliteDialect>(), 2).await;
    assert!(prune.contains("keel_outbox_published"), "prune:\n{prune}");

    let stats = query_plan(pool, keel_sql::outbox::STATS_SQL, 0).await;
    assert!(scans_unpublished(&stats), "stats:\n{stats}");

    let due = query_plan(pool, &keel_sql::saga::due_sql::<SqliteDialect>(2), 4).await;
    assert!(due.contains("keel_sagas_due"), "due:\n{due}");
}

/// The point of the partial index: published rows leave it, so the relay's
/// scan costs the same after a million events as after ten.
#[tokio::test]
async fn unpublished_index_stays_small_as_published_rows_pile_up() {
    let dir = tempfile::tempdir().expect("dir");
    let store = SqliteStore::open(dir.path().join("keel.db"))
        .await
        .expect("open");
    let records: Vec<_> = (0..2_000)
        .map(|i| record(&format!("e-{i}"), &format!("K-{}", i % 50)))
        .collect();
    append(&store, &records).await;
    loop {
        let claimed = store
            .outbox_claim("relay", 500, Duration::from_secs(30))
            .await
            .expect("claim");
        if claimed.is_empty() {
            break;
        }
        let ids: Vec<i64> = claimed.iter().map(|p| p.id).collect();
        store.outbox_mark_published(&ids).await.expect("mark");
    }
    let pages = |name: &'static str| {
        let pool = store.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM dbstat WHERE name = ?1")
                .bind(name)
                .fetch_one(&pool)
                .await
                .expect("dbstat")
        }
    };
    let table = pages("keel_outbox").await;
    let unpublished = pages("keel_outbox_unpublished").await;
    let by_key = pages("keel_outbox_unpublished_key").await;
    assert!(
        table > 20,
        "the table holds the published rows: {table} pages"
    );
    assert_eq!(unpublished, 1, "the relay's index is one empty page");
    assert_eq!(by_key, 1, "so is the per-key index");
}

#[tokio::test]
async fn appends_of_many_records_keep_their_order() {
    let store = SqliteStore::open_in_memory().await.expect("open");
    let records: Vec<_> = (0..150)
        .map(|i| record(&format!("e-{i:03}"), &format!("K-{i}")))
        .collect();
    append(&store, &records).await;
    let claimed = store
        .outbox_claim("relay", 1_000, Duration::from_secs(30))
        .await
        .expect("claim");
    let got: Vec<_> = claimed.iter().map(|p| p.record.clone()).collect();
    assert_eq!(got, records);
}

#[tokio::test]
async fn business_row_and_event_commit_or_roll_back_together() {
    let store = SqliteStore::open_in_memory().await.expect("open");
    sqlx::query("CREATE TABLE orders (id TEXT PRIMARY KEY)")
        .execute(store.pool())
        .await
        .expect("schema");

    for (order, commit) in [("A-1", false), ("A-2", true)] {
        let mut tx = store.begin().await.expect("begin");
        sqlx::query("INSERT INTO orders (id) VALUES (?)")
            .bind(order)
            .execute(&mut *tx)
            .await
            .expect("order");
        store
            .outbox_append(&mut tx, &[record(&format!("placed-{order}"), order)])
            .await
            .expect("append");
        if commit {
            store.commit(tx).await.expect("commit");
        } else {
            store.rollback(tx).await.expect("rollback");
        }
    }
    let orders: Vec<String> = sqlx::query_scalar("SELECT id FROM orders")
        .fetch_all(store.pool())
        .await
        .expect("orders");
    let events = store
        .outbox_claim("relay", 10, Duration::from_secs(30))
        .await
        .expect("claim");
    assert_eq!(orders, ["A-2"]);
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].record.event_id, "placed-A-2");
}

/// Another process holding the write lock past the busy timeout makes the
/// store report `Unavailable`, which callers retry.
#[tokio::test]
async fn a_held_write_lock_is_unavailable_and_retryable() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("keel.db");
    let store = SqliteStoreOptions::new()
        .busy_timeout(Duration::from_millis(100))
        .open(&path)
        .await
        .expect("open");
    let other = raw_pool(&path, 1).await;
    let holder = other.begin_with("BEGIN IMMEDIATE").await.expect("lock");

    let err = store.fence_next("x").await.expect_err("locked");
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");
    assert_eq!(err.class(), ErrorClass::Retryable);
    let err = store.begin().await.expect_err("locked");
    assert!(matches!(err, StoreError::Unavailable(_)), "{err:?}");

    holder.rollback().await.expect("release");
    assert_eq!(store.fence_next("x").await.expect("token"), 1);
}

/// Why `begin` says `BEGIN IMMEDIATE`: two deferred read-then-write
/// transactions in WAL mode make the second fail at once with
/// `SQLITE_BUSY` (its snapshot is stale), busy timeout or not...
#[tokio::test]
async fn deferred_read_then_write_transactions_fail_under_concurrency() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("keel.db");
    let _store = SqliteStore::open(&path).await.expect("open");
    let pool = raw_pool(&path, 2).await;

    let mut first = pool.begin().await.expect("begin");
    let mut second = pool.begin().await.expect("begin");
    for tx in [&mut first, &mut second] {
        sqlx::query("SELECT COUNT(*) FROM keel_outbox")
            .fetch_one(&mut **tx)
            .await
            .expect("read");
    }
    let write = "INSERT INTO keel_fences (resource, last_token) VALUES (?1, 1)";
    sqlx::query(write)
        .bind("a")
        .execute(&mut *first)
        .await
        .expect("write");
    first.commit().await.expect("commit");
    let err = sqlx::query(write)
        .bind("b")
        .execute(&mut *second)
        .await
        .expect_err("stale snapshot cannot upgrade");
    assert!(is_busy(&err), "{err}");
}

/// ...while the store's transactions, even on a pool of several writer
/// connections, take the write lock at `BEGIN`: the same interleaving makes
/// the second wait for the first, read what the first wrote, and both
/// commit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn immediate_read_then_write_transactions_both_commit() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("keel.db");
    let store = SqliteStore::from_pool(raw_pool(&path, 4).await)
        .await
        .expect("from_pool");
    let count = "SELECT COUNT(*) FROM keel_outbox";

    let mut first = store.begin().await.expect("begin");
    let seen: i64 = sqlx::query_scalar(count)
        .fetch_one(&mut *first)
        .await
        .expect("read");
    let (read_done, second_read) = tokio::sync::oneshot::channel();
    let second = tokio::spawn({
        let store = store.clone();
        async move {
            let mut tx = store.begin().await?;
            let seen: i64 = sqlx::query_scalar(count)
                .fetch_one(&mut *tx)
                .await
                .map_err(StoreError::other)?;
            let _ = read_done.send(());
            store
                .outbox_append(&mut tx, &[record(&format!("second-after-{seen}"), "A-1")])
                .await?;
            store.commit(tx).await
        }
    });
    // A deferred second transaction would have read by now; an immediate one
    // is still waiting for the write lock.
    let second_read_early = tokio::time::timeout(Duration::from_millis(300), second_read)
        .await
        .is_ok();
    store
        .outbox_append(&mut first, &[record(&format!("first-after-{seen}"), "A-1")])
        .await
        .expect("append");
    store.commit(first).await.expect("commit");

    second
        .await
        .expect("task")
        .expect("the second transaction commits");
    assert!(!second_read_early, "the second transaction waited at BEGIN");
    let events = store
        .outbox_claim("relay", 10, Duration::from_secs(30))
        .await
        .expect("claim");
    let ids: Vec<_> = events.iter().map(|p| p.record.event_id.as_str()).collect();
    assert_eq!(
        ids,
        ["first-after-0", "second-after-1"],
        "serialized, no lost update"
    );
}

#[tokio::test]
async fn in_memory_store_is_private_and_works() {
    let a = SqliteStore::open_in_memory().await.expect("open");
    let b = SqliteStore::open_in_memory().await.expect("open");
    append(&a, &[record("e-1", "A-1")]).await;
    a.ready().await.expect("ready");
    assert_eq!(a.outbox_stats().await.expect("stats").unpublished, 1);
    assert_eq!(b.outbox_stats().await.expect("stats").unpublished, 0);
}

/// What a `begin_with` cancelled between sqlx's two awaits leaves behind: a
/// pooled connection inside a transaction nobody owns. Its next borrower
/// must get it back outside one: `begin` works, and an autocommit write is
/// committed for every other connection to see, not held in the orphan.
#[tokio::test]
async fn a_connection_left_inside_a_transaction_is_rolled_back_at_checkout() {
    use sqlx::Database;
    use sqlx_core::transaction::TransactionManager;
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("keel.db");
    let store = SqliteStore::open(&path).await.expect("open");
    sqlx::query("CREATE TABLE probe (x INTEGER)")
        .execute(store.pool())
        .await
        .expect("table");
    {
        let mut conn = store.pool().acquire().await.expect("conn");
        <sqlx::Sqlite as Database>::TransactionManager::begin(
            &mut conn,
            Some(sqlx::SqlStr::from_static("BEGIN IMMEDIATE")),
        )
        .await
        .expect("begin without a Transaction");
    }

    sqlx::query("INSERT INTO probe VALUES (1)")
        .execute(store.pool())
        .await
        .expect("write");
    let other = raw_pool(&path, 1).await;
    let seen: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM probe")
        .fetch_one(&other)
        .await
        .expect("read");
    assert_eq!(seen, 1, "the acknowledged write is committed");
    let tx = store.begin().await.expect("begin after the leak");
    store.rollback(tx).await.expect("rollback");
}

/// `begin` dropped at every point of its wait, hundreds of times, while
/// another writer holds the lock part of the time: no transaction outlives
/// its caller, so afterwards writes commit and `begin` works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn begins_dropped_while_waiting_leave_no_transaction_behind() {
    let dir = tempfile::tempdir().expect("dir");
    let path = dir.path().join("keel.db");
    let store = SqliteStoreOptions::new()
        .busy_timeout(Duration::from_millis(200))
        .open(&path)
        .await
        .expect("open");
    let other = raw_pool(&path, 1).await;
    for i in 0..300u64 {
        let holder = if i % 10 == 0 {
            Some(other.begin_with("BEGIN IMMEDIATE").await.expect("lock"))
        } else {
            None
        };
        let _ = tokio::time::timeout(Duration::from_micros(i % 60), store.begin()).await;
        drop(holder);
    }
    assert_eq!(store.fence_next("after").await.expect("write"), 1);
    let seen: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM keel_fences WHERE resource = 'after'")
        .fetch_one(&other)
        .await
        .expect("read");
    assert_eq!(seen, 1, "the write is committed, not held in an orphan");
    let tx = store.begin().await.expect("begin");
    store.commit(tx).await.expect("commit");
}
