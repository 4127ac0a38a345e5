//! Webhook endpoints, deliveries and the delivery log: the storage behind
//! `keel-http`'s webhook sender.
//!
//! A delivery is a row queued in the caller's transaction (waking the
//! senders of other processes at commit, where the backend has wake-ups)
//! and leased by a worker, so a customer's slow endpoint is never inside the
//! request that caused the event, and a crashed worker's deliveries come
//! back when their lease ends. The fan-out (which endpoints an event goes
//! to, and that a disabled endpoint's copy waits as `disabled`) is decided
//! here, once.
//!
//! The claim is where the databases differ ([`WebhookBackend`]): for every
//! enabled endpoint it takes at most `per_endpoint` of its oldest due
//! deliveries, numbers them after the endpoint's deliveries already in
//! flight, and leases the oldest due of those that fit, up to `limit`;
//! SQLite does it in one statement on its single writer, PostgreSQL under a
//! transaction-scoped advisory lock so that the in-flight counts include
//! the claim running next door.
//!
//! Completion is batched: one transaction records any number of attempts
//! and moves their deliveries (only while the worker still holds the lease)
//! from a JSON array each ([`Dialect::json_records`]), and moves each
//! endpoint's failure window once.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use keel_messaging::StoreError;
use keel_messaging::store::{
    ClaimedDelivery, DeliveryAttempt, DeliveryFilter, DeliveryOutcome, DeliveryStatus,
    WebhookDelivery, WebhookEndpoint, WebhookFormat, WebhookMessage, WebhookSecret,
};
use serde::{Deserialize, Serialize};

use crate::backend::{Row, SqlBackend, Tx, Wake};
use crate::dialect::{Dialect, Exec, Field, SqlRow, Value};
use crate::error::{corrupt, sql_limit, to_u32};
use crate::filter::Filter;
use crate::retry::{retry, write};

/// The columns of an endpoint, as every query here reads them.
pub const ENDPOINT_COLUMNS: &str = "id, url, description, event_types, secrets, enabled, \
    disabled_reason, disabled_at, failing_since, last_success_at, created_at, updated_at, tenant, format";

/// The columns of a delivery, as [`WebhookBackend::claim_rows`] returns them.
pub const DELIVERY_COLUMNS: &str = "id, endpoint_id, event_id, event_type, payload, status, \
    attempts, next_attempt_at, created_at, updated_at, leased_by, leased_until";

const ENDPOINT_INSERT_SQL: &str = "\
INSERT INTO keel_webhook_endpoints (id, url, description, event_types, secrets, enabled,
    disabled_reason, disabled_at, failing_since, last_success_at, created_at, updated_at, tenant,
    format)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)";

const ENDPOINT_UPDATE_SQL: &str = "\
UPDATE keel_webhook_endpoints SET url = $2, description = $3, event_types = $4, updated_at = $5
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

/// Deliveries per enqueue statement (5 parameters each, far below either
/// database's limit).
const ENQUEUE_CHUNK: usize = 64;

/// A success at `$2` ends the failure window unless a failure after it
/// already started a new one.
const SUCCESS_SQL: &str = "\
UPDATE keel_webhook_endpoints
   SET last_success_at = CASE WHEN last_success_at IS NULL OR last_success_at < $2
                              THEN $2 ELSE last_success_at END,
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
UPDATE keel_webhook_deliveries
   SET status = 'pending', attempts = 0, next_attempt_at = $2, updated_at = $2,
       leased_by = NULL, leased_until = NULL
 WHERE id = $1
   AND NOT (status = 'pending' AND leased_until IS NOT NULL AND leased_until > $2)
   AND EXISTS (SELECT 1 FROM keel_webhook_endpoints e
                WHERE e.id = keel_webhook_deliveries.endpoint_id AND e.enabled)";

const REPLAY_SQL: &str = "\
UPDATE keel_webhook_deliveries
   SET status = 'pending', attempts = 0, next_attempt_at = $5, updated_at = $5,
       leased_by = NULL, leased_until = NULL
 WHERE endpoint_id = $1 AND created_at >= $2 AND created_at < $3
   AND (status IN ('failed', 'disabled') OR ($4 AND status = 'succeeded'))";

const ATTEMPTS_SQL: &str = "\
SELECT delivery_id, attempt, at, url, request_headers, response_status, response_body,
       latency_us, error
  FROM keel_webhook_attempts WHERE delivery_id = $1 ORDER BY id";

/// The default page of [`WebhookStore::webhook_delivery_list`](keel_messaging::store::WebhookStore::webhook_delivery_list).
const DEFAULT_LIST_LIMIT: usize = 100;

/// What only the backend knows how to do with its webhook deliveries.
pub trait WebhookBackend: SqlBackend {
    /// Leases due deliveries to `worker` until `until`, given the time
    /// `now`, at most `limit` in all and at most `per_endpoint` in flight
    /// per endpoint (see the module docs), and returns them with
    /// [`DELIVERY_COLUMNS`].
    fn claim_rows<'a>(
        &'a self,
        worker: &'a str,
        until: DateTime<Utc>,
        now: DateTime<Utc>,
        limit: usize,
        per_endpoint: usize,
    ) -> impl Future<Output = Result<Vec<Row<Self>>, StoreError>> + Send + 'a;
}

