//! Webhook endpoints, deliveries and the delivery log on SQLite: the storage
//! behind `keel-http`'s webhook sender.
//!
//! A delivery is a row queued in the caller's transaction and leased by a
//! worker, so a customer's slow endpoint is never inside the request that
//! caused the event, and a crashed worker's deliveries come back when their
//! lease ends.
//!
//! The claim is one `UPDATE ... RETURNING`: for every enabled endpoint it
//! takes at most `per_endpoint` of its oldest due deliveries through the
//! partial `(endpoint_id, next_attempt_at)` index, numbers them after the
//! endpoint's deliveries already in flight (any worker's live leases), and
//! leases the oldest due of those that fit, up to `limit`. Its cost grows
//! with the number of endpoints, not with the backlog: a flood to one
//! endpoint neither slows the claim down nor starves the other endpoints.
//!
//! Completion is batched: one transaction records any number of attempts,
//! updates their deliveries (only while the worker still holds the lease)
//! and moves each endpoint's failure window once.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use keel_messaging::StoreError;
use keel_messaging::store::{
    ClaimedDelivery, DeliveryAttempt, DeliveryFilter, DeliveryOutcome, DeliveryStatus, Store,
    WebhookDelivery, WebhookEndpoint, WebhookFormat, WebhookMessage, WebhookSecret, WebhookStore,
};
use serde::{Deserialize, Serialize};
use sqlx::Row;
use sqlx::sqlite::SqliteRow;

use crate::SqliteStore;
use crate::store::codec::from_ms;
use crate::store::error::db_error;

const ENDPOINT_COLUMNS: &str = "id, url, description, event_types, secrets, enabled, \
    disabled_reason, disabled_at, failing_since, last_success_at, created_at, updated_at, tenant, format";

const DELIVERY_COLUMNS: &str = "id, endpoint_id, event_id, event_type, payload, status, \
    attempts, next_attempt_at, created_at, updated_at, leased_by, leased_until";

const ENDPOINT_INSERT_SQL: &str = "\
INSERT INTO keel_webhook_endpoints (id, url, description, event_types, secrets, enabled,
    disabled_reason, disabled_at, failing_since, last_success_at, created_at, updated_at, tenant,
    format)
VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14)";

const ENDPOINT_UPDATE_SQL: &str = "\
UPDATE keel_webhook_endpoints SET url = ?2, description = ?3, event_types = ?4, updated_at = ?5
 WHERE id = ?1";

const DISABLE_SQL: &str = "\
UPDATE keel_webhook_endpoints
   SET enabled = 0, disabled_reason = ?2, disabled_at = ?3, updated_at = ?3
 WHERE id = ?1 AND enabled = 1";

const DISABLE_DELIVERIES_SQL: &str = "\
UPDATE keel_webhook_deliveries
   SET status = 'disabled', leased_by = NULL, leased_until = NULL, updated_at = ?2
 WHERE endpoint_id = ?1 AND status = 'pending'";

const ENABLE_SQL: &str = "\
UPDATE keel_webhook_endpoints
   SET enabled = 1, disabled_reason = NULL, disabled_at = NULL, failing_since = NULL,
       updated_at = ?2
 WHERE id = ?1 AND enabled = 0";

const ENQUEUE_SQL: &str = "\
INSERT INTO keel_webhook_deliveries (endpoint_id, event_id, event_type, payload, status,
    attempts, next_attempt_at, created_at, updated_at)
VALUES (?1, ?2, ?3, ?4, ?5, 0, ?6, ?6, ?6)
ON CONFLICT (endpoint_id, event_id) DO NOTHING";

/// Leases due deliveries to `?1` until `?2`, given the time `?3`, at most
/// `?4` in all and at most `?5` in flight per endpoint (see the module docs).
/// The in-flight counts are taken once per endpoint from the small index of
/// leased rows (`INDEXED BY`: the planner would otherwise count through the
/// much larger index of pending rows, once per candidate).
const CLAIM_SQL: &str = "\
WITH inflight AS MATERIALIZED (
  SELECT endpoint_id, COUNT(*) AS n
    FROM keel_webhook_deliveries INDEXED BY keel_webhook_deliveries_leased
   WHERE leased_until IS NOT NULL AND leased_until > ?3 AND status = 'pending'
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
                     AND x.next_attempt_at <= ?3
                     AND (x.leased_until IS NULL OR x.leased_until <= ?3)
                   ORDER BY x.next_attempt_at, x.id
                   LIMIT ?5)
   WHERE e.enabled = 1)
