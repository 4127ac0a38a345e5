//! Chaos experiments at the edge, scoped to the requests that ask for
//! them, as a service mesh's header-matched fault filter does.
//!
//! "Real failures, in a real environment, scoped to traffic carrying one
//! header — so only your test client sees it." A request carrying
//! `x-chaos-experiment: shipping-outage` is run as part of that
//! experiment ([`ChaosExperiment::scope`]): the faults configured for the
//! experiment on the matched route (a delay, an abort answered with a
//! status such as `503`) are injected before the handler runs, every
//! [`FaultInjection`] inside the handler for that experiment acts, and
//! `keel-client`'s `PropagatingClient` forwards the header to the
//! dependencies it calls, so the experiment follows the request
//! downstream. Requests without the header never see a fault.
//!
//! Safe by default:
//!
//! - **Off until enabled.** A layer that is not [enabled](ExperimentLayerBuilder::enabled)
//!   ignores the header.
//! - **Refused from outside.** Enabled, it honours the header only from
//!   loopback clients unless told to [trust every client](ExperimentLayerBuilder::trust_any_client);
//!   from anyone else the request is refused with `403` (type
//!   `chaos_experiment_refused`), so a stranger cannot slow your service
//!   down by naming an experiment. A malformed name (other than 1 to 64 of
//!   `a-z 0-9 . _ -`) is a `400`.
//!
//! ```
//! use std::time::Duration;
//! use axum::{Router, routing::get};
//! use keel_http::experiment::ExperimentLayer;
//! use keel_policy::chaos::FaultInjection;
//!
//! let outage = FaultInjection::builder("shipping")
//!     .experiment("shipping-outage")
//!     .abort(100.0)
//!     .enabled(true)
//!     .build()
//!     .unwrap();
//! let app: Router = Router::new()
//!     .route("/estimates/{customer}", get(|| async { "3 days" }))
//!     .layer(
//!         ExperimentLayer::builder()
//!             .enabled(true)
//!             .fault("/estimates/{customer}", outage)
//!             .build(),
//!     );
//! ```

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::{ConnectInfo, MatchedPath};
use axum::http::{Request, Response, StatusCode};
use axum::response::IntoResponse;
use keel_core::{PolicyError, Rejected};
use keel_policy::chaos::{ChaosExperiment, EXPERIMENT_HEADER, FaultInjection};
use tower_layer::Layer;
use tower_service::Service;

use crate::problem::Problem;

/// Builds an [`ExperimentLayer`]: off, loopback clients only, no faults,
/// aborts answered `503`.
#[derive(Debug, Clone)]
#[must_use]
pub struct ExperimentLayerBuilder {
    enabled: bool,
    trust_any_client: bool,
    abort_status: StatusCode,
    faults: Vec<(String, FaultInjection)>,
}

impl ExperimentLayerBuilder {
    /// Honour the experiment header at all (default: no).
    pub fn enabled(mut self, enabled: bool) -> Self {
        self.enabled = enabled;
        self
    }

    /// Honour the header from any client, not only loopback ones. For a
    /// service reachable only from inside (behind a mesh, from test
    /// clients you run).
    pub fn trust_any_client(mut self) -> Self {
        self.trust_any_client = true;
        self
    }

    /// The status an injected abort answers (default `503`).
    pub fn abort_status(mut self, status: StatusCode) -> Self {
        self.abort_status = status;
        self
    }

    /// Injects `injection`'s faults into requests to `route` (the route
    /// template, `/estimates/{customer}`, or `*` for every route) that
    /// are in its experiment. Several faults may apply to one request;
    /// they run in the order given.
    pub fn fault(mut self, route: impl Into<String>, injection: FaultInjection) -> Self {
        self.faults.push((route.into(), injection));
        self
    }

    /// The layer.
    pub fn build(self) -> ExperimentLayer {
        ExperimentLayer {
            inner: Arc::new(self),
        }
    }
}

/// Runs requests that carry the experiment header as part of their
/// experiment; see the [module docs](self). Apply it with
/// [`Router::layer`](axum::Router::layer), after the routes.
#[derive(Debug, Clone)]
pub struct ExperimentLayer {
    inner: Arc<ExperimentLayerBuilder>,
}

impl ExperimentLayer {
    /// A builder (see [`ExperimentLayerBuilder`] for the defaults).
    pub fn builder() -> ExperimentLayerBuilder {
        ExperimentLayerBuilder {
            enabled: false,
            trust_any_client: false,
            abort_status: StatusCode::SERVICE_UNAVAILABLE,
            faults: Vec::new(),
        }
    }
}

impl<S> Layer<S> for ExperimentLayer {
    type Service = ExperimentService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ExperimentService {
            inner,
            config: Arc::clone(&self.inner),
        }
    }
}

/// The service [`ExperimentLayer`] makes.
#[derive(Debug, Clone)]
pub struct ExperimentService<S> {
    inner: S,
    config: Arc<ExperimentLayerBuilder>,
}

type BoxFuture<E> = Pin<Box<dyn Future<Output = Result<Response<Body>, E>> + Send>>;

impl<S> Service<Request<Body>> for ExperimentService<S>
where
    S: Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let experiment = match self.experiment_of(&request) {
            Ok(Some(name)) => name,
            Ok(None) => return Box::pin(self.inner.call(request)),
            Err(problem) => return Box::pin(async move { Ok(problem.into_response()) }),
        };
        // Take the service that was made ready; leave a fresh clone behind.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let config = Arc::clone(&self.config);
        let route = request
            .extensions()
            .get::<MatchedPath>()
            .map(|p| p.as_str().to_owned());
        Box::pin(ChaosExperiment::scope(experiment, async move {
            for (_, injection) in config
                .faults
                .iter()
                .filter(|(r, _)| r == "*" || route.as_deref() == Some(r.as_str()))
            {
                let injected = injection.call(|| async { Ok::<_, Rejected>(()) }).await;
                if let Err(PolicyError::Rejected(Rejected::InjectedFault { .. })) = injected {
                    let problem =
                        Problem::new(config.abort_status, "injected by a chaos experiment")
                            .typed("chaos_fault_injected");
                    return Ok(problem.into_response());
                }
            }
            inner.call(request).await
        }))
    }
}

impl<S> ExperimentService<S> {
    /// The request's experiment, if it names one and may.
    fn experiment_of(&self, request: &Request<Body>) -> Result<Option<String>, Problem> {
        let Some(value) = request.headers().get(EXPERIMENT_HEADER) else {
            return Ok(None);
        };
        if !self.config.enabled {
            return Ok(None);
        }
        // Behind a proxy on this machine every client is a loopback peer.
        let trusted = self.config.trust_any_client
            || (!crate::access::is_forwarded(request.headers())
                && request
                    .extensions()
                    .get::<ConnectInfo<SocketAddr>>()
                    .is_some_and(|ConnectInfo(peer)| peer.ip().is_loopback()));
        if !trusted {
            metrics::counter!("keel_http_chaos_refused_total").increment(1);
            return Err(Problem::new(
                StatusCode::FORBIDDEN,
                format!("{EXPERIMENT_HEADER} is not accepted from this client"),
            )
            .typed("chaos_experiment_refused"));
        }
        match value.to_str() {
            Ok(name) if is_experiment_name(name) => Ok(Some(name.to_owned())),
            _ => Err(Problem::bad_request(format!(
                "{EXPERIMENT_HEADER} must be 1 to 64 of a-z, 0-9, '.', '_' and '-'"
            ))),
        }
    }
}

fn is_experiment_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b"._-".contains(&b))
}
