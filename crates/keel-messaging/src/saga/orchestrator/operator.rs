//! What an operator sees and does: sagas by state and age, retry, cancel,
//! and "confirmed not applied" for a stuck step of unknown outcome. Every
//! change goes through the orchestrator's save, so its hooks see it too.

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::SagaOrchestrator;
use crate::saga::SagaError;
use crate::saga::machine;
use crate::store::{SagaFilter, SagaRecord, SagaStatus, SagaStore};

/// A saga as an operator sees it: where it is, in words, and for how long.
#[derive(Debug, Clone, PartialEq)]
pub struct SagaView {
    /// The saga as stored.
    pub record: SagaRecord,
    /// The step it is at (the next to run, the next to undo, or the one
    /// stuck), if any.
    pub step_name: Option<String>,
    /// Time since the saga started.
    pub age: Duration,
    /// Time since it last changed.
    pub idle: Duration,
}

impl<S: SagaStore> SagaOrchestrator<S> {
    /// A saga by id.
    pub async fn get(&self, id: &str) -> Result<Option<SagaRecord>, SagaError> {
        Ok(self.inner.store.saga_get(id).await?)
    }

    /// Sagas for the operator view (by status, not updated since a time),
    /// oldest update first.
    pub async fn list(&self, filter: &SagaFilter) -> Result<Vec<SagaView>, SagaError> {
        let records = self.inner.store.saga_list(filter).await?;
        let now = keel_core::clock::utc_now();
        Ok(records.into_iter().map(|r| self.view(r, now)).collect())
    }

    /// How many sagas are in each status.
    pub async fn counts(&self) -> Result<Vec<(SagaStatus, u64)>, SagaError> {
        let counts = self.inner.store.saga_counts().await?;
        for (status, n) in &counts {
            metrics::gauge!("keel_sagas", "status" => status.as_str()).set(*n as f64);
        }
        Ok(counts)
    }

    /// Retries a stuck saga now, in the direction it was going (forward
    /// after the pivot, compensating before it), with its attempts reset.
    pub async fn retry(&self, id: &str) -> Result<SagaRecord, SagaError> {
        let record = self.load(id).await?;
        let saga = self.saga(&record.kind)?;
        let next = machine::retry(&record, saga.shape(), keel_core::clock::utc_now())?;
        self.save_operator_change(&record, &next, "retried").await?;
        Ok(next)
    }

    /// Tells a saga stuck in forward recovery that its step's action did
    /// not take effect after all: an operator looked it up at the
    /// dependency under the step's idempotency key (`saga_id:step`) and
    /// made sure it never will (a tombstone, a cancelled request). The
    /// "maybe applied" mark is cleared and the saga runs again with fresh
    /// attempts; at the pivot it may now turn back and compensate.
    ///
    /// Only a stuck saga can be told this (so no attempt is in flight).
    /// Getting it wrong undoes the steps before a pivot that happened: the
    /// shipment leaves with the payment refunded.
    pub async fn confirm_not_applied(&self, id: &str) -> Result<SagaRecord, SagaError> {
        let record = self.load(id).await?;
        let next = machine::confirm_not_applied(&record, keel_core::clock::utc_now())?;
        self.save_operator_change(&record, &next, "confirmed not applied")
            .await?;
        Ok(next)
    }

    /// Cancels a saga that has not reached its pivot: what it did is
    /// compensated in reverse order, and it ends `cancelled`. A saga past
    /// its pivot is refused with [`SagaError::PastPivot`]. A call in flight
    /// is compensated too, once its lease ends.
    pub async fn cancel(&self, id: &str) -> Result<SagaRecord, SagaError> {
        let record = self.load(id).await?;
        let saga = self.saga(&record.kind)?;
        match machine::cancel(&record, saga.shape(), keel_core::clock::utc_now())? {
            Some(next) => {
                self.save_operator_change(&record, &next, "cancelled")
                    .await?;
                Ok(next)
            }
            None => Ok(record),
        }
    }

    fn view(&self, record: SagaRecord, now: DateTime<Utc>) -> SagaView {
        let step_name = self.inner.sagas.get(&record.kind).and_then(|saga| {
            let steps = &saga.shape().steps;
            let index = match record.status {
                SagaStatus::Compensating => (record.step as usize).checked_sub(1),
                _ => Some(record.step as usize),
            };
            index.and_then(|i| steps.get(i)).map(|s| s.name.to_string())
        });
        let since = |t: DateTime<Utc>| (now - t).to_std().unwrap_or_default();
        SagaView {
            age: since(record.created_at),
            idle: since(record.updated_at),
            step_name,
            record,
        }
    }

    async fn save_operator_change(
        &self,
        prev: &SagaRecord,
        next: &SagaRecord,
        what: &'static str,
    ) -> Result<(), SagaError> {
        if !self.save(prev, next).await? {
            return Err(SagaError::Conflict {
                id: next.id.clone(),
            });
        }
        tracing::info!(saga = %next.kind, saga_id = %next.id, status = next.status.as_str(), "saga {what} by operator");
        self.notify();
        Ok(())
    }
}
