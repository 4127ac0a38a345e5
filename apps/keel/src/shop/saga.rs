//! The order fulfilment saga: capture the payment, reserve the stock,
//! schedule the shipment (the pivot), send the receipt.
//!
//! Every call goes to a dependency through its own policies: over HTTP
//! through a [`Dependency`], and to shipping over gRPC through a
//! [`ShippingClient`] (deadline on the wire, retry, one breaker per
//! dependency from a shared [`BreakerRegistry`], bulkhead, timeouts), and
//! carries the step's derived idempotency key (`saga_id:step`, or
//! `saga_id:undo:step` for a compensation), so a repeated call is deduped
//! by the service. Out of stock is permanent and makes the saga refund;
//! once the shipment may have been scheduled it only retries forward. A
//! refund or a release sends the key of the action it undoes
//! (`actionKey`), which the service tombstones so a late capture or
//! reservation is refused.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use keel_client::{Dependency, HttpCallError, PropagatingClient};
use keel_core::{Classified, Classify, ErrorClass};
use keel_messaging::saga::{Backoff, SagaDefinition, SagaError, Step, StepContext};
use keel_policy::ConfigError;
use keel_policy::breaker::BreakerRegistry;
use keel_policy::bulkhead::BulkheadConfig;
use keel_policy::fallback::LastGood;
use keel_policy::retry::{BackoffConfig, Jitter, RetryConfig};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::model::{DeliveryEstimate, DemoFault, Item};
use super::quotes::CarrierQuotes;
use super::services::DependencyUrls;
use super::shipping::ShippingClient;

/// The saga's name.
pub const SAGA: &str = "order_fulfilment";
/// Its steps, in order.
pub const STEPS: [&str; 4] = [
    "capture_payment",
    "reserve_stock",
    "schedule_shipment",
    "send_receipt",
];
/// Attempts at a compensation before the saga is stuck (a policy's refusal
/// is not an attempt).
pub const STUCK_AFTER: u32 = 8;
/// Attempts at a step up to and including the pivot before the saga
/// compensates (refusals by an open breaker do not count). Once the pivot
/// may have happened, and after it, the saga retries forward for the
/// definition's forward budget instead (keel's default, 10 minutes).
pub const MAX_ATTEMPTS: u32 = 10;

/// What the saga carries from step to step.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FulfilmentData {
    /// The order (also the saga id).
    pub order_id: String,
    /// Who ordered.
    pub customer_id: String,
    /// The amount to capture.
    pub total_cents: i64,
    /// What to reserve.
    pub items: Vec<Item>,
    /// A demo fault to act out.
    #[serde(default)]
    pub demo_fault: Option<DemoFault>,
    /// The order event's fields this version does not know, carried along.
    #[serde(flatten, default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub extra: super::model::UnknownFields,
}

/// The four dependencies, each behind its own policies.
#[derive(Debug, Clone)]
pub struct Dependencies {
    urls: DependencyUrls,
    payments: Dependency,
    inventory: Dependency,
    shipping: ShippingClient,
    notifications: Dependency,
    estimates: DeliveryEstimates,
    quotes: CarrierQuotes,
    /// Sagas whose demo `stuck-saga` refund has failed until stuck: the
    /// next refund (after an operator's retry) succeeds.
    stuck_refunds: Arc<Mutex<HashSet<String>>>,
}

/// How the dependencies' policies are tuned.
#[derive(Debug, Clone, PartialEq)]
pub struct DependencyTuning {
    /// The whole call, retries included.
    pub timeout: Duration,
    /// One attempt.
    pub attempt_timeout: Duration,
    /// Attempts per call.
    pub attempts: u32,
    /// Calls in flight per dependency.
    pub max_concurrent: usize,
}

impl Default for DependencyTuning {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(2),
            attempt_timeout: Duration::from_millis(300),
            attempts: 3,
            max_concurrent: 64,
        }
    }
}

