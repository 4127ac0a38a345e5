//! The relay on PostgreSQL's WAL (keel-postgres's `WalOutbox`) against the
//! shared test server: rows leave in commit order as they commit, with no
//! poll of the table; the slot is confirmed only past what the broker
//! acknowledged, so a relay that dies mid-batch loses nothing; parked rows
//! hold their key and the sweep publishes after a replay; decommissioning
//! drops the slot.

#[path = "../../keel-postgres/tests/common/mod.rs"]
mod common;
#[path = "postgres/recording_broker.rs"]
mod recording_broker;

use std::collections::HashSet;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use keel_messaging::broker::{Broker, BrokerError, Message, SubscribeOptions, Subscription};
use keel_messaging::outbox::{Outbox, OutboxRelay};
use keel_messaging::store::{OutboxAdminStore, OutboxRecord, OutboxStore, Store};
use keel_postgres::{PgStore, WalOutbox, WalRelayOptions};
use keel_testkit::services::{self, Service};
use tokio::task::JoinHandle;

use recording_broker::{Recorded, RecordingBroker};

/// Long enough that only the stream (never a poll or sweep) can have
/// delivered a row within a test.
const NEVER: Duration = Duration::from_secs(3600);
const PATIENCE: Duration = Duration::from_secs(20);

fn record(event_id: &str, key: &str) -> OutboxRecord {
    OutboxRecord {
        event_id: event_id.to_owned(),
        topic: "orders".to_owned(),
        partition_key: key.to_owned(),
        headers: [("event-id".to_owned(), event_id.to_owned())].into(),
        payload: Bytes::from_static(b"{\"n\":1}"),
    }
}

async fn append_committed(store: &PgStore, records: &[OutboxRecord]) {
    let mut tx = store.begin().await.expect("begin");
    store.outbox_append(&mut tx, records).await.expect("append");
    store.commit(tx).await.expect("commit");
}

/// A slot and publication named after the test's schema (slots are per
/// server, schemas per test).
fn options(store: &PgStore) -> WalRelayOptions {
    WalRelayOptions::default()
        .named(store.schema())
        .sweep_interval(NEVER)
}

struct Running {
    wal: WalOutbox,
    relay: JoinHandle<()>,
}

async fn start_relay(
    store: &PgStore,
    options: WalRelayOptions,
    broker: Arc<dyn Broker>,
) -> Running {
    start_polling_relay(store, options, broker, NEVER).await
}

/// A relay that also runs a round every `poll`, as deployed relays do
/// (each round's claim is in memory; the sweep runs on its own interval).
async fn start_polling_relay(
    store: &PgStore,
    options: WalRelayOptions,
    broker: Arc<dyn Broker>,
    poll: Duration,
) -> Running {
    let url = keel_testkit::services::postgres_url().expect("url");
    let wal = WalOutbox::start(store.clone(), &url, options)
        .await
        .expect("start the WAL relay");
    let outbox = Outbox::new(wal.clone());
    wal.wake_with(outbox.waker());
    let relay = OutboxRelay::builder(&outbox, broker)
        .name("wal")
        .batch_size(NonZeroUsize::new(64).expect("non-zero"))
        .poll_interval(poll)
        .build()
        .expect("relay");
    let relay = tokio::spawn(async move { relay.run(std::future::pending()).await });
    Running { wal, relay }
}

