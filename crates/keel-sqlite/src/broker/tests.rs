//! Tests of what the conformance suite cannot see: the pending set's
//! invariants, pruning, restarts, several brokers on one file, and the
//! settle rules of one delivery.

use std::time::Duration;

use keel_core::clock;
use keel_store::broker::{Broker, BrokerError, Delivery, Message, SubscribeOptions, Subscription};
use sqlx::Row;
use tempfile::TempDir;

use super::{SqliteBroker, SqliteBrokerOptions};

const WAIT: Duration = Duration::from_secs(3);

fn msg(topic: &str, id: &str, key: &str) -> Message {
    Message::new(id, topic, key, format!("payload of {id}"))
}

fn quiet() -> SqliteBrokerOptions {
    // No background pruning: tests prune explicitly.
    SqliteBrokerOptions::new().prune_interval(None)
}

async fn temp_broker(options: SqliteBrokerOptions) -> (SqliteBroker, TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let broker = options
        .open(dir.path().join("broker.db"))
        .await
        .expect("open");
    (broker, dir)
}

async fn sub(
    broker: &SqliteBroker,
    topic: &str,
    group: &str,
    lease: Duration,
) -> Box<dyn Subscription> {
    broker
        .subscribe(SubscribeOptions::new(topic, group).lease(lease))
        .await
        .expect("subscribe")
}

async fn take(sub: &mut dyn Subscription, n: usize) -> Vec<Delivery> {
    let deadline = clock::now() + WAIT;
    let mut got = Vec::new();
    while got.len() < n && clock::now() < deadline {
        got.extend(
            sub.receive(n - got.len(), Duration::from_millis(200))
                .await
                .expect("receive"),
        );
    }
    got
}

fn ids(deliveries: &[Delivery]) -> Vec<&str> {
    deliveries.iter().map(|d| d.message.id.as_str()).collect()
}

async fn count(broker: &SqliteBroker, sql: &str) -> i64 {
    sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
        .fetch_one(broker.pool())
        .await
        .expect("count")
}

/// Per group and key, exactly the earliest pending message is the head.
async fn assert_one_head_per_key(broker: &SqliteBroker) {
    let rows = sqlx::query(
        "SELECT group_id, msg_key, sum(head), min(seq), \
                (SELECT seq FROM keel_broker_pending h WHERE h.group_id = p.group_id \
                   AND h.msg_key = p.msg_key AND h.head = 1) \
         FROM keel_broker_pending p GROUP BY group_id, msg_key",
    )
    .fetch_all(broker.pool())
    .await
    .expect("pending");
    for row in rows {
        let key: String = row.get(1);
        let heads: i64 = row.get(2);
        let first: i64 = row.get(3);
        let head: Option<i64> = row.get(4);
        assert_eq!(heads, 1, "key {key} has {heads} heads");
        assert_eq!(
            head,
            Some(first),
            "the head of {key} is its earliest pending message"
        );
    }
}

#[tokio::test]
async fn a_pull_marks_one_head_per_key_even_within_one_batch() {
    let (broker, _dir) = temp_broker(quiet()).await;
    let mut s = sub(&broker, "t", "g", Duration::from_secs(30)).await;
    broker
        .publish(&[
            msg("t", "a1", "a"),
            msg("t", "b1", "b"),
            msg("t", "a2", "a"),
        ])
        .await
        .expect("publish");
    let first = take(s.as_mut(), 2).await;
    assert_eq!(ids(&first), ["a1", "b1"]);
    assert_one_head_per_key(&broker).await;
    // A second pull adds to keys that already have a head.
    broker
        .publish(&[
            msg("t", "a3", "a"),
            msg("t", "c1", "c"),
            msg("t", "c2", "c"),
        ])
        .await
        .expect("publish");
    let second = take(s.as_mut(), 1).await;
    assert_eq!(ids(&second), ["c1"]);
    assert_one_head_per_key(&broker).await;
    for d in first.iter().chain(&second) {
        d.ack().await.expect("ack");
    }
    assert_one_head_per_key(&broker).await;
    let rest = take(s.as_mut(), 2).await;
    assert_eq!(
        ids(&rest),
        ["a2", "c2"],
        "acks promoted the next message of each key"
    );
    assert_one_head_per_key(&broker).await;
}

