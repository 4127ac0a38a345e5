//! What Keel's gRPC layers cost on a unary call over loopback, beside
//! plain tonic in the same run. Each figure is one `grpc.health.v1.Health/Check`
//! call, client to server and back over a real HTTP/2 connection:
//!
//! - `plain_tonic`: tonic's client and server, nothing else;
//! - `keel_edge`: the server's `DeadlineLayer` + `TraceContextLayer` and the
//!   client's `PropagationLayer`, the call made under a deadline (so
//!   `grpc-timeout` and `traceparent` are written, read and scoped);
//! - `keel_policies`: `keel_edge` plus the client stack of the crate's docs:
//!   the replayable body, a retry (3 attempts, `grpc_verdict`) and a breaker
//!   (`GrpcStatus`), on a call that succeeds.
//!
//! Run: `cargo bench -p keel-grpc --bench unary`

use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use keel_core::Deadline;
use keel_grpc::client::PropagationLayer;
use keel_grpc::replay::{ChannelBodyLayer, ReplayBodyLayer};
use keel_grpc::server::{DeadlineLayer, TraceContextLayer};
use keel_policy::breaker::CircuitBreaker;
use keel_policy::retry::{Retry, grpc_verdict};
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::transport::{Channel, Endpoint, Server};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

type Stack = tower::util::BoxCloneService<
    http::Request<tonic::body::Body>,
    http::Response<tonic::body::Body>,
    tonic::Status,
>;

async fn serve(keel: bool) -> Channel {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (_reporter, health) = tonic_health::server::health_reporter();
    let incoming = TcpListenerStream::new(listener);
    if keel {
        let server = Server::builder()
            .layer(DeadlineLayer::new())
            .layer(TraceContextLayer::new())
            .add_service(health);
        tokio::spawn(server.serve_with_incoming(incoming));
    } else {
        tokio::spawn(
            Server::builder()
                .add_service(health)
                .serve_with_incoming(incoming),
        );
    }
    Endpoint::from_shared(format!("http://{addr}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("connect")
}

fn with_policies(channel: Channel) -> Stack {
    let retry = Retry::builder("bench")
        .max_attempts(3)
        .retry_on_result(grpc_verdict::<tonic::body::Body>)
        .build()
        .expect("retry");
    let breaker = CircuitBreaker::builder("bench").build().expect("breaker");
    tower::util::BoxCloneService::new(
        tower::ServiceBuilder::new()
            .layer(PropagationLayer::new())
            .layer(ReplayBodyLayer::new())
            .layer(retry.layer())
            .layer(breaker.grpc_layer())
            .layer(ChannelBodyLayer)
            .service(channel),
    )
}

fn request() -> HealthCheckRequest {
    HealthCheckRequest {
        service: String::new(),
    }
}

fn unary(c: &mut Criterion) {
    // One thread for client and servers: on 2 cores, a multi-threaded
    // runtime's cross-thread wake-ups made the figures swing by ±20%.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let (plain, edge, policies) = runtime.block_on(async {
        let plain = HealthClient::new(serve(false).await);
        let keel_channel = serve(true).await;
        let edge = HealthClient::new(
            tower::ServiceBuilder::new()
                .layer(PropagationLayer::new())
                .service(keel_channel.clone()),
        );
        let policies = HealthClient::new(with_policies(keel_channel));
        (plain, edge, policies)
    });
    let mut group = c.benchmark_group("unary");
    group.bench_function("plain_tonic", |b| {
        b.to_async(&runtime).iter(|| {
            let mut client = plain.clone();
            async move { client.check(request()).await.expect("check") }
        });
    });
    group.bench_function("keel_edge", |b| {
        b.to_async(&runtime).iter(|| {
            let mut client = edge.clone();
            Deadline::after(Duration::from_secs(5))
                .scope(async move { client.check(request()).await.expect("check") })
        });
    });
    group.bench_function("keel_policies", |b| {
        b.to_async(&runtime).iter(|| {
            let mut client = policies.clone();
            Deadline::after(Duration::from_secs(5))
                .scope(async move { client.check(request()).await.expect("check") })
        });
    });
    group.finish();
}

criterion_group!(benches, unary);
criterion_main!(benches);
