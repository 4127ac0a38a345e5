//! Saga instances, saved with optimistic concurrency.
//!
//! A save is one `UPDATE ... WHERE id = $1 AND version = $10`: if another
//! worker saved first, no row matches and the caller learns it lost, without
//! locks held across steps. Where workers live in several processes, inserts
//! and saves also wake them ([`SqlBackend::wake_channel`]), so a new or
//! rescheduled saga is picked up at once.

use chrono::{DateTime, Utc};
use keel_store::StoreError;
use keel_store::{SagaFilter, SagaRecord, SagaStatus};

use crate::backend::{SqlBackend, Tx, Wake, refused_or_missing, signalled};
use crate::dialect::{Dialect, Exec, SqlRow, Value};
use crate::error::{corrupt, sql_limit, to_u32, to_u64};
use crate::filter::Filter;
use crate::retry::retry;

/// The default of [`SagaFilter::limit`].
const DEFAULT_LIMIT: usize = 100;

const COLUMNS: &str = "id, kind, status, step, data, attempts, last_error, \
                       next_attempt_at, created_at, updated_at, version, \
                       outcome_unknown, first_attempt_at, traceparent";

/// Inserts unless the id exists.
const INSERT_SQL: &str = "\
INSERT INTO keel_sagas (id, kind, status, step, data, attempts, last_error,
                        next_attempt_at, created_at, updated_at, version,
                        outcome_unknown, first_attempt_at, traceparent)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)
ON CONFLICT (id) DO NOTHING
RETURNING id";

/// Everything but `id` and `created_at`, if the stored version is `$10`.
const SAVE_SQL: &str = "\
UPDATE keel_sagas
   SET kind = $2, status = $3, step = $4, data = $5, attempts = $6, last_error = $7,
       next_attempt_at = $8, updated_at = $9, version = $11,
       outcome_unknown = $12, first_attempt_at = $13, traceparent = $14
 WHERE id = $1 AND version = $10
RETURNING id";

const COUNTS_SQL: &str =
    "SELECT status, COUNT(*) AS n FROM keel_sagas GROUP BY status ORDER BY status";

/// Not terminal and due. The `status IN (...)` term repeats the partial
/// index's predicate word for word, which is how SQLite knows it may use
/// it; the dialect's hint makes it (without statistics SQLite's planner
/// prefers the status index and sorts, which grows with the number of
/// unfinished sagas).
pub fn due_sql<D: Dialect>(kinds: usize) -> String {
    let kinds = (3..3 + kinds)
        .map(|n| format!("${n}"))
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "SELECT {COLUMNS} FROM keel_sagas {}
          WHERE status IN ('running', 'compensating', 'stuck') AND next_attempt_at <= $1
            AND kind IN ({kinds})
          ORDER BY next_attempt_at, created_at, id
          LIMIT $2",
        D::indexed_by("keel_sagas_due")
    )
}

/// [`SagaStore::saga_insert`](keel_store::SagaStore::saga_insert).
pub async fn insert<B: SqlBackend>(
    store: &B,
    tx: &mut Tx<B>,
    saga: &SagaRecord,
) -> Result<bool, StoreError> {
    let data = serde_json::to_string(&saga.data).map_err(StoreError::other)?;
    let params = record_params(saga, &data, saga.created_at.into(), saga.updated_at.into());
    let (sql, params) = signalled(store, Wake::Sagas, INSERT_SQL, params);
    let inserted = B::Dialect::fetch_optional(Exec::Tx(tx), &sql, &params).await?;
    Ok(inserted.is_some())
}

/// [`SagaStore::saga_get`](keel_store::SagaStore::saga_get).
pub async fn get<B: SqlBackend>(store: &B, id: &str) -> Result<Option<SagaRecord>, StoreError> {
    let sql = format!("SELECT {COLUMNS} FROM keel_sagas WHERE id = $1");
    let row = store.read_optional(&sql, &[id.into()]).await?;
    row.as_ref().map(saga_from_row::<B::Dialect>).transpose()
}

/// [`SagaStore::saga_get_many`](keel_store::SagaStore::saga_get_many):
/// one `IN` list.
pub async fn get_many<B: SqlBackend>(
    store: &B,
    ids: &[String],
) -> Result<Vec<SagaRecord>, StoreError> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let mut filter = Filter::new();
    filter.and_in("id", ids.iter().map(String::as_str));
    let sql = format!("SELECT {COLUMNS} FROM keel_sagas {}", filter.where_clause());
    let rows = store.read_all(&sql, filter.params()).await?;
    rows.iter().map(saga_from_row::<B::Dialect>).collect()
}

