//! Group commit, measured against what it replaces: 64 concurrent write
//! transactions (one 256-byte row each, WAL, `synchronous = FULL`) through
//! the store's writer, and the same 64 on a plain one-connection sqlx pool
//! that commits each on its own (`BEGIN IMMEDIATE` ... `COMMIT`), in the
//! same run, on two files in the same directory.
//!
//! ```text
//! cargo bench -p keel-sqlite --bench group_commit -- --warm-up-time 1 --measurement-time 3
//! ```

use std::time::Duration;

use criterion::{Criterion, Throughput};
use keel_core::clock;
use keel_sqlite::store::SqliteStore;
use keel_store::Store;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Executor, SqlitePool};
use tempfile::TempDir;
use tokio::runtime::Runtime;
use tokio::task::JoinSet;

const WRITERS: u64 = 64;
const ROW: [u8; 256] = [7; 256];
const INSERT: &str = "INSERT INTO rows (body) VALUES (?)";
const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS rows (id INTEGER PRIMARY KEY, body BLOB NOT NULL)";

async fn keel_writers(store: &SqliteStore) {
    let mut writers = JoinSet::new();
    for _ in 0..WRITERS {
        let store = store.clone();
        writers.spawn(async move {
            let mut tx = store.begin().await.expect("begin");
            sqlx::query(INSERT)
                .bind(ROW.as_slice())
                .execute(&mut *tx)
                .await
                .expect("insert");
            store.commit(tx).await.expect("commit");
        });
    }
    writers.join_all().await;
}

async fn raw_writers(pool: &SqlitePool) {
    let mut writers = JoinSet::new();
    for _ in 0..WRITERS {
        let pool = pool.clone();
        writers.spawn(async move {
            let mut tx = pool.begin_with("BEGIN IMMEDIATE").await.expect("begin");
            sqlx::query(INSERT)
                .bind(ROW.as_slice())
                .execute(&mut *tx)
                .await
                .expect("insert");
            tx.commit().await.expect("commit");
        });
    }
    writers.join_all().await;
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = TempDir::new().expect("dir");
    let (store, pool) = rt.block_on(async {
        let store = SqliteStore::open(dir.path().join("keel.db"))
            .await
            .expect("store");
        store.pool().execute(SCHEMA).await.expect("schema");
        let options = SqliteConnectOptions::new()
            .filename(dir.path().join("raw.db"))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full);
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(options)
            .await
            .expect("raw pool");
        pool.execute(SCHEMA).await.expect("schema");
        (store, pool)
    });

    let mut c = Criterion::default().configure_from_args();
    let mut group = c.benchmark_group("group_commit");
    group.throughput(Throughput::Elements(WRITERS));
    group.bench_function("keel_64_concurrent", |b| {
        b.iter_custom(|iters| timed(&rt, iters, || keel_writers(&store)))
    });
    group.bench_function("raw_sqlx_64_concurrent", |b| {
        b.iter_custom(|iters| timed(&rt, iters, || raw_writers(&pool)))
    });
    group.finish();
    c.final_summary();
}

fn timed<F: Future<Output = ()>>(rt: &Runtime, iters: u64, round: impl Fn() -> F) -> Duration {
    rt.block_on(async {
        let start = clock::now();
        for _ in 0..iters {
            round().await;
        }
        start.elapsed()
    })
}