/// A secret as stored in the endpoint's JSON array, its instants in the
/// dialect's codec.
#[derive(Serialize, Deserialize)]
#[serde(bound(
    serialize = "T: Serialize",
    deserialize = "T: serde::de::DeserializeOwned"
))]
struct StoredSecret<T> {
    secret: String,
    created_at: T,
    expires_at: Option<T>,
}

fn secrets_to_json<D: Dialect>(secrets: &[WebhookSecret]) -> Result<String, StoreError> {
    let stored: Vec<StoredSecret<D::JsonInstant>> = secrets
        .iter()
        .map(|s| StoredSecret {
            secret: s.secret.clone(),
            created_at: D::json_instant(s.created_at),
            expires_at: s.expires_at.map(D::json_instant),
        })
        .collect();
    serde_json::to_string(&stored).map_err(StoreError::other)
}

fn secrets_from_json<D: Dialect>(json: &str) -> Result<Vec<WebhookSecret>, StoreError> {
    let stored: Vec<StoredSecret<D::JsonInstant>> =
        serde_json::from_str(json).map_err(|e| corrupt(D::NAME, "webhook secrets", e))?;
    stored
        .into_iter()
        .map(|s| {
            Ok(WebhookSecret {
                secret: s.secret,
                created_at: D::from_json_instant(s.created_at)?,
                expires_at: s.expires_at.map(D::from_json_instant).transpose()?,
            })
        })
        .collect()
}

/// [`WebhookStore::webhook_endpoint_create`](keel_messaging::store::WebhookStore::webhook_endpoint_create).
pub async fn endpoint_create<B: SqlBackend>(
    store: &B,
    endpoint: &WebhookEndpoint,
) -> Result<(), StoreError> {
    let event_types = serde_json::to_string(&endpoint.event_types).map_err(StoreError::other)?;
    let secrets = secrets_to_json::<B::Dialect>(&endpoint.secrets)?;
    let params = [
        endpoint.id.as_str().into(),
        endpoint.url.as_str().into(),
        endpoint.description.as_str().into(),
        Value::Json(&event_types),
        Value::Json(&secrets),
        endpoint.enabled.into(),
        endpoint.disabled_reason.as_deref().into(),
        endpoint.disabled_at.into(),
        endpoint.failing_since.into(),
        endpoint.last_success_at.into(),
        endpoint.created_at.into(),
        endpoint.updated_at.into(),
        endpoint.tenant.as_str().into(),
        endpoint.format.as_str().into(),
    ];
    write(
        store,
        "webhook_endpoint_create",
        ENDPOINT_INSERT_SQL,
        &params,
    )
    .await?;
    Ok(())
}

/// [`WebhookStore::webhook_endpoint_get`](keel_messaging::store::WebhookStore::webhook_endpoint_get).
pub async fn endpoint_get<B: SqlBackend>(
    store: &B,
    id: &str,
) -> Result<Option<WebhookEndpoint>, StoreError> {
    let sql = format!("SELECT {ENDPOINT_COLUMNS} FROM keel_webhook_endpoints WHERE id = $1");
    let row = store.read_optional(&sql, &[id.into()]).await?;
    row.as_ref()
        .map(endpoint_from_row::<B::Dialect>)
        .transpose()
}

/// [`WebhookStore::webhook_endpoint_list`](keel_messaging::store::WebhookStore::webhook_endpoint_list).
pub async fn endpoint_list<B: SqlBackend>(store: &B) -> Result<Vec<WebhookEndpoint>, StoreError> {
    let rows = store.read_all(&all_endpoints_sql(), &[]).await?;
    rows.iter().map(endpoint_from_row::<B::Dialect>).collect()
}

fn all_endpoints_sql() -> String {
    format!("SELECT {ENDPOINT_COLUMNS} FROM keel_webhook_endpoints ORDER BY created_at, id")
}

/// [`WebhookStore::webhook_endpoint_update`](keel_messaging::store::WebhookStore::webhook_endpoint_update).
pub async fn endpoint_update<B: SqlBackend>(
    store: &B,
    endpoint: &WebhookEndpoint,
    now: DateTime<Utc>,
) -> Result<(), StoreError> {
    let event_types = serde_json::to_string(&endpoint.event_types).map_err(StoreError::other)?;
    let params = [
        endpoint.id.as_str().into(),
        endpoint.url.as_str().into(),
        endpoint.description.as_str().into(),
        Value::Json(&event_types),
        now.into(),
    ];
    if write(
        store,
        "webhook_endpoint_update",
        ENDPOINT_UPDATE_SQL,
        &params,
    )
    .await?
        == 0
    {
        return Err(not_found_endpoint(&endpoint.id));
    }
    Ok(())
}

