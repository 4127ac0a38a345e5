//! An outbox relay source that tails PostgreSQL's write-ahead log instead
//! of polling the outbox table.
//!
//! [`WalOutbox`] is an [`OutboxStore`] for Keel's relay (`keel-messaging`'s
//! `OutboxRelay`, unchanged, with its batching, parking and per-key holds):
//! its claims come from a logical replication slot (`pgoutput`, a
//! publication of the outbox table's inserts) in commit order, the moment
//! each transaction commits, without a query. Marking a batch published
//! updates the table as the polling relay does, then confirms the slot
//! past every transaction whose rows are all finished: the slot's position
//! never passes a row the broker has not acknowledged, so a crash (of Keel,
//! of the connection, of the server) streams the unfinished transactions
//! again. At least once, as with the polling relay: consumers dedupe on
//! the event id.
//!
//! **The table stays the source of truth.** Every
//! [`sweep_interval`](WalRelayOptions::sweep_interval) (default 10 s) a
//! claim also takes unpublished rows from the table as the polling relay
//! would: rows an operator replayed after parking, rows of a key that
//! waited behind a parked row, and anything committed while the stream was
//! down. So the WAL path is a fast path, never the only path.
//!
//! **A slot holds WAL until it is confirmed**: a relay that stops reading
//! (or a decommissioned deployment that left its slot) fills the disk.
//! [`WalOutbox::slot_lag`] and the gauge `keel_outbox_wal_slot_lag_bytes`
//! say how far behind it is (the shipped alert `KeelOutboxWalSlotLagging`
//! fires on it), and [`WalOutbox::decommission`] drops the slot and the
//! publication.
//!
//! Run one relay per `WalOutbox`: a slot has one reader at a time. Other
//! processes' `WalOutbox`es on the same slot retry every second until it is
//! free, and meanwhile publish through the sweep. When the reader's process
//! dies, the server lets go of the slot once it notices the connection is
//! gone: at once on a clean close, at the latest after `wal_sender_timeout`
//! (60 s by default). Requires `wal_level = logical`
//! and PostgreSQL 14 or later (binary `pgoutput`).

mod feed;
mod pgoutput;
mod stream;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use keel_core::clock::{self, Instant};
use keel_store::{OutboxRecord, OutboxStats, OutboxStore, PendingOutbox, Store, StoreError};
use parking_lot::Mutex;
use pgwire_replication::{ReplicationConfig, TlsConfig};
use tokio::sync::{Notify, watch};

use crate::PgStore;
use crate::store::error::db_error;
use feed::Feed;

/// How the WAL relay names and paces its slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WalRelayOptions {
    /// The replication slot's name (default `keel_outbox`); one per
    /// deployment sharing a schema.
    pub slot: String,
    /// The publication's name (default `keel_outbox`).
    pub publication: String,
    /// How often a claim also reads unpublished rows from the table
    /// (default 10 s): the path for replayed, held and missed rows.
    pub sweep_interval: Duration,
    /// How often the slot's lag is measured for the gauge (default 10 s).
    pub lag_interval: Duration,
}

impl Default for WalRelayOptions {
    fn default() -> Self {
        Self {
            slot: "keel_outbox".to_owned(),
            publication: "keel_outbox".to_owned(),
            sweep_interval: Duration::from_secs(10),
            lag_interval: Duration::from_secs(10),
        }
    }
}

impl WalRelayOptions {
    /// Sets the slot's and the publication's name.
    #[must_use]
    pub fn named(mut self, name: &str) -> Self {
        name.clone_into(&mut self.slot);
        name.clone_into(&mut self.publication);
        self
    }

    /// Sets [`sweep_interval`](Self::sweep_interval).
    #[must_use]
    pub fn sweep_interval(mut self, interval: Duration) -> Self {
        self.sweep_interval = interval;
        self
    }
}

/// What the stream task and the store share.
struct Shared {
    options: WalRelayOptions,
    schema: String,
    feed: Mutex<Feed>,
    /// Partition keys with a parked row: their later rows wait in the table.
    held: Mutex<HashSet<String>>,
    next_sweep: Mutex<Instant>,
    confirm: watch::Sender<u64>,
    wake: Mutex<Option<Arc<Notify>>>,
}

impl Shared {
    fn wake(&self) {
        if let Some(wake) = self.wake.lock().as_ref() {
            wake.notify_one();
        }
    }

