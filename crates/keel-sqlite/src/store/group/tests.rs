//! Group commit's promises: transactions queued while a batch is open share
//! its fsync, a failed one leaves the others committed, and a crash before
//! the batch's `COMMIT` acknowledges nothing and loses nothing acknowledged.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use keel_sql::{SqlBackend, Value};
use keel_store::StoreError;
use keel_store::{FenceStore, OutboxRecord, OutboxStore, Store};
use parking_lot::Mutex;
use tempfile::TempDir;
use tokio::task::JoinSet;

use super::super::SqliteStore;

async fn store_at(path: &Path) -> SqliteStore {
    let store = SqliteStore::open(path).await.expect("open");
    sqlx::query("CREATE TABLE IF NOT EXISTS items (id INTEGER PRIMARY KEY)")
        .execute(store.pool())
        .await
        .expect("schema");
    store
}

const INSERT_ITEM: &str = "INSERT INTO items (id) VALUES ($1)";

async fn insert(tx: &mut <SqliteStore as Store>::Tx, id: i64) -> Result<(), StoreError> {
    sqlx::query(INSERT_ITEM)
        .bind(id)
        .execute(&mut **tx)
        .await
        .map(drop)
        .map_err(super::db_error)
}

async fn ids(path: &Path) -> BTreeSet<i64> {
    let store = SqliteStore::open(path).await.expect("reopen");
    let rows: Vec<(i64,)> = sqlx::query_as("SELECT id FROM items")
        .fetch_all(store.read_pool())
        .await
        .expect("read");
    store.close().await;
    rows.into_iter().map(|(id,)| id).collect()
}

/// Opens a batch with a transaction that has written row 0, and returns it
/// still open: whatever queues behind it lands in its batch.
async fn open_first(store: &SqliteStore) -> <SqliteStore as Store>::Tx {
    let mut first = store.begin().await.expect("begin");
    insert(&mut first, 0).await.expect("insert");
    first
}

/// One task per id, each inserting its row in a transaction of its own.
fn spawn_writers(
    store: &SqliteStore,
    ids: impl IntoIterator<Item = i64>,
) -> JoinSet<Result<(), StoreError>> {
    let mut writers = JoinSet::new();
    for id in ids {
        let store = store.clone();
        writers.spawn(async move {
            let mut tx = store.begin().await?;
            insert(&mut tx, id).await?;
            store.commit(tx).await
        });
    }
    writers
}

/// Commits `first` once every one of `writers` is queued behind it, so
/// that they all land in its batch; returns its answer and theirs. A writer
/// that never queues for the writer's batch fails the test after 10 s.
async fn commit_behind<T: 'static>(
    store: &SqliteStore,
    first: <SqliteStore as Store>::Tx,
    mut writers: JoinSet<Result<T, StoreError>>,
) -> (Result<(), StoreError>, Vec<Result<T, StoreError>>) {
    let queued = async {
        while store.group.queued() < writers.len() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), queued)
        .await
        .expect("every writer queued for the writer's batch");
    let answer = store.commit(first).await;
    let mut answers = Vec::new();
    while let Some(outcome) = writers.join_next().await {
        answers.push(outcome.expect("a writer panicked"));
    }
    (answer, answers)
}

