//! The saga's side of shipping: `CreateShipment` over gRPC with the call's
//! deadline on the wire, behind the same policies as the shop's HTTP
//! dependencies (retry with backoff, the `shipping` breaker from the
//! shared registry so the console shows it, a timeout per attempt, a
//! bulkhead).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use keel_core::error::find_cause;
use keel_core::{Classified, Classify, Rejected};
use keel_grpc::GrpcCallError;
use keel_grpc::client::PropagationLayer;
use keel_grpc::replay::{ChannelBodyLayer, ReplayBodyLayer};
use keel_policy::ConfigError;
use keel_policy::breaker::BreakerRegistry;
use keel_policy::bulkhead::{Bulkhead, BulkheadLayer};
use keel_policy::retry::{Backoff, Jitter, Retry, grpc_verdict};
use keel_policy::timeout::Timeout;
use parking_lot::Mutex;
use tonic::transport::Endpoint;

use super::pb::CreateShipmentRequest;
use super::pb::shipping_client::ShippingClient as Generated;
use crate::shop::saga::DependencyTuning;

type Stack = tower::util::BoxCloneService<
    http::Request<tonic::body::Body>,
    http::Response<tonic::body::Body>,
    tonic::Status,
>;

/// The shipping service's client, with its policies.
#[derive(Clone)]
pub struct ShippingClient {
    // The policy stack is `Send` but not `Sync` (a bulkhead holds the
    // future of a slot being acquired); each call clones it out.
    inner: Arc<Mutex<Generated<Stack>>>,
}

impl std::fmt::Debug for ShippingClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShippingClient").finish_non_exhaustive()
    }
}

impl ShippingClient {
    /// A client of the service at `url` (`http://host:port`), connecting
    /// on first use, sending `token` as `authorization: Bearer` if given.
    pub fn new(
        url: &str,
        token: Option<&str>,
        breakers: &BreakerRegistry,
        tuning: &DependencyTuning,
    ) -> Result<Self, ConfigError> {
        let authorization = token
            .map(|token| http::HeaderValue::from_str(&format!("Bearer {token}")))
            .transpose()
            .map_err(|e| ConfigError::new("shipping token", e.to_string()))?;
        let channel = Endpoint::from_shared(url.to_owned())
            .map_err(|e| ConfigError::new("shipping url", e.to_string()))?
            .connect_timeout(Duration::from_secs(1))
            .connect_lazy();
        let backoff =
            Backoff::exponential(Duration::from_millis(20), 2.0, Duration::from_millis(200))
                .and_then(|b| b.with_jitter(Jitter::Full))?;
        let retry = Retry::builder("shipping")
            .max_attempts(tuning.attempts.max(1))
            .backoff(backoff)
            // The create call carries its idempotency key: repeating one
            // whose outcome is unknown is safe.
            .retry_outcome_unknown(true)
            .retry_on_result(grpc_verdict::<tonic::body::Body>)
            .build()?;
        let attempt = Timeout::builder("shipping")
            .timeout(tuning.attempt_timeout)
            .build()?;
        let whole = Timeout::builder("shipping-call")
            .timeout(tuning.timeout)
            .build()?;
        let bulkhead = Bulkhead::builder("shipping")
            .max_concurrent(tuning.max_concurrent)
            .build()?;
        let stack = tower::ServiceBuilder::new()
            // Counted as the `shipping` dependency, like the HTTP ones, so
            // the console's history graphs its calls, failures and latency.
            .layer(PropagationLayer::new().dependency("shipping"))
            .layer(whole.layer())
            .layer(ReplayBodyLayer::new())
            .layer(retry.layer())
            .layer(breakers.get("shipping").grpc_layer())
            .layer(attempt.layer())
            .layer(BulkheadLayer::new(bulkhead))
            .layer(ChannelBodyLayer)
            .map_request(move |mut request: http::Request<_>| {
                if let Some(value) = &authorization {
                    request
                        .headers_mut()
                        .insert(http::header::AUTHORIZATION, value.clone());
                }
                request
            })
            .service(channel);
        Ok(Self {
            inner: Arc::new(Mutex::new(Generated::new(
                tower::util::BoxCloneService::new(stack),
            ))),
        })
    }

    /// Schedules the order's shipment under `key`: a retry with the same
    /// key schedules nothing new.
    pub fn create_shipment(
        &self,
        order_id: String,
        key: String,
    ) -> Pin<Box<dyn Future<Output = Result<(), Classified>> + Send>> {
        let mut client = self.raw();
        let request = CreateShipmentRequest {
            order_id,
            request_id: key,
        };
        Box::pin(async move {
            client
                .create_shipment(request)
                .await
                .map(drop)
                .map_err(classified)
        })
    }

    /// The generated client with the policies, for the other calls.
    pub fn raw(&self) -> Generated<Stack> {
        self.inner.lock().clone()
    }
}

/// The status with its class. A policy's refusal keeps the [`Rejected`]
/// itself as the cause, so the saga finds its `Retry-After` and does not
/// count it as an attempt: the call never left.
fn classified(status: tonic::Status) -> Classified {
    let err = GrpcCallError::from(status);
    match find_cause::<Rejected>(&err) {
        Some(rejected) => Classified::new(err.class(), rejected.clone()),
        None => Classified::new(err.class(), err),
    }
}
