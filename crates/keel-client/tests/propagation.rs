//! Deadline and trace propagation, server and client side, over real HTTP
//! on loopback.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, Request, StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use keel_client::{DependencyConfig, HttpCallError, PropagatingClient};
use keel_core::deadline::DEADLINE_HEADER;
use keel_core::{Classify, Deadline, ErrorClass, Rejected, TraceParent, clock};
use keel_http::problem::PROBLEM_JSON;
use keel_http::propagation::{DeadlineLayer, TraceContextLayer};
use keel_policy::breaker::{CircuitBreakerConfig, SlidingWindow, State as BreakerState};
use keel_policy::retry::{BackoffConfig, Jitter, RetryBudgetConfig, RetryConfig};
use keel_policy::timeout::TimeoutConfig;
use parking_lot::Mutex;
use tokio::io::AsyncWriteExt;
use tokio::sync::oneshot;
use tower::ServiceExt;

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// Serves `router` on 127.0.0.1 on a free port.
async fn serve(router: Router) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
    addr
}

/// What a downstream service saw of each request.
#[derive(Debug, Clone, Default)]
struct Seen {
    deadline: Option<String>,
    traceparent: Option<String>,
    tracestate: Option<String>,
}

#[derive(Clone, Default)]
struct Downstream {
    seen: Arc<Mutex<Vec<Seen>>>,
    hits: Arc<AtomicUsize>,
}

impl Downstream {
    fn router(&self) -> Router {
        async fn echo(State(d): State<Downstream>, headers: HeaderMap) -> &'static str {
            d.hits.fetch_add(1, Ordering::SeqCst);
            let text = |name: &str| headers.get(name).map(|v| v.to_str().unwrap().to_owned());
            d.seen.lock().push(Seen {
                deadline: text(DEADLINE_HEADER),
                traceparent: text("traceparent"),
                tracestate: text("tracestate"),
            });
            "ok"
        }
        async fn unavailable(State(d): State<Downstream>) -> impl IntoResponse {
            d.hits.fetch_add(1, Ordering::SeqCst);
            (
                StatusCode::SERVICE_UNAVAILABLE,
                [(header::RETRY_AFTER, "3")],
                "down",
            )
        }
        async fn busy(State(d): State<Downstream>) -> StatusCode {
            d.hits.fetch_add(1, Ordering::SeqCst);
            StatusCode::TOO_MANY_REQUESTS
        }
        async fn missing(State(d): State<Downstream>) -> impl IntoResponse {
            d.hits.fetch_add(1, Ordering::SeqCst);
            (StatusCode::NOT_FOUND, "no such order: A-4471")
        }
        async fn hang(State(d): State<Downstream>) -> &'static str {
            d.hits.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_secs(60)).await;
            "late"
        }
        Router::new()
            .route("/echo", get(echo))
            .route("/unavailable", get(unavailable))
            .route("/busy", get(busy))
            .route("/missing", get(missing))
            .route("/hang", get(hang))
            .with_state(self.clone())
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

fn client() -> PropagatingClient {
    PropagatingClient::new(reqwest::Client::new())
}

/// An upstream service that calls `downstream/echo` from its handler.
fn upstream(downstream: SocketAddr, max: Duration) -> Router {
    let client = client();
    Router::new()
        .route(
            "/checkout",
            get(move || {
                let client = client.clone();
                async move {
                    let url = format!("http://{downstream}/echo");
                    match client.send(client.inner().get(url)).await {
                        Ok(_) => StatusCode::OK,
                        Err(_) => StatusCode::BAD_GATEWAY,
                    }
                }
            }),
        )
        .layer(DeadlineLayer::with_max(max).unwrap())
        .layer(TraceContextLayer::new())
}

