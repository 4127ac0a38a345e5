//! The storage contract: the tables the messaging patterns need.
//!
//! The user's own database transaction is the unit of work. A [`Store`] hands
//! out its backend's transaction type ([`Store::Tx`], e.g.
//! `sqlx::Transaction<'static, Sqlite>`), the user writes business rows in it
//! with their own SQL, and Keel adds its rows to the *same* transaction: the
//! outbox row commits with the order, the inbox row commits with the effect.
//! That is the whole trick of both patterns, so it is in the type signatures.
//!
//! Each capability is its own trait so a backend can be tested (and a user
//! can depend) capability by capability; [`MessagingStore`] is all of them.
//! `keel-sqlite` and `keel-postgres` implement them; `keel-testkit` holds the
//! conformance suite that defines their behaviour.

use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, Utc};
use keel_core::{BoxError, Classify, ErrorClass};
use serde::{Deserialize, Serialize};

use crate::broker::{Headers, Message};

/// A store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The database could not be reached, or asked us to retry (busy,
    /// serialization failure, deadlock). Nothing was committed.
    #[error("store unavailable, try again: {0}")]
    Unavailable(#[source] BoxError),
    /// The connection failed during COMMIT: the transaction may or may not
    /// have committed. Resolve by reading back, never by guessing.
    #[error("store commit outcome unknown: {0}")]
    OutcomeUnknown(#[source] BoxError),
    /// A uniqueness or version check failed.
    #[error("conflict: {0}")]
    Conflict(String),
    /// The row does not exist.
    #[error("not found: {0}")]
    NotFound(String),
    /// Anything else (a bug, a schema mismatch).
    #[error("store error: {0}")]
    Other(#[source] BoxError),
}

impl StoreError {
    /// Wraps any error as [`StoreError::Other`].
    pub fn other(err: impl Into<BoxError>) -> Self {
        Self::Other(err.into())
    }
}

impl Classify for StoreError {
    fn class(&self) -> ErrorClass {
        match self {
            Self::Unavailable(_) => ErrorClass::Retryable,
            Self::OutcomeUnknown(_) => ErrorClass::OutcomeUnknown,
            Self::Conflict(_) | Self::NotFound(_) => ErrorClass::Permanent,
            // Nobody said what kind of failure it is: it counts against the
            // dependency (breakers) and is not retried.
            Self::Other(_) => ErrorClass::Unclassified,
        }
    }
}

/// A database that can run transactions.
#[async_trait]
pub trait Store: Clone + Send + Sync + 'static {
    /// The backend's transaction, in which users write their own rows too.
    type Tx: Send;

    /// Starts a transaction.
    async fn begin(&self) -> Result<Self::Tx, StoreError>;

    /// Commits a transaction. [`StoreError::OutcomeUnknown`] when the
    /// connection failed during COMMIT.
    async fn commit(&self, tx: Self::Tx) -> Result<(), StoreError>;

    /// Rolls a transaction back (dropping it does too).
    async fn rollback(&self, tx: Self::Tx) -> Result<(), StoreError>;

    /// Whether the schema is migrated and the pool is usable (`/readyz`).
    async fn ready(&self) -> Result<(), StoreError>;
}

/// An event to put in the outbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutboxRecord {
    /// The event id; unique in the outbox, and the message id.
    pub event_id: String,
    /// The destination topic.
    pub topic: String,
    /// Keeps per-entity order on the broker.
    pub partition_key: String,
    /// Message headers (traceparent, type, ...).
    pub headers: Headers,
    /// The message body.
    pub payload: Bytes,
}

impl OutboxRecord {
    /// The broker message for this record.
    pub fn to_message(&self) -> Message {
        Message {
            id: self.event_id.clone(),
            topic: self.topic.clone(),
            key: self.partition_key.clone(),
            headers: self.headers.clone(),
            payload: self.payload.clone(),
        }
    }
}

/// An unpublished outbox row claimed by a relay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingOutbox {
    /// The row id; the relay publishes in id order.
    pub id: i64,
    /// The event.
    pub record: OutboxRecord,
    /// When the business transaction wrote it.
    pub created_at: DateTime<Utc>,
    /// Failed publish attempts so far (0 the first time it is claimed).
    pub attempts: u32,
}

