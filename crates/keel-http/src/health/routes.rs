//! [`HealthRoutes`]: `/livez`, `/readyz` and `/debug/deep` from a [`Health`].

use axum::extract::State;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get};
use axum::{Json, Router};
use keel_lifecycle::Health;

use crate::problem::Problem;

/// The health endpoints of a [`Health`]; see the [module docs](super).
///
/// ```
/// use axum::{body::Body, http::{Request, StatusCode}};
/// use keel_http::health::{Drain, Health, HealthRoutes};
/// use tower::ServiceExt;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let drain = Drain::builder().lb_notice(std::time::Duration::ZERO).build().unwrap();
/// let health = Health::builder().drain(&drain).build().unwrap();
/// let app = health.router();
/// let readyz = || Request::get("/readyz").body(Body::empty()).unwrap();
/// assert_eq!(app.clone().oneshot(readyz()).await.unwrap().status(), StatusCode::OK);
/// drain.trigger();
/// assert_eq!(app.oneshot(readyz()).await.unwrap().status(), StatusCode::SERVICE_UNAVAILABLE);
/// # }
/// ```
pub trait HealthRoutes {
    /// The routes `/livez`, `/readyz` and `/debug/deep`, to merge into the
    /// service's router (outside shedding and authentication).
    ///
    /// Point the liveness probe at `/livez` and the readiness (and startup)
    /// probes at `/readyz`. **Never point a probe at `/debug/deep`**: it
    /// pings dependencies, and a dependency blip must never restart or
    /// eject the fleet.
    fn router(&self) -> Router;

    /// `/livez` and `/readyz` only: what load balancers and orchestrators
    /// must reach without credentials.
    fn probes_router(&self) -> Router;

    /// `/debug/deep` only: it names every dependency and its latency, so
    /// it belongs behind the same authentication as metrics.
    fn deep_router(&self) -> Router;

    /// The `/debug/deep` handler alone, to mount at a path of your own or
    /// behind a layer of its own (`route_layer` on it leaves other methods
    /// their `405`).
    fn deep_route<S: Clone + Send + Sync + 'static>(&self) -> MethodRouter<S>;
}

impl HealthRoutes for Health {
    fn router(&self) -> Router {
        self.probes_router().merge(self.deep_router())
    }

    fn probes_router(&self) -> Router {
        Router::new()
            .route("/livez", get(livez))
            .route("/readyz", get(readyz))
            .with_state(self.clone())
    }

    fn deep_router(&self) -> Router {
        Router::new().route("/debug/deep", self.deep_route())
    }

    fn deep_route<S: Clone + Send + Sync + 'static>(&self) -> MethodRouter<S> {
        get(deep).with_state(self.clone())
    }
}

fn no_store(mut response: Response) -> Response {
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    response
}

/// Deliberately trivial: if this runs, the process is alive. NEVER touch a
/// dependency here.
async fn livez() -> Response {
    no_store(Json(serde_json::json!({ "ok": true })).into_response())
}

async fn readyz(State(health): State<Health>) -> Response {
    no_store(match health.readiness().await {
        Ok(()) => Json(serde_json::json!({ "ok": true })).into_response(),
        Err(not_ready) => {
            tracing::debug!(reason = %not_ready, "readiness check failed: 503");
            Problem::new(StatusCode::SERVICE_UNAVAILABLE, not_ready.to_string())
                .typed("not_ready")
                .into_response()
        }
    })
}

/// For humans and dashboards; NOT wired to any probe.
async fn deep(State(health): State<Health>) -> Response {
    no_store(Json(health.deep().await).into_response())
}
