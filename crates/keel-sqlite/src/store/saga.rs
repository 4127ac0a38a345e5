//! Saga instances on SQLite, saved with optimistic concurrency.
//!
//! A save is one `UPDATE ... WHERE id = ? AND version = ?`: if another
//! worker saved first, no row matches and the caller learns it lost, without
//! locks held across steps.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use keel_messaging::StoreError;
use keel_messaging::store::{SagaFilter, SagaRecord, SagaStatus, SagaStore, Store};
use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use super::SqliteStore;
use super::codec::{from_ms, to_ms};
use super::error::{corrupt, db_error, sql_limit, to_u64};

/// The default of [`SagaFilter::limit`].
const DEFAULT_LIMIT: usize = 100;

const COLUMNS: &str = "id, kind, status, step, data, attempts, last_error, \
                       next_attempt_at, created_at, updated_at, version, \
                       outcome_unknown, first_attempt_at";

const INSERT_SQL: &str = "\
INSERT INTO keel_sagas (id, kind, status, step, data, attempts, last_error,
                        next_attempt_at, created_at, updated_at, version,
                        outcome_unknown, first_attempt_at)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13)
ON CONFLICT (id) DO NOTHING";

/// Everything but `id` and `created_at`, if the stored version is `?10`.
const SAVE_SQL: &str = "\
UPDATE keel_sagas
   SET kind = ?2, status = ?3, step = ?4, data = ?5, attempts = ?6, last_error = ?7,
       next_attempt_at = ?8, updated_at = ?9, version = ?11,
       outcome_unknown = ?12, first_attempt_at = ?13
 WHERE id = ?1 AND version = ?10";

/// Not terminal and due. The `status IN (...)` term repeats the partial
/// index's WHERE clause word for word, which is how SQLite knows it may use
/// it; `INDEXED BY` makes it (without statistics the planner prefers the
/// status index and sorts, which grows with the number of unfinished sagas).
pub(super) const DUE_SQL: &str = "\
SELECT id, kind, status, step, data, attempts, last_error,
       next_attempt_at, created_at, updated_at, version,
       outcome_unknown, first_attempt_at
  FROM keel_sagas INDEXED BY keel_sagas_due
 WHERE status IN ('running', 'compensating', 'stuck') AND next_attempt_at <= ?1
 ORDER BY next_attempt_at, created_at, id
 LIMIT ?2";

const COUNTS_SQL: &str = "SELECT status, COUNT(*) FROM keel_sagas GROUP BY status ORDER BY status";