/// The relay's view of the outbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct OutboxStats {
    /// Rows waiting to be published (parked rows not included; the rows
    /// held back behind a parked row are).
    pub unpublished: u64,
    /// Age of the oldest of those rows: the relay lag.
    pub oldest_unpublished_age: Option<Duration>,
    /// Rows parked because the broker refused them for good.
    #[serde(default)]
    pub parked: u64,
}

/// An outbox row the broker refused for good (`BrokerError::Invalid`),
/// parked by the relay: it is not published, and neither is any later row
/// of its partition key, until an operator replays it
/// ([`OutboxStore::outbox_unpark`]) or discards it
/// ([`OutboxStore::outbox_discard`]). Rows of other keys flow on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParkedOutbox {
    /// The row id.
    pub id: i64,
    /// The event.
    pub record: OutboxRecord,
    /// When the business transaction wrote it.
    pub created_at: DateTime<Utc>,
    /// When the relay parked it.
    pub parked_at: DateTime<Utc>,
    /// Failed publish attempts, the refusal included.
    pub attempts: u32,
    /// Why the broker refused it.
    pub last_error: String,
    /// Unpublished rows of the same key waiting behind it.
    pub held_back: u64,
}

/// Which parked outbox rows to list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ParkedFilter {
    /// Only this topic.
    pub topic: Option<String>,
    /// At most this many (default 100).
    pub limit: Option<usize>,
}

fn parking_unsupported(what: &str) -> StoreError {
    StoreError::Other(format!("this store does not support {what} (parked outbox rows)").into())
}

/// The transactional outbox table.
#[async_trait]
pub trait OutboxStore: Store {
    /// Adds events inside the caller's business transaction.
    /// [`StoreError::Conflict`] if an event id is already in the outbox.
    async fn outbox_append(
        &self,
        tx: &mut Self::Tx,
        records: &[OutboxRecord],
    ) -> Result<(), StoreError>;

