//! Sending webhooks to a real loopback receiver (axum on 127.0.0.1:0,
//! allowed through the SSRF guard's allow-list), with the real SqliteStore
//! on a temporary file and a manual wall clock for the hours-long schedule.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use base64::Engine;
use chrono::{DateTime, Utc};
use hmac::{Hmac, Mac};
use keel_policy::retry::Backoff;
use keel_sqlite::SqliteStore;
use keel_store::Store;
use keel_store::{WebhookDeliveryStore, WebhookEndpointStore};
use keel_testkit::metrics::MetricsRecorder;
use keel_webhooks::signing::{Secret, SignatureScheme, Verifier, VerifyError};
use keel_webhooks::ssrf::SsrfGuard;
use keel_webhooks::{
    DEFAULT_SCHEDULE, DeliveryFilter, DeliveryStatus, DeliveryWorker, DisableReason, Endpoints,
    NewEndpoint, WallClock, WebhookDelivery, WebhookEndpoint, WebhookError, WebhookEvent,
    WebhookOutbox, WebhookReceiver, WorkerOptions,
};
use parking_lot::Mutex;
use sha2::Sha256;
use tempfile::TempDir;
use tokio::net::TcpListener;

// ---------------------------------------------------------------- receiver

/// What the test receiver answers.
#[derive(Debug, Clone)]
struct Reply {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: String,
    delay: Duration,
}

impl Reply {
    fn status(status: u16) -> Self {
        Self {
            status,
            headers: Vec::new(),
            body: String::new(),
            delay: Duration::ZERO,
        }
    }

    fn header(mut self, name: &'static str, value: impl Into<String>) -> Self {
        self.headers.push((name, value.into()));
        self
    }

    fn body(mut self, body: impl Into<String>) -> Self {
        self.body = body.into();
        self
    }

    fn delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }
}

#[derive(Debug, Clone)]
struct Received {
    path: String,
    headers: HeaderMap,
    body: Bytes,
}

/// A scripted loopback receiver: answers from its script, then the fallback.
#[derive(Clone)]
struct Hooks {
    inner: Arc<HooksInner>,
}

struct HooksInner {
    received: Mutex<Vec<Received>>,
    script: Mutex<VecDeque<Reply>>,
    fallback: Mutex<Reply>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

impl Hooks {
    async fn start() -> (Self, SocketAddr) {
        let hooks = Self {
            inner: Arc::new(HooksInner {
                received: Mutex::new(Vec::new()),
                script: Mutex::new(VecDeque::new()),
                fallback: Mutex::new(Reply::status(200).body("ok")),
                in_flight: AtomicUsize::new(0),
                max_in_flight: AtomicUsize::new(0),
            }),
        };
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind loopback");
        let addr = listener.local_addr().expect("addr");
        let app = Router::new().fallback(answer).with_state(hooks.clone());
        tokio::spawn(async move {
            axum::serve(listener, app).await.expect("serve");
        });
        (hooks, addr)
    }

    fn script(&self, replies: impl IntoIterator<Item = Reply>) {
        self.inner.script.lock().extend(replies);
    }

    fn fallback(&self, reply: Reply) {
        *self.inner.fallback.lock() = reply;
    }

    fn received(&self) -> Vec<Received> {
        self.inner.received.lock().clone()
    }

    fn max_in_flight(&self) -> usize {
        self.inner.max_in_flight.load(Ordering::SeqCst)
    }
}

async fn answer(State(hooks): State<Hooks>, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let now = hooks.inner.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    hooks.inner.max_in_flight.fetch_max(now, Ordering::SeqCst);
    hooks.inner.received.lock().push(Received {
        path: uri.path().to_owned(),
        headers,
        body,
    });
    let reply = hooks
        .inner
        .script
        .lock()
        .pop_front()
        .unwrap_or_else(|| hooks.inner.fallback.lock().clone());
    if !reply.delay.is_zero() {
        tokio::time::sleep(reply.delay).await;
    }
    hooks.inner.in_flight.fetch_sub(1, Ordering::SeqCst);
    let mut response = (
        StatusCode::from_u16(reply.status).expect("status"),
        reply.body,
    )
        .into_response();
    for (name, value) in reply.headers {
        response
            .headers_mut()
            .insert(name, value.parse().expect("header value"));
    }
    response
}

// ---------------------------------------------------------------- metrics

/// The counter `name` with the label `label` (`key=value`), summed.
fn counter(name: &str, label: &str) -> u64 {
    MetricsRecorder::global().sum(name, label)
}

// ---------------------------------------------------------------- fixture

fn start_time() -> DateTime<Utc> {
    DateTime::parse_from_rfc3339("2026-11-29T10:00:00Z")
        .expect("time")
        .with_timezone(&Utc)
}

fn loopback_guard() -> SsrfGuard {
    SsrfGuard::new().allow("127.0.0.1/32".parse().expect("network"))
}

struct Fx {
    store: SqliteStore,
    _dir: TempDir,
    clock: WallClock,
    endpoints: Endpoints<SqliteStore>,
    outbox: WebhookOutbox<SqliteStore>,
    hooks: Hooks,
    addr: SocketAddr,
}

async fn fx() -> Fx {
    MetricsRecorder::global();
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("keel.db"))
        .await
        .expect("open store");
    let clock = WallClock::manual(start_time());
    let (hooks, addr) = Hooks::start().await;
    Fx {
        endpoints: Endpoints::new(store.clone(), loopback_guard()).clock(clock.clone()),
        outbox: WebhookOutbox::new(store.clone()).clock(clock.clone()),
        store,
        _dir: dir,
        clock,
        hooks,
        addr,
    }
}

