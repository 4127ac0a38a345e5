//! Webhook endpoints, deliveries and the delivery log on PostgreSQL: the
//! storage behind `keel-http`'s webhook sender.
//!
//! A delivery is a row queued in the caller's transaction (which notifies
//! the webhooks channel, delivered at commit) and leased by a worker, so a
//! customer's slow endpoint is never inside the request that caused the
//! event, and a crashed worker's deliveries come back when their lease ends.
//!
//! The claim is one `UPDATE ... RETURNING`: for every enabled endpoint it
//! takes at most `per_endpoint` of its oldest due deliveries (a `LATERAL`
//! walk of the partial index of pending rows), numbers them after the
//! endpoint's deliveries already in flight, and leases the oldest due of
//! those that fit, up to `limit`. Claims of one schema run under a
//! transaction-scoped advisory lock, for the same reason as the outbox's:
//! the in-flight counts must include the claim running next door, or two
//! workers together would exceed `per_endpoint`.
//!
//! Completion is batched: one transaction records any number of attempts
//! (`INSERT ... SELECT FROM jsonb_to_recordset`), moves their deliveries
//! (only while the worker still holds the lease) and each endpoint's failure
//! window once.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use keel_messaging::StoreError;
use keel_messaging::store::{
    ClaimedDelivery, DeliveryAttempt, DeliveryFilter, DeliveryOutcome, DeliveryStatus, Store,
    WebhookDelivery, WebhookEndpoint, WebhookFormat, WebhookMessage, WebhookSecret, WebhookStore,
};
use serde::Serialize;
use sqlx::Row;
use sqlx::postgres::PgRow;

use crate::PgStore;
use crate::store::codec::to_json;
use crate::store::commit_own;
use crate::store::error::{corrupt, db_error, sql_limit};
use crate::store::retry::retry;

const ENDPOINT_COLUMNS: &str = "id, url, description, event_types::text AS event_types, \
    secrets::text AS secrets, enabled, disabled_reason, disabled_at, failing_since, \
    last_success_at, created_at, updated_at, tenant, format";

const DELIVERY_COLUMNS: &str = "id, endpoint_id, event_id, event_type, payload, status, \
    attempts, next_attempt_at, created_at, updated_at, leased_by, leased_until";

const ENDPOINT_INSERT_SQL: &str = "\
INSERT INTO keel_webhook_endpoints (id, url, description, event_types, secrets, enabled,
    disabled_reason, disabled_at, failing_since, last_success_at, created_at, updated_at, tenant,
    format)
VALUES ($1, $2, $3, $4::jsonb, $5::jsonb, $6, $7, $8, $9, $10, $11, $12, $13, $14)";

const ENDPOINT_UPDATE_SQL: &str = "\
UPDATE keel_webhook_endpoints SET url = $2, description = $3, event_types = $4::jsonb,
       updated_at = $5
 WHERE id = $1";

const DISABLE_SQL: &str = "\
UPDATE keel_webhook_endpoints
   SET enabled = FALSE, disabled_reason = $2, disabled_at = $3, updated_at = $3
 WHERE id = $1 AND enabled";

const DISABLE_DELIVERIES_SQL: &str = "\
UPDATE keel_webhook_deliveries
   SET status = 'disabled', leased_by = NULL, leased_until = NULL, updated_at = $2
 WHERE endpoint_id = $1 AND status = 'pending'";

const ENABLE_SQL: &str = "\
UPDATE keel_webhook_endpoints
   SET enabled = TRUE, disabled_reason = NULL, disabled_at = NULL, failing_since = NULL,
       updated_at = $2
 WHERE id = $1 AND NOT enabled";

/// Queues the (endpoint, message) pairs given as parallel arrays, skipping
/// pairs already queued; returns the pending rows it created.
const ENQUEUE_SQL: &str = "\
INSERT INTO keel_webhook_deliveries (endpoint_id, event_id, event_type, payload, status,
    attempts, next_attempt_at, created_at, updated_at)
SELECT e, i, t, p, s, 0, $6, $6, $6
  FROM UNNEST($1::text[], $2::text[], $3::text[], $4::bytea[], $5::text[]) AS r(e, i, t, p, s)
ON CONFLICT (endpoint_id, event_id) DO NOTHING
RETURNING status";

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
          created_at, updated_at, leased_by, leased_until";