/// [`commit_behind`] for writers that must all commit: fails the test with
/// `why` if any of them, or `first`, does not.
async fn commit_all_behind(
    store: &SqliteStore,
    first: <SqliteStore as Store>::Tx,
    writers: JoinSet<Result<(), StoreError>>,
    why: &str,
) {
    let (answer, answers) = commit_behind(store, first, writers).await;
    answer.expect("the first commit");
    for answer in answers {
        answer.expect(why);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_queued_while_a_batch_is_open_share_its_commit() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("group.db");
    let store = store_at(&path).await;
    let before = store.group.commits();
    let flushes_before = store.group.flushes();

    let first = open_first(&store).await;
    commit_all_behind(
        &store,
        first,
        spawn_writers(&store, 1..=20),
        "every queued transaction commits",
    )
    .await;

    assert_eq!(
        store.group.commits() - before,
        1,
        "21 transactions, one COMMIT"
    );
    assert_eq!(
        store.group.flushes() - flushes_before,
        1,
        "21 releases, one flush queued for the writer"
    );
    store.close().await;
    assert_eq!(ids(&path).await, (0..=20).collect());
}

/// The store's own single-statement writes that return a row (fencing
/// tokens, lease grants, saga saves) join the batch too. On the writer pool
/// outside it, each waited for the batch's `COMMIT` and then paid an fsync
/// of its own: the orchestrator's saves, several per saga, were most of the
/// reference shop's fsyncs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_writes_that_return_a_row_share_the_batch_commit() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("group.db");
    let store = store_at(&path).await;
    let before = store.group.commits();

    let first = open_first(&store).await;
    let mut tokens = JoinSet::new();
    for n in 0..10 {
        let store = store.clone();
        tokens.spawn(async move { store.fence_next(&format!("resource-{n}")).await });
    }
    let (answer, tokens) = commit_behind(&store, first, tokens).await;
    answer.expect("the first commit");
    for token in tokens {
        assert_eq!(token.expect("a token"), 1);
    }

    assert_eq!(
        store.group.commits() - before,
        1,
        "one transaction and ten tokens, one COMMIT"
    );
    store.close().await;
}

/// The outbox relay's claim leases its rows in the batch too: on the writer
/// pool outside it, each claim waited for the batch and fsynced alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outbox_claims_share_the_batch_commit() {
    let dir = TempDir::new().unwrap();
    let store = store_at(&dir.path().join("group.db")).await;
    let records: Vec<OutboxRecord> = (0..10)
        .map(|n| OutboxRecord {
            event_id: format!("event-{n}"),
            topic: "orders".to_owned(),
            partition_key: format!("order-{n}"),
            headers: Default::default(),
            payload: b"{}".to_vec().into(),
        })
        .collect();
    let mut tx = store.begin().await.expect("begin");
    store
        .outbox_append(&mut tx, &records)
        .await
        .expect("append");
    store.commit(tx).await.expect("commit");
    let before = store.group.commits();

    let first = open_first(&store).await;
    let mut claims = JoinSet::new();
    for n in 0..5 {
        let store = store.clone();
        let relay = format!("relay-{n}");
        claims.spawn(async move { store.outbox_claim(&relay, 2, Duration::from_secs(30)).await });
    }
    let (answer, claims) = commit_behind(&store, first, claims).await;
    answer.expect("the first commit");
    let claimed: BTreeSet<String> = claims
        .into_iter()
        .flat_map(|claim| claim.expect("a claim"))
        .map(|row| row.record.event_id)
        .collect();
    assert_eq!(claimed.len(), 10, "every row leased once: {claimed:?}");

    assert_eq!(
        store.group.commits() - before,
        1,
        "one transaction and five claims, one COMMIT"
    );
    store.close().await;
}

/// A batch is bounded: past `MAX_BATCH` released transactions it commits
/// without waiting for the rest of the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_queue_is_committed_in_bounded_batches() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("group.db");
    let store = store_at(&path).await;
    let before = store.group.commits();
    let queued = super::MAX_BATCH + 44;

    let first = open_first(&store).await;
    let writers = spawn_writers(&store, 1..=queued as i64);
    commit_all_behind(&store, first, writers, "every queued transaction commits").await;

    assert_eq!(
        store.group.commits() - before,
        2,
        "{} transactions, at most {} per COMMIT",
        queued + 1,
        super::MAX_BATCH
    );
    store.close().await;
    assert_eq!(ids(&path).await.len(), queued + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_transaction_in_a_batch_leaves_the_others_committed() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("group.db");
    let store = store_at(&path).await;
    let before = store.group.commits();

    let first = open_first(&store).await;
    let mut writers = JoinSet::new();
    for id in 1..=12_i64 {
        let store = store.clone();
        writers.spawn(async move {
            let mut tx = store.begin().await?;
            insert(&mut tx, id).await?;
            if id % 2 == 1 {
                // The duplicate fails; the row before it must go with it.
                let duplicate = insert(&mut tx, id).await;
                assert!(
                    matches!(duplicate, Err(StoreError::Conflict(_))),
                    "{duplicate:?}"
                );
                if id % 4 == 1 {
                    store.rollback(tx).await?;
                } else {
                    drop(tx);
                }
                return Ok(());
            }
            store.commit(tx).await
        });
    }
    commit_all_behind(
        &store,
        first,
        writers,
        "no transaction is failed by another",
    )
    .await;

    assert_eq!(store.group.commits() - before, 1);
    store.close().await;
    let evens = [0, 2, 4, 6, 8, 10, 12].into_iter().collect();
    assert_eq!(ids(&path).await, evens);
}

