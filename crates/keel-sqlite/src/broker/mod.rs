//! An embedded durable [`Broker`] on SQLite: topics, consumer groups,
//! per-key order, leases and redelivery, with no server to run.
//!
//! Most services that want an outbox, a consumer and retries do not need a
//! broker cluster on day one; they need the broker *semantics* so that moving
//! to NATS JetStream later changes a constructor, not the code. This broker
//! keeps the log in the same kind of file as the [store](crate), passes the
//! same conformance suite as the scale-out brokers (`keel-testkit`), and can
//! share one database file with the store.
//!
//! # How it works
//!
//! - **The log.** Each publish appends rows to `keel_broker_messages`
//!   atomically, as multi-row inserts (one statement for up to 256
//!   messages). The sequence is an AUTOINCREMENT
//!   rowid: the delivery order, never reused. The pair (topic, message id) is
//!   unique, which is the publisher dedupe: a repeated id is accepted and
//!   dropped.
//! - **Groups.** A group has a cursor into the log and a *pending set*
//!   (`keel_broker_pending`): the messages it has pulled but not settled,
//!   each ready or leased, with a visibility time and a delivery count. When
//!   a receive runs short of deliverable messages, it pulls the next batch of
//!   the log into the pending set. Acked and terminated messages leave the
//!   set, so its size is the group's backlog, not its history.
//! - **New groups read everything retained**, like a JetStream durable
//!   consumer with `DeliverPolicy::All`: a group created after messages were
//!   published starts at the oldest message still kept.
//! - **Per-key order.** The earliest pending message of each key is its
//!   *head*; only heads are delivered, and a trigger makes the next message
//!   of a key its head when the head is acked or terminated. A later message
//!   of a key waits while an earlier one is leased *or* ready-but-delayed
//!   after a nack: order beats throughput. Other keys are not held up, and
//!   a busy key's backlog costs a receive nothing to skip.
//! - **Leases.** A receive leases up to `max` (at most
//!   [`MAX_RECEIVE`]) messages in sequence order for the subscription's
//!   lease, in one transaction, and bumps their delivery count; a lease that
//!   runs out makes the message visible again (at-least-once). The delivery
//!   count doubles as the lease token: a settle carrying an older count than
//!   the row's (the lease expired and someone else received the message)
//!   matches nothing and returns [`BrokerError::LeaseLost`]. A settle after
//!   the lease ran out but before anyone re-leased the message still
//!   succeeds, as with SQS receipt handles.
//! - **Settles are batched.** Acks, nacks, extensions and terminations from
//!   all deliveries of a broker queue up for one task that applies
//!   everything waiting as one statement (or two in one transaction), so
//!   concurrent handlers share commits. Each caller still waits for its own
//!   outcome.
//! - **Waiting.** A receive with nothing to deliver sleeps until a publish,
//!   ack or nack in this process wakes it, the next nacked or leased message
//!   becomes visible, or the poll interval passes (publishes by other
//!   processes). Cancelling a receive while it commits may leave the
//!   messages it leased invisible until their lease runs out.
//! - **Retention.** Messages every group has settled are deleted once older
//!   than [`SqliteBrokerOptions::kept_for`] (the longer of the retention and
//!   the dedupe window), by a background task in bounded batches. Pruning
//!   stops at each group's oldest pending message (its ack floor), so one
//!   slow message holds back the deletion of those after it, not their
//!   delivery. A topic with no groups keeps messages for `kept_for` too. A
//!   group that stops consuming holds its topic's messages until it
//!   resumes: every group sees every message.
//! - **Expiring groups.** A group subscribed with
//!   [`expire_after_idle`](SubscribeOptions::expire_after_idle) records
//!   when a member last read (at most every quarter of its expiry, so an
//!   idle poll is not a write each time). The pruner's pass, or
//!   [`Broker::sweep_expired`], deletes the groups idle for longer, and
//!   the topics created for them once no group is left, messages
//!   included. Topic ids are never reused.
//!
//! All writes are `BEGIN IMMEDIATE` transactions in WAL mode; several
//! processes may share the file (they wake each other by polling).
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use keel_store::broker::{Broker, Message, SubscribeOptions};
//! use keel_sqlite::broker::SqliteBroker;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let broker = SqliteBroker::open_in_memory().await?;
//! broker
//!     .publish(&[Message::new("evt-1", "orders.placed", "order-42", "{}")])
//!     .await?;
//!
//! let mut billing = broker
//!     .subscribe(SubscribeOptions::new("orders.placed", "billing"))
//!     .await?;
//! let deliveries = billing.receive(10, Duration::from_secs(1)).await?;
//! assert_eq!(deliveries.len(), 1);
//! assert_eq!(deliveries[0].message.key, "order-42");
//! // ... apply the effect, commit, then:
//! deliveries[0].ack().await?;
//! # Ok(())
//! # }
//! ```

