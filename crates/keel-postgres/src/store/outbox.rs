//! The outbox's PostgreSQL half: append and claim (the rest is the shared
//! core's `keel_sql::outbox`).
//!
//! Append is one statement per call whatever the number of events
//! (`INSERT ... SELECT FROM UNNEST(arrays)`), and it sends `pg_notify` on
//! the outbox channel in the same statement: the notification leaves when
//! the business transaction commits, and never if it rolls back.
//!
//! # Claims
//!
//! A claim leases rows to a relay: `UPDATE ... SET claimed_by, claimed_until`
//! over the lowest unpublished ids that nobody else holds, selected `FOR
//! UPDATE SKIP LOCKED`, so a relay never waits behind rows another relay is
//! marking or releasing and never takes them. The lease is what keeps two
//! relays from publishing one row; it also brings a crashed relay's rows
//! back when it ends.
//!
//! Per-key order needs one more thing. A row may only be claimed if no
//! earlier unpublished row of its key is leased by another relay; but that
//! check reads the *committed* claims, and two claims running at the same
//! moment each see the other's rows as free (and `SKIP LOCKED` hides the
//! rows the other is locking rather than showing them as taken). So claims
//! take a transaction-scoped advisory lock for the schema's outbox first:
//! claims are serialized (each is one statement over a partial index, so
//! the lock is held for a millisecond), while appends, marks and releases
//! never touch that lock. A claim is one call of the function
//! `keel_outbox_claim` (migration 1501; 1502 makes it skip parked rows and
//! the later rows of their keys), which takes the lock and then
//! leases with a fresh snapshot: one round trip, not four.
//!
//! # Pruning
//!
//! Each prune deletes at most `batch` published rows chosen `FOR UPDATE SKIP
//! LOCKED`, one short autocommit statement per batch: it never waits for a
//! lock and never holds many.

use chrono::{DateTime, Utc};
use keel_sql::dialect::within_answer_bound;
use keel_sql::outbox::OutboxBackend;
use keel_store::OutboxRecord;
use keel_store::StoreError;
use sqlx::postgres::PgRow;

use super::codec::to_json;
use super::error::{db_error, sql_limit};
use super::{PgDialect, PgStore};

/// Inserts the rows given as parallel arrays and notifies the outbox
/// channel, in one statement.
const APPEND_SQL: &str = "\
WITH inserted AS (
  INSERT INTO keel_outbox (event_id, topic, partition_key, headers, payload, created_at)
  SELECT e, t, k, h::jsonb, p, $6
    FROM UNNEST($1::text[], $2::text[], $3::text[], $4::text[], $5::bytea[]) AS r(e, t, k, h, p)
  RETURNING 1)
SELECT pg_notify($7, '') FROM (SELECT COUNT(*) FROM inserted) AS done";

/// Leases up to `$5` unpublished rows to relay `$2` until `$3`, lowest id
/// first, given the time `$4`, under the schema's claim lock `$1`: one
/// statement and one round trip (migration 1502 has the function, and the
/// SQL).
const CLAIM_SQL: &str = "SELECT * FROM keel_outbox_claim($1, $2, $3, $4, $5)";

impl OutboxBackend for PgStore {
    async fn append_rows(
        &self,
        tx: &mut keel_sql::backend::Tx<Self>,
        records: &[OutboxRecord],
        created_at: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        let mut ids = Vec::with_capacity(records.len());
        let mut topics = Vec::with_capacity(records.len());
        let mut keys = Vec::with_capacity(records.len());
        let mut headers = Vec::with_capacity(records.len());
        let mut payloads = Vec::with_capacity(records.len());
        for record in records {
            ids.push(record.event_id.as_str());
            topics.push(record.topic.as_str());
            keys.push(record.partition_key.as_str());
            headers.push(to_json(&record.headers)?);
            payloads.push(record.payload.as_ref());
        }
        let append = sqlx::query(APPEND_SQL)
            .bind(ids)
            .bind(topics)
            .bind(keys)
            .bind(headers)
            .bind(payloads)
            .bind(created_at)
            .bind(self.channels.outbox.as_str())
            .execute(&mut **tx);
        within_answer_bound::<PgDialect, _>(append)
            .await
            .map_err(db_error)?;
        Ok(())
    }

    async fn claim_rows(
        &self,
        relay: &str,
        until: DateTime<Utc>,
        now: DateTime<Utc>,
        limit: usize,
    ) -> Result<Vec<PgRow>, StoreError> {
        let lock_key = format!("{}.outbox_claim", self.schema);
        let claim = sqlx::query(CLAIM_SQL)
            .bind(lock_key)
            .bind(relay)
            .bind(until)
            .bind(now)
            .bind(sql_limit(limit))
            .fetch_all(&self.pool);
        within_answer_bound::<PgDialect, _>(claim)
            .await
            .map_err(db_error)
    }
}
