//! A real tonic server over loopback whose handlers misbehave on request.
//!
//! The service is `grpc.health.v1.Health` (its code ships generated in
//! tonic-health), implemented here with scripted behaviours picked by the
//! request's `service` field: a standard service any gRPC client can call,
//! so nothing here leans on a Keel-only convention.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use keel_core::{Deadline, TraceParent};
use keel_grpc::server::{DeadlineLayer, TraceContextLayer, require_remaining};
use keel_lifecycle::Drain;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_stream::{Stream, StreamExt};
use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};
use tonic::{Request, Response, Status};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_server::{Health, HealthServer};
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

/// What the scripted server saw.
#[derive(Debug, Default)]
pub(crate) struct Seen {
    /// Calls that reached a handler.
    pub(crate) calls: AtomicUsize,
    /// Handlers that ran to their end.
    pub(crate) finished: AtomicUsize,
    /// Stream messages sent.
    pub(crate) streamed: AtomicUsize,
}

#[derive(Clone)]
struct Scripted {
    seen: Arc<Seen>,
}

fn serving() -> HealthCheckResponse {
    HealthCheckResponse {
        status: ServingStatus::Serving as i32,
    }
}

#[tonic::async_trait]
impl Health for Scripted {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        let n = self.seen.calls.fetch_add(1, Ordering::SeqCst);
        let mut response = Response::new(serving());
        match request.get_ref().service.as_str() {
            // Reports the deadline and trace it runs under.
            "echo" => {
                let left = Deadline::current_remaining().map_or(u64::MAX, |d| d.as_millis() as u64);
                response
                    .metadata_mut()
                    .insert("x-remaining-ms", MetadataValue::from(left));
                if let Some(trace) = TraceParent::current() {
                    let id = MetadataValue::try_from(trace.trace_id_hex()).unwrap();
                    response.metadata_mut().insert("x-trace-id", id);
                }
                if let Some(state) = keel_core::trace::TraceState::current() {
                    let state = MetadataValue::try_from(state.as_str()).unwrap();
                    response.metadata_mut().insert("x-tracestate", state);
                }
            }
            "slow" => tokio::time::sleep(Duration::from_secs(2)).await,
            // Slow on its first call only: what a hedge is for.
            "slow-first" if n == 0 => tokio::time::sleep(Duration::from_secs(2)).await,
            "needs-50ms" => {
                require_remaining(Duration::from_millis(50))?;
            }
            "down" => return Err(Status::unavailable("scripted: down")),
            "missing" => return Err(Status::not_found("scripted: no such thing")),
            // Down for its first two calls, then up.
            "flaky" if n < 2 => return Err(Status::unavailable("scripted: flaky")),
            _ => {}
        }
        self.seen.finished.fetch_add(1, Ordering::SeqCst);
        Ok(response)
    }

    type WatchStream = Pin<Box<dyn Stream<Item = Result<HealthCheckResponse, Status>> + Send>>;

    /// A message every 20 ms, forever.
    async fn watch(
        &self,
        _request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        self.seen.calls.fetch_add(1, Ordering::SeqCst);
        let seen = Arc::clone(&self.seen);
        let ticks = tokio_stream::wrappers::IntervalStream::new(tokio::time::interval(
            Duration::from_millis(20),
        ))
        .map(move |_| {
            seen.streamed.fetch_add(1, Ordering::SeqCst);
            Ok(serving())
        });
        Ok(Response::new(Box::pin(ticks)))
    }
}

/// A scripted server on loopback.
pub(crate) struct Server {
    pub(crate) addr: SocketAddr,
    pub(crate) seen: Arc<Seen>,
    pub(crate) task: JoinHandle<Result<(), tonic::transport::Error>>,
}

impl Server {
    /// With Keel's server layers, the deadline capped at `max`, drained by `drain`.
    pub(crate) async fn start(max: Duration, drain: &Drain) -> Self {
        let layer = DeadlineLayer::with_max(max).unwrap().drain(drain);
        let seen = Arc::new(Seen::default());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let service = HealthServer::new(Scripted {
            seen: Arc::clone(&seen),
        });
        let task = tokio::spawn(
            tonic::transport::Server::builder()
                .layer(layer)
                .layer(TraceContextLayer::new())
                .add_service(service)
                .serve_with_incoming_shutdown(TcpListenerStream::new(listener), drain.closing()),
        );
        Self { addr, seen, task }
    }

    /// A channel to it.
    pub(crate) async fn channel(&self) -> Channel {
        Endpoint::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    pub(crate) fn calls(&self) -> usize {
        self.seen.calls.load(Ordering::SeqCst)
    }

    pub(crate) fn finished(&self) -> usize {
        self.seen.finished.load(Ordering::SeqCst)
    }
}

/// A request for the scripted behaviour `script`.
pub(crate) fn ask(script: &str) -> Request<HealthCheckRequest> {
    Request::new(HealthCheckRequest {
        service: script.to_owned(),
    })
}
