//! Dead letters and the failure history of messages still being retried.
//!
//! A dead letter keeps its error history as a JSON array in its own row: it
//! is written once, read whole, and never queried by attempt. The failure
//! history of live messages is a table of its own, because it grows one
//! attempt at a time and is cleared when the message succeeds.

use bytes::Bytes;
use keel_store::StoreError;
use keel_store::broker::Message;
use keel_store::{AttemptError, DeadLetter, DeadLetterFilter, DeadLetterStatus};

use crate::backend::{SqlBackend, Tx};
use crate::dialect::{Dialect, Exec, SqlRow, Value};
use crate::error::{corrupt, sql_limit, to_u32, to_u64};
use crate::filter::Filter;
use crate::retry::write;

/// The default of [`DeadLetterFilter::limit`].
const DEFAULT_LIMIT: usize = 100;

const COLUMNS: &str = "id, message_id, topic, partition_key, headers, payload, \
                       consumer_group, error_kind, attempts, dead_at, status";

const PUT_SQL: &str = "\
INSERT INTO keel_dead_letters (id, message_id, topic, partition_key, headers, payload,
                               consumer_group, error_kind, attempts, dead_at, status)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)";

const SETTLE_SQL: &str = "\
UPDATE keel_dead_letters SET status = $1, settled_at = $2
 WHERE id = $3 AND status = 'pending'";

const COUNTS_SQL: &str = "\
SELECT error_kind, COUNT(*) AS n FROM keel_dead_letters
 WHERE status = 'pending' GROUP BY error_kind ORDER BY error_kind";

const FAILURE_RECORD_SQL: &str = "\
INSERT INTO keel_failures (consumer_group, message_id, attempt, error, at)
VALUES ($1, $2, $3, $4, $5)";

const FAILURE_HISTORY_SQL: &str = "\
SELECT attempt, error, at FROM keel_failures
 WHERE consumer_group = $1 AND message_id = $2 ORDER BY at, seq";

const FAILURE_CLEAR_SQL: &str =
    "DELETE FROM keel_failures WHERE consumer_group = $1 AND message_id = $2";

/// [`DeadLetterStore::dead_letter_put`](keel_store::DeadLetterStore::dead_letter_put).
pub async fn put<B: SqlBackend>(store: &B, letter: &DeadLetter) -> Result<(), StoreError> {
    let message = &letter.message;
    let headers = serde_json::to_string(&message.headers).map_err(StoreError::other)?;
    let attempts = B::Dialect::attempts_to_json(&letter.attempts)?;
    let params = [
        letter.id.as_str().into(),
        message.id.as_str().into(),
        message.topic.as_str().into(),
        message.key.as_str().into(),
        Value::Json(&headers),
        message.payload.as_ref().into(),
        letter.group.as_str().into(),
        letter.error_kind.as_str().into(),
        Value::Json(&attempts),
        letter.dead_at.into(),
        letter.status.as_str().into(),
    ];
    write(store, "dead_letter_put", PUT_SQL, &params).await?;
    tracing::debug!(id = %letter.id, kind = %letter.error_kind, "dead letter stored");
    Ok(())
}

/// [`DeadLetterStore::dead_letter_list`](keel_store::DeadLetterStore::dead_letter_list).
pub async fn list<B: SqlBackend>(
    store: &B,
    filter: &DeadLetterFilter,
) -> Result<Vec<DeadLetter>, StoreError> {
    let mut conditions = Filter::new();
    conditions
        .and("topic =", filter.topic.as_deref())
        .and("error_kind =", filter.error_kind.as_deref())
        .and("status =", filter.status.map(DeadLetterStatus::as_str));
    let limit = conditions.param(sql_limit(filter.limit.unwrap_or(DEFAULT_LIMIT)));
    let sql = format!(
        "SELECT {COLUMNS} FROM keel_dead_letters {} ORDER BY dead_at, seq LIMIT {limit}",
        conditions.where_clause()
    );
    let rows = store.read_all(&sql, conditions.params()).await?;
    rows.iter().map(letter_from_row::<B::Dialect>).collect()
}

/// [`DeadLetterStore::dead_letter_get`](keel_store::DeadLetterStore::dead_letter_get).
pub async fn get<B: SqlBackend>(store: &B, id: &str) -> Result<Option<DeadLetter>, StoreError> {
    let sql = format!("SELECT {COLUMNS} FROM keel_dead_letters WHERE id = $1");
    let row = store.read_optional(&sql, &[id.into()]).await?;
    row.as_ref().map(letter_from_row::<B::Dialect>).transpose()
}

/// [`DeadLetterStore::dead_letter_settle`](keel_store::DeadLetterStore::dead_letter_settle).
pub async fn settle<B: SqlBackend>(
    tx: &mut Tx<B>,
    id: &str,
    status: DeadLetterStatus,
) -> Result<bool, StoreError> {
    if status == DeadLetterStatus::Pending {
        return Err(StoreError::other(
            "a dead letter cannot be settled as pending; settle it as replayed or discarded",
        ));
    }
    let params = [status.as_str().into(), B::Dialect::now().into(), id.into()];
    let settled = B::Dialect::execute(Exec::Tx(tx), SETTLE_SQL, &params).await?;
    Ok(settled == 1)
}

