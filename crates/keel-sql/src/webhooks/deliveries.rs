//! Deliveries: the fan-out into the caller's transaction, claims, the
//! delivery log, resends, replays and pruning.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use keel_store::StoreError;
use keel_store::{
    ClaimedDelivery, DeliveryAttempt, DeliveryFilter, DeliveryStatus, WebhookDelivery,
    WebhookEndpoint, WebhookMessage,
};

use super::endpoints::{all_endpoints_sql, endpoint_from_row};
use super::{DELIVERY_COLUMNS, ENDPOINT_COLUMNS, WebhookBackend, not_found_endpoint};
use crate::backend::{SqlBackend, Tx, Wake, refused_or_missing, signalled};
use crate::dialect::{Dialect, Exec, SqlRow, Value};
use crate::error::{corrupt, sql_limit, to_u32};
use crate::filter::Filter;
use crate::retry::{retry, write};

/// Deliveries per enqueue statement (5 parameters each, far below either
/// database's limit).
const ENQUEUE_CHUNK: usize = 64;

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

/// The default page of [`WebhookLogStore::webhook_delivery_list`](keel_store::WebhookLogStore::webhook_delivery_list).
const DEFAULT_LIST_LIMIT: usize = 100;

/// [`WebhookDeliveryStore::webhook_enqueue`](keel_store::WebhookDeliveryStore::webhook_enqueue):
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
        params.extend::<[Value<'_>; 6]>([
            endpoint.id.as_str().into(),
            message.event_id.as_str().into(),
            message.event_type.as_str().into(),
            message.payload.as_ref().into(),
            status.as_str().into(),
            message.traceparent.as_deref().into(),
        ]);
        let [e, i, t, p, s, tp] = std::array::from_fn(|n| first + n);
        rows.push(format!(
            "(${e}, ${i}, ${t}, ${p}, ${s}, ${tp}, 0, $1, $1, $1)"
        ));
    }
    let insert = format!(
        "INSERT INTO keel_webhook_deliveries (endpoint_id, event_id, event_type, payload, status,
             traceparent, attempts, next_attempt_at, created_at, updated_at)
         VALUES {}
         ON CONFLICT (endpoint_id, event_id) DO NOTHING
         RETURNING status",
        rows.join(", ")
    );
    let (sql, params) = signalled(store, Wake::Webhooks, &insert, params);
    let created = B::Dialect::fetch_all(Exec::Tx(tx), &sql, &params).await?;
    let mut pending = 0;
    for row in &created {
        if row.text("status")? == DeliveryStatus::Pending.as_str() {
            pending += 1;
        }
    }
    Ok(pending)
}

/// [`WebhookDeliveryStore::webhook_claim_due`](keel_store::WebhookDeliveryStore::webhook_claim_due).
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

/// [`WebhookLogStore::webhook_delivery_get`](keel_store::WebhookLogStore::webhook_delivery_get).
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

/// [`WebhookLogStore::webhook_delivery_list`](keel_store::WebhookLogStore::webhook_delivery_list):
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

/// [`WebhookLogStore::webhook_attempts`](keel_store::WebhookLogStore::webhook_attempts).
pub async fn attempts<B: SqlBackend>(
    store: &B,
    delivery_id: i64,
) -> Result<Vec<DeliveryAttempt>, StoreError> {
    let rows = store.read_all(ATTEMPTS_SQL, &[delivery_id.into()]).await?;
    rows.iter().map(attempt_from_row::<B::Dialect>).collect()
}

/// [`WebhookLogStore::webhook_resend`](keel_store::WebhookLogStore::webhook_resend).
pub async fn resend<B: SqlBackend>(
    store: &B,
    delivery_id: i64,
    now: DateTime<Utc>,
) -> Result<bool, StoreError> {
    let params = [delivery_id.into(), now.into()];
    if write(store, "webhook_resend", RESEND_SQL, &params).await? == 1 {
        return Ok(true);
    }
    let on = Exec::Pool(store.writer());
    refused_or_missing::<B::Dialect>(on, "keel_webhook_deliveries", delivery_id.into(), || {
        format!("webhook delivery {delivery_id}")
    })
    .await
}

/// [`WebhookLogStore::webhook_replay`](keel_store::WebhookLogStore::webhook_replay):
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

/// [`WebhookDeliveryStore::webhook_failing_since`](keel_store::WebhookDeliveryStore::webhook_failing_since).
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

/// [`WebhookDeliveryStore::webhook_prune`](keel_store::WebhookDeliveryStore::webhook_prune):
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
            store.rollback_own(tx).await?;
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
        traceparent: row.text_opt("traceparent")?,
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