UPDATE keel_webhook_deliveries SET leased_by = ?1, leased_until = ?2
 WHERE id IN (SELECT id FROM candidates WHERE slot <= ?5 ORDER BY next_attempt_at, id LIMIT ?4)
RETURNING id, endpoint_id, event_id, event_type, payload, status, attempts, next_attempt_at,
          created_at, updated_at, leased_by, leased_until";

/// Adds the attempts of a batch, given as a JSON array (see
/// [`StoredAttempt`]), in one statement: one round trip to SQLite's thread
/// for any number of attempts.
const ATTEMPTS_INSERT_SQL: &str = "\
INSERT INTO keel_webhook_attempts (delivery_id, attempt, at, url, request_headers,
    response_status, response_body, latency_us, error)
SELECT json_extract(value, '$.d'), json_extract(value, '$.n'), json_extract(value, '$.at'),
       json_extract(value, '$.url'), json_extract(value, '$.h'), json_extract(value, '$.s'),
       json_extract(value, '$.b'), json_extract(value, '$.l'), json_extract(value, '$.e')
  FROM json_each(?1)";

/// Moves the deliveries of a batch still leased by `?2`, in one statement.
const COMPLETE_SQL: &str = "\
UPDATE keel_webhook_deliveries AS d
   SET status = j.status, attempts = j.n, next_attempt_at = COALESCE(j.next, d.next_attempt_at),
       updated_at = j.at, leased_by = NULL, leased_until = NULL
  FROM (SELECT json_extract(value, '$.d') AS id, json_extract(value, '$.st') AS status,
               json_extract(value, '$.n') AS n, json_extract(value, '$.next') AS next,
               json_extract(value, '$.at') AS at
          FROM json_each(?1)) AS j
 WHERE d.id = j.id AND d.leased_by = ?2 AND d.status = 'pending'";

/// A success at `?2` ends the failure window unless a failure after it
/// already started a new one.
const SUCCESS_SQL: &str = "\
UPDATE keel_webhook_endpoints
   SET last_success_at = MAX(COALESCE(last_success_at, ?2), ?2),
       failing_since = CASE WHEN failing_since > ?2 THEN failing_since ELSE NULL END
 WHERE id = ?1";

/// A failure at `?2` starts the failure window, unless it is running since
/// earlier or a later success was recorded already.
const FAILURE_SQL: &str = "\
UPDATE keel_webhook_endpoints
   SET failing_since = CASE
         WHEN last_success_at IS NOT NULL AND last_success_at >= ?2 THEN failing_since
         WHEN failing_since IS NULL OR failing_since > ?2 THEN ?2
         ELSE failing_since END
 WHERE id = ?1";

const RESEND_SQL: &str = "\
UPDATE keel_webhook_deliveries
   SET status = 'pending', attempts = 0, next_attempt_at = ?2, updated_at = ?2,
       leased_by = NULL, leased_until = NULL
 WHERE id = ?1
   AND NOT (status = 'pending' AND leased_until IS NOT NULL AND leased_until > ?2)
   AND EXISTS (SELECT 1 FROM keel_webhook_endpoints e
                WHERE e.id = keel_webhook_deliveries.endpoint_id AND e.enabled = 1)";

const REPLAY_SQL: &str = "\
UPDATE keel_webhook_deliveries
   SET status = 'pending', attempts = 0, next_attempt_at = ?5, updated_at = ?5,
       leased_by = NULL, leased_until = NULL
 WHERE endpoint_id = ?1 AND created_at >= ?2 AND created_at < ?3
   AND (status IN ('failed', 'disabled') OR (?4 AND status = 'succeeded'))";

const LIST_SQL: &str = "\
SELECT id, endpoint_id, event_id, event_type, payload, status, attempts, next_attempt_at,
       created_at, updated_at, leased_by, leased_until
  FROM keel_webhook_deliveries
 WHERE (?1 IS NULL OR endpoint_id = ?1)
   AND (?2 IS NULL OR event_id = ?2)
   AND (?3 IS NULL OR status = ?3)
   AND (?4 IS NULL OR created_at >= ?4)
   AND (?5 IS NULL OR created_at < ?5)
   AND (?6 IS NULL OR id < ?6)
 ORDER BY id DESC
 LIMIT ?7";