/// Adds the attempts of a batch, given as a JSON array (see
/// [`StoredAttempt`]), in one statement.
const ATTEMPTS_INSERT_SQL: &str = "\
INSERT INTO keel_webhook_attempts (delivery_id, attempt, at, url, request_headers,
    response_status, response_body, latency_us, error)
SELECT d, n, at, url, h, s, b, l, e
  FROM jsonb_to_recordset($1::jsonb)
    AS r(d BIGINT, n INTEGER, at TIMESTAMPTZ, url TEXT, h JSONB, s INTEGER, b TEXT, l BIGINT,
         e TEXT)";

/// Moves the deliveries of a batch still leased by `$2`, in one statement.
const COMPLETE_SQL: &str = "\
UPDATE keel_webhook_deliveries AS d
   SET status = j.st, attempts = j.n, next_attempt_at = COALESCE(j.next, d.next_attempt_at),
       updated_at = j.at, leased_by = NULL, leased_until = NULL
  FROM jsonb_to_recordset($1::jsonb)
    AS j(d BIGINT, st TEXT, n INTEGER, next TIMESTAMPTZ, at TIMESTAMPTZ)
 WHERE d.id = j.d AND d.leased_by = $2 AND d.status = 'pending'";

/// A success at `$2` ends the failure window unless a failure after it
/// already started a new one.
const SUCCESS_SQL: &str = "\
UPDATE keel_webhook_endpoints
   SET last_success_at = GREATEST(COALESCE(last_success_at, $2), $2),
       failing_since = CASE WHEN failing_since > $2 THEN failing_since ELSE NULL END
 WHERE id = $1";

/// A failure at `$2` starts the failure window, unless it is running since
/// earlier or a later success was recorded already.
const FAILURE_SQL: &str = "\
UPDATE keel_webhook_endpoints
   SET failing_since = CASE
         WHEN last_success_at IS NOT NULL AND last_success_at >= $2 THEN failing_since
         WHEN failing_since IS NULL OR failing_since > $2 THEN $2
         ELSE failing_since END
 WHERE id = $1";

const RESEND_SQL: &str = "\
UPDATE keel_webhook_deliveries AS d
   SET status = 'pending', attempts = 0, next_attempt_at = $2, updated_at = $2,
       leased_by = NULL, leased_until = NULL
 WHERE d.id = $1
   AND NOT (d.status = 'pending' AND d.leased_until IS NOT NULL AND d.leased_until > $2)
   AND EXISTS (SELECT 1 FROM keel_webhook_endpoints e
                WHERE e.id = d.endpoint_id AND e.enabled)";

const REPLAY_SQL: &str = "\
UPDATE keel_webhook_deliveries
   SET status = 'pending', attempts = 0, next_attempt_at = $5, updated_at = $5,
       leased_by = NULL, leased_until = NULL
 WHERE endpoint_id = $1 AND created_at >= $2 AND created_at < $3
   AND (status IN ('failed', 'disabled') OR ($4 AND status = 'succeeded'))";

const LIST_SQL: &str = "\
SELECT id, endpoint_id, event_id, event_type, payload, status, attempts, next_attempt_at,
       created_at, updated_at, leased_by, leased_until
  FROM keel_webhook_deliveries
 WHERE ($1::text IS NULL OR endpoint_id = $1)
   AND ($2::text IS NULL OR event_id = $2)
   AND ($3::text IS NULL OR status = $3)
   AND ($4::timestamptz IS NULL OR created_at >= $4)
   AND ($5::timestamptz IS NULL OR created_at < $5)
   AND ($6::bigint IS NULL OR id < $6)
 ORDER BY id DESC
 LIMIT $7";

const ATTEMPTS_SQL: &str = "\
SELECT delivery_id, attempt, at, url, request_headers::text AS request_headers,
       response_status, response_body, latency_us, error
  FROM keel_webhook_attempts WHERE delivery_id = $1 ORDER BY id";

/// Deletes a bounded batch of finished deliveries with their attempts, in
/// one statement (the attempts first, through the foreign key's order).
const PRUNE_SQL: &str = "\
WITH doomed AS (
  SELECT id FROM keel_webhook_deliveries
   WHERE status <> 'pending' AND updated_at < $1
   ORDER BY updated_at LIMIT $2 FOR UPDATE SKIP LOCKED),
