//! PostgreSQL as the shared SQL core sees it: instants as `TIMESTAMPTZ`,
//! documents as `JSONB`, `SKIP LOCKED` for concurrent workers, `NOTIFY` for
//! wake-ups in other processes, and retries of serialization failures and
//! deadlocks.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use chrono::{DateTime, Utc};
use keel_sql::backend::Wake;
use keel_sql::{Dialect, Field, SqlBackend, SqlRow};
use keel_store::StoreError;
use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgArgumentBuffer, PgRow, PgTypeInfo, PgValueFormat, PgValueRef, Postgres};
use sqlx::{Column, Row, TypeInfo, ValueRef};

use super::PgStore;
use super::error::{autocommit_write_error, corrupt, db_error, is_conflict_store_error};

/// How much longer than its `statement_timeout` a statement may go without
/// an answer: the server cancels it at the timeout and answers at once, so
/// a connection silent for this much longer is not going to answer.
pub(crate) const ANSWER_MARGIN: Duration = Duration::from_secs(5);

/// The client-side bound on a statement's answer, in milliseconds: the
/// longest `statement_timeout` plus `acquire_timeout` of every store this
/// process opened, plus [`ANSWER_MARGIN`]. The dialect is a type, not a value, so the bound is
/// the process's: the longest, which cuts no store's statement short.
static ANSWER_BOUND_MS: AtomicU64 = AtomicU64::new(NO_BOUND_YET);
const NO_BOUND_YET: u64 = 0;
/// A store opened without a statement timeout: nothing is bounded.
const UNBOUNDED: u64 = u64::MAX;

/// Raises the process's answer bound to cover a store whose statements
/// the server cancels after `statement_timeout` (zero: never, and then no
/// statement is bounded), and whose pool gives up waiting for a connection
/// after `acquire_timeout`: a statement on the pool waits for both, and one
/// never sent must fail as the pool's timeout (nothing committed), not as
/// the bound's (outcome unknown).
pub(crate) fn cover_statement_timeout(statement_timeout: Duration, acquire_timeout: Duration) {
    let ms = if statement_timeout.is_zero() {
        UNBOUNDED
    } else {
        u64::try_from((statement_timeout + acquire_timeout + ANSWER_MARGIN).as_millis())
            .unwrap_or(UNBOUNDED)
    };
    ANSWER_BOUND_MS.fetch_max(ms, Ordering::Relaxed);
}

/// PostgreSQL's dialect of the shared SQL core.
#[derive(Debug, Clone, Copy, Default)]
pub struct PgDialect;

impl Dialect for PgDialect {
    type Db = Postgres;
    type Row = PgRow;
    type JsonInstant = DateTime<Utc>;

    const NAME: &'static str = "PostgreSQL";
    const FOR_UPDATE: &'static str = " FOR UPDATE";
    fn skip_locked(of: Option<&str>) -> String {
        match of {
            Some(table) => format!(" FOR UPDATE OF {table} SKIP LOCKED"),
            None => " FOR UPDATE SKIP LOCKED".to_owned(),
        }
    }

    fn signalling(statement: &str, channel: &str) -> String {
        format!(
            "WITH changed AS ({statement}) \
             SELECT changed.*, pg_notify({channel}, '') FROM changed"
        )
    }

    fn now() -> DateTime<Utc> {
        super::codec::now()
    }

    fn any_of(column: &str, ids: &str) -> String {
        format!("{column} = ANY({ids})")
    }

    fn json_records(param: &str, alias: &str, fields: &[(&str, Field)]) -> String {
        let columns: Vec<String> = fields
            .iter()
            .map(|(name, field)| {
                let ty = match field {
                    Field::Int => "BIGINT",
                    Field::Text => "TEXT",
                    Field::Json => "JSONB",
                    Field::Time => "TIMESTAMPTZ",
                };
                format!("{name} {ty}")
            })
            .collect();
        format!(
            "jsonb_to_recordset({param}::jsonb) AS {alias}({})",
            columns.join(", ")
        )
    }

    fn json_instant(at: DateTime<Utc>) -> DateTime<Utc> {
        at
    }

    fn from_json_instant(at: DateTime<Utc>) -> Result<DateTime<Utc>, StoreError> {
        Ok(at)
    }

    fn error(err: sqlx::Error) -> StoreError {
        db_error(err)
    }

    fn autocommit_write_error(err: StoreError) -> StoreError {
        autocommit_write_error(err)
    }

    fn retries(err: &StoreError) -> bool {
        is_conflict_store_error(err)
    }

    fn answer_bound() -> Option<Duration> {
        match ANSWER_BOUND_MS.load(Ordering::Relaxed) {
            NO_BOUND_YET | UNBOUNDED => None,
            ms => Some(Duration::from_millis(ms)),
        }
    }

    keel_sql::sqlx_execution!(
        Postgres,
        PgRow,
        json: |json: &'a str| Jsonb(json),
        time: |at: Option<DateTime<Utc>>| at,
        ids: |ids: &'a [i64]| ids,
        texts: |texts: &'a [&'a str]| texts,
    );
}

/// `JSONB`'s binary format: a version byte, then the document's text.
const JSONB_VERSION: u8 = 1;
/// The type OIDs of `JSONB`, `JSON` and `TEXT` (a function may hand a
/// document back as text).
const JSONB_OID: u32 = 3802;
const JSON_OID: u32 = 114;
const TEXT_OID: u32 = 25;

