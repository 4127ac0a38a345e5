//! Conformance suites and fault-injection helpers for Keel backends.
//!
//! A backend is correct when it passes the suite here: the same tests run
//! against the embedded SQLite backends and the PostgreSQL and NATS ones, so
//! "works on SQLite" and "works on PostgreSQL" mean the same thing.
//!
//! [`ledger`] re-exports `keel-ledger`, the invariant checker that crash
//! tests (and `keel chaos`, which is why it is a crate of its own that a
//! binary may ship) feed with what was committed, published and applied:
//! nothing lost, nothing applied twice, no aborted event published, per-key
//! order kept, every saga completed or fully compensated.
//!
//! [`services`] hands tests the PostgreSQL and NATS servers that
//! `scripts/services.sh` runs, and fails loudly in CI when they are missing;
//! [`browser`] starts chromedriver for the console's browser tests.
//!
//! [`netfault`] (feature `netfault`) puts a fault proxy between a process and
//! its servers and plays a seeded schedule of latency, resets, black holes,
//! slow closes and partitions on it.
//!
//! [`faultfs`] (feature `faultfs`) makes a process's data directory as
//! fragile as a disk: a power loss drops what was not fsynced, the disk
//! fills, the process dies inside an fsync.
//!
//! [`seeds`] says which seeds a seeded fault test runs.
//!
//! [`bench`](mod@bench) (feature `bench`) is what the backends' messaging benchmarks
//! share. [`eventually`] waits for what another task does; [`metrics`] (feature
//! `metrics`) records what the code under test emits, for assertions.

#![cfg_attr(docsrs, feature(doc_cfg))]

#[cfg(feature = "bench")]
pub mod bench;
#[cfg(feature = "broker-suite")]
pub mod broker_suite;
#[cfg(feature = "browser")]
pub mod browser;
#[cfg(feature = "store-suite")]
pub mod election_suite;
#[cfg(feature = "store-suite")]
pub mod event_log_suite;
mod eventually;
#[cfg(feature = "faultfs")]
pub mod faultfs;
#[cfg(feature = "store-suite")]
pub mod idempotency_suite;
#[cfg(feature = "store-suite")]
pub mod jobs_suite;
#[cfg(feature = "store-suite")]
pub mod shared_dedup_suite;
pub use keel_ledger as ledger;
#[cfg(feature = "metrics")]
pub mod metrics;
#[cfg(feature = "netfault")]
pub mod netfault;
pub mod seeds;
pub mod services;
#[cfg(feature = "store-suite")]
pub mod store_suite;
#[cfg(feature = "tls")]
pub mod tls;
#[cfg(feature = "store-suite")]
pub mod webhook_suite;

pub use eventually::{POLL_INTERVAL, eventually};
