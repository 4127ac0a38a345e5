//! Where the shop's leases are taken: the database (the default), or a
//! Redis the service already runs (`--leases redis://...`, feature
//! `redis`). Either way a lease only decides which process prunes and
//! runs retention; the deletes themselves are safe to run twice.

use std::time::Duration;

use keel_http::health::HealthBuilder;
use keel_messaging::lease::{LeaseGate, LeaseLock};
use keel_store::LeaseStore;

use crate::backend::LeaseBackend;

/// The lease backend the system uses.
#[derive(Clone, Default)]
#[non_exhaustive]
pub enum Leases {
    /// The system's own database.
    #[default]
    Store,
    /// Redis: see `keel_redis` for what a Redis lease promises.
    #[cfg(feature = "redis")]
    Redis(keel_redis::RedisLeases),
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Store => f.write_str("Store"),
            #[cfg(feature = "redis")]
            Self::Redis(redis) => f.debug_tuple("Redis").field(redis).finish(),
        }
    }
}

impl Leases {
    /// The backend `--leases` chose. Redis is connected on first use, so
    /// a Redis that is down at start is a failed lease (nobody prunes
    /// meanwhile) and a failing deep check, not a failed start.
    pub fn open(backend: &LeaseBackend) -> Result<Self, String> {
        match backend {
            LeaseBackend::Store => Ok(Self::Store),
            #[cfg(feature = "redis")]
            LeaseBackend::Redis(url) => keel_redis::RedisLeases::builder(url.as_str())
                .build()
                .map(Self::Redis)
                .map_err(|e| format!("leases: {e}")),
            #[cfg(not(feature = "redis"))]
            LeaseBackend::Redis(_) => Err("leases: built without the `redis` feature".to_owned()),
        }
    }

    /// The gate for the lease `name`, held as `holder` for `ttl` at a time.
    pub(crate) fn gate<S: LeaseStore>(
        &self,
        store: &S,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> LeaseGate {
        match self {
            Self::Store => LeaseGate::new(LeaseLock::new(store.clone(), name, holder, ttl)),
            #[cfg(feature = "redis")]
            Self::Redis(redis) => LeaseGate::new(LeaseLock::new(redis.clone(), name, holder, ttl)),
        }
    }

    /// Adds the lease backend's ping to the deep check, when it is a
    /// server of its own (the database is pinged already).
    pub(crate) fn ping_from(&self, health: HealthBuilder) -> HealthBuilder {
        match self {
            Self::Store => health,
            #[cfg(feature = "redis")]
            Self::Redis(redis) => {
                let redis = redis.clone();
                health.dependency("redis", Duration::from_secs(1), move || {
                    let redis = redis.clone();
                    async move { redis.ping().await }
                })
            }
        }
    }
}
