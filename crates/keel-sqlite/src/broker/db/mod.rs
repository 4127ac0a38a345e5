//! The broker's SQL. Every operation is atomic: a single statement (which
//! SQLite runs as an immediate write transaction) or a short `BEGIN
//! IMMEDIATE` transaction, so processes sharing the file serialize cleanly
//! and a crash leaves all of an operation or none of it.
//!
//! Within this process, writers also queue on an async gate before they ask
//! SQLite for the write lock: waiting on the gate costs nothing, while two
//! connections racing for the lock would back off in SQLite's busy handler,
//! which sleeps for milliseconds.

use std::sync::Arc;
use std::time::Duration;

use keel_store::broker::{Backlog, BrokerError, Message};
use sqlx::Transaction;
use sqlx::sqlite::{Sqlite, SqlitePool};
use tokio::sync::{Mutex, OwnedMutexGuard};

use super::clock::BrokerClock;
use super::error::db_error;
use super::topics::{Topic, TopicRegistry};

mod expiry;
mod lease;
mod prune;
mod publish;
mod settle;

/// Counts a group's unfinished messages, given now (Unix ms), the topic and
/// the group.
const BACKLOG_SQL: &str = "\
SELECT (SELECT COUNT(*) FROM keel_broker_messages m
         WHERE m.topic_id = g.topic_id AND m.seq > g.pulled_seq),
       (SELECT COUNT(*) FROM keel_broker_pending p
         WHERE p.group_id = g.group_id AND NOT (p.leased = 1 AND p.visible_at > ?1)),
       (SELECT COUNT(*) FROM keel_broker_pending p
         WHERE p.group_id = g.group_id AND p.leased = 1 AND p.visible_at > ?1)
  FROM keel_broker_groups g JOIN keel_broker_topics t ON t.topic_id = g.topic_id
 WHERE t.name = ?2 AND g.name = ?3";

/// The database side of a broker: the pool, the write gate, the clock and
/// the topic registry. Cheap to clone.
#[derive(Clone)]
pub(super) struct Db {
    pool: SqlitePool,
    gate: Arc<Mutex<()>>,
    pub(super) clock: BrokerClock,
    topics: Arc<TopicRegistry>,
}

/// A write transaction holding the in-process write gate. Dropping it
/// without [`commit`](Self::commit) rolls back.
struct WriteTx {
    // Declared first so it is dropped (rolled back) before the gate opens.
    tx: Transaction<'static, Sqlite>,
    _gate: OwnedMutexGuard<()>,
}

impl WriteTx {
    async fn commit(self, operation: &'static str) -> Result<(), BrokerError> {
        self.tx.commit().await.map_err(|e| db_error(operation, e))
    }
}

/// A consumer group of one topic, as a subscription knows it.
#[derive(Debug, Clone)]
pub(super) struct GroupRef {
    pub(super) group_id: i64,
    pub(super) name: Arc<str>,
    pub(super) topic: Arc<Topic>,
}

/// One message leased to a receiver.
#[derive(Debug)]
pub(super) struct Leased {
    pub(super) seq: i64,
    pub(super) delivery_count: i64,
    pub(super) message: Message,
    /// When the broker stored it, Unix ms.
    pub(super) published_at: i64,
}

/// What one receive attempt found.
#[derive(Debug, Default)]
pub(super) struct LeaseBatch {
    /// The leased messages, in sequence order.
    pub(super) leased: Vec<Leased>,
    /// When nothing was leased: the earliest time (Unix ms) a pending
    /// message of the group becomes visible again, if any is waiting.
    pub(super) next_visible_ms: Option<i64>,
    /// Whether new messages were pulled into the group's pending set. A
    /// pull that found only blocked messages (a busy key's backlog) is worth
    /// repeating at once: deliverable messages may lie just beyond it.
    pub(super) pulled: bool,
}

/// How one delivery is settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SettleAction {
    /// Done: delete the pending row.
    Ack,
    /// Given up: delete the pending row (counted apart from acks).
    Terminate,
    /// Release the lease; visible again after the delay.
    Nack(Duration),
    /// Keep the lease for this long from now.
    Extend(Duration),
}

impl SettleAction {
    /// A short name for metrics and logs.
    pub(super) fn name(self) -> &'static str {
        match self {
            Self::Ack => "ack",
            Self::Terminate => "terminate",
            Self::Nack(_) => "nack",
            Self::Extend(_) => "extend",
        }
    }
}

