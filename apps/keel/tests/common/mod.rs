//! What the in-process shop tests share: the shop on SQLite and the embedded
//! broker, in a directory of the test's own.
#![allow(dead_code, unreachable_pub)]

use std::sync::Arc;

use keel::shop::{System, SystemConfig, SystemHandle};
use keel_sqlite::{SqliteBroker, SqliteStore};
use keel_store::broker::Broker;

/// Starts the shop with the default configuration on two files in `dir`.
pub async fn start_embedded(dir: &std::path::Path) -> SystemHandle<SqliteStore> {
    let store = SqliteStore::open(dir.join("keel.db"))
        .await
        .expect("open the store");
    let broker: Arc<dyn Broker> = Arc::new(
        SqliteBroker::open(dir.join("broker.db"))
            .await
            .expect("open the broker"),
    );
    System::start(store, broker, SystemConfig::default(), |_| {
        Ok(axum::Router::new())
    })
    .await
    .expect("start the shop")
}

/// A `keel serve` process on a fresh SQLite database, killed when dropped.
pub struct Server {
    child: std::process::Child,
    /// `http://127.0.0.1:PORT`.
    pub url: String,
    /// The shipping service's gRPC address, `http://127.0.0.1:PORT`.
    pub grpc: String,
    /// The database file.
    pub db: std::path::PathBuf,
    log: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    /// `127.0.0.1:PORT`.
    pub fn host(&self) -> &str {
        self.url.trim_start_matches("http://")
    }

    /// What the server logged (warnings and errors) so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// The API key of tenant `acme` every [`serve`] is started with.
pub const ACME_KEY: &str = "acme-key-0123456789abcdef";

/// Runs `keel serve` on loopback (port 0) with `extra` flags and tenant
/// `acme` ([`ACME_KEY`]), and waits for its `listening` line.
pub fn serve(extra: &[&str]) -> Server {
    serve_on(&[], extra)
}

/// [`serve`] on the backend `backend`'s flags name (`--database-url`,
/// `--broker`, ...); none is a fresh SQLite file.
pub fn serve_on(backend: &[String], extra: &[&str]) -> Server {
    serve_with_env(backend, extra, &[])
}

/// [`serve_on`] with the environment variables `env` set for the process.
pub fn serve_with_env(backend: &[String], extra: &[&str], env: &[(&str, &str)]) -> Server {
    use std::io::{BufRead, BufReader};
    use std::process::{Command, Stdio};
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("shop.db");
    let sqlite = [
        "--database-url".to_owned(),
        format!("sqlite:{}", db.display()),
    ];
    let backend = if backend.is_empty() {
        &sqlite[..]
    } else {
        backend
    };
    let acme = format!("acme:{ACME_KEY}");
    let log = dir.path().join("stderr.log");
    let stderr = std::fs::File::create(&log).unwrap();
    let mut child = Command::new(keel_testkit::services::keel_binary(env!(
        "CARGO_BIN_EXE_keel"
    )))
    .args(["serve", "--listen", "127.0.0.1:0"])
    .args(backend)
    .args(["--api-key", &acme])
    .args(extra)
    .env_remove("KEEL_ADMIN_TOKEN")
    .env_remove("KEEL_API_KEYS")
    .env("KEEL_LOG", "warn")
    .envs(env.iter().copied())
    .stdout(Stdio::piped())
    .stderr(Stdio::from(stderr))
    .spawn()
    .expect("keel serve starts");
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut next = |prefix: &str| {
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        line.trim()
            .strip_prefix(prefix)
            .unwrap_or_else(|| panic!("expected {prefix:?}, got {line:?}"))
            .to_owned()
    };
    let url = next("keel: listening on ");
    let grpc = next("keel: shipping gRPC (shipping.v1.Shipping) on ");
    Server {
        child,
        url,
        grpc,
        db,
        log,
        _dir: dir,
    }
}

/// `GET url`'s JSON body.
pub async fn json_at(http: &reqwest::Client, url: &str) -> serde_json::Value {
    http.get(url)
        .send()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: {e}"))
        .json()
        .await
        .unwrap_or_else(|e| panic!("GET {url}: not JSON: {e}"))
}

/// Polls `check` until it holds; panics after 30 s.
pub async fn eventually<F, Fut>(what: &str, check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    keel_testkit::eventually(what, std::time::Duration::from_secs(30), check).await;
}

/// What a [`receiver`] got: each request's headers and body, in order.
pub type Received = Arc<parking_lot::Mutex<Vec<(axum::http::HeaderMap, axum::body::Bytes)>>>;

/// A webhook receiver on loopback that keeps every request it gets and
/// answers each with `answer`; returns its URL.
pub async fn receiver(
    answer: impl Fn() -> axum::response::Response + Clone + Send + Sync + 'static,
) -> (String, Received) {
    let received: Received = Arc::default();
    let kept = Arc::clone(&received);
    let app = axum::Router::new().fallback(
        move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
            let (kept, answer) = (Arc::clone(&kept), answer.clone());
            async move {
                kept.lock().push((headers, body));
                answer()
            }
        },
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, received)
}

/// A [`receiver`] that answers every request `200 OK`.
pub async fn ok_receiver() -> (String, Received) {
    receiver(|| axum::response::IntoResponse::into_response("ok")).await
}

/// A valid order body: two teas for `customer`.
pub fn order(customer: &str) -> serde_json::Value {
    serde_json::json!({"customerId": customer, "currency": "USD",
        "items": [{"sku": "tea", "qty": 2, "unitPriceCents": 450}]})
}

/// `POST /orders` of `body` under Idempotency-Key `key`, ready to send.
pub fn order_request(
    http: &reqwest::Client,
    s: &Server,
    key: &str,
    body: &serde_json::Value,
) -> reqwest::RequestBuilder {
    http.post(format!("{}/orders", s.url))
        .header("idempotency-key", key)
        .json(body)
}

/// Sends [`order_request`].
pub async fn place(
    http: &reqwest::Client,
    s: &Server,
    key: &str,
    body: &serde_json::Value,
) -> reqwest::Response {
    order_request(http, s, key, body).send().await.unwrap()
}

/// [`place`]s the order and returns its id.
pub async fn placed_id(
    http: &reqwest::Client,
    s: &Server,
    key: &str,
    body: &serde_json::Value,
) -> String {
    let placed: serde_json::Value = place(http, s, key, body).await.json().await.unwrap();
    placed["id"].as_str().expect("an order id").to_owned()
}

/// What an [`otlp_receiver`] was sent.
pub type Spans = Arc<parking_lot::Mutex<Vec<opentelemetry_proto::tonic::trace::v1::Span>>>;

/// An OTLP/HTTP receiver on loopback keeping every span it is sent.
pub async fn otlp_receiver() -> (String, Spans) {
    use axum::extract::State;
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use prost::Message as _;
    let spans: Spans = Arc::default();
    let app = axum::Router::new()
        .route(
            "/v1/traces",
            axum::routing::post(
                |State(kept): State<Spans>, body: axum::body::Bytes| async move {
                    let request = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                    let mut kept = kept.lock();
                    for resource in request.resource_spans {
                        for scope in resource.scope_spans {
                            kept.extend(scope.spans);
                        }
                    }
                    [("content-type", "application/x-protobuf")]
                },
            ),
        )
        .with_state(Arc::clone(&spans));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, spans)
}