#[tokio::test]
async fn a_hot_key_backlog_does_not_hide_other_keys() {
    let options = quiet()
        .pull_batch(16)
        .poll_interval(Duration::from_secs(10));
    let (broker, _dir) = temp_broker(options).await;
    let mut s = sub(&broker, "t", "g", Duration::from_secs(30)).await;
    let mut batch: Vec<Message> = (0..100)
        .map(|i| msg("t", &format!("hot-{i}"), "hot"))
        .collect();
    batch.push(msg("t", "cold", "cold"));
    broker.publish(&batch).await.expect("publish");
    let first = s.receive(10, WAIT).await.expect("receive");
    assert_eq!(ids(&first), ["hot-0"]);
    let started = clock::now();
    let second = s.receive(10, WAIT).await.expect("receive");
    assert_eq!(ids(&second), ["cold"]);
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "found the cold key only after {:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn settles_follow_the_lease_rules_of_one_delivery() {
    let broker = quiet().open_in_memory().await.expect("open");
    broker
        .publish(&[msg("t", "m1", "k"), msg("t", "m2", "j")])
        .await
        .expect("publish");
    let mut s = sub(&broker, "t", "g", Duration::from_secs(30)).await;
    let got = take(s.as_mut(), 2).await;
    let (m1, m2) = (&got[0], &got[1]);

    m1.ack().await.expect("ack");
    m1.ack().await.expect("a second ack is harmless");
    m1.terminate()
        .await
        .expect("terminating an acked delivery is harmless");
    assert!(matches!(
        m1.nack(Duration::ZERO).await,
        Err(BrokerError::Invalid(_))
    ));
    assert!(matches!(
        m1.extend_lease(Duration::from_secs(1)).await,
        Err(BrokerError::Invalid(_))
    ));

    assert!(matches!(
        m2.extend_lease(Duration::ZERO).await,
        Err(BrokerError::Invalid(_))
    ));
    m2.nack(Duration::from_secs(60)).await.expect("nack");
    assert!(
        matches!(m2.ack().await, Err(BrokerError::LeaseLost)),
        "a nacked delivery is no longer ours"
    );
    let delayed: i64 = count(
        &broker,
        "SELECT count(*) FROM keel_broker_pending WHERE leased = 0",
    )
    .await;
    assert_eq!(delayed, 1, "the refused ack changed nothing");
}

#[tokio::test]
async fn a_settle_after_the_lease_ran_out_still_counts_until_someone_else_takes_it() {
    let broker = quiet().open_in_memory().await.expect("open");
    broker
        .publish(&[msg("t", "m1", "k")])
        .await
        .expect("publish");
    let mut s = sub(&broker, "t", "g", Duration::from_millis(50)).await;
    let got = take(s.as_mut(), 1).await;
    tokio::time::sleep(Duration::from_millis(120)).await;
    got[0]
        .extend_lease(Duration::from_secs(30))
        .await
        .expect("nobody took it: extend");
    let again = s
        .receive(1, Duration::from_millis(200))
        .await
        .expect("receive");
    assert!(again.is_empty(), "the extension holds");
    got[0].ack().await.expect("ack");
    assert_eq!(
        count(&broker, "SELECT count(*) FROM keel_broker_pending").await,
        0
    );
}

