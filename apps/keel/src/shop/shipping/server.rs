//! The shipping service over gRPC: the four gRPC call shapes and the
//! create call, behind keel-grpc's deadline and trace layers.

use std::pin::Pin;
use std::time::Duration;

use futures_util::Stream;
use keel_grpc::server::require_remaining;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status, Streaming};

use super::log::{CourierPace, ScanOutcome, Shipments};
use super::pb::shipment::Status as ShipmentStatus;
use super::pb::shipping_server::Shipping;
use super::pb::{
    ClientMsg, CreateShipmentRequest, GetShipmentRequest, Scan, ScanAck, ServerMsg, Shipment,
    ShipmentEvent, UploadSummary, WatchShipmentRequest, client_msg, server_msg,
};
use crate::shop::db::ShopDb;

/// Scans one `UploadScans` call may carry; past it the call is refused
/// with `RESOURCE_EXHAUSTED` (what was applied stays applied).
pub const MAX_SCANS_PER_UPLOAD: u32 = 10_000;

/// Server messages a `Sync` call holds for a client that reads slowly;
/// past it the service stops reading the client's scans until it catches up.
pub const SYNC_OUTBOX: usize = 64;

/// The least time a create call needs: with less left it is not started.
pub const MIN_TIME_TO_CREATE: Duration = Duration::from_millis(50);

/// The service, over the shop's database (where a created shipment is
/// recorded as the order's `schedule_shipment` effect).
#[derive(Clone)]
pub struct ShippingService<S> {
    db: S,
    shipments: Shipments,
    pace: CourierPace,
}

impl<S: ShopDb> ShippingService<S> {
    /// A service recording its effects in `db`, its courier moving at `pace`.
    pub fn new(db: S, pace: CourierPace) -> Self {
        Self {
            db,
            shipments: Shipments::default(),
            pace,
        }
    }
}

fn required<'a>(value: &'a str, field: &str) -> Result<&'a str, Status> {
    if value.is_empty() {
        return Err(Status::invalid_argument(format!("{field} is required")));
    }
    if value.len() > 255 {
        return Err(Status::invalid_argument(format!(
            "{field} is longer than 255 bytes"
        )));
    }
    Ok(value)
}

/// A store failure, answered without its text (it names tables and
/// hosts): `UNAVAILABLE`, retry in a second, with the same request id; a
/// lost `COMMIT` is `INTERNAL` (outcome unknown), since the shipment may
/// have been scheduled.
fn store_unavailable(err: keel_store::StoreError) -> Status {
    tracing::warn!(error = %err, "shipping's store failed");
    if matches!(err, keel_store::StoreError::OutcomeUnknown(_)) {
        return Status::internal(
            "shipping's store lost the answer to its commit: the shipment may or may not \
             have been scheduled; retry with the same request_id",
        );
    }
    let mut status = Status::unavailable(
        "shipping's store is unavailable; nothing was scheduled, retry with the same request_id",
    );
    keel_grpc::status::set_retry_pushback(&mut status, Duration::from_secs(1));
    status
}

type BoxStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[tonic::async_trait]
impl<S: ShopDb> Shipping for ShippingService<S> {
    async fn create_shipment(
        &self,
        request: Request<CreateShipmentRequest>,
    ) -> Result<Response<Shipment>, Status> {
        require_remaining(MIN_TIME_TO_CREATE)?;
        let request = request.into_inner();
        let order_id = required(&request.order_id, "order_id")?;
        let key = required(&request.request_id, "request_id")?;
        // The shop's record first: a shipment exists only once the order's
        // effect is durable, and a retry finds both.
        self.db
            .record_effect(key, order_id, "schedule_shipment")
            .await
            .map_err(store_unavailable)?;
        let (shipment, created) = self.shipments.create(order_id, self.pace);
        metrics::counter!("keel_shop_shipments_total", "created" => if created { "new" } else { "again" })
            .increment(1);
        Ok(Response::new(shipment))
    }

    async fn get_shipment(
        &self,
        request: Request<GetShipmentRequest>,
    ) -> Result<Response<Shipment>, Status> {
        let id = required(&request.get_ref().id, "id")?;
        self.shipments
            .get(id)
            .map(Response::new)
            .ok_or_else(|| Status::not_found(format!("no shipment {id}")))
    }

    type WatchShipmentStream = BoxStream<ShipmentEvent>;

    async fn watch_shipment(
        &self,
        request: Request<WatchShipmentRequest>,
    ) -> Result<Response<Self::WatchShipmentStream>, Status> {
        let request = request.into_inner();
        let id = required(&request.id, "id")?.to_owned();
        // Subscribe BEFORE replaying: an event appended in between is then
        // seen as a change, never lost between the replay and the wait.
        let changes = self
            .shipments
            .subscribe(&id)
            .ok_or_else(|| Status::not_found(format!("no shipment {id}")))?;
        let watch = Watch {
            shipments: self.shipments.clone(),
            id,
            next: request.after_sequence.saturating_add(1),
            changes,
            done: false,
        };
        Ok(Response::new(Box::pin(futures_util::stream::unfold(
            watch,
            Watch::next,
        ))))
    }

