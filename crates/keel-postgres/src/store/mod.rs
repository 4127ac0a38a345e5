//! The messaging [`Store`] on PostgreSQL: outbox, inbox, dead letters, sagas
//! and fencing tokens next to the application's own tables, shared by any
//! number of processes.
//!
//! As with every Keel store, Keel's rows commit in the *user's* transaction:
//! [`PgStore::begin`](Store::begin) hands out a plain
//! `sqlx::Transaction<'static, Postgres>`; write your business rows in it
//! with your own SQL, add Keel's rows with the same `&mut tx`, commit once.
//!
//! ```no_run
//! use keel_store::{OutboxRecord, OutboxStore, Store};
//! use keel_postgres::PgStore;
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let store = PgStore::open("postgres://keel@127.0.0.1/keel").await?;
//! let mut tx = store.begin().await?;
//! sqlx::query("INSERT INTO public.orders (id, total_minor) VALUES ($1, $2)")
//!     .bind("A-4471")
//!     .bind(8210_i64)
//!     .execute(&mut *tx)
//!     .await?;
//! let event = OutboxRecord {
//!     event_id: "0190f5c4-6a1e-7b2c-9d3e-4f5a6b7c8d9e".into(),
//!     topic: "orders".into(),
//!     partition_key: "A-4471".into(),
//!     headers: Default::default(),
//!     payload: br#"{"orderId":"A-4471"}"#.as_slice().into(),
//! };
//! store.outbox_append(&mut tx, &[event]).await?;
//! store.commit(tx).await?;
//! # Ok(()) }
//! ```
//!
//! # Schema
//!
//! Every object lives in one schema (default `keel`, see
//! [`PgStoreOptions::schema`]), created on connect, and every connection of
//! the pool starts with `search_path = <schema>, public`: Keel's tables are
//! found unqualified, and your own tables in `public` still are too. Tables
//! are prefixed `keel_` so that they never shadow one of yours. Migrations
//! are embedded (versions 1001 and up) and run on connect; their bookkeeping
//! table `_sqlx_migrations` is the one in Keel's schema, apart from yours.
//!
//! # Concurrency
//!
//! Several processes share one database. What keeps them apart:
//! relays claim outbox rows with `FOR UPDATE SKIP LOCKED` under a lease (see
//! `outbox.rs` for why claims also take a short advisory lock), webhook
//! workers claim deliveries the same way, idempotency keys are decided under
//! row locks, and fencing tokens and event-log seqs are single-row upserts.
//!
//! # Failures
//!
//! Serialization failures (`40001`) and deadlocks (`40P01`) of the
//! statements and transactions the store runs itself are retried with
//! backoff; in the user's transactions they are
//! [`StoreError::Unavailable`] (retryable: run the transaction again). A
//! connection lost during `COMMIT` is [`StoreError::OutcomeUnknown`] from
//! [`Store::commit`]; [`PgStore::commit_resolved`] and the store's own
//! transactions resolve it instead, by asking the server what became of the
//! transaction id.
//!
//! # Wake-ups
//!
//! Appends send `pg_notify` on the store's channels inside the transaction,
//! so the notification is delivered exactly when (and only if) it commits.
//! [`PgWakeups`](crate::PgWakeups) listens to them in every process.

pub(crate) mod codec;
mod dialect;
pub(crate) mod error;
mod options;
mod outbox;

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keel_sql::dialect::within_answer_bound;
use keel_store::Store;
use keel_store::StoreError;
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgPool, Postgres};

pub use dialect::PgDialect;
pub(crate) use options::pool_options;
pub use options::{InvalidSchema, PgStoreOptions};

use error::{commit_error, db_error, is_connection_lost};

/// The first and last migration version this store owns.
const VERSIONS: std::ops::RangeInclusive<i64> = 1001..=1999;

/// How long [`PgStore::commit_resolved`] asks what became of a `COMMIT`
/// whose answer was lost.
const RESOLVE_FOR: Duration = Duration::from_secs(5);

/// The messaging [`Store`] on PostgreSQL. Cheap to clone; clones share the
/// pool.
#[derive(Debug, Clone)]
pub struct PgStore {
    pub(crate) pool: PgPool,
    pub(crate) schema: Arc<str>,
    pub(crate) channels: Arc<Channels>,
}

