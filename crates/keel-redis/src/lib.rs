//! Keel's leases and shared dedupe record on Redis: [`RedisDedup`] keeps
//! which messages were processed for consumers whose effect has no
//! transaction (`keel_store::SharedDedupStore`, the inbox's weaker
//! sibling), and [`RedisLeases`] implements
//! [`LeaseStore`](keel_store::LeaseStore), so
//! `keel_messaging::lease::{LeaseLock, LeaderElection}` run on a Redis that
//! a service already has instead of on its database.
//!
//! # A lease, not a lock
//!
//! A Redis lease is granted with `SET key value NX PX ttl`, renewed and
//! released only by a script that first checks the holder, and ends by
//! itself when its time runs out. That is fine for work that may, rarely,
//! happen twice (*probably once*): a paused process, a clock that jumps or a
//! Redis that restarts without persistence can leave two processes each
//! believing it holds the lease for a while. Work that must not be done by
//! two holders at once checks the lease's **fencing token** where the
//! effect lands (`keel_messaging::fence`): every new holder gets a higher
//! token, so the store refuses the write of a holder whose lease was
//! taken over.
//!
//! # When Redis restarts empty
//!
//! Without persistence (no RDB, no AOF) a restart forgets every lease and
//! every token counter. The lease itself is then free at once, which a
//! lease may be. The tokens do not go back: a counter that no longer exists
//! is started again from the server's clock in microseconds, above every
//! token handed out before (unless the server's clock went backwards, or
//! more than a million leases per second were granted for one name). This
//! crate's tests restart Redis with `SIGKILL` and check exactly that.
//! With `appendonly yes` and `appendfsync always`, nothing is forgotten.
//!
//! ```no_run
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use keel_redis::RedisLeases;
//! use keel_store::LeaseStore;
//!
//! let leases = RedisLeases::builder("redis://127.0.0.1:6379").build()?;
//! if let Some(grant) = leases.lease_acquire("nightly-report", "pod-a", Duration::from_secs(10)).await? {
//!     // Write the report, fenced by `grant.token`.
//!     leases.lease_release("nightly-report", "pod-a", grant.token).await?;
//! }
//! # Ok(()) }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]

mod connection;
mod dedup;
mod error;
mod lease;

pub use connection::{DEFAULT_KEY_PREFIX, DEFAULT_TIMEOUT};
pub use dedup::RedisDedup;
pub use error::RedisConfigError;
pub use lease::{RedisLeases, RedisLeasesBuilder};
