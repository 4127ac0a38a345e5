//! The resumable per-stream event log that real-time push reads.

use async_trait::async_trait;
use chrono::{DateTime, Utc};

use super::{Store, StoreError};

/// One event in a user's resumable event log.
#[derive(Debug, Clone, PartialEq)]
pub struct LoggedEvent {
    /// Position in the stream; strictly increasing per stream.
    pub seq: i64,
    /// The event type.
    pub event_type: String,
    /// The payload.
    pub data: serde_json::Value,
    /// When it was appended.
    pub at: DateTime<Utc>,
}

/// Per-stream (per-user) event logs behind long polling, SSE and WebSocket.
///
/// Sequence numbers are per stream and *contiguous*: a stream's first event
/// is 1 and every append adds exactly one, in commit order, and a
/// rolled-back append leaves no hole. Seqs are never reused, also after
/// every event of a stream was trimmed. Contiguity is what lets a reader
/// tell "nothing new" from "events were trimmed before I could read them"
/// (the first event it gets is not `after + 1`).
#[async_trait]
pub trait EventLogStore: Store {
    /// Appends to `stream` inside the caller's transaction; returns its seq.
    /// Concurrent appends to one stream are ordered: the later committer
    /// gets the higher seq (the per-stream counter is locked until commit).
    async fn event_log_append(
        &self,
        tx: &mut Self::Tx,
        stream: &str,
        event_type: &str,
        data: &serde_json::Value,
    ) -> Result<i64, StoreError>;

    /// Events of `stream` with seq greater than `after`, oldest first.
    async fn event_log_read_after(
        &self,
        stream: &str,
        after: i64,
        limit: usize,
    ) -> Result<Vec<LoggedEvent>, StoreError>;

    /// Deletes up to `batch` events appended before `before` (retention).
    async fn event_log_trim(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError>;

    /// The last seq ever appended to `stream` (committed), 0 if none; not
    /// lowered by trimming.
    async fn event_log_last_seq(&self, stream: &str) -> Result<i64, StoreError>;

    /// Deletes up to `batch` events that are not among the newest `keep` of
    /// their stream (count retention), in every stream; returns how many.
    async fn event_log_trim_keep_last(&self, keep: u64, batch: usize) -> Result<u64, StoreError>;
}