impl Fx {
    /// Worker options: loopback allowed, the manual clock, the default
    /// schedule without jitter (so the exact times can be asserted).
    fn options(&self) -> WorkerOptions {
        WorkerOptions::new()
            .name("worker-1")
            .guard(loopback_guard())
            .clock(self.clock.clone())
            .backoff(Backoff::schedule(DEFAULT_SCHEDULE).expect("schedule"))
            .timeout(Duration::from_secs(5))
    }

    fn worker(&self) -> DeliveryWorker<SqliteStore> {
        DeliveryWorker::new(self.store.clone(), self.options()).expect("worker")
    }

    async fn endpoint(&self, path: &str) -> (WebhookEndpoint, Secret) {
        self.endpoints
            .create(
                NewEndpoint::new(format!("http://{}{path}", self.addr))
                    .description("test receiver"),
            )
            .await
            .expect("create endpoint")
    }

    async fn send(&self, events: &[WebhookEvent]) -> u64 {
        let mut tx = self.store.begin().await.expect("begin");
        let queued = self.outbox.enqueue(&mut tx, events).await.expect("enqueue");
        self.store.commit(tx).await.expect("commit");
        queued
    }

    async fn delivery(&self, event_id: &str) -> WebhookDelivery {
        let list = self
            .endpoints
            .deliveries(&DeliveryFilter {
                event_id: Some(event_id.to_owned()),
                ..DeliveryFilter::default()
            })
            .await
            .expect("list");
        assert_eq!(list.len(), 1, "one delivery of {event_id}");
        list.into_iter().next().expect("delivery")
    }

    fn at(&self, secs: u64) -> DateTime<Utc> {
        start_time() + chrono::Duration::seconds(secs as i64)
    }
}

fn event(id: &str) -> WebhookEvent {
    WebhookEvent::new(
        "order.paid",
        serde_json::json!({ "orderId": id, "totalMinor": 8210 }),
    )
    .with_id(id)
    .occurred_at(start_time())
}

fn header<'a>(r: &'a Received, name: &str) -> &'a str {
    r.headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
}

