//! Every await can be cancelled: a client hang-up, a timeout or a `select!`
//! drops a future wherever it is. These tests drop PostgreSQL work at its
//! worst moments and check that no pooled session is ever handed out inside
//! a transaction, so an acknowledged write is never discarded by somebody
//! else's `ROLLBACK`.

mod common;

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use keel_postgres::PgStore;
use keel_store::Store;
use sqlx::Connection;

/// Polls `future` once and drops it: the cancellation that lands between
/// sending a statement and reading its answer.
fn poll_once_and_drop<F: Future>(future: F) {
    let mut future = pin!(future);
    let mut cx = Context::from_waker(Waker::noop());
    if future.as_mut().poll(&mut cx).is_ready() {
        panic!("the statement answered within one poll; the test proves nothing");
    }
}

/// Drops a `begin()` after its `BEGIN` was sent and before its answer was
/// read, every time: a slow statement abandoned just before keeps the
/// answer 300 ms away while the `begin()` is given 100 ms. Then the
/// connection goes back to the pool, as a cancelled request's would.
async fn cancel_a_begin_mid_flight(store: &PgStore) {
    let mut conn = store.pool().acquire().await.expect("acquire");
    poll_once_and_drop(sqlx::raw_sql("SELECT pg_sleep(0.3)").execute(&mut *conn));
    let begin = tokio::time::timeout(Duration::from_millis(100), conn.begin()).await;
    assert!(begin.is_err(), "BEGIN answered before the timeout");
}

async fn one_connection_store() -> Option<(PgStore, common::ServerLease)> {
    let (store, lease) = common::fresh_store().await?;
    let url = keel_testkit::services::postgres_url().expect("url");
    let single = PgStore::options()
        .schema(store.schema())
        .max_connections(1)
        .open(&url)
        .await
        .expect("connect");
    sqlx::query("CREATE TABLE notes (body TEXT NOT NULL)")
        .execute(single.pool())
        .await
        .expect("create table");
    Some((single, lease))
}

async fn notes(store: &PgStore) -> Vec<String> {
    sqlx::query_scalar("SELECT body FROM notes ORDER BY body")
        .fetch_all(store.pool())
        .await
        .expect("read notes")
}

async fn insert_note(store: &PgStore, body: &str) {
    sqlx::query("INSERT INTO notes (body) VALUES ($1)")
        .bind(body)
        .execute(store.pool())
        .await
        .expect("autocommit insert");
}

/// The repro of sqlx issues #4385/#4393: sqlx 0.8.6 and 0.9.0 raised their
/// transaction depth only after `BEGIN`'s answer, so a `begin()` dropped in
/// that window returned the connection to the pool inside an open
/// transaction. The next borrower's autocommit insert landed in it, and a
/// later rollback on that connection discarded a write that had answered
/// success. sqlx 0.9.1 fixed it, and the store no longer asks the server at
/// every checkout: this test is what says the sqlx in use still holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_sqlx_begin_never_swallows_the_next_autocommit_write() {
    let Some((store, _lease)) = one_connection_store().await else {
        return;
    };
    cancel_a_begin_mid_flight(&store).await;
    insert_note(&store, "acknowledged").await;
    let tx = store.pool().begin().await.expect("begin");
    tx.rollback().await.expect("rollback");
    assert_eq!(notes(&store).await, ["acknowledged"]);
}

/// A session that goes back to the pool inside a transaction sqlx knows of
/// (begun with its transaction manager by hand and never ended) is rolled
/// back at the next checkout, so the next borrower's autocommit write is
/// not swallowed by it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_returned_inside_a_transaction_is_rolled_back_at_checkout() {
    use sqlx_core::transaction::TransactionManager;
    let Some((store, _lease)) = one_connection_store().await else {
        return;
    };
    let mut conn = store.pool().acquire().await.expect("acquire");
    sqlx::postgres::PgTransactionManager::begin(&mut conn, None)
        .await
        .expect("begin by hand");
    sqlx::query("INSERT INTO notes (body) VALUES ('never committed')")
        .execute(&mut *conn)
        .await
        .expect("insert in the leaked transaction");
    drop(conn);
    insert_note(&store, "acknowledged").await;
    assert_eq!(notes(&store).await, ["acknowledged"]);
}

/// Keel's own [`Store::begin`] dropped after every number of polls from 1
/// to 40, with the runtime running in between: whichever await it is cut
/// at, nothing is left open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_begin_cut_at_any_poll_leaves_no_open_transaction() {
    let Some((store, _lease)) = one_connection_store().await else {
        return;
    };
    for polls in 1..=40 {
        let mut begin = pin!(store.begin());
        for _ in 0..polls {
            let polled = std::future::poll_fn(|cx| Poll::Ready(begin.as_mut().poll(cx))).await;
            if polled.is_ready() {
                break;
            }
            tokio::task::yield_now().await;
        }
    }
    insert_note(&store, "acknowledged").await;
    let tx = store.begin().await.expect("begin");
    store.rollback(tx).await.expect("rollback");
    assert_eq!(notes(&store).await, ["acknowledged"]);
}

