//! Dead letters: the messages that could not be applied, with their story,
//! and what an operator does with them.
//!
//! The consumer runtime moves a message here instead of letting it block its
//! partition or retry forever (see [`kind`] for why). [`DeadLetters`] is the
//! operator's side: list and count them by error kind, inspect one with its
//! full error history (attempt, error, time), discard it, or replay it once
//! the cause is fixed.
//!
//! ## Replay is durable, targeted, and deduped
//!
//! A replay writes the original message back to its original topic **through
//! the outbox, in the same transaction that marks the letter replayed**, so
//! a crash can neither lose the replay nor replay twice; the relay publishes
//! it like any other event. [`DeadLetters::replay_many`] writes letters
//! oldest first, so messages with the same key are replayed in their
//! original order.
//!
//! Two ids matter, and a replay treats them differently:
//!
//! - the broker drops a publish whose **message id** it has seen, so a replay
//!   gets a *fresh* message id (the original's would be swallowed as a
//!   duplicate of the first publish);
//! - the inbox dedupes on the **`event-id` header**, so a replay *keeps* the
//!   original event id: if the event was applied after all (a letter
//!   replayed twice, say), the inbox still turns it into a no-op.
//!
//! A replay also carries [`REPLAY_GROUP_HEADER`] naming the group that gave
//! up on it: other groups on the topic already handled the event, so their
//! consumers ack the replay without running anything (their inbox would
//! dedupe it too, for as long as it remembers the event).

use keel_core::{Classify, ErrorClass};

use crate::broker::header;
use crate::outbox::Outbox;
use crate::store::{
    DeadLetter, DeadLetterFilter, DeadLetterStatus, DeadLetterStore, OutboxRecord, OutboxStore,
    StoreError,
};

/// The error kinds the consumer runtime files dead letters under.
///
/// Each is dead-lettered rather than retried because retrying cannot help,
/// and holding it would block every later message with the same key.
pub mod kind {
    /// The payload is not a CloudEvents envelope (or its data does not fit
    /// the handler's type). Dead-lettered at once.
    pub const MALFORMED: &str = "malformed";
    /// No handler for the event type in this group (a producer ahead of its
    /// consumers, or a misrouted event). Dead-lettered at once; replay it
    /// after deploying the handler.
    pub const UNKNOWN_TYPE: &str = "unknown_type";
    /// The handler said the failure is permanent. Dead-lettered at once.
    pub const PERMANENT: &str = "permanent";
    /// Retryable failures (or crashes) on every one of the allowed
    /// deliveries. Dead-lettered with the history of every attempt.
    pub const TOO_MANY_ATTEMPTS: &str = "too_many_attempts";
}

/// The header on a replayed message naming the only group that should
/// process it.
pub const REPLAY_GROUP_HEADER: &str = "keel-replay-group";

/// The header on a replayed message naming the dead letter it came from.
pub const REPLAY_OF_HEADER: &str = "keel-replay-of";

/// The id of the dead letter for `message_id` given up by `group`. The same
/// message dead-lettered twice by the same group (a crash after storing the
/// letter) gets the same id, so it is stored once.
pub(crate) fn letter_id(group: &str, message_id: &str) -> String {
    format!("{group}:{message_id}")
}

/// Operator operations on the dead-letter store. Cheap to clone.
#[derive(Debug, Clone)]
pub struct DeadLetters<S> {
    outbox: Outbox<S>,
}

