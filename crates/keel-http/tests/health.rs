//! Health endpoints and graceful drain: in-process for the endpoints, a
//! real server on loopback for the drain.
#![cfg(feature = "health")]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode, header};
use axum::response::Response;
use axum::routing::get;
use keel_core::clock;
use keel_http::health::{
    Drain, DrainReport, DrainServe, Health, HealthRoutes, Phase, PingStatus, PoolUsage,
};
use keel_http::problem::PROBLEM_JSON;
use keel_sqlite::SqliteStore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tower::ServiceExt;

async fn get_in_process(app: &Router, path: &str) -> (StatusCode, Response) {
    let response = app
        .clone()
        .oneshot(Request::get(path).body(Body::empty()).unwrap())
        .await
        .unwrap();
    (response.status(), response)
}

async fn json_of(response: Response) -> serde_json::Value {
    let body = axum::body::to_bytes(response.into_body(), 64 * 1024)
        .await
        .unwrap();
    serde_json::from_slice(&body).unwrap()
}

/// A check that counts its calls and never answers.
fn hanging(
    calls: &Arc<AtomicUsize>,
) -> impl Fn() -> futures_util::future::BoxFuture<'static, Result<(), String>> + Send + Sync + 'static
{
    let calls = Arc::clone(calls);
    move || {
        calls.fetch_add(1, Ordering::SeqCst);
        Box::pin(std::future::pending())
    }
}

#[tokio::test]
async fn livez_is_trivial_and_never_touches_a_dependency() {
    let calls = Arc::new(AtomicUsize::new(0));
    let health = Health::builder()
        .ready_check("migrations", hanging(&calls))
        .dependency("database", Duration::from_secs(5), hanging(&calls))
        .build()
        .unwrap();
    let app = health.router();
    let (status, response) =
        tokio::time::timeout(Duration::from_millis(500), get_in_process(&app, "/livez"))
            .await
            .expect("livez answers at once");
    assert_eq!(status, StatusCode::OK);
    assert_eq!(response.headers()[header::CONTENT_TYPE], "application/json");
    assert_eq!(response.headers()[header::CACHE_CONTROL], "no-store");
    assert_eq!(json_of(response).await, serde_json::json!({ "ok": true }));
    assert_eq!(calls.load(Ordering::SeqCst), 0, "livez ran no check");
}

#[tokio::test]
async fn readyz_checks_what_we_own_on_a_real_store() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("keel.db")).await.unwrap();
    let waiters = Arc::new(AtomicUsize::new(0));
    let deep_calls = Arc::new(AtomicUsize::new(0));
    let health = Health::builder()
        .store(store.clone())
        .pool_saturation("db_pool", 50, {
            let waiters = Arc::clone(&waiters);
            move || PoolUsage {
                available: 0,
                waiters: waiters.load(Ordering::SeqCst),
            }
        })
        .dependency("payments", Duration::from_secs(5), hanging(&deep_calls))
        .build()
        .unwrap();
    let app = health.router();

    let (status, response) = get_in_process(&app, "/readyz").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(response.headers()[header::CACHE_CONTROL], "no-store");
    assert_eq!(json_of(response).await, serde_json::json!({ "ok": true }));

    // The pool is saturated: no connection free, more than 50 waiting.
    waiters.store(51, Ordering::SeqCst);
    let (status, response) = get_in_process(&app, "/readyz").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
    let problem = json_of(response).await;
    assert_eq!(problem["type"], "urn:keel:problem:not_ready");
    let detail = problem["detail"].as_str().unwrap();
    assert!(detail.contains("db_pool: pool saturated"), "{detail}");
    waiters.store(50, Ordering::SeqCst);
    assert_eq!(get_in_process(&app, "/readyz").await.0, StatusCode::OK);

    // The schema loses its migrations after start: readiness, which saw
    // them applied, no longer asks the database; `/debug/deep` does.
    sqlx::query("DELETE FROM _sqlx_migrations")
        .execute(store.pool())
        .await
        .unwrap();
    assert_eq!(get_in_process(&app, "/readyz").await.0, StatusCode::OK);
    assert_eq!(
        deep_calls.load(Ordering::SeqCst),
        0,
        "readiness never pings dependencies"
    );
}