#[tokio::test]
async fn one_settle_batch_tells_stale_leases_from_fresh_ones() {
    use super::db::{SettleAction, SettleRequest};
    let broker = quiet().open_in_memory().await.expect("open");
    broker
        .publish(&[msg("t", "m1", "a"), msg("t", "m2", "b")])
        .await
        .expect("publish");
    let mut slow = sub(&broker, "t", "g", Duration::from_millis(50)).await;
    let mut fast = sub(&broker, "t", "g", Duration::from_secs(30)).await;
    assert_eq!(take(slow.as_mut(), 2).await.len(), 2);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        take(fast.as_mut(), 2).await.len(),
        2,
        "both re-leased, count 2"
    );
    let rows: Vec<(i64, i64)> =
        sqlx::query_as("SELECT group_id, seq FROM keel_broker_pending ORDER BY seq")
            .fetch_all(broker.pool())
            .await
            .expect("pending");
    let request = |(group_id, seq): (i64, i64), lease_token, action| SettleRequest {
        group_id,
        seq,
        lease_token,
        action,
    };
    let batch = [
        request(rows[0], 1, SettleAction::Ack),
        request(rows[0], 2, SettleAction::Ack),
        request(rows[1], 1, SettleAction::Nack(Duration::ZERO)),
        request(rows[1], 2, SettleAction::Extend(Duration::from_secs(60))),
    ];
    let held = broker
        .inner
        .db
        .settle(&batch.iter().collect::<Vec<_>>())
        .await
        .expect("settle");
    assert_eq!(
        held,
        [false, true, false, true],
        "only the current lease token counts"
    );
    let left: Vec<(i64, i64)> = sqlx::query_as("SELECT seq, leased FROM keel_broker_pending")
        .fetch_all(broker.pool())
        .await
        .expect("pending");
    assert_eq!(
        left,
        [(rows[1].1, 1)],
        "m1 acked; m2 still leased, not nacked by the stale token"
    );
}

#[tokio::test]
async fn refuses_bad_input() {
    let broker = quiet()
        .max_message_bytes(100)
        .open_in_memory()
        .await
        .expect("open");
    let too_big = Message::new("big", "t", "k", vec![0_u8; 200]);
    let refused = broker.publish(&[msg("t", "ok", "k"), too_big]).await;
    assert!(
        matches!(refused, Err(BrokerError::Invalid(ref e)) if e.contains("claim check")),
        "{refused:?}"
    );
    assert_eq!(
        count(&broker, "SELECT count(*) FROM keel_broker_messages").await,
        0,
        "a refused batch publishes nothing"
    );
    assert!(matches!(
        broker.publish(&[msg("", "m", "k")]).await,
        Err(BrokerError::Invalid(_))
    ));
    for options in [
        SubscribeOptions::new("", "g"),
        SubscribeOptions::new("t", ""),
        SubscribeOptions::new("t", "g").lease(Duration::ZERO),
    ] {
        assert!(matches!(
            broker.subscribe(options).await,
            Err(BrokerError::Invalid(_))
        ));
    }
    let bad = quiet().pull_batch(0).open_in_memory().await;
    assert!(matches!(bad, Err(BrokerError::Invalid(_))));
    broker.publish(&[]).await.expect("an empty publish is fine");
}

#[tokio::test]
async fn pruning_deletes_only_what_every_group_settled() {
    let options = quiet()
        .retention(Duration::ZERO)
        .dedupe_window(Duration::ZERO);
    let broker = options.open_in_memory().await.expect("open");
    let mut fast = sub(&broker, "t", "fast", Duration::from_secs(30)).await;
    let mut slow = sub(&broker, "t", "slow", Duration::from_secs(30)).await;
    broker
        .publish(&[
            msg("t", "m1", "a"),
            msg("t", "m2", "b"),
            msg("t", "m3", "c"),
        ])
        .await
        .expect("publish");
    for d in take(fast.as_mut(), 3).await {
        d.ack().await.expect("ack");
    }
    let slow_got = take(slow.as_mut(), 3).await;
    slow_got[0].ack().await.expect("ack");
    slow_got[2].ack().await.expect("ack");
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(
        broker.prune().await.expect("prune"),
        1,
        "only m1 is settled by both groups before the floor"
    );
    slow_got[1].terminate().await.expect("terminate");
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(broker.prune().await.expect("prune"), 2);
    assert_eq!(
        count(&broker, "SELECT count(*) FROM keel_broker_messages").await,
        0
    );
}

