//! The webhook deliveries' PostgreSQL half: the claim (the rest is the
//! shared core's `keel_sql::webhooks`).
//!
//! The claim is one `UPDATE ... RETURNING`: for every enabled endpoint it
//! takes at most `per_endpoint` of its oldest due deliveries (a `LATERAL`
//! walk of the partial index of pending rows), numbers them after the
//! endpoint's deliveries already in flight, and leases the oldest due of
//! those that fit, up to `limit`. Claims of one schema run under a
//! transaction-scoped advisory lock, for the same reason as the outbox's:
//! the in-flight counts must include the claim running next door, or two
//! workers together would exceed `per_endpoint`.

use chrono::{DateTime, Utc};
use keel_sql::dialect::within_answer_bound;
use keel_sql::webhooks::WebhookBackend;
use keel_store::Store;
use keel_store::StoreError;
use sqlx::postgres::PgRow;

use crate::PgStore;
use crate::store::PgDialect;
use crate::store::error::{db_error, sql_limit};

const CLAIM_LOCK_SQL: &str = "SELECT pg_advisory_xact_lock(hashtext($1))";

/// Leases due deliveries to `$1` until `$2`, given the time `$3`, at most
/// `$4` in all and at most `$5` in flight per endpoint (see the module docs).
const CLAIM_SQL: &str = "\
WITH inflight AS (
  SELECT endpoint_id, COUNT(*) AS n
    FROM keel_webhook_deliveries
   WHERE leased_until IS NOT NULL AND leased_until > $3 AND status = 'pending'
   GROUP BY endpoint_id),
candidates AS (
  SELECT d.id, d.next_attempt_at,
         ROW_NUMBER() OVER (PARTITION BY e.id ORDER BY d.next_attempt_at, d.id)
           + COALESCE(i.n, 0) AS slot
    FROM keel_webhook_endpoints e
    LEFT JOIN inflight i ON i.endpoint_id = e.id
    CROSS JOIN LATERAL (
      SELECT x.id, x.next_attempt_at FROM keel_webhook_deliveries x
       WHERE x.endpoint_id = e.id AND x.status = 'pending'
         AND x.next_attempt_at <= $3
         AND (x.leased_until IS NULL OR x.leased_until <= $3)
       ORDER BY x.next_attempt_at, x.id
       LIMIT $5) d
   WHERE e.enabled)
UPDATE keel_webhook_deliveries SET leased_by = $1, leased_until = $2
 WHERE id IN (SELECT id FROM candidates WHERE slot <= $5 ORDER BY next_attempt_at, id LIMIT $4)
RETURNING id, endpoint_id, event_id, event_type, payload, status, attempts, next_attempt_at,
          created_at, updated_at, leased_by, leased_until, traceparent";

impl WebhookBackend for PgStore {
    async fn claim_rows(
        &self,
        worker: &str,
        until: DateTime<Utc>,
        now: DateTime<Utc>,
        limit: usize,
        per_endpoint: usize,
    ) -> Result<Vec<PgRow>, StoreError> {
        let mut tx = self.begin().await?;
        let lock = sqlx::query(CLAIM_LOCK_SQL)
            .bind(format!("{}.webhook_claim", self.schema))
            .execute(&mut *tx);
        within_answer_bound::<PgDialect, _>(lock)
            .await
            .map_err(db_error)?;
        let claim = sqlx::query(CLAIM_SQL)
            .bind(worker)
            .bind(until)
            .bind(now)
            .bind(sql_limit(limit))
            .bind(sql_limit(per_endpoint))
            .fetch_all(&mut *tx);
        let rows = within_answer_bound::<PgDialect, _>(claim)
            .await
            .map_err(db_error)?;
        // A lost COMMIT leaves the rows leased to this worker or to no one;
        // either way their leases end, so no resolving is needed.
        self.commit(tx).await?;
        Ok(rows)
    }
}

keel_sql::webhook_store!(PgStore);