async fn wait_for(recorded: &Recorded, count: usize) {
    let waited = tokio::time::timeout(PATIENCE, async {
        while recorded.len() < count {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(
        waited.is_ok(),
        "{} of {count} published: {:?}",
        recorded.len(),
        recorded.ids()
    );
}

/// Waits until no row of the outbox is unpublished.
async fn all_marked(store: &PgStore) {
    let waited = tokio::time::timeout(PATIENCE, async {
        while store.outbox_stats().await.expect("stats").unpublished > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "published rows were never marked");
}

/// The slot's confirmed position, and the server's WAL position now.
async fn positions(store: &PgStore) -> (u64, u64) {
    let (confirmed, now): (i64, i64) = sqlx::query_as(
        "SELECT (confirmed_flush_lsn - '0/0'::pg_lsn)::bigint, \
                (pg_current_wal_lsn() - '0/0'::pg_lsn)::bigint \
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(store.schema())
    .fetch_one(store.pool())
    .await
    .expect("slot position");
    (confirmed as u64, now as u64)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_leave_in_commit_order_as_they_commit() {
    let Some((store, _lease)) = common::fresh_store().await else {
        return;
    };
    let recorded = Arc::new(Recorded::default());
    let broker = Arc::new(RecordingBroker::new(Arc::clone(&recorded), None));
    let running = start_relay(&store, options(&store), broker as Arc<dyn Broker>).await;

    // The first transaction takes the lower id but commits last.
    let mut early = store.begin().await.expect("begin");
    store
        .outbox_append(&mut early, &[record("e-early-id", "a")])
        .await
        .expect("append");
    append_committed(&store, &[record("e-1", "b"), record("e-2", "b")]).await;
    wait_for(&recorded, 2).await;
    store.commit(early).await.expect("commit");
    wait_for(&recorded, 3).await;
    assert_eq!(recorded.ids(), ["e-1", "e-2", "e-early-id"], "commit order");

    // Published rows are marked in the table, as the polling relay does
    // (right after the broker acknowledged them).
    all_marked(&store).await;
    let waited = tokio::time::timeout(PATIENCE, async {
        while running.wal.unfinished() > 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "the stream's rows were never all finished");
    running.relay.abort();
    running.wal.decommission().await.expect("decommission");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_dying_mid_batch_loses_nothing_the_broker_did_not_acknowledge() {
    let Some((store, _lease)) = common::fresh_store().await else {
        return;
    };
    let recorded = Arc::new(Recorded::default());
    let dying = Arc::new(RecordingBroker::new(Arc::clone(&recorded), None));
    dying.die_mid_batch.store(true, Ordering::SeqCst);
    let first = start_relay(
        &store,
        options(&store),
        Arc::clone(&dying) as Arc<dyn Broker>,
    )
    .await;
    let batch: Vec<_> = (0..10).map(|i| record(&format!("e-{i}"), "k")).collect();
    append_committed(&store, &batch).await;
    let (_, after_commit) = positions(&store).await;
    tokio::time::timeout(PATIENCE, dying.died.notified())
        .await
        .expect("the broker died mid-batch");
    assert_eq!(recorded.len(), 5, "half the batch reached the broker");
    // Give the stream a status update's time to confirm what it must not.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (confirmed, _) = positions(&store).await;
    assert!(
        confirmed < after_commit,
        "the slot was confirmed past an unpublished batch"
    );
    // The process dies: its relay and its stream go.
    first.relay.abort();
    drop(first.wal);

    let after = Arc::new(Recorded::default());
    let healthy = Arc::new(RecordingBroker::new(Arc::clone(&after), None));
    let second = start_relay(&store, options(&store), healthy as Arc<dyn Broker>).await;
    wait_for(&after, 10).await;
    let expected: Vec<String> = (0..10).map(|i| format!("e-{i}")).collect();
    assert_eq!(after.ids(), expected, "the whole batch again, in order");
    // Once published, the slot is confirmed past the batch. (The second
    // relay never sweeps the table: only the slot could have redelivered.)
    let waited = tokio::time::timeout(PATIENCE, async {
        while positions(&store).await.0 < after_commit {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(
        waited.is_ok(),
        "the slot was never confirmed past the published batch"
    );
    second.relay.abort();
    second.wal.decommission().await.expect("decommission");
}

/// Refuses (for good) the messages whose ids it is told to, until told
/// otherwise; records the rest.
struct RefusingBroker {
    recording: RecordingBroker,
    refused: parking_lot::Mutex<HashSet<String>>,
}

#[async_trait]
impl Broker for RefusingBroker {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        let refusal = {
            let refused = self.refused.lock();
            messages
                .iter()
                .find(|m| refused.contains(&m.id))
                .map(|bad| BrokerError::Invalid(format!("{} is refused", bad.id)))
        };
        match refusal {
            Some(refusal) => Err(refusal),
            None => self.recording.publish(messages).await,
        }
    }

    async fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        self.recording.subscribe(options).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_key_waits_in_the_table_and_the_sweep_publishes_it_after_replay() {
    let Some((store, _lease)) = common::fresh_store().await else {
        return;
    };
    let recorded = Arc::new(Recorded::default());
    let broker = Arc::new(RefusingBroker {
        recording: RecordingBroker::new(Arc::clone(&recorded), None),
        refused: parking_lot::Mutex::new(["e-bad".to_owned()].into()),
    });
    let options = options(&store).sweep_interval(Duration::from_millis(200));
    let running = start_polling_relay(
        &store,
        options,
        Arc::clone(&broker) as Arc<dyn Broker>,
        Duration::from_millis(50),
    )
    .await;
    append_committed(&store, &[record("e-bad", "k")]).await;
    let waited = tokio::time::timeout(PATIENCE, async {
        while store.outbox_stats().await.expect("stats").parked == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(waited.is_ok(), "the refused row was parked");

    // A later row of the parked key waits; other keys flow.
    append_committed(&store, &[record("e-after", "k"), record("e-other", "o")]).await;
    wait_for(&recorded, 1).await;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        recorded.ids(),
        ["e-other"],
        "e-after waits behind the parked row"
    );

    // The operator fixes the cause and replays: the sweep publishes both,
    // in order.
    broker.refused.lock().clear();
    let parked = store
        .outbox_parked(&Default::default())
        .await
        .expect("parked");
    assert_eq!(parked.len(), 1);
    assert!(store.outbox_unpark(parked[0].id).await.expect("unpark"));
    wait_for(&recorded, 3).await;
    assert_eq!(recorded.ids(), ["e-other", "e-bad", "e-after"]);
    all_marked(&store).await;
    running.relay.abort();
    running.wal.decommission().await.expect("decommission");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decommission_drops_the_slot_and_bad_names_are_refused() {
    let Some((store, _lease)) = common::fresh_store().await else {
        return;
    };
    let url = keel_testkit::services::postgres_url().expect("url");
    let wal = WalOutbox::start(store.clone(), &url, options(&store))
        .await
        .expect("start");
    assert!(wal.slot_lag().await.expect("lag").is_some());
    let again = WalOutbox::start(store.clone(), &url, options(&store)).await;
    assert!(
        again.is_ok(),
        "starting on an existing slot and publication is fine"
    );
    drop(again);
    let check = wal.clone();
    wal.decommission().await.expect("decommission");
    assert_eq!(
        check.slot_lag().await.expect("lag"),
        None,
        "the slot is gone"
    );

    let refused = WalOutbox::start(
        store.clone(),
        &url,
        WalRelayOptions::default().named("Bad-Name"),
    )
    .await
    .expect_err("a quoted name is refused");
    assert!(refused.to_string().contains("Bad-Name"), "{refused}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_crash_mid_stream_loses_nothing_and_the_stream_resumes() {
    let Some((store, _alone)) = common::fresh_store_alone().await else {
        return;
    };
    let recorded = Arc::new(Recorded::default());
    let broker = Arc::new(RecordingBroker::new(Arc::clone(&recorded), None));
    let running = start_relay(&store, options(&store), broker as Arc<dyn Broker>).await;
    let ids = |range: std::ops::Range<usize>| -> Vec<String> {
        range.map(|i| format!("e-{i}")).collect()
    };
    for id in ids(0..20) {
        append_committed(&store, &[record(&id, "k")]).await;
    }
    wait_for(&recorded, 20).await;

    // An immediate shutdown (recovered from the WAL), while the relay
    // streams: its connection and the server's walsender die with it.
    tokio::task::spawn_blocking(|| services::crash(Service::Postgres))
        .await
        .expect("join")
        .expect("crash and start PostgreSQL");
    for id in ids(20..40) {
        // The pool's first use after the crash may meet a dead session.
        let mut appended = false;
        for _ in 0..50 {
            let mut tx = match store.begin().await {
                Ok(tx) => tx,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            if store
                .outbox_append(&mut tx, &[record(&id, "k")])
                .await
                .is_ok()
                && store.commit(tx).await.is_ok()
            {
                appended = true;
                break;
            }
        }
        assert!(appended, "{id} appended after the restart");
    }
    let waited = tokio::time::timeout(PATIENCE, async {
        loop {
            let seen: HashSet<String> = recorded.ids().into_iter().collect();
            if ids(0..40).iter().all(|id| seen.contains(id)) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert!(
        waited.is_ok(),
        "rows lost across the crash: {:?}",
        recorded.ids()
    );
    // Per-key order holds in what each stream delivered: the last
    // delivery of every id comes after the last delivery of the one before.
    let published = recorded.ids();
    let last = |id: &str| published.iter().rposition(|p| p == id).expect("published");
    for pair in ids(0..40).windows(2) {
        assert!(
            last(&pair[0]) < last(&pair[1]),
            "{} after {}",
            pair[0],
            pair[1]
        );
    }
    running.relay.abort();
    running.wal.decommission().await.expect("decommission");
}
