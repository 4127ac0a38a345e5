//! Idempotency keys on PostgreSQL: the storage behind `keel-http`'s
//! Idempotency-Key layer.
//!
//! A key must be recorded *before* its request is processed, atomically with
//! the check that it is new, or two concurrent duplicates both see "new" and
//! both execute. A new key is one autocommit `INSERT ... ON CONFLICT DO
//! NOTHING`: of any number of concurrent inserts exactly one inserts (the
//! others wait for its transaction and then find the row). An existing key
//! is decided under its row lock (`SELECT ... FOR UPDATE`): a replay, a
//! mismatch, "in flight", or a takeover of an expired or abandoned key,
//! which rewrites the row before the lock is released, so two takeovers
//! cannot both win. If the row vanished meanwhile (released or pruned), the
//! decision starts over.
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
use sqlx::postgres::PgRow;

use crate::PgStore;
use crate::store::codec::{now, to_json};
use crate::store::commit_own;
use crate::store::error::{corrupt, db_error};
use crate::store::retry::{delete_batch, retry};

/// How often the decision starts over when the row keeps vanishing.
const MAX_ROUNDS: usize = 8;

const SELECT_FOR_UPDATE_SQL: &str = "\
SELECT fingerprint, state, locked_until, status, headers::text AS headers, body, expires_at
  FROM keel_idempotency WHERE principal = $1 AND idem_key = $2 FOR UPDATE";

const INSERT_NEW_SQL: &str = "\
INSERT INTO keel_idempotency
       (principal, idem_key, fingerprint, state, locked_until, created_at, expires_at, owner)
VALUES ($1, $2, $3, 'in_flight', $4, $5, $6, $7)
ON CONFLICT (principal, idem_key) DO NOTHING";

const TAKEOVER_SQL: &str = "\
UPDATE keel_idempotency
   SET fingerprint = $3, state = 'in_flight', locked_until = $4, status = NULL,
       headers = NULL, body = NULL, created_at = $5, expires_at = $6, owner = $7
 WHERE principal = $1 AND idem_key = $2";

const RENEW_SQL: &str = "\
UPDATE keel_idempotency SET locked_until = LEAST($4, expires_at)
 WHERE principal = $1 AND idem_key = $2 AND state = 'in_flight' AND owner = $3";

const COMPLETE_SQL: &str = "\
UPDATE keel_idempotency
   SET state = 'completed', locked_until = NULL, owner = NULL,
       status = $4, headers = $5::jsonb, body = $6
 WHERE principal = $1 AND idem_key = $2 AND state = 'in_flight' AND owner = $3";

const RELEASE_SQL: &str = "\
DELETE FROM keel_idempotency
 WHERE principal = $1 AND idem_key = $2 AND state = 'in_flight' AND owner = $3";

const PRUNE_SQL: &str = "\
DELETE FROM keel_idempotency WHERE (principal, idem_key) IN (
  SELECT principal, idem_key FROM keel_idempotency
   WHERE expires_at <= $1 ORDER BY expires_at LIMIT $2 FOR UPDATE SKIP LOCKED)";

/// What the locked row says to do.
enum Decision {
    Answer(IdempotencyBegin),
    TakeOver,
}

