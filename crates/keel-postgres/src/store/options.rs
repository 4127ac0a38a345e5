//! How a [`PgStore`] connects: pool size, schema, migrations.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use keel_store::StoreError;
use sqlx::Connection;
use sqlx::migrate::MigrateError;
use sqlx::postgres::{PgConnectOptions, PgConnection, PgPoolOptions};

use super::error::db_error;
use super::{Channels, PgStore};

/// The longest schema name accepted: PostgreSQL's identifiers have 63
/// bytes, and channel names (`<schema>.event_log`) must fit too.
const MAX_SCHEMA_LEN: usize = 48;

/// A schema name Keel refuses.
#[derive(Debug, thiserror::Error)]
#[error(
    "invalid schema name {0:?}: use 1 to 48 lowercase ASCII letters, digits and underscores, \
     starting with a letter or underscore"
)]
pub struct InvalidSchema(pub String);

/// Options for connecting a [`PgStore`], with documented defaults.
///
/// ```no_run
/// # async fn demo() -> Result<(), keel_store::StoreError> {
/// use std::time::Duration;
/// use keel_postgres::PgStore;
///
/// let store = PgStore::options()
///     .schema("orders_keel")
///     .max_connections(20)
///     .acquire_timeout(Duration::from_secs(2))
///     .open("postgres://keel@127.0.0.1/keel")
///     .await?;
/// # drop(store); Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PgStoreOptions {
    schema: String,
    max_connections: u32,
    min_connections: u32,
    acquire_timeout: Duration,
    migrate: bool,
    application_name: String,
    idle_in_transaction_timeout: Duration,
    statement_timeout: Duration,
    max_lifetime: Duration,
}

impl Default for PgStoreOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl PgStoreOptions {
    /// The defaults: schema `keel`, at most 10 connections (none
    /// kept idle), a 5 s acquire timeout, migrations on connect,
    /// `application_name = keel`, statements cancelled by the server after
    /// 30 s, sessions ended by it after 60 s idle inside a transaction and
    /// replaced after 30 minutes.
    pub fn new() -> Self {
        Self {
            schema: "keel".to_owned(),
            max_connections: 10,
            min_connections: 0,
            acquire_timeout: Duration::from_secs(5),
            migrate: true,
            application_name: "keel".to_owned(),
            idle_in_transaction_timeout: Duration::from_secs(60),
            statement_timeout: Duration::from_secs(30),
            max_lifetime: Duration::from_secs(30 * 60),
        }
    }

    /// The schema holding every Keel object (default `keel`). Created on
    /// connect if missing. Lowercase letters, digits and underscores.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// The most connections in the pool (default 10).
    pub fn max_connections(mut self, n: u32) -> Self {
        self.max_connections = n.max(1);
        self
    }

    /// Connections kept open when idle (default 0).
    pub fn min_connections(mut self, n: u32) -> Self {
        self.min_connections = n;
        self
    }

    /// How long an operation waits for a free connection before failing with
    /// [`StoreError::Unavailable`] (default 5 s).
    pub fn acquire_timeout(mut self, timeout: Duration) -> Self {
        self.acquire_timeout = timeout;
        self
    }

    /// Whether to create the schema and run the embedded migrations on
    /// connect (default `true`). Without it, run [`PgStore::migrator`]
    /// yourself; [`ready`](keel_store::Store::ready) reports a schema
    /// that is behind.
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// The `application_name` the connections report in
    /// `pg_stat_activity` (default `keel`).
    pub fn application_name(mut self, name: impl Into<String>) -> Self {
        self.application_name = name.into();
        self
    }

    /// How long the server lets a session sit idle inside a transaction
    /// before ending it (`idle_in_transaction_session_timeout`, default
    /// 60 s, whole seconds). It bounds what a leaked transaction can hold:
    /// its row locks, and the writes of anyone who mistakenly joined it.
    /// Keep it above the longest pause your own transactions make between
    /// statements.
    pub fn idle_in_transaction_timeout(mut self, timeout: Duration) -> Self {
        self.idle_in_transaction_timeout = timeout.max(Duration::from_secs(1));
        self
    }

    /// How long one statement may run, waiting for locks included, before
    /// the server cancels it (`statement_timeout`, default 30 s,
    /// milliseconds; zero for no limit). It bounds how long a stuck query
    /// or a lock held elsewhere keeps a pooled connection, which the
    /// store's workers and your requests share. A cancelled statement
    /// fails with [`StoreError::Unavailable`] (try again later), and inside
    /// a transaction it fails the transaction. It covers your statements in
    /// the store's transactions too; migrations run without it.
    ///
    /// The store's own statements, `BEGIN` and `COMMIT` also give up on the
    /// client side when no answer comes within the timeout plus 5 s (the
    /// longest of any store in the process): a network that drops every
    /// byte never lets the server see the statement to cancel it, and the
    /// socket alone would wait for minutes. A statement given up on fails
    /// with [`StoreError::Unavailable`] (nothing committed), a `COMMIT`
    /// or an autocommit write with [`StoreError::OutcomeUnknown`].
    pub fn statement_timeout(mut self, timeout: Duration) -> Self {
        self.statement_timeout = timeout;
        self
    }

