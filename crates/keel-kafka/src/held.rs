//! What a group member holds: the records it fetched and has not settled,
//! with the leases, delayed nacks and per-key holds the contract asks for.
//!
//! Kafka has no per-message lease or redelivery: a group commits one offset
//! per partition. So the member keeps each fetched record until it is
//! settled, hands it out under a lease, takes it back when the lease runs
//! out or a nack's delay passes, and holds a key's later records until its
//! earlier one is settled. The offset committed for a partition is its
//! oldest unsettled record's (ack last): a crash or a rebalance redelivers
//! from there, never past a record whose effect did not commit.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Weak};
use std::time::Duration;

use chrono::{DateTime, Utc};
use keel_core::clock::{self, Instant};
use keel_store::broker::{BrokerError, Delivery, DeliveryControl, Message};
use parking_lot::Mutex;
use tokio::sync::Notify;

use crate::envelope::Arrived;
use crate::recent::RecentPlaces;

/// A record's place: partition and offset.
pub(crate) type Place = (i32, i64);

/// The records a member holds, shared with its settle handles and the
/// task that fetches them.
pub(crate) struct Held {
    state: Mutex<HeldState>,
    /// Something became deliverable (an arrival, a settle).
    pub(crate) changed: Notify,
}

struct HeldState {
    entries: BTreeMap<Place, Entry>,
    /// Per assigned partition, the offset after the last record fetched.
    fetched_to: HashMap<i32, i64>,
    /// Per partition, the offset last stored for commit.
    stored: HashMap<i32, i64>,
    recent: RecentPlaces,
    next_lease: u64,
    assigned: bool,
}

struct Entry {
    message: Message,
    published_at: Option<DateTime<Utc>>,
    deliveries: u32,
    state: EntryState,
}

#[derive(Clone, Copy)]
enum EntryState {
    /// Deliverable from this instant (a nack's delay).
    Ready(Instant),
    /// Handed out under this lease until this instant; deliverable again
    /// after it.
    Leased { id: u64, until: Instant },
}

impl EntryState {
    fn deliverable_from(self) -> Instant {
        match self {
            Self::Ready(at) => at,
            Self::Leased { until, .. } => until,
        }
    }
}

impl Held {
    pub(crate) fn new(recent: RecentPlaces) -> Self {
        Self {
            state: Mutex::new(HeldState {
                entries: BTreeMap::new(),
                fetched_to: HashMap::new(),
                stored: HashMap::new(),
                recent,
                next_lease: 0,
                assigned: false,
            }),
            changed: Notify::new(),
        }
    }

    /// Takes a fetched record; a message id seen lately at another offset
    /// is a republish and is dropped (its offset counts as settled).
    pub(crate) fn take(&self, place: Place, arrived: Arrived) {
        let mut state = self.state.lock();
        let (partition, offset) = place;
        let fetched_to = state.fetched_to.entry(partition).or_insert(offset);
        *fetched_to = (*fetched_to).max(offset + 1);
        if state.entries.contains_key(&place)
            || state.recent.is_duplicate(&arrived.message.id, place)
        {
            return;
        }
        state.entries.insert(
            place,
            Entry {
                message: arrived.message,
                published_at: arrived.published_at,
                deliveries: 0,
                state: EntryState::Ready(clock::now()),
            },
        );
        drop(state);
        self.changed.notify_waiters();
    }

    /// How many records are held.
    pub(crate) fn len(&self) -> usize {
        self.state.lock().entries.len()
    }

    /// How many are handed out under a lease that has not run out.
    pub(crate) fn in_flight(&self) -> u64 {
        let now = clock::now();
        let state = self.state.lock();
        state
            .entries
            .values()
            .filter(|e| matches!(e.state, EntryState::Leased { until, .. } if until > now))
            .count() as u64
    }

    /// Partitions whose commit point moved past what was stored, with the
    /// new point: the oldest held record's offset, or the fetch position
    /// when none is held. Recorded as stored.
    pub(crate) fn advanced(&self) -> Vec<(i32, i64)> {
        let mut state = self.state.lock();
        let mut advanced = Vec::new();
        let partitions: Vec<(i32, i64)> = state.fetched_to.iter().map(|(p, o)| (*p, *o)).collect();
        for (partition, fetched_to) in partitions {
            let oldest = state
                .entries
                .range((partition, i64::MIN)..=(partition, i64::MAX))
                .next()
                .map(|(place, _)| place.1);
            let point = oldest.unwrap_or(fetched_to);
            if state
                .stored
                .get(&partition)
                .is_none_or(|stored| point > *stored)
            {
                state.stored.insert(partition, point);
                advanced.push((partition, point));
            }
        }
        advanced
    }

    /// Forgets the records of revoked partitions: their settles will find
    /// their lease lost, and whoever gets the partitions reads them again
    /// from the committed offset.
    pub(crate) fn revoke(&self, partitions: &HashSet<i32>) {
        let mut state = self.state.lock();
        state
            .entries
            .retain(|place, _| !partitions.contains(&place.0));
        for partition in partitions {
            state.fetched_to.remove(partition);
            state.stored.remove(partition);
        }
        drop(state);
        self.changed.notify_waiters();
    }

    /// Records that the member has its first assignment.
    pub(crate) fn mark_assigned(&self) {
        self.state.lock().assigned = true;
        self.changed.notify_waiters();
    }

    pub(crate) fn is_assigned(&self) -> bool {
        self.state.lock().assigned
    }