#[async_trait]
impl IdempotencyStore for PgStore {
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
        let locked_until = locked_until.min(expires_at);
        for _ in 0..MAX_ROUNDS {
            let now = now();
            let inserted = retry("idempotency_insert", || async {
                sqlx::query(INSERT_NEW_SQL)
                    .bind(principal)
                    .bind(key)
                    .bind(fingerprint)
                    .bind(locked_until)
                    .bind(now)
                    .bind(expires_at)
                    .bind(owner)
                    .execute(&self.pool)
                    .await
                    .map_err(db_error)
            })
            .await?;
            if inserted.rows_affected() == 1 {
                return Ok(IdempotencyBegin::Started);
            }
            let decided = retry("idempotency_decide", || async {
                let mut tx = self.begin().await?;
                let row = sqlx::query(SELECT_FOR_UPDATE_SQL)
                    .bind(principal)
                    .bind(key)
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(db_error)?;
                let Some(row) = row else {
                    self.rollback(tx).await?;
                    return Ok(None);
                };
                match decide(&row, fingerprint, now)? {
                    Decision::Answer(answer) => {
                        self.rollback(tx).await?;
                        Ok(Some(answer))
                    }
                    Decision::TakeOver => {
                        sqlx::query(TAKEOVER_SQL)
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
                        commit_own(self, tx).await?;
                        Ok(Some(IdempotencyBegin::Started))
                    }
                }
            })
            .await?;
            if let Some(answer) = decided {
                return Ok(answer);
            }
        }
        Err(StoreError::Unavailable(
            format!("idempotency key {key:?} kept changing; try again").into(),
        ))
    }

    async fn idempotency_renew(
        &self,
        principal: &str,
        key: &str,
        owner: &str,
        locked_until: DateTime<Utc>,
    ) -> Result<bool, StoreError> {
        let done = retry("idempotency_renew", || async {
            sqlx::query(RENEW_SQL)
                .bind(principal)
                .bind(key)
                .bind(owner)
                .bind(locked_until)
                .execute(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
        Ok(done.rows_affected() == 1)
    }

    async fn idempotency_complete(
        &self,
        principal: &str,
        key: &str,
        owner: &str,
        response: &StoredResponse,
    ) -> Result<(), StoreError> {
        let headers = to_json(&response.headers)?;
        let done = retry("idempotency_complete", || async {
            sqlx::query(COMPLETE_SQL)
                .bind(principal)
                .bind(key)
                .bind(owner)
                .bind(i32::from(response.status))
                .bind(headers.as_str())
                .bind(response.body.as_ref())
                .execute(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
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
        retry("idempotency_release", || async {
            sqlx::query(RELEASE_SQL)
                .bind(principal)
                .bind(key)
                .bind(owner)
                .execute(&self.pool)
                .await
                .map_err(db_error)
        })
        .await?;
        Ok(())
    }

    async fn idempotency_prune(&self, now: DateTime<Utc>, batch: usize) -> Result<u64, StoreError> {
        delete_batch(&self.pool, "idempotency_prune", PRUNE_SQL, now, batch).await
    }
}

/// What an existing (locked) row means for a request with `fingerprint`.
fn decide(row: &PgRow, fingerprint: &str, now: DateTime<Utc>) -> Result<Decision, StoreError> {
    let stored_fp: String = row.try_get("fingerprint").map_err(db_error)?;
    let state: String = row.try_get("state").map_err(db_error)?;
    let lock: Option<DateTime<Utc>> = row.try_get("locked_until").map_err(db_error)?;
    let expires: DateTime<Utc> = row.try_get("expires_at").map_err(db_error)?;
    if expires <= now {
        return Ok(Decision::TakeOver);
    }
    if stored_fp != fingerprint {
        return Ok(Decision::Answer(IdempotencyBegin::Mismatch));
    }
    if state == "completed" {
        return Ok(Decision::Answer(IdempotencyBegin::Completed(
            response_from_row(row)?,
        )));
    }
    if lock.is_some_and(|lock| lock <= now) {
        tracing::warn!("idempotency key abandoned in flight; taken over");
        metrics::counter!("keel_idempotency_takeover_total").increment(1);
        return Ok(Decision::TakeOver);
    }
    Ok(Decision::Answer(IdempotencyBegin::InFlight))
}

fn response_from_row(row: &PgRow) -> Result<StoredResponse, StoreError> {
    let status: Option<i32> = row.try_get("status").map_err(db_error)?;
    let headers: Option<String> = row.try_get("headers").map_err(db_error)?;
    let body: Option<Vec<u8>> = row.try_get("body").map_err(db_error)?;
    let status = status
        .and_then(|s| u16::try_from(s).ok())
        .ok_or_else(|| corrupt("idempotency response status", format!("{status:?}")))?;
    let headers: Vec<(String, String)> = match headers {
        Some(json) => {
            serde_json::from_str(&json).map_err(|e| corrupt("idempotency response headers", e))?
        }
        None => Vec::new(),
    };
    Ok(StoredResponse {
        status,
        headers,
        body: Bytes::from(body.unwrap_or_default()),
    })
}