    /// How long a connection lives before the pool replaces it (default
    /// 30 minutes).
    pub fn max_lifetime(mut self, lifetime: Duration) -> Self {
        self.max_lifetime = lifetime;
        self
    }

    /// The connect options every connection of the store uses (`url`
    /// with Keel's `search_path`, application name and timeouts).
    pub fn connect_options(&self, url: &str) -> Result<PgConnectOptions, StoreError> {
        self.connect_options_timing_out_after(url, self.statement_timeout)
    }

    fn connect_options_timing_out_after(
        &self,
        url: &str,
        statement_timeout: Duration,
    ) -> Result<PgConnectOptions, StoreError> {
        validate_schema(&self.schema)?;
        let options = PgConnectOptions::from_str(url).map_err(StoreError::other)?;
        Ok(options.application_name(&self.application_name).options([
            ("search_path", format!("{},public", self.schema)),
            (
                "idle_in_transaction_session_timeout",
                format!("{}s", self.idle_in_transaction_timeout.as_secs()),
            ),
            (
                "statement_timeout",
                format!("{}ms", statement_timeout.as_millis()),
            ),
        ]))
    }

    /// Opens the store at `url` (lazily: the pool opens connections as
    /// needed), creating the schema and migrating unless told not to.
    pub async fn open(self, url: &str) -> Result<PgStore, StoreError> {
        let options = self.connect_options(url)?;
        super::dialect::cover_statement_timeout(self.statement_timeout, self.acquire_timeout);
        let pool = pool_options()
            .max_connections(self.max_connections)
            .min_connections(self.min_connections)
            .acquire_timeout(self.acquire_timeout)
            .max_lifetime(self.max_lifetime)
            .connect_lazy_with(options);
        if self.migrate {
            // A migration may rewrite a large table: it gets a connection
            // of its own, without the statement timeout.
            let unbounded = self.connect_options_timing_out_after(url, Duration::ZERO)?;
            migrate(&unbounded, self.acquire_timeout, &self.schema).await?;
        }
        Ok(PgStore {
            pool,
            channels: Arc::new(Channels::for_schema(&self.schema)),
            schema: Arc::from(self.schema),
        })
    }
}

/// Pool options whose checkout under load costs no round trip.
///
/// A session must never be handed out inside a transaction nobody owns: the
/// next borrower's autocommit writes would answer success and vanish with
/// that transaction. sqlx 0.8.6 and 0.9.0 left one behind whenever a
/// `begin()` was dropped while its `BEGIN` was in flight (upstream issues
/// #4385 and #4393), so every checkout used to ask the server first, one
/// extra round trip per borrow (13 per order in `keel serve`). sqlx 0.9.1
/// counts the transaction before it sends `BEGIN`, so a cancelled `begin()`
/// queues its `ROLLBACK`, and the pool's release ping sends it before the
/// session is idle again: the workspace requires that version, and
/// `tests/cancellation.rs` proves the property against a real server.
///
/// What a checkout still checks is that the session is alive, and only for
/// one idle longer than [`PING_AFTER_IDLE`]: a server restart or a broken
/// link closes idle sessions without telling sqlx, and their next borrower
/// would get the I/O error instead of a fresh session. One back from a
/// borrow more recently was pinged by sqlx on its way back (HikariCP skips
/// its validation in the same window).
pub(crate) fn pool_options() -> PgPoolOptions {
    PgPoolOptions::new()
        .after_release(|conn, _meta| Box::pin(answers_after_a_silence(conn)))
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if !outside_a_transaction(conn).await {
                    return Ok(false);
                }
                if meta.idle_for < PING_AFTER_IDLE {
                    return Ok(true);
                }
                // A dead session is closed; the pool opens another.
                Ok(conn.ping().await.is_ok())
            })
        })
}

/// How long after a statement was given up on the connections coming back
/// are checked within the answer bound.
const SILENCE_WATCH: Duration = Duration::from_secs(120);

/// Whether a connection coming back to the pool may be kept, after a
/// statement was given up on lately (`Ok(true)` at once otherwise): it
/// must answer a ping within the answer bound, or it is closed. sqlx's own
/// release check (a ping) has no bound, and a connection the network went
/// silent on would hold its pool slot until the kernel gave up on the
/// socket, minutes later, so that a pool of them would refuse every
/// caller even once the server is reachable again.
async fn answers_after_a_silence(conn: &mut sqlx::PgConnection) -> Result<bool, sqlx::Error> {
    use sqlx::Connection;
    if !keel_sql::dialect::gave_up_within(SILENCE_WATCH) {
        return Ok(true);
    }
    let Some(bound) = <super::PgDialect as keel_sql::Dialect>::answer_bound() else {
        return Ok(true);
    };
    match tokio::time::timeout(bound, conn.ping()).await {
        Ok(answered) => answered.map(|()| true),
        Err(_) => Err(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "a connection given back after a silence did not answer: closed",
        ))),
    }
}

