//! Hooks: the application's writes that commit with a saga's change of
//! status.
//!
//! An application that shows a saga's outcome somewhere (an order's
//! status, a customer's feed, a webhook) must not read the saga table to
//! find out: it is the library's, and a poll can only see a status after
//! the fact, between two saves. A [`SagaHook`] is told instead, inside the
//! transaction that saves the new status: what it writes there commits
//! with the status or not at all, whichever process or operator moved the
//! saga, and a crash can never leave one without the other.

use std::fmt;

use async_trait::async_trait;

use crate::store::{SagaRecord, Store, StoreError};

/// Writes that belong with a saga's new status.
///
/// Registered with
/// [`OrchestratorBuilder::hook`](super::OrchestratorBuilder::hook). The
/// orchestrator calls [`status_changed`](Self::status_changed) whenever a
/// save changes a saga's status (forward, compensation, stuck, an
/// operator's retry or cancel), inside the transaction of that save, after
/// the save itself succeeded. An error rolls the whole transaction back:
/// the saga keeps its previous state and the change is attempted again
/// later, the hook with it. Nothing a rolled-back attempt wrote survives,
/// so the hook needs no idempotency of its own.
#[async_trait]
pub trait SagaHook<S>: Send + Sync + 'static {
    /// Writes, in `tx`, what follows from `prev` becoming `next`; returns
    /// what to do once `tx` committed (wake readers, count).
    async fn status_changed(
        &self,
        tx: &mut S::Tx,
        prev: &SagaRecord,
        next: &SagaRecord,
    ) -> Result<AfterCommit, StoreError>
    where
        S: Store;
}

/// What a [`SagaHook`] does after its transaction committed (or may have:
/// a lost commit reply runs it too, so that a reader woken for nothing
/// finds nothing, rather than one not woken missing an event).
#[derive(Default)]
pub struct AfterCommit(Option<Box<dyn FnOnce() + Send>>);

impl AfterCommit {
    /// Nothing to do.
    pub fn nothing() -> Self {
        Self(None)
    }

    /// Runs `then` after the commit.
    pub fn then(then: impl FnOnce() + Send + 'static) -> Self {
        Self(Some(Box::new(then)))
    }

    pub(super) fn run(self) {
        if let Some(then) = self.0 {
            then();
        }
    }
}

impl fmt::Debug for AfterCommit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("AfterCommit")
            .field(&self.0.as_ref().map(|_| "FnOnce"))
            .finish()
    }
}