/// The store's own writes are one statement each and skip the savepoint: one
/// that fails is undone by SQLite alone, and the batch goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_single_write_leaves_the_others_committed() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("group.db");
    let store = store_at(&path).await;
    let mut tx = store.begin().await.expect("begin");
    insert(&mut tx, 100).await.expect("insert");
    store.commit(tx).await.expect("commit");
    let before = store.group.commits();

    let first = open_first(&store).await;
    let mut writers = spawn_writers(&store, 1..=8);
    // Rows already written when the duplicates run: 0 in `first`, which
    // holds the writer, and 100 committed before (a row of a queued writer
    // could be written after its duplicate, which would then succeed).
    for id in [0, 100] {
        let store = store.clone();
        writers.spawn(async move {
            let duplicate = SqlBackend::write(&store, INSERT_ITEM, &[Value::Int(Some(id))]).await;
            assert!(
                matches!(duplicate, Err(StoreError::Conflict(_))),
                "{duplicate:?}"
            );
            Ok(())
        });
    }
    commit_all_behind(
        &store,
        first,
        writers,
        "no transaction is failed by another",
    )
    .await;

    assert_eq!(store.group.commits() - before, 1);
    store.close().await;
    assert_eq!(ids(&path).await, (0..=8).chain([100]).collect());
}

/// A single write has no savepoint to undo; dropped before its commit, its
/// statement has run and commits with the batch, and the batch is unharmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_write_dropped_before_its_commit_leaves_the_batch_whole() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("group.db");
    let store = store_at(&path).await;
    let before = store.group.commits();

    let mut single = store.group.begin_statement().await.expect("begin");
    insert(&mut single, 7).await.expect("insert");
    let mut writers = spawn_writers(&store, 1..=3);
    while store.group.queued() < 3 {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    drop(single);
    while let Some(answer) = writers.join_next().await {
        answer.expect("a writer panicked").expect("a commit");
    }

    assert_eq!(store.group.commits() - before, 1);
    store.close().await;
    assert_eq!(ids(&path).await, [1, 2, 3, 7].into_iter().collect());
}

/// SQLite rolls the whole transaction back on some errors (here an
/// `OR ROLLBACK` conflict; a full disk or an I/O error in production). A
/// single write has no savepoint whose failed release would reveal that, so
/// the writer checks: the batch fails, and no caller is told a row that was
/// rolled back committed. Without the check, the statements queued next ran
/// in a new transaction that the batch's `COMMIT` then committed, and every
/// caller of the lost batch was told it had committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_write_that_ends_the_batch_fails_it_and_no_answer_lies() {
    a_batch_ended_by(Ender::SingleWrite).await;
}

/// The same inside a transaction that its caller drops on the error: the
/// savepoint it would roll back is gone, and that, too, fails the batch.
/// (Dropping used to queue the rollback and ignore its failure: the same
/// lie.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_transaction_that_ended_the_batch_fails_it_and_no_answer_lies() {
    a_batch_ended_by(Ender::DroppedTransaction).await;
}

/// How the statement that ends the batch is sent.
#[derive(Clone, Copy)]
enum Ender {
    SingleWrite,
    DroppedTransaction,
}

/// What a caller queued behind the first transaction does with its row.
#[derive(Clone, Copy)]
enum Step {
    Commit,
    /// Collides with the row `OR ROLLBACK`, which ends the transaction.
    EndTheBatch(Ender),
    RollBack,
}

const ENDS_THE_BATCH: &str = "INSERT OR ROLLBACK INTO items (id) VALUES ($1)";

async fn take_step(store: &SqliteStore, id: i64, step: Step) -> Result<(), StoreError> {
    match step {
        Step::EndTheBatch(Ender::SingleWrite) => {
            SqlBackend::write(store, ENDS_THE_BATCH, &[Value::Int(Some(id))])
                .await
                .map(drop)
        }
        Step::EndTheBatch(Ender::DroppedTransaction) => {
            let mut tx = store.begin().await?;
            let ended = sqlx::query(ENDS_THE_BATCH).bind(id).execute(&mut *tx).await;
            ended.map(drop).map_err(super::db_error)
        }
        Step::Commit | Step::RollBack => {
            let mut tx = store.begin().await?;
            insert(&mut tx, id).await?;
            match step {
                Step::RollBack => store.rollback(tx).await,
                _ => store.commit(tx).await,
            }
        }
    }
}

