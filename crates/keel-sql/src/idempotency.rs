//! Idempotency keys: the storage behind `keel-http`'s Idempotency-Key layer.
//!
//! A key must be recorded *before* its request is processed, atomically with
//! the check that it is new, or two concurrent duplicates both see "new" and
//! both execute. A new key is one autocommit `INSERT ... ON CONFLICT DO
//! NOTHING`: of any number of concurrent inserts exactly one inserts (the
//! others, on PostgreSQL, wait for its transaction and then find the row). A
//! replay, or a key reused with another request, is answered from a plain
//! read: a live row in those states does not change until it expires.
//! Everything else (in flight, expired, abandoned, or changed meanwhile) is
//! decided in one of the store's own transactions, under the row's lock
//! (PostgreSQL's `FOR UPDATE`; SQLite's `BEGIN IMMEDIATE` holds the write
//! lock already): "in flight", or a takeover of an expired or abandoned key,
//! which rewrites the row before the lock is released, so two takeovers
//! cannot both win. If the row vanished meanwhile (released or pruned), the
//! decision starts over.
//!
//! An in-flight row carries its owner and a lock (`locked_until`) that the
//! owner renews while it works: a process that dies stops renewing, and
//! after the lock a retry with the same fingerprint takes over. Renewing,
//! completing and releasing match the owner, so a holder that lost its key
//! to a takeover changes nothing.

use bytes::Bytes;
use chrono::{DateTime, Utc};
use keel_store::StoreError;
use keel_store::{IdempotencyBegin, IdempotencyClaim, StoredResponse};

use crate::backend::{SqlBackend, Tx};
use crate::dialect::{Dialect, Exec, SqlRow, Value};
use crate::error::corrupt;
use crate::retry::{bounded_delete_sql, delete_batch, retry, write};

/// How often the decision starts over when the row keeps vanishing.
const MAX_ROUNDS: usize = 8;

const COLUMNS: &str = "fingerprint, state, locked_until, status, headers, body, expires_at";

/// Records a new key in flight; changes nothing if the key exists in any
/// state.
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

/// Extends the lock, never past the key's expiry.
const RENEW_SQL: &str = "\
UPDATE keel_idempotency
   SET locked_until = CASE WHEN $4 < expires_at THEN $4 ELSE expires_at END
 WHERE principal = $1 AND idem_key = $2 AND state = 'in_flight' AND owner = $3";

const COMPLETE_SQL: &str = "\
UPDATE keel_idempotency
   SET state = 'completed', locked_until = NULL, owner = NULL,
       status = $4, headers = $5, body = $6
 WHERE principal = $1 AND idem_key = $2 AND state = 'in_flight' AND owner = $3";

const RELEASE_SQL: &str = "\
DELETE FROM keel_idempotency
 WHERE principal = $1 AND idem_key = $2 AND state = 'in_flight' AND owner = $3";

/// What an existing row says to do.
enum Decision {
    Answer(IdempotencyBegin),
    TakeOver,
}