/// One settle, identified by its lease: the group, the message and the
/// delivery count the lease was granted with.
#[derive(Debug, Clone)]
pub(super) struct SettleRequest {
    pub(super) group_id: i64,
    pub(super) seq: i64,
    pub(super) lease_token: i64,
    pub(super) action: SettleAction,
}

/// What one pruning pass did.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct PruneOutcome {
    /// Messages deleted.
    pub(super) deleted: u64,
    /// Whether some topic had more to delete than one batch.
    pub(super) more: bool,
}

/// A count as SQLite's integer, saturating.
fn to_i64(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Db {
    pub(super) fn new(pool: SqlitePool) -> Self {
        Self {
            pool,
            gate: Arc::new(Mutex::new(())),
            clock: BrokerClock::new(),
            topics: Arc::new(TopicRegistry::default()),
        }
    }

    pub(super) fn pool(&self) -> &SqlitePool {
        &self.pool
    }

    async fn begin(&self, operation: &'static str) -> Result<WriteTx, BrokerError> {
        let gate = self.gate.clone().lock_owned().await;
        let tx = crate::pool::begin_immediate(&self.pool)
            .await
            .map_err(|e| db_error(operation, e))?;
        Ok(WriteTx { tx, _gate: gate })
    }

    /// Applies the broker's migrations (2xxx), leaving any other migrator's
    /// rows in `_sqlx_migrations` alone.
    pub(super) async fn migrate(&self) -> Result<(), BrokerError> {
        let mut migrator = sqlx::migrate!("./migrations/broker");
        migrator.set_ignore_missing(true);
        // Two processes opening a fresh file at once may race to record the
        // same migration; the loser finds it applied on the next attempt.
        let mut attempt = 0;
        loop {
            match migrator.run(&self.pool).await {
                Ok(()) => return Ok(()),
                Err(error) if attempt < 3 => {
                    attempt += 1;
                    tracing::debug!(%error, attempt, "broker migration raced; retrying");
                    tokio::time::sleep(Duration::from_millis(50 * attempt)).await;
                }
                Err(sqlx::migrate::MigrateError::Execute(e)) => {
                    return Err(db_error("migrate", e));
                }
                Err(error) => return Err(BrokerError::Other(Box::new(error))),
            }
        }
    }

    /// A trivial query: is the database answering?
    pub(super) async fn ping(&self) -> Result<(), BrokerError> {
        sqlx::query("SELECT 1")
            .execute(&self.pool)
            .await
            .map(drop)
            .map_err(|e| db_error("ping", e))
    }

    /// Group `group`'s unfinished messages of `topic`: not yet pulled into
    /// its pending set or pending unleased (waiting), and leased with a
    /// lease still running (in flight). `None` if there is no such group.
    pub(super) async fn backlog(
        &self,
        topic: &str,
        group: &str,
    ) -> Result<Option<Backlog>, BrokerError> {
        let row: Option<(i64, i64, i64)> = sqlx::query_as(BACKLOG_SQL)
            .bind(self.clock.now_ms())
            .bind(topic)
            .bind(group)
            .fetch_optional(&self.pool)
            .await
            .map_err(|e| db_error("backlog", e))?;
        let count = |n: i64| u64::try_from(n).unwrap_or(0);
        Ok(row.map(|(unpulled, waiting, in_flight)| Backlog {
            waiting: count(unpulled) + count(waiting),
            in_flight: count(in_flight),
        }))
    }

    /// The topic named `name`, created if needed.
    pub(super) async fn topic(&self, name: &str) -> Result<Arc<Topic>, BrokerError> {
        if let Some(topic) = self.topics.get(name) {
            return Ok(topic);
        }
        let mut w = self.begin("create topic").await?;
        sqlx::query(
            "INSERT INTO keel_broker_topics (name) VALUES (?1) ON CONFLICT (name) DO NOTHING",
        )
        .bind(name)
        .execute(&mut *w.tx)
        .await
        .map_err(|e| db_error("create topic", e))?;
        let id: i64 = sqlx::query_scalar("SELECT topic_id FROM keel_broker_topics WHERE name = ?1")
            .bind(name)
            .fetch_one(&mut *w.tx)
            .await
            .map_err(|e| db_error("create topic", e))?;
        w.commit("create topic").await?;
        Ok(self.topics.insert(name, id))
    }
}
