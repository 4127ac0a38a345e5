//! The webhook deliveries' SQLite half: the claim (the rest is the shared
//! core's `keel_sql::webhooks`).
//!
//! The claim is one `UPDATE ... RETURNING` in the writer's group commit: for
//! every enabled endpoint it takes at most `per_endpoint` of its oldest due
//! deliveries through the partial `(endpoint_id, next_attempt_at)` index,
//! numbers them after the endpoint's deliveries already in flight (any
//! worker's live leases), and leases the oldest due of those that fit, up to
//! `limit`. Its cost grows with the number of endpoints, not with the
//! backlog: a flood to one endpoint neither slows the claim down nor starves
//! the other endpoints.

use chrono::{DateTime, Utc};
use keel_sql::webhooks::WebhookBackend;
use keel_store::StoreError;
use sqlx::sqlite::SqliteRow;

use crate::SqliteStore;
use crate::store::codec::to_ms;
use crate::store::error::sql_limit;

/// Leases due deliveries to `$1` until `$2`, given the time `$3`, at most
/// `$4` in all and at most `$5` in flight per endpoint (see the module docs).
/// The in-flight counts are taken once per endpoint from the small index of
/// leased rows (`INDEXED BY`: the planner would otherwise count through the
/// much larger index of pending rows, once per candidate).
const CLAIM_SQL: &str = "\
WITH inflight AS MATERIALIZED (
  SELECT endpoint_id, COUNT(*) AS n
    FROM keel_webhook_deliveries INDEXED BY keel_webhook_deliveries_leased
   WHERE leased_until IS NOT NULL AND leased_until > $3 AND status = 'pending'
   GROUP BY endpoint_id),
candidates AS (
  SELECT d.id, d.next_attempt_at,
         ROW_NUMBER() OVER (PARTITION BY d.endpoint_id ORDER BY d.next_attempt_at, d.id)
           + COALESCE(i.n, 0) AS slot
    FROM keel_webhook_endpoints e
    LEFT JOIN inflight i ON i.endpoint_id = e.id
    JOIN keel_webhook_deliveries d
      ON d.id IN (SELECT x.id FROM keel_webhook_deliveries x INDEXED BY keel_webhook_deliveries_due
                   WHERE x.endpoint_id = e.id AND x.status = 'pending'
                     AND x.next_attempt_at <= $3
                     AND (x.leased_until IS NULL OR x.leased_until <= $3)
                   ORDER BY x.next_attempt_at, x.id
                   LIMIT $5)
   WHERE e.enabled = 1)
UPDATE keel_webhook_deliveries SET leased_by = $1, leased_until = $2
 WHERE id IN (SELECT id FROM candidates WHERE slot <= $5 ORDER BY next_attempt_at, id LIMIT $4)
RETURNING id, endpoint_id, event_id, event_type, payload, status, attempts, next_attempt_at,
          created_at, updated_at, leased_by, leased_until, traceparent";

impl WebhookBackend for SqliteStore {
    async fn claim_rows(
        &self,
        worker: &str,
        until: DateTime<Utc>,
        now: DateTime<Utc>,
        limit: usize,
        per_endpoint: usize,
    ) -> Result<Vec<SqliteRow>, StoreError> {
        let claim = sqlx::query(CLAIM_SQL)
            .bind(worker)
            .bind(to_ms(until))
            .bind(to_ms(now))
            .bind(sql_limit(limit))
            .bind(sql_limit(per_endpoint));
        self.claim(claim).await
    }
}

keel_sql::webhook_store!(SqliteStore);