/// [`WebhookStore::webhook_endpoint_rotate_secret`](keel_messaging::store::WebhookStore::webhook_endpoint_rotate_secret):
/// keeps only the newest current secret, for the grace period, next to the
/// new one.
pub async fn endpoint_rotate_secret<B: SqlBackend>(
    store: &B,
    id: &str,
    secret: &WebhookSecret,
    previous_expires_at: DateTime<Utc>,
) -> Result<WebhookEndpoint, StoreError> {
    let select = format!(
        "SELECT secrets FROM keel_webhook_endpoints WHERE id = $1{}",
        B::Dialect::FOR_UPDATE
    );
    let update = format!(
        "UPDATE keel_webhook_endpoints SET secrets = $2, updated_at = $3 \
         WHERE id = $1 RETURNING {ENDPOINT_COLUMNS}"
    );
    retry::<B::Dialect, _, _, _>("webhook_endpoint_rotate_secret", || async {
        let mut tx = store.begin_own().await?;
        let current = B::Dialect::fetch_optional(Exec::Tx(&mut tx), &select, &[id.into()]).await?;
        let Some(current) = current else {
            return Err(not_found_endpoint(id));
        };
        let mut secrets = secrets_from_json::<B::Dialect>(&current.json("secrets")?)?;
        let mut kept: Vec<WebhookSecret> = secrets.pop().into_iter().collect();
        for previous in &mut kept {
            previous.expires_at = Some(
                previous
                    .expires_at
                    .map_or(previous_expires_at, |e| e.min(previous_expires_at)),
            );
        }
        kept.push(secret.clone());
        let kept = secrets_to_json::<B::Dialect>(&kept)?;
        let params = [id.into(), Value::Json(&kept), secret.created_at.into()];
        let row = B::Dialect::fetch_optional(Exec::Tx(&mut tx), &update, &params)
            .await?
            .ok_or_else(|| not_found_endpoint(id))?;
        let endpoint = endpoint_from_row::<B::Dialect>(&row)?;
        store.commit_own(tx).await?;
        Ok(endpoint)
    })
    .await
}

/// [`WebhookStore::webhook_endpoint_disable`](keel_messaging::store::WebhookStore::webhook_endpoint_disable):
/// the endpoint and its pending deliveries, in one transaction.
pub async fn endpoint_disable<B: SqlBackend>(
    store: &B,
    id: &str,
    reason: &str,
    at: DateTime<Utc>,
) -> Result<bool, StoreError> {
    retry::<B::Dialect, _, _, _>("webhook_endpoint_disable", || async {
        let mut tx = store.begin_own().await?;
        let params = [id.into(), reason.into(), at.into()];
        if B::Dialect::execute(Exec::Tx(&mut tx), DISABLE_SQL, &params).await? == 0 {
            let exists = endpoint_exists::<B>(&mut tx, id).await?;
            tx.rollback().await.map_err(B::Dialect::error)?;
            return if exists {
                Ok(false)
            } else {
                Err(not_found_endpoint(id))
            };
        }
        let params = [id.into(), at.into()];
        let parked =
            B::Dialect::execute(Exec::Tx(&mut tx), DISABLE_DELIVERIES_SQL, &params).await?;
        store.commit_own(tx).await?;
        tracing::debug!(endpoint = id, parked, "webhook endpoint disabled");
        Ok(true)
    })
    .await
}

/// [`WebhookStore::webhook_endpoint_enable`](keel_messaging::store::WebhookStore::webhook_endpoint_enable).
pub async fn endpoint_enable<B: SqlBackend>(
    store: &B,
    id: &str,
    at: DateTime<Utc>,
) -> Result<bool, StoreError> {
    let params = [id.into(), at.into()];
    if write(store, "webhook_endpoint_enable", ENABLE_SQL, &params).await? == 1 {
        return Ok(true);
    }
    let sql = "SELECT id FROM keel_webhook_endpoints WHERE id = $1";
    match B::Dialect::fetch_optional(Exec::Pool(store.writer()), sql, &[id.into()]).await? {
        Some(_) => Ok(false),
        None => Err(not_found_endpoint(id)),
    }
}

/// [`WebhookStore::webhook_endpoint_delete`](keel_messaging::store::WebhookStore::webhook_endpoint_delete):
/// the attempts, the deliveries and the endpoint, in one transaction.
pub async fn endpoint_delete<B: SqlBackend>(store: &B, id: &str) -> Result<bool, StoreError> {
    const DELETES: [&str; 3] = [
        "DELETE FROM keel_webhook_attempts WHERE delivery_id IN \
         (SELECT id FROM keel_webhook_deliveries WHERE endpoint_id = $1)",
        "DELETE FROM keel_webhook_deliveries WHERE endpoint_id = $1",
        "DELETE FROM keel_webhook_endpoints WHERE id = $1",
    ];
    retry::<B::Dialect, _, _, _>("webhook_endpoint_delete", || async {
        let mut tx = store.begin_own().await?;
        let mut deleted = 0;
        for sql in DELETES {
            deleted = B::Dialect::execute(Exec::Tx(&mut tx), sql, &[id.into()]).await?;
        }
        store.commit_own(tx).await?;
        Ok(deleted == 1)
    })
    .await
}