#[tokio::test]
async fn pruning_keeps_messages_for_the_retention_and_in_bounded_batches() {
    let options = quiet()
        .retention(Duration::from_millis(300))
        .dedupe_window(Duration::ZERO)
        .prune_batch(4);
    let broker = options.open_in_memory().await.expect("open");
    let batch: Vec<Message> = (0..10)
        .map(|i| msg("t", &format!("m{i}"), &format!("k{i}")))
        .collect();
    broker.publish(&batch).await.expect("publish");
    assert_eq!(
        broker.prune().await.expect("prune"),
        0,
        "younger than the retention"
    );
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(broker.prune().await.expect("prune"), 4, "one bounded batch");
    assert_eq!(broker.prune().await.expect("prune"), 4);
    assert_eq!(broker.prune().await.expect("prune"), 2);
    // A topic without groups keeps messages for the retention only; a group
    // created afterwards starts at what is left.
    broker
        .publish(&[msg("t", "fresh", "k")])
        .await
        .expect("publish");
    let mut late = sub(&broker, "t", "late", Duration::from_secs(30)).await;
    assert_eq!(ids(&take(late.as_mut(), 1).await), ["fresh"]);
}

#[tokio::test]
async fn sequences_are_never_reused_after_the_newest_message_is_pruned() {
    let options = quiet()
        .retention(Duration::ZERO)
        .dedupe_window(Duration::ZERO);
    let broker = options.open_in_memory().await.expect("open");
    let mut s = sub(&broker, "t", "g", Duration::from_secs(30)).await;
    broker
        .publish(&[msg("t", "m1", "k")])
        .await
        .expect("publish");
    for d in take(s.as_mut(), 1).await {
        d.ack().await.expect("ack");
    }
    tokio::time::sleep(Duration::from_millis(5)).await;
    assert_eq!(
        broker.prune().await.expect("prune"),
        1,
        "the log is empty now"
    );
    broker
        .publish(&[msg("t", "m2", "k")])
        .await
        .expect("publish");
    assert_eq!(
        ids(&take(s.as_mut(), 1).await),
        ["m2"],
        "a reused sequence would sit behind the group's cursor"
    );
}

#[tokio::test]
async fn dedupe_lasts_as_long_as_the_message_is_kept() {
    let options = quiet()
        .retention(Duration::ZERO)
        .dedupe_window(Duration::from_millis(300));
    let broker = options.open_in_memory().await.expect("open");
    broker
        .publish(&[msg("t", "m1", "k")])
        .await
        .expect("publish");
    assert_eq!(
        broker.prune().await.expect("prune"),
        0,
        "inside the dedupe window"
    );
    broker
        .publish(&[msg("t", "m1", "k")])
        .await
        .expect("publish");
    assert_eq!(
        count(&broker, "SELECT count(*) FROM keel_broker_messages").await,
        1
    );
    tokio::time::sleep(Duration::from_millis(350)).await;
    assert_eq!(broker.prune().await.expect("prune"), 1);
    broker
        .publish(&[msg("t", "m1", "k")])
        .await
        .expect("publish");
    assert_eq!(
        count(&broker, "SELECT count(*) FROM keel_broker_messages").await,
        1,
        "past the window the id is new again"
    );
}

#[tokio::test]
async fn messages_and_leases_survive_a_restart() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("broker.db");
    {
        let broker = quiet().open(&path).await.expect("open");
        broker
            .publish(&[msg("t", "m1", "k"), msg("t", "m2", "k")])
            .await
            .expect("publish");
        let mut s = sub(&broker, "t", "g", Duration::from_millis(200)).await;
        let got = take(s.as_mut(), 1).await;
        assert_eq!(ids(&got), ["m1"]);
        broker.close().await; // "crash" holding the lease on m1
    }
    let broker = quiet().open(&path).await.expect("reopen");
    broker
        .publish(&[msg("t", "m1", "k")])
        .await
        .expect("a republish after restart");
    let mut s = sub(&broker, "t", "g", Duration::from_secs(30)).await;
    let got = take(s.as_mut(), 1).await;
    assert_eq!(
        ids(&got),
        ["m1"],
        "m1 again after its lease, not m2, and not twice"
    );
    assert_eq!(got[0].delivery_count, 2, "the count survives the restart");
    got[0].ack().await.expect("ack");
    assert_eq!(ids(&take(s.as_mut(), 1).await), ["m2"]);
}

