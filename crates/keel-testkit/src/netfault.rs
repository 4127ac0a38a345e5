//! Network faults between a process and its servers, on a seeded schedule.
//!
//! Restarting or crashing PostgreSQL and nats-server tests what a *server*
//! does. The network between does other things, and each breaks a
//! different assumption:
//!
//! - it delays every byte (timeouts tuned for loopback fire);
//! - it resets a connection in the middle of a reply (was the commit
//!   applied? the client cannot know);
//! - it drops packets and says nothing, a black hole: no error, no
//!   refusal, only a timeout notices;
//! - it closes slowly (a pool hands out a connection that is going away);
//! - it cuts one process off while the other goes on: the live holder of
//!   a lease is silent long enough for its lease to be taken, and fencing
//!   is all that stands between two writers.
//!
//! [`FaultProxy`] is a TCP proxy that one process dials instead of the
//! server, and that does any of these on demand. [`Network`] holds one
//! proxy per (process, service) link. [`Schedule`] is a list of fault
//! episodes drawn from a seed, so a failing run names the seed that
//! replays its schedule.
//!
//! ```no_run
//! # async fn demo() -> std::io::Result<()> {
//! use std::time::Duration;
//! use keel_testkit::netfault::{Network, Schedule};
//!
//! let mut network = Network::default();
//! let pg = network.link("a", "postgres", "127.0.0.1:5432".parse().unwrap()).await?;
//! // start process "a" against `pg` instead of port 5432...
//! # let _ = pg;
//! let schedule = Schedule::draw(7, &["a"], &["postgres"], Duration::from_secs(10));
//! network.play(&schedule).await;
//! network.heal();
//! # Ok(())
//! # }
//! ```

mod network;
mod proxy;
mod schedule;

pub use network::Network;
pub use proxy::{Condition, FaultProxy, ProxyStats};
pub use schedule::{Episode, Fault, Schedule, Scope};