const ATTEMPTS_SQL: &str = "\
SELECT delivery_id, attempt, at, url, request_headers, response_status, response_body,
       latency_us, error
  FROM keel_webhook_attempts WHERE delivery_id = ?1 ORDER BY id";

const PRUNE_SELECT_SQL: &str = "\
SELECT id FROM keel_webhook_deliveries
 WHERE status <> 'pending' AND updated_at < ?1 ORDER BY updated_at LIMIT ?2";

/// The default and largest page of [`WebhookStore::webhook_delivery_list`].
const DEFAULT_LIST_LIMIT: usize = 100;

#[async_trait]
impl WebhookStore for SqliteStore {
    async fn webhook_endpoint_create(&self, endpoint: &WebhookEndpoint) -> Result<(), StoreError> {
        sqlx::query(ENDPOINT_INSERT_SQL)
            .bind(endpoint.id.as_str())
            .bind(endpoint.url.as_str())
            .bind(endpoint.description.as_str())
            .bind(to_json(&endpoint.event_types)?)
            .bind(secrets_to_json(&endpoint.secrets)?)
            .bind(endpoint.enabled)
            .bind(endpoint.disabled_reason.as_deref())
            .bind(endpoint.disabled_at.map(ms))
            .bind(endpoint.failing_since.map(ms))
            .bind(endpoint.last_success_at.map(ms))
            .bind(ms(endpoint.created_at))
            .bind(ms(endpoint.updated_at))
            .bind(endpoint.tenant.as_str())
            .bind(endpoint.format.as_str())
            .execute(self.pool())
            .await
            .map_err(db_error)?;
        Ok(())
    }