#[tokio::test]
async fn headers_arrive_downstream_with_the_deadline_capped() {
    let downstream = Downstream::default();
    let down = serve(downstream.router()).await;
    let up = serve(upstream(down, Duration::from_secs(2))).await;

    let an_hour = clock::unix_millis() + 3_600_000;
    let sent_at = clock::unix_millis();
    let response = reqwest::Client::new()
        .get(format!("http://{up}/checkout"))
        .header("traceparent", TRACEPARENT)
        .header("tracestate", "rojo=00f067aa0ba902b7")
        .header("tracestate", "congo=t61rcWkgMzE")
        .header(DEADLINE_HEADER, an_hour.to_string())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);

    // The caller learns the server span and the trace id.
    let caller: TraceParent = TRACEPARENT.parse().unwrap();
    let server: TraceParent = response.headers()["traceresponse"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(server.trace_id(), caller.trace_id());
    assert_ne!(server.parent_id(), caller.parent_id());
    assert_eq!(response.headers()["x-trace-id"], caller.trace_id_hex());

    let seen = downstream.seen.lock().clone();
    assert_eq!(seen.len(), 1);
    // The downstream call is a child span of the server span: same trace, new span.
    let outgoing: TraceParent = seen[0].traceparent.as_deref().unwrap().parse().unwrap();
    assert_eq!(outgoing.trace_id(), caller.trace_id());
    assert_ne!(outgoing.parent_id(), server.parent_id());
    assert_ne!(outgoing.parent_id(), caller.parent_id());
    // The vendors' tracestate is carried on unchanged, as one list.
    assert_eq!(
        seen[0].tracestate.as_deref(),
        Some("rojo=00f067aa0ba902b7,congo=t61rcWkgMzE")
    );
    // The hour the caller asked for was capped at our 2 s maximum.
    let deadline: u64 = seen[0].deadline.as_deref().unwrap().parse().unwrap();
    assert!(
        deadline <= clock::unix_millis() + 2_000,
        "{deadline} not capped"
    );
    assert!(deadline >= sent_at + 1_500, "{deadline} is too early");
    assert!(deadline < an_hour);
}

#[tokio::test]
async fn a_tighter_inbound_deadline_is_passed_on_as_it_is() {
    let downstream = Downstream::default();
    let down = serve(downstream.router()).await;
    let up = serve(upstream(down, Duration::from_secs(30))).await;

    let soon = clock::unix_millis() + 1_500;
    let response = reqwest::Client::new()
        .get(format!("http://{up}/checkout"))
        .header(DEADLINE_HEADER, soon.to_string())
        // Without its traceparent a tracestate means nothing: dropped.
        .header("tracestate", "rojo=00f067aa0ba902b7")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let seen = downstream.seen.lock()[0].clone();
    let deadline: u64 = seen.deadline.unwrap().parse().unwrap();
    assert!(
        deadline.abs_diff(soon) <= 2,
        "sent {soon}, downstream saw {deadline}"
    );
    // No traceparent in: a new trace was started and carried on.
    assert!(seen.traceparent.unwrap().parse::<TraceParent>().is_ok());
    assert_eq!(seen.tracestate, None);
}

fn guarded_app(ran: Arc<AtomicUsize>) -> Router {
    Router::new()
        .route(
            "/",
            get(move || {
                let ran = Arc::clone(&ran);
                async move {
                    ran.fetch_add(1, Ordering::SeqCst);
                    "ran"
                }
            }),
        )
        .layer(DeadlineLayer::new())
        .layer(TraceContextLayer::new())
}

async fn problem_of(response: axum::response::Response) -> serde_json::Value {
    assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
    let body = axum::body::to_bytes(response.into_body(), 64 * 1024)
        .await
        .unwrap();
    serde_json::from_slice(&body).unwrap()
}

#[tokio::test]
async fn malformed_headers_are_400_problems() {
    let ran = Arc::new(AtomicUsize::new(0));
    let app = guarded_app(Arc::clone(&ran));
    let cases = [
        (DEADLINE_HEADER, "soon", "not a whole number"),
        (DEADLINE_HEADER, "-5", "not a whole number"),
        (
            DEADLINE_HEADER,
            "99999999999999999999999",
            "not a whole number",
        ),
        (DEADLINE_HEADER, "", "empty"),
        ("traceparent", "garbage", "traceparent"),
        (
            "traceparent",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "lowercase",
        ),
        (
            "traceparent",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "zeros",
        ),
    ];
    for (name, value, says) in cases {
        let request = Request::get("/")
            .header(name, value)
            .body(Body::empty())
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(
            response.status(),
            StatusCode::BAD_REQUEST,
            "{name}: {value:?}"
        );
        let problem = problem_of(response).await;
        assert_eq!(problem["status"], 400);
        let detail = problem["detail"].as_str().unwrap();
        assert!(detail.contains(says), "{name}: {value:?}: {detail}");
    }
    assert_eq!(
        ran.load(Ordering::SeqCst),
        0,
        "no handler ran for bad input"
    );
}