    fn confirm(&self, lsn: Option<u64>) {
        if let Some(lsn) = lsn {
            self.confirm.send_if_modified(|confirmed| {
                let moved = lsn > *confirmed;
                *confirmed = (*confirmed).max(lsn);
                moved
            });
        }
    }
}

/// The outbox of a [`PgStore`], claimed from its replication slot; see the
/// [module docs](self). Cheap to clone; clones share the stream.
#[derive(Clone)]
pub struct WalOutbox {
    store: PgStore,
    shared: Arc<Shared>,
    stop: Arc<StopOnDrop>,
}

struct StopOnDrop(watch::Sender<bool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.send_replace(true);
    }
}

impl std::fmt::Debug for WalOutbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WalOutbox")
            .field("slot", &self.shared.options.slot)
            .finish_non_exhaustive()
    }
}

impl WalOutbox {
    /// Creates the publication and the slot if missing (several processes
    /// may race to), and starts streaming it on a replication connection to
    /// `url`, the server `store` is on. Fails if the server's `wal_level`
    /// is not `logical` or a name is not a plain lowercase identifier.
    pub async fn start(
        store: PgStore,
        url: &str,
        options: WalRelayOptions,
    ) -> Result<Self, StoreError> {
        for name in [&options.slot, &options.publication] {
            check_name(name)?;
        }
        setup(&store, &options).await?;
        let config = replication_config(url, &options)?;
        let (confirm, confirmed) = watch::channel(0);
        let (stop, stopped) = watch::channel(false);
        let shared = Arc::new(Shared {
            schema: store.schema().to_owned(),
            feed: Mutex::new(Feed::default()),
            held: Mutex::new(HashSet::new()),
            // The slot delivers what was committed while no relay ran;
            // the first sweep is for what it never will (rows from before
            // the slot existed, replays).
            next_sweep: Mutex::new(clock::now() + options.sweep_interval),
            confirm,
            wake: Mutex::new(None),
            options,
        });
        tokio::spawn(stream::run(
            Arc::clone(&shared),
            config,
            confirmed,
            stopped.clone(),
        ));
        tokio::spawn(measure_lag(store.clone(), Arc::clone(&shared), stopped));
        Ok(Self {
            store,
            shared,
            stop: Arc::new(StopOnDrop(stop)),
        })
    }

    /// Notifies `wake` whenever a transaction with outbox rows arrives on
    /// the stream: give it the relay's wake-up (keel-messaging's
    /// `Outbox::waker`), so rows leave as soon as they are streamed.
    pub fn wake_with(&self, wake: Arc<Notify>) {
        *self.shared.wake.lock() = Some(wake);
    }

    /// The store whose outbox this streams.
    pub fn store(&self) -> &PgStore {
        &self.store
    }

    /// Bytes of WAL the slot holds that its reader has not confirmed;
    /// `None` if the slot does not exist.
    pub async fn slot_lag(&self) -> Result<Option<u64>, StoreError> {
        slot_lag(&self.store, &self.shared.options.slot).await
    }

    /// Outbox rows the stream delivered that are not published yet.
    pub fn unfinished(&self) -> usize {
        self.shared.feed.lock().unfinished()
    }