/// [`DeadLetterStore::dead_letter_counts`](keel_store::DeadLetterStore::dead_letter_counts).
pub async fn counts<B: SqlBackend>(store: &B) -> Result<Vec<(String, u64)>, StoreError> {
    let rows = store.read_all(COUNTS_SQL, &[]).await?;
    rows.iter()
        .map(|row| {
            Ok((
                row.text("error_kind")?,
                to_u64("dead letter count", row.int("n")?)?,
            ))
        })
        .collect()
}

/// [`DeadLetterStore::failure_record`](keel_store::DeadLetterStore::failure_record).
pub async fn failure_record<B: SqlBackend>(
    store: &B,
    group: &str,
    message_id: &str,
    failure: &AttemptError,
) -> Result<(), StoreError> {
    let params = [
        group.into(),
        message_id.into(),
        i64::from(failure.attempt).into(),
        failure.error.as_str().into(),
        failure.at.into(),
    ];
    write(store, "failure_record", FAILURE_RECORD_SQL, &params).await?;
    Ok(())
}

/// [`DeadLetterStore::failure_history`](keel_store::DeadLetterStore::failure_history).
pub async fn failure_history<B: SqlBackend>(
    store: &B,
    group: &str,
    message_id: &str,
) -> Result<Vec<AttemptError>, StoreError> {
    let rows = store
        .read_all(FAILURE_HISTORY_SQL, &[group.into(), message_id.into()])
        .await?;
    rows.iter()
        .map(|row| {
            Ok(AttemptError {
                attempt: to_u32("attempt number", row.int("attempt")?)?,
                error: row.text("error")?,
                at: row.time("at")?,
            })
        })
        .collect()
}

/// [`DeadLetterStore::failure_clear`](keel_store::DeadLetterStore::failure_clear).
pub async fn failure_clear<B: SqlBackend>(
    store: &B,
    group: &str,
    message_id: &str,
) -> Result<(), StoreError> {
    let params = [group.into(), message_id.into()];
    write(store, "failure_clear", FAILURE_CLEAR_SQL, &params).await?;
    Ok(())
}

fn letter_from_row<D: Dialect>(row: &D::Row) -> Result<DeadLetter, StoreError> {
    let headers = row.json("headers")?;
    let status = row.text("status")?;
    Ok(DeadLetter {
        id: row.text("id")?,
        message: Message {
            id: row.text("message_id")?,
            topic: row.text("topic")?,
            key: row.text("partition_key")?,
            headers: serde_json::from_str(&headers).map_err(|e| corrupt(D::NAME, "headers", e))?,
            payload: Bytes::from(row.bytes("payload")?),
        },
        group: row.text("consumer_group")?,
        error_kind: row.text("error_kind")?,
        attempts: D::attempts_from_json(&row.json("attempts")?)?,
        dead_at: row.time("dead_at")?,
        status: DeadLetterStatus::parse(&status)
            .ok_or_else(|| corrupt(D::NAME, "dead letter status", status))?,
    })
}

/// Implements [`DeadLetterStore`](keel_store::DeadLetterStore) for
/// a [`SqlBackend`] whose transaction is the core's [`Tx`].
#[macro_export]
macro_rules! dead_letter_store {
    ($store:ty) => {
        #[$crate::__private::async_trait]
        impl $crate::__private::store::DeadLetterStore for $store {
            async fn dead_letter_put(
                &self,
                letter: &$crate::__private::store::DeadLetter,
            ) -> ::std::result::Result<(), $crate::__private::StoreError> {
                $crate::dead_letter::put(self, letter).await
            }

            async fn dead_letter_list(
                &self,
                filter: &$crate::__private::store::DeadLetterFilter,
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::__private::store::DeadLetter>,
                $crate::__private::StoreError,
            > {
                $crate::dead_letter::list(self, filter).await
            }

            async fn dead_letter_get(
                &self,
                id: &str,
            ) -> ::std::result::Result<
                ::std::option::Option<$crate::__private::store::DeadLetter>,
                $crate::__private::StoreError,
            > {
                $crate::dead_letter::get(self, id).await
            }

            async fn dead_letter_settle(
                &self,
                tx: &mut <Self as $crate::__private::store::Store>::Tx,
                id: &str,
                status: $crate::__private::store::DeadLetterStatus,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::dead_letter::settle::<Self>(tx, id, status).await
            }

            async fn dead_letter_counts(
                &self,
            ) -> ::std::result::Result<
                ::std::vec::Vec<(::std::string::String, u64)>,
                $crate::__private::StoreError,
            > {
                $crate::dead_letter::counts(self).await
            }

            async fn failure_record(
                &self,
                group: &str,
                message_id: &str,
                failure: &$crate::__private::store::AttemptError,
            ) -> ::std::result::Result<(), $crate::__private::StoreError> {
                $crate::dead_letter::failure_record(self, group, message_id, failure).await
            }

            async fn failure_history(
                &self,
                group: &str,
                message_id: &str,
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::__private::store::AttemptError>,
                $crate::__private::StoreError,
            > {
                $crate::dead_letter::failure_history(self, group, message_id).await
            }

            async fn failure_clear(
                &self,
                group: &str,
                message_id: &str,
            ) -> ::std::result::Result<(), $crate::__private::StoreError> {
                $crate::dead_letter::failure_clear(self, group, message_id).await
            }
        }
    };
}