/// Whether `conn` may be handed out: a session that sqlx counts inside a
/// transaction (one begun by hand with its transaction manager and never
/// ended, whatever the reason) is rolled back first, or closed if that
/// fails. Otherwise the next borrower's autocommit writes would answer
/// success inside a transaction that a later rollback discards. sqlx knows
/// the depth without asking the server, so the check costs nothing.
async fn outside_a_transaction(conn: &mut sqlx::PgConnection) -> bool {
    use sqlx::Connection;
    use sqlx_core::transaction::TransactionManager;
    if !conn.is_in_transaction() {
        return true;
    }
    metrics::counter!("keel_postgres_leaked_transactions_total").increment(1);
    tracing::warn!(
        "a pooled PostgreSQL session was inside a transaction nobody owns; rolling it back"
    );
    while conn.is_in_transaction() {
        let rolled_back = sqlx::postgres::PgTransactionManager::rollback(conn).await;
        if rolled_back.is_err() {
            return false;
        }
    }
    true
}

/// How long a session may sit idle before a checkout pings it.
const PING_AFTER_IDLE: Duration = Duration::from_millis(500);

/// Lowercase identifiers only: they need no quoting anywhere (search_path,
/// channel names), and nothing user-supplied reaches SQL text unchecked.
fn validate_schema(schema: &str) -> Result<(), StoreError> {
    let mut chars = schema.chars();
    let valid = schema.len() <= MAX_SCHEMA_LEN
        && chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if valid {
        Ok(())
    } else {
        Err(StoreError::other(InvalidSchema(schema.to_owned())))
    }
}

/// Creates the schema and runs the migrations. Processes starting at the
/// same moment race on `CREATE SCHEMA IF NOT EXISTS` (a unique violation in
/// the catalog); the loser tries again and finds the schema. sqlx holds an
/// advisory lock while migrating, so migrations themselves never race.
/// Connecting waits no longer than the pool's `acquire_timeout` (a server
/// that drops packets would otherwise hold the start for minutes); the
/// migrations themselves are not bounded.
async fn migrate(
    options: &PgConnectOptions,
    connect_within: Duration,
    schema: &str,
) -> Result<(), StoreError> {
    let create = format!("CREATE SCHEMA IF NOT EXISTS {schema}");
    let migrator = PgStore::migrator();
    let mut attempt = 0;
    loop {
        attempt += 1;
        let result = async {
            let mut conn =
                tokio::time::timeout(connect_within, PgConnection::connect_with(options))
                    .await
                    .map_err(|_| {
                        sqlx::Error::Io(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!("no connection for the migrations within {connect_within:?}"),
                        ))
                    })??;
            sqlx::query(sqlx::AssertSqlSafe(create.as_str()))
                .execute(&mut conn)
                .await?;
            let migrated = migrator.run(&mut conn).await;
            let _ = conn.close().await;
            migrated
        }
        .await;
        match result {
            Ok(()) => return Ok(()),
            Err(err) if attempt < 3 => {
                tracing::debug!(error = %err, attempt, "postgres store migration failed, retrying");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(MigrateError::Execute(err)) => return Err(db_error(err)),
            Err(err) => return Err(StoreError::other(err)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_plain_identifiers() {
        for ok in ["keel", "keel_t_0190f5c46a1e", "_x", "a1"] {
            assert!(validate_schema(ok).is_ok(), "{ok}");
        }
        for bad in ["", "Keel", "1x", "a-b", "a;drop", "a b", &"x".repeat(49)] {
            assert!(validate_schema(bad).is_err(), "{bad}");
        }
    }

    /// A server that takes the connection and never answers (a black hole
    /// past the TCP handshake) fails the open within the acquire timeout,
    /// three attempts included, instead of holding the start.
    #[tokio::test]
    async fn a_server_that_never_answers_fails_the_open_in_bounded_time() {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let url = format!(
            "postgres://keel@{}/keel",
            silent.local_addr().expect("addr")
        );
        let started = keel_core::clock::now();
        let opened = PgStoreOptions::new()
            .acquire_timeout(Duration::from_millis(200))
            .open(&url)
            .await;
        assert!(
            matches!(opened, Err(StoreError::Unavailable(_))),
            "{opened:?}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "failed after {:?}",
            started.elapsed()
        );
    }

    #[test]
    fn connect_options_carry_the_search_path() {
        let builder = PgStoreOptions::new().schema("k1");
        let options = builder
            .connect_options("postgres://keel@127.0.0.1:5432/keel")
            .expect("options");
        assert_eq!(options.get_database(), Some("keel"));
        assert!(format!("{options:?}").contains("search_path=k1,public"));
    }
}
