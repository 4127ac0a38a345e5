//! The `keel` binary's library: the reference shop, `keel demo`, and
//! `keel serve`.
//!
//! The shop ([`shop`]) is a small system (orders, payments, inventory,
//! shipping, customers) that uses every Keel component where it belongs,
//! over real HTTP on loopback. [`demo`] drives a workload through it and
//! checks the invariants; [`serve`] runs it as a server.

#![cfg_attr(docsrs, feature(doc_cfg))]
pub mod api;
pub mod backend;
pub mod blobs;
#[cfg(feature = "chaos")]
pub mod chaos;
pub mod demo;
pub mod metrics_report;
pub mod serve;
pub mod shop;
