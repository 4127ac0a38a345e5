//! The resumable per-user event log: append in the business transaction,
//! wake subscribers after the commit, read after a cursor.
//!
//! An event is appended with the rows it announces, in one transaction, so
//! a client never hears about an order that then rolls back, and never
//! misses one that commits. Subscribers are woken *after* the commit
//! ([`EventLog::commit`] does both), because a wake-up before it would send
//! a reader to the log too early.

use std::sync::Arc;

use keel_store::StoreError;
use keel_store::{EventLogStore, LoggedEvent};

use super::notifier::{LocalNotifier, Notifier, Subscription};
use super::stream::StreamId;

/// The longest event type accepted, in bytes.
pub const MAX_EVENT_TYPE_LEN: usize = 128;

/// An appended event whose transaction has not been committed yet. Hand it
/// to [`EventLog::commit`] (or to [`EventLog::notify`] after committing
/// yourself), or subscribers only learn of it at their next wake-up.
#[derive(Debug, Clone, PartialEq, Eq)]
#[must_use = "notify subscribers after the commit: EventLog::commit(tx, [appended])"]
pub struct Appended {
    stream: StreamId,
    seq: i64,
}

impl Appended {
    /// The stream appended to.
    pub fn stream(&self) -> &StreamId {
        &self.stream
    }

    /// The event's seq.
    pub fn seq(&self) -> i64 {
        self.seq
    }
}

/// An event could not be appended.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AppendError {
    /// The event type would break the SSE framing or is unreasonably long.
    #[error(
        "invalid event type {0:?}: use 1 to {MAX_EVENT_TYPE_LEN} bytes without control \
         characters (e.g. `order.shipped`)"
    )]
    InvalidEventType(String),
    /// The store failed; see [`StoreError`] for whether to retry.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Per-stream event logs over an [`EventLogStore`], with a [`Notifier`] that
/// wakes the connections waiting on a stream. Cheap to clone.
///
/// ```
/// use keel_realtime::{EventLog, StreamId};
/// use keel_store::Store;
/// use keel_sqlite::SqliteStore;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
/// let store = SqliteStore::open_in_memory().await?;
/// let log = EventLog::new(store.clone());
/// let alice = StreamId::new("user:alice")?;
///
/// // In the business transaction: the order row (not shown) and its event.
/// let mut tx = store.begin().await?;
/// let placed = log
///     .append(&mut tx, &alice, "order.placed", &serde_json::json!({ "orderId": "A-4471" }))
///     .await?;
/// log.commit(tx, [placed]).await?; // commits, then wakes alice's connections
///
/// let events = log.read_after(&alice, 0, 100).await?;
/// assert_eq!(events[0].seq, 1);
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct EventLog<S> {
    store: S,
    notifier: Arc<dyn Notifier>,
}

impl<S: Clone> Clone for EventLog<S> {
    fn clone(&self) -> Self {
        Self {
            store: self.store.clone(),
            notifier: Arc::clone(&self.notifier),
        }
    }
}

impl<S: EventLogStore> EventLog<S> {
    /// A log on `store` with an in-process [`LocalNotifier`].
    pub fn new(store: S) -> Self {
        Self::with_notifier(store, Arc::new(LocalNotifier::new()))
    }

    /// A log on `store` with another notifier (a cross-node backplane).
    pub fn with_notifier(store: S, notifier: Arc<dyn Notifier>) -> Self {
        Self { store, notifier }
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// The notifier.
    pub fn notifier(&self) -> &Arc<dyn Notifier> {
        &self.notifier
    }

    /// Appends an event to `stream` inside the caller's transaction.
    pub async fn append(
        &self,
        tx: &mut S::Tx,
        stream: &StreamId,
        event_type: &str,
        data: &serde_json::Value,
    ) -> Result<Appended, AppendError> {
        if event_type.is_empty()
            || event_type.len() > MAX_EVENT_TYPE_LEN
            || event_type.chars().any(char::is_control)
        {
            return Err(AppendError::InvalidEventType(
                event_type.chars().take(MAX_EVENT_TYPE_LEN).collect(),
            ));
        }
        let seq = self
            .store
            .event_log_append(tx, stream.as_str(), event_type, data)
            .await?;
        Ok(Appended {
            stream: stream.clone(),
            seq,
        })
    }

    /// Commits `tx`, then wakes the subscribers of the `appended` events.
    /// If the commit's outcome is unknown they are woken anyway: a reader
    /// woken for nothing finds nothing, which is harmless.
    pub async fn commit(
        &self,
        tx: S::Tx,
        appended: impl IntoIterator<Item = Appended> + Send,
    ) -> Result<(), StoreError> {
        let result = self.store.commit(tx).await;
        if matches!(result, Ok(()) | Err(StoreError::OutcomeUnknown(_))) {
            for event in appended {
                self.notify(&event);
            }
        }
        result
    }

    /// Wakes the subscribers of an event's stream (call it after the commit).
    pub fn notify(&self, appended: &Appended) {
        self.notifier.notify(&appended.stream, appended.seq);
    }

    /// Appends one event in a transaction of its own, commits and notifies;
    /// returns its seq.
    pub async fn publish(
        &self,
        stream: &StreamId,
        event_type: &str,
        data: &serde_json::Value,
    ) -> Result<i64, AppendError> {
        let mut tx = self.store.begin().await?;
        let appended = self.append(&mut tx, stream, event_type, data).await?;
        let seq = appended.seq;
        self.commit(tx, [appended]).await?;
        Ok(seq)
    }

    /// Up to `limit` events of `stream` after seq `after`, oldest first.
    pub async fn read_after(
        &self,
        stream: &StreamId,
        after: i64,
        limit: usize,
    ) -> Result<Vec<LoggedEvent>, StoreError> {
        self.store
            .event_log_read_after(stream.as_str(), after, limit)
            .await
    }

    /// The last seq appended to `stream` (0 if none).
    pub async fn last_seq(&self, stream: &StreamId) -> Result<i64, StoreError> {
        self.store.event_log_last_seq(stream.as_str()).await
    }

    /// Starts watching `stream` (see [`Notifier::subscribe`]).
    pub fn subscribe(&self, stream: &StreamId) -> Subscription {
        self.notifier.subscribe(stream)
    }
}
