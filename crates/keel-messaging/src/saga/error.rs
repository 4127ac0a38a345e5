//! What can go wrong when defining, starting, driving or steering a saga.

use keel_core::{Classify, ErrorClass};

use crate::store::{SagaStatus, StoreError};

/// A saga operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SagaError {
    /// The saga store failed.
    #[error("saga store: {0}")]
    Store(#[from] StoreError),
    /// A definition is invalid.
    #[error("saga definition `{saga}` is invalid: {problems}")]
    Definition {
        /// The saga kind.
        saga: String,
        /// Everything wrong with it.
        problems: String,
    },
    /// Two definitions with the same name were registered.
    #[error("saga `{kind}` is registered twice with the orchestrator; names must be unique")]
    DuplicateKind {
        /// The saga kind.
        kind: String,
    },
    /// A saga of a kind this orchestrator has no definition for.
    #[error(
        "saga kind `{kind}` is not registered with this orchestrator: add its definition with \
         OrchestratorBuilder::saga"
    )]
    UnknownKind {
        /// The saga kind.
        kind: String,
    },
    /// No saga has this id.
    #[error("no saga with id `{id}`")]
    NotFound {
        /// The saga id.
        id: String,
    },
    /// Only stuck sagas can be retried.
    #[error(
        "saga `{id}` is {status:?}, not stuck: only a stuck saga can be retried (a running or \
         compensating one retries by itself)"
    )]
    NotStuck {
        /// The saga id.
        id: String,
        /// Its status.
        status: SagaStatus,
    },
    /// A saga past its pivot cannot be cancelled.
    #[error(
        "saga `{id}` has reached its pivot `{pivot}` (the point of no return): it cannot be \
         cancelled, only finished; fix what makes it fail and retry it"
    )]
    PastPivot {
        /// The saga id.
        id: String,
        /// The pivot step.
        pivot: String,
    },
    /// The saga already finished.
    #[error("saga `{id}` already finished ({status:?}); there is nothing to change")]
    Finished {
        /// The saga id.
        id: String,
        /// Its final status.
        status: SagaStatus,
    },
    /// Someone else (another orchestrator, an operator) changed the saga
    /// at the same time.
    #[error("saga `{id}` was changed concurrently; reload it and try again")]
    Conflict {
        /// The saga id.
        id: String,
    },
    /// The saga's data could not be serialized.
    #[error("saga data could not be serialized: {0}")]
    Data(#[source] serde_json::Error),
    /// A failpoint simulated a crash (tests only).
    #[error("failpoint `{0}` simulated a crash")]
    Crashed(&'static str),
}

impl Classify for SagaError {
    fn class(&self) -> ErrorClass {
        match self {
            Self::Store(e) => e.class(),
            Self::Conflict { .. } | Self::Crashed(_) => ErrorClass::Retryable,
            _ => ErrorClass::Permanent,
        }
    }
}
