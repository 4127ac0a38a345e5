//! The Broker conformance suite (keel-testkit) against the embedded SQLite
//! broker: a fresh database file per scenario.

#![cfg(feature = "broker")]

use async_trait::async_trait;
use keel_sqlite::broker::SqliteBroker;
use keel_store::broker::{Backlog, Broker, BrokerError, Message, SubscribeOptions, Subscription};
use tempfile::TempDir;

/// A broker in a temporary directory that is removed with it.
struct TempBroker {
    broker: SqliteBroker,
    _dir: TempDir,
}

#[async_trait]
impl Broker for TempBroker {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        self.broker.publish(messages).await
    }

    async fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        self.broker.subscribe(options).await
    }

    async fn ping(&self) -> Result<(), BrokerError> {
        self.broker.ping().await
    }

    fn retention(&self) -> keel_store::broker::MessageRetention {
        self.broker.retention()
    }

    async fn backlog(&self, topic: &str, group: &str) -> Result<Option<Backlog>, BrokerError> {
        self.broker.backlog(topic, group).await
    }

    async fn sweep_expired(&self) -> Result<u64, BrokerError> {
        self.broker.sweep_expired().await
    }

    async fn remove_group(&self, topic: &str, group: &str) -> Result<(), BrokerError> {
        self.broker.remove_group(topic, group).await
    }
}

async fn make_broker() -> TempBroker {
    let dir = tempfile::tempdir().expect("temp dir");
    let broker = SqliteBroker::open(dir.path().join("broker.db"))
        .await
        .expect("open the broker");
    TempBroker { broker, _dir: dir }
}

keel_testkit::broker_conformance_tests!(async { make_broker().await });

/// Request-reply's reply topics, as topic rows: a crashed requester's goes
/// after its expiry (swept by the restarted one), a stopped one's at once,
/// and no message is left without its topic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_requester_leaves_nothing_behind() {
    let dir = tempfile::tempdir().expect("temp dir");
    // No background pruner: only the requesters' own sweeps clean up.
    let broker = SqliteBroker::options()
        .prune_interval(None)
        .open(dir.path().join("broker.db"))
        .await
        .expect("open the broker");
    let pool = broker.pool().clone();
    let reply_topics = || async {
        let strays: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM keel_broker_messages \
             WHERE topic_id NOT IN (SELECT topic_id FROM keel_broker_topics)",
        )
        .fetch_one(&pool)
        .await
        .expect("count stray messages");
        assert_eq!(strays, 0, "messages outlived their topic");
        sqlx::query_scalar(
            "SELECT name FROM keel_broker_topics WHERE substr(name, 1, 7) = '_reply.' ORDER BY name",
        )
        .fetch_all(&pool)
        .await
        .expect("list reply topics")
    };
    keel_testkit::broker_suite::a_restarted_requester_leaves_nothing_behind(
        TempBroker { broker, _dir: dir },
        reply_topics,
    )
    .await;
}
