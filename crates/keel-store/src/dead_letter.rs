//! Dead letters and their failure history: what a consumer gave up on,
//! with every attempt's error, for an operator to replay or discard.

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::{Store, StoreError};
use crate::broker::Message;

/// One failed attempt at handling a message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptError {
    /// The delivery count of the attempt.
    pub attempt: u32,
    /// What went wrong (the full cause chain).
    pub error: String,
    /// When.
    pub at: DateTime<Utc>,
}

/// What has become of a dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeadLetterStatus {
    /// Waiting for an operator.
    Pending,
    /// Sent back to its topic.
    Replayed,
    /// Thrown away on purpose.
    Discarded,
}

impl DeadLetterStatus {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Replayed => "replayed",
            Self::Discarded => "discarded",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "pending" => Some(Self::Pending),
            "replayed" => Some(Self::Replayed),
            "discarded" => Some(Self::Discarded),
            _ => None,
        }
    }
}

/// A message that could not be processed, with its whole error history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetter {
    /// The dead letter's own id.
    pub id: String,
    /// The original message.
    pub message: Message,
    /// The consumer group (handler) that gave up on it.
    pub group: String,
    /// A short error category for grouping (`poison`, `malformed`,
    /// `unknown_type`, `too_many_attempts`, `expired`, ...).
    pub error_kind: String,
    /// Every attempt, oldest first.
    pub attempts: Vec<AttemptError>,
    /// When it was dead-lettered.
    pub dead_at: DateTime<Utc>,
    /// What has become of it.
    pub status: DeadLetterStatus,
}

/// Which dead letters to list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeadLetterFilter {
    /// Only this topic.
    pub topic: Option<String>,
    /// Only this error kind.
    pub error_kind: Option<String>,
    /// Only this status (default: any).
    pub status: Option<DeadLetterStatus>,
    /// At most this many (default 100).
    pub limit: Option<usize>,
}

/// The dead-letter table.
#[async_trait]
pub trait DeadLetterStore: Store {
    /// Stores a dead letter.
    /// [`StoreError::Conflict`] if a letter with this id exists.
    async fn dead_letter_put(&self, letter: &DeadLetter) -> Result<(), StoreError>;

    /// Lists dead letters, oldest first.
    async fn dead_letter_list(
        &self,
        filter: &DeadLetterFilter,
    ) -> Result<Vec<DeadLetter>, StoreError>;

    /// One dead letter.
    async fn dead_letter_get(&self, id: &str) -> Result<Option<DeadLetter>, StoreError>;

    /// Sets the status of a dead letter inside `tx` (so a replay's outbox
    /// row and the status change commit together). `false` if it was not
    /// pending.
    async fn dead_letter_settle(
        &self,
        tx: &mut Self::Tx,
        id: &str,
        status: DeadLetterStatus,
    ) -> Result<bool, StoreError>;

    /// Pending dead letters counted by error kind.
    async fn dead_letter_counts(&self) -> Result<Vec<(String, u64)>, StoreError>;

    /// Remembers a failed attempt at `message_id` by `group`, so the whole
    /// history travels with the message if it is dead-lettered later (the
    /// broker only counts deliveries; it does not keep errors).
    async fn failure_record(
        &self,
        group: &str,
        message_id: &str,
        failure: &AttemptError,
    ) -> Result<(), StoreError>;

    /// The failed attempts recorded for `message_id` by `group`, oldest first.
    async fn failure_history(
        &self,
        group: &str,
        message_id: &str,
    ) -> Result<Vec<AttemptError>, StoreError>;

    /// Forgets the failure history (after success or dead-lettering).
    async fn failure_clear(&self, group: &str, message_id: &str) -> Result<(), StoreError>;
}
