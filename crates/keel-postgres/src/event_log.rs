//! The event log's PostgreSQL half: the append (the rest is the shared
//! core's `keel_sql::event_log`), one statement that bumps the counter,
//! inserts the event and notifies the event-log channel with
//! `<seq> <stream>`. The bump holds the counter row's lock until COMMIT, so
//! a second appender to the same stream waits and gets the next seq, and the
//! notification leaves at commit, so readers in every process wake up.

use chrono::{DateTime, Utc};
use keel_sql::dialect::within_answer_bound;
use keel_sql::event_log::EventLogBackend;
use keel_store::StoreError;
use sqlx::Row;

use crate::PgStore;
use crate::store::PgDialect;
use crate::store::error::db_error;

const APPEND_SQL: &str = "\
WITH bumped AS (
  INSERT INTO keel_event_log_streams (stream, last_seq) VALUES ($1, 1)
  ON CONFLICT (stream) DO UPDATE SET last_seq = keel_event_log_streams.last_seq + 1
  RETURNING last_seq),
inserted AS (
  INSERT INTO keel_event_log (stream, seq, event_type, data, at)
  SELECT $1, last_seq, $2, $3::jsonb, $4 FROM bumped
  RETURNING seq)
SELECT seq, pg_notify($5, seq::text || ' ' || $1) FROM inserted";

impl EventLogBackend for PgStore {
    async fn append_row(
        &self,
        tx: &mut keel_sql::backend::Tx<Self>,
        stream: &str,
        event_type: &str,
        data: &str,
        at: DateTime<Utc>,
    ) -> Result<i64, StoreError> {
        let append = sqlx::query(APPEND_SQL)
            .bind(stream)
            .bind(event_type)
            .bind(data)
            .bind(at)
            .bind(self.channels.event_log.as_str())
            .fetch_one(&mut **tx);
        let row = within_answer_bound::<PgDialect, _>(append)
            .await
            .map_err(db_error)?;
        row.try_get("seq").map_err(db_error)
    }
}