#[async_trait]
impl SagaStore for SqliteStore {
    async fn saga_insert(
        &self,
        tx: &mut <Self as Store>::Tx,
        saga: &SagaRecord,
    ) -> Result<bool, StoreError> {
        let data = serde_json::to_string(&saga.data).map_err(StoreError::other)?;
        let done = sqlx::query(INSERT_SQL)
            .bind(saga.id.as_str())
            .bind(saga.kind.as_str())
            .bind(saga.status.as_str())
            .bind(i64::from(saga.step))
            .bind(data)
            .bind(i64::from(saga.attempts))
            .bind(saga.last_error.as_deref())
            .bind(to_ms(saga.next_attempt_at))
            .bind(to_ms(saga.created_at))
            .bind(to_ms(saga.updated_at))
            .bind(saga.version)
            .bind(saga.outcome_unknown)
            .bind(saga.first_attempt_at.map(to_ms))
            .execute(&mut **tx)
            .await
            .map_err(db_error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn saga_get(&self, id: &str) -> Result<Option<SagaRecord>, StoreError> {
        let sql = format!("SELECT {COLUMNS} FROM keel_sagas WHERE id = ?1");
        let row = sqlx::query(&sql)
            .bind(id)
            .fetch_optional(&self.reader)
            .await
            .map_err(db_error)?;
        row.as_ref().map(saga_from_row).transpose()
    }

    async fn saga_save(&self, saga: &SagaRecord) -> Result<bool, StoreError> {
        let data = serde_json::to_string(&saga.data).map_err(StoreError::other)?;
        let done = sqlx::query(SAVE_SQL)
            .bind(saga.id.as_str())
            .bind(saga.kind.as_str())
            .bind(saga.status.as_str())
            .bind(i64::from(saga.step))
            .bind(data)
            .bind(i64::from(saga.attempts))
            .bind(saga.last_error.as_deref())
            .bind(to_ms(saga.next_attempt_at))
            .bind(to_ms(saga.updated_at))
            .bind(saga.version.saturating_sub(1))
            .bind(saga.version)
            .bind(saga.outcome_unknown)
            .bind(saga.first_attempt_at.map(to_ms))
            .execute(&self.writer)
            .await
            .map_err(db_error)?;
        if done.rows_affected() == 1 {
            return Ok(true);
        }
        // Lost the race, or there was nothing to save.
        let exists: Option<i64> = sqlx::query_scalar("SELECT 1 FROM keel_sagas WHERE id = ?1")
            .bind(saga.id.as_str())
            .fetch_optional(&self.writer)
            .await
            .map_err(db_error)?;
        match exists {
            Some(_) => Ok(false),
            None => Err(StoreError::NotFound(format!("saga {}", saga.id))),
        }
    }

    async fn saga_due(
        &self,
        now: DateTime<Utc>,
        limit: usize,
    ) -> Result<Vec<SagaRecord>, StoreError> {
        if limit == 0 {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(DUE_SQL)
            .bind(to_ms(now))
            .bind(sql_limit(limit))
            .fetch_all(&self.reader)
            .await
            .map_err(db_error)?;
        rows.iter().map(saga_from_row).collect()
    }

    async fn saga_list(&self, filter: &SagaFilter) -> Result<Vec<SagaRecord>, StoreError> {
        let sql = list_sql(filter);
        let mut query = sqlx::query(&sql);
        if let Some(status) = filter.status {
            query = query.bind(status.as_str());
        }
        if let Some(before) = filter.updated_before {
            query = query.bind(to_ms(before));
        }
        let limit = filter.limit.unwrap_or(DEFAULT_LIMIT);
        let rows = query
            .bind(sql_limit(limit))
            .fetch_all(&self.reader)
            .await
            .map_err(db_error)?;
        rows.iter().map(saga_from_row).collect()
    }

    async fn saga_counts(&self) -> Result<Vec<(SagaStatus, u64)>, StoreError> {
        let rows: Vec<(String, i64)> = sqlx::query_as(COUNTS_SQL)
            .fetch_all(&self.reader)
            .await
            .map_err(db_error)?;
        rows.into_iter()
            .map(|(status, n)| {
                let parsed =
                    SagaStatus::parse(&status).ok_or_else(|| corrupt("saga status", &status))?;
                Ok((parsed, to_u64("saga count", n)?))
            })
            .collect()
    }
}

/// The list query with only the conditions the filter sets.
fn list_sql(filter: &SagaFilter) -> String {
    let mut conditions = Vec::new();
    if filter.status.is_some() {
        conditions.push("status = ?");
    }
    if filter.updated_before.is_some() {
        conditions.push("updated_at < ?");
    }
    let conditions = if conditions.is_empty() {
        String::new()
    } else {
        format!("WHERE {}", conditions.join(" AND "))
    };
    format!("SELECT {COLUMNS} FROM keel_sagas {conditions} ORDER BY updated_at, id LIMIT ?")
}

fn saga_from_row(row: &SqliteRow) -> Result<SagaRecord, StoreError> {
    let status: String = row.try_get("status").map_err(db_error)?;
    let data: String = row.try_get("data").map_err(db_error)?;
    let step: i64 = row.try_get("step").map_err(db_error)?;
    let attempts: i64 = row.try_get("attempts").map_err(db_error)?;
    Ok(SagaRecord {
        id: row.try_get("id").map_err(db_error)?,
        kind: row.try_get("kind").map_err(db_error)?,
        status: SagaStatus::parse(&status).ok_or_else(|| corrupt("saga status", &status))?,
        step: u32::try_from(step).map_err(|e| corrupt("saga step", e))?,
        data: serde_json::from_str(&data).map_err(|e| corrupt("saga data", e))?,
        attempts: u32::try_from(attempts).map_err(|e| corrupt("saga attempts", e))?,
        last_error: row.try_get("last_error").map_err(db_error)?,
        next_attempt_at: from_ms(row.try_get("next_attempt_at").map_err(db_error)?)?,
        created_at: from_ms(row.try_get("created_at").map_err(db_error)?)?,
        updated_at: from_ms(row.try_get("updated_at").map_err(db_error)?)?,
        version: row.try_get("version").map_err(db_error)?,
        outcome_unknown: row.try_get("outcome_unknown").map_err(db_error)?,
        first_attempt_at: row
            .try_get::<Option<i64>, _>("first_attempt_at")
            .map_err(db_error)?
            .map(from_ms)
            .transpose()?,
    })
}
