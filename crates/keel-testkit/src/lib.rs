//! Conformance suites and fault-injection helpers for Keel backends.
//!
//! A backend is correct when it passes the suite here: the same tests run
//! against the embedded SQLite backends and the PostgreSQL and NATS ones, so
//! "works on SQLite" and "works on PostgreSQL" mean the same thing.

#[cfg(feature = "broker-suite")]
pub mod broker_suite;
#[cfg(feature = "store-suite")]
pub mod event_log_suite;
#[cfg(feature = "store-suite")]
pub mod idempotency_suite;
#[cfg(feature = "store-suite")]
pub mod jobs_suite;
pub mod ledger;
#[cfg(feature = "store-suite")]
pub mod store_suite;
#[cfg(feature = "store-suite")]
pub mod webhook_suite;