#[tokio::test]
async fn readyz_refuses_a_store_that_was_never_migrated() {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("keel.db")).await.unwrap();
    sqlx::query("DELETE FROM _sqlx_migrations")
        .execute(store.pool())
        .await
        .unwrap();
    let app = Health::builder().store(store).build().unwrap().router();
    let (status, response) = get_in_process(&app, "/readyz").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let detail = json_of(response).await["detail"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(detail.starts_with("not ready: store: "), "{detail}");
    assert!(detail.contains("not migrated"), "{detail}");
}

/// A store whose database can be switched off, counting every question
/// asked of it.
#[derive(Clone, Default)]
struct CountedStore {
    asked: Arc<AtomicUsize>,
    down: Arc<std::sync::atomic::AtomicBool>,
}

#[async_trait::async_trait]
impl keel_store::Store for CountedStore {
    type Tx = ();

    async fn begin(&self) -> Result<(), keel_store::StoreError> {
        Ok(())
    }

    async fn commit(&self, (): ()) -> Result<(), keel_store::StoreError> {
        Ok(())
    }

    async fn rollback(&self, (): ()) -> Result<(), keel_store::StoreError> {
        Ok(())
    }

    async fn ready(&self) -> Result<(), keel_store::StoreError> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        if self.down.load(Ordering::SeqCst) {
            Err(keel_store::StoreError::other("connection refused"))
        } else {
            Ok(())
        }
    }
}

/// The classic cascade: every instance shares the database,
/// so a readiness probe that reads it takes the whole fleet out of the load
/// balancer when the database blips. Readiness asks the store once, at
/// start; the blip shows in `/debug/deep` only.
#[tokio::test]
async fn a_database_blip_leaves_every_instance_ready() {
    let store = CountedStore::default();
    let app = Health::builder()
        .store(store.clone())
        .build()
        .unwrap()
        .router();
    for _ in 0..10 {
        assert_eq!(get_in_process(&app, "/readyz").await.0, StatusCode::OK);
    }
    assert_eq!(
        store.asked.load(Ordering::SeqCst),
        1,
        "one question, at start"
    );

    store.down.store(true, Ordering::SeqCst);
    assert_eq!(get_in_process(&app, "/readyz").await.0, StatusCode::OK);
    assert_eq!(
        store.asked.load(Ordering::SeqCst),
        1,
        "probes never read the database"
    );
    let (status, response) = get_in_process(&app, "/debug/deep").await;
    assert_eq!(status, StatusCode::OK);
    let report = json_of(response).await;
    assert_eq!(report["ok"], false, "{report}");
    assert!(
        report.to_string().contains("connection refused"),
        "{report}"
    );
}

/// Readiness on a pool whose free connections `free` counts, with a 5 s grace.
fn pool_watched_for_5s(free: &Arc<AtomicUsize>) -> Router {
    let free = Arc::clone(free);
    Health::builder()
        .pool_exhaustion("db_pool", Duration::from_secs(5), move || {
            free.load(Ordering::SeqCst)
        })
        .build()
        .unwrap()
        .router()
}

