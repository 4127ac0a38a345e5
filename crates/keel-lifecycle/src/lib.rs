//! The life of a Keel process, apart from any web framework: when it is
//! ready for traffic, how it drains, and how many connections it lets one
//! client hold.
//!
//! Every server Keel runs answers the same questions the same way, so the
//! answers live here and the servers only translate them: keel-http's axum
//! edge serves `/livez`, `/readyz` and `/debug/deep` from a [`Health`] and
//! runs its listener through a [`Drain`]; keel-grpc's `grpc.health.v1`
//! answers from the same [`Health`] and ends its streams on the same
//! [`Drain::signal`]. Neither needs the other's framework, and this crate
//! depends on none (tokio, the contracts in `keel-store`, Keel's clock and
//! configuration errors).
//!
//! - [`drain`]: the shutdown in the order that loses no request —
//!   readiness fails first, load balancers get `lb_notice` to notice, the
//!   listener closes and long-lived streams are signalled, and whatever is
//!   still open after `drain_timeout` is aborted ([`DrainStream`]).
//! - [`health`]: readiness that checks only what the instance owns, each
//!   check within a time limit, and the deep report that pings every
//!   dependency (for dashboards, never for a probe).
//! - [`slots`] and [`ConnectionLimits`]: a cap on connections with a
//!   share per client address, and the time a request may take to arrive.
//!
//! ```
//! use std::time::Duration;
//! use keel_lifecycle::{Drain, Health, Phase};
//!
//! # #[tokio::main(flavor = "current_thread", start_paused = true)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let drain = Drain::builder().lb_notice(Duration::from_secs(10)).build()?;
//! let health = Health::builder().drain(&drain).build()?;
//! assert!(health.readiness().await.is_ok());
//! drain.trigger();
//! assert!(health.readiness().await.is_err(), "readiness fails first");
//! drain.wait_for(Phase::Closing).await;
//! assert!(*drain.signal().borrow(), "then streams are told to end");
//! # Ok(()) }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod drain;
pub mod health;
pub mod limits;
pub mod slots;
mod stream;

pub use drain::{
    DEFAULT_DRAIN_TIMEOUT, DEFAULT_LB_NOTICE, Drain, DrainBuilder, DrainReport, Phase,
};
pub use health::{
    DEFAULT_CHECK_TIMEOUT, DEFAULT_MAX_POOL_WAITERS, DEFAULT_POOL_EXHAUSTION_GRACE, DeepReport,
    DependencyStatus, Health, HealthBuilder, NotReady, PingStatus, PoolUsage,
};
pub use limits::{
    ConnectionLimits, DEFAULT_BODY_READ_TIMEOUT, DEFAULT_HEADER_READ_TIMEOUT, DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
};
pub use slots::{ConnectionSlot, ConnectionSlots};
pub use stream::{ConnectionCounts, DrainStream};
