//! The demo's gRPC watch: one shipped order's shipment watched over
//! `WatchShipment` with the call's deadline on the wire, the stream
//! dropped after its first event and resumed after the last sequence
//! seen. Every event must arrive once, numbered without a gap, ending
//! with the delivery.

use std::time::Duration;

use keel_core::Deadline;
use keel_grpc::client::{Propagation, PropagationLayer};
use tonic::transport::{Channel, Endpoint};

use crate::shop::shipping::pb::shipment::Status;
use crate::shop::shipping::pb::shipping_client::ShippingClient;
use crate::shop::shipping::pb::{GetShipmentRequest, WatchShipmentRequest};
use crate::shop::shipping::shipment_id;

/// What the watch showed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WatchOutcome {
    /// The one-line summary for the report.
    pub summary: String,
    /// What went wrong, if anything.
    pub violations: Vec<String>,
}

/// Watches the shipment of the first of `order_ids` that was shipped.
pub async fn run(shipping_grpc: &str, order_ids: &[String]) -> anyhow::Result<WatchOutcome> {
    let channel = Endpoint::from_shared(shipping_grpc.to_owned())?
        .connect()
        .await?;
    let mut client = ShippingClient::new(
        tower::ServiceBuilder::new()
            .layer(PropagationLayer::new())
            .service(channel),
    );
    // A deadline for the whole watch: it travels as grpc-timeout.
    Deadline::after(Duration::from_secs(10))
        .scope(async move {
            for order_id in order_ids {
                let id = shipment_id(order_id);
                let found = client
                    .get_shipment(GetShipmentRequest { id: id.clone() })
                    .await;
                if found.is_ok() {
                    return watch(&mut client, order_id, &id).await;
                }
            }
            Ok(WatchOutcome {
                summary: "no order was shipped".to_owned(),
                violations: Vec::new(),
            })
        })
        .await
}

/// The demo's client: tonic's channel under Keel's propagation layer.
type Client = ShippingClient<Propagation<Channel>>;

async fn watch(client: &mut Client, order_id: &str, id: &str) -> anyhow::Result<WatchOutcome> {
    let request = |after| WatchShipmentRequest {
        id: id.to_owned(),
        after_sequence: after,
    };
    let mut first = client.watch_shipment(request(0)).await?.into_inner();
    let mut seen = Vec::new();
    if let Some(event) = first.message().await? {
        seen.push(event);
    }
    drop(first);
    let last = seen.last().map_or(0, |e| e.sequence);
    let mut resumed = client.watch_shipment(request(last)).await?.into_inner();
    while let Some(event) = resumed.message().await? {
        seen.push(event);
    }
    let sequences: Vec<u64> = seen.iter().map(|e| e.sequence).collect();
    let mut violations = Vec::new();
    if sequences != (1..=sequences.len() as u64).collect::<Vec<_>>() {
        violations.push(format!(
            "the watch of {id} resumed with a gap or a duplicate: {sequences:?}"
        ));
    }
    if seen.last().map(|e| e.status()) != Some(Status::Delivered) {
        violations.push(format!("the watch of {id} ended before the delivery"));
    }
    Ok(WatchOutcome {
        summary: format!(
            "order {order_id}'s shipment watched, dropped after event {last} and resumed: \
             events {sequences:?}, ending delivered"
        ),
        violations,
    })
}