    async fn webhook_endpoint_get(&self, id: &str) -> Result<Option<WebhookEndpoint>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {ENDPOINT_COLUMNS} FROM keel_webhook_endpoints WHERE id = ?1"
        ))
        .bind(id)
        .fetch_optional(self.read_pool())
        .await
        .map_err(db_error)?;
        row.as_ref().map(endpoint_from_row).transpose()
    }

    async fn webhook_endpoint_list(&self) -> Result<Vec<WebhookEndpoint>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {ENDPOINT_COLUMNS} FROM keel_webhook_endpoints ORDER BY created_at, id"
        ))
        .fetch_all(self.read_pool())
        .await
        .map_err(db_error)?;
        rows.iter().map(endpoint_from_row).collect()
    }

    async fn webhook_endpoint_update(
        &self,
        endpoint: &WebhookEndpoint,
        now: DateTime<Utc>,
    ) -> Result<(), StoreError> {
        let done = sqlx::query(ENDPOINT_UPDATE_SQL)
            .bind(endpoint.id.as_str())
            .bind(endpoint.url.as_str())
            .bind(endpoint.description.as_str())
            .bind(to_json(&endpoint.event_types)?)
            .bind(ms(now))
            .execute(self.pool())
            .await
            .map_err(db_error)?;
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
        let mut tx = self.begin().await?;
        let current: Option<String> =
            sqlx::query_scalar("SELECT secrets FROM keel_webhook_endpoints WHERE id = ?1")
                .bind(id)
                .fetch_optional(&mut *tx)
                .await
                .map_err(db_error)?;
        let Some(current) = current else {
            return Err(not_found_endpoint(id));
        };
        let mut secrets = secrets_from_json(&current)?;
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
        sqlx::query(
            "UPDATE keel_webhook_endpoints SET secrets = ?2, updated_at = ?3 WHERE id = ?1",
        )
        .bind(id)
        .bind(secrets_to_json(&kept)?)
        .bind(ms(secret.created_at))
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
        let row = sqlx::query(&format!(
            "SELECT {ENDPOINT_COLUMNS} FROM keel_webhook_endpoints WHERE id = ?1"
        ))
        .bind(id)
        .fetch_one(&mut *tx)
        .await
        .map_err(db_error)?;
        let endpoint = endpoint_from_row(&row)?;
        self.commit(tx).await?;
        Ok(endpoint)
    }

    async fn webhook_endpoint_disable(
        &self,
        id: &str,
        reason: &str,
        at: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        let mut tx = self.begin().await?;
        let done = sqlx::query(DISABLE_SQL)
            .bind(id)
            .bind(reason)
            .bind(ms(at))
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
            .bind(ms(at))
            .execute(&mut *tx)
            .await
            .map_err(db_error)?
            .rows_affected();
        self.commit(tx).await?;
        tracing::debug!(endpoint = id, parked, "webhook endpoint disabled");
        Ok(true)
    }

    async fn webhook_endpoint_enable(
        &self,
        id: &str,
        at: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(ENABLE_SQL)
            .bind(id)
            .bind(ms(at))
            .execute(self.pool())
            .await
            .map_err(db_error)?;
        if done.rows_affected() == 1 {
            return Ok(true);
        }
        let exists: Option<i64> =
            sqlx::query_scalar("SELECT 1 FROM keel_webhook_endpoints WHERE id = ?1")
                .bind(id)
                .fetch_optional(self.pool())
                .await
                .map_err(db_error)?;
        match exists {
            Some(_) => Ok(false),
            None => Err(not_found_endpoint(id)),
        }
    }

    async fn webhook_endpoint_delete(&self, id: &str) -> Result<bool, StoreError> {
        let mut tx = self.begin().await?;
        sqlx::query(
            "DELETE FROM keel_webhook_attempts WHERE delivery_id IN \
             (SELECT id FROM keel_webhook_deliveries WHERE endpoint_id = ?1)",
        )
        .bind(id)
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
        sqlx::query("DELETE FROM keel_webhook_deliveries WHERE endpoint_id = ?1")
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(db_error)?;
        let done = sqlx::query("DELETE FROM keel_webhook_endpoints WHERE id = ?1")
            .bind(id)
            .execute(&mut *tx)
            .await
            .map_err(db_error)?;
        self.commit(tx).await?;
        Ok(done.rows_affected() == 1)
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
        let now = ms(now);
        let mut queued = 0;
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
                let done = sqlx::query(ENQUEUE_SQL)
                    .bind(endpoint.id.as_str())
                    .bind(message.event_id.as_str())
                    .bind(message.event_type.as_str())
                    .bind(message.payload.as_ref())
                    .bind(status.as_str())
                    .bind(now)
                    .execute(&mut **tx)
                    .await
                    .map_err(db_error)?;
                if endpoint.enabled {
                    queued += done.rows_affected();
                }
            }
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
        let now = ms(now);
        let lease_ms = i64::try_from(lease.as_millis()).unwrap_or(i64::MAX);
        let rows = sqlx::query(CLAIM_SQL)
            .bind(worker)
            .bind(now.saturating_add(lease_ms))
            .bind(now)
            .bind(sql_limit(limit))
            .bind(sql_limit(per_endpoint))
            .fetch_all(self.pool())
            .await
            .map_err(db_error)?;
        if rows.is_empty() {
            return Ok(Vec::new());
        }
        let mut deliveries = rows
            .iter()
            .map(delivery_from_row)
            .collect::<Result<Vec<_>, _>>()?;
        // RETURNING does not promise an order.
        deliveries.sort_unstable_by_key(|d| (d.next_attempt_at, d.id));
        let ids: BTreeSet<&str> = deliveries.iter().map(|d| d.endpoint_id.as_str()).collect();
        let endpoints = sqlx::query(&format!(
            "SELECT {ENDPOINT_COLUMNS} FROM keel_webhook_endpoints \
             WHERE id IN (SELECT value FROM json_each(?1))"
        ))
        .bind(to_json(&ids)?)
        .fetch_all(self.read_pool())
        .await
        .map_err(db_error)?
        .iter()
        .map(|row| endpoint_from_row(row).map(|e| (e.id.clone(), e)))
        .collect::<Result<HashMap<_, _>, _>>()?;
        deliveries
            .into_iter()
            .map(|delivery| {
                let endpoint = endpoints
                    .get(&delivery.endpoint_id)
                    .cloned()
                    .ok_or_else(|| {
                        corrupt(format!("endpoint {:?} vanished", delivery.endpoint_id))
                    })?;
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
        let mut tx = self.begin().await?;
        let ids: Vec<i64> = outcomes.iter().map(|o| o.attempt.delivery_id).collect();
        let owners: HashMap<i64, String> = sqlx::query(
            "SELECT id, endpoint_id FROM keel_webhook_deliveries \
             WHERE id IN (SELECT value FROM json_each(?1))",
        )
        .bind(to_json(&ids)?)
        .fetch_all(&mut *tx)
        .await
        .map_err(db_error)?
        .iter()
        .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
        .collect::<Result<_, sqlx::Error>>()
        .map_err(db_error)?;

        let mut attempts = Vec::with_capacity(outcomes.len());
        let mut moves = Vec::with_capacity(outcomes.len());
        // Per endpoint: the latest success, and the failures' times.
        let mut health: HashMap<&str, (Option<i64>, Vec<i64>)> = HashMap::new();
        for outcome in outcomes {
            let attempt = &outcome.attempt;
            let at = ms(attempt.at);
            attempts.push(StoredAttempt {
                d: attempt.delivery_id,
                n: attempt.attempt,
                at,
                url: &attempt.url,
                h: to_json(&attempt.request_headers)?,
                s: attempt.response_status,
                b: attempt.response_body.as_deref(),
                l: i64::try_from(attempt.latency.as_micros()).unwrap_or(i64::MAX),
                e: attempt.error.as_deref(),
            });
            moves.push(StoredMove {
                d: attempt.delivery_id,
                st: outcome.status.as_str(),
                n: attempt.attempt,
                next: outcome.next_attempt_at.map(ms),
                at,
            });
            if let Some(endpoint) = owners.get(&attempt.delivery_id) {
                let entry = health.entry(endpoint.as_str()).or_default();
                if attempt.succeeded() {
                    entry.0 = entry.0.max(Some(at));
                } else {
                    entry.1.push(at);
                }
            }
        }
        sqlx::query(ATTEMPTS_INSERT_SQL)
            .bind(to_json(&attempts)?)
            .execute(&mut *tx)
            .await
            .map_err(db_error)?;
        let applied = sqlx::query(COMPLETE_SQL)
            .bind(to_json(&moves)?)
            .bind(worker)
            .execute(&mut *tx)
            .await
            .map_err(db_error)?
            .rows_affected();
        for (endpoint, (success, failures)) in health {
            if let Some(success) = success {
                sqlx::query(SUCCESS_SQL)
                    .bind(endpoint)
                    .bind(success)
                    .execute(&mut *tx)
                    .await
                    .map_err(db_error)?;
            }
            // The earliest failure after the latest success in the batch.
            let first_failure = failures
                .into_iter()
                .filter(|at| success.is_none_or(|s| *at > s))
                .min();
            if let Some(failure) = first_failure {
                sqlx::query(FAILURE_SQL)
                    .bind(endpoint)
                    .bind(failure)
                    .execute(&mut *tx)
                    .await
                    .map_err(db_error)?;
            }
        }
        self.commit(tx).await?;
        Ok(applied)
    }

    async fn webhook_delivery_get(&self, id: i64) -> Result<Option<WebhookDelivery>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {DELIVERY_COLUMNS} FROM keel_webhook_deliveries WHERE id = ?1"
        ))
        .bind(id)
        .fetch_optional(self.read_pool())
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
            .bind(filter.created_from.map(ms))
            .bind(filter.created_before.map(ms))
            .bind(filter.before_id)
            .bind(sql_limit(limit))
            .fetch_all(self.read_pool())
            .await
            .map_err(db_error)?;
        rows.iter().map(delivery_from_row).collect()
    }

    async fn webhook_attempts(&self, delivery_id: i64) -> Result<Vec<DeliveryAttempt>, StoreError> {
        let rows = sqlx::query(ATTEMPTS_SQL)
            .bind(delivery_id)
            .fetch_all(self.read_pool())
            .await
            .map_err(db_error)?;
        rows.iter().map(attempt_from_row).collect()
    }

    async fn webhook_resend(
        &self,
        delivery_id: i64,
        now: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(RESEND_SQL)
            .bind(delivery_id)
            .bind(ms(now))
            .execute(self.pool())
            .await
            .map_err(db_error)?;
        if done.rows_affected() == 1 {
            return Ok(true);
        }
        let exists: Option<i64> =
            sqlx::query_scalar("SELECT 1 FROM keel_webhook_deliveries WHERE id = ?1")
                .bind(delivery_id)
                .fetch_optional(self.pool())
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
        let mut tx = self.begin().await?;
        let enabled: Option<bool> =
            sqlx::query_scalar("SELECT enabled FROM keel_webhook_endpoints WHERE id = ?1")
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
            .bind(ms(from))
            .bind(ms(to))
            .bind(include_succeeded)
            .bind(ms(now))
            .execute(&mut *tx)
            .await
            .map_err(db_error)?;
        self.commit(tx).await?;
        Ok(done.rows_affected())
    }

    async fn webhook_failing_since(
        &self,
        endpoint_id: &str,
    ) -> Result<Option<DateTime<Utc>>, StoreError> {
        let row: Option<Option<i64>> =
            sqlx::query_scalar("SELECT failing_since FROM keel_webhook_endpoints WHERE id = ?1")
                .bind(endpoint_id)
                .fetch_optional(self.read_pool())
                .await
                .map_err(db_error)?;
        match row {
            None => Err(not_found_endpoint(endpoint_id)),
            Some(since) => since.map(from_ms).transpose(),
        }
    }

    async fn webhook_prune(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError> {
        if batch == 0 {
            return Ok(0);
        }
        let mut tx = self.begin().await?;
        let ids: Vec<i64> = sqlx::query_scalar(PRUNE_SELECT_SQL)
            .bind(ms(before))
            .bind(sql_limit(batch))
            .fetch_all(&mut *tx)
            .await
            .map_err(db_error)?;
        if ids.is_empty() {
            self.rollback(tx).await?;
            return Ok(0);
        }
        let ids = to_json(&ids)?;
        sqlx::query(
            "DELETE FROM keel_webhook_attempts WHERE delivery_id IN (SELECT value FROM json_each(?1))",
        )
        .bind(ids.as_str())
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
        let done = sqlx::query(
            "DELETE FROM keel_webhook_deliveries WHERE id IN (SELECT value FROM json_each(?1))",
        )
        .bind(ids.as_str())
        .execute(&mut *tx)
        .await
        .map_err(db_error)?;
        self.commit(tx).await?;
        let deleted = done.rows_affected();
        tracing::debug!(deleted, "webhook deliveries pruned");
        Ok(deleted)
    }
}

