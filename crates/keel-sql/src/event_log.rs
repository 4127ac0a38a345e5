//! Per-user event logs: the storage behind `keel-http`'s long polling, SSE
//! and WebSocket push.
//!
//! A client that reconnects says "I have everything up to seq 41"; the log
//! must then hand it 42, 43, ... with nothing skipped. So seqs come from a
//! per-stream counter row (`keel_event_log_streams`) bumped in the caller's
//! own transaction: the bump holds the row's write lock until COMMIT (on
//! SQLite the single writer serializes whole transactions), so a second
//! appender to the same stream waits and gets the next seq; seqs are
//! contiguous and in commit order, a rolled-back append leaves no hole, and
//! the counter survives trimming, so seqs are never reused. Where readers
//! live in several processes the append also signals `<seq> <stream>`,
//! delivered at commit. The append is the backend's ([`EventLogBackend`]).
//!
//! Retention is two batched deletes, by age ([`trim`]) and by count per
//! stream ([`trim_keep_last`]), each bounded by `batch` so a trim never holds
//! locks for long.

use chrono::{DateTime, Utc};
use keel_store::LoggedEvent;
use keel_store::StoreError;

use std::future::Future;

use crate::backend::{SqlBackend, Tx};
use crate::dialect::{Dialect, SqlRow};
use crate::error::{corrupt, sql_limit};
use crate::retry::{bounded_delete_sql, delete_batch};

const READ_SQL: &str = "\
SELECT seq, event_type, data, at FROM keel_event_log
 WHERE stream = $1 AND seq > $2 ORDER BY seq LIMIT $3";

const LAST_SEQ_SQL: &str = "SELECT last_seq FROM keel_event_log_streams WHERE stream = $1";

/// What only the backend knows how to do with its event log.
pub trait EventLogBackend: SqlBackend {
    /// Bumps `stream`'s counter and inserts the event with the new seq
    /// (`data` is its JSON text), in `tx`, waking the readers that must
    /// learn of it at commit; returns the seq, in one round trip. (SQLite
    /// sends its two statements as one query; PostgreSQL runs one statement,
    /// whose data-modifying CTEs also notify.)
    fn append_row<'a>(
        &'a self,
        tx: &'a mut Tx<Self>,
        stream: &'a str,
        event_type: &'a str,
        data: &'a str,
        at: DateTime<Utc>,
    ) -> impl Future<Output = Result<i64, StoreError>> + Send + 'a;
}

/// [`EventLogStore::event_log_append`](keel_store::EventLogStore::event_log_append).
pub async fn append<B: EventLogBackend>(
    store: &B,
    tx: &mut Tx<B>,
    stream: &str,
    event_type: &str,
    data: &serde_json::Value,
) -> Result<i64, StoreError> {
    let data = serde_json::to_string(data).map_err(StoreError::other)?;
    store
        .append_row(tx, stream, event_type, &data, B::Dialect::now())
        .await
}

/// [`EventLogStore::event_log_read_after`](keel_store::EventLogStore::event_log_read_after).
pub async fn read_after<B: SqlBackend>(
    store: &B,
    stream: &str,
    after: i64,
    limit: usize,
) -> Result<Vec<LoggedEvent>, StoreError> {
    if limit == 0 {
        return Ok(Vec::new());
    }
    let params = [stream.into(), after.into(), sql_limit(limit).into()];
    let rows = store.read_all(READ_SQL, &params).await?;
    rows.iter()
        .map(|row| {
            let data = row.json("data")?;
            Ok(LoggedEvent {
                seq: row.int("seq")?,
                event_type: row.text("event_type")?,
                data: serde_json::from_str(&data)
                    .map_err(|e| corrupt(B::Dialect::NAME, "event log entry", e))?,
                at: row.time("at")?,
            })
        })
        .collect()
}

/// [`EventLogStore::event_log_trim`](keel_store::EventLogStore::event_log_trim).
pub async fn trim<B: SqlBackend>(
    store: &B,
    before: DateTime<Utc>,
    batch: usize,
) -> Result<u64, StoreError> {
    let sql = bounded_delete_sql::<B::Dialect>("keel_event_log", "id", "at < $1", "at, id");
    delete_batch(store, "event_log_trim", &sql, before.into(), batch).await
}

/// [`EventLogStore::event_log_last_seq`](keel_store::EventLogStore::event_log_last_seq).
pub async fn last_seq<B: SqlBackend>(store: &B, stream: &str) -> Result<i64, StoreError> {
    let row = store.read_optional(LAST_SEQ_SQL, &[stream.into()]).await?;
    row.map_or(Ok(0), |row| row.int("last_seq"))
}

/// [`EventLogStore::event_log_trim_keep_last`](keel_store::EventLogStore::event_log_trim_keep_last):
/// walks the streams and, through the `(stream, seq)` index, each stream's
/// events at or below `last_seq - keep`.
pub async fn trim_keep_last<B: SqlBackend>(
    store: &B,
    keep: u64,
    batch: usize,
) -> Result<u64, StoreError> {
    let sql = format!(
        "DELETE FROM keel_event_log WHERE id IN (
           SELECT e.id FROM keel_event_log_streams s
             JOIN keel_event_log e ON e.stream = s.stream AND e.seq <= s.last_seq - $1
            LIMIT $2{})",
        B::Dialect::skip_locked(Some("e"))
    );
    let keep = i64::try_from(keep).unwrap_or(i64::MAX);
    delete_batch(store, "event_log_trim_keep_last", &sql, keep.into(), batch).await
}

/// Implements [`EventLogStore`](keel_store::EventLogStore) for a
/// [`EventLogBackend`].
#[macro_export]
macro_rules! event_log_store {
    ($store:ty) => {
        #[$crate::__private::async_trait]
        impl $crate::__private::store::EventLogStore for $store {
            async fn event_log_append(
                &self,
                tx: &mut <Self as $crate::__private::store::Store>::Tx,
                stream: &str,
                event_type: &str,
                data: &$crate::__private::serde_json::Value,
            ) -> ::std::result::Result<i64, $crate::__private::StoreError> {
                $crate::event_log::append(self, tx, stream, event_type, data).await
            }

            async fn event_log_read_after(
                &self,
                stream: &str,
                after: i64,
                limit: usize,
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::__private::store::LoggedEvent>,
                $crate::__private::StoreError,
            > {
                $crate::event_log::read_after(self, stream, after, limit).await
            }

            async fn event_log_trim(
                &self,
                before: $crate::__private::DateTime<$crate::__private::Utc>,
                batch: usize,
            ) -> ::std::result::Result<u64, $crate::__private::StoreError> {
                $crate::event_log::trim(self, before, batch).await
            }

            async fn event_log_last_seq(
                &self,
                stream: &str,
            ) -> ::std::result::Result<i64, $crate::__private::StoreError> {
                $crate::event_log::last_seq(self, stream).await
            }

            async fn event_log_trim_keep_last(
                &self,
                keep: u64,
                batch: usize,
            ) -> ::std::result::Result<u64, $crate::__private::StoreError> {
                $crate::event_log::trim_keep_last(self, keep, batch).await
            }
        }
    };
}
