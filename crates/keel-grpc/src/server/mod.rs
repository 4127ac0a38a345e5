//! The server half: the call's deadline from `grpc-timeout`, the caller's
//! trace from `traceparent`, streams ended cleanly on shutdown, a bearer
//! credential ([`RequireBearer`]), and connections bounded in number, per
//! address and in time ([`BoundedIncoming`]).
//!
//! Add the layers to a tonic server, deadline outermost:
//!
//! ```no_run
//! use std::time::Duration;
//! use keel_grpc::server::{DeadlineLayer, TraceContextLayer};
//! use keel_lifecycle::Drain;
//!
//! # async fn run(drain: Drain) -> Result<(), Box<dyn std::error::Error>> {
//! let (_reporter, health) = tonic_health::server::health_reporter();
//! tonic::transport::Server::builder()
//!     .layer(DeadlineLayer::with_max(Duration::from_secs(10))?.drain(&drain))
//!     .layer(TraceContextLayer::new())
//!     .add_service(health)
//!     .serve_with_shutdown("127.0.0.1:50051".parse()?, drain.closing())
//!     .await?;
//! # Ok(()) }
//! ```
//!
//! A handler that knows its least useful duration refuses to start
//! without it; here, a `GetShipment` that needs 50 ms:
//!
//! ```
//! use std::time::Duration;
//!
//! async fn get_shipment() -> Result<&'static str, tonic::Status> {
//!     keel_grpc::server::require_remaining(Duration::from_millis(50))?;
//!     Ok("S-1")
//! }
//! ```

mod bearer;
mod deadline;
mod incoming;
mod trace;

use std::time::Duration;

pub use bearer::RequireBearer;
pub use deadline::{DEFAULT_MAX_DEADLINE, DeadlineLayer, DeadlineService};
pub use incoming::{BoundedConnection, BoundedIncoming};
use keel_core::Deadline;
use tonic::Status;
pub use trace::{TraceContextLayer, TraceContextService};

/// The time left to the call's deadline, or `DEADLINE_EXCEEDED` if no
/// more than `min` is left: work that cannot finish in time is not worth
/// starting. With no deadline set (no [`DeadlineLayer`]) there is no
/// limit, and this answers `Duration::MAX`.
pub fn require_remaining(min: Duration) -> Result<Duration, Status> {
    let Some(deadline) = Deadline::current() else {
        return Ok(Duration::MAX);
    };
    deadline.check_start(min).map_err(|_| {
        metrics::counter!("keel_grpc_server_calls_total", "outcome" => "too_late_to_start")
            .increment(1);
        Status::deadline_exceeded(format!(
            "{:?} left before the call's deadline, less than the {min:?} this call needs: \
             not started; call again with a later deadline",
            deadline.remaining()
        ))
    })
}
