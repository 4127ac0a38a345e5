//! The shipping service's record: each shipment's events, numbered 1, 2,
//! 3... without gaps, which is what makes a watch resumable.
//!
//! Shipping is a stand-in for another company's service, so it keeps its
//! record in its own memory rather than in the shop's tables (the effect
//! the shop's invariants count, one shipment per order, is recorded in
//! the shop's database by the create call). A courier moves each shipment
//! along on a timer: picked at once, in transit, then delivered.
//!
//! Memory is bounded by what is still moving: a delivered shipment is kept
//! (for watches to resume and scans to be deduplicated) until
//! [`KEPT_DELIVERED`] later deliveries, then forgotten, and a watch of it
//! ends with `NOT_FOUND`. The shop's own record of the shipment is its
//! effect row, which does not go away.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use prost_types::Timestamp;
use tokio::sync::watch;

use super::pb::shipment::Status;
use super::pb::{Shipment, ShipmentEvent};

/// How fast the courier moves a shipment along.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CourierPace {
    /// From picked to in transit.
    pub to_transit: Duration,
    /// From in transit to delivered.
    pub to_delivered: Duration,
}

impl Default for CourierPace {
    fn default() -> Self {
        Self {
            to_transit: Duration::from_millis(200),
            to_delivered: Duration::from_millis(800),
        }
    }
}

/// What became of one scan.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum ScanOutcome {
    /// Recorded as the shipment's next event.
    Applied(ShipmentEvent),
    /// The scan id was seen before: nothing recorded.
    Duplicate,
    /// No such shipment, or it was already delivered.
    Refused,
}

/// Delivered shipments kept after their delivery, oldest forgotten first.
pub(crate) const KEPT_DELIVERED: usize = 10_000;

struct Entry {
    order_id: String,
    events: Vec<ShipmentEvent>,
    /// Scan ids already recorded.
    scans: HashSet<String>,
    latest: watch::Sender<u64>,
}

/// Every shipment and its events; cheap to clone.
#[derive(Clone)]
pub(crate) struct Shipments {
    inner: Arc<Mutex<Inner>>,
}

struct Inner {
    shipments: HashMap<String, Entry>,
    /// Delivered shipments, in the order they were delivered.
    delivered: VecDeque<String>,
    kept_delivered: usize,
}

impl Default for Shipments {
    fn default() -> Self {
        Self::keeping(KEPT_DELIVERED)
    }
}

/// The shipment id for an order: one shipment per order, whoever asks.
pub fn shipment_id(order_id: &str) -> String {
    format!("shp-{order_id}")
}

fn now() -> Timestamp {
    let at = keel_core::clock::utc_now();
    Timestamp {
        seconds: at.timestamp(),
        nanos: i32::try_from(at.timestamp_subsec_nanos()).unwrap_or(0),
    }
}