    /// Claims up to `limit` unpublished rows, lowest id first, for `lease`:
    /// other relays skip them until the lease ends. A row whose partition key
    /// has an earlier unpublished row claimed by another relay is not
    /// returned, so per-key order survives several relays. A parked row is
    /// never returned, nor is any later row of its key (see
    /// [`outbox_park`](Self::outbox_park)). Never skips a
    /// row because a higher id committed first. Rows already leased by
    /// `relay` itself are returned again (lease renewed), so a restarted
    /// relay with the same name resumes at once.
    async fn outbox_claim(
        &self,
        relay: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<PendingOutbox>, StoreError>;

    /// Marks rows published (after the broker accepted them).
    async fn outbox_mark_published(&self, ids: &[i64]) -> Result<(), StoreError>;

    /// Gives claimed rows back without publishing them.
    async fn outbox_release(&self, ids: &[i64]) -> Result<(), StoreError>;

    /// Deletes up to `batch` rows published before `before`; returns how many.
    async fn outbox_prune(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError>;

    /// Unpublished count and relay lag, and the parked count.
    async fn outbox_stats(&self) -> Result<OutboxStats, StoreError>;

    /// Gives claimed rows back after a failed publish that may succeed
    /// later (the broker was unreachable, the outcome is unknown): each
    /// row's attempt count goes up by one and `error` is kept as its last
    /// error. The default releases them without counting.
    async fn outbox_release_failed(&self, ids: &[i64], error: &str) -> Result<(), StoreError> {
        let _ = error;
        self.outbox_release(ids).await
    }

    /// Parks an unpublished row the broker refused for good: it is
    /// released, its attempt count goes up by one, `error` is kept, and it
    /// is never claimed again, nor is any later row of its partition key,
    /// until it is unparked or discarded. `false` if there is no such
    /// unpublished, unparked row.
    async fn outbox_park(&self, id: i64, error: &str) -> Result<bool, StoreError> {
        let _ = (id, error);
        Err(parking_unsupported("parking"))
    }

    /// Parked rows, lowest id first.
    async fn outbox_parked(&self, filter: &ParkedFilter) -> Result<Vec<ParkedOutbox>, StoreError> {
        let _ = filter;
        Err(parking_unsupported("listing"))
    }

    /// One parked row.
    async fn outbox_parked_get(&self, id: i64) -> Result<Option<ParkedOutbox>, StoreError> {
        let _ = id;
        Err(parking_unsupported("reading"))
    }

    /// Replays a parked row: it is claimable again with no attempts and no
    /// error, and, keeping its id, it is still published before the later
    /// rows of its key. `false` if the row is not parked.
    async fn outbox_unpark(&self, id: i64) -> Result<bool, StoreError> {
        let _ = id;
        Err(parking_unsupported("replaying"))
    }

    /// Deletes a parked row for good, which frees the later rows of its
    /// key. `false` if the row is not parked.
    async fn outbox_discard(&self, id: i64) -> Result<bool, StoreError> {
        let _ = id;
        Err(parking_unsupported("discarding"))
    }
}

/// The idempotent consumer's table of processed events.
#[async_trait]
pub trait InboxStore: Store {
    /// Records that `handler` processed `event_id`, inside the transaction of
    /// its effect. `false` if it already had: the caller skips the effect.
    async fn inbox_record(
        &self,
        tx: &mut Self::Tx,
        event_id: &str,
        handler: &str,
    ) -> Result<bool, StoreError>;

    /// Deletes inbox rows older than `before` (beyond any redelivery window).
    async fn inbox_prune(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError>;
}

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

    /// Saves a saga if its stored version is still `saga.version - 1`
    /// (the caller bumps it). `false` if someone else saved first.
    /// [`StoreError::NotFound`] if there is no such saga.
    async fn saga_save(&self, saga: &SagaRecord) -> Result<bool, StoreError>;

    /// Sagas that are not terminal and due (`next_attempt_at <= now`),
    /// oldest first.
    async fn saga_due(
        &self,
        now: DateTime<Utc>,
        limit: usize,
    ) -> Result<Vec<SagaRecord>, StoreError>;

    /// Sagas for the operator view, oldest update first.
    async fn saga_list(&self, filter: &SagaFilter) -> Result<Vec<SagaRecord>, StoreError>;

    /// Counts by status.
    async fn saga_counts(&self) -> Result<Vec<(SagaStatus, u64)>, StoreError>;
}

/// Monotonic fencing tokens.
#[async_trait]
pub trait FenceStore: Store {
    /// The next token for `resource`: strictly greater than every token
    /// handed out before for it, across restarts.
    async fn fence_next(&self, resource: &str) -> Result<u64, StoreError>;
}

/// Every messaging capability in one bound.
pub trait MessagingStore:
    OutboxStore + InboxStore + DeadLetterStore + SagaStore + FenceStore
{
}

impl<S> MessagingStore for S where
    S: OutboxStore + InboxStore + DeadLetterStore + SagaStore + FenceStore
{
}

/// A response stored under an idempotency key, replayed for retries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResponse {
    /// The HTTP status.
    pub status: u16,
    /// Headers worth replaying (content type, location, ...).
    pub headers: Vec<(String, String)>,
    /// The body bytes.
    pub body: Bytes,
}

/// What an idempotency key already stands for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdempotencyBegin {
    /// The key is new (or was taken over) and is now in flight under the
    /// claim's owner: process the request.
    Started,
    /// A request with this key is being processed right now.
    InFlight,
    /// The key finished before with this response: replay it.
    Completed(StoredResponse),
    /// The key was used before for a different request (fingerprint).
    Mismatch,
}

/// A request's claim on an idempotency key: who asks, for which request,
/// under which owner token, and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdempotencyClaim<'a> {
    /// Whose keys these are (keys are scoped per principal).
    pub principal: &'a str,
    /// The key.
    pub key: &'a str,
    /// The request's fingerprint: the same key with another is a mismatch.
    pub fingerprint: &'a str,
    /// A token unique to this attempt. Only its holder may renew, complete
    /// or release the key, so a holder that lost its lock to a takeover can
    /// never overwrite its successor.
    pub owner: &'a str,
    /// Until when the in-flight key is locked to `owner`. The holder renews
    /// it while it works ([`IdempotencyStore::idempotency_renew`]); once it
    /// has passed the holder is presumed dead and a request with the same
    /// fingerprint takes the key over.
    pub locked_until: DateTime<Utc>,
    /// When the key expires (inclusive); after that any request starts it
    /// afresh. A lock never outlives it.
    pub expires_at: DateTime<Utc>,
}