impl<S> DeadLetters<S>
where
    S: DeadLetterStore + OutboxStore,
{
    /// Dead-letter operations on `store`; replays wake no relay in this
    /// process (it finds them on its next poll). Prefer
    /// [`with_outbox`](Self::with_outbox) when a relay runs here.
    pub fn new(store: S) -> Self {
        Self {
            outbox: Outbox::new(store),
        }
    }

    /// Dead-letter operations whose replays go through `outbox`, waking its
    /// relay on commit.
    pub fn with_outbox(outbox: Outbox<S>) -> Self {
        Self { outbox }
    }

    fn store(&self) -> &S {
        self.outbox.store()
    }

    /// Dead letters matching `filter`, oldest first.
    pub async fn list(&self, filter: &DeadLetterFilter) -> Result<Vec<DeadLetter>, StoreError> {
        self.store().dead_letter_list(filter).await
    }

    /// One dead letter with its whole error history.
    pub async fn inspect(&self, id: &str) -> Result<Option<DeadLetter>, StoreError> {
        self.store().dead_letter_get(id).await
    }

    /// Pending dead letters counted by error kind, most frequent first; also
    /// sets the `keel_dead_letters_pending{kind}` gauges.
    pub async fn counts(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let mut counts = self.store().dead_letter_counts().await?;
        counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        for (kind, n) in &counts {
            metrics::gauge!("keel_dead_letters_pending", "kind" => kind.clone()).set(*n as f64);
        }
        Ok(counts)
    }

    /// Sends one pending dead letter back to its topic (see the [module
    /// docs](self)).
    pub async fn replay(&self, id: &str) -> Result<(), DeadLetterError> {
        let letter = self.pending(id).await?;
        let replayed = self.replay_letters(std::slice::from_ref(&letter)).await?;
        if replayed == 0 {
            return Err(DeadLetterError::NotPending {
                id: id.to_owned(),
                status: DeadLetterStatus::Replayed,
            });
        }
        Ok(())
    }

    /// Sends the pending dead letters matching `filter` (its status is
    /// ignored) back to their topics, oldest first, in one transaction.
    /// Returns how many it replayed: at most the filter's limit (default
    /// 100), so call it again until it returns 0.
    pub async fn replay_many(&self, filter: &DeadLetterFilter) -> Result<usize, DeadLetterError> {
        let filter = DeadLetterFilter {
            status: Some(DeadLetterStatus::Pending),
            ..filter.clone()
        };
        let mut letters = self.store().dead_letter_list(&filter).await?;
        // Oldest first keeps each key's original order.
        letters.sort_by_key(|l| l.dead_at);
        self.replay_letters(&letters).await
    }

    /// Throws a pending dead letter away on purpose.
    pub async fn discard(&self, id: &str) -> Result<(), DeadLetterError> {
        let letter = self.pending(id).await?;
        let store = self.store();
        let mut tx = store.begin().await?;
        let settled = store
            .dead_letter_settle(&mut tx, id, DeadLetterStatus::Discarded)
            .await?;
        store.commit(tx).await?;
        if !settled {
            return Err(DeadLetterError::NotPending {
                id: id.to_owned(),
                status: DeadLetterStatus::Replayed,
            });
        }
        tracing::info!(letter = id, kind = %letter.error_kind, "dead letter discarded");
        metrics::counter!("keel_dead_letters_discarded_total", "kind" => letter.error_kind)
            .increment(1);
        Ok(())
    }

    async fn pending(&self, id: &str) -> Result<DeadLetter, DeadLetterError> {
        let letter = self
            .store()
            .dead_letter_get(id)
            .await?
            .ok_or_else(|| DeadLetterError::NotFound(id.to_owned()))?;
        if letter.status != DeadLetterStatus::Pending {
            return Err(DeadLetterError::NotPending {
                id: id.to_owned(),
                status: letter.status,
            });
        }
        Ok(letter)
    }

    /// Settles each letter as replayed and appends its replay to the outbox,
    /// all in one transaction; letters someone else settled meanwhile are
    /// skipped. Returns how many were replayed.
    async fn replay_letters(&self, letters: &[DeadLetter]) -> Result<usize, DeadLetterError> {
        if letters.is_empty() {
            return Ok(0);
        }
        let store = self.store();
        let mut tx = store.begin().await?;
        let mut replayed = Vec::with_capacity(letters.len());
        for letter in letters {
            if store
                .dead_letter_settle(&mut tx, &letter.id, DeadLetterStatus::Replayed)
                .await?
            {
                let record = replay_record(letter);
                store
                    .outbox_append(&mut tx, std::slice::from_ref(&record))
                    .await?;
                replayed.push((letter, record.event_id));
            }
        }
        self.outbox.commit(tx).await?;
        for (letter, message_id) in &replayed {
            tracing::info!(letter = %letter.id, kind = %letter.error_kind, topic = %letter.message.topic,
                key = %letter.message.key, %message_id, "dead letter replayed");
            metrics::counter!("keel_dead_letters_replayed_total",
                "kind" => letter.error_kind.clone())
            .increment(1);
        }
        Ok(replayed.len())
    }
}