/// [`IdempotencyStore::idempotency_begin`](keel_store::IdempotencyStore::idempotency_begin).
pub async fn begin<B: SqlBackend>(
    store: &B,
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
    let select =
        format!("SELECT {COLUMNS} FROM keel_idempotency WHERE principal = $1 AND idem_key = $2");
    let locked_select = format!("{select}{}", B::Dialect::FOR_UPDATE);
    let key_params = [principal.into(), key.into()];
    for _ in 0..MAX_ROUNDS {
        let now = B::Dialect::now();
        let claim_params: [Value<'_>; 7] = [
            principal.into(),
            key.into(),
            fingerprint.into(),
            locked_until.into(),
            now.into(),
            expires_at.into(),
            owner.into(),
        ];
        if write(store, "idempotency_insert", INSERT_NEW_SQL, &claim_params).await? == 1 {
            return Ok(IdempotencyBegin::Started);
        }
        if let Some(answer) = settled(store, &select, &key_params, fingerprint, now).await? {
            return Ok(answer);
        }
        let decided = retry::<B::Dialect, _, _, _>("idempotency_decide", || async {
            let mut tx = store.begin_own().await?;
            let row =
                B::Dialect::fetch_optional(Exec::Tx(&mut tx), &locked_select, &key_params).await?;
            let Some(row) = row else {
                store.rollback_own(tx).await?;
                return Ok(None);
            };
            match decide::<B::Dialect>(&row, fingerprint, now)? {
                Decision::Answer(answer) => {
                    store.rollback_own(tx).await?;
                    Ok(Some(answer))
                }
                Decision::TakeOver => {
                    B::Dialect::execute(Exec::Tx(&mut tx), TAKEOVER_SQL, &claim_params).await?;
                    store.commit_own(tx).await?;
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

/// A replay or a mismatch, answered from a plain read: a live row in those
/// states does not change until it expires.
async fn settled<B: SqlBackend>(
    store: &B,
    select: &str,
    key_params: &[Value<'_>],
    fingerprint: &str,
    now: DateTime<Utc>,
) -> Result<Option<IdempotencyBegin>, StoreError> {
    let Some(row) = store.read_optional(select, key_params).await? else {
        return Ok(None);
    };
    Ok(match decide::<B::Dialect>(&row, fingerprint, now)? {
        Decision::Answer(
            answer @ (IdempotencyBegin::Mismatch | IdempotencyBegin::Completed(_)),
        ) => Some(answer),
        _ => None,
    })
}

/// [`IdempotencyStore::idempotency_renew`](keel_store::IdempotencyStore::idempotency_renew).
pub async fn renew<B: SqlBackend>(
    store: &B,
    principal: &str,
    key: &str,
    owner: &str,
    locked_until: DateTime<Utc>,
) -> Result<bool, StoreError> {
    let params = [
        principal.into(),
        key.into(),
        owner.into(),
        locked_until.into(),
    ];
    Ok(write(store, "idempotency_renew", RENEW_SQL, &params).await? == 1)
}

/// [`IdempotencyStore::idempotency_complete`](keel_store::IdempotencyStore::idempotency_complete).
pub async fn complete<B: SqlBackend>(
    store: &B,
    principal: &str,
    key: &str,
    owner: &str,
    response: &StoredResponse,
) -> Result<(), StoreError> {
    let headers = encode_headers(response)?;
    let params = complete_params(principal, key, owner, response, &headers);
    completed(
        key,
        write(store, "idempotency_complete", COMPLETE_SQL, &params).await?,
    )
}

/// [`IdempotencyStore::idempotency_complete_in`](keel_store::IdempotencyStore::idempotency_complete_in).
pub async fn complete_in<B: SqlBackend>(
    tx: &mut Tx<B>,
    principal: &str,
    key: &str,
    owner: &str,
    response: &StoredResponse,
) -> Result<(), StoreError> {
    let headers = encode_headers(response)?;
    let params = complete_params(principal, key, owner, response, &headers);
    completed(
        key,
        B::Dialect::execute(Exec::Tx(tx), COMPLETE_SQL, &params).await?,
    )
}

fn encode_headers(response: &StoredResponse) -> Result<String, StoreError> {
    serde_json::to_string(&response.headers).map_err(StoreError::other)
}

fn complete_params<'a>(
    principal: &'a str,
    key: &'a str,
    owner: &'a str,
    response: &'a StoredResponse,
    headers: &'a str,
) -> [Value<'a>; 6] {
    [
        principal.into(),
        key.into(),
        owner.into(),
        i64::from(response.status).into(),
        Value::Json(headers),
        response.body.as_ref().into(),
    ]
}

/// `NotFound` unless the complete changed the key's row.
fn completed(key: &str, changed: u64) -> Result<(), StoreError> {
    if changed == 0 {
        return Err(StoreError::NotFound(format!(
            "idempotency key {key:?} is not in flight under this owner"
        )));
    }
    Ok(())
}

/// [`IdempotencyStore::idempotency_release`](keel_store::IdempotencyStore::idempotency_release).
pub async fn release<B: SqlBackend>(
    store: &B,
    principal: &str,
    key: &str,
    owner: &str,
) -> Result<(), StoreError> {
    let params = [principal.into(), key.into(), owner.into()];
    write(store, "idempotency_release", RELEASE_SQL, &params).await?;
    Ok(())
}

/// [`IdempotencyStore::idempotency_prune`](keel_store::IdempotencyStore::idempotency_prune).
pub async fn prune<B: SqlBackend>(
    store: &B,
    now: DateTime<Utc>,
    batch: usize,
) -> Result<u64, StoreError> {
    let sql = bounded_delete_sql::<B::Dialect>(
        "keel_idempotency",
        "principal, idem_key",
        "expires_at <= $1",
        "expires_at",
    );
    delete_batch(store, "idempotency_prune", &sql, now.into(), batch).await
}

/// What an existing row means for a request with `fingerprint` at `now`.
fn decide<D: Dialect>(
    row: &D::Row,
    fingerprint: &str,
    now: DateTime<Utc>,
) -> Result<Decision, StoreError> {
    if row.time("expires_at")? <= now {
        return Ok(Decision::TakeOver);
    }
    if row.text("fingerprint")? != fingerprint {
        return Ok(Decision::Answer(IdempotencyBegin::Mismatch));
    }
    if row.text("state")? == "completed" {
        return Ok(Decision::Answer(IdempotencyBegin::Completed(
            response_from_row::<D>(row)?,
        )));
    }
    if row
        .time_opt("locked_until")?
        .is_some_and(|lock| lock <= now)
    {
        tracing::warn!("idempotency key abandoned in flight; taken over");
        metrics::counter!("keel_idempotency_takeover_total").increment(1);
        return Ok(Decision::TakeOver);
    }
    Ok(Decision::Answer(IdempotencyBegin::InFlight))
}

fn response_from_row<D: Dialect>(row: &D::Row) -> Result<StoredResponse, StoreError> {
    let status = row.int_opt("status")?;
    let status = status.and_then(|s| u16::try_from(s).ok()).ok_or_else(|| {
        corrupt(
            D::NAME,
            "idempotency response status",
            format!("{status:?}"),
        )
    })?;
    let headers = match row.json_opt("headers")? {
        Some(json) => serde_json::from_str(&json)
            .map_err(|e| corrupt(D::NAME, "idempotency response headers", e))?,
        None => Vec::new(),
    };
    Ok(StoredResponse {
        status,
        headers,
        body: Bytes::from(row.bytes_opt("body")?.unwrap_or_default()),
    })
}

/// Implements [`IdempotencyStore`](keel_store::IdempotencyStore)
/// for a [`SqlBackend`].
#[macro_export]
macro_rules! idempotency_store {
    ($store:ty) => {
        #[$crate::__private::async_trait]
        impl $crate::__private::store::IdempotencyStore for $store {
            async fn idempotency_begin(
                &self,
                claim: &$crate::__private::store::IdempotencyClaim<'_>,
            ) -> ::std::result::Result<
                $crate::__private::store::IdempotencyBegin,
                $crate::__private::StoreError,
            > {
                $crate::idempotency::begin(self, claim).await
            }

            async fn idempotency_renew(
                &self,
                principal: &str,
                key: &str,
                owner: &str,
                locked_until: $crate::__private::DateTime<$crate::__private::Utc>,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::idempotency::renew(self, principal, key, owner, locked_until).await
            }

            async fn idempotency_complete(
                &self,
                principal: &str,
                key: &str,
                owner: &str,
                response: &$crate::__private::store::StoredResponse,
            ) -> ::std::result::Result<(), $crate::__private::StoreError> {
                $crate::idempotency::complete(self, principal, key, owner, response).await
            }

            async fn idempotency_complete_in(
                &self,
                tx: &mut <Self as $crate::__private::store::Store>::Tx,
                principal: &str,
                key: &str,
                owner: &str,
                response: &$crate::__private::store::StoredResponse,
            ) -> ::std::result::Result<(), $crate::__private::StoreError> {
                $crate::idempotency::complete_in::<Self>(tx, principal, key, owner, response).await
            }

            async fn idempotency_release(
                &self,
                principal: &str,
                key: &str,
                owner: &str,
            ) -> ::std::result::Result<(), $crate::__private::StoreError> {
                $crate::idempotency::release(self, principal, key, owner).await
            }

            async fn idempotency_prune(
                &self,
                now: $crate::__private::DateTime<$crate::__private::Utc>,
                batch: usize,
            ) -> ::std::result::Result<u64, $crate::__private::StoreError> {
                $crate::idempotency::prune(self, now, batch).await
            }
        }
    };
}