#[tokio::test]
async fn a_lenient_trace_layer_starts_a_new_trace_instead() {
    let app = Router::new()
        .route(
            "/",
            get(|| async { TraceParent::current().unwrap().trace_id_hex() }),
        )
        .layer(TraceContextLayer::new().lenient());
    let request = Request::get("/")
        .header("traceparent", "garbage")
        .body(Body::empty())
        .unwrap();
    let response = app.oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let trace_id = response.headers()["x-trace-id"]
        .to_str()
        .unwrap()
        .to_owned();
    let body = axum::body::to_bytes(response.into_body(), 1024)
        .await
        .unwrap();
    assert_eq!(
        body,
        trace_id.as_bytes(),
        "the handler ran in the trace it echoed"
    );
}

#[tokio::test]
async fn an_expired_deadline_is_504_without_running_the_handler() {
    let ran = Arc::new(AtomicUsize::new(0));
    let app = guarded_app(Arc::clone(&ran));
    for past in ["0".to_owned(), (clock::unix_millis() - 1_000).to_string()] {
        let request = Request::get("/")
            .header(DEADLINE_HEADER, past)
            .body(Body::empty())
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::GATEWAY_TIMEOUT);
        assert!(response.headers().contains_key("x-trace-id"));
        let problem = problem_of(response).await;
        assert_eq!(problem["type"], "urn:keel:problem:deadline_exceeded");
    }
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    // A live deadline runs it.
    let request = Request::get("/")
        .header(DEADLINE_HEADER, (clock::unix_millis() + 5_000).to_string())
        .body(Body::empty())
        .unwrap();
    assert_eq!(app.oneshot(request).await.unwrap().status(), StatusCode::OK);
    assert_eq!(ran.load(Ordering::SeqCst), 1);
}

/// Sends on `tx` when dropped.
struct DropGuard(Option<oneshot::Sender<()>>);

impl Drop for DropGuard {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

#[tokio::test]
async fn the_handler_is_cancelled_when_the_deadline_passes() {
    let (tx, dropped) = oneshot::channel();
    let tx = Arc::new(Mutex::new(Some(tx)));
    let app = Router::new()
        .route(
            "/slow",
            get(move || {
                let guard = DropGuard(tx.lock().take());
                async move {
                    let _guard = guard;
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    "too late"
                }
            }),
        )
        .layer(DeadlineLayer::with_max(Duration::from_millis(200)).unwrap());
    let started = clock::now();
    let response = app
        .oneshot(Request::get("/slow").body(Body::empty()).unwrap())
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::GATEWAY_TIMEOUT);
    assert!(started.elapsed() < Duration::from_secs(2));
    tokio::time::timeout(Duration::from_secs(1), dropped)
        .await
        .expect("the handler was dropped")
        .unwrap();
}