async fn endpoint_exists(
    tx: &mut <SqliteStore as Store>::Tx,
    id: &str,
) -> Result<bool, StoreError> {
    let exists: Option<i64> =
        sqlx::query_scalar("SELECT 1 FROM keel_webhook_endpoints WHERE id = ?1")
            .bind(id)
            .fetch_optional(&mut **tx)
            .await
            .map_err(db_error)?;
    Ok(exists.is_some())
}

/// One attempt of a batch, as passed to [`ATTEMPTS_INSERT_SQL`]; the
/// request headers travel as a JSON string (stored as it is).
#[derive(Serialize)]
struct StoredAttempt<'a> {
    d: i64,
    n: u32,
    at: i64,
    url: &'a str,
    h: String,
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
    next: Option<i64>,
    at: i64,
}

/// A secret as stored in the endpoint's JSON array.
#[derive(Serialize, Deserialize)]
struct StoredSecret {
    secret: String,
    created_at: i64,
    expires_at: Option<i64>,
}

fn secrets_to_json(secrets: &[WebhookSecret]) -> Result<String, StoreError> {
    let stored: Vec<StoredSecret> = secrets
        .iter()
        .map(|s| StoredSecret {
            secret: s.secret.clone(),
            created_at: ms(s.created_at),
            expires_at: s.expires_at.map(ms),
        })
        .collect();
    to_json(&stored)
}

