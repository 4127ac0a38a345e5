//! The event log's SQLite half: the append (the rest is the shared core's
//! `keel_sql::event_log`). The counter's bump and the event's insert, in the
//! caller's transaction; the store's single writer serializes whole
//! transactions, so seqs are contiguous and in commit order.
//!
//! The two statements travel as one query: sqlx runs every statement of a
//! query string on its connection's thread in one command, binding `$N` to
//! the N-th argument in each, so the append costs one hand-off to that
//! thread instead of two (each hand-off wakes a thread, and on the writer
//! every other transaction waits for it).

use chrono::{DateTime, Utc};
use keel_sql::event_log::EventLogBackend;
use keel_store::StoreError;

use crate::SqliteStore;
use crate::store::codec::to_ms;
use crate::store::error::db_error;

const APPEND_SQL: &str = "\
INSERT INTO keel_event_log_streams (stream, last_seq) VALUES ($1, 1)
ON CONFLICT (stream) DO UPDATE SET last_seq = last_seq + 1;
INSERT INTO keel_event_log (stream, seq, event_type, data, at)
SELECT $1, last_seq, $2, $3, $4 FROM keel_event_log_streams WHERE stream = $1
RETURNING seq";

impl EventLogBackend for SqliteStore {
    async fn append_row(
        &self,
        tx: &mut keel_sql::backend::Tx<Self>,
        stream: &str,
        event_type: &str,
        data: &str,
        at: DateTime<Utc>,
    ) -> Result<i64, StoreError> {
        sqlx::query_scalar(APPEND_SQL)
            .bind(stream)
            .bind(event_type)
            .bind(data)
            .bind(to_ms(at))
            .fetch_one(&mut **tx)
            .await
            .map_err(db_error)
    }
}
