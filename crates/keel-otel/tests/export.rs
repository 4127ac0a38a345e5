//! The export path against real parts: Keel's span ids are the exported
//! ones, the queue drops (and counts) rather than waits, and spans reach an
//! OTLP receiver over loopback (or, with the receiver gone, cost only
//! their drop count).

use std::sync::Arc;
use std::sync::mpsc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::State;
use axum::routing::post;
use keel_core::TraceParent;
use keel_core::trace::span;
use keel_otel::{OtlpExport, OtlpProtocol, SpanQueue, otel_layer};
use opentelemetry::trace::{SpanKind, TracerProvider as _};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData, SpanExporter};
use parking_lot::Mutex;
use prost::Message as _;
use tracing_subscriber::layer::SubscriberExt as _;

const CALLER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

fn in_memory() -> (SdkTracerProvider, InMemorySpanExporter) {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    (provider, exporter)
}

fn subscriber(provider: &SdkTracerProvider) -> impl tracing::Subscriber + Send + Sync {
    tracing_subscriber::registry().with(otel_layer(provider.tracer("test")))
}

#[test]
fn the_ids_keel_carries_on_are_the_exported_spans_ids() {
    let (provider, exporter) = in_memory();
    let caller: TraceParent = CALLER.parse().unwrap();
    let (server, consumer) = tracing::subscriber::with_default(subscriber(&provider), || {
        let s = tracing::info_span!("server", otel.kind = "server");
        let server = span::child(&s, Some(&caller), None);
        drop(s);
        let c = tracing::info_span!("consumer", otel.kind = "consumer");
        let consumer = span::linked(&c, Some(&server), None);
        drop(c);
        (server, consumer)
    });
    let spans = exporter.get_finished_spans().unwrap();
    let find = |name: &str| spans.iter().find(|s| s.name == name).unwrap().clone();
    let s = find("server");
    assert_eq!(s.span_kind, SpanKind::Server);
    assert_eq!(s.span_context.trace_id().to_bytes(), caller.trace_id());
    assert_eq!(
        s.parent_span_id.to_bytes(),
        caller.parent_id(),
        "child of the caller"
    );
    assert_eq!(
        s.span_context.span_id().to_bytes(),
        server.parent_id(),
        "the id Keel sends on"
    );
    let c = find("consumer");
    assert_eq!(c.span_kind, SpanKind::Consumer);
    assert_ne!(
        c.span_context.trace_id(),
        s.span_context.trace_id(),
        "a trace of its own"
    );
    assert_eq!(c.span_context.trace_id().to_bytes(), consumer.trace_id());
    assert!(
        !c.parent_span_id.to_bytes().iter().any(|b| *b != 0),
        "a root, not nested"
    );
    let link = &c.links.links[0].span_context;
    assert_eq!(
        (link.trace_id().to_bytes(), link.span_id().to_bytes()),
        (server.trace_id(), server.parent_id()),
        "linked to the producer"
    );
}

#[test]
fn spans_that_do_not_say_their_kind_stay_in_the_logs() {
    let (provider, exporter) = in_memory();
    tracing::subscriber::with_default(subscriber(&provider), || {
        let outer = tracing::info_span!("log context");
        let _in = outer.enter();
        let s = tracing::info_span!("work", otel.kind = "internal");
        span::child(&s, None, None);
    });
    let names: Vec<_> = exporter
        .get_finished_spans()
        .unwrap()
        .into_iter()
        .map(|s| s.name.into_owned())
        .collect();
    assert_eq!(names, ["work"]);
}

/// An exporter that tells when it is exporting and waits to be let go.
#[derive(Debug)]
struct Stuck {
    exporting: mpsc::SyncSender<()>,
    release: Arc<Mutex<mpsc::Receiver<()>>>,
}

impl SpanExporter for Stuck {
    async fn export(&self, _batch: Vec<SpanData>) -> OTelSdkResult {
        let _ = self.exporting.try_send(());
        let _ = self.release.lock().recv();
        Ok(())
    }
}

fn ended(provider: &SdkTracerProvider, n: usize) {
    tracing::subscriber::with_default(subscriber(provider), || {
        for _ in 0..n {
            let s = tracing::info_span!("s", otel.kind = "internal");
            span::child(&s, None, None);
        }
    });
}

