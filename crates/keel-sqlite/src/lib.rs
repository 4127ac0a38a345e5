//! Keel on SQLite: durable messaging with no server to run.
//!
//! - [`store`]: the messaging [`Store`](keel_store::Store) (outbox, inbox,
//!   dead letters, sagas, fencing tokens) on SQLite in WAL mode, with embedded
//!   migrations.
//! - [`broker`]: an embedded durable [`Broker`](keel_store::Broker) on
//!   SQLite: topics, consumer groups, per-key order, leases, redelivery.

#![cfg_attr(docsrs, feature(doc_cfg))]
#[cfg(feature = "broker")]
pub mod broker;
#[cfg(any(feature = "store", feature = "broker"))]
mod pool;
#[cfg(any(feature = "store", feature = "broker"))]
mod private_file;
#[cfg(feature = "broker")]
pub use broker::{SqliteBroker, SqliteBrokerOptions};
#[cfg(feature = "store")]
pub mod store;
#[cfg(feature = "store")]
pub use store::{SqliteStore, SqliteStoreOptions};
#[cfg(feature = "event-log")]
mod event_log;
#[cfg(feature = "webhooks")]
mod webhooks;
