//! Idempotency keys on SQLite: the storage behind `keel-http`'s
//! Idempotency-Key layer.
//!
//! A key must be recorded *before* its request is processed, atomically with
//! the check that it is new, or two concurrent duplicates both see "new" and
//! both execute. Here the check and the record are one `BEGIN IMMEDIATE`
//! transaction on the store's single writer connection, so SQLite itself
//! serializes them: of any number of concurrent begins for one key, exactly
//! one is [`IdempotencyBegin::Started`].
//!
//! The common cases skip that transaction: a new key is one autocommit
//! `INSERT ... ON CONFLICT DO NOTHING` (it either inserts, and the key is
//! ours, or changes nothing), and a replay is a read on a read connection
//! (a completed key does not change until it expires). Only keys in flight,
//! expired or abandoned take the transaction.
//!
//! An in-flight row carries its owner and a lock (`locked_until`) that the
//! owner renews while it works: a process that dies stops renewing, and
//! after the lock a retry with the same fingerprint takes over. Renewing,
//! completing and releasing match the owner, so a holder that lost its key
//! to a takeover changes nothing.

use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use keel_messaging::StoreError;
use keel_messaging::store::{
    IdempotencyBegin, IdempotencyClaim, IdempotencyStore, Store, StoredResponse,
};
use sqlx::Row;

use crate::SqliteStore;
use crate::store::error::db_error;

const SELECT_SQL: &str = "\
SELECT fingerprint, state, locked_until, status, headers, body, expires_at
  FROM keel_idempotency WHERE principal = ?1 AND idem_key = ?2";

/// Records a new key in flight; no-op if the key exists in any state.
const INSERT_NEW_SQL: &str = "\
INSERT INTO keel_idempotency
       (principal, idem_key, fingerprint, state, locked_until, created_at, expires_at, owner)
VALUES (?1, ?2, ?3, 'in_flight', ?4, ?5, ?6, ?7)
ON CONFLICT (principal, idem_key) DO NOTHING";

/// Records the key in flight, replacing an expired or abandoned row.
const START_SQL: &str = "\
INSERT INTO keel_idempotency
       (principal, idem_key, fingerprint, state, locked_until, status, headers, body,
        created_at, expires_at, owner)
VALUES (?1, ?2, ?3, 'in_flight', ?4, NULL, NULL, NULL, ?5, ?6, ?7)
ON CONFLICT (principal, idem_key) DO UPDATE SET
       fingerprint = excluded.fingerprint, state = 'in_flight',
       locked_until = excluded.locked_until, status = NULL, headers = NULL, body = NULL,
       created_at = excluded.created_at, expires_at = excluded.expires_at,
       owner = excluded.owner";

const RENEW_SQL: &str = "\
UPDATE keel_idempotency SET locked_until = MIN(?4, expires_at)
 WHERE principal = ?1 AND idem_key = ?2 AND state = 'in_flight' AND owner = ?3";

const COMPLETE_SQL: &str = "\
UPDATE keel_idempotency
   SET state = 'completed', locked_until = NULL, owner = NULL,
       status = ?4, headers = ?5, body = ?6
 WHERE principal = ?1 AND idem_key = ?2 AND state = 'in_flight' AND owner = ?3";

const RELEASE_SQL: &str = "\
DELETE FROM keel_idempotency
 WHERE principal = ?1 AND idem_key = ?2 AND state = 'in_flight' AND owner = ?3";

const PRUNE_SQL: &str = "\
DELETE FROM keel_idempotency WHERE rowid IN (
  SELECT rowid FROM keel_idempotency WHERE expires_at <= ?1 ORDER BY expires_at LIMIT ?2)";