/// Queues, behind a first transaction, a commit of row 1, a statement that
/// collides with row 1 `OR ROLLBACK` (sent as `ender` says), a transaction
/// that rolls row 5 back, and a commit of row 3; checks every answer
/// against the file.
async fn a_batch_ended_by(ender: Ender) {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("group.db");
    let store = store_at(&path).await;

    let first = open_first(&store).await;
    let mut callers: JoinSet<(i64, Result<(), StoreError>)> = JoinSet::new();
    // In this order behind `first`, each queued before the next.
    let plan = [
        (1, Step::Commit),
        (1, Step::EndTheBatch(ender)),
        (5, Step::RollBack),
        (3, Step::Commit),
    ];
    for (queued, (id, step)) in plan.into_iter().enumerate() {
        let caller = store.clone();
        callers.spawn(async move { (id, take_step(&caller, id, step).await) });
        while store.group.queued() <= queued {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }
    let mut answers = vec![(0, store.commit(first).await)];
    while let Some(answer) = callers.join_next().await {
        answers.push(answer.expect("a caller panicked"));
    }
    store.close().await;

    let durable = ids(&path).await;
    for (id, answer) in &answers {
        if answer.is_ok() && *id != 5 {
            assert!(
                durable.contains(id),
                "row {id} acknowledged but lost: {answers:?}"
            );
        }
    }
    assert_eq!(durable, [3].into_iter().collect(), "{answers:?}");
    assert!(
        answers
            .iter()
            .any(|(id, answer)| *id == 1 && matches!(answer, Err(StoreError::Conflict(_)))),
        "{answers:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_before_the_batchs_commit_acknowledges_nothing_and_loses_nothing_acknowledged() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("group.db");
    let store = store_at(&path).await;
    let mut tx = store.begin().await.unwrap();
    insert(&mut tx, 100).await.unwrap();
    store
        .commit(tx)
        .await
        .expect("acknowledged before the crash");

    fail::cfg("keel-sqlite-group-before-commit", "1*panic").unwrap();
    let first = open_first(&store).await;
    let (answer, answers) = commit_behind(&store, first, spawn_writers(&store, 1..=8)).await;
    assert!(
        matches!(answer, Err(StoreError::OutcomeUnknown(_))),
        "{answer:?}"
    );
    for answer in answers {
        assert!(
            matches!(answer, Err(StoreError::OutcomeUnknown(_))),
            "{answer:?}"
        );
    }
    fail::remove("keel-sqlite-group-before-commit");

    // The store outlives its dead batch: the next transaction starts clean.
    let mut tx = store.begin().await.expect("begin after the dead batch");
    insert(&mut tx, 101).await.unwrap();
    store.commit(tx).await.expect("commit after the dead batch");
    store.close().await;
    assert_eq!(ids(&path).await, [100, 101].into_iter().collect());
}

/// Kill -9 at a random moment of a busy writer, many times: every
/// transaction the store acknowledged is in the file afterwards.
#[test]
fn a_crash_at_any_moment_loses_nothing_acknowledged() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("group.db");
    let acked = Arc::new(Mutex::new(BTreeSet::<i64>::new()));
    let setup = tokio::runtime::Runtime::new().unwrap();
    setup.block_on(async { store_at(&path).await.close().await });
    for round in 0..12_i64 {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let acked_now = acked.clone();
        let path_now = path.clone();
        runtime.spawn(async move {
            let store = store_at(&path_now).await;
            for writer in 0..16_i64 {
                let (store, acked) = (store.clone(), acked_now.clone());
                tokio::spawn(async move {
                    for n in 0.. {
                        let id = round * 1_000_000 + writer * 10_000 + n;
                        let Ok(mut tx) = store.begin().await else {
                            continue;
                        };
                        if insert(&mut tx, id).await.is_ok() && store.commit(tx).await.is_ok() {
                            acked.lock().insert(id);
                        }
                    }
                });
            }
        });
        // Bounded, so that a store that cannot open fails here, not at the
        // runner's timeout.
        for waited in 0.. {
            if acked.lock().iter().any(|id| id / 1_000_000 == round) {
                break;
            }
            assert!(
                waited < 30_000,
                "round {round} acknowledged nothing in 30 s"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        std::thread::sleep(Duration::from_millis((round as u64 * 7) % 30));
        runtime.shutdown_background();

        let check = tokio::runtime::Runtime::new().unwrap();
        let durable = check.block_on(ids(&path));
        let acked = acked.lock();
        let lost: Vec<_> = acked.difference(&durable).collect();
        assert!(
            lost.is_empty(),
            "round {round}: acknowledged but lost: {lost:?}"
        );
    }
}

/// A transaction dropped where no runtime runs (its task outlived the
/// runtime) cannot undo its savepoint or commit the batch: the batch's
/// connection is closed, without a panic, and nothing of the batch commits.
#[test]
fn a_transaction_dropped_outside_a_runtime_closes_its_batch_uncommitted() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("group.db");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (store, open) = runtime.block_on(async {
        let store = store_at(&path).await;
        let mut tx = store.begin().await.expect("begin");
        insert(&mut tx, 1).await.expect("insert");
        store.commit(tx).await.expect("commit");
        let open = open_first(&store).await;
        (store, open)
    });
    drop(runtime);
    drop(open);
    drop(store);

    let check = tokio::runtime::Runtime::new().unwrap();
    assert_eq!(check.block_on(ids(&path)), [1].into_iter().collect());
}

/// A user's own nested transaction inside a `WriteTx` (sqlx's `begin` on
/// the connection it lends) is a savepoint inside the logical transaction's:
/// rolling it back undoes only its rows, committing it keeps them, and the
/// logical transaction commits or rolls back around it as a whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_transaction_inside_a_write_transaction_is_its_own_savepoint() {
    use sqlx::Connection;

    let dir = TempDir::new().unwrap();
    let path = dir.path().join("group.db");
    let store = store_at(&path).await;
    let nested = |ids: [i64; 2], commit_inner: bool| {
        let store = store.clone();
        async move {
            let mut tx = store.begin().await.expect("begin");
            insert(&mut tx, ids[0]).await.expect("outer insert");
            let mut inner = (*tx).begin().await.expect("nested begin");
            sqlx::query(INSERT_ITEM)
                .bind(ids[1])
                .execute(&mut *inner)
                .await
                .expect("inner insert");
            if commit_inner {
                inner.commit().await.expect("nested commit");
            } else {
                inner.rollback().await.expect("nested rollback");
            }
            tx
        }
    };

    let tx = nested([1, 2], false).await;
    store
        .commit(tx)
        .await
        .expect("commit with the inner rolled back");
    let tx = nested([3, 4], true).await;
    store
        .commit(tx)
        .await
        .expect("commit with the inner committed");
    let tx = nested([5, 6], true).await;
    store
        .rollback(tx)
        .await
        .expect("roll back around a committed inner");
    let mut tx = store.begin().await.expect("begin after");
    insert(&mut tx, 7).await.expect("insert after");
    store.commit(tx).await.expect("commit after");

    store.close().await;
    assert_eq!(ids(&path).await, [1, 3, 4, 7].into_iter().collect());
}

/// Reads row `id` in a transaction of its own, then rolls it back: whether
/// it saw the row, and the rollback's answer.
async fn read_then_roll_back(store: &SqliteStore, id: i64) -> (bool, Result<(), StoreError>) {
    let mut tx = store.begin().await.expect("begin");
    let seen: Option<(i64,)> = sqlx::query_as("SELECT id FROM items WHERE id = $1")
        .bind(id)
        .fetch_optional(&mut *tx)
        .await
        .expect("read");
    (seen.is_some(), store.rollback(tx).await)
}

/// A transaction that reads a row another one released into the batch and
/// then rolls back (the consumer's duplicate, the idempotency replay, the
/// shop's "reserved already") is answered only once that row is durable.
/// When the batch's `COMMIT` then fails (a full disk, a failed fsync), the
/// rollback fails too: before, it answered at once, and its caller acked a
/// duplicate, or replayed an answer, whose row was gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollback_that_read_its_batch_fails_with_the_batch() {
    for fault in ["full", "ioerr"] {
        let dir = TempDir::new().unwrap();
        let path = dir.path().join("group.db");
        let store = store_at(&path).await;

        let first = open_first(&store).await;
        let mut writer = spawn_writers(&store, [7]);
        while store.group.queued() < 1 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let reader = tokio::spawn({
            let store = store.clone();
            async move { read_then_roll_back(&store, 7).await }
        });
        while store.group.queued() < 2 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        fail::cfg("keel-sqlite-group-commit", &format!("1*return({fault})")).unwrap();
        let first_answer = store.commit(first).await;
        let written = writer.join_next().await.unwrap().unwrap();
        let (seen, rolled_back) = reader.await.unwrap();
        fail::remove("keel-sqlite-group-commit");

        assert!(seen, "{fault}: the reader saw the released row 7");
        assert!(first_answer.is_err() && written.is_err(), "{fault}");
        assert!(
            matches!(rolled_back, Err(StoreError::Unavailable(_))),
            "{fault}: the rollback vouched for a read its batch lost: {rolled_back:?}"
        );
        let (seen, rolled_back) = read_then_roll_back(&store, 7).await;
        assert!(!seen && rolled_back.is_ok(), "{fault}: {rolled_back:?}");
        store.close().await;
        assert!(ids(&path).await.is_empty(), "{fault}");
    }
}