    /// Stops streaming and drops the slot and the publication, so the
    /// server stops keeping WAL for them: for a deployment that goes away
    /// or moves to the polling relay. Unpublished rows stay in the table.
    pub async fn decommission(self) -> Result<(), StoreError> {
        self.stop.0.send_replace(true);
        let options = &self.shared.options;
        // The walsender lets go of the slot shortly after the stream stops.
        let drop_slot = "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots \
                         WHERE slot_name = $1";
        let mut attempts = 0;
        loop {
            match sqlx::query(drop_slot)
                .bind(&options.slot)
                .execute(self.store.pool())
                .await
            {
                Ok(_) => break,
                Err(err) if attempts < 50 && is_slot_active(&err) => attempts += 1,
                Err(err) => return Err(db_error(err)),
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let drop_publication = format!("DROP PUBLICATION IF EXISTS {}", options.publication);
        // The name passed `check_name`: a plain identifier.
        sqlx::query(sqlx::AssertSqlSafe(drop_publication))
            .execute(self.store.pool())
            .await
            .map_err(db_error)?;
        tracing::info!(slot = %options.slot, "outbox WAL slot and publication dropped");
        Ok(())
    }

    fn sweep_due(&self) -> bool {
        let mut next = self.shared.next_sweep.lock();
        let now = clock::now();
        if now < *next {
            return false;
        }
        *next = now + self.shared.options.sweep_interval;
        true
    }

    async fn refresh_held(&self) -> Result<(), StoreError> {
        let keys: Vec<String> = sqlx::query_scalar(
            "SELECT DISTINCT partition_key FROM keel_outbox \
             WHERE parked_at IS NOT NULL AND published_at IS NULL",
        )
        .fetch_all(self.store.pool())
        .await
        .map_err(db_error)?;
        *self.shared.held.lock() = keys.into_iter().collect();
        Ok(())
    }

    /// Splits `ids` into the stream's and the table's (the sweep's).
    fn split(&self, ids: &[i64]) -> (Vec<i64>, Vec<i64>) {
        let feed = self.shared.feed.lock();
        ids.iter().partition(|id| feed.owns(**id))
    }
}

fn check_name(name: &str) -> Result<(), StoreError> {
    let plain = !name.is_empty()
        && name.len() <= 63
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if plain {
        Ok(())
    } else {
        Err(StoreError::other(format!(
            "`{name}` is not a plain slot or publication name: use 1 to 63 lowercase \
             letters, digits and underscores, starting with a letter or underscore"
        )))
    }
}

async fn setup(store: &PgStore, options: &WalRelayOptions) -> Result<(), StoreError> {
    let pool = store.pool();
    let wal_level: String = sqlx::query_scalar("SHOW wal_level")
        .fetch_one(pool)
        .await
        .map_err(db_error)?;
    if wal_level != "logical" {
        return Err(StoreError::other(format!(
            "the server's wal_level is `{wal_level}`: the WAL relay needs `wal_level = logical` \
             (a restart), or use the polling relay"
        )));
    }
    let create_publication = format!(
        "CREATE PUBLICATION {} FOR TABLE keel_outbox WITH (publish = 'insert')",
        options.publication
    );
    // The name passed `check_name`: a plain identifier.
    let create_publication = sqlx::query(sqlx::AssertSqlSafe(create_publication));
    tolerate_duplicate(create_publication.execute(pool).await)?;
    let create_slot = "SELECT pg_create_logical_replication_slot($1, 'pgoutput') \
                       WHERE NOT EXISTS (SELECT 1 FROM pg_replication_slots WHERE slot_name = $1)";
    tolerate_duplicate(
        sqlx::query(create_slot)
            .bind(&options.slot)
            .execute(pool)
            .await,
    )
}

/// Another process created it first: fine.
fn tolerate_duplicate<T>(result: Result<T, sqlx::Error>) -> Result<(), StoreError> {
    match result {
        Ok(_) => Ok(()),
        Err(sqlx::Error::Database(db)) if db.code().as_deref() == Some("42710") => Ok(()),
        Err(err) => Err(db_error(err)),
    }
}

fn is_slot_active(err: &sqlx::Error) -> bool {
    matches!(err, sqlx::Error::Database(db) if db.code().as_deref() == Some("55006"))
}

fn replication_config(
    url: &str,
    options: &WalRelayOptions,
) -> Result<ReplicationConfig, StoreError> {
    let url =
        url::Url::parse(url).map_err(|e| StoreError::other(format!("the WAL relay's URL: {e}")))?;
    let password = url.password().unwrap_or_default();
    let user = match url.username() {
        "" => "postgres",
        user => user,
    };
    let database = url.path().trim_start_matches('/');
    let host = url.host_str().unwrap_or("localhost");
    let config = ReplicationConfig::new(
        host,
        user,
        password,
        if database.is_empty() { user } else { database },
        options.slot.clone(),
        options.publication.clone(),
    )
    .with_port(url.port().unwrap_or(5432))
    .with_binary(true)
    // Confirmed positions reach the server within a second, so the slot
    // holds little more WAL than the relay's backlog.
    .with_status_interval(Duration::from_secs(1))
    .with_application_name(format!("keel-wal-relay-{}", options.slot));
    let tls = url.query_pairs().any(|(k, v)| {
        k == "sslmode" && matches!(v.as_ref(), "require" | "verify-ca" | "verify-full")
    });
    Ok(if tls {
        config
    } else {
        config.with_tls(TlsConfig::disabled())
    })
}

async fn slot_lag(store: &PgStore, slot: &str) -> Result<Option<u64>, StoreError> {
    let lag: Option<Option<i64>> = sqlx::query_scalar(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint \
         FROM pg_replication_slots WHERE slot_name = $1",
    )
    .bind(slot)
    .fetch_optional(store.pool())
    .await
    .map_err(db_error)?;
    Ok(lag.map(|lag| lag.map_or(0, |bytes| u64::try_from(bytes).unwrap_or(0))))
}

async fn measure_lag(store: PgStore, shared: Arc<Shared>, mut stopped: watch::Receiver<bool>) {
    let gauge =
        metrics::gauge!("keel_outbox_wal_slot_lag_bytes", "slot" => shared.options.slot.clone());
    loop {
        match slot_lag(&store, &shared.options.slot).await {
            Ok(Some(lag)) => gauge.set(lag as f64),
            Ok(None) => {}
            Err(error) => tracing::debug!(%error, "could not measure the WAL slot's lag"),
        }
        tokio::select! {
            () = tokio::time::sleep(shared.options.lag_interval) => {}
            _ = stopped.wait_for(|stop| *stop) => return,
        }
    }
}

#[async_trait]
impl Store for WalOutbox {
    type Tx = <PgStore as Store>::Tx;

    async fn begin(&self) -> Result<Self::Tx, StoreError> {
        self.store.begin().await
    }

    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError> {
        self.store.commit(tx).await
    }

    async fn rollback(&self, tx: Self::Tx) -> Result<(), StoreError> {
        self.store.rollback(tx).await
    }

    async fn ready(&self) -> Result<(), StoreError> {
        self.store.ready().await
    }
}

#[async_trait]
impl OutboxStore for WalOutbox {
    async fn outbox_append(
        &self,
        tx: &mut Self::Tx,
        records: &[OutboxRecord],
    ) -> Result<(), StoreError> {
        self.store.outbox_append(tx, records).await
    }

    /// The stream's rows first, in commit order; when the sweep is due,
    /// the table's unpublished rows too (see the module docs).
    async fn outbox_claim(
        &self,
        relay: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<PendingOutbox>, StoreError> {
        let (streamed, confirmable) = {
            let held = self.shared.held.lock();
            let mut feed = self.shared.feed.lock();
            (feed.claim(limit, &held), feed.confirmable())
        };
        self.shared.confirm(confirmable);
        if !streamed.is_empty() || !self.sweep_due() {
            return Ok(streamed);
        }
        self.refresh_held().await?;
        self.store.outbox_claim(relay, limit, lease).await
    }

    async fn outbox_mark_published(&self, ids: &[i64]) -> Result<(), StoreError> {
        self.store.outbox_mark_published(ids).await?;
        let (streamed, swept) = self.split(ids);
        let confirmable = {
            let mut feed = self.shared.feed.lock();
            feed.swept(&swept);
            feed.finish(&streamed)
        };
        self.shared.confirm(confirmable);
        Ok(())
    }

    async fn outbox_release(&self, relay: &str, ids: &[i64]) -> Result<(), StoreError> {
        let (streamed, swept) = self.split(ids);
        self.shared.feed.lock().release(&streamed);
        self.store.outbox_release(relay, &swept).await
    }

    async fn outbox_release_failed(
        &self,
        relay: &str,
        ids: &[i64],
        error: &str,
    ) -> Result<(), StoreError> {
        let (streamed, swept) = self.split(ids);
        self.shared.feed.lock().release(&streamed);
        self.store.outbox_release_failed(relay, &swept, error).await
    }

    async fn outbox_park(&self, id: i64, error: &str) -> Result<bool, StoreError> {
        let (streamed, _) = self.split(&[id]);
        let key =
            sqlx::query_scalar::<_, String>("SELECT partition_key FROM keel_outbox WHERE id = $1")
                .bind(id)
                .fetch_optional(self.store.pool())
                .await
                .map_err(db_error)?;
        let parked = self.store.outbox_park(id, error).await?;
        if let (true, Some(key)) = (parked, key) {
            self.shared.held.lock().insert(key);
        }
        let confirmable = self.shared.feed.lock().finish(&streamed);
        self.shared.confirm(confirmable);
        Ok(parked)
    }

    async fn outbox_prune(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError> {
        self.store.outbox_prune(before, batch).await
    }

    async fn outbox_archive(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError> {
        self.store.outbox_archive(before, batch).await
    }

    async fn outbox_stats(&self) -> Result<OutboxStats, StoreError> {
        self.store.outbox_stats().await
    }
}
