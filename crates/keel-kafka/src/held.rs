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

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use keel_core::clock::{self, Instant};
use keel_store::broker::held::{HeldDeliveries, Settling};
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
    entries: HeldDeliveries<Place, ()>,
    /// Per assigned partition, the offset after the last record fetched.
    fetched_to: HashMap<i32, i64>,
    /// Per partition, the offset last stored for commit.
    stored: HashMap<i32, i64>,
    recent: RecentPlaces,
    assigned: bool,
}

impl Held {
    pub(crate) fn new(recent: RecentPlaces) -> Self {
        Self {
            state: Mutex::new(HeldState {
                entries: HeldDeliveries::default(),
                fetched_to: HashMap::new(),
                stored: HashMap::new(),
                recent,
                assigned: false,
            }),
            changed: Notify::new(),
        }
    }

    /// Takes a fetched record; a message id seen lately at another offset
    /// is a republish and is dropped (its offset counts as settled). The
    /// caller wakes the receivers ([`Held::changed`]) once per burst.
    pub(crate) fn take(&self, place: Place, arrived: Arrived) {
        let mut state = self.state.lock();
        let (partition, offset) = place;
        let fetched_to = state.fetched_to.entry(partition).or_insert(offset);
        *fetched_to = (*fetched_to).max(offset + 1);
        if state.entries.contains(&place) || state.recent.is_duplicate(&arrived.message.id, place) {
            return;
        }
        let (message, published_at) = (arrived.message, arrived.published_at);
        let now = clock::now();
        state
            .entries
            .insert(place, message, published_at, 0, (), now);
    }

    /// How many records are held.
    pub(crate) fn len(&self) -> usize {
        self.state.lock().entries.len()
    }

    /// How many are handed out under a lease that has not run out.
    pub(crate) fn in_flight(&self) -> u64 {
        self.state.lock().entries.in_flight(clock::now())
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
                .places_in((partition, i64::MIN)..=(partition, i64::MAX))
                .next()
                .map(|place| place.1);
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
        state.entries.retain(|place| !partitions.contains(&place.0));
        for partition in partitions {
            state.fetched_to.remove(partition);
            state.stored.remove(partition);
        }
        drop(state);
        self.changed.notify_waiters();
    }

    /// Forgets every record: the member left its group, and whoever reads
    /// the partitions next starts at the committed offsets.
    pub(crate) fn forget_all(&self) {
        let mut state = self.state.lock();
        state.entries.clear();
        state.fetched_to.clear();
        state.stored.clear();
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

    /// Leases up to `max` deliverable records (see
    /// [`HeldDeliveries::lease`]).
    pub(crate) fn lease(
        &self,
        max: usize,
        lease: Duration,
        control: impl Fn(Place, u64) -> Box<dyn DeliveryControl>,
    ) -> (Vec<Delivery>, Option<Instant>) {
        let now = clock::now();
        self.state.lock().entries.lease(max, lease, now, control)
    }

    /// Runs `settle` on the record at `place` (with the time it reads)
    /// while `lease` holds it, and wakes the receivers: an ack, a nack or
    /// an extension. [`BrokerError::LeaseLost`] once the lease ran out, the
    /// record was handed out again or its partition was revoked.
    pub(crate) fn settle(
        &self,
        place: Place,
        lease: u64,
        settle: impl FnOnce(Settling<'_, Place, ()>, Instant),
    ) -> Result<(), BrokerError> {
        let now = clock::now();
        let mut state = self.state.lock();
        settle(state.entries.settle(place, lease, now)?, now);
        drop(state);
        self.changed.notify_waiters();
        Ok(())
    }

    /// The record at `place` and how often it was delivered, while `lease`
    /// holds it.
    pub(crate) fn message(&self, place: Place, lease: u64) -> Result<(Message, u32), BrokerError> {
        let mut state = self.state.lock();
        let settling = state.entries.settle(place, lease, clock::now())?;
        let entry = settling.entry().ok_or(BrokerError::LeaseLost)?;
        Ok((entry.message.clone(), entry.deliveries))
    }
}
