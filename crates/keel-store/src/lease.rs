//! Leases: a named, expiring claim with a fencing token.

use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};

#[cfg(doc)]
use super::Store;
use super::StoreError;

/// A lease as granted: its token and when the store considers it over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseGrant {
    /// Greater than every token an earlier holder of the lease got; the
    /// same while one holder keeps extending it.
    pub token: u64,
    /// When the lease ends unless extended.
    pub expires_at: DateTime<Utc>,
}

/// The lease table: per name, the holder, its token and the lease's end.
///
/// Not a [`Store`] bound: a lease is taken and given back on its own, never
/// inside the caller's transaction, so a coordination server with no
/// transactions (Redis, etcd) is a lease store too. What a database adds
/// is durability: its tokens survive any restart, where a server that
/// restarts empty keeps them growing only by the means its backend states.
#[async_trait]
pub trait LeaseStore: Clone + Send + Sync + 'static {
    /// Takes the lease `name` for `holder` until `ttl` from now if it is
    /// free or expired (a new token, above every earlier one), or extends
    /// it if `holder` holds it (the same token). `None` if another holder's
    /// lease is still running.
    async fn lease_acquire(
        &self,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<LeaseGrant>, StoreError>;

    /// Ends the lease now if `holder` still holds it under `token`; the
    /// token sequence is kept, so the next holder's token is higher still.
    async fn lease_release(&self, name: &str, holder: &str, token: u64)
    -> Result<bool, StoreError>;
}