/// The commit failures a full disk and a failed fsync cause: callers of a
/// batch that filled the disk hear it did not commit, callers of a batch
/// whose fsync failed hear the outcome is unknown, and the store goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_tells_every_caller_and_the_store_goes_on() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("group.db");
    let store = store_at(&path).await;
    for (fault, id) in [("full", 1), ("ioerr", 2)] {
        fail::cfg("keel-sqlite-group-commit", &format!("1*return({fault})")).unwrap();
        let first = open_first(&store).await;
        let (answer, answers) = commit_behind(&store, first, spawn_writers(&store, [id])).await;
        fail::remove("keel-sqlite-group-commit");
        for answer in answers.into_iter().chain([answer]) {
            match fault {
                "full" => assert!(
                    matches!(answer, Err(StoreError::Unavailable(_))),
                    "{answer:?}"
                ),
                _ => assert!(
                    matches!(answer, Err(StoreError::OutcomeUnknown(_))),
                    "{answer:?}"
                ),
            }
        }
    }
    let mut tx = store.begin().await.expect("begin after the failed commits");
    insert(&mut tx, 3).await.unwrap();
    store
        .commit(tx)
        .await
        .expect("commit after the failed commits");
    store.close().await;
    assert_eq!(ids(&path).await, [3].into_iter().collect());
}