/// A pool with nothing free for a moment stays ready; one that stays
/// exhausted past the grace is not, and is ready again once a connection
/// frees up.
#[tokio::test(start_paused = true)]
async fn a_pool_exhausted_past_its_grace_is_not_ready() {
    let free = Arc::new(AtomicUsize::new(0));
    let app = pool_watched_for_5s(&free);
    assert_eq!(get_in_process(&app, "/readyz").await.0, StatusCode::OK);
    tokio::time::advance(Duration::from_secs(4)).await;
    assert_eq!(get_in_process(&app, "/readyz").await.0, StatusCode::OK);
    tokio::time::advance(Duration::from_secs(1)).await;
    let (status, response) = get_in_process(&app, "/readyz").await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let detail = json_of(response).await["detail"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(
        detail,
        "not ready: db_pool: pool exhausted: no connection free for 5000ms"
    );

    free.store(1, Ordering::SeqCst);
    assert_eq!(get_in_process(&app, "/readyz").await.0, StatusCode::OK);
    free.store(0, Ordering::SeqCst);
    assert_eq!(
        get_in_process(&app, "/readyz").await.0,
        StatusCode::OK,
        "the grace starts over"
    );
}

/// Probes only sample: a one-connection pool under load can be busy at the
/// instant of every probe while it frees between them. Seen free during the
/// failing probe's watch, it stays ready.
#[tokio::test(start_paused = true)]
async fn a_pool_busy_whenever_a_probe_looks_but_free_between_stays_ready() {
    let free = Arc::new(AtomicUsize::new(0));
    let app = pool_watched_for_5s(&free);
    assert_eq!(get_in_process(&app, "/readyz").await.0, StatusCode::OK);
    tokio::time::advance(Duration::from_secs(10)).await;
    let frees = tokio::spawn({
        let free = Arc::clone(&free);
        async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            free.store(1, Ordering::SeqCst);
        }
    });
    assert_eq!(
        get_in_process(&app, "/readyz").await.0,
        StatusCode::OK,
        "a connection came back during the watch"
    );
    frees.await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_hanging_readiness_check_fails_within_its_time_limit() {
    let calls = Arc::new(AtomicUsize::new(0));
    let health = Health::builder()
        .ready_check("cache_warm", hanging(&calls))
        .check_timeout(Duration::from_millis(200))
        .build()
        .unwrap();
    let started = clock::now();
    let (status, response) = get_in_process(&health.router(), "/readyz").await;
    assert_eq!(started.elapsed(), Duration::from_millis(200));
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let detail = json_of(response).await["detail"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(detail, "not ready: cache_warm: no answer within 200ms");
}

#[tokio::test(start_paused = true)]
async fn deep_reports_each_dependency_within_its_own_timeout() {
    let calls = Arc::new(AtomicUsize::new(0));
    let health = Health::builder()
        .dependency("database", Duration::from_millis(200), || async {
            tokio::time::sleep(Duration::from_millis(5)).await;
            Ok::<_, String>(())
        })
        .dependency("cache", Duration::from_millis(100), || async {
            Err::<(), _>("connection refused")
        })
        .dependency("broker", Duration::from_millis(300), hanging(&calls))
        .dependency("search", Duration::from_millis(100), || async {
            // Each ping runs under its own deadline, for propagating clients.
            let left = keel_core::Deadline::current_remaining().unwrap();
            if left <= Duration::from_millis(100) {
                Ok(())
            } else {
                Err("no deadline")
            }
        })
        .build()
        .unwrap();
    let started = clock::now();
    let (status, response) = get_in_process(&health.router(), "/debug/deep").await;
    // Concurrent: the slowest timeout, not the sum.
    assert_eq!(started.elapsed(), Duration::from_millis(300));
    assert_eq!(status, StatusCode::OK);
    let report = json_of(response).await;
    assert_eq!(report["ok"], false);
    let deps = report["dependencies"].as_array().unwrap();
    let by_name = |name: &str| deps.iter().find(|d| d["name"] == name).unwrap().clone();
    assert_eq!(by_name("database")["status"], "ok");
    assert_eq!(by_name("database")["latency_ms"], 5.0);
    assert_eq!(by_name("cache")["status"], "failed");
    assert_eq!(by_name("cache")["error"], "connection refused");
    let broker = by_name("broker");
    assert_eq!(broker["status"], "timed_out");
    assert_eq!(broker["latency_ms"], 300.0);
    assert_eq!(broker["timeout_ms"], 300);
    assert_eq!(by_name("search")["status"], "ok");

    let typed = health.deep().await;
    assert_eq!(typed.dependencies[2].status, PingStatus::TimedOut);
}

// ---------------------------------------------------------------- drain

/// A response read off the wire, `Connection: close`.
struct Raw {
    status: u16,
    text: String,
}

async fn raw_get(addr: SocketAddr, path: &str) -> std::io::Result<Raw> {
    let mut stream = TcpStream::connect(addr).await?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut bytes = Vec::new();
    stream.read_to_end(&mut bytes).await?;
    let text = String::from_utf8_lossy(&bytes).into_owned();
    let status = text
        .get(9..12)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not an HTTP response: {text:?}")))?;
    Ok(Raw { status, text })
}

/// Waits until connecting to `addr` is refused (the listener closed).
async fn until_refused(addr: SocketAddr) {
    tokio::time::timeout(Duration::from_secs(1), async {
        while TcpStream::connect(addr).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .expect("the listener closed");
}

struct Server {
    addr: SocketAddr,
    drain: Drain,
    done: JoinHandle<std::io::Result<DrainReport>>,
}

async fn start(drain: Drain, app: Router) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let done = tokio::spawn({
        let drain = drain.clone();
        async move { drain.serve(listener, app).await }
    });
    Server { addr, drain, done }
}

fn drain(lb_notice_ms: u64, drain_timeout_ms: u64) -> Drain {
    Drain::builder()
        .lb_notice(Duration::from_millis(lb_notice_ms))
        .drain_timeout(Duration::from_millis(drain_timeout_ms))
        .build()
        .unwrap()
}

#[tokio::test]
async fn readyz_fails_with_draining_before_the_listener_closes() {
    let drain = drain(400, 5_000);
    let health = Health::builder().drain(&drain).build().unwrap();
    let app = Router::new()
        .route("/orders", get(|| async { "orders" }))
        .merge(health.router());
    let server = start(drain.clone(), app).await;

    assert_eq!(raw_get(server.addr, "/readyz").await.unwrap().status, 200);
    server.drain.trigger();
    // Readiness fails first, on a new connection: the listener still accepts...
    let readyz = raw_get(server.addr, "/readyz").await.unwrap();
    assert_eq!(readyz.status, 503);
    assert!(
        readyz.text.contains(r#""detail":"not ready: draining""#),
        "{}",
        readyz.text
    );
    assert!(readyz.text.contains(PROBLEM_JSON));
    // ...and real traffic is still served while load balancers notice.
    let orders = raw_get(server.addr, "/orders").await.unwrap();
    assert_eq!(
        (orders.status, orders.text.ends_with("orders")),
        (200, true)
    );
    assert_eq!(drain.phase(), Phase::Draining);

    // After the LB notice delay the listener closes.
    drain.wait_for(Phase::Closing).await;
    let report = tokio::time::timeout(Duration::from_secs(2), server.done)
        .await
        .expect("the server stopped")
        .unwrap()
        .unwrap();
    assert!(!report.forced);
    let refused = TcpStream::connect(server.addr).await;
    assert!(refused.is_err(), "no longer accepting");
}

#[tokio::test]
async fn an_in_flight_request_completes_during_the_drain() {
    let drain = drain(0, 5_000);
    let (started_tx, started) = oneshot::channel::<()>();
    let started_tx = Arc::new(parking_lot::Mutex::new(Some(started_tx)));
    let app = Router::new().route(
        "/slow",
        get(move || {
            if let Some(tx) = started_tx.lock().take() {
                let _ = tx.send(());
            }
            async {
                tokio::time::sleep(Duration::from_millis(500)).await;
                "finished"
            }
        }),
    );
    let server = start(drain.clone(), app).await;
    let request = tokio::spawn({
        let addr = server.addr;
        async move { raw_get(addr, "/slow").await }
    });
    started.await.unwrap();
    drain.trigger();
    drain.wait_for(Phase::Closing).await;
    // New connections are refused while the request is still running.
    until_refused(server.addr).await;
    assert!(
        !request.is_finished(),
        "the in-flight request is still being served"
    );

    let response = request.await.unwrap().unwrap();
    assert_eq!(response.status, 200);
    assert!(response.text.ends_with("finished"));
    let report = server.done.await.unwrap().unwrap();
    assert!(!report.forced);
    assert_eq!(report.aborted_connections, 0);
    assert_eq!(drain.open_connections(), 0);
}

/// A server-sent-events-like stream: ticks every 20 ms; with `drain`, ends
/// with a `bye` event when the drain signal fires.
fn ticking(drain: Option<Drain>) -> Body {
    let signal = drain.map(|d| d.signal());
    let stream = futures_util::stream::unfold((signal, false), |(mut signal, done)| async move {
        if done {
            return None;
        }
        let closing = async {
            match signal.as_mut() {
                Some(rx) => {
                    let _ = rx.wait_for(|close| *close).await;
                }
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = closing => Some((Ok::<_, Infallible>(Bytes::from_static(b"event: bye\n\n")), (signal, true))),
            () = tokio::time::sleep(Duration::from_millis(20)) => {
                Some((Ok(Bytes::from_static(b"data: tick\n\n")), (signal, false)))
            }
        }
    });
    Body::from_stream(stream)
}

/// Opens a stream at `path` and waits for its first bytes.
async fn open_stream(addr: SocketAddr, path: &str) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(format!("GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut first = [0u8; 256];
    let n = stream.read(&mut first).await.unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    stream
}

#[tokio::test]
async fn a_long_lived_stream_is_closed_when_the_drain_signal_fires() {
    let drain = drain(0, 10_000);
    let app = Router::new().route(
        "/events",
        get({
            let drain = drain.clone();
            move || {
                let drain = drain.clone();
                async move { ticking(Some(drain)) }
            }
        }),
    );
    let server = start(drain.clone(), app).await;
    let mut stream = open_stream(server.addr, "/events").await;

    let triggered = clock::now();
    drain.trigger();
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(3), stream.read_to_end(&mut rest))
        .await
        .expect("the stream ended")
        .unwrap();
    let rest = String::from_utf8_lossy(&rest);
    assert!(rest.contains("event: bye"), "a clean last event: {rest:?}");
    assert!(
        rest.ends_with("0\r\n\r\n"),
        "a complete chunked body: {rest:?}"
    );

    let report = server.done.await.unwrap().unwrap();
    assert!(
        !report.forced,
        "closed by the signal, long before the 10 s timeout"
    );
    assert!(triggered.elapsed() < Duration::from_secs(3));
}

#[tokio::test]
async fn a_stream_ignoring_the_signal_is_aborted_at_the_drain_timeout() {
    let drain = drain(0, 300);
    let app = Router::new().route("/events", get(|| async { ticking(None) }));
    let server = start(drain.clone(), app).await;
    let mut stream = open_stream(server.addr, "/events").await;
    assert_eq!(drain.open_connections(), 1);

    let triggered = clock::now();
    drain.trigger();
    let report = tokio::time::timeout(Duration::from_secs(3), server.done)
        .await
        .expect("the server stopped despite the stream")
        .unwrap()
        .unwrap();
    let took = triggered.elapsed();
    assert!(
        took >= Duration::from_millis(300) && took < Duration::from_secs(2),
        "{took:?}"
    );
    assert!(report.forced);
    assert_eq!(report.aborted_connections, 1);
    assert!(report.drain_time >= Duration::from_millis(300));

    // The client sees the connection end without the body's last chunk.
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(2), stream.read_to_end(&mut rest))
        .await
        .expect("the connection was closed");
    assert!(!String::from_utf8_lossy(&rest).ends_with("0\r\n\r\n"));
    assert_eq!(drain.open_connections(), 0);
}

#[cfg(unix)]
#[tokio::test]
async fn sigterm_starts_the_drain() {
    let drain = drain(60_000, 60_000);
    let listening = drain.trigger_on_signal().unwrap();
    let status = std::process::Command::new("kill")
        .args(["-TERM", &std::process::id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    tokio::time::timeout(Duration::from_secs(5), drain.wait_for(Phase::Draining))
        .await
        .expect("SIGTERM triggered the drain");
    assert!(drain.is_draining());
    assert_eq!(
        drain.phase(),
        Phase::Draining,
        "readiness fails; the listener stays open for now"
    );
    listening.abort();
}

/// Whether the server closes `stream` within `limit`.
async fn closed_within(stream: &mut TcpStream, limit: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0) | Err(_)) => return true,
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_sending_its_body_is_cut_off_by_the_idle_timeout() {
    use keel_http::health::ConnectionLimits;
    use tokio::io::AsyncWriteExt;
    let app = Router::new().route(
        "/upload",
        axum::routing::post(|body: axum::body::Bytes| async move { body.len().to_string() }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limits = ConnectionLimits::new().idle_timeout(Duration::from_millis(500));
    let serving = drain(0, 5_000);
    tokio::spawn(async move { serving.serve_with(listener, app, limits).await });
    let mut stalled = TcpStream::connect(addr).await.unwrap();
    stalled
        .write_all(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nonly-this")
        .await
        .unwrap();
    assert!(
        closed_within(&mut stalled, Duration::from_secs(3)).await,
        "silent for two idle periods: dropped"
    );
    let mut moving = TcpStream::connect(addr).await.unwrap();
    moving
        .write_all(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n")
        .await
        .unwrap();
    for byte in [b"a", b"b"] {
        tokio::time::sleep(Duration::from_millis(300)).await;
        moving.write_all(byte).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    moving.write_all(b"c").await.unwrap();
    let answer = raw_answer(&mut moving).await;
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "a slow but moving body is served: {answer}"
    );
}

async fn raw_answer(stream: &mut TcpStream) -> String {
    use tokio::io::AsyncReadExt;
    let mut buf = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// A server on a free port with `limits`, answering `POST /upload` with the
/// body's length and `GET /hello` with `hello`.
async fn limited(limits: keel_http::health::ConnectionLimits) -> SocketAddr {
    let app = Router::new()
        .route(
            "/upload",
            axum::routing::post(|body: axum::body::Bytes| async move { body.len().to_string() }),
        )
        .route("/hello", get(|| async { "hello" }))
        .route("/livez", get(|| async { "live" }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = drain(0, 5_000);
    tokio::spawn(async move { serving.serve_with(listener, app, limits).await });
    addr
}

/// A connection to `server` from the loopback address `from`.
async fn connect_from(from: [u8; 4], server: SocketAddr) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind((from, 0).into()).unwrap();
    socket.connect(server).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_trickling_in_past_its_read_timeout_gets_408_and_the_connection_closes() {
    use keel_http::health::ConnectionLimits;
    use tokio::io::AsyncWriteExt;
    let limits = ConnectionLimits::new().body_read_timeout(Duration::from_secs(1));
    let addr = limited(limits).await;
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
        .await
        .unwrap();
    // A byte every 200 ms: never idle, never done.
    let trickle = async {
        for _ in 0..20 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if slow.write_all(b"x").await.is_err() {
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_millis(1_500), trickle)
        .await
        .ok();
    let answer = raw_answer(&mut slow).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("connection: close"),
        "{answer}"
    );
    assert!(closed_within(&mut slow, Duration::from_secs(3)).await);

    let mut quick = TcpStream::connect(addr).await.unwrap();
    quick
        .write_all(b"POST /upload HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc")
        .await
        .unwrap();
    let answer = raw_answer(&mut quick).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_holds_its_share_and_livez_answers_at_the_cap() {
    use keel_http::health::ConnectionLimits;
    use tokio::io::AsyncWriteExt;
    let limits = ConnectionLimits::new()
        .max_connections(4)
        .max_connections_per_address(2);
    let addr = limited(limits).await;
    let get = |path: &str| format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    let _held = [
        connect_from([127, 0, 0, 1], addr).await,
        connect_from([127, 0, 0, 1], addr).await,
    ];
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut third = connect_from([127, 0, 0, 1], addr).await;
    third.write_all(get("/hello").as_bytes()).await.unwrap();
    let answer = raw_answer(&mut third).await;
    assert!(
        answer.starts_with("HTTP/1.1 503"),
        "past its share: {answer}"
    );

    let mut other = connect_from([127, 0, 0, 2], addr).await;
    other.write_all(get("/hello").as_bytes()).await.unwrap();
    let answer = raw_answer(&mut other).await;
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "another address: {answer}"
    );

    let _more = [
        connect_from([127, 0, 0, 3], addr).await,
        connect_from([127, 0, 0, 3], addr).await,
    ];
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut probe = connect_from([127, 0, 0, 4], addr).await;
    probe.write_all(get("/livez").as_bytes()).await.unwrap();
    let answer = raw_answer(&mut probe).await;
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "alive at the cap: {answer}"
    );
    assert!(
        answer.contains("at_connection_cap"),
        "answered by the cap's path: {answer}"
    );
    let mut refused = connect_from([127, 0, 0, 4], addr).await;
    refused.write_all(get("/hello").as_bytes()).await.unwrap();
    let answer = raw_answer(&mut refused).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "at the cap: {answer}");
}
