//! One order, one story: `keel serve` exports its spans over OTLP to a
//! receiver on loopback, and the spans of one order placed over HTTP are
//! asserted as a graph, on the embedded defaults and on PostgreSQL + NATS.
//!
//! The story: the server span (a child of the caller's `traceparent`), the
//! outbox's producer span under it, the relay's batch span and the
//! consumer's span each *linked* to the producer (a consumer is a new
//! trace, not nested), the saga's step spans under the consumer, the gRPC
//! call to shipping under its step, and the webhook attempt under the
//! consumer that queued it. `tracestate` crosses the broker on the link; a
//! malformed `traceparent` starts a new trace.

mod common;

use std::collections::{HashMap, HashSet};

use common::{ACME_KEY, Server, eventually, ok_receiver, order, otlp_receiver, serve_on};
use keel_testkit::services::{self, ServerLock, Service};
use opentelemetry_proto::tonic::trace::v1::Span;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use serde_json::json;

const CALLER_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";
const TRACESTATE: &str = "shop=t61rcWkgMzE,rojo=00f067aa0ba902b7";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn kind(span: &Span) -> SpanKind {
    SpanKind::try_from(span.kind).unwrap_or(SpanKind::Unspecified)
}

fn attr(span: &Span, key: &str) -> Option<String> {
    let kv = span.attributes.iter().find(|kv| kv.key == key)?;
    let value = kv.value.as_ref()?.value.as_ref()?;
    Some(match value {
        opentelemetry_proto::tonic::common::v1::any_value::Value::StringValue(s) => s.clone(),
        other => format!("{other:?}"),
    })
}

/// The spans as a graph: by span id, and each span's neighbours through
/// parent and link edges, either way.
struct Story {
    by_id: HashMap<Vec<u8>, Span>,
}

impl Story {
    fn new(spans: &[Span]) -> Self {
        let by_id = spans
            .iter()
            .map(|s| (s.span_id.clone(), s.clone()))
            .collect();
        Self { by_id }
    }

    fn one(&self, what: &str, pick: impl Fn(&Span) -> bool) -> &Span {
        let found: Vec<_> = self.by_id.values().filter(|s| pick(s)).collect();
        assert_eq!(found.len(), 1, "exactly one {what}: {:#?}", self.names());
        found[0]
    }

    fn all(&self, pick: impl Fn(&Span) -> bool) -> Vec<&Span> {
        self.by_id.values().filter(|s| pick(s)).collect()
    }

    fn names(&self) -> Vec<String> {
        let mut names: Vec<_> = self
            .by_id
            .values()
            .map(|s| format!("{} ({:?})", s.name, kind(s)))
            .collect();
        names.sort();
        names
    }

    /// The spans as trees, one per trace root, for a failing run's output.
    fn tree(&self) -> String {
        let mut out = String::new();
        let mut roots: Vec<_> = self.all(|s| self.parent(s).is_none());
        roots.sort_by_key(|s| s.start_time_unix_nano);
        for root in roots {
            self.draw(root, 0, &mut out);
        }
        out
    }

    fn draw(&self, span: &Span, depth: usize, out: &mut String) {
        let links: Vec<_> = span
            .links
            .iter()
            .filter_map(|l| self.by_id.get(&l.span_id).map(|s| s.name.clone()))
            .collect();
        out.push_str(&format!(
            "{}{} ({:?}) trace {} links {links:?}\n",
            "  ".repeat(depth),
            span.name,
            kind(span),
            &hex(&span.trace_id)[..8]
        ));
        let mut children = self.all(|s| s.parent_span_id == span.span_id);
        children.sort_by_key(|s| s.start_time_unix_nano);
        for child in children {
            self.draw(child, depth + 1, out);
        }
    }

    fn parent(&self, span: &Span) -> Option<&Span> {
        self.by_id.get(&span.parent_span_id)
    }

    fn links_to(&self, span: &Span, to: &Span) -> bool {
        span.links
            .iter()
            .any(|l| l.span_id == to.span_id && l.trace_id == to.trace_id)
    }