/// [`WebhookStore::webhook_enqueue`](keel_messaging::store::WebhookStore::webhook_enqueue):
/// one delivery per subscribed endpoint and message, `disabled` for a
/// disabled endpoint (so a replay after enabling it finds it), none twice
/// for one endpoint and event; returns how many are pending.
pub async fn enqueue<B: SqlBackend>(
    store: &B,
    tx: &mut Tx<B>,
    messages: &[WebhookMessage],
    now: DateTime<Utc>,
) -> Result<u64, StoreError> {
    if messages.is_empty() {
        return Ok(0);
    }
    let rows = B::Dialect::fetch_all(Exec::Tx(&mut *tx), &all_endpoints_sql(), &[]).await?;
    let endpoints = rows
        .iter()
        .map(endpoint_from_row::<B::Dialect>)
        .collect::<Result<Vec<_>, _>>()?;
    let copies: Vec<(&WebhookEndpoint, &WebhookMessage)> = messages
        .iter()
        .flat_map(|message| {
            endpoints
                .iter()
                .filter(|e| e.subscribes_to(&message.event_type))
                .map(move |endpoint| (endpoint, message))
        })
        .collect();
    let mut queued = 0;
    for chunk in copies.chunks(ENQUEUE_CHUNK) {
        queued += enqueue_chunk(store, tx, chunk, now).await?;
    }
    Ok(queued)
}

async fn enqueue_chunk<B: SqlBackend>(
    store: &B,
    tx: &mut Tx<B>,
    copies: &[(&WebhookEndpoint, &WebhookMessage)],
    now: DateTime<Utc>,
) -> Result<u64, StoreError> {
    let mut params: Vec<Value<'_>> = vec![now.into()];
    let mut rows = Vec::with_capacity(copies.len());
    for (endpoint, message) in copies {
        let status = if endpoint.enabled {
            DeliveryStatus::Pending
        } else {
            DeliveryStatus::Disabled
        };
        let first = params.len() + 1;
        params.extend::<[Value<'_>; 5]>([
            endpoint.id.as_str().into(),
            message.event_id.as_str().into(),
            message.event_type.as_str().into(),
            message.payload.as_ref().into(),
            status.as_str().into(),
        ]);
        let [e, i, t, p, s] = std::array::from_fn(|n| first + n);
        rows.push(format!("(${e}, ${i}, ${t}, ${p}, ${s}, 0, $1, $1, $1)"));
    }
    let insert = format!(
        "INSERT INTO keel_webhook_deliveries (endpoint_id, event_id, event_type, payload, status,
             attempts, next_attempt_at, created_at, updated_at)
         VALUES {}
         ON CONFLICT (endpoint_id, event_id) DO NOTHING
         RETURNING status",
        rows.join(", ")
    );
    let sql = match store.wake_channel(Wake::Webhooks) {
        Some(channel) => {
            params.push(channel.into());
            B::Dialect::signalling(&insert, &format!("${}", params.len()), "''")
        }
        None => insert,
    };
    let created = B::Dialect::fetch_all(Exec::Tx(tx), &sql, &params).await?;
    let mut pending = 0;
    for row in &created {
        if row.text("status")? == DeliveryStatus::Pending.as_str() {
            pending += 1;
        }
    }
    Ok(pending)
}

/// [`WebhookStore::webhook_claim_due`](keel_messaging::store::WebhookStore::webhook_claim_due).
pub async fn claim_due<B: WebhookBackend>(
    store: &B,
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
    let rows = retry::<B::Dialect, _, _, _>("webhook_claim_due", || {
        store.claim_rows(worker, until, now, limit, per_endpoint)
    })
    .await?;
    if rows.is_empty() {
        return Ok(Vec::new());
    }
    let mut deliveries = rows
        .iter()
        .map(delivery_from_row::<B::Dialect>)
        .collect::<Result<Vec<_>, _>>()?;
    // RETURNING does not promise an order.
    deliveries.sort_unstable_by_key(|d| (d.next_attempt_at, d.id));
    let ids: Vec<&str> = deliveries
        .iter()
        .map(|d| d.endpoint_id.as_str())
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let sql = format!(
        "SELECT {ENDPOINT_COLUMNS} FROM keel_webhook_endpoints WHERE {}",
        B::Dialect::any_of("id", "$1")
    );
    let endpoints = store
        .read_all(&sql, &[Value::Texts(&ids)])
        .await?
        .iter()
        .map(|row| endpoint_from_row::<B::Dialect>(row).map(|e| (e.id.clone(), e)))
        .collect::<Result<HashMap<_, _>, _>>()?;
    deliveries
        .into_iter()
        .map(|delivery| {
            let endpoint = endpoints
                .get(&delivery.endpoint_id)
                .cloned()
                .ok_or_else(|| {
                    corrupt(
                        B::Dialect::NAME,
                        "webhook delivery",
                        "its endpoint vanished",
                    )
                })?;
            Ok(ClaimedDelivery { delivery, endpoint })
        })
        .collect()
}

/// One attempt of a batch, as [`complete`] passes it to the database.
#[derive(Serialize)]
struct StoredAttempt<'a, T> {
    d: i64,
    n: u32,
    at: T,
    url: &'a str,
    h: &'a [(String, String)],
    s: Option<u16>,
    b: Option<&'a str>,
    l: i64,
    e: Option<&'a str>,
}