/// A session left in a failed transaction (`25P02`) is never handed out:
/// the next borrower gets a working connection, not "current transaction is
/// aborted" until `max_lifetime`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_begin_followed_by_an_error_does_not_poison_the_pool() {
    let Some((store, _lease)) = one_connection_store().await else {
        return;
    };
    cancel_a_begin_mid_flight(&store).await;
    let failed = sqlx::query("SELECT 1/0").execute(store.pool()).await;
    assert!(failed.is_err(), "division by zero must fail");
    insert_note(&store, "after the error").await;
    assert_eq!(notes(&store).await, ["after the error"]);
}

/// A transaction whose future is dropped after its writes (a hang-up in the
/// middle of a handler) rolls back, and the connection comes back clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_dropped_mid_write_rolls_back_and_frees_the_session() {
    let Some((store, _lease)) = one_connection_store().await else {
        return;
    };
    let abandoned = async {
        let mut tx = store.begin().await.expect("begin");
        sqlx::query("INSERT INTO notes (body) VALUES ('abandoned')")
            .execute(&mut *tx)
            .await
            .expect("insert");
        poll_once_and_drop(sqlx::query("SELECT pg_sleep(0.2)").execute(&mut *tx));
    };
    abandoned.await;
    insert_note(&store, "acknowledged").await;
    let tx = store.begin().await.expect("begin");
    store.rollback(tx).await.expect("rollback");
    assert_eq!(notes(&store).await, ["acknowledged"]);
}

/// The server-side bound on the damage: a session idle inside a transaction
/// is ended by `idle_in_transaction_session_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_carry_an_idle_in_transaction_timeout() {
    let Some((store, _lease)) = one_connection_store().await else {
        return;
    };
    let timeout: String = sqlx::query_scalar("SHOW idle_in_transaction_session_timeout")
        .fetch_one(store.pool())
        .await
        .expect("show");
    assert_eq!(timeout, "1min");
}

/// A stuck statement (a lock held elsewhere, a runaway query) keeps its
/// pooled connection only as long as `statement_timeout`: 30 s unless told,
/// and then the server cancels it. Migrations run without it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_are_cancelled_after_the_statement_timeout() {
    let Some((store, _lease)) = one_connection_store().await else {
        return;
    };
    let timeout: String = sqlx::query_scalar("SHOW statement_timeout")
        .fetch_one(store.pool())
        .await
        .expect("show");
    assert_eq!(timeout, "30s");

    let url = keel_testkit::services::postgres_url().expect("url");
    let short = PgStore::options()
        .schema(store.schema())
        .max_connections(1)
        .statement_timeout(Duration::from_millis(300))
        .open(&url)
        .await
        .expect("connect");
    let started = keel_core::clock::now();
    let err = sqlx::query("SELECT pg_sleep(10)")
        .execute(short.pool())
        .await
        .expect_err("cancelled");
    let code = err.as_database_error().and_then(|db| db.code());
    assert_eq!(code.as_deref(), Some("57014"), "query_canceled: {err}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "cancelled after {:?}",
        started.elapsed()
    );
    sqlx::query("SELECT 1")
        .execute(short.pool())
        .await
        .expect("the connection serves the next statement");
}

/// The store names every setting under which an acknowledged commit can be
/// lost, and nothing else: on the test server's own settings (fsync as
/// `KEEL_TEST_PG_FSYNC` says, on unless told), then with synchronous
/// commits turned off in the session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_names_the_settings_that_lose_acknowledged_commits() {
    let Some((store, _lease)) = one_connection_store().await else {
        return;
    };
    let fsync: String = sqlx::query_scalar("SHOW fsync")
        .fetch_one(store.pool())
        .await
        .expect("show");
    let warnings = store.durability_warnings().await.expect("read settings");
    if fsync == "on" {
        assert!(warnings.is_empty(), "{warnings:?}");
    } else {
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(warnings[0].starts_with("fsync = off"), "{warnings:?}");
    }

    sqlx::query("SET synchronous_commit = off")
        .execute(store.pool())
        .await
        .expect("set");
    let warnings = store.durability_warnings().await.expect("read settings");
    assert!(
        warnings
            .iter()
            .any(|w| w.starts_with("synchronous_commit = off")),
        "{warnings:?}"
    );
}