/// [`SagaStore::saga_get_in`](keel_store::SagaStore::saga_get_in).
pub async fn get_in<B: SqlBackend>(
    tx: &mut Tx<B>,
    id: &str,
) -> Result<Option<SagaRecord>, StoreError> {
    let sql = format!("SELECT {COLUMNS} FROM keel_sagas WHERE id = $1");
    let row = B::Dialect::fetch_optional(Exec::Tx(tx), &sql, &[id.into()]).await?;
    row.as_ref().map(saga_from_row::<B::Dialect>).transpose()
}

/// [`SagaStore::saga_save`](keel_store::SagaStore::saga_save).
pub async fn save<B: SqlBackend>(store: &B, saga: &SagaRecord) -> Result<bool, StoreError> {
    let data = serde_json::to_string(&saga.data).map_err(StoreError::other)?;
    let (sql, params) = save_statement(store, saga, &data);
    let saved =
        retry::<B::Dialect, _, _, _>("saga_save", || store.write_optional(&sql, &params)).await?;
    if saved.is_some() {
        return Ok(true);
    }
    // Lost the race, or there was nothing to save.
    refused_or_missing::<B::Dialect>(
        Exec::Pool(store.writer()),
        "keel_sagas",
        saga.id.as_str().into(),
        || format!("saga {}", saga.id),
    )
    .await
}

/// [`SagaStore::saga_save_in`](keel_store::SagaStore::saga_save_in).
pub async fn save_in<B: SqlBackend>(
    store: &B,
    tx: &mut Tx<B>,
    saga: &SagaRecord,
) -> Result<bool, StoreError> {
    let data = serde_json::to_string(&saga.data).map_err(StoreError::other)?;
    let (sql, params) = save_statement(store, saga, &data);
    let saved = B::Dialect::fetch_optional(Exec::Tx(&mut *tx), &sql, &params).await?;
    if saved.is_some() {
        return Ok(true);
    }
    refused_or_missing::<B::Dialect>(Exec::Tx(tx), "keel_sagas", saga.id.as_str().into(), || {
        format!("saga {}", saga.id)
    })
    .await
}

/// The save's statement: the record over the version before its own.
fn save_statement<'a, B: SqlBackend>(
    store: &'a B,
    saga: &'a SagaRecord,
    data: &'a str,
) -> (String, Vec<Value<'a>>) {
    let expected_version = saga.version.saturating_sub(1);
    let params = record_params(saga, data, saga.updated_at.into(), expected_version.into());
    signalled(store, Wake::Sagas, SAVE_SQL, params)
}

/// [`SagaStore::saga_due`](keel_store::SagaStore::saga_due).
pub async fn due<B: SqlBackend>(
    store: &B,
    kinds: &[&str],
    now: DateTime<Utc>,
    limit: usize,
) -> Result<Vec<SagaRecord>, StoreError> {
    if limit == 0 || kinds.is_empty() {
        return Ok(Vec::new());
    }
    let sql = due_sql::<B::Dialect>(kinds.len());
    let mut params: Vec<Value<'_>> = vec![now.into(), sql_limit(limit).into()];
    params.extend(kinds.iter().map(|&kind| Value::from(kind)));
    let rows = store.read_all(&sql, &params).await?;
    rows.iter().map(saga_from_row::<B::Dialect>).collect()
}

/// [`SagaStore::saga_list`](keel_store::SagaStore::saga_list).
pub async fn list<B: SqlBackend>(
    store: &B,
    filter: &SagaFilter,
) -> Result<Vec<SagaRecord>, StoreError> {
    let mut conditions = Filter::new();
    conditions
        .and("status =", filter.status.map(SagaStatus::as_str))
        .and("updated_at <", filter.updated_before);
    let limit = conditions.param(sql_limit(filter.limit.unwrap_or(DEFAULT_LIMIT)));
    let sql = format!(
        "SELECT {COLUMNS} FROM keel_sagas {} ORDER BY updated_at, id LIMIT {limit}",
        conditions.where_clause()
    );
    let rows = store.read_all(&sql, conditions.params()).await?;
    rows.iter().map(saga_from_row::<B::Dialect>).collect()
}

/// [`SagaStore::saga_counts`](keel_store::SagaStore::saga_counts).
pub async fn counts<B: SqlBackend>(store: &B) -> Result<Vec<(SagaStatus, u64)>, StoreError> {
    let rows = store.read_all(COUNTS_SQL, &[]).await?;
    rows.iter()
        .map(|row| {
            let status = row.text("status")?;
            let parsed = SagaStatus::parse(&status)
                .ok_or_else(|| corrupt(B::Dialect::NAME, "saga status", &status))?;
            Ok((parsed, to_u64("saga count", row.int("n")?)?))
        })
        .collect()
}

