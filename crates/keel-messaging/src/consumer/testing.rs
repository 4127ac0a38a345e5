//! In-memory Store and Broker for this crate's unit tests (the real backends
//! live in keel-sqlite, whose integration tests run the same scenarios).
//! Time is tokio's, so tests can pause it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use keel_core::clock::{self, Instant};
use parking_lot::Mutex;

use crate::broker::{
    Broker, BrokerError, Delivery, DeliveryControl, Message, SubscribeOptions, Subscription,
};
use crate::store::{
    AttemptError, DeadLetter, DeadLetterFilter, DeadLetterStatus, DeadLetterStore, InboxStore,
    OutboxRecord, OutboxStats, OutboxStore, ParkedFilter, ParkedOutbox, PendingOutbox, Store,
    StoreError,
};

// ---------------------------------------------------------------- store --

#[derive(Debug)]
struct Row {
    id: i64,
    record: OutboxRecord,
    created_at: DateTime<Utc>,
    published_at: Option<DateTime<Utc>>,
    claim: Option<(String, Instant)>,
    attempts: u32,
    last_error: Option<String>,
    parked_at: Option<DateTime<Utc>>,
}

impl Row {
    fn parked(&self, rows: &[Row]) -> ParkedOutbox {
        ParkedOutbox {
            id: self.id,
            record: self.record.clone(),
            created_at: self.created_at,
            parked_at: self.parked_at.unwrap_or(self.created_at),
            attempts: self.attempts,
            last_error: self.last_error.clone().unwrap_or_default(),
            held_back: rows
                .iter()
                .filter(|r| {
                    r.published_at.is_none()
                        && r.id > self.id
                        && r.record.partition_key == self.record.partition_key
                })
                .count() as u64,
        }
    }
}

#[derive(Debug, Default)]
struct StoreState {
    next_id: i64,
    outbox: Vec<Row>,
    inbox: HashSet<(String, String)>,
    letters: Vec<DeadLetter>,
    failures: HashMap<(String, String), Vec<AttemptError>>,
    ledger: Vec<String>,
    prune_calls: usize,
}

/// A store whose transactions buffer writes until commit.
#[derive(Debug, Clone, Default)]
pub(crate) struct MemStore {
    state: Arc<Mutex<StoreState>>,
}

/// A buffered transaction. Handlers push their effect into `effects`; it
/// reaches the ledger only on commit.
#[derive(Debug, Default)]
pub(crate) struct MemTx {
    pub(crate) effects: Vec<String>,
    outbox: Vec<OutboxRecord>,
    inbox: Vec<(String, String)>,
    settle: Vec<(String, DeadLetterStatus)>,
}

impl MemStore {
    /// Every effect committed so far, in commit order.
    pub(crate) fn ledger(&self) -> Vec<String> {
        self.state.lock().ledger.clone()
    }

    pub(crate) fn unpublished(&self) -> usize {
        self.state
            .lock()
            .outbox
            .iter()
            .filter(|r| r.published_at.is_none() && r.parked_at.is_none())
            .count()
    }

    /// Each outbox row's failed attempts, by event id.
    pub(crate) fn attempts(&self, event_id: &str) -> Option<u32> {
        self.state
            .lock()
            .outbox
            .iter()
            .find(|r| r.record.event_id == event_id)
            .map(|r| r.attempts)
    }

    pub(crate) fn outbox_len(&self) -> usize {
        self.state.lock().outbox.len()
    }

    pub(crate) fn prune_calls(&self) -> usize {
        self.state.lock().prune_calls
    }

    /// Pretends every published row was published `age` ago.
    pub(crate) fn age_published(&self, age: chrono::Duration) {
        for row in &mut self.state.lock().outbox {
            if let Some(at) = &mut row.published_at {
                *at -= age;
            }
        }
    }

    pub(crate) fn letters(&self) -> Vec<DeadLetter> {
        self.state.lock().letters.clone()
    }
}

#[async_trait]
impl Store for MemStore {
    type Tx = MemTx;

    async fn begin(&self) -> Result<MemTx, StoreError> {
        Ok(MemTx::default())
    }