/// Idempotency keys with their stored responses.
///
/// An in-flight key is a lease: it belongs to the claim's `owner` until
/// `locked_until`, which the owner renews while its request runs. A process
/// that dies stops renewing, so a retry takes the key over within one lock
/// period instead of waiting for the key to expire; renew, complete and
/// release all check the owner, so of two holders only the latest can
/// write.
#[async_trait]
pub trait IdempotencyStore: Store {
    /// Records the claimed key as in flight for `claim.owner`, atomically
    /// with the check, unless it exists live; says what it stands for. A
    /// key in flight past its lock, with the same fingerprint, is taken
    /// over ([`IdempotencyBegin::Started`]); with another fingerprint it is
    /// still [`IdempotencyBegin::Mismatch`]. Recording *before* processing
    /// is what makes concurrent duplicates execute once.
    async fn idempotency_begin(
        &self,
        claim: &IdempotencyClaim<'_>,
    ) -> Result<IdempotencyBegin, StoreError>;

    /// Extends the lock of a key in flight under `owner` to `locked_until`
    /// (never past the key's expiry). `Ok(false)` if the key is no longer
    /// `owner`'s: it was taken over, released, completed or pruned, and the
    /// holder must stop.
    async fn idempotency_renew(
        &self,
        principal: &str,
        key: &str,
        owner: &str,
        locked_until: DateTime<Utc>,
    ) -> Result<bool, StoreError>;

    /// Stores the response for a key in flight under `owner`, making it
    /// completed. [`StoreError::NotFound`] if the key is not in flight under
    /// `owner` (taken over, released, pruned, or never begun).
    async fn idempotency_complete(
        &self,
        principal: &str,
        key: &str,
        owner: &str,
        response: &StoredResponse,
    ) -> Result<(), StoreError>;

    /// Forgets a key in flight under `owner` whose request failed in a way
    /// the client may retry (so the retry is processed, not refused as in
    /// flight). A completed key, another owner's, or no key at all is left
    /// alone (not an error).
    async fn idempotency_release(
        &self,
        principal: &str,
        key: &str,
        owner: &str,
    ) -> Result<(), StoreError>;

    /// Deletes up to `batch` keys that expired at or before `now`, in flight
    /// or completed; returns how many.
    async fn idempotency_prune(&self, now: DateTime<Utc>, batch: usize) -> Result<u64, StoreError>;
}

/// The state of an asynchronous job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobStatus {
    /// Accepted, waiting for a worker.
    Queued,
    /// A worker is on it.
    Running,
    /// Done; the result is at `result_location`.
    Succeeded,
    /// Failed; see `error`.
    Failed,
    /// Cancelled by the client.
    Cancelled,
}

impl JobStatus {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queued => "queued",
            Self::Running => "running",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Cancelled => "cancelled",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "queued" => Self::Queued,
            "running" => Self::Running,
            "succeeded" => Self::Succeeded,
            "failed" => Self::Failed,
            "cancelled" => Self::Cancelled,
            _ => return None,
        })
    }

    /// Whether the job has finished for good (succeeded, failed or
    /// cancelled): no update moves it again.
    pub fn is_final(self) -> bool {
        matches!(self, Self::Succeeded | Self::Failed | Self::Cancelled)
    }
}

/// An asynchronous job (202 Accepted, then poll).
#[derive(Debug, Clone, PartialEq)]
pub struct JobRecord {
    /// The job id.
    pub id: String,
    /// What kind of job (`report`).
    pub kind: String,
    /// The idempotency key it was created with (unique per kind).
    pub idempotency_key: String,
    /// The job's parameters.
    pub params: serde_json::Value,
    /// Where it is.
    pub status: JobStatus,
    /// 0 to 100.
    pub progress: u8,
    /// Where the result lives once succeeded (for the 303).
    pub result_location: Option<String>,
    /// What went wrong, once failed.
    pub error: Option<String>,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
    /// After this the job is gone (410).
    pub expires_at: DateTime<Utc>,
}

/// Asynchronous jobs.
#[async_trait]
pub trait JobStore: Store {
    /// Creates a job inside the caller's transaction (with its outbox event).
    /// If a job with the same kind and idempotency key exists, returns it
    /// instead and creates nothing.
    async fn job_create(&self, tx: &mut Self::Tx, job: &JobRecord)
    -> Result<JobRecord, StoreError>;