#[tokio::test]
async fn brokers_sharing_a_file_see_each_other_by_polling() {
    let options = quiet().poll_interval(Duration::from_millis(50));
    let (one, dir) = temp_broker(options.clone()).await;
    let two = options
        .open(dir.path().join("broker.db"))
        .await
        .expect("open");
    let mut on_two = sub(&two, "t", "g", Duration::from_secs(30)).await;
    let mut on_one = sub(&one, "t", "g", Duration::from_secs(30)).await;
    let waiting = tokio::spawn(async move {
        let got = on_two.receive(10, WAIT).await.expect("receive");
        (on_two, got)
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    one.publish(&[msg("t", "m1", "k"), msg("t", "m2", "k")])
        .await
        .expect("publish");
    let (mut on_two, got) = waiting.await.expect("join");
    assert_eq!(ids(&got), ["m1"], "the other broker polled it in");
    assert!(
        on_one
            .receive(10, Duration::from_millis(200))
            .await
            .expect("receive")
            .is_empty(),
        "m1 is leased through the other broker and m2 is behind it"
    );
    got[0].ack().await.expect("ack");
    assert_eq!(ids(&take(on_one.as_mut(), 1).await), ["m2"]);
    assert!(
        on_two
            .receive(1, Duration::ZERO)
            .await
            .expect("receive")
            .is_empty()
    );
}

#[tokio::test]
async fn a_waiting_receive_wakes_when_a_nack_delay_ends_or_a_key_is_released() {
    let options = quiet().poll_interval(Duration::from_secs(30));
    let broker = options.open_in_memory().await.expect("open");
    broker
        .publish(&[msg("t", "m1", "k"), msg("t", "m2", "k")])
        .await
        .expect("publish");
    let mut first = sub(&broker, "t", "g", Duration::from_secs(30)).await;
    let mut second = sub(&broker, "t", "g", Duration::from_secs(30)).await;
    let m1 = take(first.as_mut(), 1).await;
    m1[0].nack(Duration::from_millis(200)).await.expect("nack");
    let started = clock::now();
    let again = second
        .receive(1, Duration::from_secs(10))
        .await
        .expect("receive");
    assert_eq!(ids(&again), ["m1"]);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "slept past the delay: {:?}",
        started.elapsed()
    );

    let releasing = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        again[0].ack().await.expect("ack");
    });
    let started = clock::now();
    let next = first
        .receive(1, Duration::from_secs(10))
        .await
        .expect("receive");
    assert_eq!(ids(&next), ["m2"]);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the ack did not wake the waiter"
    );
    releasing.await.expect("join");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_acks_are_batched_and_all_confirmed() {
    let broker = quiet().open_in_memory().await.expect("open");
    let batch: Vec<Message> = (0..300)
        .map(|i| msg("t", &format!("m{i}"), &format!("k{i}")))
        .collect();
    broker.publish(&batch).await.expect("publish");
    let mut s = sub(&broker, "t", "g", Duration::from_secs(30)).await;
    let got = take(s.as_mut(), 300).await;
    assert_eq!(got.len(), 300);
    let acks: Vec<_> = got
        .into_iter()
        .map(|d| tokio::spawn(async move { d.ack().await }))
        .collect();
    for ack in acks {
        ack.await.expect("join").expect("ack");
    }
    assert_eq!(
        count(&broker, "SELECT count(*) FROM keel_broker_pending").await,
        0
    );
}

#[tokio::test]
async fn shares_a_database_with_other_migrations() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("shared.db");
    let broker = SqliteBroker::open(&path).await.expect("open");
    // Another component's migration (the store's are numbered 1xxx).
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (1001, 'store', 1, x'00', 0)",
    )
    .execute(broker.pool())
    .await
    .expect("record a foreign migration");
    broker.close().await;
    let again = SqliteBroker::open(&path)
        .await
        .expect("reopen next to foreign migrations");
    again.ping().await.expect("ping");
    let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
        .fetch_one(again.pool())
        .await
        .expect("journal mode");
    assert_eq!(mode, "wal");
}