    async fn upload_scans(
        &self,
        request: Request<Streaming<Scan>>,
    ) -> Result<Response<UploadSummary>, Status> {
        let mut scans = request.into_inner();
        let mut summary = UploadSummary::default();
        while let Some(scan) = scans.message().await? {
            summary.received += 1;
            if summary.received > MAX_SCANS_PER_UPLOAD {
                return Err(Status::resource_exhausted(format!(
                    "more than {MAX_SCANS_PER_UPLOAD} scans in one upload: the first \
                     {MAX_SCANS_PER_UPLOAD} were taken; send the rest in another"
                )));
            }
            match self.apply(&scan) {
                ScanOutcome::Applied(_) => summary.applied += 1,
                ScanOutcome::Duplicate => summary.duplicates += 1,
                ScanOutcome::Refused => summary.refused += 1,
            }
        }
        Ok(Response::new(summary))
    }

    type SyncStream = BoxStream<ServerMsg>;

    async fn sync(
        &self,
        request: Request<Streaming<ClientMsg>>,
    ) -> Result<Response<Self::SyncStream>, Status> {
        let mut incoming = request.into_inner();
        let (out, outgoing) = mpsc::channel(SYNC_OUTBOX);
        let service = self.clone();
        tokio::spawn(async move {
            loop {
                let message = match incoming.message().await {
                    Ok(Some(message)) => message,
                    Ok(None) => break,
                    Err(status) => {
                        let _ = out.send(Err(status)).await;
                        break;
                    }
                };
                for reply in service.answer(message) {
                    if out.send(reply).await.is_err() {
                        return;
                    }
                }
            }
        });
        let stream = futures_util::stream::unfold(outgoing, |mut outgoing| async move {
            let next = outgoing.recv().await?;
            Some((next, outgoing))
        });
        Ok(Response::new(Box::pin(stream)))
    }
}

impl<S: ShopDb> ShippingService<S> {
    fn apply(&self, scan: &Scan) -> ScanOutcome {
        if scan.shipment_id.is_empty() || scan.scan_id.is_empty() || scan.scan_id.len() > 255 {
            return ScanOutcome::Refused;
        }
        self.shipments
            .scan(&scan.shipment_id, &scan.scan_id, &scan.location)
    }

    /// What `Sync` sends back for one client message: a scan is
    /// acknowledged (and its event sent when it made one); an event's
    /// acknowledgement is counted.
    fn answer(&self, message: ClientMsg) -> Vec<Result<ServerMsg, Status>> {
        let reply = |kind| Ok(ServerMsg { kind: Some(kind) });
        match message.kind {
            Some(client_msg::Kind::Scan(scan)) => {
                let outcome = self.apply(&scan);
                let ack = server_msg::Kind::ScanAck(ScanAck {
                    scan_id: scan.scan_id,
                    applied: matches!(outcome, ScanOutcome::Applied(_)),
                });
                let mut replies = vec![reply(ack)];
                if let ScanOutcome::Applied(event) = outcome {
                    replies.push(reply(server_msg::Kind::Event(event)));
                }
                replies
            }
            Some(client_msg::Kind::Ack(_)) => {
                metrics::counter!("keel_shop_sync_events_acknowledged_total").increment(1);
                Vec::new()
            }
            None => vec![Err(Status::invalid_argument(
                "a Sync message must carry a scan or an ack",
            ))],
        }
    }
}

/// One watch: the next sequence to send, and the shipment's changes.
struct Watch {
    shipments: Shipments,
    id: String,
    next: u64,
    changes: tokio::sync::watch::Receiver<u64>,
    done: bool,
}

impl Watch {
    async fn next(mut self) -> Option<(Result<ShipmentEvent, Status>, Self)> {
        loop {
            if self.done {
                return None;
            }
            if let Some(event) = self.shipments.event(&self.id, self.next) {
                self.next += 1;
                self.done = event.status() == ShipmentStatus::Delivered;
                return Some((Ok(event), self));
            }
            match self.shipments.get(&self.id) {
                // Asked to resume at or past the delivery: nothing more comes.
                Some(shipment) if shipment.status() == ShipmentStatus::Delivered => return None,
                Some(_) => {}
                None => {
                    self.done = true;
                    let gone = Status::not_found(format!(
                        "shipment {} was delivered and is no longer kept",
                        self.id
                    ));
                    return Some((Err(gone), self));
                }
            }
            // A closed channel means the service is going away (a forgotten
            // shipment was caught above), and the stream ends with it.
            self.changes.changed().await.ok()?;
        }
    }
}
