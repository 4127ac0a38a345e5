//! The event log's SQLite half: the append (the rest is the shared core's
//! `keel_sql::event_log`). Two statements, the counter's bump and the
//! event's insert, in the caller's transaction; the store's single writer
//! serializes whole transactions, so seqs are contiguous and in commit
//! order.

use chrono::{DateTime, Utc};
use keel_messaging::StoreError;
use keel_sql::event_log::EventLogBackend;

use crate::SqliteStore;
use crate::store::codec::to_ms;
use crate::store::error::db_error;

const BUMP_SQL: &str = "\
INSERT INTO keel_event_log_streams (stream, last_seq) VALUES ($1, 1)
ON CONFLICT (stream) DO UPDATE SET last_seq = last_seq + 1
RETURNING last_seq";

const INSERT_SQL: &str = "\
INSERT INTO keel_event_log (stream, seq, event_type, data, at) VALUES ($1, $2, $3, $4, $5)";

impl EventLogBackend for SqliteStore {
    async fn append_row(
        &self,
        tx: &mut keel_sql::backend::Tx<Self>,
        stream: &str,
        event_type: &str,
        data: &str,
        at: DateTime<Utc>,
    ) -> Result<i64, StoreError> {
        let seq: i64 = sqlx::query_scalar(BUMP_SQL)
            .bind(stream)
            .fetch_one(&mut **tx)
            .await
            .map_err(db_error)?;
        sqlx::query(INSERT_SQL)
            .bind(stream)
            .bind(seq)
            .bind(event_type)
            .bind(data)
            .bind(to_ms(at))
            .execute(&mut **tx)
            .await
            .map_err(db_error)?;
        Ok(seq)
    }
}