/// One delivery's move of a batch, as [`complete`] passes it.
#[derive(Serialize)]
struct StoredMove<T> {
    d: i64,
    st: &'static str,
    n: u32,
    next: Option<T>,
    at: T,
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

/// The statements of [`complete`]: the attempts, then the moves.
fn complete_sql<D: Dialect>() -> (String, String) {
    let attempts = D::json_records(
        "$1",
        "j",
        &[
            ("d", Field::Int),
            ("n", Field::Int),
            ("at", Field::Time),
            ("url", Field::Text),
            ("h", Field::Json),
            ("s", Field::Int),
            ("b", Field::Text),
            ("l", Field::Int),
            ("e", Field::Text),
        ],
    );
    let moves = D::json_records(
        "$1",
        "j",
        &[
            ("d", Field::Int),
            ("st", Field::Text),
            ("n", Field::Int),
            ("next", Field::Time),
            ("at", Field::Time),
        ],
    );
    (
        format!(
            "INSERT INTO keel_webhook_attempts (delivery_id, attempt, at, url, request_headers,
                 response_status, response_body, latency_us, error)
             SELECT j.d, j.n, j.at, j.url, j.h, j.s, j.b, j.l, j.e FROM {attempts}"
        ),
        format!(
            "UPDATE keel_webhook_deliveries AS d
                SET status = j.st, attempts = j.n,
                    next_attempt_at = COALESCE(j.next, d.next_attempt_at),
                    updated_at = j.at, leased_by = NULL, leased_until = NULL
               FROM {moves}
              WHERE d.id = j.d AND d.leased_by = $2 AND d.status = 'pending'"
        ),
    )
}

/// [`WebhookStore::webhook_complete`](keel_messaging::store::WebhookStore::webhook_complete).
pub async fn complete<B: SqlBackend>(
    store: &B,
    worker: &str,
    outcomes: &[DeliveryOutcome],
) -> Result<u64, StoreError> {
    if outcomes.is_empty() {
        return Ok(0);
    }
    let attempts: Vec<StoredAttempt<'_, <B::Dialect as Dialect>::JsonInstant>> = outcomes
        .iter()
        .map(|o| {
            let a = &o.attempt;
            StoredAttempt {
                d: a.delivery_id,
                n: a.attempt,
                at: B::Dialect::json_instant(a.at),
                url: &a.url,
                h: &a.request_headers,
                s: a.response_status,
                b: a.response_body.as_deref(),
                l: i64::try_from(a.latency.as_micros()).unwrap_or(i64::MAX),
                e: a.error.as_deref(),
            }
        })
        .collect();
    let moves: Vec<StoredMove<<B::Dialect as Dialect>::JsonInstant>> = outcomes
        .iter()
        .map(|o| StoredMove {
            d: o.attempt.delivery_id,
            st: o.status.as_str(),
            n: o.attempt.attempt,
            next: o.next_attempt_at.map(B::Dialect::json_instant),
            at: B::Dialect::json_instant(o.attempt.at),
        })
        .collect();
    let attempts = serde_json::to_string(&attempts).map_err(StoreError::other)?;
    let moves = serde_json::to_string(&moves).map_err(StoreError::other)?;
    let ids: Vec<i64> = outcomes.iter().map(|o| o.attempt.delivery_id).collect();
    let (insert_attempts, apply_moves) = complete_sql::<B::Dialect>();
    let owners_sql = format!(
        "SELECT id, endpoint_id FROM keel_webhook_deliveries WHERE {}",
        B::Dialect::any_of("id", "$1")
    );
    retry::<B::Dialect, _, _, _>("webhook_complete", || async {
        let mut tx = store.begin_own().await?;
        let owners: HashMap<i64, String> =
            B::Dialect::fetch_all(Exec::Tx(&mut tx), &owners_sql, &[Value::Ids(&ids)])
                .await?
                .iter()
                .map(|row| Ok((row.int("id")?, row.text("endpoint_id")?)))
                .collect::<Result<_, StoreError>>()?;
        B::Dialect::execute(
            Exec::Tx(&mut tx),
            &insert_attempts,
            &[Value::Json(&attempts)],
        )
        .await?;
        let applied = B::Dialect::execute(
            Exec::Tx(&mut tx),
            &apply_moves,
            &[Value::Json(&moves), worker.into()],
        )
        .await?;
        for (endpoint, health) in health(outcomes, &owners) {
            if let Some(success) = health.success {
                let params = [endpoint.into(), success.into()];
                B::Dialect::execute(Exec::Tx(&mut tx), SUCCESS_SQL, &params).await?;
            }
            if let Some(failure) = health.first_failure {
                let params = [endpoint.into(), failure.into()];
                B::Dialect::execute(Exec::Tx(&mut tx), FAILURE_SQL, &params).await?;
            }
        }
        store.commit_own(tx).await?;
        Ok(applied)
    })
    .await
}

/// [`WebhookStore::webhook_delivery_get`](keel_messaging::store::WebhookStore::webhook_delivery_get).
pub async fn delivery_get<B: SqlBackend>(
    store: &B,
    id: i64,
) -> Result<Option<WebhookDelivery>, StoreError> {
    let sql = format!("SELECT {DELIVERY_COLUMNS} FROM keel_webhook_deliveries WHERE id = $1");
    let row = store.read_optional(&sql, &[id.into()]).await?;
    row.as_ref()
        .map(delivery_from_row::<B::Dialect>)
        .transpose()
}

