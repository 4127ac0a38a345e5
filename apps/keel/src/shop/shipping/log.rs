//! The shipping service's record: each shipment's events, numbered 1, 2,
//! 3... without gaps, which is what makes a watch resumable.
//!
//! Shipping is a stand-in for another company's service, so it keeps its
//! record in its own memory rather than in the shop's tables (the effect
//! the shop's invariants count, one shipment per order, is recorded in
//! the shop's database by the create call). A courier moves each shipment
//! along on a timer: picked at once, in transit, then delivered.

use std::collections::{HashMap, HashSet};
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

struct Entry {
    order_id: String,
    events: Vec<ShipmentEvent>,
    latest: watch::Sender<u64>,
}

/// Every shipment and its events; cheap to clone.
#[derive(Clone, Default)]
pub(crate) struct Shipments {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Default)]
struct Inner {
    shipments: HashMap<String, Entry>,
    scans: HashSet<String>,
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
            let open = inner.shipments.get(shipment).is_some_and(|entry| {
                entry.events.last().map(ShipmentEvent::status) != Some(Status::Delivered)
            });
            if !open {
                return ScanOutcome::Refused;
            }
            if !inner.scans.insert(scan_id.to_owned()) {
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
        Some(event)
    }
}