    /// Every span reachable from `from` through parent and link edges.
    fn connected(&self, from: &Span) -> HashSet<Vec<u8>> {
        let mut edges: HashMap<Vec<u8>, Vec<Vec<u8>>> = HashMap::new();
        for s in self.by_id.values() {
            let others = std::iter::once(s.parent_span_id.clone())
                .chain(s.links.iter().map(|l| l.span_id.clone()));
            for other in others.filter(|o| self.by_id.contains_key(o)) {
                edges
                    .entry(s.span_id.clone())
                    .or_default()
                    .push(other.clone());
                edges.entry(other).or_default().push(s.span_id.clone());
            }
        }
        let mut seen = HashSet::from([from.span_id.clone()]);
        let mut next = vec![from.span_id.clone()];
        while let Some(id) = next.pop() {
            for n in edges.get(&id).into_iter().flatten() {
                if seen.insert(n.clone()) {
                    next.push(n.clone());
                }
            }
        }
        seen
    }
}

async fn webhook_endpoint(http: &reqwest::Client, s: &Server, url: &str) {
    let created = http
        .post(format!("{}/webhook-endpoints", s.url))
        .bearer_auth(ACME_KEY)
        .json(&json!({"url": url, "eventTypes": ["order.completed"]}))
        .send()
        .await
        .unwrap();
    assert!(created.status().is_success(), "{}", created.status());
}