    /// One job.
    async fn job_get(&self, id: &str) -> Result<Option<JobRecord>, StoreError>;

    /// Updates status, progress, result, error and `expires_at` (and sets
    /// `updated_at` to now).
    /// Refuses (false) to move a job out of a final state (succeeded,
    /// failed, cancelled): the check and the write are one atomic step, so a
    /// client's cancel and a worker's success cannot both win.
    /// [`StoreError::NotFound`] if there is no such job.
    async fn job_update(&self, job: &JobRecord) -> Result<bool, StoreError>;

    /// Deletes up to `batch` jobs whose `expires_at` is before `before`;
    /// returns how many. Keep expired jobs for a while before pruning them
    /// (pass a time well before now): until then they answer `410 Gone`,
    /// afterwards only `404`.
    async fn job_prune(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError>;
}

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

/// A signing secret of a webhook endpoint.
///
/// The text is a Standard Webhooks secret (`whsec_` + base64 of the key
/// bytes) or any other string, used as the key bytes as it is.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WebhookSecret {
    /// The secret's text form (`whsec_...`).
    pub secret: String,
    /// When it was added.
    pub created_at: DateTime<Utc>,
    /// After this time it no longer signs (`None`: until it is rotated out).
    pub expires_at: Option<DateTime<Utc>>,
}

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print the secret itself (logs, panics, test output).
        f.debug_struct("WebhookSecret")
            .field("secret", &"<redacted>")
            .field("created_at", &self.created_at)
            .field("expires_at", &self.expires_at)
            .finish()
    }
}

impl WebhookSecret {
    /// Whether the secret still signs at `now`.
    pub fn is_active_at(&self, now: DateTime<Utc>) -> bool {
        self.expires_at.is_none_or(|expires| expires > now)
    }
}

/// A customer's webhook endpoint: where deliveries go and how they are signed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookEndpoint {
    /// The endpoint id.
    pub id: String,
    /// The URL deliveries are POSTed to.
    pub url: String,
    /// A human description (may be empty).
    pub description: String,
    /// The event types it subscribes to: exact names (`order.paid`) or
    /// prefixes ending in `.*` (`order.*`); empty means every type.
    pub event_types: Vec<String>,
    /// Its signing secrets, oldest first: at most two, so that a rotation
    /// can sign with the old and the new one during a grace period.
    pub secrets: Vec<WebhookSecret>,
    /// Whether deliveries are sent to it.
    pub enabled: bool,
    /// Why it was disabled (`410 Gone`, a failure window, an operator).
    pub disabled_reason: Option<String>,
    /// When it was disabled.
    pub disabled_at: Option<DateTime<Utc>>,
    /// Since when every attempt to it has failed: the time of the first
    /// failed attempt after its last successful one (`None` while healthy).
    pub failing_since: Option<DateTime<Utc>>,
    /// When an attempt to it last succeeded.
    pub last_success_at: Option<DateTime<Utc>>,
    /// Creation time.
    pub created_at: DateTime<Utc>,
    /// Last change of its settings, secrets or state.
    pub updated_at: DateTime<Utc>,
    /// The tenant that owns it: only that tenant's callers see, change or
    /// resend it (empty: no tenant, managed by operators only).
    pub tenant: String,
    /// How its deliveries are put on the wire.
    pub format: WebhookFormat,
}

/// How a webhook is put on the wire. Every format is signed the same way
/// (Standard Webhooks `webhook-id`, `webhook-timestamp` and
/// `webhook-signature` over the exact body sent); they differ in what the
/// body and headers hold, so a receiver uses the SDK it already has.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WebhookFormat {
    /// The Standard Webhooks payload, `application/json`:
    /// `{"id","type","timestamp","sequence"?,"source"?,"data"}`.
    #[default]
    StandardWebhooks,
    /// A CloudEvents 1.0 event in structured mode:
    /// `application/cloudevents+json`, attributes and `data` in the body.
    CloudeventsStructured,
    /// A CloudEvents 1.0 event in binary mode: attributes as `ce-*`
    /// headers, `data` alone as the `application/json` body.
    CloudeventsBinary,
}

impl WebhookFormat {
    /// Every format.
    pub const ALL: [Self; 3] = [
        Self::StandardWebhooks,
        Self::CloudeventsStructured,
        Self::CloudeventsBinary,
    ];