#[tokio::test]
async fn a_client_hanging_up_cancels_everything_downstream() {
    // downstream: a handler that never answers, and says when it is dropped.
    let (down_tx, down_dropped) = oneshot::channel();
    let down_tx = Arc::new(Mutex::new(Some(down_tx)));
    let (reached_tx, reached) = oneshot::channel::<()>();
    let reached_tx = Arc::new(Mutex::new(Some(reached_tx)));
    let down = serve(Router::new().route(
        "/hang",
        get(move || {
            let guard = DropGuard(down_tx.lock().take());
            if let Some(tx) = reached_tx.lock().take() {
                let _ = tx.send(());
            }
            async move {
                let _guard = guard;
                tokio::time::sleep(Duration::from_secs(60)).await;
                "late"
            }
        }),
    ))
    .await;

    // upstream: calls downstream and waits.
    let (up_tx, up_dropped) = oneshot::channel();
    let up_tx = Arc::new(Mutex::new(Some(up_tx)));
    let client = client();
    let up = serve(
        Router::new()
            .route(
                "/checkout",
                get(move || {
                    let guard = DropGuard(up_tx.lock().take());
                    let client = client.clone();
                    async move {
                        let _guard = guard;
                        let url = format!("http://{down}/hang");
                        let _ = client.send(client.inner().get(url)).await;
                        "done"
                    }
                }),
            )
            .layer(DeadlineLayer::new()),
    )
    .await;

    let mut stream = tokio::net::TcpStream::connect(up).await.unwrap();
    stream
        .write_all(b"GET /checkout HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), reached)
        .await
        .expect("the request reached downstream")
        .unwrap();
    // The client hangs up mid-request.
    drop(stream);
    tokio::time::timeout(Duration::from_secs(5), up_dropped)
        .await
        .expect("the upstream handler was cancelled")
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), down_dropped)
        .await
        .expect("the downstream handler was cancelled")
        .unwrap();
}

#[tokio::test]
async fn too_late_calls_never_leave_the_process() {
    let downstream = Downstream::default();
    let down = serve(downstream.router()).await;
    let client = client();
    let url = format!("http://{down}/echo");

    let refused = Deadline::after(Duration::from_millis(40))
        .scope(client.send(client.inner().get(&url)))
        .await
        .unwrap_err();
    assert!(matches!(
        refused,
        HttpCallError::Rejected(Rejected::DeadlineExceeded)
    ));
    assert_eq!(refused.class(), ErrorClass::Rejected);

    let payments = client.dependency("payments").build().unwrap();
    let refused = Deadline::after(Duration::from_millis(40))
        .scope(payments.send(|http| http.get(&url)))
        .await
        .unwrap_err();
    assert!(matches!(
        refused,
        HttpCallError::Rejected(Rejected::DeadlineExceeded)
    ));
    assert_eq!(downstream.hits(), 0, "nothing was sent");

    // With time left, the same call goes.
    Deadline::after(Duration::from_secs(1))
        .scope(client.send(client.inner().get(&url)))
        .await
        .unwrap();
    assert_eq!(downstream.hits(), 1);
}

#[tokio::test]
async fn the_request_timeout_is_the_time_left() {
    let downstream = Downstream::default();
    let down = serve(downstream.router()).await;
    let client = client().timeout(Duration::from_secs(30));
    let started = clock::now();
    let err = Deadline::after(Duration::from_millis(300))
        .scope(client.send(client.inner().get(format!("http://{down}/hang"))))
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(2), "waited {took:?}");
    match &err {
        HttpCallError::Timeout { after, .. } => assert!(*after <= Duration::from_millis(300)),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert_eq!(
        err.class(),
        ErrorClass::OutcomeUnknown,
        "it was sent: outcome unknown"
    );
    assert_eq!(downstream.hits(), 1);
}

#[tokio::test]
async fn failures_are_classified() {
    let downstream = Downstream::default();
    let down = serve(downstream.router()).await;
    let client = client();

    // Nothing listens on a port we just freed: connection refused.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap()
    };
    let err = client
        .send(client.inner().get(format!("http://{closed}/x")))
        .await
        .unwrap_err();
    assert!(matches!(err, HttpCallError::Connect { .. }), "{err:?}");
    assert_eq!(err.class(), ErrorClass::Retryable);

    let err = client
        .send(client.inner().get(format!("http://{down}/unavailable")))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(StatusCode::SERVICE_UNAVAILABLE));
    assert_eq!(err.class(), ErrorClass::Retryable);
    assert_eq!(err.retry_after(), Some(Duration::from_secs(3)));

    let err = client
        .send(client.inner().get(format!("http://{down}/busy")))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(StatusCode::TOO_MANY_REQUESTS));
    assert_eq!(err.class(), ErrorClass::Retryable);

    let err = client
        .send(client.inner().get(format!("http://{down}/missing")))
        .await
        .unwrap_err();
    assert_eq!(err.class(), ErrorClass::Permanent);
    match &err {
        HttpCallError::Status { status, body, .. } => {
            assert_eq!(*status, StatusCode::NOT_FOUND);
            assert_eq!(body, "no such order: A-4471");
        }
        other => panic!("{other:?}"),
    }

    let err = client
        .send(client.inner().get("not a url"))
        .await
        .unwrap_err();
    assert_eq!(err.class(), ErrorClass::Permanent);
}