impl Shipments {
    /// A record that keeps `kept_delivered` shipments after their delivery.
    pub(crate) fn keeping(kept_delivered: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                shipments: HashMap::new(),
                delivered: VecDeque::new(),
                kept_delivered,
            })),
        }
    }

    /// The order's shipment, created picked (and the courier started) if
    /// it did not exist; whether it was created now.
    pub(crate) fn create(&self, order_id: &str, pace: CourierPace) -> (Shipment, bool) {
        let id = shipment_id(order_id);
        let created = {
            let mut inner = self.inner.lock();
            let created = !inner.shipments.contains_key(&id);
            if created {
                let (latest, _) = watch::channel(0);
                inner.shipments.insert(
                    id.clone(),
                    Entry {
                        order_id: order_id.to_owned(),
                        events: Vec::new(),
                        scans: HashSet::new(),
                        latest,
                    },
                );
            }
            created
        };
        if created {
            self.append(&id, Status::Picked, "warehouse");
            let courier = self.clone();
            let moving = id.clone();
            tokio::spawn(async move {
                tokio::time::sleep(pace.to_transit).await;
                courier.append(&moving, Status::InTransit, "hub");
                tokio::time::sleep(pace.to_delivered).await;
                courier.append(&moving, Status::Delivered, "doorstep");
            });
        }
        let shipment = self
            .get(&id)
            .unwrap_or_else(|| unreachable!("created above"));
        (shipment, created)
    }

    /// The shipment as of its latest event.
    pub(crate) fn get(&self, id: &str) -> Option<Shipment> {
        let inner = self.inner.lock();
        let entry = inner.shipments.get(id)?;
        let last = entry.events.last();
        Some(Shipment {
            id: id.to_owned(),
            status: last.map_or(Status::Unspecified, |e| e.status()) as i32,
            updated_at: last.and_then(|e| e.at),
            order_id: entry.order_id.clone(),
            last_sequence: last.map_or(0, |e| e.sequence),
        })
    }

    /// The event numbered `sequence`, if it has happened.
    pub(crate) fn event(&self, id: &str, sequence: u64) -> Option<ShipmentEvent> {
        let inner = self.inner.lock();
        let index = usize::try_from(sequence.checked_sub(1)?).ok()?;
        inner.shipments.get(id)?.events.get(index).cloned()
    }

    /// A receiver that changes with every new event of the shipment.
    pub(crate) fn subscribe(&self, id: &str) -> Option<watch::Receiver<u64>> {
        Some(self.inner.lock().shipments.get(id)?.latest.subscribe())
    }

    /// Records a courier's scan, once per scan id, while the shipment is
    /// not yet delivered.
    pub(crate) fn scan(&self, shipment: &str, scan_id: &str, location: &str) -> ScanOutcome {
        {
            let mut inner = self.inner.lock();
            let Some(entry) = inner.shipments.get_mut(shipment) else {
                return ScanOutcome::Refused;
            };
            if entry.events.last().map(ShipmentEvent::status) == Some(Status::Delivered) {
                return ScanOutcome::Refused;
            }
            if !entry.scans.insert(scan_id.to_owned()) {
                return ScanOutcome::Duplicate;
            }
        }
        match self.append(shipment, Status::InTransit, location) {
            Some(event) => ScanOutcome::Applied(event),
            None => ScanOutcome::Refused,
        }
    }

    /// Appends the shipment's next event; none once it is delivered.
    fn append(&self, id: &str, status: Status, location: &str) -> Option<ShipmentEvent> {
        let mut inner = self.inner.lock();
        let entry = inner.shipments.get_mut(id)?;
        if entry.events.last().map(ShipmentEvent::status) == Some(Status::Delivered) {
            return None;
        }
        let sequence = entry.events.len() as u64 + 1;
        let event = ShipmentEvent {
            shipment_id: id.to_owned(),
            sequence,
            status: status as i32,
            location: location.to_owned(),
            at: Some(now()),
        };
        entry.events.push(event.clone());
        entry.latest.send_replace(sequence);
        if status == Status::Delivered {
            inner.forget_the_oldest_beyond_the_bound(id);
        }
        Some(event)
    }
}

impl Inner {
    /// Records `id` as delivered, and forgets the delivered shipments
    /// beyond the bound (their watches end).
    fn forget_the_oldest_beyond_the_bound(&mut self, id: &str) {
        self.delivered.push_back(id.to_owned());
        while self.delivered.len() > self.kept_delivered {
            if let Some(oldest) = self.delivered.pop_front() {
                self.shipments.remove(&oldest);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SLOW: CourierPace = CourierPace {
        to_transit: Duration::from_secs(3600),
        to_delivered: Duration::from_secs(3600),
    };

    /// Nothing here awaits, so the couriers never run: the test delivers.
    #[tokio::test(flavor = "current_thread")]
    async fn delivered_shipments_are_forgotten_oldest_first_beyond_the_bound() {
        let shipments = Shipments::keeping(2);
        for order in ["a", "b", "c", "d"] {
            shipments.create(order, SLOW);
        }
        let watch_a = shipments.subscribe(&shipment_id("a")).expect("a watch");
        for order in ["a", "b", "c"] {
            shipments.append(&shipment_id(order), Status::Delivered, "doorstep");
        }

        assert!(
            shipments.get(&shipment_id("a")).is_none(),
            "the oldest delivery goes"
        );
        for kept in ["b", "c"] {
            assert!(
                shipments.get(&shipment_id(kept)).is_some(),
                "{kept} is kept"
            );
        }
        let moving = shipments.get(&shipment_id("d")).expect("still moving");
        assert_eq!(
            moving.status(),
            Status::Picked,
            "what moves is never forgotten"
        );
        assert!(watch_a.has_changed().is_err(), "a's watch is closed");
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_scan_counts_once_per_shipment_and_never_after_delivery() {
        let shipments = Shipments::keeping(1);
        let id = shipment_id("a");
        shipments.create("a", SLOW);
        assert!(matches!(
            shipments.scan(&id, "s-1", "hub"),
            ScanOutcome::Applied(_)
        ));
        assert_eq!(shipments.scan(&id, "s-1", "hub"), ScanOutcome::Duplicate);
        shipments.append(&id, Status::Delivered, "doorstep");
        assert_eq!(shipments.scan(&id, "s-2", "hub"), ScanOutcome::Refused);
        assert_eq!(
            shipments.scan("shp-none", "s-3", "hub"),
            ScanOutcome::Refused
        );
    }
}