#[async_trait]
impl IdempotencyStore for SqliteStore {
    async fn idempotency_begin(
        &self,
        claim: &IdempotencyClaim<'_>,
    ) -> Result<IdempotencyBegin, StoreError> {
        let IdempotencyClaim {
            principal,
            key,
            fingerprint,
            owner,
            locked_until,
            expires_at,
        } = *claim;
        let now = keel_core::clock::utc_now().timestamp_millis();
        let locked_until = locked_until.min(expires_at).timestamp_millis();
        let expires_at = expires_at.timestamp_millis();
        // Fast path 1, the common case: a new key is one autocommit INSERT.
        let inserted = sqlx::query(INSERT_NEW_SQL)
            .bind(principal)
            .bind(key)
            .bind(fingerprint)
            .bind(locked_until)
            .bind(now)
            .bind(expires_at)
            .bind(owner)
            .execute(self.pool())
            .await
            .map_err(db_error)?;
        if inserted.rows_affected() == 1 {
            return Ok(IdempotencyBegin::Started);
        }
        // Fast path 2: a live completed key (a replay) or a live key with
        // another fingerprint never changes until it expires, so a read
        // connection answers without the write lock.
        if let Some(row) = sqlx::query(SELECT_SQL)
            .bind(principal)
            .bind(key)
            .fetch_optional(self.read_pool())
            .await
            .map_err(db_error)?
        {
            let stored_fp: String = row.try_get("fingerprint").map_err(db_error)?;
            let state: String = row.try_get("state").map_err(db_error)?;
            let expires: i64 = row.try_get("expires_at").map_err(db_error)?;
            if expires > now {
                if stored_fp != fingerprint {
                    return Ok(IdempotencyBegin::Mismatch);
                }
                if state == "completed" {
                    return Ok(IdempotencyBegin::Completed(response_from_row(&row)?));
                }
            }
        }
        // The rest (in flight, expired, abandoned, or changed meanwhile):
        // decide and write under the write lock.
        let mut tx = self.begin().await?;
        let row = sqlx::query(SELECT_SQL)
            .bind(principal)
            .bind(key)
            .fetch_optional(&mut *tx)
            .await
            .map_err(db_error)?;
        let outcome = match row {
            None => None,
            Some(row) => {
                let stored_fp: String = row.try_get("fingerprint").map_err(db_error)?;
                let state: String = row.try_get("state").map_err(db_error)?;
                let lock: Option<i64> = row.try_get("locked_until").map_err(db_error)?;
                let expires: i64 = row.try_get("expires_at").map_err(db_error)?;
                if expires <= now {
                    None
                } else if stored_fp != fingerprint {
                    Some(IdempotencyBegin::Mismatch)
                } else if state == "in_flight" {
                    if lock.is_some_and(|lock| lock <= now) {
                        tracing::warn!(
                            principal,
                            key,
                            "idempotency key abandoned in flight; taken over"
                        );
                        metrics::counter!("keel_idempotency_takeover_total").increment(1);
                        None
                    } else {
                        Some(IdempotencyBegin::InFlight)
                    }
                } else {
                    Some(IdempotencyBegin::Completed(response_from_row(&row)?))
                }
            }
        };
        if let Some(outcome) = outcome {
            self.rollback(tx).await?;
            return Ok(outcome);
        }
        sqlx::query(START_SQL)
            .bind(principal)
            .bind(key)
            .bind(fingerprint)
            .bind(locked_until)
            .bind(now)
            .bind(expires_at)
            .bind(owner)
            .execute(&mut *tx)
            .await
            .map_err(db_error)?;
        self.commit(tx).await?;
        Ok(IdempotencyBegin::Started)
    }

    async fn idempotency_renew(
        &self,
        principal: &str,
        key: &str,
        owner: &str,
        locked_until: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        let done = sqlx::query(RENEW_SQL)
            .bind(principal)
            .bind(key)
            .bind(owner)
            .bind(locked_until.timestamp_millis())
            .execute(self.pool())
            .await
            .map_err(db_error)?;
        Ok(done.rows_affected() == 1)
    }

    async fn idempotency_complete(
        &self,
        principal: &str,
        key: &str,
        owner: &str,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        let headers = serde_json::to_string(&response.headers).map_err(StoreError::other)?;
        let done = sqlx::query(COMPLETE_SQL)
            .bind(principal)
            .bind(key)
            .bind(owner)
            .bind(i64::from(response.status))
            .bind(headers)
            .bind(response.body.as_ref())
            .execute(self.pool())
            .await
            .map_err(db_error)?;
        if done.rows_affected() == 0 {
            return Err(StoreError::NotFound(format!(
                "idempotency key {key:?} is not in flight under this owner"
            )));
        }
        Ok(())
    }

    async fn idempotency_release(
        &self,
        principal: &str,
        key: &str,
        owner: &str,
    ) -> Result<(), StoreError> {
        sqlx::query(RELEASE_SQL)
            .bind(principal)
            .bind(key)
            .bind(owner)
            .execute(self.pool())
            .await
            .map_err(db_error)?;
        Ok(())
    }

    async fn idempotency_prune(&self, now: DateTime<Utc>, batch: usize) -> Result<u64, StoreError> {
        if batch == 0 {
            return Ok(0);
        }
        let done = sqlx::query(PRUNE_SQL)
            .bind(now.timestamp_millis())
            .bind(i64::try_from(batch).unwrap_or(i64::MAX))
            .execute(self.pool())
            .await
            .map_err(db_error)?;
        let deleted = done.rows_affected();
        if deleted > 0 {
            tracing::debug!(deleted, "idempotency keys pruned");
        }
        Ok(deleted)
    }
}

fn response_from_row(row: &sqlx::sqlite::SqliteRow) -> Result<StoredResponse, StoreError> {
    let status: Option<i64> = row.try_get("status").map_err(db_error)?;
    let headers: Option<String> = row.try_get("headers").map_err(db_error)?;
    let body: Option<Vec<u8>> = row.try_get("body").map_err(db_error)?;
    let status = status
        .and_then(|s| u16::try_from(s).ok())
        .ok_or_else(|| corrupt(format!("status {status:?}")))?;
    let headers: Vec<(String, String)> = match headers {
        Some(json) => serde_json::from_str(&json).map_err(|e| corrupt(e.to_string()))?,
        None => Vec::new(),
    };
    Ok(StoredResponse {
        status,
        headers,
        body: Bytes::from(body.unwrap_or_default()),
    })
}

fn corrupt(detail: String) -> StoreError {
    StoreError::other(format!(
        "unreadable idempotency record in the SQLite store: {detail}"
    ))
}
