//! What a statement's trip to sqlx's SQLite connection thread costs: 32
//! single-row inserts inside one transaction, sent as 32 queries (a
//! command to the connection's thread and an answer back for each, as the
//! store's writer sends them) and as one query of 32 statements (one
//! command, the same statements run back to back on that thread). The
//! difference, per statement, is the hand-off that a write path running
//! statements on the caller's thread would save. Each iteration rolls its
//! transaction back, so no fsync is measured.
//!
//! ```text
//! cargo bench -p keel-sqlite --bench handoff -- --warm-up-time 1 --measurement-time 3
//! ```

use criterion::{Criterion, Throughput};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqliteSynchronous};
use sqlx::{AssertSqlSafe, Connection, Executor, SqliteConnection};
use tempfile::TempDir;
use tokio::runtime::Runtime;

const STATEMENTS: usize = 32;
const ROW: [u8; 256] = [7; 256];
const INSERT: &str = "INSERT INTO rows (body) VALUES ($1)";
const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS rows (id INTEGER PRIMARY KEY, body BLOB NOT NULL)";

async fn one_query_per_statement(conn: &mut SqliteConnection) {
    let mut tx = conn.begin().await.expect("begin");
    for _ in 0..STATEMENTS {
        sqlx::query(INSERT)
            .bind(ROW.as_slice())
            .execute(&mut *tx)
            .await
            .expect("insert");
    }
    tx.rollback().await.expect("rollback");
}

async fn one_query_for_all(conn: &mut SqliteConnection, all: &str) {
    let mut tx = conn.begin().await.expect("begin");
    let done = sqlx::query(AssertSqlSafe(all))
        .bind(ROW.as_slice())
        .execute(&mut *tx)
        .await
        .expect("inserts");
    assert_eq!(done.rows_affected(), STATEMENTS as u64);
    tx.rollback().await.expect("rollback");
}

fn handoff(c: &mut Criterion) {
    // Two workers, as `keel serve` runs on this machine's two cores.
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = TempDir::new().expect("tempdir");
    let mut conn = connect(&rt, &dir);
    let all = vec![INSERT; STATEMENTS].join(";\n");
    let mut group = c.benchmark_group("sqlite_handoff");
    group.throughput(Throughput::Elements(STATEMENTS as u64));
    group.bench_function("one_query_per_statement", |b| {
        b.iter(|| rt.block_on(one_query_per_statement(&mut conn)));
    });
    group.bench_function("one_query_for_all", |b| {
        b.iter(|| rt.block_on(one_query_for_all(&mut conn, &all)));
    });
    group.finish();
}

fn connect(rt: &Runtime, dir: &TempDir) -> SqliteConnection {
    rt.block_on(async {
        let options = SqliteConnectOptions::new()
            .filename(dir.path().join("handoff.db"))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full);
        let mut conn = SqliteConnection::connect_with(&options)
            .await
            .expect("connect");
        conn.execute(SCHEMA).await.expect("schema");
        conn
    })
}

criterion::criterion_group!(benches, handoff);
criterion::criterion_main!(benches);