fn secrets_from_json(json: &str) -> Result<Vec<WebhookSecret>, StoreError> {
    let stored: Vec<StoredSecret> =
        serde_json::from_str(json).map_err(|e| corrupt(format!("secrets: {e}")))?;
    stored
        .into_iter()
        .map(|s| {
            Ok(WebhookSecret {
                secret: s.secret,
                created_at: from_ms(s.created_at)?,
                expires_at: s.expires_at.map(from_ms).transpose()?,
            })
        })
        .collect()
}

fn endpoint_from_row(row: &SqliteRow) -> Result<WebhookEndpoint, StoreError> {
    let event_types: String = row.try_get("event_types").map_err(db_error)?;
    let secrets: String = row.try_get("secrets").map_err(db_error)?;
    Ok(WebhookEndpoint {
        id: row.try_get("id").map_err(db_error)?,
        url: row.try_get("url").map_err(db_error)?,
        description: row.try_get("description").map_err(db_error)?,
        event_types: serde_json::from_str(&event_types)
            .map_err(|e| corrupt(format!("event types: {e}")))?,
        secrets: secrets_from_json(&secrets)?,
        enabled: row.try_get("enabled").map_err(db_error)?,
        disabled_reason: row.try_get("disabled_reason").map_err(db_error)?,
        disabled_at: opt_time(row, "disabled_at")?,
        failing_since: opt_time(row, "failing_since")?,
        last_success_at: opt_time(row, "last_success_at")?,
        created_at: from_ms(row.try_get("created_at").map_err(db_error)?)?,
        updated_at: from_ms(row.try_get("updated_at").map_err(db_error)?)?,
        tenant: row.try_get("tenant").map_err(db_error)?,
        format: {
            let name: String = row.try_get("format").map_err(db_error)?;
            WebhookFormat::parse(&name).ok_or_else(|| corrupt(format!("format {name:?}")))?
        },
    })
}

