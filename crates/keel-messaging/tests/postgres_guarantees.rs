//! The PostgreSQL-specific guarantees of issue 6, each shown against the
//! shared test server: SKIP LOCKED relays never double-publish and keep
//! per-key order, late commits are not skipped, the partial index exists
//! and the claim never reads it by bitmap scan, prunes are bounded and
//! never wait for locks, deadlocks are retryable, a connection killed
//! before COMMIT is an unknown outcome (resolved when asked), and
//! LISTEN/NOTIFY wakes other processes.

#[path = "../../keel-postgres/tests/common/mod.rs"]
mod common;
#[path = "postgres/recording_broker.rs"]
mod recording_broker;

use std::collections::{BTreeMap, HashMap};
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use keel_core::{Classify, ErrorClass};
use keel_messaging::outbox::{Outbox, OutboxRelay};
use keel_messaging::store::{InboxStore, OutboxRecord, OutboxStore, Store};
use keel_postgres::{PgStore, PgWakeups, TxOutcome};

use recording_broker::{Recorded, RecordingBroker};

const LEASE: Duration = Duration::from_secs(30);

fn record(event_id: &str, key: &str) -> OutboxRecord {
    OutboxRecord {
        event_id: event_id.to_owned(),
        topic: "orders".to_owned(),
        partition_key: key.to_owned(),
        headers: Default::default(),
        payload: Bytes::from_static(b"{}"),
    }
}

async fn append_committed(store: &PgStore, records: &[OutboxRecord]) {
    let mut tx = store.begin().await.expect("begin");
    store.outbox_append(&mut tx, records).await.expect("append");
    store.commit(tx).await.expect("commit");
}

/// The same schema through another pool: another process, as PostgreSQL
/// sees it.
async fn other_process(store: &PgStore) -> PgStore {
    let url = keel_testkit::services::postgres_url().expect("url");
    common::store_in(&url, store.schema()).await
}

async fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let waited = tokio::time::timeout(timeout, async {
        while !done() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "timed out waiting for {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_relays_publish_every_row_exactly_once_in_key_order() {
    let Some((store, _lease)) = common::fresh_store().await else {
        return;
    };
    const EVENTS: usize = 600;
    const KEYS: usize = 12;
    let recorded = Arc::new(Recorded::default());
    let mut relays = Vec::new();
    for r in 0..4 {
        let replica = other_process(&store).await;
        let outbox = Outbox::new(replica);
        let broker = Arc::new(RecordingBroker::new(Arc::clone(&recorded), None));
        let relay = OutboxRelay::builder(&outbox, broker)
            .name(format!("relay-{r}"))
            .batch_size(NonZeroUsize::new(16).expect("non-zero"))
            .poll_interval(Duration::from_millis(5))
            .lease(LEASE)
            .build()
            .expect("relay");
        relays.push(tokio::spawn(async move {
            relay.run(std::future::pending()).await
        }));
    }
    // Four writers append concurrently while the relays run.
    let mut writers = Vec::new();
    for w in 0..4 {
        let store = store.clone();
        writers.push(tokio::spawn(async move {
            for i in (w..EVENTS).step_by(4) {
                let key = format!("k{}", i % KEYS);
                append_committed(&store, &[record(&format!("e{i:04}"), &key)]).await;
            }
        }));
    }
    for writer in writers {
        writer.await.expect("writer");
    }
    wait_until("every row published", Duration::from_secs(60), || {
        recorded.len() >= EVENTS
    })
    .await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    for relay in &relays {
        relay.abort();
    }

    let messages = recorded.messages.lock().clone();
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for m in &messages {
        *counts.entry(m.id.as_str()).or_default() += 1;
    }
    let duplicated: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(duplicated.is_empty(), "published twice: {duplicated:?}");
    assert_eq!(counts.len(), EVENTS, "every row published");
    assert_eq!(store.outbox_stats().await.expect("stats").unpublished, 0);

    // Per key, the broker saw the rows in id (= append) order.
    let ids = outbox_ids(&store).await;
    let mut last: BTreeMap<&str, i64> = BTreeMap::new();
    for m in &messages {
        let id = ids[&m.id];
        let previous = last.insert(m.key.as_str(), id);
        assert!(
            previous.is_none_or(|p| p < id),
            "key {} published out of order: {previous:?} then {id}",
            m.key
        );
    }
}

async fn outbox_ids(store: &PgStore) -> HashMap<String, i64> {
    sqlx::query_as("SELECT event_id, id FROM keel_outbox")
        .fetch_all(store.pool())
        .await
        .expect("ids")
        .into_iter()
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claimers_never_share_a_row() {
    let Some((store, _lease)) = common::fresh_store().await else {
        return;
    };
    let records: Vec<_> = (0..400)
        .map(|i| record(&format!("e{i}"), &format!("k{i}")))
        .collect();
    append_committed(&store, &records).await;
    let mut claimers = Vec::new();
    for c in 0..6 {
        let replica = other_process(&store).await;
        claimers.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let batch = replica
                    .outbox_claim(&format!("c{c}"), 7, LEASE)
                    .await
                    .expect("claim");
                if batch.is_empty() {
                    return mine;
                }
                let ids: Vec<i64> = batch.iter().map(|p| p.id).collect();
                // Published, so this claimer's next claim moves on.
                replica.outbox_mark_published(&ids).await.expect("mark");
                mine.extend(ids);
            }
        }));
    }
    let mut all = Vec::new();
    for claimer in claimers {
        all.extend(claimer.await.expect("claimer"));
    }
    let total = all.len();
    all.sort_unstable();
    all.dedup();
    assert_eq!(total, all.len(), "a row was claimed by two claimers");
    assert_eq!(all.len(), 400, "every row was claimed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lower_id_that_commits_late_is_claimed() {
    let Some((store, _lease)) = common::fresh_store().await else {
        return;
    };
    let mut slow = store.begin().await.expect("begin");
    store
        .outbox_append(&mut slow, &[record("e-1", "A")])
        .await
        .expect("append 1");
    append_committed(&store, &[record("e-2", "B")]).await;
    let ids = outbox_ids(&store).await;
    assert_eq!(ids.len(), 1, "only the committed row is visible");

    let claimed = store.outbox_claim("r", 10, LEASE).await.expect("claim");
    assert_eq!(claimed.len(), 1);
    assert_eq!(claimed[0].record.event_id, "e-2");
    store
        .outbox_mark_published(&[claimed[0].id])
        .await
        .expect("mark");

    store.commit(slow).await.expect("commit 1");
    let claimed = store.outbox_claim("r", 10, LEASE).await.expect("claim");
    assert_eq!(claimed.len(), 1, "the late commit is claimed");
    assert_eq!(claimed[0].record.event_id, "e-1");
    let ids = outbox_ids(&store).await;
    assert!(ids["e-1"] < ids["e-2"], "e-1 really has the lower id");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unpublished_rows_have_a_partial_index() {
    let Some((store, _lease)) = common::fresh_store().await else {
        return;
    };
    let indexes: Vec<(String, String)> = sqlx::query_as(
        "SELECT indexname, indexdef FROM pg_indexes \
         WHERE schemaname = $1 AND tablename = 'keel_outbox'",
    )
    .bind(store.schema())
    .fetch_all(store.pool())
    .await
    .expect("indexes");
    let by_name: HashMap<_, _> = indexes.into_iter().collect();
    for name in ["keel_outbox_unpublished", "keel_outbox_unpublished_key"] {
        let def = by_name
            .get(name)
            .unwrap_or_else(|| panic!("{name} missing"));
        assert!(
            def.contains("WHERE (published_at IS NULL)"),
            "{name} is not partial: {def}"
        );
    }
}

/// The claim walks the unpublished index in id order and never through a
/// bitmap scan: after a burst of marks, stale statistics made the planner
/// read every dead entry of the index on each claim (BENCHMARKS.md,
/// append → effect), where an ordered index scan stops at the first live
/// rows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_never_scans_the_unpublished_rows_by_bitmap() {
    let Some((store, _lease)) = common::fresh_store().await else {
        return;
    };
    let config: Option<Vec<String>> = sqlx::query_scalar(
        "SELECT p.proconfig FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace \
         WHERE n.nspname = $1 AND p.proname = 'keel_outbox_claim'",
    )
    .bind(store.schema())
    .fetch_one(store.pool())
    .await
    .expect("the claim function");
    assert_eq!(config, Some(vec!["enable_bitmapscan=off".to_owned()]));
    append_committed(&store, &[record("e-1", "k")]).await;
    let claimed = store.outbox_claim("r", 10, LEASE).await.expect("claim");
    assert_eq!(
        claimed.len(),
        1,
        "the setting changes the plan, not the answer"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_deletes_bounded_batches_and_skips_locked_rows() {
    let Some((store, _lease)) = common::fresh_store().await else {
        return;
    };
    let records: Vec<_> = (0..25).map(|i| record(&format!("e{i}"), "k")).collect();
    append_committed(&store, &records).await;
    let claimed = store.outbox_claim("r", 100, LEASE).await.expect("claim");
    let ids: Vec<i64> = claimed.iter().map(|p| p.id).collect();
    store.outbox_mark_published(&ids).await.expect("mark");

    // Someone holds a lock on one published row for as long as they like.
    let mut holder = store.begin().await.expect("begin");
    sqlx::query("SELECT 1 FROM keel_outbox WHERE id = $1 FOR UPDATE")
        .bind(ids[0])
        .execute(&mut *holder)
        .await
        .expect("lock");

    let future = keel_core::clock::utc_now() + chrono::Duration::seconds(1);
    let mut batches = Vec::new();
    let pruned = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let n = store.outbox_prune(future, 10).await.expect("prune");
            batches.push(n);
            if n < 10 {
                break;
            }
        }
    })
    .await;
    assert!(pruned.is_ok(), "prune waited for a lock");
    assert_eq!(
        batches,
        [10, 10, 4],
        "bounded batches, the locked row skipped"
    );
    store.rollback(holder).await.expect("rollback");
    assert_eq!(store.outbox_prune(future, 10).await.expect("prune"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadlock_in_a_user_transaction_is_retryable() {
    let Some((store, _lease)) = common::fresh_store().await else {
        return;
    };
    let mut a = store.begin().await.expect("begin a");
    let mut b = store.begin().await.expect("begin b");
    assert!(store.inbox_record(&mut a, "x", "h").await.expect("a x"));
    assert!(store.inbox_record(&mut b, "y", "h").await.expect("b y"));
    // a waits for b's row, b for a's: PostgreSQL aborts one of them.
    let (ra, rb) = tokio::join!(store.inbox_record(&mut a, "y", "h"), async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        store.inbox_record(&mut b, "x", "h").await
    });
    let err = match (ra, rb) {
        (Err(err), Ok(_)) | (Ok(_), Err(err)) => err,
        other => panic!("expected exactly one deadlock victim, got {other:?}"),
    };
    assert_eq!(err.class(), ErrorClass::Retryable, "{err:?}");
    assert!(format!("{err:?}").contains("40P01"), "{err:?}");
}

/// The backend pid of `tx`'s connection, terminated from another
/// connection; returns once it is gone.
async fn kill_backend_of(store: &PgStore, tx: &mut <PgStore as Store>::Tx) {
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut **tx)
        .await
        .expect("pid");
    let killer = other_process(store).await;
    let killed: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(pid)
        .fetch_one(killer.pool())
        .await
        .expect("terminate");
    assert!(killed);
    wait_backend_gone(&killer, pid).await;
}