mod clock;
mod db;
mod delivery;
mod error;
mod options;
mod subscription;
mod topics;

#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::fmt;
use std::path::Path;
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use keel_store::broker::{
    Backlog, Broker, BrokerError, Message, MessageRetention, SubscribeOptions, Subscription,
};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool};

pub use options::SqliteBrokerOptions;

/// The most deliveries one receive returns, whatever `max` asks for, so a
/// receive's transaction stays short.
pub const MAX_RECEIVE: usize = 1024;

use clock::millis;
use db::{Db, GroupRef};
use delivery::Settler;
use error::db_error;
use subscription::SqliteSubscription;

/// The embedded durable broker. Cheap to clone: clones share the database,
/// the wake-ups and the background tasks. See the [module docs](self).
#[derive(Clone)]
pub struct SqliteBroker {
    inner: Arc<Inner>,
}

struct Inner {
    db: Db,
    options: SqliteBrokerOptions,
    settler: Settler,
}

impl fmt::Debug for SqliteBroker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqliteBroker")
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

impl SqliteBroker {
    /// Opens (creating if needed) the broker in the database file at `path`,
    /// with the default options.
    pub async fn open(path: impl AsRef<Path>) -> Result<Self, BrokerError> {
        SqliteBrokerOptions::default().open(path).await
    }

    /// Options for opening a broker: `SqliteBroker::options()…open(path)`.
    pub fn options() -> SqliteBrokerOptions {
        SqliteBrokerOptions::new()
    }

    /// See [`SqliteBrokerOptions::open`].
    pub(crate) async fn open_file(
        path: impl AsRef<Path>,
        options: SqliteBrokerOptions,
    ) -> Result<Self, BrokerError> {
        options.validate()?;
        crate::private_file::create_private(path.as_ref()).map_err(|e| {
            BrokerError::Unavailable(format!("creating {}: {e}", path.as_ref().display()).into())
        })?;
        let connect = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(options.synchronous)
            .busy_timeout(Duration::from_secs(5))
            .pragma("temp_store", "memory");
        let pool = crate::pool::guarded_pool_options()
            .max_connections(options.max_connections)
            .connect_with(connect)
            .await
            .map_err(|e| db_error("open", e))?;
        Self::on_pool(pool, options).await
    }

    /// A broker in a private in-memory database: for tests and demos; it
    /// vanishes with the last clone.
    pub async fn open_in_memory() -> Result<Self, BrokerError> {
        SqliteBrokerOptions::default().open_in_memory().await
    }

    /// See [`SqliteBrokerOptions::open_in_memory`].
    pub(crate) async fn open_memory(options: SqliteBrokerOptions) -> Result<Self, BrokerError> {
        options.validate()?;
        let connect = SqliteConnectOptions::new().in_memory(true);
        // One connection that never closes: each in-memory connection would
        // otherwise be a database of its own.
        let pool = crate::pool::guarded_pool_options()
            .max_connections(1)
            .min_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .connect_with(connect)
            .await
            .map_err(|e| db_error("open", e))?;
        Self::on_pool(pool, options).await
    }

    /// The broker on an existing pool (for example the store's, so both
    /// share one file), with the default options. The pool's pragmas are the
    /// caller's: use WAL mode and a busy timeout for file databases.
    pub async fn from_pool(pool: SqlitePool) -> Result<Self, BrokerError> {
        SqliteBrokerOptions::default().from_pool(pool).await
    }

    /// See [`SqliteBrokerOptions::from_pool`].
    pub(crate) async fn on_pool(
        pool: SqlitePool,
        options: SqliteBrokerOptions,
    ) -> Result<Self, BrokerError> {
        options.validate()?;
        let db = Db::new(pool);
        db.migrate().await?;
        let settler = Settler::spawn(db.clone());
        let prune_interval = options.prune_interval;
        let inner = Arc::new(Inner {
            db,
            options,
            settler,
        });
        if let Some(interval) = prune_interval {
            tokio::spawn(prune_periodically(Arc::downgrade(&inner), interval));
        }
        Ok(Self { inner })
    }

    /// The underlying pool.
    pub fn pool(&self) -> &SqlitePool {
        self.inner.db.pool()
    }

    /// Deletes settled messages older than [`SqliteBrokerOptions::kept_for`]:
    /// one bounded batch per topic. Returns how many were deleted. The
    /// background pruner calls this; call it yourself when that is off.
    pub async fn prune(&self) -> Result<u64, BrokerError> {
        Ok(self.inner.prune_once().await?.deleted)
    }

    /// Closes the pool: waits for in-flight operations, then refuses new
    /// ones. Deliveries not yet settled are redelivered after their lease.
    pub async fn close(&self) {
        self.inner.db.pool().close().await;
    }
}

impl Inner {
    async fn sweep_once(&self) -> Result<u64, BrokerError> {
        let swept = self.db.sweep_expired().await?;
        if swept > 0 {
            metrics::counter!("keel_broker_expired_total").increment(swept);
            tracing::debug!(swept, "deleted expired broker groups and topics");
        }
        Ok(swept)
    }