impl Dependencies {
    /// Builds the four dependencies on `urls`, taking their breakers from
    /// `breakers` (so operators see them all in one place).
    pub fn new(
        urls: DependencyUrls,
        breakers: &BreakerRegistry,
        tuning: &DependencyTuning,
        shipping_token: Option<&str>,
    ) -> Result<Self, ConfigError> {
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .build()
            .map_err(|e| ConfigError::new("http client", e.to_string()))?;
        let client = PropagatingClient::new(http);
        let retry = RetryConfig {
            max_attempts: std::num::NonZeroU32::new(tuning.attempts.max(1))
                .unwrap_or(std::num::NonZeroU32::MIN),
            backoff: BackoffConfig::Exponential {
                base: Duration::from_millis(20),
                factor: 2.0,
                max_delay: Duration::from_millis(200),
                jitter: Jitter::Full,
            },
            // Every call carries an idempotency key, so repeating one whose
            // outcome is unknown is safe.
            retry_outcome_unknown: true,
            ..RetryConfig::default()
        };
        let bulkhead = BulkheadConfig {
            max_concurrent: tuning.max_concurrent,
            ..BulkheadConfig::default()
        };
        // Each through the balancer, so a dependency given more endpoints
        // (or a canary subset) is routed by load and weight.
        let build = |name: &str, url: &str| {
            client
                .dependency(name)
                .endpoints([url])
                .timeout(tuning.timeout)
                .attempt_timeout(tuning.attempt_timeout)
                .retry(retry.clone())
                .bulkhead(bulkhead.clone())
                .breaker_from(breakers)
                .build()
        };
        // Estimates are a read of their own: their own breaker (a failing
        // read must not stop shipments) and a short budget, since the order
        // page waits for them.
        let estimates = client
            .dependency("shipping-estimates")
            .timeout(Duration::from_millis(300))
            .attempt_timeout(Duration::from_millis(150))
            .breaker_from(breakers)
            .build()?;
        let last_good = LastGood::builder("shipping-estimates")
            .max_age(Duration::from_secs(600))
            .build()?;
        Ok(Self {
            estimates: DeliveryEstimates {
                dependency: estimates,
                url: format!("{}/estimates", urls.shipping),
                last_good,
            },
            quotes: CarrierQuotes::new(client.clone(), &urls.shipping, breakers)?,
            payments: build("payments", &urls.payments)?,
            inventory: build("inventory", &urls.inventory)?,
            shipping: ShippingClient::new(&urls.shipping_grpc, shipping_token, breakers, tuning)?,
            notifications: build("notifications", &urls.notifications)?,
            urls,
            stuck_refunds: Arc::default(),
        })
    }

    /// The dependencies' URLs.
    pub fn urls(&self) -> &DependencyUrls {
        &self.urls
    }

    /// Shipping's delivery estimates, for the order page.
    pub fn estimates(&self) -> DeliveryEstimates {
        self.estimates.clone()
    }

    /// The carriers' shipping quotes, for the order page.
    pub fn quotes(&self) -> CarrierQuotes {
        self.quotes.clone()
    }
}

/// Delivery estimates from shipping, with its last good answer per
/// customer served (and marked stale) for up to 10 minutes when shipping
/// cannot answer.
#[derive(Debug, Clone)]
pub struct DeliveryEstimates {
    dependency: Dependency,
    url: String,
    last_good: LastGood<String, u32>,
}

impl DeliveryEstimates {
    /// `customer`'s estimate; `None` when shipping fails with nothing
    /// recent to fall back on (the order page shows no estimate then).
    pub async fn for_customer(&self, customer: &str) -> Option<DeliveryEstimate> {
        let url = format!("{}/{customer}", self.url);
        let fetch = || async {
            let response = self
                .dependency
                .send(|http| http.get(url.as_str()))
                .await
                .map_err(classified)?;
            let body: serde_json::Value = response
                .json()
                .await
                .map_err(|e| Classified::new(ErrorClass::Retryable, e))?;
            let days = body["days"].as_u64().and_then(|d| u32::try_from(d).ok());
            days.ok_or_else(|| Classified::new(ErrorClass::Permanent, "an estimate without days"))
        };
        match self.last_good.call(customer.to_owned(), fetch).await {
            Ok(answer) => Some(DeliveryEstimate {
                stale_seconds: answer.staleness().map(|age| age.as_secs()),
                days: answer.into_value(),
            }),
            Err(error) => {
                tracing::debug!(%error, customer, "no delivery estimate");
                None
            }
        }
    }
}

/// The call's error with its class. A policy's refusal keeps the
/// [`Rejected`](keel_core::Rejected) itself as the cause, so the saga finds its `Retry-After`
/// (and does not count it as an attempt: the call never left).
pub(crate) fn classified(err: HttpCallError) -> Classified {
    match err.rejected() {
        Some(rejected) => Classified::new(err.class(), rejected.clone()),
        None => Classified::new(err.class(), err),
    }
}

async fn call(
    dep: &Dependency,
    path: &str,
    key: &str,
    body: serde_json::Value,
) -> Result<(), Classified> {
    dep.send_routed(|http, endpoint| {
        http.post(endpoint.url(path))
            .header("idempotency-key", key)
            .json(&body)
    })
    .await
    .map(drop)
    .map_err(classified)
}

