//! What the shared SQL needs to know about one database.
//!
//! The core never names a database type. It binds parameters as one of a
//! handful of [`Value`] kinds, reads columns through [`SqlRow`], and runs
//! statements through [`Dialect::execute`] and its siblings. A dialect is
//! therefore small and concrete: it binds each kind the way its database
//! stores it, reads it back, and classifies its errors. Keeping the generic
//! surface this narrow is what keeps sqlx's long trait bounds out of every
//! function of the core.

use std::future::Future;
use std::ops::DerefMut;
use std::sync::atomic::{AtomicU64, Ordering};

use chrono::{DateTime, Utc};
use keel_store::AttemptError;
use keel_store::StoreError;

use crate::error::corrupt;

/// One parameter of a statement, in the kinds Keel stores.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Value<'a> {
    /// Text, or `NULL`.
    Text(Option<&'a str>),
    /// A 64-bit integer, or `NULL` (PostgreSQL casts it to a narrower
    /// column on assignment).
    Int(Option<i64>),
    /// A boolean (SQLite stores 0 or 1).
    Bool(bool),
    /// Bytes.
    Bytes(&'a [u8]),
    /// A JSON document, already serialized (`TEXT` on SQLite, `JSONB` on
    /// PostgreSQL).
    Json(&'a str),
    /// An instant, or `NULL` (Unix milliseconds on SQLite, `TIMESTAMPTZ` on
    /// PostgreSQL).
    Time(Option<DateTime<Utc>>),
    /// A list of row ids, for [`Dialect::any_of`] (a JSON array on SQLite,
    /// a `BIGINT[]` on PostgreSQL): one statement for any number of ids.
    Ids(&'a [i64]),
    /// A list of text keys, for [`Dialect::any_of`] (a JSON array on
    /// SQLite, a `TEXT[]` on PostgreSQL).
    Texts(&'a [&'a str]),
}

/// The SQL type of a field of [`Dialect::json_records`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    /// An integer.
    Int,
    /// Text.
    Text,
    /// A nested JSON document.
    Json,
    /// An instant, written as [`Dialect::JsonInstant`].
    Time,
}

impl<'a> From<&'a str> for Value<'a> {
    fn from(value: &'a str) -> Self {
        Self::Text(Some(value))
    }
}

impl<'a> From<Option<&'a str>> for Value<'a> {
    fn from(value: Option<&'a str>) -> Self {
        Self::Text(value)
    }
}

impl From<i64> for Value<'_> {
    fn from(value: i64) -> Self {
        Self::Int(Some(value))
    }
}

impl From<Option<i64>> for Value<'_> {
    fn from(value: Option<i64>) -> Self {
        Self::Int(value)
    }
}

impl From<bool> for Value<'_> {
    fn from(value: bool) -> Self {
        Self::Bool(value)
    }
}

impl<'a> From<&'a [u8]> for Value<'a> {
    fn from(value: &'a [u8]) -> Self {
        Self::Bytes(value)
    }
}

impl From<DateTime<Utc>> for Value<'_> {
    fn from(value: DateTime<Utc>) -> Self {
        Self::Time(Some(value))
    }
}

impl From<Option<DateTime<Utc>>> for Value<'_> {
    fn from(value: Option<DateTime<Utc>>) -> Self {
        Self::Time(value)
    }
}

/// Where a statement runs: a pool (autocommit) or a transaction.
pub enum Exec<'a, D: Dialect> {
    /// A connection from the pool, in autocommit mode.
    Pool(&'a sqlx::Pool<D::Db>),
    /// The caller's transaction (the user's, for the outbox and inbox): any
    /// handle that lends the connection it runs on.
    Tx(&'a mut (dyn DerefMut<Target = <D::Db as sqlx::Database>::Connection> + Send + 'static)),
}

