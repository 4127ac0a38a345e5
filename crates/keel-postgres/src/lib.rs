//! Keel on PostgreSQL: the messaging Store for systems that outgrow one
//! machine.
//!
//! - [`PgStore`]: every storage trait of [`keel_store`] (outbox,
//!   inbox, dead letters, sagas, fencing tokens, idempotency keys, jobs, the
//!   event log, webhook tables) on one `sqlx::PgPool`, in a schema of its
//!   own, with embedded migrations. Several processes share it safely:
//!   relays claim outbox rows with `FOR UPDATE SKIP LOCKED` under leases,
//!   keep per-key order across replicas, and never skip a row whose lower
//!   id committed late.
//! - [`PgWakeups`]: `LISTEN/NOTIFY`, so a commit in one process wakes the
//!   relay, webhook worker or event-log readers of every other at once;
//!   polling remains the fallback.
//! - [`WalOutbox`] (feature `wal-relay`): the relay's claims from a logical
//!   replication slot instead of the table, in commit order as each
//!   transaction commits.
//!
//! Failures are classified for callers: serialization failures and
//! deadlocks are retryable (and retried inside the store's own work), a
//! connection lost during `COMMIT` is an unknown outcome, which the store
//! resolves for its own transactions by asking the server.

#![cfg_attr(docsrs, feature(doc_cfg))]
mod event_log;
pub mod store;
pub mod wakeups;
#[cfg(feature = "wal-relay")]
pub mod wal;
mod webhooks;

pub use store::{Channels, InvalidSchema, PgStore, PgStoreOptions, TxOutcome};
pub use wakeups::{EventLogWake, PgWakeups, PgWakeupsBuilder};
#[cfg(feature = "wal-relay")]
pub use wal::{WalOutbox, WalRelayOptions};
