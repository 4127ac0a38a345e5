//! Shipping as a gRPC service: the seed's `shipping.v1.Shipping`
//! (`proto/shipping/v1/shipping.proto`, compiled by protox at build time).
//!
//! - [`ShippingService`]: the server. `CreateShipment` (the saga's pivot,
//!   idempotent by its request id and recorded in the shop's database),
//!   `GetShipment`, `WatchShipment` (events numbered without gaps; a
//!   client resumes after the last sequence it saw), `UploadScans` (the
//!   summary once the client's stream ends) and `Sync` (scans up, events
//!   down, each acknowledged).
//! - [`ShippingClient`]: the saga's client, with the deadline on the
//!   wire and the shop's policies around a tonic channel.
//! - [`serve`]: the server on a listener, with keel-grpc's deadline and
//!   trace layers, the health service and reflection.

mod client;
mod log;
mod server;
#[cfg(test)]
mod tests;

use std::net::SocketAddr;

pub use client::ShippingClient;
pub use log::{CourierPace, shipment_id};
pub use server::{MAX_SCANS_PER_UPLOAD, MIN_TIME_TO_CREATE, SYNC_OUTBOX, ShippingService};

use keel_grpc::server::{DeadlineLayer, TraceContextLayer};
use tokio::net::TcpListener;
use tokio::sync::watch;

use super::db::ShopDb;

/// The generated protobuf types, client and server.
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("shipping.v1");

    /// The encoded descriptors, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/shipping_descriptor.bin"));
}

/// Serves `service` on `listener` (deadline capped at 10 s, the caller's
/// trace, `grpc.health.v1` and reflection) until `shutdown` turns `true`.
pub async fn serve<S: ShopDb>(
    listener: TcpListener,
    service: ShippingService<S>,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<SocketAddr> {
    let addr = listener.local_addr()?;
    let (health_reporter, health) = tonic_health::server::health_reporter();
    health_reporter
        .set_serving::<pb::shipping_server::ShippingServer<ShippingService<S>>>()
        .await;
    let reflection = keel_grpc::reflection::reflection_service(&[pb::FILE_DESCRIPTOR_SET])
        .map_err(std::io::Error::other)?;
    let deadline = DeadlineLayer::with_max(std::time::Duration::from_secs(10))
        .map_err(std::io::Error::other)?;
    let router = tonic::transport::Server::builder()
        .layer(deadline)
        .layer(TraceContextLayer::new())
        .add_service(pb::shipping_server::ShippingServer::new(service))
        .add_service(health)
        .add_service(reflection);
    tokio::spawn(async move {
        let mut shutdown = shutdown;
        let stop = async move {
            let _ = shutdown.wait_for(|stop| *stop).await;
        };
        let incoming = tonic::transport::server::TcpIncoming::from(listener);
        if let Err(err) = router.serve_with_incoming_shutdown(incoming, stop).await {
            tracing::error!(error = %err, "shipping gRPC server failed");
        }
    });
    Ok(addr)
}