/// The `LISTEN/NOTIFY` channels of one schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Channels {
    /// Outbox appends.
    pub outbox: String,
    /// Webhook deliveries queued.
    pub webhooks: String,
    /// Event-log appends (payload: `<seq> <stream>`).
    pub event_log: String,
    /// Sagas created or saved.
    pub sagas: String,
}

impl Channels {
    /// The channels of `schema`: `<schema>.outbox`, `<schema>.webhooks`,
    /// `<schema>.event_log`, `<schema>.sagas`, so stores in different
    /// schemas of one database never wake each other.
    pub fn for_schema(schema: &str) -> Self {
        Self {
            outbox: format!("{schema}.outbox"),
            webhooks: format!("{schema}.webhooks"),
            event_log: format!("{schema}.event_log"),
            sagas: format!("{schema}.sagas"),
        }
    }
}

/// What became of a transaction, as PostgreSQL remembers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxOutcome {
    /// It committed.
    Committed,
    /// It rolled back (or its server crashed before it committed).
    Aborted,
    /// It is still running (its COMMIT may not have arrived yet).
    InProgress,
    /// The server no longer knows (the id is too old).
    Unknown,
}

impl PgStore {
    /// Opens the store at `url` with the default [`PgStoreOptions`]
    /// (schema `keel`, 10 connections) and migrates.
    pub async fn open(url: &str) -> Result<Self, StoreError> {
        PgStoreOptions::new().open(url).await
    }

    /// Options for opening a store: `PgStore::options()…open(url)`.
    pub fn options() -> PgStoreOptions {
        PgStoreOptions::new()
    }

    /// The pool: every connection has Keel's schema first in its
    /// `search_path`. For business writes that go with an event, use
    /// [`Store::begin`] and `sqlx::query(..).execute(&mut *tx)`.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Connections the pool could hand out right now without waiting: the
    /// idle ones and those not opened yet. For readiness (pool
    /// exhaustion); reads no database.
    pub fn connections_free(&self) -> usize {
        keel_sql::backend::connections_free(&self.pool)
    }

    /// What this server is configured with that breaks Keel's "nothing
    /// acknowledged is lost", one sentence each (empty when nothing is).
    ///
    /// The relay marks a row published, and the idempotency layer answers
    /// from a stored response, once PostgreSQL acknowledged the commit; with
    /// `synchronous_commit` below `on` (`off`, `local` on a standby setup)
    /// or `fsync = off`, a server crash can lose commits it acknowledged.
    /// `keel serve` logs these at start.
    pub async fn durability_warnings(&self) -> Result<Vec<String>, StoreError> {
        let (commit, fsync): (String, String) = sqlx::query_as(
            "SELECT current_setting('synchronous_commit'), current_setting('fsync')",
        )
        .fetch_one(&self.pool)
        .await
        .map_err(db_error)?;
        let mut warnings = Vec::new();
        if !matches!(commit.as_str(), "on" | "remote_write" | "remote_apply") {
            warnings.push(format!(
                "synchronous_commit = {commit}: a server crash can lose commits it acknowledged; \
                 set it to on"
            ));
        }
        if fsync != "on" {
            warnings.push(format!(
                "fsync = {fsync}: a machine crash can lose or corrupt committed data; \
                 set it to on outside tests"
            ));
        }
        Ok(warnings)
    }

    /// The schema holding Keel's tables.
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The `LISTEN/NOTIFY` channels appends signal on.
    pub fn channels(&self) -> &Channels {
        &self.channels
    }

    /// The embedded migrations (run them yourself with `migrate(false)`).
    pub fn migrator() -> Migrator {
        let mut migrator = sqlx::migrate!("./migrations");
        migrator.set_ignore_missing(true);
        migrator
    }

    /// Closes the pool, waiting for connections in use to come back.
    pub async fn close(&self) {
        self.pool.close().await;
    }