/// A row as the core reads it: each getter names the column and says what
/// kind of value it holds. A value of the wrong kind is an error, never a
/// panic. (The dialect is a parameter so that a backend crate may implement
/// it for its database's row type.)
pub trait SqlRow<D>: Send + Sync + 'static {
    /// A `TEXT` column, possibly `NULL`.
    fn text_opt(&self, column: &str) -> Result<Option<String>, StoreError>;
    /// An integer column of any width, possibly `NULL`.
    fn int_opt(&self, column: &str) -> Result<Option<i64>, StoreError>;
    /// A boolean column.
    fn flag(&self, column: &str) -> Result<bool, StoreError>;
    /// A bytes column, possibly `NULL`.
    fn bytes_opt(&self, column: &str) -> Result<Option<Vec<u8>>, StoreError>;
    /// A JSON document column, as text, possibly `NULL`.
    fn json_opt(&self, column: &str) -> Result<Option<String>, StoreError>;
    /// An instant column, possibly `NULL`.
    fn time_opt(&self, column: &str) -> Result<Option<DateTime<Utc>>, StoreError>;

    /// A `TEXT` column that may not be `NULL`.
    fn text(&self, column: &str) -> Result<String, StoreError> {
        self.text_opt(column)?
            .ok_or_else(|| corrupt("SQL", "column", format!("{column} is unexpectedly NULL")))
    }

    /// An integer column that may not be `NULL`.
    fn int(&self, column: &str) -> Result<i64, StoreError> {
        self.int_opt(column)?
            .ok_or_else(|| corrupt("SQL", "column", format!("{column} is unexpectedly NULL")))
    }

    /// A bytes column that may not be `NULL`.
    fn bytes(&self, column: &str) -> Result<Vec<u8>, StoreError> {
        self.bytes_opt(column)?
            .ok_or_else(|| corrupt("SQL", "column", format!("{column} is unexpectedly NULL")))
    }

    /// A JSON document column that may not be `NULL`, as text.
    fn json(&self, column: &str) -> Result<String, StoreError> {
        self.json_opt(column)?
            .ok_or_else(|| corrupt("SQL", "column", format!("{column} is unexpectedly NULL")))
    }

    /// An instant column that may not be `NULL`.
    fn time(&self, column: &str) -> Result<DateTime<Utc>, StoreError> {
        self.time_opt(column)?
            .ok_or_else(|| corrupt("SQL", "column", format!("{column} is unexpectedly NULL")))
    }
}

