//! Where the shop's leases are taken: the database (the default), a Redis
//! the service already runs (`--leases redis://...`, feature `redis`), or
//! leadership in etcd's elections (`--leases etcd://...`, feature `etcd`).
//! Either way a lease only decides which process prunes and runs
//! retention; the deletes themselves are safe to run twice.

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
    /// etcd: one election per lease name, each gate open while this
    /// process leads it.
    #[cfg(feature = "etcd")]
    Etcd(etcd::EtcdLeases),
}

impl std::fmt::Debug for Leases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Store => f.write_str("Store"),
            #[cfg(feature = "redis")]
            Self::Redis(redis) => f.debug_tuple("Redis").field(redis).finish(),
            #[cfg(feature = "etcd")]
            Self::Etcd(etcd) => f.debug_tuple("Etcd").field(etcd).finish(),
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
            #[cfg(feature = "etcd")]
            LeaseBackend::Etcd(endpoints) => Ok(Self::Etcd(etcd::EtcdLeases::new(endpoints))),
            #[cfg(not(feature = "etcd"))]
            LeaseBackend::Etcd(_) => Err("leases: built without the `etcd` feature".to_owned()),
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
            #[cfg(feature = "etcd")]
            Self::Etcd(etcd) => LeaseGate::leading(etcd.election(name, ttl), holder),
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
            #[cfg(feature = "etcd")]
            Self::Etcd(etcd) => {
                let election = etcd.election("keel-health", Duration::from_secs(10));
                health.dependency("etcd", Duration::from_secs(1), move || {
                    let election = election.clone();
                    async move { election.ping().await }
                })
            }
        }
    }
}

#[cfg(feature = "etcd")]
mod etcd {
    //! Elections on etcd, connected on first use: an etcd that is down at
    //! start is a campaign that keeps retrying (nobody prunes meanwhile)
    //! and a failing deep check, not a failed start.

    use std::sync::Arc;
    use std::time::Duration;

    use keel_etcd::EtcdElection;
    use keel_store::{Election, Leadership, StoreError};
    use tokio::sync::OnceCell;

    /// The etcd cluster the shop's elections run on.
    #[derive(Debug, Clone)]
    pub struct EtcdLeases {
        endpoints: Arc<[String]>,
    }

    impl EtcdLeases {
        pub(super) fn new(endpoints: &[String]) -> Self {
            Self {
                endpoints: endpoints.into(),
            }
        }

        /// The election `name`, whose leader's lease lasts `ttl`.
        pub(super) fn election(&self, name: &str, ttl: Duration) -> LazyElection {
            LazyElection {
                endpoints: Arc::clone(&self.endpoints),
                name: name.to_owned(),
                ttl,
                connected: Arc::default(),
            }
        }
    }

    /// An [`EtcdElection`] built on its first campaign.
    #[derive(Clone)]
    pub(super) struct LazyElection {
        endpoints: Arc<[String]>,
        name: String,
        ttl: Duration,
        connected: Arc<OnceCell<EtcdElection>>,
    }

    impl LazyElection {
        async fn connected(&self) -> Result<&EtcdElection, keel_etcd::EtcdError> {
            self.connected
                .get_or_try_init(|| {
                    EtcdElection::builder(self.endpoints.iter().cloned(), self.name.clone())
                        .ttl(self.ttl)
                        .build()
                })
                .await
        }

        pub(super) async fn ping(&self) -> Result<(), String> {
            let election = self.connected().await.map_err(|e| e.to_string())?;
            election.ping().await.map_err(|e| e.to_string())
        }
    }

    #[async_trait::async_trait]
    impl Election for LazyElection {
        async fn campaign(&self, holder: &str) -> Result<Box<dyn Leadership>, StoreError> {
            let election = self.connected().await?;
            Election::campaign(election, holder).await
        }
    }
}