fn delivery_from_row(row: &SqliteRow) -> Result<WebhookDelivery, StoreError> {
    let status: String = row.try_get("status").map_err(db_error)?;
    let payload: Vec<u8> = row.try_get("payload").map_err(db_error)?;
    let attempts: i64 = row.try_get("attempts").map_err(db_error)?;
    Ok(WebhookDelivery {
        id: row.try_get("id").map_err(db_error)?,
        endpoint_id: row.try_get("endpoint_id").map_err(db_error)?,
        event_id: row.try_get("event_id").map_err(db_error)?,
        event_type: row.try_get("event_type").map_err(db_error)?,
        payload: Bytes::from(payload),
        status: DeliveryStatus::parse(&status)
            .ok_or_else(|| corrupt(format!("delivery status {status:?}")))?,
        attempts: u32::try_from(attempts).map_err(|_| corrupt(format!("attempts {attempts}")))?,
        next_attempt_at: from_ms(row.try_get("next_attempt_at").map_err(db_error)?)?,
        created_at: from_ms(row.try_get("created_at").map_err(db_error)?)?,
        updated_at: from_ms(row.try_get("updated_at").map_err(db_error)?)?,
        leased_by: row.try_get("leased_by").map_err(db_error)?,
        leased_until: opt_time(row, "leased_until")?,
    })
}

fn attempt_from_row(row: &SqliteRow) -> Result<DeliveryAttempt, StoreError> {
    let headers: String = row.try_get("request_headers").map_err(db_error)?;
    let attempt: i64 = row.try_get("attempt").map_err(db_error)?;
    let status: Option<i64> = row.try_get("response_status").map_err(db_error)?;
    let latency: i64 = row.try_get("latency_us").map_err(db_error)?;
    Ok(DeliveryAttempt {
        delivery_id: row.try_get("delivery_id").map_err(db_error)?,
        attempt: u32::try_from(attempt).map_err(|_| corrupt(format!("attempt {attempt}")))?,
        at: from_ms(row.try_get("at").map_err(db_error)?)?,
        url: row.try_get("url").map_err(db_error)?,
        request_headers: serde_json::from_str(&headers)
            .map_err(|e| corrupt(format!("request headers: {e}")))?,
        response_status: status
            .map(|s| u16::try_from(s).map_err(|_| corrupt(format!("status {s}"))))
            .transpose()?,
        response_body: row.try_get("response_body").map_err(db_error)?,
        latency: Duration::from_micros(u64::try_from(latency).unwrap_or(0)),
        error: row.try_get("error").map_err(db_error)?,
    })
}

fn opt_time(row: &SqliteRow, column: &str) -> Result<Option<DateTime<Utc>>, StoreError> {
    let ms: Option<i64> = row.try_get(column).map_err(db_error)?;
    ms.map(from_ms).transpose()
}

fn ms(at: DateTime<Utc>) -> i64 {
    at.timestamp_millis()
}

fn to_json<T: Serialize + ?Sized>(value: &T) -> Result<String, StoreError> {
    serde_json::to_string(value).map_err(StoreError::other)
}

fn sql_limit(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

fn not_found_endpoint(id: &str) -> StoreError {
    StoreError::NotFound(format!("webhook endpoint {id:?}"))
}

fn corrupt(detail: String) -> StoreError {
    StoreError::other(format!(
        "unreadable webhook row in the SQLite store: {detail}"
    ))
}