// ---------------------------------------------------------------- tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivers_a_signed_request_and_logs_it() {
    let f = fx().await;
    let (endpoint, secret) = f.endpoint("/hooks").await;
    let queued = f.send(&[event("evt_1").with_sequence(41)]).await;
    assert_eq!(queued, 1);

    let report = f.worker().run_once().await.expect("run");
    assert_eq!((report.attempted, report.succeeded), (1, 1));

    let received = f.hooks.received();
    assert_eq!(received.len(), 1);
    let request = &received[0];
    assert_eq!(request.path, "/hooks");
    assert_eq!(header(request, "webhook-id"), "evt_1");
    assert_eq!(
        header(request, "webhook-timestamp"),
        start_time().timestamp().to_string()
    );
    assert_eq!(header(request, "content-type"), "application/json");
    assert!(header(request, "user-agent").starts_with("keel-webhooks/"));
    // The signature verifies over the raw body with the endpoint's secret.
    let verified = Verifier::new([secret.clone()])
        .verify(&request.headers, &request.body, start_time().timestamp())
        .expect("signature verifies");
    assert_eq!(verified.id, "evt_1");
    // Recomputed independently: base64(HMAC-SHA256(key, "id.ts.body")).
    let mut mac = Hmac::<Sha256>::new_from_slice(secret.key()).expect("key");
    mac.update(format!("evt_1.{}.", start_time().timestamp()).as_bytes());
    mac.update(&request.body);
    let expected = format!(
        "v1,{}",
        base64::engine::general_purpose::STANDARD.encode(mac.finalize().into_bytes())
    );
    assert_eq!(header(request, "webhook-signature"), expected);

    // The body: an event id, the type, when it occurred, the sequence.
    let body: serde_json::Value = serde_json::from_slice(&request.body).expect("json");
    assert_eq!(body["id"], "evt_1");
    assert_eq!(body["type"], "order.paid");
    assert_eq!(body["timestamp"], "2026-11-29T10:00:00.000Z");
    assert_eq!(body["sequence"], 41);
    assert_eq!(body["data"]["orderId"], "evt_1");

    let delivery = f.delivery("evt_1").await;
    assert_eq!(
        (delivery.status, delivery.attempts),
        (DeliveryStatus::Succeeded, 1)
    );
    assert_eq!(delivery.endpoint_id, endpoint.id);
    let attempts = f.endpoints.attempts(delivery.id).await.expect("attempts");
    assert_eq!(attempts.len(), 1);
    let logged = &attempts[0];
    assert_eq!(logged.response_status, Some(200));
    assert_eq!(logged.response_body.as_deref(), Some("ok"));
    assert_eq!(logged.url, format!("http://{}/hooks", f.addr));
    assert_eq!(logged.at, start_time());
    assert!(logged.latency > Duration::ZERO);
    assert_eq!(logged.error, None);
    let names: Vec<&str> = logged
        .request_headers
        .iter()
        .map(|(k, _)| k.as_str())
        .collect();
    for name in [
        "content-type",
        "user-agent",
        "webhook-id",
        "webhook-timestamp",
        "webhook-signature",
    ] {
        assert!(names.contains(&name), "{name} logged: {names:?}");
    }
    assert!(
        f.worker().run_once().await.expect("run").attempted == 0,
        "sent once"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_are_queued_never_sent_inline_and_roll_back_with_the_caller() {
    let f = fx().await;
    f.endpoint("/hooks").await;
    let mut tx = f.store.begin().await.expect("begin");
    f.outbox
        .enqueue(&mut tx, &[event("evt_rolled_back")])
        .await
        .expect("enqueue");
    // Queued in the caller's transaction: nothing was sent by enqueueing.
    assert!(f.hooks.received().is_empty());
    f.store.rollback(tx).await.expect("rollback");
    assert_eq!(f.worker().run_once().await.expect("run").attempted, 0);
    assert!(
        f.hooks.received().is_empty(),
        "a rolled-back event is never announced"
    );

    f.send(&[event("evt_committed")]).await;
    assert!(
        f.hooks.received().is_empty(),
        "still not sent until a worker runs"
    );
    assert_eq!(f.worker().run_once().await.expect("run").succeeded, 1);
    assert_eq!(f.hooks.received().len(), 1);

    // A redelivered event (same id) is not queued twice.
    assert_eq!(f.send(&[event("evt_committed")]).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payload_over_the_cap_is_refused_at_enqueue() {
    let f = fx().await;
    f.endpoint("/hooks").await;
    let outbox = WebhookOutbox::new(f.store.clone()).max_payload(1024);
    let big = WebhookEvent::new(
        "report.ready",
        serde_json::json!({ "blob": "x".repeat(2000) }),
    );
    let mut tx = f.store.begin().await.expect("begin");
    let err = outbox
        .enqueue(&mut tx, &[event("evt_ok"), big])
        .await
        .expect_err("too large");
    assert!(
        matches!(err, WebhookError::PayloadTooLarge { limit: 1024, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("send an id"), "{err}");
    f.store.rollback(tx).await.expect("rollback");
    let long_type = WebhookEvent::new("t".repeat(256), serde_json::json!({}));
    let mut tx = f.store.begin().await.expect("begin");
    let err = f
        .outbox
        .enqueue(&mut tx, &[long_type])
        .await
        .expect_err("type too long");
    assert!(err.to_string().contains("1 to 255 characters"), "{err}");
    f.store.rollback(tx).await.expect("rollback");
    let bad_id = WebhookEvent::new("x", serde_json::json!({})).with_id("has space");
    let mut tx = f.store.begin().await.expect("begin");
    assert!(matches!(
        f.outbox.enqueue(&mut tx, &[bad_id]).await,
        Err(WebhookError::Invalid { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_500_is_retried_on_the_schedule() {
    let f = fx().await;
    f.endpoint("/hooks").await;
    f.hooks.script([Reply::status(500), Reply::status(502)]);
    f.send(&[event("evt_1")]).await;
    let worker = f.worker();

    let report = worker.run_once().await.expect("run");
    assert_eq!((report.attempted, report.retrying), (1, 1));
    let d = f.delivery("evt_1").await;
    assert_eq!((d.status, d.attempts), (DeliveryStatus::Pending, 1));
    assert_eq!(d.next_attempt_at, f.at(5), "first retry after 5 s");
    assert_eq!(d.leased_by, None);

    // Not due yet: nothing is sent.
    f.clock.advance(Duration::from_secs(4));
    assert_eq!(worker.run_once().await.expect("run").attempted, 0);
    f.clock.advance(Duration::from_secs(1));
    assert_eq!(worker.run_once().await.expect("run").retrying, 1);
    let d = f.delivery("evt_1").await;
    assert_eq!(d.attempts, 2);
    assert_eq!(d.next_attempt_at, f.at(5 + 300), "then after 5 minutes");

    f.clock.advance(Duration::from_secs(300));
    assert_eq!(worker.run_once().await.expect("run").succeeded, 1);
    let d = f.delivery("evt_1").await;
    assert_eq!((d.status, d.attempts), (DeliveryStatus::Succeeded, 3));
    let statuses: Vec<_> = f
        .endpoints
        .attempts(d.id)
        .await
        .expect("attempts")
        .iter()
        .map(|a| (a.attempt, a.response_status))
        .collect();
    assert_eq!(statuses, [(1, Some(500)), (2, Some(502)), (3, Some(200))]);
    // Every attempt carries the same webhook-id, and a fresh timestamp.
    let received = f.hooks.received();
    assert!(received.iter().all(|r| header(r, "webhook-id") == "evt_1"));
    let stamps: Vec<_> = received
        .iter()
        .map(|r| header(r, "webhook-timestamp").to_owned())
        .collect();
    assert_eq!(
        stamps,
        [0, 5, 305].map(|s| (start_time().timestamp() + s).to_string())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_default_schedule_spans_hours_with_jitter() {
    let options = WorkerOptions::new();
    let debug = format!("{options:?}");
    assert!(debug.contains("Proportional(0.2)"), "{debug}");
    let backoff = Backoff::schedule(DEFAULT_SCHEDULE)
        .expect("schedule")
        .with_jitter(keel_policy::retry::Jitter::Proportional(0.2))
        .expect("jitter");
    let total: Duration = DEFAULT_SCHEDULE.iter().sum();
    assert_eq!(
        total,
        Duration::from_secs(5 + 300 + 1800 + 7200 + 18_000 + 36_000 + 36_000)
    );
    for (i, nominal) in DEFAULT_SCHEDULE.iter().enumerate() {
        let d = backoff.delay(i as u32).expect("delay");
        let high = nominal.mul_f64(1.2).min(Duration::from_secs(36_000));
        assert!(
            d >= nominal.mul_f64(0.8) && d <= high,
            "retry {i}: {d:?} vs {nominal:?}"
        );
    }
    assert_eq!(backoff.delay(7), None, "eight attempts in all");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_after_is_honoured_within_bounds() {
    let f = fx().await;
    f.endpoint("/hooks").await;
    // The third answer asks for a time as an HTTP-date, 40 minutes after it.
    let third_at = f.at(120 + 3600);
    let asked = third_at + chrono::Duration::seconds(2400);
    f.hooks.script([
        Reply::status(503).header("retry-after", "120"),
        Reply::status(429).header("retry-after", "999999"),
        Reply::status(503).header("retry-after", asked.to_rfc2822().replace("+0000", "GMT")),
        Reply::status(503).header("retry-after", "1"),
    ]);
    f.send(&[event("evt_1")]).await;
    let worker = DeliveryWorker::new(
        f.store.clone(),
        f.options().max_retry_after(Duration::from_secs(3600)),
    )
    .expect("worker");

    worker.run_once().await.expect("run");
    let d = f.delivery("evt_1").await;
    assert_eq!(
        d.next_attempt_at,
        f.at(120),
        "Retry-After 120 beats the 5 s step"
    );

    f.clock.set(d.next_attempt_at);
    worker.run_once().await.expect("run");
    let d = f.delivery("evt_1").await;
    assert_eq!(
        d.next_attempt_at, third_at,
        "an absurd Retry-After is capped at 1 h"
    );

    f.clock.set(d.next_attempt_at);
    worker.run_once().await.expect("run");
    let d = f.delivery("evt_1").await;
    assert_eq!(
        d.next_attempt_at, asked,
        "an HTTP-date beyond the 30 min step is honoured"
    );

    f.clock.set(d.next_attempt_at);
    worker.run_once().await.expect("run");
    let d = f.delivery("evt_1").await;
    assert_eq!(
        d.next_attempt_at,
        asked + chrono::Duration::seconds(7200),
        "never sooner than the 2 h step"
    );
    let asked_headers: Vec<_> = f
        .hooks
        .received()
        .iter()
        .map(|r| header(r, "webhook-id").to_owned())
        .collect();
    assert_eq!(asked_headers.len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_410_disables_the_endpoint_with_an_event() {
    let f = fx().await;
    let (endpoint, _) = f.endpoint("/hooks").await;
    f.hooks.script([Reply::status(410)]);
    f.send(&[event("evt_1")]).await;
    let (tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let worker =
        DeliveryWorker::new(f.store.clone(), f.options().notify_disabled(tx)).expect("worker");

    let report = worker.run_once().await.expect("run");
    assert_eq!(report.disabled.len(), 1);
    let disabled = events.try_recv().expect("a disabled event");
    assert_eq!(disabled.endpoint_id, endpoint.id);
    assert_eq!(disabled.reason, DisableReason::Gone);
    assert_eq!(disabled.url, endpoint.url);
    assert_eq!(disabled.at, start_time());

    let stored = f.endpoints.get(&endpoint.id).await.expect("endpoint");
    assert!(!stored.enabled);
    assert_eq!(
        stored.disabled_reason.as_deref(),
        Some("the endpoint answered 410 Gone")
    );
    assert!(counter("keel_webhook_endpoint_disabled_total", "reason=gone") >= 1);
    assert!(counter("keel_webhook_attempts_total", "outcome=gone") >= 1);
    assert_eq!(stored.disabled_at, Some(start_time()));
    assert_eq!(f.delivery("evt_1").await.status, DeliveryStatus::Disabled);

    // Later events are kept for a replay, not sent.
    f.send(&[event("evt_2")]).await;
    f.clock.advance(Duration::from_secs(3600));
    assert_eq!(worker.run_once().await.expect("run").attempted, 0);
    assert_eq!(f.delivery("evt_2").await.status, DeliveryStatus::Disabled);
    assert_eq!(f.hooks.received().len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_is_logged_and_retried() {
    let f = fx().await;
    f.endpoint("/slow").await;
    f.hooks
        .script([Reply::status(200).delay(Duration::from_secs(3))]);
    f.send(&[event("evt_1")]).await;
    let worker = DeliveryWorker::new(
        f.store.clone(),
        f.options().timeout(Duration::from_millis(300)),
    )
    .expect("worker");
    let report = worker.run_once().await.expect("run");
    assert_eq!(report.retrying, 1);
    let d = f.delivery("evt_1").await;
    assert_eq!(
        (d.status, d.next_attempt_at),
        (DeliveryStatus::Pending, f.at(5))
    );
    let attempt = &f.endpoints.attempts(d.id).await.expect("attempts")[0];
    assert_eq!(attempt.response_status, None);
    assert_eq!(attempt.error.as_deref(), Some("timed out after 300ms"));
    assert!(
        attempt.latency >= Duration::from_millis(300) && attempt.latency < Duration::from_secs(3)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_failing_for_the_whole_window_is_disabled_with_an_event() {
    let f = fx().await;
    let (endpoint, _) = f.endpoint("/broken").await;
    f.hooks.fallback(Reply::status(500).body("boom"));
    f.send(&[event("evt_1")]).await;
    let (tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let worker = DeliveryWorker::new(
        f.store.clone(),
        f.options()
            .failure_window(Duration::from_secs(30 * 60))
            .notify_disabled(tx),
    )
    .expect("worker");

    // 0 s, 5 s, 5 min 5 s: failing, but not for 30 minutes yet.
    for step in [0, 5, 300] {
        f.clock.advance(Duration::from_secs(step));
        let report = worker.run_once().await.expect("run");
        assert_eq!((report.retrying, report.disabled.len()), (1, 0));
    }
    assert_eq!(
        f.store
            .webhook_failing_since(&endpoint.id)
            .await
            .expect("window"),
        Some(start_time())
    );
    assert!(events.try_recv().is_err());
    // 35 min 5 s: every attempt failed for more than the window.
    f.clock.advance(Duration::from_secs(1800));
    let report = worker.run_once().await.expect("run");
    assert_eq!(report.disabled.len(), 1);
    let disabled = events.try_recv().expect("a disabled event");
    assert_eq!(disabled.endpoint_id, endpoint.id);
    assert_eq!(
        disabled.reason,
        DisableReason::FailureWindow {
            failing_since: start_time(),
            window: Duration::from_secs(1800)
        }
    );
    let stored = f.endpoints.get(&endpoint.id).await.expect("endpoint");
    assert!(!stored.enabled);
    assert!(
        stored
            .disabled_reason
            .expect("reason")
            .contains("every attempt failed since")
    );
    assert!(
        counter(
            "keel_webhook_endpoint_disabled_total",
            "reason=failure_window"
        ) >= 1
    );
    assert_eq!(f.delivery("evt_1").await.status, DeliveryStatus::Disabled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_used_up_schedule_fails_the_delivery_and_optionally_disables() {
    let f = fx().await;
    let (kept, _) = f.endpoint("/kept").await;
    f.hooks.fallback(Reply::status(500));
    f.send(&[event("evt_1")]).await;
    let short = Backoff::schedule([Duration::from_secs(1)]).expect("schedule");
    let worker =
        DeliveryWorker::new(f.store.clone(), f.options().backoff(short.clone())).expect("worker");
    worker.run_once().await.expect("run");
    f.clock.advance(Duration::from_secs(1));
    let report = worker.run_once().await.expect("run");
    assert_eq!((report.failed, report.disabled.len()), (1, 0));
    assert_eq!(f.delivery("evt_1").await.status, DeliveryStatus::Failed);
    assert!(
        f.endpoints.get(&kept.id).await.expect("get").enabled,
        "the window decides by default"
    );

    let strict = DeliveryWorker::new(
        f.store.clone(),
        f.options().backoff(short).disable_when_exhausted(true),
    )
    .expect("worker");
    f.send(&[event("evt_2")]).await;
    strict.run_once().await.expect("run");
    f.clock.advance(Duration::from_secs(1));
    let report = strict.run_once().await.expect("run");
    assert_eq!(report.disabled.len(), 1);
    assert!(matches!(
        report.disabled[0].reason,
        DisableReason::ScheduleExhausted { .. }
    ));
    assert!(!f.endpoints.get(&kept.id).await.expect("get").enabled);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_log_keeps_a_truncated_response_body() {
    let f = fx().await;
    f.endpoint("/hooks").await;
    f.hooks
        .script([Reply::status(500).body("x".repeat(10 * 1024))]);
    f.send(&[event("evt_1")]).await;
    f.worker().run_once().await.expect("run");
    let d = f.delivery("evt_1").await;
    let attempt = &f.endpoints.attempts(d.id).await.expect("attempts")[0];
    assert_eq!(attempt.response_status, Some(500));
    assert_eq!(
        attempt.response_body.as_deref().map(str::len),
        Some(4096),
        "4 KiB kept"
    );
    let small =
        DeliveryWorker::new(f.store.clone(), f.options().max_response_body(10)).expect("worker");
    f.clock.advance(Duration::from_secs(5));
    f.hooks
        .script([Reply::status(500).body("0123456789abcdef")]);
    small.run_once().await.expect("run");
    let attempts = f.endpoints.attempts(d.id).await.expect("attempts");
    assert_eq!(attempts[1].response_body.as_deref(), Some("0123456789"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manual_resend_sends_again_with_the_same_id() {
    let f = fx().await;
    let (endpoint, _) = f.endpoint("/hooks").await;
    f.send(&[event("evt_1")]).await;
    let worker = f.worker();
    worker.run_once().await.expect("run");
    let d = f.delivery("evt_1").await;
    assert_eq!(d.status, DeliveryStatus::Succeeded);

    f.clock.advance(Duration::from_secs(60));
    f.endpoints.resend(d.id).await.expect("resend");
    let again = f.delivery("evt_1").await;
    assert_eq!(
        (again.status, again.attempts, again.next_attempt_at),
        (DeliveryStatus::Pending, 0, f.at(60))
    );
    assert_eq!(worker.run_once().await.expect("run").succeeded, 1);
    let received = f.hooks.received();
    assert_eq!(received.len(), 2);
    assert_eq!(
        header(&received[1], "webhook-id"),
        "evt_1",
        "receivers dedupe on it"
    );
    assert_eq!(f.endpoints.attempts(d.id).await.expect("attempts").len(), 2);

    assert!(matches!(
        f.endpoints.resend(999_999).await,
        Err(WebhookError::DeliveryNotFound(999_999))
    ));
    f.endpoints
        .disable(&endpoint.id, "operator")
        .await
        .expect("disable");
    let err = f.endpoints.resend(d.id).await.expect_err("disabled");
    assert!(matches!(err, WebhookError::Conflict(_)), "{err}");
    assert!(err.to_string().contains("disabled (operator)"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_time_range_is_replayed_after_an_outage() {
    let f = fx().await;
    let (endpoint, _) = f.endpoint("/hooks").await;
    f.endpoints
        .disable(&endpoint.id, "customer outage")
        .await
        .expect("disable");
    for (i, minute) in [(1, 0), (2, 10), (3, 20), (4, 30)] {
        f.clock.set(f.at(minute * 60));
        f.send(&[event(&format!("evt_{i}"))]).await;
    }
    let worker = f.worker();
    assert_eq!(
        worker.run_once().await.expect("run").attempted,
        0,
        "parked while disabled"
    );
    let err = f
        .endpoints
        .replay(&endpoint.id, f.at(0), f.at(3600))
        .await
        .expect_err("disabled");
    assert!(matches!(err, WebhookError::Conflict(_)), "{err}");

    assert!(f.endpoints.enable(&endpoint.id).await.expect("enable"));
    // The outage was from 5 to 25 minutes: evt_2 and evt_3.
    let replayed = f
        .endpoints
        .replay(&endpoint.id, f.at(300), f.at(1500))
        .await
        .expect("replay");
    assert_eq!(replayed, 2);
    assert_eq!(worker.run_once().await.expect("run").succeeded, 2);
    let mut ids: Vec<_> = f
        .hooks
        .received()
        .iter()
        .map(|r| header(r, "webhook-id").to_owned())
        .collect();
    ids.sort();
    assert_eq!(ids, ["evt_2", "evt_3"]);
    assert_eq!(f.delivery("evt_1").await.status, DeliveryStatus::Disabled);
    assert!(matches!(
        f.endpoints.replay("ghost", f.at(0), f.at(1)).await,
        Err(WebhookError::EndpointNotFound(_))
    ));
    assert!(matches!(
        f.endpoints.replay(&endpoint.id, f.at(1), f.at(1)).await,
        Err(WebhookError::Invalid { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotation_signs_with_both_secrets_during_the_grace_period() {
    let f = fx().await;
    let (endpoint, old) = f.endpoint("/hooks").await;
    let (rotated, new) = f
        .endpoints
        .rotate_secret(&endpoint.id, Duration::from_secs(3600))
        .await
        .expect("rotate");
    assert_eq!(rotated.secrets.len(), 2);
    f.send(&[event("evt_grace")]).await;
    let worker = f.worker();
    worker.run_once().await.expect("run");
    let during = f.hooks.received().pop().expect("request");
    assert_eq!(
        header(&during, "webhook-signature").split(' ').count(),
        2,
        "one signature per secret"
    );
    let now = f.clock.unix_seconds();
    for secret in [&old, &new] {
        Verifier::new([secret.clone()])
            .verify(&during.headers, &during.body, now)
            .expect("either secret verifies during the grace period");
    }

    f.clock.advance(Duration::from_secs(3601));
    f.send(&[event("evt_after")]).await;
    worker.run_once().await.expect("run");
    let after = f.hooks.received().pop().expect("request");
    assert_eq!(header(&after, "webhook-signature").split(' ').count(), 1);
    let now = f.clock.unix_seconds();
    assert_eq!(
        Verifier::new([old.clone()]).verify(&after.headers, &after.body, now),
        Err(VerifyError::BadSignature),
        "the retired secret no longer verifies"
    );
    Verifier::new([new])
        .verify(&after.headers, &after.body, now)
        .expect("the new one does");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seed_format_is_available_as_an_option() {
    let f = fx().await;
    let secret = Secret::parse("s3cr3t-from-the-seed").expect("raw secret");
    f.endpoints
        .create(NewEndpoint::new(format!("http://{}/acme", f.addr)).secret(secret.clone()))
        .await
        .expect("create");
    f.send(&[event("evt_1")]).await;
    let scheme = SignatureScheme::TimestampedHex {
        header: axum::http::HeaderName::from_static("x-acme-signature"),
    };
    let worker =
        DeliveryWorker::new(f.store.clone(), f.options().scheme(scheme.clone())).expect("worker");
    worker.run_once().await.expect("run");
    let request = f.hooks.received().pop().expect("request");
    // The reference sign(): hmac(secret.encode(), f"{timestamp}." + body).hexdigest()
    let ts = start_time().timestamp();
    let mut mac = Hmac::<Sha256>::new_from_slice(b"s3cr3t-from-the-seed").expect("key");
    mac.update(format!("{ts}.").as_bytes());
    mac.update(&request.body);
    assert_eq!(
        header(&request, "x-acme-signature"),
        format!("t={ts},v1={}", hex::encode(mac.finalize().into_bytes()))
    );
    Verifier::new([secret])
        .scheme(scheme)
        .verify(&request.headers, &request.body, ts + 60)
        .expect("verifies");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endpoint_pointing_inside_the_network_is_never_called() {
    let f = fx().await;
    for url in [
        "http://169.254.169.254/latest/meta-data/",
        "http://[::ffff:a9fe:a9fe]/",
        "http://10.0.0.5:6379/",
    ] {
        let err = f
            .endpoints
            .create(NewEndpoint::new(url))
            .await
            .expect_err("refused");
        assert!(matches!(err, WebhookError::Url(_)), "{url}: {err}");
    }
    // Written straight into the store (an old row, a changed rule): the
    // worker refuses it at send time, logs why, and retries later.
    let mut endpoint = stored_endpoint("ep_metadata", "http://169.254.169.254/latest/meta-data/");
    endpoint.created_at = start_time();
    f.store
        .webhook_endpoint_create(&endpoint)
        .await
        .expect("create");
    f.send(&[event("evt_1")]).await;
    let report = f.worker().run_once().await.expect("run");
    assert_eq!(report.retrying, 1);
    let d = f.delivery("evt_1").await;
    let attempt = &f.endpoints.attempts(d.id).await.expect("attempts")[0];
    let error = attempt.error.as_deref().expect("error");
    assert!(error.contains("refused by the SSRF guard"), "{error}");
    assert!(
        !error.contains("link-local"),
        "the log does not name the range: {error}"
    );
    assert_eq!(attempt.response_status, None);
    assert!(counter("keel_webhook_ssrf_refused_total", "range=link-local") >= 1);
}

fn stored_endpoint(id: &str, url: &str) -> WebhookEndpoint {
    WebhookEndpoint::registered(
        id,
        url,
        Secret::generate().expect("secret").expose(),
        start_time(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_type_filters_choose_the_endpoints() {
    let f = fx().await;
    let (orders, _) = f
        .endpoints
        .create(NewEndpoint::new(format!("http://{}/orders", f.addr)).event_types(["order.*"]))
        .await
        .expect("create");
    f.endpoints
        .create(
            NewEndpoint::new(format!("http://{}/invoices", f.addr)).event_types(["invoice.paid"]),
        )
        .await
        .expect("create");
    assert_eq!(f.send(&[event("evt_1")]).await, 1);
    f.worker().run_once().await.expect("run");
    let received = f.hooks.received();
    assert_eq!(received.len(), 1);
    assert_eq!(received[0].path, "/orders");
    assert_eq!(f.delivery("evt_1").await.endpoint_id, orders.id);
    let err = f
        .endpoints
        .create(NewEndpoint::new(format!("http://{}/x", f.addr)).event_types(["order.*.paid"]))
        .await
        .expect_err("bad filter");
    assert!(matches!(err, WebhookError::Invalid { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_verified_receiver_gets_each_event_once() {
    let f = fx().await;
    // A real receiving service on loopback: verify, dedupe, hand off.
    let (queue, mut inbox) = tokio::sync::mpsc::channel(16);
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let secret = Secret::generate().expect("secret");
    let receiver = WebhookReceiver::new([secret.clone()]).clock(f.clock.clone());
    let app: Router = Router::new().route("/webhooks", receiver.channel_route(queue));
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });

    f.endpoints
        .create(NewEndpoint::new(format!("http://{addr}/webhooks")).secret(secret))
        .await
        .expect("create");
    f.send(&[event("evt_1"), event("evt_2")]).await;
    let worker = f.worker();
    assert_eq!(worker.run_once().await.expect("run").succeeded, 2);
    let mut got = [
        inbox.recv().await.expect("webhook"),
        inbox.recv().await.expect("webhook"),
    ];
    got.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(got[0].id, "evt_1");
    assert_eq!(got[0].payload["data"]["totalMinor"], 8210);

    // A resend of a delivered event: 2xx for the sender, no second hand-off.
    let d = f.delivery("evt_1").await;
    f.endpoints.resend(d.id).await.expect("resend");
    assert_eq!(worker.run_once().await.expect("run").succeeded, 1);
    let attempts = f.endpoints.attempts(d.id).await.expect("attempts");
    assert_eq!(
        attempts[1].response_body.as_deref(),
        Some(r#"{"received":true,"duplicate":true}"#)
    );
    assert!(inbox.try_recv().is_err(), "not handed off twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_consumer_path_queues_each_event_once() {
    use keel_messaging::consumer::{Consumer, Group};
    use keel_messaging::outbox::Outbox;
    use keel_sqlite::broker::SqliteBroker;
    use keel_store::broker::Broker;
    use keel_store::envelope::Envelope;
    use keel_webhooks::WebhookFanout;

    let f = fx().await;
    f.endpoint("/hooks").await;
    let broker = Arc::new(
        SqliteBroker::open(f._dir.path().join("broker.db"))
            .await
            .expect("broker"),
    );
    // The domain event, as the relay publishes it from the business outbox;
    // published twice, as a relay may after a crash.
    let mut envelope = Envelope::new("/services/orders", "shop.order.paid.v1");
    envelope.data = Some(serde_json::json!({
        "orderId": "A-4471", "version": 3, "occurredAt": "2026-11-29T09:59:00.000Z"
    }));
    let message = Outbox::new(f.store.clone())
        .record("orders", &envelope)
        .expect("record")
        .to_message();
    broker
        .publish(std::slice::from_ref(&message))
        .await
        .expect("publish");
    broker.publish(&[message]).await.expect("publish again");

    let fanout = WebhookFanout::new(WebhookOutbox::new(f.store.clone()).clock(f.clock.clone()));
    let consumer = Consumer::builder(f.store.clone(), broker)
        .group(Group::new("orders", "webhooks").on("shop.order.paid.v1", fanout))
        .receive_wait(Duration::from_millis(50))
        .build()
        .expect("consumer");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(consumer.run(async move {
        let _ = stopped.await;
    }));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let queued = f
            .endpoints
            .deliveries(&DeliveryFilter::default())
            .await
            .expect("list");
        if !queued.is_empty() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "queued by the consumer"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.send(()).expect("stop");
    running.await.expect("consumer task");
    assert_eq!(
        f.endpoints
            .deliveries(&DeliveryFilter::default())
            .await
            .expect("list")
            .len(),
        1,
        "queued once"
    );

    f.worker().run_once().await.expect("run");
    let received = f.hooks.received();
    assert_eq!(received.len(), 1);
    assert_eq!(header(&received[0], "webhook-id"), envelope.id);
    let body: serde_json::Value = serde_json::from_slice(&received[0].body).expect("json");
    assert_eq!(body["type"], "shop.order.paid.v1");
    assert_eq!(
        body["timestamp"], "2026-11-29T09:59:00.000Z",
        "when it occurred"
    );
    assert_eq!(body["sequence"], 3, "the entity version orders it");
    assert_eq!(body["data"]["orderId"], "A-4471");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_loop_delivers_bounds_concurrency_and_drains() {
    let f = fx().await;
    f.endpoint("/a").await;
    f.hooks
        .fallback(Reply::status(204).delay(Duration::from_millis(20)));
    let events: Vec<_> = (0..60).map(|i| event(&format!("evt_{i:03}"))).collect();
    f.send(&events).await;
    let worker = DeliveryWorker::new(
        f.store.clone(),
        f.options()
            .per_endpoint(3)
            .poll_interval(Duration::from_millis(20)),
    )
    .expect("worker");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = worker.spawn(async move {
        let _ = stopped.await;
    });
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while f.hooks.received().len() < 60 {
        assert!(tokio::time::Instant::now() < deadline, "delivered in time");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Deliveries queued while it runs are picked up by polling.
    f.send(&[event("evt_late")]).await;
    while f.hooks.received().len() < 61 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "late event delivered"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(()).expect("stop");
    let report = running.await.expect("worker task");
    assert_eq!(report.succeeded, 61);
    assert!(
        f.hooks.max_in_flight() <= 3,
        "per-endpoint bound: {}",
        f.hooks.max_in_flight()
    );
    assert!(
        f.hooks.max_in_flight() >= 2,
        "but concurrent: {}",
        f.hooks.max_in_flight()
    );
    let succeeded = f
        .endpoints
        .deliveries(&DeliveryFilter {
            status: Some(DeliveryStatus::Succeeded),
            limit: Some(1000),
            ..DeliveryFilter::default()
        })
        .await
        .expect("list");
    assert_eq!(succeeded.len(), 61);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notified_worker_claims_at_once_instead_of_at_its_next_poll() {
    let f = fx().await;
    f.endpoint("/a").await;
    f.hooks.fallback(Reply::status(204));
    let worker = DeliveryWorker::new(
        f.store.clone(),
        f.options().poll_interval(Duration::from_secs(3600)),
    )
    .expect("worker");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = worker.spawn(async move {
        let _ = stopped.await;
    });
    // Its first claim found nothing; the next poll is an hour away.
    tokio::time::sleep(Duration::from_millis(100)).await;
    for (n, id) in ["evt_woken_1", "evt_woken_2"].into_iter().enumerate() {
        f.send(&[event(id)]).await;
        worker.notify();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while f.hooks.received().len() <= n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the wake-up made it claim {id}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    stop.send(()).expect("stop");
    assert_eq!(running.await.expect("worker task").succeeded, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_worker_options_are_refused() {
    let f = fx().await;
    for options in [
        f.options().batch(0),
        f.options().max_in_flight(0),
        f.options().per_endpoint(0),
        f.options().timeout(Duration::ZERO),
        f.options().lease(Duration::from_secs(1)),
    ] {
        let err = DeliveryWorker::new(f.store.clone(), options).expect_err("invalid");
        assert!(matches!(err, WebhookError::Config(_)), "{err}");
    }
}
