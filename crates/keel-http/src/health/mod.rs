//! Health checks that tell an orchestrator the truth without taking the
//! fleet down with a dependency, and a graceful drain that lets every
//! request, stream and socket finish before the process exits.
//!
//! # Three endpoints, three questions
//!
//! - **`/livez`: is the process alive?** Deliberately trivial: if the
//!   handler runs, the runtime is alive, and it answers `200 {"ok": true}`.
//!   It **never touches a dependency**: a liveness probe that checks the
//!   database restarts every instance of the fleet when the database blips,
//!   turning a degraded service into a dead one.
//! - **`/readyz`: should this instance get traffic?** It checks only what
//!   *we* own and what makes us useless if broken: migrations applied at
//!   start ([`HealthBuilder::store`], via
//!   [`Store::ready`](keel_store::Store::ready) until it first passes),
//!   not draining ([`HealthBuilder::drain`]), the connection pool not
//!   saturated ([`HealthBuilder::pool_saturation`],
//!   [`HealthBuilder::pool_exhaustion`]), and any
//!   [`ready_check`](HealthBuilder::ready_check) you add. It **never reads
//!   the shared database** on a probe: every instance shares it, so a
//!   database blip would make them all unready at once. Each check has a
//!   time limit (default 1 s): a probe with no timeout is not a probe. Not
//!   ready is a `503` problem naming the reason (`draining`, `store: ...`).
//! - **`/debug/deep`: how are our dependencies?** Pings each registered
//!   [`dependency`](HealthBuilder::dependency) concurrently, each within its
//!   own timeout, and reports per-dependency status and latency as JSON, for
//!   humans and dashboards. **Never wire it to a probe**: a dependency blip
//!   must never restart or eject the fleet. It always answers `200`; the
//!   report's `ok` says whether everything answered.
//!
//! ```yaml
//! livenessProbe:  { httpGet: { path: /livez,  port: 8080 }, timeoutSeconds: 2, failureThreshold: 3 }
//! readinessProbe: { httpGet: { path: /readyz, port: 8080 }, timeoutSeconds: 2, periodSeconds: 5, failureThreshold: 2 }
//! # /debug/deep: dashboards only, never a probe.
//! terminationGracePeriodSeconds: 45   # > lb_notice + drain_timeout (10 s + 30 s by default)
//! ```
//!
//! Mount the health routes *outside* load shedding and authentication
//! (merge them after applying those layers): a probe must not be shed or
//! queued behind real traffic.
//!
//! # Graceful shutdown
//!
//! On SIGTERM (or ctrl-c, or [`Drain::trigger`]) a [`Drain`] runs the
//! shutdown in the order that loses no request:
//!
//! 1. **readiness fails first** (`/readyz` answers `503 draining`) while the
//!    server keeps serving everything;
//! 2. it waits [`lb_notice`](DrainBuilder::lb_notice) (default 10 s) for
//!    load balancers to notice and stop sending traffic;
//! 3. it **stops accepting** connections, lets in-flight requests finish,
//!    and fires [`Drain::signal`], which SSE, WebSocket and long-poll
//!    handlers must watch to end their streams: axum's graceful shutdown
//!    waits for them, it does not close them;
//! 4. after [`drain_timeout`](DrainBuilder::drain_timeout) (default 30 s)
//!    whatever is still open is aborted, so the process exits before the
//!    orchestrator's SIGKILL.
//!
//! [`DrainServe::serve`] runs an axum server through all of this.
//!
//! The drain, readiness and the connection limits are keel-lifecycle's,
//! re-exported here; this module adds what is axum's: the routes
//! ([`HealthRoutes`]) and the server ([`DrainServe`]). keel-grpc answers
//! from the same [`Health`] and [`Drain`] without building this edge.
//!
//! ```no_run
//! use std::time::Duration;
//! use axum::{Router, routing::get};
//! use keel_http::health::{Drain, DrainServe, Health, HealthRoutes};
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let drain = Drain::builder().lb_notice(Duration::from_secs(10)).build()?;
//! drain.trigger_on_signal()?;
//! let health = Health::builder().drain(&drain).build()?;
//! let app = Router::new()
//!     .route("/orders", get(|| async { "ok" }))
//!     .merge(health.router());
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! let report = drain.serve(listener, app).await?;
//! assert!(!report.forced, "every connection finished in time");
//! # Ok(()) }
//! ```

mod listener;
mod routes;
mod serve;
mod server;

pub use keel_lifecycle::{
    ConnectionCounts, ConnectionLimits, ConnectionSlot, ConnectionSlots, DEFAULT_BODY_READ_TIMEOUT,
    DEFAULT_CHECK_TIMEOUT, DEFAULT_DRAIN_TIMEOUT, DEFAULT_HEADER_READ_TIMEOUT,
    DEFAULT_IDLE_TIMEOUT, DEFAULT_LB_NOTICE, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_CONNECTIONS_PER_ADDRESS, DEFAULT_MAX_POOL_WAITERS, DEFAULT_POOL_EXHAUSTION_GRACE,
    DeepReport, DependencyStatus, Drain, DrainBuilder, DrainReport, DrainStream, Health,
    HealthBuilder, NotReady, Phase, PingStatus, PoolUsage,
};
pub use listener::DrainListener;
pub use routes::HealthRoutes;
pub use serve::DrainServe;