type Ctx = StepContext<FulfilmentData>;

/// Builds the fulfilment saga over `deps`.
pub fn definition(deps: &Dependencies) -> Result<SagaDefinition<FulfilmentData>, SagaError> {
    let backoff = Backoff::exponential(Duration::from_millis(100), 2.0, Duration::from_secs(2))
        .and_then(|b| b.with_jitter(Jitter::Full))
        .map_err(|e| SagaError::Definition {
            saga: SAGA.to_owned(),
            problems: e.to_string(),
        })?;
    let timeout = Duration::from_secs(5);
    SagaDefinition::builder(SAGA)
        .step(
            capture_payment(deps)
                .timeout(timeout)
                .max_attempts(MAX_ATTEMPTS),
        )
        .step(
            reserve_stock(deps)
                .timeout(timeout)
                .max_attempts(MAX_ATTEMPTS),
        )
        .pivot(
            schedule_shipment(deps)
                .timeout(timeout)
                .max_attempts(MAX_ATTEMPTS),
        )
        .step(send_receipt(deps).timeout(timeout))
        .backoff(backoff)
        .stuck_after(STUCK_AFTER)
        .build()
}

/// Captures the payment; refunds it to compensate (a demo fault keeps
/// the refund failing until an operator retries the saga).
fn capture_payment(deps: &Dependencies) -> Step<FulfilmentData> {
    let d = deps.clone();
    let capture = Step::new("capture_payment", move |ctx: Ctx| {
        let d = d.clone();
        async move {
            let data = ctx.data();
            let body =
                serde_json::json!({"orderId": data.order_id, "amountCents": data.total_cents});
            call(&d.payments, "/captures", ctx.idempotency_key(), body).await
        }
    });
    let d = deps.clone();
    capture.compensate_with(move |ctx: Ctx| {
        let d = d.clone();
        async move {
            let data = ctx.data();
            if data.demo_fault == Some(DemoFault::StuckSaga) {
                let mut stuck = d.stuck_refunds.lock();
                if !stuck.contains(ctx.saga_id()) {
                    if ctx.attempt() >= STUCK_AFTER {
                        stuck.insert(ctx.saga_id().to_owned());
                    }
                    return Err(Classified::retryable(
                        "demo fault: the refund fails until an operator retries the saga",
                    ));
                }
            }
            let body = serde_json::json!({"orderId": data.order_id, "actionKey": ctx.action_key()});
            call(&d.payments, "/refunds", ctx.idempotency_key(), body).await
        }
    })
}

/// Reserves the items; releases them to compensate.
fn reserve_stock(deps: &Dependencies) -> Step<FulfilmentData> {
    let d = deps.clone();
    let reserve = Step::new("reserve_stock", move |ctx: Ctx| {
        let d = d.clone();
        async move {
            let data = ctx.data();
            if data.demo_fault == Some(DemoFault::StuckSaga) {
                return Err(Classified::permanent("demo fault: reserve_stock refused"));
            }
            let body = serde_json::json!({"orderId": data.order_id, "items": data.items});
            call(&d.inventory, "/reservations", ctx.idempotency_key(), body).await
        }
    });
    let d = deps.clone();
    reserve.compensate_with(move |ctx: Ctx| {
        let d = d.clone();
        async move {
            let body =
                serde_json::json!({"orderId": ctx.data().order_id, "actionKey": ctx.action_key()});
            call(&d.inventory, "/releases", ctx.idempotency_key(), body).await
        }
    })
}

/// Creates the shipment over gRPC: the pivot, past which the saga only
/// goes forward.
fn schedule_shipment(deps: &Dependencies) -> Step<FulfilmentData> {
    let d = deps.clone();
    Step::new("schedule_shipment", move |ctx: Ctx| {
        let d = d.clone();
        async move {
            d.shipping
                .create_shipment(
                    ctx.data().order_id.clone(),
                    ctx.idempotency_key().to_owned(),
                )
                .await
        }
    })
}

/// Sends the receipt.
fn send_receipt(deps: &Dependencies) -> Step<FulfilmentData> {
    let d = deps.clone();
    Step::new("send_receipt", move |ctx: Ctx| {
        let d = d.clone();
        async move {
            let body = serde_json::json!({"orderId": ctx.data().order_id});
            call(&d.notifications, "/receipts", ctx.idempotency_key(), body).await
        }
    })
}