    /// The stored (and API) name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::StandardWebhooks => "standard-webhooks",
            Self::CloudeventsStructured => "cloudevents-structured",
            Self::CloudeventsBinary => "cloudevents-binary",
        }
    }

    /// Parses the stored name.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.as_str() == name)
    }
}

impl WebhookEndpoint {
    /// Whether it subscribes to `event_type`: no filter, an exact name, or a
    /// `prefix.*` pattern whose prefix (dot included) starts the type.
    pub fn subscribes_to(&self, event_type: &str) -> bool {
        self.event_types.is_empty()
            || self.event_types.iter().any(|pattern| {
                pattern == event_type
                    || pattern == "*"
                    || pattern.strip_suffix('*').is_some_and(|prefix| {
                        prefix.ends_with('.') && event_type.starts_with(prefix)
                    })
            })
    }

    /// The secrets that sign at `now`, oldest first.
    pub fn active_secrets(&self, now: DateTime<Utc>) -> impl Iterator<Item = &WebhookSecret> {
        self.secrets.iter().filter(move |s| s.is_active_at(now))
    }
}

/// Where a webhook delivery is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryStatus {
    /// Waiting for its next attempt (or being attempted under a lease).
    Pending,
    /// The endpoint answered `2xx`.
    Succeeded,
    /// Every attempt of the retry schedule failed.
    Failed,
    /// Not sent because its endpoint is (or was) disabled; a replay
    /// re-queues it once the endpoint is enabled again.
    Disabled,
}

impl DeliveryStatus {
    /// The stored name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Succeeded => "succeeded",
            Self::Failed => "failed",
            Self::Disabled => "disabled",
        }
    }

    /// Parses the stored name.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "pending" => Self::Pending,
            "succeeded" => Self::Succeeded,
            "failed" => Self::Failed,
            "disabled" => Self::Disabled,
            _ => return None,
        })
    }
}

/// An event to deliver to every subscribed endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookMessage {
    /// The event id: the `webhook-id` receivers dedupe on, the same in
    /// every attempt and for every endpoint.
    pub event_id: String,
    /// The event type endpoints subscribe to.
    pub event_type: String,
    /// The exact body to send (and sign).
    pub payload: Bytes,
}

/// One event queued for one endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookDelivery {
    /// The delivery id, increasing in creation order.
    pub id: i64,
    /// The endpoint it goes to.
    pub endpoint_id: String,
    /// The event id (`webhook-id`).
    pub event_id: String,
    /// The event type.
    pub event_type: String,
    /// The body.
    pub payload: Bytes,
    /// Where it is.
    pub status: DeliveryStatus,
    /// Attempts made since it was (re)queued.
    pub attempts: u32,
    /// Not attempted before this time.
    pub next_attempt_at: DateTime<Utc>,
    /// When it was queued.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
    /// The worker attempting it now, if any.
    pub leased_by: Option<String>,
    /// Until when that worker holds it; afterwards another worker may.
    pub leased_until: Option<DateTime<Utc>>,
}

/// A due delivery leased to a worker, with its endpoint (URL, secrets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedDelivery {
    /// The delivery.
    pub delivery: WebhookDelivery,
    /// Its endpoint as it was when claimed.
    pub endpoint: WebhookEndpoint,
}

/// One attempt at a delivery, as the delivery log shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryAttempt {
    /// The delivery.
    pub delivery_id: i64,
    /// The attempt's number since the delivery was (re)queued, from 1.
    pub attempt: u32,
    /// When it started.
    pub at: DateTime<Utc>,
    /// The URL finally requested (after redirects).
    pub url: String,
    /// The request headers sent (the body is the delivery's payload).
    pub request_headers: Vec<(String, String)>,
    /// The response status, if a response came.
    pub response_status: Option<u16>,
    /// The start of the response body (truncated by the sender).
    pub response_body: Option<String>,
    /// How long the attempt took.
    pub latency: Duration,
    /// What went wrong, if anything did (timeout, refused, SSRF guard, ...).
    pub error: Option<String>,
}

impl DeliveryAttempt {
    /// Whether the endpoint accepted the delivery (`2xx`).
    pub fn succeeded(&self) -> bool {
        self.response_status
            .is_some_and(|status| (200..300).contains(&status))
    }
}

