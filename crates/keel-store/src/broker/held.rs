//! Deliveries a group member holds itself: the leases, delayed nacks and
//! per-key holds of the contract, for brokers whose server has none of
//! them per message (RabbitMQ's queues, Kafka's offsets).
//!
//! The member takes each message from its server and keeps it here until
//! it is settled: it hands it out under a lease, takes it back once the
//! lease runs out or a nack's delay passes, and holds back a key's later
//! message while an earlier one of that key is unsettled. What the server
//! must learn (an ack, a commit, a hand-over when a lease runs out) stays
//! the broker's own business: this is only the book.

use std::collections::{BTreeMap, HashSet};
use std::ops::RangeBounds;
use std::time::Duration;

use chrono::{DateTime, Utc};
use keel_core::clock::Instant;

use super::{BrokerError, Delivery, DeliveryControl, Message};

/// The messages a member holds, ordered by their place in the server's
/// order (`P`: a sequence number, a partition and offset), each with the
/// broker's own `X` (an acker, nothing).
#[derive(Debug)]
pub struct HeldDeliveries<P, X> {
    entries: BTreeMap<P, HeldEntry<X>>,
    next_lease: u64,
}

/// One held message.
#[derive(Debug)]
pub struct HeldEntry<X> {
    /// The message.
    pub message: Message,
    /// When the server received it, if it says.
    pub published_at: Option<DateTime<Utc>>,
    /// How many times it was handed out so far.
    pub deliveries: u32,
    /// The broker's own part.
    pub extra: X,
    state: EntryState,
}

#[derive(Debug, Clone, Copy)]
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

    fn leased_past(self, now: Instant) -> bool {
        matches!(self, Self::Leased { until, .. } if until > now)
    }
}

impl<P, X> Default for HeldDeliveries<P, X> {
    fn default() -> Self {
        Self {
            entries: BTreeMap::new(),
            next_lease: 0,
        }
    }
}

impl<P: Ord + Copy, X> HeldDeliveries<P, X> {
    /// Holds `message` at `place`, deliverable from `now`; `deliveries` is
    /// how often it was handed out before (the server's count, or 0).
    pub fn insert(
        &mut self,
        place: P,
        message: Message,
        published_at: Option<DateTime<Utc>>,
        deliveries: u32,
        extra: X,
        now: Instant,
    ) {
        let entry = HeldEntry {
            message,
            published_at,
            deliveries,
            extra,
            state: EntryState::Ready(now),
        };
        self.entries.insert(place, entry);
    }

    /// Whether a message is held at `place`.
    pub fn contains(&self, place: &P) -> bool {
        self.entries.contains_key(place)
    }

    /// How many messages are held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// How many are handed out under a lease that has not run out.
    pub fn in_flight(&self, now: Instant) -> u64 {
        let leased = self.entries.values().filter(|e| e.state.leased_past(now));
        leased.count() as u64
    }

    /// Whether a message is leased past its lease's end at `now`.
    pub fn a_lease_ran_out(&self, now: Instant) -> bool {
        self.entries
            .values()
            .any(|e| matches!(e.state, EntryState::Leased { until, .. } if until <= now))
    }

    /// When the earliest lease ends, if any message is leased.
    pub fn next_lease_end(&self) -> Option<Instant> {
        let ends = self.entries.values().filter_map(|e| match e.state {
            EntryState::Leased { until, .. } => Some(until),
            EntryState::Ready(_) => None,
        });
        ends.min()
    }

    /// The places held within `range`, in order.
    pub fn places_in<R: RangeBounds<P>>(&self, range: R) -> impl Iterator<Item = &P> {
        self.entries.range(range).map(|(place, _)| place)
    }

    /// Keeps only the messages whose place `keep` accepts (their settles
    /// then find their lease lost).
    pub fn retain(&mut self, mut keep: impl FnMut(&P) -> bool) {
        self.entries.retain(|place, _| keep(place));
    }

    /// Forgets every message.
    pub fn clear(&mut self) {
        self.entries.clear();
    }