/// [`WebhookStore::webhook_delivery_list`](keel_messaging::store::WebhookStore::webhook_delivery_list):
/// newest first, paged by id.
pub async fn delivery_list<B: SqlBackend>(
    store: &B,
    filter: &DeliveryFilter,
) -> Result<Vec<WebhookDelivery>, StoreError> {
    let limit = filter.limit.unwrap_or(DEFAULT_LIST_LIMIT);
    if limit == 0 {
        return Ok(Vec::new());
    }
    let mut conditions = Filter::new();
    conditions
        .and("endpoint_id =", filter.endpoint_id.as_deref())
        .and("event_id =", filter.event_id.as_deref())
        .and("status =", filter.status.map(DeliveryStatus::as_str))
        .and("created_at >=", filter.created_from)
        .and("created_at <", filter.created_before)
        .and("id <", filter.before_id);
    let limit = conditions.param(sql_limit(limit));
    let sql = format!(
        "SELECT {DELIVERY_COLUMNS} FROM keel_webhook_deliveries {} ORDER BY id DESC LIMIT {limit}",
        conditions.where_clause()
    );
    let rows = store.read_all(&sql, conditions.params()).await?;
    rows.iter().map(delivery_from_row::<B::Dialect>).collect()
}

/// [`WebhookStore::webhook_attempts`](keel_messaging::store::WebhookStore::webhook_attempts).
pub async fn attempts<B: SqlBackend>(
    store: &B,
    delivery_id: i64,
) -> Result<Vec<DeliveryAttempt>, StoreError> {
    let rows = store.read_all(ATTEMPTS_SQL, &[delivery_id.into()]).await?;
    rows.iter().map(attempt_from_row::<B::Dialect>).collect()
}

/// [`WebhookStore::webhook_resend`](keel_messaging::store::WebhookStore::webhook_resend).
pub async fn resend<B: SqlBackend>(
    store: &B,
    delivery_id: i64,
    now: DateTime<Utc>,
) -> Result<bool, StoreError> {
    let params = [delivery_id.into(), now.into()];
    if write(store, "webhook_resend", RESEND_SQL, &params).await? == 1 {
        return Ok(true);
    }
    let sql = "SELECT id FROM keel_webhook_deliveries WHERE id = $1";
    match B::Dialect::fetch_optional(Exec::Pool(store.writer()), sql, &[delivery_id.into()]).await?
    {
        Some(_) => Ok(false),
        None => Err(StoreError::NotFound(format!(
            "webhook delivery {delivery_id}"
        ))),
    }
}

/// [`WebhookStore::webhook_replay`](keel_messaging::store::WebhookStore::webhook_replay):
/// refused while the endpoint is disabled, which the transaction holds
/// still while it requeues.
pub async fn replay<B: SqlBackend>(
    store: &B,
    endpoint_id: &str,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    include_succeeded: bool,
    now: DateTime<Utc>,
) -> Result<u64, StoreError> {
    let enabled_sql = format!(
        "SELECT enabled FROM keel_webhook_endpoints WHERE id = $1{}",
        B::Dialect::FOR_UPDATE
    );
    retry::<B::Dialect, _, _, _>("webhook_replay", || async {
        let mut tx = store.begin_own().await?;
        let endpoint =
            B::Dialect::fetch_optional(Exec::Tx(&mut tx), &enabled_sql, &[endpoint_id.into()])
                .await?;
        match endpoint {
            None => return Err(not_found_endpoint(endpoint_id)),
            Some(row) if !row.flag("enabled")? => {
                return Err(StoreError::Conflict(format!(
                    "webhook endpoint {endpoint_id:?} is disabled: enable it before replaying"
                )));
            }
            Some(_) => {}
        }
        let params = [
            endpoint_id.into(),
            from.into(),
            to.into(),
            include_succeeded.into(),
            now.into(),
        ];
        let requeued = B::Dialect::execute(Exec::Tx(&mut tx), REPLAY_SQL, &params).await?;
        store.commit_own(tx).await?;
        Ok(requeued)
    })
    .await
}

/// [`WebhookStore::webhook_failing_since`](keel_messaging::store::WebhookStore::webhook_failing_since).
pub async fn failing_since<B: SqlBackend>(
    store: &B,
    endpoint_id: &str,
) -> Result<Option<DateTime<Utc>>, StoreError> {
    let sql = "SELECT failing_since FROM keel_webhook_endpoints WHERE id = $1";
    match store.read_optional(sql, &[endpoint_id.into()]).await? {
        None => Err(not_found_endpoint(endpoint_id)),
        Some(row) => row.time_opt("failing_since"),
    }
}