/// A caller whose statement made SQLite roll the batch back, and who
/// carries on in the same transaction: its next statements find no
/// transaction and would run in autocommit, each committing at once while
/// the caller is told nothing committed. The commit gate refuses them, as
/// PostgreSQL refuses statements in an aborted transaction.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_after_sqlite_ended_the_batch_do_not_commit_on_their_own() {
    let dir = TempDir::new().unwrap();
    let path = dir.path().join("group.db");
    let store = store_at(&path).await;
    let mut tx = store.begin().await.unwrap();
    insert(&mut tx, 1).await.unwrap();
    store.commit(tx).await.unwrap();

    let mut tx = store.begin().await.unwrap();
    let ended = sqlx::query(ENDS_THE_BATCH).bind(1).execute(&mut *tx).await;
    assert!(ended.is_err(), "the conflict ends the batch");
    let carried_on = insert(&mut tx, 9).await;
    let answer = store.commit(tx).await;
    assert!(
        carried_on.is_err(),
        "a statement outside the batch's transaction must fail"
    );
    assert!(answer.is_err(), "{answer:?}");

    // The writer's own writes outside a batch still commit.
    SqlBackend::write(&store, INSERT_ITEM, &[Value::Int(Some(2))])
        .await
        .expect("a write after the ended batch");
    sqlx::query(INSERT_ITEM)
        .bind(3)
        .execute(store.pool())
        .await
        .expect("a write on the store's pool");
    store.close().await;
    assert_eq!(ids(&path).await, [1, 2, 3].into_iter().collect());
}
