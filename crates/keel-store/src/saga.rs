//! Saga records: each saga's state, step, attempts and whether an outcome
//! is unknown, claimed by the orchestrator under a lease.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{Store, StoreError};

/// Where a saga is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SagaStatus {
    /// Running its steps forward.
    Running,
    /// Undoing completed steps in reverse.
    Compensating,
    /// All steps done.
    Completed,
    /// All completed steps undone.
    Compensated,
    /// Past the pivot and failing: retried forward until a human acts.
    Stuck,
    /// Cancelled by an operator before the pivot, after compensation.
    Cancelled,
}

impl SagaStatus {
    /// Every status, in the order of a saga's life.
    pub const ALL: [Self; 6] = [
        Self::Running,
        Self::Compensating,
        Self::Completed,
        Self::Compensated,
        Self::Stuck,
        Self::Cancelled,
    ];

    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Running => "running",
            Self::Compensating => "compensating",
            Self::Completed => "completed",
            Self::Compensated => "compensated",
            Self::Stuck => "stuck",
            Self::Cancelled => "cancelled",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "running" => Self::Running,
            "compensating" => Self::Compensating,
            "completed" => Self::Completed,
            "compensated" => Self::Compensated,
            "stuck" => Self::Stuck,
            "cancelled" => Self::Cancelled,
            _ => return None,
        })
    }

    /// Whether the saga has finished for good.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Completed | Self::Compensated | Self::Cancelled)
    }
}

/// A saga instance as persisted after every step.
#[derive(Debug, Clone, PartialEq)]
pub struct SagaRecord {
    /// The saga id (idempotency keys derive from it).
    pub id: String,
    /// The saga definition's name.
    pub kind: String,
    /// Where it is.
    pub status: SagaStatus,
    /// Forward: the next step to run. Compensating: steps below this index
    /// still need undoing.
    pub step: u32,
    /// The saga's data, shared by its steps.
    pub data: serde_json::Value,
    /// Attempts started at the current call (a policy's refusal gives its
    /// attempt back).
    pub attempts: u32,
    /// Whether an attempt at the current step's action may have taken
    /// effect (it timed out, lost its reply, or the orchestrator stopped
    /// during it). Persisted, so a restart remembers it: compensation then
    /// includes the step, and a pivot that may have happened only goes
    /// forward.
    pub outcome_unknown: bool,
    /// When the first attempt at the current call was made; forward
    /// recovery's time budget counts from it. `None` before any attempt.
    pub first_attempt_at: Option<DateTime<Utc>>,
    /// The last error, for the operator.
    pub last_error: Option<String>,
    /// Not before this time is the saga worked on again (backoff).
    pub next_attempt_at: DateTime<Utc>,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
    /// Optimistic-concurrency version, bumped on every save.
    pub version: i64,
    /// The trace it was started in (a W3C `traceparent`): its step spans
    /// are children of it, so they join the story of what started it.
    pub traceparent: Option<String>,
}

/// Which sagas to list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SagaFilter {
    /// Only this status.
    pub status: Option<SagaStatus>,
    /// Only sagas not updated since this time (the "stuck for how long" view).
    pub updated_before: Option<DateTime<Utc>>,
    /// At most this many (default 100).
    pub limit: Option<usize>,
}

/// The saga table.
#[async_trait]
pub trait SagaStore: Store {
    /// Creates a saga inside the caller's transaction (e.g. an inbox handler).
    /// A saga with the same id already existing is not an error: `false`.
    async fn saga_insert(&self, tx: &mut Self::Tx, saga: &SagaRecord) -> Result<bool, StoreError>;

    /// Loads a saga.
    async fn saga_get(&self, id: &str) -> Result<Option<SagaRecord>, StoreError>;

    /// Loads the sagas with these ids (those that exist, in no particular
    /// order): one read for a page of orders, not one per order (a
    /// GraphQL DataLoader's batch). The default asks one by one; the SQL
    /// stores answer with one statement.
    async fn saga_get_many(&self, ids: &[String]) -> Result<Vec<SagaRecord>, StoreError> {
        let mut found = Vec::with_capacity(ids.len());
        for id in ids {
            found.extend(self.saga_get(id).await?);
        }
        Ok(found)
    }

    /// [`saga_get`](Self::saga_get) inside the caller's transaction: what
    /// the transaction itself wrote included, for a read-modify-save in one
    /// transaction (a choreographed flow's step).
    async fn saga_get_in(
        &self,
        tx: &mut Self::Tx,
        id: &str,
    ) -> Result<Option<SagaRecord>, StoreError>;

    /// Saves a saga if its stored version is still `saga.version - 1`
    /// (the caller bumps it). `false` if someone else saved first.
    /// [`StoreError::NotFound`] if there is no such saga.
    async fn saga_save(&self, saga: &SagaRecord) -> Result<bool, StoreError>;

    /// [`saga_save`](Self::saga_save) inside the caller's transaction, so
    /// that what else the transaction writes (a
    /// `keel_messaging::saga::SagaHook`'s projection) commits or rolls
    /// back with the saga's new state. The store retries nothing here: a
    /// conflict is the caller's to re-run, like any of its transactions.
    async fn saga_save_in(&self, tx: &mut Self::Tx, saga: &SagaRecord) -> Result<bool, StoreError>;

    /// Sagas of `kinds` that are not terminal and due
    /// (`next_attempt_at <= now`), oldest first. Only the kinds the caller
    /// runs: an orchestrator never picks up another's sagas, nor the
    /// choreographed flows a `FlowWatch` (`keel-messaging`)
    /// keeps.
    async fn saga_due(
        &self,
        kinds: &[&str],
        now: DateTime<Utc>,
        limit: usize,
    ) -> Result<Vec<SagaRecord>, StoreError>;

    /// Sagas for the operator view, oldest update first.
    async fn saga_list(&self, filter: &SagaFilter) -> Result<Vec<SagaRecord>, StoreError>;

    /// Counts by status.
    async fn saga_counts(&self) -> Result<Vec<(SagaStatus, u64)>, StoreError>;
}