/// [`WebhookStore::webhook_prune`](keel_messaging::store::WebhookStore::webhook_prune):
/// a bounded batch of finished deliveries with their attempts, in one
/// transaction (the attempts first, in the foreign key's order).
pub async fn prune<B: SqlBackend>(
    store: &B,
    before: DateTime<Utc>,
    batch: usize,
) -> Result<u64, StoreError> {
    if batch == 0 {
        return Ok(0);
    }
    let select = format!(
        "SELECT id FROM keel_webhook_deliveries
          WHERE status <> 'pending' AND updated_at < $1 ORDER BY updated_at LIMIT $2{}",
        B::Dialect::skip_locked(None)
    );
    let deletes = [
        format!(
            "DELETE FROM keel_webhook_attempts WHERE {}",
            B::Dialect::any_of("delivery_id", "$1")
        ),
        format!(
            "DELETE FROM keel_webhook_deliveries WHERE {}",
            B::Dialect::any_of("id", "$1")
        ),
    ];
    let deleted = retry::<B::Dialect, _, _, _>("webhook_prune", || async {
        let mut tx = store.begin_own().await?;
        let params = [before.into(), sql_limit(batch).into()];
        let ids = B::Dialect::fetch_all(Exec::Tx(&mut tx), &select, &params)
            .await?
            .iter()
            .map(|row| row.int("id"))
            .collect::<Result<Vec<_>, _>>()?;
        if ids.is_empty() {
            tx.rollback().await.map_err(B::Dialect::error)?;
            return Ok(0);
        }
        let mut deleted = 0;
        for sql in &deletes {
            deleted = B::Dialect::execute(Exec::Tx(&mut tx), sql, &[Value::Ids(&ids)]).await?;
        }
        store.commit_own(tx).await?;
        Ok(deleted)
    })
    .await?;
    if deleted > 0 {
        tracing::debug!(deleted, "webhook deliveries pruned");
    }
    Ok(deleted)
}

async fn endpoint_exists<B: SqlBackend>(tx: &mut Tx<B>, id: &str) -> Result<bool, StoreError> {
    let sql = "SELECT id FROM keel_webhook_endpoints WHERE id = $1";
    Ok(B::Dialect::fetch_optional(Exec::Tx(tx), sql, &[id.into()])
        .await?
        .is_some())
}

fn not_found_endpoint(id: &str) -> StoreError {
    StoreError::NotFound(format!("webhook endpoint {id:?}"))
}

fn endpoint_from_row<D: Dialect>(row: &D::Row) -> Result<WebhookEndpoint, StoreError> {
    let event_types = row.json("event_types")?;
    let format = row.text("format")?;
    Ok(WebhookEndpoint {
        id: row.text("id")?,
        url: row.text("url")?,
        description: row.text("description")?,
        event_types: serde_json::from_str(&event_types)
            .map_err(|e| corrupt(D::NAME, "webhook event types", e))?,
        secrets: secrets_from_json::<D>(&row.json("secrets")?)?,
        enabled: row.flag("enabled")?,
        disabled_reason: row.text_opt("disabled_reason")?,
        disabled_at: row.time_opt("disabled_at")?,
        failing_since: row.time_opt("failing_since")?,
        last_success_at: row.time_opt("last_success_at")?,
        created_at: row.time("created_at")?,
        updated_at: row.time("updated_at")?,
        tenant: row.text("tenant")?,
        format: WebhookFormat::parse(&format)
            .ok_or_else(|| corrupt(D::NAME, "webhook format", &format))?,
    })
}

fn delivery_from_row<D: Dialect>(row: &D::Row) -> Result<WebhookDelivery, StoreError> {
    let status = row.text("status")?;
    Ok(WebhookDelivery {
        id: row.int("id")?,
        endpoint_id: row.text("endpoint_id")?,
        event_id: row.text("event_id")?,
        event_type: row.text("event_type")?,
        payload: Bytes::from(row.bytes("payload")?),
        status: DeliveryStatus::parse(&status)
            .ok_or_else(|| corrupt(D::NAME, "webhook delivery status", &status))?,
        attempts: to_u32("webhook attempts", row.int("attempts")?)?,
        next_attempt_at: row.time("next_attempt_at")?,
        created_at: row.time("created_at")?,
        updated_at: row.time("updated_at")?,
        leased_by: row.text_opt("leased_by")?,
        leased_until: row.time_opt("leased_until")?,
    })
}

fn attempt_from_row<D: Dialect>(row: &D::Row) -> Result<DeliveryAttempt, StoreError> {
    let headers = row.json("request_headers")?;
    Ok(DeliveryAttempt {
        delivery_id: row.int("delivery_id")?,
        attempt: to_u32("webhook attempt number", row.int("attempt")?)?,
        at: row.time("at")?,
        url: row.text("url")?,
        request_headers: serde_json::from_str(&headers)
            .map_err(|e| corrupt(D::NAME, "webhook request headers", e))?,
        response_status: row
            .int_opt("response_status")?
            .map(|s| u16::try_from(s).map_err(|e| corrupt(D::NAME, "webhook response status", e)))
            .transpose()?,
        response_body: row.text_opt("response_body")?,
        latency: Duration::from_micros(u64::try_from(row.int("latency_us")?).unwrap_or(0)),
        error: row.text_opt("error")?,
    })
}