    /// Leases up to `max` deliverable records, oldest first per partition,
    /// skipping every key with an earlier unsettled record; also says when
    /// the next held record becomes deliverable.
    pub(crate) fn lease<F>(
        &self,
        max: usize,
        lease: Duration,
        control: F,
    ) -> (Vec<Delivery>, Option<Instant>)
    where
        F: Fn(Place, u64) -> Box<dyn DeliveryControl>,
    {
        let mut state = self.state.lock();
        let now = clock::now();
        let mut seen_keys = HashSet::new();
        let mut chosen = Vec::new();
        let mut next_wake: Option<Instant> = None;
        for (place, entry) in &state.entries {
            if !seen_keys.insert(entry.message.key.as_str()) {
                continue;
            }
            let from = entry.state.deliverable_from();
            if from > now {
                next_wake = Some(next_wake.map_or(from, |wake| wake.min(from)));
            } else if chosen.len() < max {
                chosen.push(*place);
            }
        }
        let mut deliveries = Vec::with_capacity(chosen.len());
        for place in chosen {
            let id = state.next_lease;
            state.next_lease += 1;
            let Some(entry) = state.entries.get_mut(&place) else {
                continue;
            };
            entry.deliveries += 1;
            entry.state = EntryState::Leased {
                id,
                until: now + lease,
            };
            let mut delivery =
                Delivery::new(entry.message.clone(), entry.deliveries, control(place, id));
            if let Some(at) = entry.published_at {
                delivery = delivery.with_received_at(at);
            }
            deliveries.push(delivery);
        }
        (deliveries, next_wake)
    }

    /// Runs `settle` on the record at `place` while lease `lease` holds it;
    /// [`BrokerError::LeaseLost`] once it ran out, was handed out again or
    /// the partition was revoked.
    fn settle<T>(
        &self,
        place: Place,
        lease: u64,
        settle: impl FnOnce(&mut BTreeMap<Place, Entry>) -> T,
    ) -> Result<T, BrokerError> {
        let mut state = self.state.lock();
        match state.entries.get(&place).map(|entry| entry.state) {
            Some(EntryState::Leased { id, until }) if id == lease && until > clock::now() => {}
            _ => return Err(BrokerError::LeaseLost),
        }
        let outcome = settle(&mut state.entries);
        drop(state);
        self.changed.notify_waiters();
        Ok(outcome)
    }

    /// Done with the record at `place`.
    pub(crate) fn remove(&self, place: Place, lease: u64) -> Result<(), BrokerError> {
        self.settle(place, lease, |entries| {
            entries.remove(&place);
        })
    }

    /// The record at `place` and how often it was delivered, while `lease`
    /// holds it.
    pub(crate) fn message(&self, place: Place, lease: u64) -> Result<(Message, u32), BrokerError> {
        self.settle(place, lease, |entries| {
            entries
                .get(&place)
                .map(|entry| (entry.message.clone(), entry.deliveries))
        })?
        .ok_or(BrokerError::LeaseLost)
    }

    /// Deliverable again after `delay`.
    pub(crate) fn release(
        &self,
        place: Place,
        lease: u64,
        delay: Duration,
    ) -> Result<(), BrokerError> {
        self.settle(place, lease, |entries| {
            if let Some(entry) = entries.get_mut(&place) {
                entry.state = EntryState::Ready(clock::now() + delay);
            }
        })
    }

    /// Kept out of others' reach for `lease_for` from now.
    pub(crate) fn extend(
        &self,
        place: Place,
        lease: u64,
        lease_for: Duration,
    ) -> Result<(), BrokerError> {
        let until = clock::now() + lease_for;
        self.settle(place, lease, |entries| {
            if let Some(entry) = entries.get_mut(&place) {
                entry.state = EntryState::Leased { id: lease, until };
            }
        })
    }
}

/// Settles one leased delivery through its member.
pub(crate) struct Settle<M> {
    pub(crate) member: Weak<M>,
    pub(crate) place: Place,
    pub(crate) lease: u64,
}

/// What a settle needs from the member that holds the record.
#[async_trait::async_trait]
pub(crate) trait Holder: Send + Sync + 'static {
    fn held(&self) -> &Arc<Held>;
    /// Writes `message` to the group's dead-letter topic.
    async fn dead_letter(&self, message: Message, deliveries: u32) -> Result<(), BrokerError>;
}

impl<M: Holder> Settle<M> {
    fn member(&self) -> Result<Arc<M>, BrokerError> {
        self.member.upgrade().ok_or(BrokerError::LeaseLost)
    }
}

#[async_trait::async_trait]
impl<M: Holder> DeliveryControl for Settle<M> {
    async fn ack(&self) -> Result<(), BrokerError> {
        self.member()?.held().remove(self.place, self.lease)
    }

    async fn nack(&self, delay: Duration) -> Result<(), BrokerError> {
        self.member()?.held().release(self.place, self.lease, delay)
    }

    async fn extend(&self, lease: Duration) -> Result<(), BrokerError> {
        self.member()?.held().extend(self.place, self.lease, lease)
    }

    /// Written to the group's dead-letter topic, then settled: a record
    /// whose dead letter was not acknowledged stays held.
    async fn terminate(&self) -> Result<(), BrokerError> {
        let member = self.member()?;
        let (message, deliveries) = member.held().message(self.place, self.lease)?;
        member.dead_letter(message, deliveries).await?;
        member.held().remove(self.place, self.lease)
    }
}
