//! SQLite as the shared SQL core sees it: instants as Unix milliseconds,
//! documents as JSON text, index hints where the planner needs them, and no
//! retries of its own (a `BUSY` comes after the busy timeout already
//! waited).

use chrono::{DateTime, Utc};
use keel_sql::{Dialect, Exec, Field, SqlBackend, SqlRow, Value};
use keel_store::AttemptError;
use keel_store::StoreError;
use serde::{Deserialize, Serialize};
use sqlx::Row;
use sqlx::sqlite::{Sqlite, SqliteRow};

use super::SqliteStore;
use super::codec::{from_ms, to_ms};
use super::error::{corrupt, db_error};

/// SQLite's dialect of the shared SQL core.
#[derive(Debug, Clone, Copy, Default)]
pub struct SqliteDialect;

impl Dialect for SqliteDialect {
    type Db = Sqlite;
    type Row = SqliteRow;
    type JsonInstant = i64;

    const NAME: &'static str = "SQLite";
    const FOR_UPDATE: &'static str = "";

    fn indexed_by(index: &str) -> String {
        format!("INDEXED BY {index}")
    }

    fn now() -> DateTime<Utc> {
        let now = keel_core::clock::utc_now();
        DateTime::from_timestamp_millis(now.timestamp_millis()).unwrap_or(now)
    }

    fn any_of(column: &str, ids: &str) -> String {
        format!("{column} IN (SELECT value FROM json_each({ids}))")
    }

    fn json_records(param: &str, alias: &str, fields: &[(&str, Field)]) -> String {
        let columns: Vec<String> = fields
            .iter()
            .map(|(name, _)| format!("json_extract(value, '$.{name}') AS {name}"))
            .collect();
        format!(
            "(SELECT {} FROM json_each({param})) AS {alias}",
            columns.join(", ")
        )
    }

    fn json_instant(at: DateTime<Utc>) -> i64 {
        to_ms(at)
    }

    fn from_json_instant(ms: i64) -> Result<DateTime<Utc>, StoreError> {
        from_ms(ms)
    }

    fn error(err: sqlx::Error) -> StoreError {
        db_error(err)
    }

    fn retries(_: &StoreError) -> bool {
        false
    }

    keel_sql::sqlx_execution!(
        Sqlite,
        SqliteRow,
        json: |json: &'a str| json,
        time: |at: Option<DateTime<Utc>>| at.map(to_ms),
        ids: |ids: &[i64]| serde_json::Value::from(ids.to_vec()).to_string(),
        texts: |texts: &[&str]| serde_json::Value::from(texts.to_vec()).to_string(),
    );

    fn attempts_to_json(attempts: &[AttemptError]) -> Result<String, StoreError> {
        let stored: Vec<StoredAttempt> = attempts
            .iter()
            .map(|a| StoredAttempt {
                attempt: a.attempt,
                error: a.error.clone(),
                at_ms: to_ms(a.at),
            })
            .collect();
        serde_json::to_string(&stored).map_err(StoreError::other)
    }

    fn attempts_from_json(json: &str) -> Result<Vec<AttemptError>, StoreError> {
        let stored: Vec<StoredAttempt> =
            serde_json::from_str(json).map_err(|e| corrupt("attempt history", e))?;
        stored
            .into_iter()
            .map(|a| {
                Ok(AttemptError {
                    attempt: a.attempt,
                    error: a.error,
                    at: from_ms(a.at_ms)?,
                })
            })
            .collect()
    }
}

/// One attempt as stored in a dead letter's JSON history (instants in the
/// store's own Unix milliseconds).
#[derive(Serialize, Deserialize)]
struct StoredAttempt {
    attempt: u32,
    error: String,
    at_ms: i64,
}

impl SqlRow<SqliteDialect> for SqliteRow {
    fn text_opt(&self, column: &str) -> Result<Option<String>, StoreError> {
        self.try_get(column).map_err(db_error)
    }

    fn int_opt(&self, column: &str) -> Result<Option<i64>, StoreError> {
        self.try_get(column).map_err(db_error)
    }

    fn flag(&self, column: &str) -> Result<bool, StoreError> {
        self.try_get(column).map_err(db_error)
    }

    fn bytes_opt(&self, column: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.try_get(column).map_err(db_error)
    }

    fn json_opt(&self, column: &str) -> Result<Option<String>, StoreError> {
        self.try_get(column).map_err(db_error)
    }

    fn time_opt(&self, column: &str) -> Result<Option<DateTime<Utc>>, StoreError> {
        let ms: Option<i64> = self.try_get(column).map_err(db_error)?;
        ms.map(from_ms).transpose()
    }
}

impl SqlBackend for SqliteStore {
    type Dialect = SqliteDialect;
    type Tx = super::WriteTx;

    async fn begin_own(&self) -> Result<super::WriteTx, StoreError> {
        self.group.begin().await
    }

    async fn commit_own(&self, tx: super::WriteTx) -> Result<(), StoreError> {
        self.group.commit(tx).await
    }

    async fn rollback_own(&self, tx: super::WriteTx) -> Result<(), StoreError> {
        self.group.rollback(tx).await
    }

    /// In a logical transaction of its own, so that it folds into the
    /// writer's batch instead of waiting for it, and without a savepoint:
    /// SQLite applies or undoes one statement as a whole.
    async fn write<'a>(&'a self, sql: &'a str, params: &'a [Value<'a>]) -> Result<u64, StoreError> {
        let mut tx = self.group.begin_statement().await?;
        let changed = SqliteDialect::execute(Exec::Tx(&mut tx), sql, params).await?;
        self.group.commit(tx).await?;
        Ok(changed)
    }

    /// Like [`write`](SqlBackend::write): a statement on the writer pool
    /// outside the batch would wait for the batch's `COMMIT` and then pay
    /// an fsync of its own.
    async fn write_optional<'a>(
        &'a self,
        sql: &'a str,
        params: &'a [Value<'a>],
    ) -> Result<Option<SqliteRow>, StoreError> {
        let mut tx = self.group.begin_statement().await?;
        let row = SqliteDialect::fetch_optional(Exec::Tx(&mut tx), sql, params).await?;
        self.group.commit(tx).await?;
        Ok(row)
    }

    fn writer(&self) -> &sqlx::SqlitePool {
        &self.writer
    }

    fn reader(&self) -> &sqlx::SqlitePool {
        &self.reader
    }
}

#[cfg(feature = "event-log")]
keel_sql::event_log_store!(SqliteStore);
keel_sql::dead_letter_store!(SqliteStore);
keel_sql::fence_store!(SqliteStore);
keel_sql::lease_store!(SqliteStore);
keel_sql::entity_version_store!(SqliteStore);
#[cfg(feature = "idempotency")]
keel_sql::idempotency_store!(SqliteStore);
keel_sql::inbox_store!(SqliteStore);
keel_sql::outbox_store!(SqliteStore);
#[cfg(feature = "jobs")]
keel_sql::job_store!(SqliteStore);
keel_sql::saga_store!(SqliteStore);
