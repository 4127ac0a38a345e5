//! Durable messaging that survives crashes, redelivery and duplicates.
//!
//! The network delivers messages at least once, in an order you did not
//! choose, sometimes long after anyone cared. This crate turns that into
//! effects that happen exactly once, in per-entity order, or land in a
//! dead-letter store with their story:
//!
//! - [`envelope`], [`store`] and [`broker`]: the CloudEvents envelope and
//!   the contracts a database and a broker fulfil, re-exported from
//!   `keel-store`, the API crate backends depend on (`keel-sqlite` is the
//!   embedded default; `keel-postgres` and `keel-nats` scale out).
//! - [`outbox`]: write the event in the business transaction; the
//!   [`relay`](outbox::OutboxRelay) publishes it afterwards.
//! - [`consumer`]: the consumer runtime: inbox dedupe in the effect's
//!   transaction, ack last, lease extension, retries with backoff,
//!   dead-lettering after N deliveries.
//! - [`dead_letter`]: list, inspect, replay and discard what failed.
//! - [`saga`]: orchestrated sagas with a pivot, derived idempotency keys and
//!   resumable compensation.
//! - [`reply`]: request-reply over the broker.
//! - [`fence`]: fencing tokens checked by the resource.
//! - [`dedup`]: a bounded dedupe window for consumers without a transaction.
//! - [`lease`]: leases with fencing tokens on the database, and leader
//!   election.
//! - [`version_guard`]: drop an event older than its entity's applied
//!   version, where per-key order cannot be relied on.

#![cfg_attr(docsrs, feature(doc_cfg))]

// The saga fixture is shared with the integration tests, which name this
// crate by its name.
#[cfg(test)]
extern crate self as keel_messaging;

pub use keel_store::{broker, dedup, envelope};
/// The storage contracts (`keel-store`), under the path users know.
pub mod store {
    pub use keel_store::*;
}

pub use broker::{Broker, Delivery, Message, SubscribeOptions, Subscription};
pub use consumer::{Consumer, Group, HandlerError};
pub use dead_letter::DeadLetters;
pub use dedup::DedupWindow;
pub use envelope::{Envelope, Event, EventMeta};
pub use outbox::{Outbox, OutboxRelay};
pub use store::{MessagingStore, Store, StoreError};

pub mod consumer;
pub mod dead_letter;
pub mod outbox;
pub mod version_guard;

#[cfg(feature = "claim-check")]
pub mod claim_check;
#[cfg(feature = "fence")]
pub mod election;
#[cfg(feature = "fence")]
pub mod fence;
#[cfg(feature = "fence")]
pub mod lease;
#[cfg(feature = "reply")]
pub mod reply;
#[cfg(feature = "saga")]
pub mod saga;
