//! The webhook deliveries' part of the admin API (feature `webhooks`):
//! list and inspect deliveries with their attempt logs, and send one again.

use axum::Json;
use axum::Router;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::routing::{get, post};

use crate::model::Listing;
use crate::routes::{Reply, query};
use crate::{
    ActionJson, Admin, AdminError, AdminStore, DeliveryAttemptJson, DeliveryJson, DeliveryQuery,
    action,
};

impl<S: AdminStore> Admin<S> {
    /// Webhook deliveries matching `query`, newest first; with
    /// `with_attempts`, each with its attempt log.
    pub async fn deliveries(
        &self,
        query: &DeliveryQuery,
        with_attempts: bool,
    ) -> Result<Vec<DeliveryJson>, AdminError> {
        let filter = query.filter()?;
        let deliveries = self.inner.endpoints.deliveries(&filter).await?;
        let mut out = Vec::with_capacity(deliveries.len());
        for delivery in &deliveries {
            let mut json = DeliveryJson::from(delivery);
            if with_attempts {
                json.attempt_log = self.attempt_log(delivery.id).await?;
            }
            out.push(json);
        }
        Ok(out)
    }

    /// One delivery with its attempt log; `id` is the delivery's number.
    pub async fn delivery(&self, id: &str) -> Result<DeliveryJson, AdminError> {
        let id = delivery_id(id)?;
        let delivery = self.inner.endpoints.delivery(id).await?;
        let mut json = DeliveryJson::from(&delivery);
        json.attempt_log = self.attempt_log(id).await?;
        Ok(json)
    }

    /// Queues a delivery again from a fresh retry schedule.
    pub async fn resend_delivery(&self, id: &str) -> Result<ActionJson, AdminError> {
        let number = delivery_id(id)?;
        self.inner.endpoints.resend(number).await?;
        Ok(action("resent", id, 1))
    }

    async fn attempt_log(&self, id: i64) -> Result<Vec<DeliveryAttemptJson>, AdminError> {
        let attempts = self.inner.endpoints.attempts(id).await?;
        Ok(attempts.iter().map(DeliveryAttemptJson::from).collect())
    }
}

/// The deliveries' routes, added to the admin API's router.
pub(crate) fn routes<S: AdminStore>(router: Router<Admin<S>>) -> Router<Admin<S>> {
    router
        .route("/admin/api/webhook-deliveries", get(deliveries::<S>))
        .route("/admin/api/webhook-deliveries/{id}", get(delivery::<S>))
        .route(
            "/admin/api/webhook-deliveries/{id}/resend",
            post(resend::<S>),
        )
}

async fn deliveries<S: AdminStore>(
    State(admin): State<Admin<S>>,
    q: Result<Query<DeliveryQuery>, QueryRejection>,
) -> Reply<Listing<DeliveryJson>> {
    Ok(Json(admin.deliveries(&query(q)?, false).await?.into()))
}

async fn delivery<S: AdminStore>(
    State(admin): State<Admin<S>>,
    Path(id): Path<String>,
) -> Reply<DeliveryJson> {
    Ok(Json(admin.delivery(&id).await?))
}

async fn resend<S: AdminStore>(
    State(admin): State<Admin<S>>,
    Path(id): Path<String>,
) -> Reply<ActionJson> {
    Ok(Json(admin.resend_delivery(&id).await?))
}

fn delivery_id(id: &str) -> Result<i64, AdminError> {
    id.parse().map_err(|_| {
        AdminError::bad_request(format!(
            "`{id}` is not a delivery id: delivery ids are whole numbers"
        ))
    })
}