/// The outbox record that replays `letter`: the original topic, key,
/// headers and payload, a fresh message id, the original `event-id` header,
/// and the replay headers.
pub fn replay_record(letter: &DeadLetter) -> OutboxRecord {
    let original = &letter.message;
    let mut headers = original.headers.clone();
    headers
        .entry(header::EVENT_ID.to_owned())
        .or_insert_with(|| original.id.clone());
    headers.insert(REPLAY_GROUP_HEADER.to_owned(), letter.group.clone());
    headers.insert(REPLAY_OF_HEADER.to_owned(), letter.id.clone());
    OutboxRecord {
        event_id: keel_core::id::new_id().to_string(),
        topic: original.topic.clone(),
        partition_key: original.key.clone(),
        headers,
        payload: original.payload.clone(),
    }
}

/// A dead-letter operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeadLetterError {
    /// No dead letter has this id.
    #[error("no dead letter with id `{0}`")]
    NotFound(String),
    /// The letter was already replayed or discarded (perhaps by another
    /// operator just now).
    #[error("dead letter `{id}` is already {}; only pending letters can be replayed or discarded", .status.as_str())]
    NotPending {
        /// The letter.
        id: String,
        /// What became of it.
        status: DeadLetterStatus,
    },
    /// The store failed; nothing was changed.
    #[error("dead-letter store error: {0}")]
    Store(#[from] StoreError),
}

impl Classify for DeadLetterError {
    fn class(&self) -> ErrorClass {
        match self {
            Self::Store(e) => e.class(),
            Self::NotFound(_) | Self::NotPending { .. } => ErrorClass::Permanent,
        }
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::broker::Message;
    use crate::consumer::testing::MemStore;

    fn letter(id: &str, message: Message, dead_secs_ago: i64) -> DeadLetter {
        DeadLetter {
            id: id.to_owned(),
            message,
            group: "billing".into(),
            error_kind: kind::PERMANENT.into(),
            attempts: Vec::new(),
            dead_at: keel_core::clock::utc_now() - chrono::Duration::seconds(dead_secs_ago),
            status: DeadLetterStatus::Pending,
        }
    }

    #[test]
    fn a_replay_gets_a_fresh_message_id_and_keeps_the_event_id() {
        let original = Message::new("evt-1", "orders", "A-1", "{}");
        let record = replay_record(&letter("billing:evt-1", original.clone(), 0));
        assert_ne!(record.event_id, "evt-1", "the broker would drop the old id");
        let msg = record.to_message();
        assert_eq!(
            msg.header(header::EVENT_ID),
            Some("evt-1"),
            "the inbox dedupes on it"
        );
        assert_eq!(msg.header(REPLAY_GROUP_HEADER), Some("billing"));
        assert_eq!(msg.header(REPLAY_OF_HEADER), Some("billing:evt-1"));
        assert_eq!(
            (msg.topic, msg.key, msg.payload),
            (original.topic, original.key, original.payload)
        );

        // A message without the header (published by hand): its id is the event id.
        let mut bare = Message::new("evt-2", "orders", "A-1", "{}");
        bare.headers.clear();
        let msg = replay_record(&letter("billing:evt-2", bare, 0)).to_message();
        assert_eq!(msg.header(header::EVENT_ID), Some("evt-2"));
    }

    #[tokio::test]
    async fn replay_many_writes_the_oldest_first_and_settles_in_the_same_transaction() {
        let store = MemStore::default();
        for (id, age) in [("b", 10), ("a", 30), ("c", 5)] {
            let msg = Message::new(format!("evt-{id}"), "orders", "K", "{}");
            store.dead_letter_put(&letter(id, msg, age)).await.unwrap();
        }
        let letters = DeadLetters::new(store.clone());
        assert_eq!(
            letters
                .replay_many(&DeadLetterFilter::default())
                .await
                .unwrap(),
            3
        );
        let claimed = store
            .outbox_claim("test", 10, std::time::Duration::from_secs(1))
            .await
            .unwrap();
        let order: Vec<_> = claimed
            .iter()
            .map(|p| p.record.headers[REPLAY_OF_HEADER].clone())
            .collect();
        assert_eq!(order, ["a", "b", "c"], "oldest first keeps the key's order");
        assert!(
            store
                .letters()
                .iter()
                .all(|l| l.status == DeadLetterStatus::Replayed)
        );
        assert_eq!(letters.counts().await.unwrap(), []);
        assert!(matches!(
            letters.discard("a").await,
            Err(DeadLetterError::NotPending {
                status: DeadLetterStatus::Replayed,
                ..
            })
        ));
    }
}