fn quick_retries(max_attempts: u32, budget: Option<RetryBudgetConfig>) -> RetryConfig {
    RetryConfig {
        max_attempts: max_attempts.try_into().unwrap(),
        backoff: BackoffConfig::Schedule {
            delays: vec![Duration::from_millis(1); 4],
            jitter: Jitter::None,
        },
        budget,
        ..RetryConfig::default()
    }
}

#[tokio::test]
async fn a_failing_dependency_opens_its_own_breaker_only() {
    let downstream = Downstream::default();
    let down = serve(downstream.router()).await;
    let client = client();
    let breaker = CircuitBreakerConfig {
        sliding_window: SlidingWindow::Count { size: 4 },
        minimum_calls: 4,
        open_duration: Duration::from_secs(60),
        open_duration_jitter: 0.0,
        ..CircuitBreakerConfig::default()
    };
    let config = DependencyConfig {
        retry: quick_retries(1, None),
        breaker,
        ..DependencyConfig::default()
    };
    let payments = client
        .dependency("payments")
        .config(config.clone())
        .build()
        .unwrap();
    let stock = client.dependency("stock").config(config).build().unwrap();
    let down_url = format!("http://{down}/unavailable");
    let ok_url = format!("http://{down}/echo");

    for _ in 0..4 {
        let err = payments.send(|http| http.get(&down_url)).await.unwrap_err();
        assert_eq!(err.status(), Some(StatusCode::SERVICE_UNAVAILABLE));
        stock.send(|http| http.get(&ok_url)).await.unwrap();
    }
    assert_eq!(payments.breaker().state(), BreakerState::Open);
    assert_eq!(stock.breaker().state(), BreakerState::Closed);
    let hits = downstream.hits();

    // payments is cut off: refused without a request...
    let err = payments.send(|http| http.get(&down_url)).await.unwrap_err();
    match err.rejected() {
        Some(open @ Rejected::CircuitOpen { name, .. }) => {
            assert_eq!(&**name, "payments");
            assert!(open.retry_after() > Some(Duration::ZERO));
        }
        other => panic!("expected circuit open, got {other:?}"),
    }
    assert_eq!(downstream.hits(), hits, "an open breaker sends nothing");
    // ...while stock keeps working.
    for _ in 0..3 {
        stock.send(|http| http.get(&ok_url)).await.unwrap();
    }
    assert_eq!(downstream.hits(), hits + 3);
}

#[tokio::test]
async fn retries_stop_when_the_budget_is_empty() {
    let downstream = Downstream::default();
    let down = serve(downstream.router()).await;
    let client = client();
    // Every call earns half a retry; there is no per-second allowance.
    let budget = RetryBudgetConfig {
        ratio: 0.5,
        min_per_sec: 0.0,
        max_tokens: 1.0,
    };
    let config = DependencyConfig {
        retry: quick_retries(3, Some(budget)),
        // Three attempts must fit in the 2 s total (checked at build time).
        attempt_timeout: TimeoutConfig {
            timeout: Duration::from_millis(600),
            ..TimeoutConfig::default()
        },
        breaker: CircuitBreakerConfig {
            minimum_calls: 100,
            ..CircuitBreakerConfig::default()
        },
        ..DependencyConfig::default()
    };
    let inventory = client
        .dependency("inventory")
        .config(config)
        .build()
        .unwrap();
    let url = format!("http://{down}/busy");
    for _ in 0..10 {
        let err = inventory.send(|http| http.get(&url)).await.unwrap_err();
        assert_eq!(err.status(), Some(StatusCode::TOO_MANY_REQUESTS));
    }
    // Without the budget: 10 calls x 3 attempts = 30 requests. With it,
    // every other call earns one retry: 10 + 5.
    assert_eq!(downstream.hits(), 15);
    assert!(inventory.retry().budget().unwrap().available() < 1.0);
}