/// Places one order with a caller's trace, waits for its webhook and the
/// spans of its whole story, and asserts them as a graph.
async fn one_order_is_one_connected_story(backend: &[String]) {
    let (otlp, spans) = otlp_receiver().await;
    let s = serve_on(
        backend,
        &["--allow-loopback-webhooks", "--otlp-endpoint", &otlp],
    );
    let http = reqwest::Client::new();
    let (hook, received) = ok_receiver().await;
    webhook_endpoint(&http, &s, &hook).await;

    let placed = http
        .post(format!("{}/orders", s.url))
        .header("idempotency-key", "trace-1")
        .header("traceparent", format!("00-{CALLER_TRACE}-{CALLER_SPAN}-01"))
        .header("tracestate", TRACESTATE)
        .json(&order("tracer"))
        .send()
        .await
        .unwrap();
    assert_eq!(placed.status(), 201);
    eventually("the order's webhook", || async {
        !received.lock().is_empty()
    })
    .await;
    // Spans arrive as they end, in batches: the consumer that queued the
    // webhook may end after the attempt did.
    eventually("the webhook attempt's span and its parent", || async {
        let spans = spans.lock();
        let story = Story::new(&spans);
        spans
            .iter()
            .any(|s| s.name.starts_with("webhook ") && story.parent(s).is_some())
    })
    .await;
    let story = Story::new(&spans.lock());
    eprintln!("{}", story.tree());

    let server = story.one("server span of POST /orders", |s| {
        kind(s) == SpanKind::Server && s.name == "POST /orders"
    });
    assert_eq!(hex(&server.trace_id), CALLER_TRACE, "the caller's trace");
    assert_eq!(
        hex(&server.parent_span_id),
        CALLER_SPAN,
        "under the caller's span"
    );
    assert_eq!(
        attr(server, "http.response.status_code").as_deref(),
        Some("IntValue(201)")
    );

    let created = story.one("producer span of orders", |s| {
        kind(s) == SpanKind::Producer && s.name == "create orders"
    });
    assert_eq!(
        story.parent(created).map(|p| &p.span_id),
        Some(&server.span_id),
        "created under {:?} ({}), trace {}",
        story.parent(created).map(|p| &p.name),
        hex(&created.parent_span_id),
        hex(&created.trace_id)
    );

    let relay = story.all(|s| kind(s) == SpanKind::Producer && s.name.starts_with("send "));
    assert!(
        relay.iter().any(|r| story.links_to(r, created)),
        "a relay batch links the event it sent: {:#?}",
        story.names()
    );

    let consumer = story.one("fulfilment's consumer span", |s| {
        kind(s) == SpanKind::Consumer
            && s.name == "process orders"
            && story.links_to(s, created)
            && attr(s, "messaging.consumer.group.name").as_deref() == Some("fulfilment")
    });
    assert!(consumer.parent_span_id.is_empty(), "linked, not nested");
    assert_ne!(consumer.trace_id, server.trace_id, "a trace of its own");
    let link = consumer
        .links
        .iter()
        .find(|l| l.span_id == created.span_id)
        .unwrap();
    assert_eq!(
        link.trace_state, TRACESTATE,
        "tracestate crossed the broker"
    );

    let steps = story.all(|s| attr(s, "keel.saga.step").is_some());
    assert!(!steps.is_empty(), "saga steps: {:#?}", story.names());
    for step in &steps {
        assert_eq!(
            story.parent(step).map(|p| &p.span_id),
            Some(&consumer.span_id),
            "the saga's steps are children of the delivery that started it"
        );
    }
    let grpc_client = story.one("CreateShipment client span", |s| {
        kind(s) == SpanKind::Client && s.name == "shipping.v1.Shipping/CreateShipment"
    });
    let step = story.parent(grpc_client).expect("the call's step");
    assert!(
        attr(step, "keel.saga.step").is_some(),
        "called from a saga step"
    );
    let grpc_server = story.one("CreateShipment server span", |s| {
        kind(s) == SpanKind::Server && s.name == "shipping.v1.Shipping/CreateShipment"
    });
    assert_eq!(
        story.parent(grpc_server).map(|p| &p.span_id),
        Some(&grpc_client.span_id)
    );

    let webhook = story.one("webhook attempt", |s| s.name == "webhook order.completed");
    assert_eq!(kind(webhook), SpanKind::Client);
    let queued_by = story.parent(webhook).expect("the delivery that queued it");
    assert_eq!(kind(queued_by), SpanKind::Consumer);

    let reached = story.connected(server);
    for (what, span) in [
        ("producer", created),
        ("consumer", consumer),
        ("gRPC server", grpc_server),
        ("webhook", webhook),
    ] {
        assert!(
            reached.contains(&span.span_id),
            "the {what} span is in the story"
        );
    }
    for step in steps {
        assert!(
            reached.contains(&step.span_id),
            "saga step {} is in the story",
            step.name
        );
    }

    let fresh = http
        .post(format!("{}/orders", s.url))
        .header("idempotency-key", "trace-2")
        .header("traceparent", "00-not-a-trace-01")
        .json(&order("tracer"))
        .send()
        .await
        .unwrap();
    assert_eq!(fresh.status(), 201, "a broken tracer never fails an order");
    let trace = fresh.headers()["x-trace-id"].to_str().unwrap().to_owned();
    eventually("the new trace's server span", || async {
        spans
            .lock()
            .iter()
            .any(|s| hex(&s.trace_id) == trace && kind(s) == SpanKind::Server)
    })
    .await;
    let root = Story::new(&spans.lock())
        .one("the new trace's server span", |s| {
            hex(&s.trace_id) == trace && kind(s) == SpanKind::Server
        })
        .clone();
    assert!(
        root.parent_span_id.is_empty(),
        "a new trace starts at the server"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_order_is_one_connected_story_on_the_embedded_defaults() {
    one_order_is_one_connected_story(&[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_order_is_one_connected_story_on_postgres_and_nats() {
    let (Some(pg), Some(nats)) = (services::postgres_url(), services::nats_url()) else {
        return;
    };
    let _pg = ServerLock::shared(Service::Postgres);
    let _nats = ServerLock::shared(Service::Nats);
    let id = uuid::Uuid::now_v7().simple().to_string();
    let mut backend = vec![
        "--database-url".to_owned(),
        pg.clone(),
        "--broker".to_owned(),
        nats,
        "--pg-schema".to_owned(),
        format!("keel_tr_{id}"),
        "--stream-prefix".to_owned(),
        format!("tr_{}", &id[id.len() - 24..]),
    ];
    // The dependencies in a database of their own: the story crosses it.
    backend.extend([
        "--dependencies-database-url".to_owned(),
        scratch_database(&pg, &format!("keel_deps_{id}")).await,
    ]);
    one_order_is_one_connected_story(&backend).await;
}

/// Creates database `name` on the server of `url`; returns its URL.
async fn scratch_database(url: &str, name: &str) -> String {
    use sqlx::Connection;
    let mut admin = sqlx::PgConnection::connect(url).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .unwrap();
    let (server, _) = url.rsplit_once('/').unwrap();
    format!("{server}/{name}")
}