    /// Leases up to `max` deliverable messages for `lease` from `now`,
    /// oldest first, skipping every key with an earlier unsettled message;
    /// `control` makes each delivery's settle handle from its place and
    /// lease id. Also says when the next held message becomes deliverable.
    pub fn lease(
        &mut self,
        max: usize,
        lease: Duration,
        now: Instant,
        control: impl Fn(P, u64) -> Box<dyn DeliveryControl>,
    ) -> (Vec<Delivery>, Option<Instant>) {
        let mut seen_keys = HashSet::new();
        let mut chosen = Vec::new();
        let mut next_wake: Option<Instant> = None;
        for (place, entry) in &self.entries {
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
            let id = self.next_lease;
            self.next_lease += 1;
            let Some(entry) = self.entries.get_mut(&place) else {
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

    /// The message at `place` while lease `lease` holds it at `now`, to
    /// settle; [`BrokerError::LeaseLost`] once the lease ran out, the
    /// message was handed out again or is no longer held.
    pub fn settle(
        &mut self,
        place: P,
        lease: u64,
        now: Instant,
    ) -> Result<Settling<'_, P, X>, BrokerError> {
        match self.entries.get(&place).map(|entry| entry.state) {
            Some(EntryState::Leased { id, until }) if id == lease && until > now => Ok(Settling {
                entries: &mut self.entries,
                place,
                lease,
            }),
            _ => Err(BrokerError::LeaseLost),
        }
    }
}

/// A held message its lease still holds, being settled.
#[derive(Debug)]
pub struct Settling<'a, P, X> {
    entries: &'a mut BTreeMap<P, HeldEntry<X>>,
    place: P,
    lease: u64,
}

impl<P: Ord + Copy, X> Settling<'_, P, X> {
    /// The message, as held.
    pub fn entry(&self) -> Option<&HeldEntry<X>> {
        self.entries.get(&self.place)
    }

    /// Done: no longer held. Returns what was.
    pub fn done(self) -> Option<HeldEntry<X>> {
        self.entries.remove(&self.place)
    }

    /// Deliverable again from `at` (a nack).
    pub fn release(self, at: Instant) {
        if let Some(entry) = self.entries.get_mut(&self.place) {
            entry.state = EntryState::Ready(at);
        }
    }

    /// Leased until `until` (an extension).
    pub fn extend(self, until: Instant) {
        if let Some(entry) = self.entries.get_mut(&self.place) {
            entry.state = EntryState::Leased {
                id: self.lease,
                until,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Nothing;

    #[async_trait::async_trait]
    impl DeliveryControl for Nothing {
        async fn ack(&self) -> Result<(), BrokerError> {
            Ok(())
        }
        async fn nack(&self, _: Duration) -> Result<(), BrokerError> {
            Ok(())
        }
        async fn extend(&self, _: Duration) -> Result<(), BrokerError> {
            Ok(())
        }
        async fn terminate(&self) -> Result<(), BrokerError> {
            Ok(())
        }
    }

    fn held(keys: &[&str], now: Instant) -> HeldDeliveries<u64, ()> {
        let mut held = HeldDeliveries::default();
        for (place, key) in keys.iter().enumerate() {
            let message = Message::new(format!("m-{place}"), "t", *key, "x");
            held.insert(place as u64, message, None, 0, (), now);
        }
        held
    }

    fn ids(deliveries: &[Delivery]) -> Vec<String> {
        deliveries.iter().map(|d| d.message.id.clone()).collect()
    }

    const LEASE: Duration = Duration::from_secs(1);

    #[test]
    fn a_keys_later_message_waits_for_its_earlier_one() {
        let now = keel_core::clock::now();
        let mut held = held(&["a", "b", "a"], now);
        let (first, _) = held.lease(10, LEASE, now, |_, _| Box::new(Nothing));
        assert_eq!(ids(&first), ["m-0", "m-1"]);
        let settling = held.settle(0, 0, now).expect("leased");
        assert!(settling.done().is_some());
        let (next, _) = held.lease(10, LEASE, now, |_, _| Box::new(Nothing));
        assert_eq!(ids(&next), ["m-2"], "released by the ack");
    }

    #[test]
    fn a_lease_that_ran_out_is_lost_and_the_message_comes_again() {
        let now = keel_core::clock::now();
        let mut held = held(&["a"], now);
        let (first, _) = held.lease(10, LEASE, now, |_, _| Box::new(Nothing));
        assert_eq!(first[0].delivery_count, 1);
        let later = now + LEASE;
        assert!(held.a_lease_ran_out(later));
        assert!(matches!(
            held.settle(0, 0, later),
            Err(BrokerError::LeaseLost)
        ));
        let (again, _) = held.lease(10, LEASE, later, |_, _| Box::new(Nothing));
        assert_eq!(again[0].delivery_count, 2);
        assert!(
            matches!(held.settle(0, 0, later), Err(BrokerError::LeaseLost)),
            "the first lease's settle is refused once it was handed out again"
        );
    }

    #[test]
    fn a_nacked_message_waits_out_its_delay() {
        let now = keel_core::clock::now();
        let mut held = held(&["a"], now);
        held.lease(10, LEASE, now, |_, _| Box::new(Nothing));
        let delay = Duration::from_millis(300);
        held.settle(0, 0, now).expect("leased").release(now + delay);
        let (none, wake) = held.lease(10, LEASE, now, |_, _| Box::new(Nothing));
        assert!(none.is_empty());
        assert_eq!(wake, Some(now + delay));
        let (again, _) = held.lease(10, LEASE, now + delay, |_, _| Box::new(Nothing));
        assert_eq!(ids(&again), ["m-0"]);
    }
}