    async fn commit(&self, tx: MemTx) -> Result<(), StoreError> {
        let mut s = self.state.lock();
        if tx.inbox.iter().any(|k| s.inbox.contains(k)) {
            return Err(StoreError::Conflict("inbox row exists".into()));
        }
        for (id, _) in &tx.settle {
            let pending = s
                .letters
                .iter()
                .any(|l| &l.id == id && l.status == DeadLetterStatus::Pending);
            if !pending {
                return Err(StoreError::Conflict(format!("letter {id} settled")));
            }
        }
        s.inbox.extend(tx.inbox);
        s.ledger.extend(tx.effects);
        for (id, status) in tx.settle {
            if let Some(l) = s.letters.iter_mut().find(|l| l.id == id) {
                l.status = status;
            }
        }
        for record in tx.outbox {
            s.next_id += 1;
            let id = s.next_id;
            s.outbox.push(Row {
                id,
                record,
                created_at: keel_core::clock::utc_now(),
                published_at: None,
                claim: None,
                attempts: 0,
                last_error: None,
                parked_at: None,
            });
        }
        Ok(())
    }

    async fn rollback(&self, _tx: MemTx) -> Result<(), StoreError> {
        Ok(())
    }

    async fn ready(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

#[async_trait]
impl OutboxStore for MemStore {
    async fn outbox_append(
        &self,
        tx: &mut MemTx,
        records: &[OutboxRecord],
    ) -> Result<(), StoreError> {
        tx.outbox.extend_from_slice(records);
        Ok(())
    }

    async fn outbox_claim(
        &self,
        relay: &str,
        limit: usize,
        lease: Duration,
    ) -> Result<Vec<PendingOutbox>, StoreError> {
        let now = clock::now();
        let mut s = self.state.lock();
        let mut blocked = HashSet::new();
        let mut out = Vec::new();
        for row in s.outbox.iter_mut().filter(|r| r.published_at.is_none()) {
            let key = row.record.partition_key.clone();
            let held_by_other = row
                .claim
                .as_ref()
                .is_some_and(|(who, until)| who != relay && *until > now);
            if held_by_other || row.parked_at.is_some() {
                blocked.insert(key);
                continue;
            }
            if blocked.contains(&key) || out.len() >= limit {
                continue;
            }
            row.claim = Some((relay.to_owned(), now + lease));
            out.push(PendingOutbox {
                id: row.id,
                record: row.record.clone(),
                created_at: row.created_at,
                attempts: row.attempts,
            });
        }
        Ok(out)
    }

    async fn outbox_mark_published(&self, ids: &[i64]) -> Result<(), StoreError> {
        let mut s = self.state.lock();
        for row in s.outbox.iter_mut().filter(|r| ids.contains(&r.id)) {
            row.published_at = Some(keel_core::clock::utc_now());
            row.claim = None;
        }
        Ok(())
    }

    async fn outbox_release(&self, ids: &[i64]) -> Result<(), StoreError> {
        let mut s = self.state.lock();
        for row in s.outbox.iter_mut().filter(|r| ids.contains(&r.id)) {
            row.claim = None;
        }
        Ok(())
    }

    async fn outbox_prune(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError> {
        let mut s = self.state.lock();
        s.prune_calls += 1;
        let doomed: Vec<i64> = s
            .outbox
            .iter()
            .filter(|r| r.published_at.is_some_and(|at| at < before))
            .take(batch)
            .map(|r| r.id)
            .collect();
        s.outbox.retain(|r| !doomed.contains(&r.id));
        Ok(doomed.len() as u64)
    }

    async fn outbox_stats(&self) -> Result<OutboxStats, StoreError> {
        let s = self.state.lock();
        let pending: Vec<_> = s
            .outbox
            .iter()
            .filter(|r| r.published_at.is_none() && r.parked_at.is_none())
            .collect();
        Ok(OutboxStats {
            unpublished: pending.len() as u64,
            oldest_unpublished_age: pending
                .first()
                .and_then(|r| (keel_core::clock::utc_now() - r.created_at).to_std().ok()),
            parked: s.outbox.iter().filter(|r| r.parked_at.is_some()).count() as u64,
        })
    }

    async fn outbox_release_failed(&self, ids: &[i64], error: &str) -> Result<(), StoreError> {
        let mut s = self.state.lock();
        for row in s
            .outbox
            .iter_mut()
            .filter(|r| ids.contains(&r.id) && r.published_at.is_none())
        {
            row.claim = None;
            row.attempts += 1;
            row.last_error = Some(error.to_owned());
        }
        Ok(())
    }

    async fn outbox_park(&self, id: i64, error: &str) -> Result<bool, StoreError> {
        let mut s = self.state.lock();
        let Some(row) = s
            .outbox
            .iter_mut()
            .find(|r| r.id == id && r.published_at.is_none() && r.parked_at.is_none())
        else {
            return Ok(false);
        };
        row.claim = None;
        row.attempts += 1;
        row.last_error = Some(error.to_owned());
        row.parked_at = Some(keel_core::clock::utc_now());
        Ok(true)
    }

    async fn outbox_parked(&self, filter: &ParkedFilter) -> Result<Vec<ParkedOutbox>, StoreError> {
        let s = self.state.lock();
        Ok(s.outbox
            .iter()
            .filter(|r| r.parked_at.is_some() && r.published_at.is_none())
            .filter(|r| filter.topic.as_ref().is_none_or(|t| *t == r.record.topic))
            .take(filter.limit.unwrap_or(100))
            .map(|r| r.parked(&s.outbox))
            .collect())
    }

    async fn outbox_parked_get(&self, id: i64) -> Result<Option<ParkedOutbox>, StoreError> {
        let s = self.state.lock();
        Ok(s.outbox
            .iter()
            .find(|r| r.id == id && r.parked_at.is_some() && r.published_at.is_none())
            .map(|r| r.parked(&s.outbox)))
    }

    async fn outbox_unpark(&self, id: i64) -> Result<bool, StoreError> {
        let mut s = self.state.lock();
        let Some(row) = s
            .outbox
            .iter_mut()
            .find(|r| r.id == id && r.parked_at.is_some() && r.published_at.is_none())
        else {
            return Ok(false);
        };
        row.parked_at = None;
        row.attempts = 0;
        row.last_error = None;
        Ok(true)
    }

    async fn outbox_discard(&self, id: i64) -> Result<bool, StoreError> {
        let mut s = self.state.lock();
        let before = s.outbox.len();
        s.outbox
            .retain(|r| !(r.id == id && r.parked_at.is_some() && r.published_at.is_none()));
        Ok(s.outbox.len() < before)
    }
}

#[async_trait]
impl InboxStore for MemStore {
    async fn inbox_record(
        &self,
        tx: &mut MemTx,
        event_id: &str,
        handler: &str,
    ) -> Result<bool, StoreError> {
        let key = (event_id.to_owned(), handler.to_owned());
        if self.state.lock().inbox.contains(&key) || tx.inbox.contains(&key) {
            return Ok(false);
        }
        tx.inbox.push(key);
        Ok(true)
    }

    async fn inbox_prune(&self, _before: DateTime<Utc>, _batch: usize) -> Result<u64, StoreError> {
        Ok(0)
    }
}

#[async_trait]
impl DeadLetterStore for MemStore {
    async fn dead_letter_put(&self, letter: &DeadLetter) -> Result<(), StoreError> {
        let mut s = self.state.lock();
        if s.letters.iter().any(|l| l.id == letter.id) {
            return Err(StoreError::Conflict(letter.id.clone()));
        }
        s.letters.push(letter.clone());
        Ok(())
    }

    async fn dead_letter_list(
        &self,
        filter: &DeadLetterFilter,
    ) -> Result<Vec<DeadLetter>, StoreError> {
        let s = self.state.lock();
        Ok(s.letters
            .iter()
            .filter(|l| filter.topic.as_ref().is_none_or(|t| &l.message.topic == t))
            .filter(|l| {
                filter
                    .error_kind
                    .as_ref()
                    .is_none_or(|k| &l.error_kind == k)
            })
            .filter(|l| filter.status.is_none_or(|st| l.status == st))
            .take(filter.limit.unwrap_or(100))
            .cloned()
            .collect())
    }

    async fn dead_letter_get(&self, id: &str) -> Result<Option<DeadLetter>, StoreError> {
        Ok(self
            .state
            .lock()
            .letters
            .iter()
            .find(|l| l.id == id)
            .cloned())
    }

    async fn dead_letter_settle(
        &self,
        tx: &mut MemTx,
        id: &str,
        status: DeadLetterStatus,
    ) -> Result<bool, StoreError> {
        let pending = self
            .state
            .lock()
            .letters
            .iter()
            .any(|l| l.id == id && l.status == DeadLetterStatus::Pending);
        if !pending || tx.settle.iter().any(|(i, _)| i == id) {
            return Ok(false);
        }
        tx.settle.push((id.to_owned(), status));
        Ok(true)
    }

    async fn dead_letter_counts(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let mut counts: HashMap<String, u64> = HashMap::new();
        for l in &self.state.lock().letters {
            if l.status == DeadLetterStatus::Pending {
                *counts.entry(l.error_kind.clone()).or_default() += 1;
            }
        }
        Ok(counts.into_iter().collect())
    }

    async fn failure_record(
        &self,
        group: &str,
        message_id: &str,
        failure: &AttemptError,
    ) -> Result<(), StoreError> {
        self.state
            .lock()
            .failures
            .entry((group.to_owned(), message_id.to_owned()))
            .or_default()
            .push(failure.clone());
        Ok(())
    }

    async fn failure_history(
        &self,
        group: &str,
        message_id: &str,
    ) -> Result<Vec<AttemptError>, StoreError> {
        Ok(self
            .state
            .lock()
            .failures
            .get(&(group.to_owned(), message_id.to_owned()))
            .cloned()
            .unwrap_or_default())
    }

    async fn failure_clear(&self, group: &str, message_id: &str) -> Result<(), StoreError> {
        self.state
            .lock()
            .failures
            .remove(&(group.to_owned(), message_id.to_owned()));
        Ok(())
    }
}

// --------------------------------------------------------------- broker --

#[derive(Debug, Clone)]
struct Entry {
    visible_at: Instant,
    lease: Option<(u64, Instant)>,
    count: u32,
    done: bool,
}

#[derive(Debug, Default)]
struct BrokerState {
    logs: HashMap<String, Vec<Message>>,
    seen: HashSet<(String, String)>,
    groups: HashMap<(String, String), (Duration, Vec<Entry>)>,
    publish_calls: HashMap<String, u32>,
    batches: u32,
    next_token: u64,
}

/// A broker with per-key order, leases and redelivery, on tokio's clock.
#[derive(Debug, Clone, Default)]
pub(crate) struct MemBroker {
    state: Arc<Mutex<BrokerState>>,
    fail_publishes: Arc<AtomicU32>,
    refuse: Arc<Mutex<Refusals>>,
}

/// What a [`MemBroker`] refuses for good.
#[derive(Debug, Default)]
struct Refusals {
    /// In `publish`: a batch holding one of these keys is refused whole
    /// (nothing after the refused message is stored).
    keys_on_publish: HashSet<String>,
    /// In `validate` (and so in `publish` too).
    keys_on_validate: HashSet<String>,
}

impl MemBroker {
    /// Every message with `key` is refused by `publish` (not by
    /// `validate`) with `Invalid`, like a broker that finds out only when
    /// it tries; the messages before it in the batch are stored.
    pub(crate) fn refuse_key_on_publish(&self, key: &str) {
        self.refuse.lock().keys_on_publish.insert(key.to_owned());
    }

    /// Every message with `key` is refused by `validate` with `Invalid`.
    pub(crate) fn refuse_key_on_validate(&self, key: &str) {
        self.refuse.lock().keys_on_validate.insert(key.to_owned());
    }

    /// Refuses nothing any more.
    pub(crate) fn allow_all(&self) {
        let mut refuse = self.refuse.lock();
        refuse.keys_on_publish.clear();
        refuse.keys_on_validate.clear();
    }

    /// How many publish calls were made, batches and single rows alike.
    pub(crate) fn publish_batches(&self) -> u32 {
        self.state.lock().batches
    }

    /// The next `n` publish calls fail with `Unavailable`.
    pub(crate) fn fail_next_publishes(&self, n: u32) {
        self.fail_publishes.store(n, Ordering::SeqCst);
    }

    /// How many times a message id was passed to `publish` (dupes included).
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    pub(crate) fn publish_calls(&self, id: &str) -> u32 {
        self.state
            .lock()
            .publish_calls
            .get(id)
            .copied()
            .unwrap_or(0)
    }

    /// The messages stored on `topic`, in order.
    pub(crate) fn log(&self, topic: &str) -> Vec<Message> {
        self.state
            .lock()
            .logs
            .get(topic)
            .cloned()
            .unwrap_or_default()
    }

    /// Delivery counts of `topic`'s messages for `group`, in log order.
    pub(crate) fn delivery_counts(&self, topic: &str, group: &str) -> Vec<u32> {
        self.state
            .lock()
            .groups
            .get(&(topic.to_owned(), group.to_owned()))
            .map(|(_, e)| e.iter().map(|e| e.count).collect())
            .unwrap_or_default()
    }

    /// Whether every message on `topic` is settled for `group`.
    pub(crate) fn all_done(&self, topic: &str, group: &str) -> bool {
        let s = self.state.lock();
        let len = s.logs.get(topic).map_or(0, Vec::len);
        s.groups
            .get(&(topic.to_owned(), group.to_owned()))
            .is_some_and(|(_, e)| e.len() == len && e.iter().all(|e| e.done))
    }
}

#[async_trait]
impl Broker for MemBroker {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        let failing = self
            .fail_publishes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if failing {
            return Err(BrokerError::Unavailable("injected publish failure".into()));
        }
        let mut s = self.state.lock();
        s.batches += 1;
        for m in messages {
            self.validate(m)?;
            if self.refuse.lock().keys_on_publish.contains(&m.key) {
                return Err(BrokerError::Invalid(format!("key {:?} refused", m.key)));
            }
            *s.publish_calls.entry(m.id.clone()).or_default() += 1;
            if s.seen.insert((m.topic.clone(), m.id.clone())) {
                s.logs.entry(m.topic.clone()).or_default().push(m.clone());
            }
        }
        Ok(())
    }

    fn validate(&self, message: &Message) -> Result<(), BrokerError> {
        if self.refuse.lock().keys_on_validate.contains(&message.key) {
            return Err(BrokerError::Invalid(format!(
                "key {:?} can never be published",
                message.key
            )));
        }
        Ok(())
    }

    async fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        self.state
            .lock()
            .groups
            .entry((options.topic.clone(), options.group.clone()))
            .or_insert_with(|| (options.lease, Vec::new()));
        Ok(Box::new(MemSubscription {
            state: Arc::clone(&self.state),
            topic: options.topic,
            group: options.group,
        }))
    }
}

struct MemSubscription {
    state: Arc<Mutex<BrokerState>>,
    topic: String,
    group: String,
}

impl MemSubscription {
    fn take(&self, max: usize) -> Vec<Delivery> {
        let now = clock::now();
        let mut s = self.state.lock();
        let log = s.logs.get(&self.topic).cloned().unwrap_or_default();
        let mut token = s.next_token;
        let Some((lease, entries)) = s.groups.get_mut(&(self.topic.clone(), self.group.clone()))
        else {
            return Vec::new();
        };
        while entries.len() < log.len() {
            entries.push(Entry {
                visible_at: now,
                lease: None,
                count: 0,
                done: false,
            });
        }
        let mut blocked = HashSet::new();
        let mut out = Vec::new();
        for (index, (entry, msg)) in entries.iter_mut().zip(&log).enumerate() {
            if entry.done || !blocked.insert(msg.key.clone()) {
                continue;
            }
            let free = entry.lease.is_none_or(|(_, until)| until <= now);
            if out.len() < max && free && entry.visible_at <= now {
                token += 1;
                entry.lease = Some((token, now + *lease));
                entry.count += 1;
                let control = MemControl {
                    state: Arc::clone(&self.state),
                    key: (self.topic.clone(), self.group.clone()),
                    index,
                    token,
                };
                out.push(Delivery::new(msg.clone(), entry.count, Box::new(control)));
            }
        }
        s.next_token = token;
        out
    }
}

#[async_trait]
impl Subscription for MemSubscription {
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>, BrokerError> {
        let until = clock::now() + wait;
        loop {
            let batch = self.take(max);
            if !batch.is_empty() || clock::now() >= until {
                return Ok(batch);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

struct MemControl {
    state: Arc<Mutex<BrokerState>>,
    key: (String, String),
    index: usize,
    token: u64,
}

impl MemControl {
    fn with_entry(&self, f: impl FnOnce(&mut Entry, Duration, Instant)) -> Result<(), BrokerError> {
        let mut s = self.state.lock();
        let (lease, entries) = s.groups.get_mut(&self.key).ok_or(BrokerError::LeaseLost)?;
        let entry = &mut entries[self.index];
        if entry.done || entry.lease.map(|(t, _)| t) != Some(self.token) {
            return Err(BrokerError::LeaseLost);
        }
        f(entry, *lease, clock::now());
        Ok(())
    }
}

#[async_trait]
impl DeliveryControl for MemControl {
    async fn ack(&self) -> Result<(), BrokerError> {
        self.with_entry(|e, _, _| e.done = true)
    }

    async fn nack(&self, delay: Duration) -> Result<(), BrokerError> {
        self.with_entry(|e, _, now| {
            e.lease = None;
            e.visible_at = now + delay;
        })
    }

    async fn extend(&self, lease: Duration) -> Result<(), BrokerError> {
        self.with_entry(|e, _, now| {
            if let Some((token, _)) = e.lease {
                e.lease = Some((token, now + lease));
            }
        })
    }

    async fn terminate(&self) -> Result<(), BrokerError> {
        self.with_entry(|e, _, _| e.done = true)
    }
}