/// Implements [`WebhookStore`](keel_messaging::store::WebhookStore) for a
/// [`WebhookBackend`].
#[macro_export]
macro_rules! webhook_store {
    ($store:ty) => {
        #[$crate::__private::async_trait]
        impl $crate::__private::store::WebhookStore for $store {
            async fn webhook_endpoint_create(
                &self,
                endpoint: &$crate::__private::store::WebhookEndpoint,
            ) -> ::std::result::Result<(), $crate::__private::StoreError> {
                $crate::webhooks::endpoint_create(self, endpoint).await
            }

            async fn webhook_endpoint_get(
                &self,
                id: &str,
            ) -> ::std::result::Result<
                ::std::option::Option<$crate::__private::store::WebhookEndpoint>,
                $crate::__private::StoreError,
            > {
                $crate::webhooks::endpoint_get(self, id).await
            }

            async fn webhook_endpoint_list(
                &self,
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::__private::store::WebhookEndpoint>,
                $crate::__private::StoreError,
            > {
                $crate::webhooks::endpoint_list(self).await
            }

            async fn webhook_endpoint_update(
                &self,
                endpoint: &$crate::__private::store::WebhookEndpoint,
                now: $crate::__private::DateTime<$crate::__private::Utc>,
            ) -> ::std::result::Result<(), $crate::__private::StoreError> {
                $crate::webhooks::endpoint_update(self, endpoint, now).await
            }

            async fn webhook_endpoint_rotate_secret(
                &self,
                id: &str,
                secret: &$crate::__private::store::WebhookSecret,
                previous_expires_at: $crate::__private::DateTime<$crate::__private::Utc>,
            ) -> ::std::result::Result<
                $crate::__private::store::WebhookEndpoint,
                $crate::__private::StoreError,
            > {
                $crate::webhooks::endpoint_rotate_secret(self, id, secret, previous_expires_at)
                    .await
            }

            async fn webhook_endpoint_disable(
                &self,
                id: &str,
                reason: &str,
                at: $crate::__private::DateTime<$crate::__private::Utc>,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::webhooks::endpoint_disable(self, id, reason, at).await
            }

            async fn webhook_endpoint_enable(
                &self,
                id: &str,
                at: $crate::__private::DateTime<$crate::__private::Utc>,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::webhooks::endpoint_enable(self, id, at).await
            }

            async fn webhook_endpoint_delete(
                &self,
                id: &str,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::webhooks::endpoint_delete(self, id).await
            }

            async fn webhook_enqueue(
                &self,
                tx: &mut <Self as $crate::__private::store::Store>::Tx,
                messages: &[$crate::__private::store::WebhookMessage],
                now: $crate::__private::DateTime<$crate::__private::Utc>,
            ) -> ::std::result::Result<u64, $crate::__private::StoreError> {
                $crate::webhooks::enqueue(self, tx, messages, now).await
            }

            async fn webhook_claim_due(
                &self,
                worker: &str,
                now: $crate::__private::DateTime<$crate::__private::Utc>,
                limit: usize,
                per_endpoint: usize,
                lease: ::std::time::Duration,
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::__private::store::ClaimedDelivery>,
                $crate::__private::StoreError,
            > {
                $crate::webhooks::claim_due(self, worker, now, limit, per_endpoint, lease).await
            }

            async fn webhook_complete(
                &self,
                worker: &str,
                outcomes: &[$crate::__private::store::DeliveryOutcome],
            ) -> ::std::result::Result<u64, $crate::__private::StoreError> {
                $crate::webhooks::complete(self, worker, outcomes).await
            }

            async fn webhook_delivery_get(
                &self,
                id: i64,
            ) -> ::std::result::Result<
                ::std::option::Option<$crate::__private::store::WebhookDelivery>,
                $crate::__private::StoreError,
            > {
                $crate::webhooks::delivery_get(self, id).await
            }

            async fn webhook_delivery_list(
                &self,
                filter: &$crate::__private::store::DeliveryFilter,
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::__private::store::WebhookDelivery>,
                $crate::__private::StoreError,
            > {
                $crate::webhooks::delivery_list(self, filter).await
            }

            async fn webhook_attempts(
                &self,
                delivery_id: i64,
            ) -> ::std::result::Result<
                ::std::vec::Vec<$crate::__private::store::DeliveryAttempt>,
                $crate::__private::StoreError,
            > {
                $crate::webhooks::attempts(self, delivery_id).await
            }

            async fn webhook_resend(
                &self,
                delivery_id: i64,
                now: $crate::__private::DateTime<$crate::__private::Utc>,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::webhooks::resend(self, delivery_id, now).await
            }

            async fn webhook_replay(
                &self,
                endpoint_id: &str,
                from: $crate::__private::DateTime<$crate::__private::Utc>,
                to: $crate::__private::DateTime<$crate::__private::Utc>,
                include_succeeded: bool,
                now: $crate::__private::DateTime<$crate::__private::Utc>,
            ) -> ::std::result::Result<u64, $crate::__private::StoreError> {
                $crate::webhooks::replay(self, endpoint_id, from, to, include_succeeded, now).await
            }

            async fn webhook_failing_since(
                &self,
                endpoint_id: &str,
            ) -> ::std::result::Result<
                ::std::option::Option<$crate::__private::DateTime<$crate::__private::Utc>>,
                $crate::__private::StoreError,
            > {
                $crate::webhooks::failing_since(self, endpoint_id).await
            }

            async fn webhook_prune(
                &self,
                before: $crate::__private::DateTime<$crate::__private::Utc>,
                batch: usize,
            ) -> ::std::result::Result<u64, $crate::__private::StoreError> {
                $crate::webhooks::prune(self, before, batch).await
            }
        }
    };
}