async fn wait_backend_gone(store: &PgStore, pid: i32) {
    for _ in 0..200 {
        let alive: Option<i32> =
            sqlx::query_scalar("SELECT pid FROM pg_stat_activity WHERE pid = $1")
                .bind(pid)
                .fetch_optional(store.pool())
                .await
                .expect("activity");
        if alive.is_none() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("backend {pid} did not go away");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_killed_before_commit_is_an_unknown_outcome() {
    let Some((store, _lease)) = common::fresh_store().await else {
        return;
    };
    let mut tx = store.begin().await.expect("begin");
    store
        .outbox_append(&mut tx, &[record("e-1", "k")])
        .await
        .expect("append");
    kill_backend_of(&store, &mut tx).await;
    let err = store
        .commit(tx)
        .await
        .expect_err("commit on a dead connection");
    assert_eq!(err.class(), ErrorClass::OutcomeUnknown, "{err:?}");
    // The caller resolves it by reading back: here it did not commit.
    assert_eq!(store.outbox_stats().await.expect("stats").unpublished, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn commit_resolved_asks_the_server_instead_of_guessing() {
    let Some((store, _lease)) = common::fresh_store().await else {
        return;
    };
    let mut tx = store.begin().await.expect("begin");
    store
        .outbox_append(&mut tx, &[record("e-1", "k")])
        .await
        .expect("append");
    kill_backend_of(&store, &mut tx).await;
    let err = store
        .commit_resolved(tx)
        .await
        .expect_err("the transaction died");
    assert_eq!(
        err.class(),
        ErrorClass::Retryable,
        "resolved as rolled back, so safe to run again: {err:?}"
    );
    assert_eq!(store.outbox_stats().await.expect("stats").unpublished, 0);

    // A transaction that did commit is reported as committed.
    let mut tx = store.begin().await.expect("begin");
    store
        .outbox_append(&mut tx, &[record("e-2", "k")])
        .await
        .expect("append");
    let xid: i64 = sqlx::query_scalar("SELECT txid_current()")
        .fetch_one(&mut *tx)
        .await
        .expect("xid");
    store.commit_resolved(tx).await.expect("commit");
    assert_eq!(
        store.transaction_outcome(xid).await.expect("status"),
        TxOutcome::Committed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_in_another_process_wakes_the_relay_at_once() {
    let Some((store, _lease)) = common::fresh_store().await else {
        return;
    };
    // Process A: a relay polling only every 60 s, woken by LISTEN/NOTIFY.
    let outbox = Outbox::new(store.clone());
    let recorded = Arc::new(Recorded::default());
    let broker = Arc::new(RecordingBroker::new(Arc::clone(&recorded), None));
    let relay = OutboxRelay::builder(&outbox, broker)
        .poll_interval(Duration::from_secs(60))
        .build()
        .expect("relay");
    let waker = outbox.clone();
    let wakeups = PgWakeups::builder(&store)
        .on_outbox(move || waker.notify())
        .spawn();
    tokio::time::timeout(Duration::from_secs(5), wakeups.listening())
        .await
        .expect("listening");
    let relay = tokio::spawn(async move { relay.run(std::future::pending()).await });
    // Let the relay finish its first (empty) round and go to sleep.
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Process B: another pool, another Outbox (no in-process wake-up).
    let b = other_process(&store).await;
    let started = tokio::time::Instant::now();
    append_committed(&b, &[record("e-1", "k")]).await;
    wait_until("the relay woken by NOTIFY", Duration::from_secs(5), || {
        recorded.len() == 1
    })
    .await;
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(5),
        "took {took:?} (poll is 60 s)"
    );

    // The listener's connection dies: it reconnects and wakes once.
    let listener_pid: i32 = sqlx::query_scalar(
        "SELECT pid FROM pg_stat_activity WHERE query LIKE 'LISTEN%' \
         AND query LIKE '%' || $1 || '%'",
    )
    .bind(store.schema())
    .fetch_one(b.pool())
    .await
    .expect("listener backend");
    sqlx::query("SELECT pg_terminate_backend($1)")
        .bind(listener_pid)
        .execute(b.pool())
        .await
        .expect("terminate listener");
    wait_backend_gone(&b, listener_pid).await;
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if wakeups.is_listening() {
                let pid: Option<i32> = sqlx::query_scalar(
                    "SELECT pid FROM pg_stat_activity WHERE query LIKE 'LISTEN%' \
                     AND query LIKE '%' || $1 || '%'",
                )
                .bind(store.schema())
                .fetch_optional(b.pool())
                .await
                .expect("activity");
                if pid.is_some_and(|pid| pid != listener_pid) {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("listener reconnected");
    append_committed(&b, &[record("e-2", "k")]).await;
    wait_until("woken after the reconnect", Duration::from_secs(5), || {
        recorded.len() == 2
    })
    .await;
    relay.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_append_wakes_nobody() {
    let Some((store, _lease)) = common::fresh_store().await else {
        return;
    };
    let woken = Arc::new(tokio::sync::Notify::new());
    let signal = Arc::clone(&woken);
    let wakeups = PgWakeups::builder(&store)
        .on_outbox(move || signal.notify_one())
        .spawn();
    tokio::time::timeout(Duration::from_secs(5), wakeups.listening())
        .await
        .expect("listening");
    let mut tx = store.begin().await.expect("begin");
    store
        .outbox_append(&mut tx, &[record("e-1", "k")])
        .await
        .expect("append");
    store.rollback(tx).await.expect("rollback");
    let early = tokio::time::timeout(Duration::from_millis(300), woken.notified()).await;
    assert!(early.is_err(), "woken by a rolled-back append");
    append_committed(&store, &[record("e-2", "k")]).await;
    tokio::time::timeout(Duration::from_secs(5), woken.notified())
        .await
        .expect("woken by the commit");
}