#[test]
fn a_full_queue_drops_and_counts_instead_of_waiting() {
    let (exporting, started) = mpsc::sync_channel(8);
    let (release, released) = mpsc::channel();
    let release_rx = Arc::new(Mutex::new(released));
    let queue = SpanQueue::start(
        move || {
            Ok(Stuck {
                exporting,
                release: release_rx,
            })
        },
        4,
        1,
        Duration::from_millis(10),
    )
    .unwrap();
    let counts = queue.counts();
    let provider = SdkTracerProvider::builder()
        .with_span_processor(queue)
        .build();
    ended(&provider, 1);
    started.recv().unwrap();
    // One span is being exported, stuck; four fit in the queue.
    ended(&provider, 4 + 3);
    assert_eq!(counts.queue_full(), 3, "dropped at once, not waited for");
    for _ in 0..5 {
        release.send(()).unwrap();
    }
    provider.force_flush().unwrap();
    assert_eq!((counts.exported(), counts.dropped()), (5, 3));
}

/// A receiver of OTLP/HTTP trace exports on loopback.
async fn receiver() -> (String, Arc<Mutex<Vec<ExportTraceServiceRequest>>>) {
    let got: Arc<Mutex<Vec<ExportTraceServiceRequest>>> = Arc::default();
    let app = axum::Router::new()
        .route(
            "/v1/traces",
            post(
                |State(got): State<Arc<Mutex<Vec<ExportTraceServiceRequest>>>>, body: Bytes| async move {
                    let request = ExportTraceServiceRequest::decode(body).unwrap();
                    got.lock().push(request);
                    ([("content-type", "application/x-protobuf")], Vec::<u8>::new())
                },
            ),
        )
        .with_state(Arc::clone(&got));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_an_otlp_receiver_with_their_service_and_link() {
    let (url, got) = receiver().await;
    let exporting = OtlpExport::new()
        .endpoint(&url)
        .service_name("keel-test")
        .start()
        .unwrap();
    let provider = exporting.provider().clone();
    let caller: TraceParent = CALLER.parse().unwrap();
    tracing::subscriber::with_default(subscriber(&provider), || {
        let s = tracing::info_span!(
            "process orders",
            otel.kind = "consumer",
            "messaging.destination.name" = "orders"
        );
        span::linked(&s, Some(&caller), None);
    });
    let counts = exporting.counts();
    tokio::task::spawn_blocking(move || exporting.shutdown())
        .await
        .unwrap();
    assert_eq!((counts.exported(), counts.dropped()), (1, 0));
    let got = got.lock();
    let resource = got[0].resource_spans[0].resource.as_ref().unwrap();
    assert!(
        resource
            .attributes
            .iter()
            .any(|kv| kv.key == "service.name" && format!("{:?}", kv.value).contains("keel-test"))
    );
    let span = &got[0].resource_spans[0].scope_spans[0].spans[0];
    assert_eq!(span.name, "process orders");
    assert!(
        span.attributes
            .iter()
            .any(|kv| kv.key == "messaging.destination.name")
    );
    assert_eq!(span.links[0].trace_id, caller.trace_id());
    assert_eq!(span.links[0].span_id, caller.parent_id());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_collector_costs_only_dropped_spans() {
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", dead.local_addr().unwrap());
    drop(dead);
    let exporting = OtlpExport::new()
        .endpoint(&url)
        .timeout(Duration::from_secs(1))
        .start()
        .unwrap();
    let provider = exporting.provider().clone();
    ended(&provider, 1_000);
    let counts = exporting.counts();
    tokio::task::spawn_blocking(move || exporting.shutdown())
        .await
        .unwrap();
    assert_eq!(counts.exported(), 0);
    assert_eq!(counts.dropped(), 1_000, "every span counted, none kept");
}

/// A collector's gRPC trace service on loopback.
#[derive(Clone, Default)]
struct GrpcCollector(Arc<Mutex<Vec<ExportTraceServiceRequest>>>);

#[tonic::async_trait]
impl TraceService for GrpcCollector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.lock().push(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_a_grpc_collector() {
    let collector = GrpcCollector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener);
    let service = TraceServiceServer::new(collector.clone());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service)
            .serve_with_incoming(incoming),
    );
    let exporting = OtlpExport::new()
        .endpoint(&url)
        .protocol(OtlpProtocol::Grpc)
        .start()
        .unwrap();
    ended(exporting.provider(), 3);
    let counts = exporting.counts();
    tokio::task::spawn_blocking(move || exporting.shutdown())
        .await
        .unwrap();
    assert_eq!((counts.exported(), counts.dropped()), (3, 0));
    let got = collector.0.lock();
    let spans: usize = got
        .iter()
        .flat_map(|r| &r.resource_spans)
        .flat_map(|r| &r.scope_spans)
        .map(|s| s.spans.len())
        .sum();
    assert_eq!(spans, 3);
}
