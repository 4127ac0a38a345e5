//! Leader election on etcd, with fencing tokens for free. [`EtcdElection`]
//! implements `keel_store::Election`, the contract that keel-messaging's
//! election on leases implements too, and passes the same conformance
//! suite.
//!
//! [`EtcdElection::campaign`] uses etcd's election API on a lease of its
//! own, kept alive in the background: it returns once this process leads,
//! as a [`Leadership`] whose [`token`](Leadership::token) is the create
//! revision of its leader key. Revisions only grow across the whole
//! cluster, so every later leader has a higher token, and a resource that
//! keeps the newest token it saw (`keel_messaging::fence`) refuses a
//! deposed leader's writes.
//!
//! # Leadership ends by the leader's own clock, first
//!
//! etcd expires a lease `ttl` after the last keep-alive *it received*; a
//! leader cut off from etcd (a partition, a paused process) cannot know
//! when that was. So a [`Leadership`] is valid until `ttl` after the last
//! keep-alive it *sent* and saw answered: earlier than etcd's expiry, never
//! later. [`Leadership::is_leader`] turns false and [`Leadership::lost`]
//! resolves at that moment, before etcd could let another campaign win,
//! and work that checks either between steps stops in time; the fencing
//! token covers the write already on its way.
//!
//! ```no_run
//! # async fn demo() -> Result<(), keel_etcd::EtcdError> {
//! use keel_etcd::EtcdElection;
//!
//! let election = EtcdElection::builder(["http://127.0.0.1:2379"], "nightly-report")
//!     .build()
//!     .await?;
//! let leadership = election.campaign("pod-a").await?;
//! while leadership.is_leader() {
//!     // One step of the work, fenced by `leadership.token()`.
//! #   break;
//! }
//! leadership.resign().await?;
//! # Ok(()) }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

mod contract;
mod election;
mod keep_alive;

pub use election::{
    DEFAULT_REQUEST_TIMEOUT, DEFAULT_TTL, EtcdElection, EtcdElectionBuilder, EtcdError, Leadership,
};
