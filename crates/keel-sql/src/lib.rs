//! Keel's storage logic, written once for every SQL database.
//!
//! The outbox, inbox, dead letters, sagas, fences, idempotency keys, jobs,
//! the event log and the webhook tables mean the same thing on SQLite and on
//! PostgreSQL: the same rows, the same status transitions, the same filters
//! and the same rules. What differs is small and lives in each backend crate
//! as its [`Dialect`]: how a value is bound and read back (an instant is
//! Unix milliseconds on SQLite and `TIMESTAMPTZ` on PostgreSQL, a document
//! is `TEXT` or `JSONB`), how an error is classified, which errors the store
//! may retry by itself, and the few places where the SQL text really
//! differs, each a clause (an index hint, `SKIP LOCKED`, a `NOTIFY`). Each
//! backend crate keeps its own concurrency (SQLite's single writer and
//! `BEGIN IMMEDIATE`; PostgreSQL's advisory-lock claims and commit-outcome
//! resolution) and its wake-ups.
//!
//! # Why not `sqlx::Any`
//!
//! The outbox and the inbox rest on one promise: Keel's row commits in the
//! *user's* transaction, and that transaction lends the backend's own
//! connection (`sqlx::Transaction<'static, Postgres>`, SQLite's
//! group-committed `WriteTx`), so the user's business SQL runs in it
//! unchanged. `Any` would hand out a different connection type and lose each
//! database's types. So the core is generic over [`SqlBackend`], whose
//! transaction derefs to the backend's own connection, and talks to
//! the database only through a handful of [`Value`] kinds and the
//! [`SqlRow`] getters a dialect implements.
//!
//! # Shape
//!
//! One module per table: its SQL, its row codec and one generic function per
//! operation of the matching `keel_store` trait. A backend crate
//! implements [`SqlBackend`] for its store and says which contracts it takes
//! from the core with the matching macro ([`dead_letter_store!`],
//! [`saga_store!`], [`inbox_store!`], [`fence_store!`],
//! [`entity_version_store!`], [`lease_store!`], [`job_store!`],
//! [`event_log_store!`], [`idempotency_store!`], [`outbox_store!`],
//! [`webhook_store!`]), each of which writes the trait's forwarding impl
//! and nothing else. Where a table needs what only the backend can do (the
//! outbox's append and claim, the webhook claim, the event-log append), the
//! module says so with a trait of its own ([`outbox::OutboxBackend`],
//! [`webhooks::WebhookBackend`], [`event_log::EventLogBackend`]).

#![cfg_attr(docsrs, feature(doc_cfg))]
pub mod backend;
pub mod dead_letter;
pub mod dialect;
pub mod entity_version;
pub mod error;
pub mod event_log;
pub mod fence;
pub mod filter;
pub mod idempotency;
pub mod inbox;
pub mod jobs;
pub mod lease;
pub mod outbox;
pub mod retry;
pub mod saga;
pub mod schema;
pub mod webhooks;

pub use backend::SqlBackend;
pub use dialect::{Dialect, Exec, Field, SqlRow, Value};

/// What the macros need to name from the calling crate.
#[doc(hidden)]
pub mod __private {
    pub use async_trait::async_trait;
    pub use chrono::{DateTime, Utc};
    pub use keel_store as store;
    pub use keel_store::StoreError;
    pub use serde_json;
}
