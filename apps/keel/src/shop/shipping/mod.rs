//! Shipping as a gRPC service: `shipping.v1.Shipping`
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

use std::time::Duration;

use keel_grpc::health::GrpcHealth;
use keel_grpc::server::{BoundedIncoming, DeadlineLayer, RequireBearer, TraceContextLayer};
use keel_http::health::{ConnectionLimits, Drain, Health, Phase};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tonic::service::interceptor::InterceptedService;

use super::db::ShopDb;

/// The generated protobuf types, client and server.
#[allow(missing_docs, unreachable_pub, clippy::all, clippy::pedantic)]
pub mod pb {
    tonic::include_proto!("shipping.v1");

    /// The encoded descriptors, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        include_bytes!(concat!(env!("OUT_DIR"), "/shipping_descriptor.bin"));
}

/// How long open streams get once shipping stops: they are ended with
/// `UNAVAILABLE` (resumable) at once, so this only bounds a client that
/// does not hang up.
pub const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);

/// Who may call the shipping port, and how its connections are bounded.
#[derive(Debug, Clone, Default)]
pub struct GrpcAccess {
    /// The token every call of `shipping.v1.Shipping` and of reflection
    /// must carry as `authorization: Bearer` (`None`: none asked for; only
    /// allowed on loopback). Health answers without it: probes carry none.
    pub token: Option<String>,
    /// The cap, the share per address, the first bytes' and the idle
    /// timeouts of its connections.
    pub limits: ConnectionLimits,
}

/// HTTP/2 pings to an idle connection this often; one unanswered for
/// [`KEEPALIVE_TIMEOUT`] closes it. Their round trips also keep a quiet
/// stream within the idle timeout.
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);
const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `service` on `listener` (deadline capped at 10 s, the caller's
/// trace, `grpc.health.v1` and reflection, `access`'s credential and
/// connection limits) until `shutdown` turns `true`; then health answers
/// `NOT_SERVING`, open streams end with `UNAVAILABLE` for their clients to
/// resume elsewhere, and the server stops.
pub async fn serve<S: ShopDb>(
    listener: TcpListener,
    service: ShippingService<S>,
    access: GrpcAccess,
    shutdown: watch::Receiver<bool>,
) -> std::io::Result<SocketAddr> {
    let addr = listener.local_addr()?;
    let drain = Drain::builder()
        .lb_notice(Duration::ZERO)
        .drain_timeout(DRAIN_TIMEOUT)
        .build()
        .map_err(std::io::Error::other)?;
    let ready = Health::builder()
        .drain(&drain)
        .build()
        .map_err(std::io::Error::other)?;
    let (health, _checks) = GrpcHealth::new(&ready)
        .service("shipping.v1.Shipping")
        .start()
        .await;
    let reflection = keel_grpc::reflection::reflection_service(&[pb::FILE_DESCRIPTOR_SET])
        .map_err(std::io::Error::other)?;
    let deadline = DeadlineLayer::with_max(Duration::from_secs(10))
        .map_err(std::io::Error::other)?
        .drain(&drain);
    let bearer = RequireBearer::new(access.token.as_deref());
    let router = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .layer(deadline)
        .layer(TraceContextLayer::new())
        .add_service(pb::shipping_server::ShippingServer::with_interceptor(
            service,
            bearer.clone(),
        ))
        .add_service(health)
        .add_service(InterceptedService::new(reflection, bearer));
    let trigger = drain.clone();
    tokio::spawn(async move {
        let mut shutdown = shutdown;
        let _ = shutdown.wait_for(|stop| *stop).await;
        trigger.trigger();
    });
    tokio::spawn(async move {
        let incoming = BoundedIncoming::new(listener, &access.limits);
        let serving = router.serve_with_incoming_shutdown(incoming, drain.closing());
        tokio::select! {
            served = serving => if let Err(err) = served {
                tracing::error!(error = %err, "shipping gRPC server failed");
            },
            // Dropping the server closes what is still open.
            () = drain.wait_for(Phase::Aborting) => {
                tracing::warn!("shipping gRPC: connections outlived the drain timeout; closed");
            }
        }
    });
    Ok(addr)
}