/// The result of one attempt, to be recorded by
/// [`WebhookStore::webhook_complete`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeliveryOutcome {
    /// The attempt, for the log; `attempt.attempt` becomes the delivery's
    /// attempt count.
    pub attempt: DeliveryAttempt,
    /// The delivery's new status.
    pub status: DeliveryStatus,
    /// With [`DeliveryStatus::Pending`]: when to try again.
    pub next_attempt_at: Option<DateTime<Utc>>,
}

/// Which deliveries to list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DeliveryFilter {
    /// Only this endpoint's.
    pub endpoint_id: Option<String>,
    /// Only this event's.
    pub event_id: Option<String>,
    /// Only this status.
    pub status: Option<DeliveryStatus>,
    /// Only deliveries queued at or after this time.
    pub created_from: Option<DateTime<Utc>>,
    /// Only deliveries queued before this time.
    pub created_before: Option<DateTime<Utc>>,
    /// Only deliveries with a smaller id (keyset paging, newest first).
    pub before_id: Option<i64>,
    /// At most this many (default 100).
    pub limit: Option<usize>,
}

/// Webhook endpoints, their queued deliveries and the delivery log.
///
/// Deliveries are *queued*, never sent inline: [`webhook_enqueue`] writes
/// one row per subscribed endpoint inside the caller's transaction (the one
/// that writes the business change, or an outbox consumer's), and workers
/// lease due rows with [`webhook_claim_due`], send them, and record each
/// attempt with [`webhook_complete`].
///
/// A `pending` delivery always belongs to an enabled endpoint: disabling an
/// endpoint turns its pending deliveries `disabled`, enqueueing for a
/// disabled endpoint creates `disabled` rows, and a resend or replay for a
/// disabled endpoint is refused. A replay after re-enabling recovers them.
///
/// [`webhook_enqueue`]: WebhookStore::webhook_enqueue
/// [`webhook_claim_due`]: WebhookStore::webhook_claim_due
/// [`webhook_complete`]: WebhookStore::webhook_complete
#[async_trait]
pub trait WebhookStore: Store {
    /// Creates an endpoint. [`StoreError::Conflict`] if the id exists.
    async fn webhook_endpoint_create(&self, endpoint: &WebhookEndpoint) -> Result<(), StoreError>;

    /// One endpoint.
    async fn webhook_endpoint_get(&self, id: &str) -> Result<Option<WebhookEndpoint>, StoreError>;

    /// Every endpoint, oldest first.
    async fn webhook_endpoint_list(&self) -> Result<Vec<WebhookEndpoint>, StoreError>;

    /// Saves an endpoint's URL, description and event types (not its
    /// secrets or state), setting `updated_at` to `now`.
    /// [`StoreError::NotFound`] if there is no such endpoint.
    async fn webhook_endpoint_update(
        &self,
        endpoint: &WebhookEndpoint,
        now: DateTime<Utc>,
    ) -> Result<(), StoreError>;

    /// Rotates an endpoint's secret in one atomic step: `secret` becomes the
    /// newest; the newest of the current secrets keeps signing until
    /// `previous_expires_at` (or its own earlier expiry); every other secret
    /// is dropped, so at most two are ever stored. Returns the endpoint.
    /// [`StoreError::NotFound`] if there is no such endpoint.
    async fn webhook_endpoint_rotate_secret(
        &self,
        id: &str,
        secret: &WebhookSecret,
        previous_expires_at: DateTime<Utc>,
    ) -> Result<WebhookEndpoint, StoreError>;

    /// Disables an endpoint with a reason, and turns its pending deliveries
    /// `disabled` (releasing their leases), atomically. `false` if it was
    /// already disabled (nothing changes). [`StoreError::NotFound`] if there
    /// is no such endpoint.
    async fn webhook_endpoint_disable(
        &self,
        id: &str,
        reason: &str,
        at: DateTime<Utc>,
    ) -> Result<bool, StoreError>;

    /// Enables an endpoint again, clearing its disabled reason and its
    /// failure window. Its `disabled` deliveries stay so until a replay.
    /// `false` if it was enabled. [`StoreError::NotFound`] if there is no
    /// such endpoint.
    async fn webhook_endpoint_enable(
        &self,
        id: &str,
        at: DateTime<Utc>,
    ) -> Result<bool, StoreError>;

