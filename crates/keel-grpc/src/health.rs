//! `grpc.health.v1` answering from Keel's readiness and drain, so that a
//! gRPC load balancer or `grpc_health_probe` sees what `/readyz` says.
//!
//! ```
//! use keel_grpc::health::GrpcHealth;
//! use keel_lifecycle::{Drain, Health};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let drain = Drain::new();
//! let health = Health::builder().drain(&drain).build()?;
//! let (service, _task) = GrpcHealth::new(&health).service("shipping.v1.Shipping").start().await;
//! // tonic::transport::Server::builder().add_service(service)...
//! # let _ = service;
//! # Ok(()) }
//! ```

use std::time::Duration;

use keel_lifecycle::{Health, Phase};
use tokio::task::JoinHandle;
use tonic_health::ServingStatus;
use tonic_health::pb::health_server::{Health as HealthApi, HealthServer};
use tonic_health::server::{HealthReporter, health_reporter};

/// How often readiness is checked by default: 5 s, a readiness probe's
/// usual period. A drain is seen at once, not at the next check.
pub const DEFAULT_CHECK_EVERY: Duration = Duration::from_secs(5);

/// Builds the standard health service over a Keel [`Health`]: the server
/// (`""`) and each named service are `SERVING` while readiness passes and
/// `NOT_SERVING` while it fails, and from the moment the drain starts.
#[derive(Debug, Clone)]
#[must_use]
pub struct GrpcHealth {
    health: Health,
    services: Vec<String>,
    every: Duration,
}

impl GrpcHealth {
    /// Answers from `health` (and its drain, if it has one).
    pub fn new(health: &Health) -> Self {
        Self {
            health: health.clone(),
            services: Vec::new(),
            every: DEFAULT_CHECK_EVERY,
        }
    }

    /// Also reports `name` (`package.Service`), for clients that ask
    /// about one service.
    pub fn service(mut self, name: impl Into<String>) -> Self {
        self.services.push(name.into());
        self
    }

    /// Checks readiness this often (default [`DEFAULT_CHECK_EVERY`]).
    pub fn check_every(mut self, every: Duration) -> Self {
        self.every = every;
        self
    }

    /// Checks readiness once, so the service never answers before it
    /// knows, and starts the task that keeps the answer current. The task
    /// ends once the drain has started (the answer stays `NOT_SERVING`).
    pub async fn start(self) -> (HealthServer<impl HealthApi>, JoinHandle<()>) {
        let (reporter, server) = health_reporter();
        let draining = self.report(&reporter).await;
        let task = tokio::spawn(async move {
            if draining {
                return;
            }
            loop {
                let drain_started = async {
                    match self.health.drain() {
                        Some(drain) => drain.wait_for(Phase::Draining).await,
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = tokio::time::sleep(self.every) => {}
                    () = drain_started => {}
                }
                if self.report(&reporter).await {
                    return;
                }
            }
        });
        (server, task)
    }

    /// Sets every status from readiness now; whether the drain has started.
    async fn report(&self, reporter: &HealthReporter) -> bool {
        let status = match self.health.readiness().await {
            Ok(()) => ServingStatus::Serving,
            Err(not_ready) => {
                tracing::debug!(%not_ready, "gRPC health: NOT_SERVING");
                ServingStatus::NotServing
            }
        };
        for name in std::iter::once("").chain(self.services.iter().map(String::as_str)) {
            reporter.set_service_status(name, status).await;
        }
        self.health.drain().is_some_and(|d| d.is_draining())
    }
}