    async fn prune_once(&self) -> Result<db::PruneOutcome, BrokerError> {
        let cutoff = self
            .db
            .clock
            .now_ms()
            .saturating_sub(millis(self.options.kept_for()));
        let outcome = self.db.prune(self.options.prune_batch, cutoff).await?;
        if outcome.deleted > 0 {
            metrics::counter!("keel_broker_pruned_total").increment(outcome.deleted);
            tracing::debug!(deleted = outcome.deleted, "pruned settled broker messages");
        }
        Ok(outcome)
    }
}

/// Prunes every `interval`, in batches until caught up; stops when the
/// broker is dropped or closed.
async fn prune_periodically(inner: Weak<Inner>, interval: Duration) {
    loop {
        tokio::time::sleep(interval).await;
        let Some(inner) = inner.upgrade().filter(|i| !i.db.pool().is_closed()) else {
            return;
        };
        if let Err(error) = inner.sweep_once().await {
            tracing::warn!(%error, "sweeping expired broker groups failed; will retry");
        }
        loop {
            match inner.prune_once().await {
                Ok(outcome) if outcome.more => tokio::task::yield_now().await,
                Ok(_) => break,
                Err(error) => {
                    tracing::warn!(%error, "pruning the sqlite broker failed; will retry");
                    break;
                }
            }
        }
    }
}

fn check_name(what: &str, name: &str) -> Result<(), BrokerError> {
    if name.is_empty() {
        return Err(BrokerError::Invalid(format!("the {what} name is empty")));
    }
    Ok(())
}

#[async_trait]
impl Broker for SqliteBroker {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        if messages.is_empty() {
            return Ok(());
        }
        let mut topics = HashMap::new();
        for message in messages {
            self.validate(message)?;
            if !topics.contains_key(message.topic.as_str()) {
                let topic = self.inner.db.topic(&message.topic).await?;
                topics.insert(message.topic.as_str(), topic);
            }
        }
        let rows: Vec<(i64, &Message)> = messages
            .iter()
            .map(|m| (topics[m.topic.as_str()].id, m))
            .collect();
        let inserted = self.inner.db.publish(&rows).await?;
        for topic in topics.values() {
            topic.changed.notify_waiters();
        }
        let duplicates = messages.len() as u64 - inserted;
        metrics::counter!("keel_broker_published_total").increment(inserted);
        if duplicates > 0 {
            metrics::counter!("keel_broker_duplicates_total").increment(duplicates);
        }
        tracing::trace!(
            published = inserted,
            duplicates,
            "published to the sqlite broker"
        );
        Ok(())
    }

    /// A message needs a topic name and must fit the broker's
    /// [`max_message_bytes`](SqliteBrokerOptions::max_message_bytes)
    /// (payload plus headers).
    fn validate(&self, message: &Message) -> Result<(), BrokerError> {
        check_name("topic", &message.topic)?;
        let limit = self.inner.options.max_message_bytes;
        let size = message.payload.len()
            + message
                .headers
                .iter()
                .map(|(k, v)| k.len() + v.len())
                .sum::<usize>();
        if size > limit {
            return Err(BrokerError::Invalid(format!(
                "message {} is {size} bytes, over the broker's limit of {limit}; \
                 put the payload in a claim check",
                message.id
            )));
        }
        Ok(())
    }

    fn retention(&self) -> MessageRetention {
        MessageRetention::For(self.inner.options.kept_for())
    }

    async fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        check_name("topic", &options.topic)?;
        check_name("group", &options.group)?;
        if options.lease.is_zero() {
            return Err(BrokerError::Invalid("the lease must be positive".into()));
        }
        let (topic, group_id) = self
            .inner
            .db
            .subscribe(&options.topic, &options.group, options.expire_after_idle)
            .await?;
        let group = GroupRef {
            group_id,
            name: Arc::from(options.group.as_str()),
            topic,
        };
        tracing::debug!(topic = %options.topic, group = %options.group, "subscribed");
        Ok(Box::new(SqliteSubscription::new(
            self.inner.clone(),
            group,
            options,
        )))
    }

    /// Deletes the expired groups and topics in one transaction. The
    /// background pruner also sweeps, at every pass.
    async fn sweep_expired(&self) -> Result<u64, BrokerError> {
        self.inner.sweep_once().await
    }

    async fn remove_group(&self, topic: &str, group: &str) -> Result<(), BrokerError> {
        self.inner.db.remove_group(topic, group).await.map(drop)
    }

    async fn ping(&self) -> Result<(), BrokerError> {
        self.inner.db.ping().await
    }

    async fn backlog(&self, topic: &str, group: &str) -> Result<Option<Backlog>, BrokerError> {
        self.inner.db.backlog(topic, group).await
    }
}