gone_attempts AS (
  DELETE FROM keel_webhook_attempts WHERE delivery_id IN (SELECT id FROM doomed))
SELECT id FROM doomed";

/// The default page of [`WebhookStore::webhook_delivery_list`].
const DEFAULT_LIST_LIMIT: usize = 100;

#[async_trait]
impl WebhookStore for PgStore {
    async fn webhook_endpoint_create(&self, endpoint: &WebhookEndpoint) -> Result<(), StoreError> {
        let event_types = to_json(&endpoint.event_types)?;
        let secrets = to_json(&endpoint.secrets)?;
        retry("webhook_endpoint_create", || async {
            sqlx::query(ENDPOINT_INSERT_SQL)
                .bind(endpoint.id.as_str())
                .bind(endpoint.url.as_str())
                .bind(endpoint.description.as_str())
                .bind(event_types.as_str())
                .bind(secrets.as_str())
                .bind(endpoint.enabled)
                .bind(endpoint.disabled_reason.as_deref())
                .bind(endpoint.disabled_at)
                .bind(endpoint.failing_since)
                .bind(endpoint.last_success_at)
                .bind(endpoint.created_at)
                .bind(endpoint.updated_at)
                .bind(endpoint.tenant.as_str())
                .bind(endpoint.format.as_str())
                .execute(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
        Ok(())
    }

    async fn webhook_endpoint_get(&self, id: &str) -> Result<Option<WebhookEndpoint>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {ENDPOINT_COLUMNS} FROM keel_webhook_endpoints WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await
        .map_err(db_error)?;
        row.as_ref().map(endpoint_from_row).transpose()
    }

    async fn webhook_endpoint_list(&self) -> Result<Vec<WebhookEndpoint>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {ENDPOINT_COLUMNS} FROM keel_webhook_endpoints ORDER BY created_at, id"
        ))
        .fetch_all(&self.pool)
        .await
        .map_err(db_error)?;
        rows.iter().map(endpoint_from_row).collect()
    }

    async fn webhook_endpoint_update(
        &self,
        endpoint: &WebhookEndpoint,
        now: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        let event_types = to_json(&endpoint.event_types)?;
        let done = retry("webhook_endpoint_update", || async {
            sqlx::query(ENDPOINT_UPDATE_SQL)
                .bind(endpoint.id.as_str())
                .bind(endpoint.url.as_str())
                .bind(endpoint.description.as_str())
                .bind(event_types.as_str())
                .bind(now)
                .execute(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
        if done.rows_affected() == 0 {
            return Err(not_found_endpoint(&endpoint.id));
        }
        Ok(())
    }

    async fn webhook_endpoint_rotate_secret(
        &self,
        id: &str,
        secret: &WebhookSecret,
        previous_expires_at: DateTime<Utc>,
    ) -> Result<WebhookEndpoint, StoreError> {
        retry("webhook_endpoint_rotate_secret", || async {
            let mut tx = self.begin().await?;
            let current: Option<String> = sqlx::query_scalar(
                "SELECT secrets::text FROM keel_webhook_endpoints WHERE id = $1 FOR UPDATE",
            )
            .bind(id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_error)?;
            let Some(current) = current else {
                return Err(not_found_endpoint(id));
            };
            let mut secrets: Vec<WebhookSecret> =
                serde_json::from_str(&current).map_err(|e| corrupt("webhook secrets", e))?;
            // Keep only the newest current secret, for the grace period.
            let mut kept: Vec<WebhookSecret> = secrets.pop().into_iter().collect();
            for previous in &mut kept {
                previous.expires_at = Some(
                    previous
                        .expires_at
                        .map_or(previous_expires_at, |e| e.min(previous_expires_at)),
                );
            }
            kept.push(secret.clone());
            let row = sqlx::query(&format!(
                "UPDATE keel_webhook_endpoints SET secrets = $2::jsonb, updated_at = $3 \
                 WHERE id = $1 RETURNING {ENDPOINT_COLUMNS}"
            ))
            .bind(id)
            .bind(to_json(&kept)?)
            .bind(secret.created_at)
            .fetch_one(&mut *tx)
            .await
            .map_err(db_error)?;
            let endpoint = endpoint_from_row(&row)?;
            commit_own(self, tx).await?;
            Ok(endpoint)
        })
        .await
    }

    async fn webhook_endpoint_disable(
        &self,
        id: &str,
        reason: &str,
        at: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        retry("webhook_endpoint_disable", || async {
            let mut tx = self.begin().await?;
            let done = sqlx::query(DISABLE_SQL)
                .bind(id)
                .bind(reason)
                .bind(at)
                .execute(&mut *tx)
                .await
                .map_err(db_error)?;
            if done.rows_affected() == 0 {
                let exists = endpoint_exists(&mut tx, id).await?;
                self.rollback(tx).await?;
                return if exists {
                    Ok(false)
                } else {
                    Err(not_found_endpoint(id))
                };
            }
            let parked = sqlx::query(DISABLE_DELIVERIES_SQL)
                .bind(id)
                .bind(at)
                .execute(&mut *tx)
                .await
                .map_err(db_error)?
                .rows_affected();
            commit_own(self, tx).await?;
            tracing::debug!(endpoint = id, parked, "webhook endpoint disabled");
            Ok(true)
        })
        .await
    }

    async fn webhook_endpoint_enable(
        &self,
        id: &str,
        at: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        let done = retry("webhook_endpoint_enable", || async {
            sqlx::query(ENABLE_SQL)
                .bind(id)
                .bind(at)
                .execute(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
        if done.rows_affected() == 1 {
            return Ok(true);
        }
        let exists: Option<i32> =
            sqlx::query_scalar("SELECT 1 FROM keel_webhook_endpoints WHERE id = $1")
                .bind(id)
                .fetch_optional(&self.pool)
                .await
                .map_err(db_error)?;
        match exists {
            Some(_) => Ok(false),
            None => Err(not_found_endpoint(id)),
        }
    }

    async fn webhook_endpoint_delete(&self, id: &str) -> Result<bool, StoreError> {
        retry("webhook_endpoint_delete", || async {
            let mut tx = self.begin().await?;
            sqlx::query(
                "DELETE FROM keel_webhook_attempts WHERE delivery_id IN \
                 (SELECT id FROM keel_webhook_deliveries WHERE endpoint_id = $1)",
            )
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(db_error)?;
            sqlx::query("DELETE FROM keel_webhook_deliveries WHERE endpoint_id = $1")
                .bind(id)
                .execute(&mut *tx)
                .await
                .map_err(db_error)?;
            let done = sqlx::query("DELETE FROM keel_webhook_endpoints WHERE id = $1")
                .bind(id)
                .execute(&mut *tx)
                .await
                .map_err(db_error)?;
            commit_own(self, tx).await?;
            Ok(done.rows_affected() == 1)
        })
        .await
    }

    async fn webhook_enqueue(
        &self,
        tx: &mut <Self as Store>::Tx,
        messages: &[WebhookMessage],
        now: DateTime<Utc>,
    ) -> Result<u64, StoreError> {
        if messages.is_empty() {
            return Ok(0);
        }
        let rows = sqlx::query(&format!(
            "SELECT {ENDPOINT_COLUMNS} FROM keel_webhook_endpoints ORDER BY created_at, id"
        ))
        .fetch_all(&mut **tx)
        .await
        .map_err(db_error)?;
        let endpoints = rows
            .iter()
            .map(endpoint_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        let mut endpoint_ids = Vec::new();
        let mut event_ids = Vec::new();
        let mut event_types = Vec::new();
        let mut payloads = Vec::new();
        let mut statuses = Vec::new();
        for message in messages {
            for endpoint in endpoints
                .iter()
                .filter(|e| e.subscribes_to(&message.event_type))
            {
                let status = if endpoint.enabled {
                    DeliveryStatus::Pending
                } else {
                    DeliveryStatus::Disabled
                };
                endpoint_ids.push(endpoint.id.as_str());
                event_ids.push(message.event_id.as_str());
                event_types.push(message.event_type.as_str());
                payloads.push(message.payload.as_ref());
                statuses.push(status.as_str());
            }
        }
        if endpoint_ids.is_empty() {
            return Ok(0);
        }
        let created: Vec<String> = sqlx::query_scalar(ENQUEUE_SQL)
            .bind(endpoint_ids)
            .bind(event_ids)
            .bind(event_types)
            .bind(payloads)
            .bind(statuses)
            .bind(now)
            .fetch_all(&mut **tx)
            .await
            .map_err(db_error)?;
        let queued = created.iter().filter(|s| s.as_str() == "pending").count() as u64;
        if queued > 0 {
            crate::store::notify(tx, &self.channels.webhooks, "").await?;
        }
        Ok(queued)
    }

    async fn webhook_claim_due(
        &self,
        worker: &str,
        now: DateTime<Utc>,
        limit: usize,
        per_endpoint: usize,
        lease: Duration,
    ) -> Result<Vec<ClaimedDelivery>, StoreError> {
        if limit == 0 || per_endpoint == 0 {
            return Ok(Vec::new());
        }
        let lease = chrono::Duration::from_std(lease).unwrap_or(chrono::Duration::MAX);
        let until = now
            .checked_add_signed(lease)
            .unwrap_or(DateTime::<Utc>::MAX_UTC);
        let lock_key = format!("{}.webhook_claim", self.schema);
        let (rows, endpoint_rows) = retry("webhook_claim_due", || async {
            let mut tx = self.begin().await?;
            sqlx::query(CLAIM_LOCK_SQL)
                .bind(lock_key.as_str())
                .execute(&mut *tx)
                .await
                .map_err(db_error)?;
            let rows = sqlx::query(CLAIM_SQL)
                .bind(worker)
                .bind(until)
                .bind(now)
                .bind(sql_limit(limit))
                .bind(sql_limit(per_endpoint))
                .fetch_all(&mut *tx)
                .await
                .map_err(db_error)?;
            let ids: Vec<String> = rows
                .iter()
                .map(|row| row.try_get::<String, _>("endpoint_id"))
                .collect::<Result<_, _>>()
                .map_err(db_error)?;
            let endpoint_rows = if ids.is_empty() {
                Vec::new()
            } else {
                sqlx::query(&format!(
                    "SELECT {ENDPOINT_COLUMNS} FROM keel_webhook_endpoints WHERE id = ANY($1)"
                ))
                .bind(ids)
                .fetch_all(&mut *tx)
                .await
                .map_err(db_error)?
            };
            // A lost COMMIT leaves the rows leased to this worker or to no
            // one; either way their leases end, so no resolving is needed.
            self.commit(tx).await?;
            Ok((rows, endpoint_rows))
        })
        .await?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let mut deliveries = rows
            .iter()
            .map(delivery_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        // RETURNING does not promise an order.
        deliveries.sort_unstable_by_key(|d| (d.next_attempt_at, d.id));
        let endpoints = endpoint_rows
            .iter()
            .map(|row| endpoint_from_row(row).map(|e| (e.id.clone(), e)))
            .collect::<Result<HashMap<_, _>, _>>()?;
        deliveries
            .into_iter()
            .map(|delivery| {
                let endpoint = endpoints
                    .get(&delivery.endpoint_id)
                    .cloned()
                    .ok_or_else(|| corrupt("webhook delivery", "its endpoint vanished"))?;
                Ok(ClaimedDelivery { delivery, endpoint })
            })
            .collect()
    }

    async fn webhook_complete(
        &self,
        worker: &str,
        outcomes: &[DeliveryOutcome],
    ) -> Result<u64, StoreError> {
        if outcomes.is_empty() {
            return Ok(0);
        }
        let mut attempts = Vec::with_capacity(outcomes.len());
        let mut moves = Vec::with_capacity(outcomes.len());
        for outcome in outcomes {
            let attempt = &outcome.attempt;
            attempts.push(StoredAttempt {
                d: attempt.delivery_id,
                n: attempt.attempt,
                at: attempt.at,
                url: &attempt.url,
                h: &attempt.request_headers,
                s: attempt.response_status,
                b: attempt.response_body.as_deref(),
                l: i64::try_from(attempt.latency.as_micros()).unwrap_or(i64::MAX),
                e: attempt.error.as_deref(),
            });
            moves.push(StoredMove {
                d: attempt.delivery_id,
                st: outcome.status.as_str(),
                n: attempt.attempt,
                next: outcome.next_attempt_at,
                at: attempt.at,
            });
        }
        let attempts = to_json(&attempts)?;
        let moves = to_json(&moves)?;
        let ids: Vec<i64> = outcomes.iter().map(|o| o.attempt.delivery_id).collect();
        retry("webhook_complete", || async {
            let mut tx = self.begin().await?;
            let owners: HashMap<i64, String> = sqlx::query(
                "SELECT id, endpoint_id FROM keel_webhook_deliveries WHERE id = ANY($1)",
            )
            .bind(&ids)
            .fetch_all(&mut *tx)
            .await
            .map_err(db_error)?
            .iter()
            .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
            .collect::<Result<_, sqlx::Error>>()
            .map_err(db_error)?;
            sqlx::query(ATTEMPTS_INSERT_SQL)
                .bind(attempts.as_str())
                .execute(&mut *tx)
                .await
                .map_err(db_error)?;
            let applied = sqlx::query(COMPLETE_SQL)
                .bind(moves.as_str())
                .bind(worker)
                .execute(&mut *tx)
                .await
                .map_err(db_error)?
                .rows_affected();
            for (endpoint, health) in health(outcomes, &owners) {
                if let Some(success) = health.success {
                    sqlx::query(SUCCESS_SQL)
                        .bind(endpoint)
                        .bind(success)
                        .execute(&mut *tx)
                        .await
                        .map_err(db_error)?;
                }
                if let Some(failure) = health.first_failure {
                    sqlx::query(FAILURE_SQL)
                        .bind(endpoint)
                        .bind(failure)
                        .execute(&mut *tx)
                        .await
                        .map_err(db_error)?;
                }
            }
            commit_own(self, tx).await?;
            Ok(applied)
        })
        .await
    }

    async fn webhook_delivery_get(&self, id: i64) -> Result<Option<WebhookDelivery>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {DELIVERY_COLUMNS} FROM keel_webhook_deliveries WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(&self.pool)
        .await
        .map_err(db_error)?;
        row.as_ref().map(delivery_from_row).transpose()
    }

    async fn webhook_delivery_list(
        &self,
        filter: &DeliveryFilter,
    ) -> Result<Vec<WebhookDelivery>, StoreError> {
        let limit = filter.limit.unwrap_or(DEFAULT_LIST_LIMIT);
        if limit == 0 {
            return Ok(Vec::new());
        }
        let rows = sqlx::query(LIST_SQL)
            .bind(filter.endpoint_id.as_deref())
            .bind(filter.event_id.as_deref())
            .bind(filter.status.map(DeliveryStatus::as_str))
            .bind(filter.created_from)
            .bind(filter.created_before)
            .bind(filter.before_id)
            .bind(sql_limit(limit))
            .fetch_all(&self.pool)
            .await
            .map_err(db_error)?;
        rows.iter().map(delivery_from_row).collect()
    }

    async fn webhook_attempts(&self, delivery_id: i64) -> Result<Vec<DeliveryAttempt>, StoreError> {
        let rows = sqlx::query(ATTEMPTS_SQL)
            .bind(delivery_id)
            .fetch_all(&self.pool)
            .await
            .map_err(db_error)?;
        rows.iter().map(attempt_from_row).collect()
    }

    async fn webhook_resend(
        &self,
        delivery_id: i64,
        now: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        let done = retry("webhook_resend", || async {
            sqlx::query(RESEND_SQL)
                .bind(delivery_id)
                .bind(now)
                .execute(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
        if done.rows_affected() == 1 {
            return Ok(true);
        }
        let exists: Option<i32> =
            sqlx::query_scalar("SELECT 1 FROM keel_webhook_deliveries WHERE id = $1")
                .bind(delivery_id)
                .fetch_optional(&self.pool)
                .await
                .map_err(db_error)?;
        match exists {
            Some(_) => Ok(false),
            None => Err(StoreError::NotFound(format!(
                "webhook delivery {delivery_id}"
            ))),
        }
    }

    async fn webhook_replay(
        &self,
        endpoint_id: &str,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        include_succeeded: bool,
        now: DateTime<Utc>,
    ) -> Result<u64, StoreError> {
        retry("webhook_replay", || async {
            let mut tx = self.begin().await?;
            let enabled: Option<bool> = sqlx::query_scalar(
                "SELECT enabled FROM keel_webhook_endpoints WHERE id = $1 FOR SHARE",
            )
            .bind(endpoint_id)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_error)?;
            match enabled {
                None => return Err(not_found_endpoint(endpoint_id)),
                Some(false) => {
                    return Err(StoreError::Conflict(format!(
                        "webhook endpoint {endpoint_id:?} is disabled: enable it before replaying"
                    )));
                }
                Some(true) => {}
            }
            let done = sqlx::query(REPLAY_SQL)
                .bind(endpoint_id)
                .bind(from)
                .bind(to)
                .bind(include_succeeded)
                .bind(now)
                .execute(&mut *tx)
                .await
                .map_err(db_error)?;
            commit_own(self, tx).await?;
            Ok(done.rows_affected())
        })
        .await
    }

    async fn webhook_failing_since(
        &self,
        endpoint_id: &str,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        let row: Option<Option<DateTime<Utc>>> =
            sqlx::query_scalar("SELECT failing_since FROM keel_webhook_endpoints WHERE id = $1")
                .bind(endpoint_id)
                .fetch_optional(&self.pool)
                .await
                .map_err(db_error)?;
        row.ok_or_else(|| not_found_endpoint(endpoint_id))
    }

    async fn webhook_prune(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError> {
        if batch == 0 {
            return Ok(0);
        }
        let deleted = retry("webhook_prune", || async {
            let mut tx = self.begin().await?;
            let ids: Vec<i64> = sqlx::query_scalar(PRUNE_SQL)
                .bind(before)
                .bind(sql_limit(batch))
                .fetch_all(&mut *tx)
                .await
                .map_err(db_error)?;
            if ids.is_empty() {
                self.rollback(tx).await?;
                return Ok(0);
            }
            let done = sqlx::query("DELETE FROM keel_webhook_deliveries WHERE id = ANY($1)")
                .bind(&ids)
                .execute(&mut *tx)
                .await
                .map_err(db_error)?;
            commit_own(self, tx).await?;
            Ok(done.rows_affected())
        })
        .await?;
        if deleted > 0 {
            tracing::debug!(deleted, "webhook deliveries pruned");
        }
        Ok(deleted)
    }
}

/// What one batch says about an endpoint's health.
#[derive(Default)]
struct Health {
    /// The latest successful attempt.
    success: Option<DateTime<Utc>>,
    /// The earliest failed attempt after it (what may start the window).
    first_failure: Option<DateTime<Utc>>,
}

/// Per endpoint of a batch: the latest success, and the earliest failure
/// after it (what moves the failure window).
fn health<'a>(
    outcomes: &[DeliveryOutcome],
    owners: &'a HashMap<i64, String>,
) -> HashMap<&'a str, Health> {
    let mut seen: HashMap<&str, (Health, Vec<DateTime<Utc>>)> = HashMap::new();
    for outcome in outcomes {
        let attempt = &outcome.attempt;
        if let Some(endpoint) = owners.get(&attempt.delivery_id) {
            let (health, failures) = seen.entry(endpoint.as_str()).or_default();
            if attempt.succeeded() {
                health.success = health.success.max(Some(attempt.at));
            } else {
                failures.push(attempt.at);
            }
        }
    }
    seen.into_iter()
        .map(|(endpoint, (mut health, failures))| {
            health.first_failure = failures
                .into_iter()
                .filter(|at| health.success.is_none_or(|s| *at > s))
                .min();
            (endpoint, health)
        })
        .collect()
}

async fn endpoint_exists(tx: &mut <PgStore as Store>::Tx, id: &str) -> Result<bool, StoreError> {
    let exists: Option<i32> =
        sqlx::query_scalar("SELECT 1 FROM keel_webhook_endpoints WHERE id = $1")
            .bind(id)
            .fetch_optional(&mut **tx)
            .await
            .map_err(db_error)?;
    Ok(exists.is_some())
}

/// One attempt of a batch, as passed to [`ATTEMPTS_INSERT_SQL`].
#[derive(Serialize)]
struct StoredAttempt<'a> {
    d: i64,
    n: u32,
    at: DateTime<Utc>,
    url: &'a str,
    h: &'a [(String, String)],
    s: Option<u16>,
    b: Option<&'a str>,
    l: i64,
    e: Option<&'a str>,
}

/// One delivery's move of a batch, as passed to [`COMPLETE_SQL`].
#[derive(Serialize)]
struct StoredMove {
    d: i64,
    st: &'static str,
    n: u32,
    next: Option<DateTime<Utc>>,
    at: DateTime<Utc>,
}

fn endpoint_from_row(row: &PgRow) -> Result<WebhookEndpoint, StoreError> {
    let event_types: String = row.try_get("event_types").map_err(db_error)?;
    let secrets: String = row.try_get("secrets").map_err(db_error)?;
    Ok(WebhookEndpoint {
        id: row.try_get("id").map_err(db_error)?,
        url: row.try_get("url").map_err(db_error)?,
        description: row.try_get("description").map_err(db_error)?,
        event_types: serde_json::from_str(&event_types)
            .map_err(|e| corrupt("webhook event types", e))?,
        secrets: serde_json::from_str(&secrets).map_err(|e| corrupt("webhook secrets", e))?,
        enabled: row.try_get("enabled").map_err(db_error)?,
        disabled_reason: row.try_get("disabled_reason").map_err(db_error)?,
        disabled_at: row.try_get("disabled_at").map_err(db_error)?,
        failing_since: row.try_get("failing_since").map_err(db_error)?,
        last_success_at: row.try_get("last_success_at").map_err(db_error)?,
        created_at: row.try_get("created_at").map_err(db_error)?,
        updated_at: row.try_get("updated_at").map_err(db_error)?,
        tenant: row.try_get("tenant").map_err(db_error)?,
        format: {
            let name: String = row.try_get("format").map_err(db_error)?;
            WebhookFormat::parse(&name).ok_or_else(|| corrupt("webhook format", &name))?
        },
    })
}

fn delivery_from_row(row: &PgRow) -> Result<WebhookDelivery, StoreError> {
    let status: String = row.try_get("status").map_err(db_error)?;
    let payload: Vec<u8> = row.try_get("payload").map_err(db_error)?;
    let attempts: i32 = row.try_get("attempts").map_err(db_error)?;
    Ok(WebhookDelivery {
        id: row.try_get("id").map_err(db_error)?,
        endpoint_id: row.try_get("endpoint_id").map_err(db_error)?,
        event_id: row.try_get("event_id").map_err(db_error)?,
        event_type: row.try_get("event_type").map_err(db_error)?,
        payload: Bytes::from(payload),
        status: DeliveryStatus::parse(&status)
            .ok_or_else(|| corrupt("webhook delivery status", &status))?,
        attempts: u32::try_from(attempts).map_err(|e| corrupt("webhook attempts", e))?,
        next_attempt_at: row.try_get("next_attempt_at").map_err(db_error)?,
        created_at: row.try_get("created_at").map_err(db_error)?,
        updated_at: row.try_get("updated_at").map_err(db_error)?,
        leased_by: row.try_get("leased_by").map_err(db_error)?,
        leased_until: row.try_get("leased_until").map_err(db_error)?,
    })
}

fn attempt_from_row(row: &PgRow) -> Result<DeliveryAttempt, StoreError> {
    let headers: String = row.try_get("request_headers").map_err(db_error)?;
    let attempt: i32 = row.try_get("attempt").map_err(db_error)?;
    let status: Option<i32> = row.try_get("response_status").map_err(db_error)?;
    let latency: i64 = row.try_get("latency_us").map_err(db_error)?;
    Ok(DeliveryAttempt {
        delivery_id: row.try_get("delivery_id").map_err(db_error)?,
        attempt: u32::try_from(attempt).map_err(|e| corrupt("webhook attempt number", e))?,
        at: row.try_get("at").map_err(db_error)?,
        url: row.try_get("url").map_err(db_error)?,
        request_headers: serde_json::from_str(&headers)
            .map_err(|e| corrupt("webhook request headers", e))?,
        response_status: status
            .map(|s| u16::try_from(s).map_err(|e| corrupt("webhook response status", e)))
            .transpose()?,
        response_body: row.try_get("response_body").map_err(db_error)?,
        latency: Duration::from_micros(u64::try_from(latency).unwrap_or(0)),
        error: row.try_get("error").map_err(db_error)?,
    })
}

fn not_found_endpoint(id: &str) -> StoreError {
    StoreError::NotFound(format!("webhook endpoint {id:?}"))
}
