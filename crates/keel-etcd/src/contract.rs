//! [`EtcdElection`] behind keel-store's `Election` contract.

use async_trait::async_trait;
use keel_store::{Election, Leadership as LeadershipContract, StoreError};

use crate::{EtcdElection, EtcdError, Leadership};

impl From<EtcdError> for StoreError {
    fn from(error: EtcdError) -> Self {
        match error {
            // Unreachable, refused or timed out: nothing was decided.
            EtcdError::Etcd(error) => StoreError::Unavailable(Box::new(error)),
            other => StoreError::other(other),
        }
    }
}

#[async_trait]
impl Election for EtcdElection {
    async fn campaign(&self, holder: &str) -> Result<Box<dyn LeadershipContract>, StoreError> {
        Ok(Box::new(EtcdElection::campaign(self, holder).await?))
    }
}

#[async_trait]
impl LeadershipContract for Leadership {
    fn token(&self) -> u64 {
        Leadership::token(self)
    }

    fn is_leader(&self) -> bool {
        Leadership::is_leader(self)
    }

    async fn lost(&self) {
        Leadership::lost(self).await;
    }

    async fn resign(self: Box<Self>) -> Result<(), StoreError> {
        Ok(Leadership::resign(*self).await?)
    }
}
