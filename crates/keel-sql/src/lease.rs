//! Leases.
//!
//! One conditional upsert takes or extends a lease: the row is created
//! with token 1, or taken over (token + 1) when its lease has run out, or
//! extended (same token) by its own holder; a running lease of another
//! holder matches no branch and nothing comes back. Releasing expires the
//! row instead of deleting it, so tokens never start over. Expiry is
//! judged by the caller's clock: skew between processes shortens or
//! lengthens a lease, which is why a lease carries a fencing token.

use std::time::Duration;

use keel_store::LeaseGrant;
use keel_store::StoreError;

use crate::backend::SqlBackend;
use crate::dialect::{Dialect, SqlRow};
use crate::error::to_u64;
use crate::retry::{retry, write};

const ACQUIRE_SQL: &str = "\
INSERT INTO keel_leases (name, holder, token, expires_at) VALUES ($1, $2, 1, $3)
ON CONFLICT (name) DO UPDATE SET
       token = CASE WHEN keel_leases.holder = excluded.holder AND keel_leases.expires_at > $4
                    THEN keel_leases.token ELSE keel_leases.token + 1 END,
       holder = excluded.holder,
       expires_at = excluded.expires_at
 WHERE keel_leases.holder = excluded.holder OR keel_leases.expires_at <= $4
RETURNING token, expires_at";

const RELEASE_SQL: &str = "\
UPDATE keel_leases SET expires_at = $4 WHERE name = $1 AND holder = $2 AND token = $3";

/// [`LeaseStore::lease_acquire`](keel_store::LeaseStore::lease_acquire).
pub async fn acquire<B: SqlBackend>(
    store: &B,
    name: &str,
    holder: &str,
    ttl: Duration,
) -> Result<Option<LeaseGrant>, StoreError> {
    let now = B::Dialect::now();
    let ttl = chrono::Duration::from_std(ttl)
        .map_err(|_| StoreError::other(format!("a lease of {ttl:?} is too long")))?;
    let params = [name.into(), holder.into(), (now + ttl).into(), now.into()];
    let row = retry::<B::Dialect, _, _, _>("lease_acquire", || {
        store.write_optional(ACQUIRE_SQL, &params)
    })
    .await?;
    row.map(|row| {
        Ok(LeaseGrant {
            token: to_u64("lease token", row.int("token")?)?,
            expires_at: row.time("expires_at")?,
        })
    })
    .transpose()
}

/// [`LeaseStore::lease_release`](keel_store::LeaseStore::lease_release).
pub async fn release<B: SqlBackend>(
    store: &B,
    name: &str,
    holder: &str,
    token: u64,
) -> Result<bool, StoreError> {
    let token = i64::try_from(token)
        .map_err(|_| StoreError::other(format!("lease token {token} is over i64::MAX")))?;
    let params = [
        name.into(),
        holder.into(),
        token.into(),
        B::Dialect::now().into(),
    ];
    Ok(write(store, "lease_release", RELEASE_SQL, &params).await? == 1)
}

/// Implements [`LeaseStore`](keel_store::LeaseStore) for a
/// [`SqlBackend`] with the core's [`acquire`] and [`release`].
#[macro_export]
macro_rules! lease_store {
    ($store:ty) => {
        #[$crate::__private::async_trait]
        impl $crate::__private::store::LeaseStore for $store {
            async fn lease_acquire(
                &self,
                name: &str,
                holder: &str,
                ttl: ::std::time::Duration,
            ) -> ::std::result::Result<
                ::std::option::Option<$crate::__private::store::LeaseGrant>,
                $crate::__private::StoreError,
            > {
                $crate::lease::acquire(self, name, holder, ttl).await
            }

            async fn lease_release(
                &self,
                name: &str,
                holder: &str,
                token: u64,
            ) -> ::std::result::Result<bool, $crate::__private::StoreError> {
                $crate::lease::release(self, name, holder, token).await
            }
        }
    };
}
