//! Endpoints: their subscriptions, secrets (rotated with a grace period) and
//! enabled state.

use chrono::{DateTime, Utc};
use keel_store::StoreError;
use keel_store::{WebhookEndpoint, WebhookFormat, WebhookSecret};
use serde::{Deserialize, Serialize};

use super::{ENDPOINT_COLUMNS, endpoint_name, not_found_endpoint};
use crate::backend::{SqlBackend, refused_or_missing};
use crate::dialect::{Dialect, Exec, SqlRow, Value};
use crate::error::corrupt;
use crate::retry::{retry, write};

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

/// [`WebhookEndpointStore::webhook_endpoint_create`](keel_store::WebhookEndpointStore::webhook_endpoint_create).
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

/// [`WebhookEndpointStore::webhook_endpoint_get`](keel_store::WebhookEndpointStore::webhook_endpoint_get).
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

/// [`WebhookEndpointStore::webhook_endpoint_list`](keel_store::WebhookEndpointStore::webhook_endpoint_list).
pub async fn endpoint_list<B: SqlBackend>(store: &B) -> Result<Vec<WebhookEndpoint>, StoreError> {
    let rows = store.read_all(&all_endpoints_sql(), &[]).await?;
    rows.iter().map(endpoint_from_row::<B::Dialect>).collect()
}

pub(super) fn all_endpoints_sql() -> String {
    format!("SELECT {ENDPOINT_COLUMNS} FROM keel_webhook_endpoints ORDER BY created_at, id")
}

/// [`WebhookEndpointStore::webhook_endpoint_update`](keel_store::WebhookEndpointStore::webhook_endpoint_update).
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

/// [`WebhookEndpointStore::webhook_endpoint_rotate_secret`](keel_store::WebhookEndpointStore::webhook_endpoint_rotate_secret):
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

/// [`WebhookEndpointStore::webhook_endpoint_disable`](keel_store::WebhookEndpointStore::webhook_endpoint_disable):
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
            let on = Exec::Tx(&mut tx);
            let answer =
                refused_or_missing::<B::Dialect>(on, ENDPOINTS, id.into(), || endpoint_name(id))
                    .await;
            store.rollback_own(tx).await?;
            return answer;
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

/// [`WebhookEndpointStore::webhook_endpoint_enable`](keel_store::WebhookEndpointStore::webhook_endpoint_enable).
pub async fn endpoint_enable<B: SqlBackend>(
    store: &B,
    id: &str,
    at: DateTime<Utc>,
) -> Result<bool, StoreError> {
    let params = [id.into(), at.into()];
    if write(store, "webhook_endpoint_enable", ENABLE_SQL, &params).await? == 1 {
        return Ok(true);
    }
    let on = Exec::Pool(store.writer());
    refused_or_missing::<B::Dialect>(on, ENDPOINTS, id.into(), || endpoint_name(id)).await
}

/// [`WebhookEndpointStore::webhook_endpoint_delete`](keel_store::WebhookEndpointStore::webhook_endpoint_delete):
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

/// The endpoints' table.
const ENDPOINTS: &str = "keel_webhook_endpoints";

pub(super) fn endpoint_from_row<D: Dialect>(row: &D::Row) -> Result<WebhookEndpoint, StoreError> {
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