    /// Commits `tx` like [`Store::commit`], but when the connection is lost
    /// during `COMMIT` it asks the server (on another connection, for up to
    /// about five seconds) whether the transaction committed instead of
    /// returning [`StoreError::OutcomeUnknown`]: `Ok` if it did,
    /// [`StoreError::Unavailable`] (nothing was written: run it again) if it
    /// did not. Only if the server cannot tell is the outcome still unknown.
    /// Costs one extra round trip before the `COMMIT`.
    pub async fn commit_resolved(&self, mut tx: <Self as Store>::Tx) -> Result<(), StoreError> {
        let xid: Option<i64> = within_answer_bound::<PgDialect, _>(
            sqlx::query_scalar("SELECT txid_current_if_assigned()").fetch_one(&mut *tx),
        )
        .await
        .map_err(db_error)?;
        let err = match within_answer_bound::<PgDialect, _>(tx.commit()).await {
            Ok(()) => return Ok(()),
            Err(err) if is_connection_lost(&err) => err,
            Err(err) => return Err(commit_error(err)),
        };
        // Nothing written (no xid): nothing to lose by calling it aborted.
        let Some(xid) = xid else {
            return Err(StoreError::Unavailable(err.into()));
        };
        // About five seconds of asking, however long each answer takes.
        match tokio::time::timeout(RESOLVE_FOR, self.resolve(xid, &err)).await {
            Ok(Some(resolved)) => resolved,
            Ok(None) | Err(_) => Err(commit_error(err)),
        }
    }

    /// Asks what became of transaction `xid` until the server says
    /// committed, aborted or unknown (`None`); `err` is the lost `COMMIT`'s.
    async fn resolve(&self, xid: i64, err: &sqlx::Error) -> Option<Result<(), StoreError>> {
        for attempt in 0u32.. {
            match self.transaction_outcome(xid).await {
                Ok(TxOutcome::Committed) => {
                    tracing::info!(xid, "commit outcome resolved: committed");
                    return Some(Ok(()));
                }
                Ok(TxOutcome::Aborted) => {
                    tracing::info!(xid, "commit outcome resolved: rolled back");
                    return Some(Err(StoreError::Unavailable(
                        format!("the transaction was rolled back: {err}").into(),
                    )));
                }
                Ok(TxOutcome::Unknown) => return None,
                Ok(TxOutcome::InProgress) | Err(_) => {
                    tracing::debug!(xid, attempt, "commit outcome not known yet");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        None
    }

    /// What became of the transaction with id `xid` (`txid_current()`),
    /// asked on a pool connection.
    pub async fn transaction_outcome(&self, xid: i64) -> Result<TxOutcome, StoreError> {
        let status: Option<String> = within_answer_bound::<PgDialect, _>(
            sqlx::query_scalar("SELECT txid_status($1)")
                .bind(xid)
                .fetch_one(&self.pool),
        )
        .await
        .map_err(db_error)?;
        Ok(match status.as_deref() {
            Some("committed") => TxOutcome::Committed,
            Some("aborted") => TxOutcome::Aborted,
            Some("in progress") => TxOutcome::InProgress,
            _ => TxOutcome::Unknown,
        })
    }
}

#[async_trait]
impl Store for PgStore {
    type Tx = sqlx::Transaction<'static, Postgres>;

    /// Runs `BEGIN` in a task of its own, so a caller dropped while waiting
    /// for it (a hang-up, a timeout) never cuts it in half: the task still
    /// gets the transaction, and dropping it there rolls it back. (sqlx
    /// 0.9.1 makes its own `begin()` cancel-safe too; see `pool_options`.)
    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        let pool = self.pool.clone();
        tokio::spawn(async move { within_answer_bound::<PgDialect, _>(pool.begin()).await })
            .await
            .map_err(StoreError::other)?
            .map_err(db_error)
    }

    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError> {
        within_answer_bound::<PgDialect, _>(tx.commit())
            .await
            .map_err(commit_error)
    }

    async fn rollback(&self, tx: Self::Tx) -> Result<(), StoreError> {
        within_answer_bound::<PgDialect, _>(tx.rollback())
            .await
            .map_err(db_error)
    }

    async fn ready(&self) -> Result<(), StoreError> {
        keel_sql::schema::check_migrated(
            self,
            &Self::migrator(),
            VERSIONS,
            &format!("postgres store schema {:?}", self.schema),
        )
        .await
    }
}