/// One SQL database, as the core needs to know it.
///
/// Statements are written once in the core with numbered placeholders
/// (`$1`, `$2`, ...), which both SQLite and PostgreSQL accept. Where the SQL
/// text really differs, it differs by a clause, and the dialect supplies
/// the clause: [`Dialect::skip_locked`], [`Dialect::indexed_by`],
/// [`Dialect::signalling`].
pub trait Dialect: Send + Sync + Sized + 'static {
    /// The sqlx database.
    type Db: sqlx::Database;
    /// Its rows.
    type Row: SqlRow<Self>;
    /// How an instant is written inside a JSON document the database reads
    /// or stores (a batch's times, a secret's expiry): the same codec as
    /// its columns.
    type JsonInstant: serde::Serialize + serde::de::DeserializeOwned + Send + Sync;

    /// The database's name, for messages ("SQLite", "PostgreSQL").
    const NAME: &'static str;

    /// What ends a `SELECT` of rows about to be changed so that concurrent
    /// writers skip each other's rows instead of waiting (PostgreSQL's
    /// `FOR UPDATE [OF <of>] SKIP LOCKED`, `of` naming the one table of a
    /// join whose rows are locked); empty where one writer at a time is the
    /// rule (SQLite).
    fn skip_locked(of: Option<&str>) -> String {
        let _ = of;
        String::new()
    }

    /// The hint that makes a `FROM <table>` use `index` (SQLite's
    /// `INDEXED BY`, for queries its planner gets wrong without statistics);
    /// empty where the planner needs none.
    fn indexed_by(index: &str) -> String {
        let _ = index;
        String::new()
    }

    /// What ends a `SELECT` that decides a write in the same transaction, so
    /// that no one else changes the row meanwhile (`FOR UPDATE`); empty
    /// where the transaction already holds the database's only write lock
    /// (SQLite's `BEGIN IMMEDIATE`).
    const FOR_UPDATE: &'static str;

    /// The condition "`column` is one of the ids bound at `ids`" (a
    /// [`Value::Ids`] or [`Value::Texts`] placeholder).
    fn any_of(column: &str, ids: &str) -> String;

    /// A table expression named `alias` with one row per element of the
    /// JSON array of objects bound at `param` (a [`Value::Json`]
    /// placeholder) and one column per field: how one statement writes a
    /// whole batch (SQLite's `json_each`, PostgreSQL's
    /// `jsonb_to_recordset`).
    fn json_records(param: &str, alias: &str, fields: &[(&str, Field)]) -> String;

    /// An instant as [`Dialect::JsonInstant`].
    fn json_instant(at: DateTime<Utc>) -> Self::JsonInstant;

    /// An instant from [`Dialect::JsonInstant`].
    fn from_json_instant(value: Self::JsonInstant) -> Result<DateTime<Utc>, StoreError>;

    /// `statement` (a write ending in `RETURNING ...`) extended to wake the
    /// listeners of the channel bound at `channel` (a placeholder) when it
    /// changed a row, delivered when (and only if) it commits; it still
    /// returns the same columns. The default leaves it unchanged, for
    /// backends whose wake-ups are in-process.
    fn signalling(statement: &str, channel: &str) -> String {
        let _ = channel;
        statement.to_owned()
    }

    /// Now, truncated to the precision the database stores, so that a value
    /// read back compares equal to the one written.
    fn now() -> DateTime<Utc>;

    /// Maps an error of an ordinary statement to the store's error classes:
    /// what is transient becomes [`StoreError::Unavailable`], a unique
    /// violation [`StoreError::Conflict`].
    fn error(err: sqlx::Error) -> StoreError;

    /// Maps the error of a write sent in autocommit, outside a transaction
    /// ([`SqlBackend::write`](crate::SqlBackend::write)), once
    /// [`error`](Self::error) mapped it. Such a statement commits by
    /// itself, so a connection lost after it was sent leaves it committed
    /// or not, exactly as a lost `COMMIT` does: a dialect that can tell
    /// that from the error says [`StoreError::OutcomeUnknown`] where
    /// `error` said "unavailable, nothing committed". By default, `err`.
    fn autocommit_write_error(err: StoreError) -> StoreError {
        err
    }

    /// How long a statement may go without an answer before the store gives
    /// up on it ([`within_answer_bound`]). A network that drops every byte
    /// and says nothing leaves a socket waiting for minutes (TCP's
    /// retransmissions), and a server-side timeout never fires for a
    /// statement the server never received. `None` (the default): as long
    /// as the connection waits.
    fn answer_bound() -> Option<std::time::Duration> {
        None
    }

    /// Whether the store may run one of its *own* statements again after
    /// `err` (a serialization failure or a deadlock, after which nothing was
    /// written). A user's transaction is never re-run by the store.
    fn retries(err: &StoreError) -> bool;

    /// Runs `sql` and returns how many rows it changed.
    fn execute<'a>(
        on: Exec<'a, Self>,
        sql: &'a str,
        params: &'a [Value<'a>],
    ) -> impl Future<Output = Result<u64, StoreError>> + Send + 'a;

    /// Runs `sql` and returns every row.
    fn fetch_all<'a>(
        on: Exec<'a, Self>,
        sql: &'a str,
        params: &'a [Value<'a>],
    ) -> impl Future<Output = Result<Vec<Self::Row>, StoreError>> + Send + 'a;

    /// Runs `sql` and returns its first row, if any.
    fn fetch_optional<'a>(
        on: Exec<'a, Self>,
        sql: &'a str,
        params: &'a [Value<'a>],
    ) -> impl Future<Output = Result<Option<Self::Row>, StoreError>> + Send + 'a;

    /// A dead letter's error history as the JSON it stores (by default each
    /// [`AttemptError`] as serde writes it).
    fn attempts_to_json(attempts: &[AttemptError]) -> Result<String, StoreError> {
        serde_json::to_string(attempts).map_err(StoreError::other)
    }

    /// A dead letter's error history from its stored JSON.
    fn attempts_from_json(json: &str) -> Result<Vec<AttemptError>, StoreError> {
        serde_json::from_str(json).map_err(|e| corrupt(Self::NAME, "attempt history", e))
    }
}

/// When a statement was last given up on ([`within_answer_bound`]), in
/// Unix milliseconds; 0 for never.
static LAST_GAVE_UP_MS: AtomicU64 = AtomicU64::new(0);

/// Whether a statement was given up on within `window`: a pool then checks
/// the connections it gets back within a bound (one given up on may still
/// be waiting for its answer, and an unbounded check would hold its slot
/// until the kernel gives up on the socket).
pub fn gave_up_within(window: std::time::Duration) -> bool {
    let last = LAST_GAVE_UP_MS.load(Ordering::Relaxed);
    last != 0
        && unix_ms().saturating_sub(last) <= u64::try_from(window.as_millis()).unwrap_or(u64::MAX)
}

fn unix_ms() -> u64 {
    let since = keel_core::clock::utc_now().timestamp_millis();
    u64::try_from(since).unwrap_or(0)
}

