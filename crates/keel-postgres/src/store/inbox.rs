//! The idempotent consumer's inbox on PostgreSQL.
//!
//! Recording is `INSERT ... ON CONFLICT DO NOTHING` in the handler's own
//! transaction: the affected-row count says whether this handler saw the
//! event before. A plain `INSERT` would raise a unique violation instead,
//! which aborts the whole PostgreSQL transaction, effect included. A
//! concurrent duplicate waits for the first one's transaction: if that
//! commits, the duplicate sees the row and skips; if it rolls back, the
//! duplicate records the event and does the work.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use keel_messaging::StoreError;
use keel_messaging::store::{InboxStore, Store};

use super::PgStore;
use super::codec::now;
use super::error::db_error;
use super::retry::delete_batch;

const RECORD_SQL: &str = "\
INSERT INTO keel_inbox (event_id, handler, processed_at) VALUES ($1, $2, $3)
ON CONFLICT (event_id, handler) DO NOTHING";

const PRUNE_SQL: &str = "\
DELETE FROM keel_inbox WHERE (event_id, handler) IN (
  SELECT event_id, handler FROM keel_inbox
   WHERE processed_at < $1 ORDER BY processed_at LIMIT $2 FOR UPDATE SKIP LOCKED)";

#[async_trait]
impl InboxStore for PgStore {
    async fn inbox_record(
        &self,
        tx: &mut <Self as Store>::Tx,
        event_id: &str,
        handler: &str,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(RECORD_SQL)
            .bind(event_id)
            .bind(handler)
            .bind(now())
            .execute(&mut **tx)
            .await
            .map_err(db_error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn inbox_prune(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError> {
        delete_batch(&self.pool, "inbox_prune", PRUNE_SQL, before, batch).await
    }
}