/// A document already serialized, sent and read as `JSONB` without parsing
/// it on the way (the core parses it once, into its own type).
struct Jsonb<T>(T);

impl<T> sqlx::Type<Postgres> for Jsonb<T> {
    fn type_info() -> PgTypeInfo {
        PgTypeInfo::with_oid(sqlx::postgres::types::Oid(JSONB_OID))
    }

    fn compatible(ty: &PgTypeInfo) -> bool {
        matches!(ty.oid(), Some(oid) if [JSONB_OID, JSON_OID, TEXT_OID].contains(&oid.0))
    }
}

impl sqlx::Encode<'_, Postgres> for Jsonb<&str> {
    fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
        buf.push(JSONB_VERSION);
        buf.extend_from_slice(self.0.as_bytes());
        Ok(IsNull::No)
    }
}

impl<'r> sqlx::Decode<'r, Postgres> for Jsonb<String> {
    fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
        let is_jsonb = value
            .type_info()
            .oid()
            .is_some_and(|oid| oid.0 == JSONB_OID);
        let bytes = value.as_bytes()?;
        let text = match (value.format(), is_jsonb) {
            (PgValueFormat::Binary, true) => match bytes.split_first() {
                Some((&JSONB_VERSION, text)) => text,
                _ => return Err("unknown JSONB binary version".into()),
            },
            _ => bytes,
        };
        Ok(Self(std::str::from_utf8(text)?.to_owned()))
    }
}

impl SqlRow<PgDialect> for PgRow {
    fn text_opt(&self, column: &str) -> Result<Option<String>, StoreError> {
        self.try_get(column).map_err(db_error)
    }

    /// Any integer width: Keel's columns are `BIGINT` or `INTEGER`.
    fn int_opt(&self, column: &str) -> Result<Option<i64>, StoreError> {
        let width = self
            .try_column(column)
            .map_err(db_error)?
            .type_info()
            .name();
        match width {
            "INT4" => Ok(self
                .try_get::<Option<i32>, _>(column)
                .map_err(db_error)?
                .map(i64::from)),
            "INT2" => Ok(self
                .try_get::<Option<i16>, _>(column)
                .map_err(db_error)?
                .map(i64::from)),
            _ => self.try_get(column).map_err(db_error),
        }
    }

    fn flag(&self, column: &str) -> Result<bool, StoreError> {
        self.try_get(column).map_err(db_error)
    }

    fn bytes_opt(&self, column: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.try_get(column).map_err(db_error)
    }

    fn json_opt(&self, column: &str) -> Result<Option<String>, StoreError> {
        let text = self
            .try_get::<Option<Jsonb<String>>, _>(column)
            .map_err(|e| corrupt("document", e))?;
        Ok(text.map(|Jsonb(text)| text))
    }

    fn time_opt(&self, column: &str) -> Result<Option<DateTime<Utc>>, StoreError> {
        self.try_get(column).map_err(db_error)
    }
}

impl SqlBackend for PgStore {
    type Dialect = PgDialect;
    type Tx = sqlx::Transaction<'static, sqlx::Postgres>;

    async fn begin_own(&self) -> Result<keel_sql::backend::Tx<Self>, StoreError> {
        keel_store::Store::begin(self).await
    }

    async fn commit_own(&self, tx: keel_sql::backend::Tx<Self>) -> Result<(), StoreError> {
        self.commit_resolved(tx).await
    }

    async fn rollback_own(&self, tx: keel_sql::backend::Tx<Self>) -> Result<(), StoreError> {
        keel_store::Store::rollback(self, tx).await
    }

    fn writer(&self) -> &sqlx::PgPool {
        &self.pool
    }

    fn reader(&self) -> &sqlx::PgPool {
        &self.pool
    }

    fn wake_channel(&self, wake: Wake) -> Option<&str> {
        match wake {
            Wake::Sagas => Some(&self.channels.sagas),
            Wake::Webhooks => Some(&self.channels.webhooks),
        }
    }
}

keel_sql::dead_letter_store!(PgStore);
keel_sql::event_log_store!(PgStore);
keel_sql::fence_store!(PgStore);
keel_sql::lease_store!(PgStore);
keel_sql::entity_version_store!(PgStore);
keel_sql::idempotency_store!(PgStore);
keel_sql::inbox_store!(PgStore);
keel_sql::outbox_store!(PgStore);
keel_sql::job_store!(PgStore);
keel_sql::saga_store!(PgStore);

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    /// Retryable, but not a conflict: the caller's retry policy decides.
    fn pool_timeout() -> StoreError {
        StoreError::Unavailable(sqlx::Error::PoolTimedOut.into())
    }

    #[tokio::test(start_paused = true)]
    async fn only_conflicts_are_retried_by_the_store() {
        let calls = Arc::new(AtomicU32::new(0));
        let counted = calls.clone();
        let result: Result<(), _> = keel_sql::retry::retry::<PgDialect, _, _, _>("test", || {
            counted.fetch_add(1, Ordering::SeqCst);
            async { Err(pool_timeout()) }
        })
        .await;
        assert!(result.is_err());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
    }
}