/// Awaits `answer`, a statement's (or a `BEGIN`'s, a `COMMIT`'s), for at
/// most `D`'s [`Dialect::answer_bound`]; past it, an I/O error (timed
/// out) in its place, which the dialect's error mapping reads as any
/// connection lost with no answer: nothing committed inside a
/// transaction, outcome unknown for a `COMMIT` or an autocommit write.
///
/// The abandoned statement's connection is not reused until it answers:
/// sqlx tests it when it goes back to the pool, and a backend should bound
/// that test while [`gave_up_within`] says a statement was given up on
/// (keel-postgres closes a connection that does not answer in time).
pub async fn within_answer_bound<D: Dialect, T>(
    answer: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, sqlx::Error> {
    let Some(bound) = D::answer_bound() else {
        return answer.await;
    };
    match tokio::time::timeout(bound, answer).await {
        Ok(answered) => answered,
        Err(_) => {
            LAST_GAVE_UP_MS.store(unix_ms(), Ordering::Relaxed);
            tracing::warn!(
                database = D::NAME,
                ?bound,
                "no answer from the database within the bound; giving up on the connection"
            );
            Err(sqlx::Error::Io(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!(
                    "no answer from {} within {bound:?}: the connection went silent",
                    D::NAME
                ),
            )))
        }
    }
}

/// Writes a dialect's [`Dialect::execute`], [`Dialect::fetch_all`] and
/// [`Dialect::fetch_optional`] on sqlx: given the database and row types,
/// and how the kinds that differ between databases are bound (`json`,
/// `time`, `ids`, `texts`, each a closure from the [`Value`]'s content to
/// something sqlx binds). The other kinds bind as themselves. (A macro
/// rather than default methods: generic code over `D::Db` would need
/// sqlx's executor bounds at every call site of the core.)
#[macro_export]
macro_rules! sqlx_execution {
    ($db:ty, $row:ty, json: $json:expr, time: $time:expr, ids: $ids:expr, texts: $texts:expr $(,)?) => {
        fn execute<'a>(
            on: $crate::Exec<'a, Self>,
            sql: &'a str,
            params: &'a [$crate::Value<'a>],
        ) -> impl ::std::future::Future<
            Output = ::std::result::Result<u64, $crate::__private::StoreError>,
        > + Send
        + 'a {
            async move {
                let query = $crate::sqlx_execution!(@bind $db, sql, params, $json, $time, $ids, $texts);
                let done = $crate::dialect::within_answer_bound::<Self, _>(async {
                    match on {
                        $crate::Exec::Pool(pool) => query.execute(pool).await,
                        $crate::Exec::Tx(tx) => query.execute(&mut **tx).await,
                    }
                })
                .await;
                Ok(done.map_err(<Self as $crate::Dialect>::error)?.rows_affected())
            }
        }

        fn fetch_all<'a>(
            on: $crate::Exec<'a, Self>,
            sql: &'a str,
            params: &'a [$crate::Value<'a>],
        ) -> impl ::std::future::Future<
            Output = ::std::result::Result<::std::vec::Vec<$row>, $crate::__private::StoreError>,
        > + Send
        + 'a {
            async move {
                let query = $crate::sqlx_execution!(@bind $db, sql, params, $json, $time, $ids, $texts);
                $crate::dialect::within_answer_bound::<Self, _>(async {
                    match on {
                        $crate::Exec::Pool(pool) => query.fetch_all(pool).await,
                        $crate::Exec::Tx(tx) => query.fetch_all(&mut **tx).await,
                    }
                })
                .await
                .map_err(<Self as $crate::Dialect>::error)
            }
        }

        fn fetch_optional<'a>(
            on: $crate::Exec<'a, Self>,
            sql: &'a str,
            params: &'a [$crate::Value<'a>],
        ) -> impl ::std::future::Future<
            Output = ::std::result::Result<
                ::std::option::Option<$row>,
                $crate::__private::StoreError,
            >,
        > + Send
        + 'a {
            async move {
                let query = $crate::sqlx_execution!(@bind $db, sql, params, $json, $time, $ids, $texts);
                $crate::dialect::within_answer_bound::<Self, _>(async {
                    match on {
                        $crate::Exec::Pool(pool) => query.fetch_optional(pool).await,
                        $crate::Exec::Tx(tx) => query.fetch_optional(&mut **tx).await,
                    }
                })
                .await
                .map_err(<Self as $crate::Dialect>::error)
            }
        }
    };
    (@bind $db:ty, $sql:ident, $params:ident, $json:expr, $time:expr, $ids:expr, $texts:expr) => {{
        let mut query = ::sqlx::query::<$db>(::sqlx::AssertSqlSafe($sql));
        for param in $params {
            query = match *param {
                $crate::Value::Text(text) => query.bind(text),
                $crate::Value::Int(int) => query.bind(int),
                $crate::Value::Bool(flag) => query.bind(flag),
                $crate::Value::Bytes(bytes) => query.bind(bytes),
                $crate::Value::Json(json) => query.bind(($json)(json)),
                $crate::Value::Time(at) => query.bind(($time)(at)),
                $crate::Value::Ids(ids) => query.bind(($ids)(ids)),
                $crate::Value::Texts(texts) => query.bind(($texts)(texts)),
            };
        }
        query
    }};
}