/// The 13 parameters of either write, in its order; `$9` and `$10` differ
/// (the insert's `created_at` and `updated_at`, the save's `updated_at` and
/// expected version).
fn record_params<'a>(
    saga: &'a SagaRecord,
    data: &'a str,
    ninth: Value<'a>,
    tenth: Value<'a>,
) -> Vec<Value<'a>> {
    vec![
        saga.id.as_str().into(),
        saga.kind.as_str().into(),
        saga.status.as_str().into(),
        i64::from(saga.step).into(),
        Value::Json(data),
        i64::from(saga.attempts).into(),
        saga.last_error.as_deref().into(),
        saga.next_attempt_at.into(),
        ninth,
        tenth,
        saga.version.into(),
        saga.outcome_unknown.into(),
        saga.first_attempt_at.into(),
        saga.traceparent.as_deref().into(),
    ]
}

fn saga_from_row<D: Dialect>(row: &D::Row) -> Result<SagaRecord, StoreError> {
    let status = row.text("status")?;
    let data = row.json("data")?;
    Ok(SagaRecord {
        id: row.text("id")?,
        kind: row.text("kind")?,
        status: SagaStatus::parse(&status)
            .ok_or_else(|| corrupt(D::NAME, "saga status", &status))?,
        step: to_u32("saga step", row.int("step")?)?,
        data: serde_json::from_str(&data).map_err(|e| corrupt(D::NAME, "saga data", e))?,
        attempts: to_u32("saga attempts", row.int("attempts")?)?,
        last_error: row.text_opt("last_error")?,
        next_attempt_at: row.time("next_attempt_at")?,
        created_at: row.time("created_at")?,
        updated_at: row.time("updated_at")?,
        version: row.int("version")?,
        outcome_unknown: row.flag("outcome_unknown")?,
        first_attempt_at: row.time_opt("first_attempt_at")?,
        traceparent: row.text_opt("traceparent")?,
    })
}

/// Implements [`SagaStore`](keel_store::SagaStore) for a
/// [`SqlBackend`] whose transaction is the core's [`Tx`].
#[macro_export]
macro_rules! saga_store {
    ($store:ty) => {
        #[$crate::__private::async_trait]
        impl $crate::__private::store::SagaStore for $store {
            async fn saga_insert(
                &self,
                tx: &mut <Self as $crate::__private::store::Store>::Tx,
                saga: &$crate::__private::store::SagaRecord,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::saga::insert(self, tx, saga).await
            }

            async fn saga_get(
                &self,
                id: &str,
            ) -> ::std::result::Result<
                ::std::option::Option<$crate::__private::store::SagaRecord>,
                $crate::__private::StoreError,
            > {
                $crate::saga::get(self, id).await
            }

            async fn saga_get_many(
                &self,
                ids: &[::std::string::String],
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::__private::store::SagaRecord>,
                $crate::__private::StoreError,
            > {
                $crate::saga::get_many(self, ids).await
            }

            async fn saga_get_in(
                &self,
                tx: &mut <Self as $crate::__private::store::Store>::Tx,
                id: &str,
            ) -> ::std::result::Result<
                ::std::option::Option<$crate::__private::store::SagaRecord>,
                $crate::__private::StoreError,
            > {
                $crate::saga::get_in::<Self>(tx, id).await
            }

            async fn saga_save(
                &self,
                saga: &$crate::__private::store::SagaRecord,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::saga::save(self, saga).await
            }

            async fn saga_save_in(
                &self,
                tx: &mut <Self as $crate::__private::store::Store>::Tx,
                saga: &$crate::__private::store::SagaRecord,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::saga::save_in(self, tx, saga).await
            }

            async fn saga_due(
                &self,
                kinds: &[&str],
                now: $crate::__private::DateTime<$crate::__private::Utc>,
                limit: usize,
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::__private::store::SagaRecord>,
                $crate::__private::StoreError,
            > {
                $crate::saga::due(self, kinds, now, limit).await
            }

            async fn saga_list(
                &self,
                filter: &$crate::__private::store::SagaFilter,
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::__private::store::SagaRecord>,
                $crate::__private::StoreError,
            > {
                $crate::saga::list(self, filter).await
            }

            async fn saga_counts(
                &self,
            ) -> ::std::result::Result<
                ::std::vec::Vec<($crate::__private::store::SagaStatus, u64)>,
                $crate::__private::StoreError,
            > {
                $crate::saga::counts(self).await
            }
        }
    };
}