#[tokio::test]
async fn retries_go_through_when_the_budget_allows() {
    let downstream = Downstream::default();
    let down = serve(downstream.router()).await;
    let client = client();
    let config = DependencyConfig {
        retry: quick_retries(3, Some(RetryBudgetConfig::default())),
        // Three attempts must fit in the 2 s total (checked at build time).
        attempt_timeout: TimeoutConfig {
            timeout: Duration::from_millis(600),
            ..TimeoutConfig::default()
        },
        ..DependencyConfig::default()
    };
    let orders = client.dependency("orders").config(config).build().unwrap();
    let url = format!("http://{down}/busy");
    let err = orders.send(|http| http.get(&url)).await.unwrap_err();
    assert_eq!(err.class(), ErrorClass::Retryable);
    assert_eq!(downstream.hits(), 3, "3 attempts");
    // A permanent error is not retried.
    let url = format!("http://{down}/missing");
    orders.send(|http| http.get(&url)).await.unwrap_err();
    assert_eq!(downstream.hits(), 4);
}

/// Handlers need `Send` futures: a dependency call must be one.
#[allow(dead_code)]
fn dependency_calls_are_send(dependency: keel_client::Dependency) {
    fn send<T: Send>(_: T) {}
    send(async move {
        dependency
            .send(|http| http.get("http://127.0.0.1:1/"))
            .await
    });
}

#[tokio::test]
async fn a_dependency_sends_the_attempt_deadline_downstream() {
    let downstream = Downstream::default();
    let down = serve(downstream.router()).await;
    let echo = client()
        .dependency("echo")
        .attempt_timeout(Duration::from_millis(700))
        .build()
        .unwrap();
    let url = format!("http://{down}/echo");
    let before = clock::unix_millis();
    Deadline::after(Duration::from_secs(5))
        .scope(echo.send(|http| http.get(&url)))
        .await
        .unwrap();
    let seen = downstream.seen.lock()[0].clone();
    let deadline: u64 = seen.deadline.unwrap().parse().unwrap();
    // min(attempt timeout, time left): the attempt's 700 ms, not the request's 5 s.
    assert!(deadline <= clock::unix_millis() + 700, "{deadline}");
    assert!(deadline >= before + 600, "{deadline}");
}

#[tokio::test]
async fn every_attempt_and_every_call_lands_in_its_dependencys_latency_histogram() {
    let recorder = keel_testkit::metrics::MetricsRecorder::global();
    let downstream = Downstream::default();
    let down = serve(downstream.router()).await;
    let config = DependencyConfig {
        retry: quick_retries(2, None),
        ..DependencyConfig::default()
    };
    let pricing = client()
        .dependency("pricing")
        .config(config)
        .build()
        .unwrap();

    let err = pricing
        .send(|http| http.get(format!("http://{down}/busy")))
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(StatusCode::TOO_MANY_REQUESTS));
    assert_eq!(downstream.hits(), 2, "429 without Retry-After: tried again");
    pricing
        .send(|http| http.get(format!("http://{down}/echo")))
        .await
        .unwrap();

    let attempts = |outcome: &str| {
        recorder.samples(&format!(
            "keel_client_attempt_duration_seconds,dependency=pricing,outcome={outcome}"
        ))
    };
    let calls = |outcome: &str| {
        recorder.samples(&format!(
            "keel_client_call_duration_seconds,dependency=pricing,outcome={outcome}"
        ))
    };
    assert_eq!(attempts("4xx").len(), 2, "both attempts of the failed call");
    assert_eq!(attempts("2xx").len(), 1);
    assert_eq!(calls("error").len(), 1, "one call, however many attempts");
    assert_eq!(calls("ok").len(), 1);
    // The call's time covers its attempts and the wait between them.
    assert!(calls("error")[0] >= attempts("4xx").iter().sum::<f64>());
}
