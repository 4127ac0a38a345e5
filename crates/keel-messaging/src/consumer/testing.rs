//! In-memory Store and Broker for this crate's unit tests, checked by the
//! same conformance suites as the real backends (below, and in
//! `broker.rs`); the runtime's integration tests in `tests/` run the same
//! scenarios on SQLite, PostgreSQL and NATS. Time is tokio's, so tests can
//! pause it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use keel_core::clock::{self, Instant};
use parking_lot::Mutex;

use crate::store::{
    AttemptError, DeadLetter, DeadLetterFilter, DeadLetterStatus, DeadLetterStore, InboxStore,
    OutboxAdminStore, OutboxRecord, OutboxStats, OutboxStore, ParkedFilter, ParkedOutbox,
    PendingOutbox, PublishedOutbox, Store, StoreError,
};

mod broker;

pub(crate) use broker::MemBroker;

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

/// Whether `row` is one of `ids`, unpublished and still claimed by `relay`.
fn claimed_by(row: &Row, relay: &str, ids: &[i64]) -> bool {
    ids.contains(&row.id)
        && row.published_at.is_none()
        && row.claim.as_ref().is_some_and(|(by, _)| by == relay)
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
    /// Each inbox row, with when it was committed.
    inbox: HashMap<(String, String), DateTime<Utc>>,
    letters: Vec<DeadLetter>,
    failures: HashMap<(String, String), Vec<AttemptError>>,
    ledger: Vec<String>,
    prune_calls: usize,
    rollbacks: usize,
    /// Rollbacks still to fail (a batch that did not commit what they read).
    failing_rollbacks: usize,
    failure_clears: usize,
    refuse_failure_records: bool,
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

    /// Adds `n` inbox rows for `handler`, committed at `at`.
    pub(crate) fn add_inbox_rows(&self, handler: &str, n: usize, at: DateTime<Utc>) {
        let mut s = self.state.lock();
        let first = s.inbox.len();
        s.inbox
            .extend((first..first + n).map(|i| ((format!("event-{i}"), handler.to_owned()), at)));
    }

    pub(crate) fn inbox_len(&self) -> usize {
        self.state.lock().inbox.len()
    }

    /// Transactions rolled back explicitly (not just dropped).
    pub(crate) fn rollbacks(&self) -> usize {
        self.state.lock().rollbacks
    }

    /// Makes the next `n` rollbacks fail, as a SQLite rollback does when
    /// the batch it read from does not commit.
    pub(crate) fn fail_next_rollbacks(&self, n: usize) {
        self.state.lock().failing_rollbacks = n;
    }

    /// Makes recording a failed attempt fail (a store hiccup) while `refuse`.
    pub(crate) fn refuse_failure_records(&self, refuse: bool) {
        self.state.lock().refuse_failure_records = refuse;
    }

    /// Calls that cleared a message's failure history.
    pub(crate) fn failure_clears(&self) -> usize {
        self.state.lock().failure_clears
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
        if tx.inbox.iter().any(|k| s.inbox.contains_key(k)) {
            return Err(StoreError::Conflict("inbox row exists".into()));
        }
        let appended = |r: &OutboxRecord| s.outbox.iter().any(|o| o.record.event_id == r.event_id);
        if tx.outbox.iter().any(appended) {
            return Err(StoreError::Conflict("outbox event id exists".into()));
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
        let now = keel_core::clock::utc_now();
        s.inbox.extend(tx.inbox.into_iter().map(|k| (k, now)));
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
        let mut s = self.state.lock();
        s.rollbacks += 1;
        if s.failing_rollbacks > 0 {
            s.failing_rollbacks -= 1;
            return Err(StoreError::Unavailable(
                "the batch this transaction read from did not commit".into(),
            ));
        }
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
        let s = self.state.lock();
        for record in records {
            let taken = |id: &str| {
                s.outbox.iter().any(|r| r.record.event_id == id)
                    || tx.outbox.iter().any(|r| r.event_id == id)
            };
            if taken(&record.event_id) {
                return Err(StoreError::Conflict(format!(
                    "event {} is in the outbox",
                    record.event_id
                )));
            }
            tx.outbox.push(record.clone());
        }
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
    async fn outbox_release(&self, relay: &str, ids: &[i64]) -> Result<(), StoreError> {
        let mut s = self.state.lock();
        for row in s.outbox.iter_mut().filter(|r| claimed_by(r, relay, ids)) {
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
    async fn outbox_release_failed(
        &self,
        relay: &str,
        ids: &[i64],
        error: &str,
    ) -> Result<(), StoreError> {
        let mut s = self.state.lock();
        for row in s.outbox.iter_mut().filter(|r| claimed_by(r, relay, ids)) {
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
}

#[async_trait]
impl OutboxAdminStore for MemStore {
    async fn outbox_published(
        &self,
        after: i64,
        limit: usize,
    ) -> Result<Vec<PublishedOutbox>, StoreError> {
        let s = self.state.lock();
        let mut published: Vec<PublishedOutbox> = s
            .outbox
            .iter()
            .filter(|r| r.id > after)
            .filter_map(|r| {
                r.published_at.map(|published_at| PublishedOutbox {
                    id: r.id,
                    event_id: r.record.event_id.clone(),
                    published_at,
                })
            })
            .collect();
        published.sort_by_key(|p| p.id);
        published.truncate(limit);
        Ok(published)
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
        if self.state.lock().inbox.contains_key(&key) || tx.inbox.contains(&key) {
            return Ok(false);
        }
        tx.inbox.push(key);
        Ok(true)
    }

    async fn inbox_prune(&self, before: DateTime<Utc>, batch: usize) -> Result<u64, StoreError> {
        let mut s = self.state.lock();
        let old: Vec<_> = s
            .inbox
            .iter()
            .filter(|(_, at)| **at < before)
            .map(|(k, _)| k.clone())
            .take(batch)
            .collect();
        for k in &old {
            s.inbox.remove(k);
        }
        Ok(old.len() as u64)
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
        let mut oldest_first: Vec<&DeadLetter> = s.letters.iter().collect();
        oldest_first.sort_by(|a, b| (a.dead_at, &a.id).cmp(&(b.dead_at, &b.id)));
        Ok(oldest_first
            .into_iter()
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
        let mut state = self.state.lock();
        if state.refuse_failure_records {
            return Err(StoreError::Unavailable("the store hiccuped".into()));
        }
        state
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
        let mut state = self.state.lock();
        state.failure_clears += 1;
        state
            .failures
            .remove(&(group.to_owned(), message_id.to_owned()));
        Ok(())
    }
}

// The in-memory store is a backend like any other: the tables it has pass
// the same conformance suite as SQLite and PostgreSQL, so a unit test that
// passes on it says something about the real ones. (It keeps no archive:
// `outbox_archive` refuses, as the contract allows.)
keel_testkit::store_conformance_tests!(
    async { MemStore::default() };
    outbox, outbox_parked, inbox, dead_letter
);