    /// Deletes an endpoint with its deliveries and their attempts. `false`
    /// if there was no such endpoint.
    async fn webhook_endpoint_delete(&self, id: &str) -> Result<bool, StoreError>;

    /// Queues `messages` inside the caller's transaction: for each message,
    /// one delivery per endpoint that [subscribes](WebhookEndpoint::subscribes_to)
    /// to its type, due at `now`, `pending` for an enabled endpoint and
    /// `disabled` for a disabled one. A message already queued for an
    /// endpoint (same event id) is skipped, so a redelivered event queues
    /// nothing twice. Returns how many `pending` deliveries were created.
    async fn webhook_enqueue(
        &self,
        tx: &mut Self::Tx,
        messages: &[WebhookMessage],
        now: DateTime<Utc>,
    ) -> Result<u64, StoreError>;

    /// Leases up to `limit` due deliveries (pending, `next_attempt_at <=
    /// now`, not leased or with an expired lease) to `worker` until `now +
    /// lease`, oldest due first, with their endpoints. No endpoint ever has
    /// more than `per_endpoint` deliveries under a live lease, counting
    /// those of every worker: that bounds the concurrency each receiver
    /// sees.
    async fn webhook_claim_due(
        &self,
        worker: &str,
        now: DateTime<Utc>,
        limit: usize,
        per_endpoint: usize,
        lease: Duration,
    ) -> Result<Vec<ClaimedDelivery>, StoreError>;

    /// Records attempts in one transaction: each attempt is added to the
    /// delivery log; its delivery takes the outcome's status, attempt count
    /// and next attempt time and loses its lease, but only while `worker`
    /// still holds it and it is pending (a delivery re-leased by another
    /// worker after this lease expired, or disabled meanwhile, is left as it
    /// is); its endpoint's failure window is updated (a `2xx` ends it, a
    /// failure starts it if it is not running). Returns how many deliveries
    /// were updated.
    async fn webhook_complete(
        &self,
        worker: &str,
        outcomes: &[DeliveryOutcome],
    ) -> Result<u64, StoreError>;

    /// One delivery.
    async fn webhook_delivery_get(&self, id: i64) -> Result<Option<WebhookDelivery>, StoreError>;

    /// Deliveries matching `filter`, newest (highest id) first.
    async fn webhook_delivery_list(
        &self,
        filter: &DeliveryFilter,
    ) -> Result<Vec<WebhookDelivery>, StoreError>;

    /// The attempts of a delivery, oldest first.
    async fn webhook_attempts(&self, delivery_id: i64) -> Result<Vec<DeliveryAttempt>, StoreError>;

    /// Queues one delivery again (manual resend): pending, no attempts, due
    /// at `now`. `false` if it is being attempted right now (live lease) or
    /// its endpoint is disabled. [`StoreError::NotFound`] if there is no
    /// such delivery.
    async fn webhook_resend(
        &self,
        delivery_id: i64,
        now: DateTime<Utc>,
    ) -> Result<bool, StoreError>;

    /// Queues again (like a resend) every delivery of `endpoint_id` queued
    /// in `[from, to)` that failed or was disabled, and also those that
    /// succeeded if `include_succeeded`. Pending ones are left alone.
    /// Returns how many. [`StoreError::NotFound`] if there is no such
    /// endpoint, [`StoreError::Conflict`] if it is disabled.
    async fn webhook_replay(
        &self,
        endpoint_id: &str,
        from: DateTime<Utc>,
        to: DateTime<Utc>,
        include_succeeded: bool,
        now: DateTime<Utc>,
    ) -> Result<u64, StoreError>;

    /// The endpoint's failure window: since when every attempt to it has
    /// failed (`None` while its last attempt succeeded or it had none).
    /// [`StoreError::NotFound`] if there is no such endpoint.
    async fn webhook_failing_since(
        &self,
        endpoint_id: &str,
    ) -> Result<Option<DateTime<Utc>>, StoreError>;

    /// Deletes up to `batch` finished (succeeded, failed or disabled)
    /// deliveries last changed before `before`, with their attempts;
    /// returns how many deliveries.
    async fn webhook_prune(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError>;
}
