//! The SSRF guard: a refusal for each forbidden range (IPv4, IPv6, and the
//! IPv4-mapped and other embedding forms), for odd IPv4 spellings, for a
//! name that resolves to a private address, for an address that changes
//! between the check and the connection, and for redirects from an allowed
//! loopback server to forbidden addresses.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use keel_policy::retry::Backoff;
use keel_sqlite::SqliteStore;
use keel_store::Store;
use keel_webhooks::ssrf::{IpNetwork, ResolveFn, SsrfError, SsrfGuard, forbidden_range};
use keel_webhooks::{
    DEFAULT_SCHEDULE, DeliveryFilter, DeliveryStatus, DeliveryWorker, Endpoints, NewEndpoint,
    WallClock, WebhookEvent, WebhookOutbox, WorkerOptions,
};
use parking_lot::Mutex;
use tokio::net::TcpListener;

fn guard() -> SsrfGuard {
    SsrfGuard::new()
}

fn url(text: &str) -> reqwest::Url {
    text.parse().expect("url")
}

/// Every forbidden range, with the range name the refusal must give.
const FORBIDDEN: &[(&str, &str)] = &[
    // IPv4
    ("10.0.0.1", "private (10.0.0.0/8)"),
    ("10.255.255.255", "private (10.0.0.0/8)"),
    ("172.16.0.1", "private (172.16.0.0/12)"),
    ("172.31.255.254", "private (172.16.0.0/12)"),
    ("192.168.1.1", "private (192.168.0.0/16)"),
    ("127.0.0.1", "loopback"),
    ("127.255.255.254", "loopback"),
    ("169.254.169.254", "link-local"),
    ("169.254.0.1", "link-local"),
    ("100.64.0.1", "carrier-grade NAT"),
    ("100.127.255.254", "carrier-grade NAT"),
    ("0.0.0.0", "unspecified"),
    ("0.1.2.3", "this network"),
    ("255.255.255.255", "broadcast"),
    ("224.0.0.1", "multicast"),
    ("239.255.255.250", "multicast"),
    ("240.0.0.1", "reserved"),
    ("192.0.0.8", "IETF protocol assignments"),
    ("192.0.2.10", "documentation"),
    ("198.51.100.10", "documentation"),
    ("203.0.113.10", "documentation"),
    ("198.18.0.1", "benchmarking"),
    ("192.88.99.1", "6to4 relay"),
    // IPv6
    ("::", "unspecified"),
    ("::1", "loopback"),
    ("fe80::1", "link-local (fe80::/10)"),
    ("febf::1", "link-local (fe80::/10)"),
    ("fc00::1", "unique-local"),
    ("fd12:3456:789a::1", "unique-local"),
    ("ff02::1", "multicast"),
    ("2001:db8::1", "documentation"),
    ("3fff::1", "documentation"),
    ("fec0::1", "site-local"),
    ("100::1", "discard-only"),
    ("64:ff9b:1::1", "NAT64 local use"),
    ("2001::1", "IETF protocol assignments"),
    // IPv4-mapped: the IPv4 address inside decides.
    ("::ffff:127.0.0.1", "loopback"),
    ("::ffff:a9fe:a9fe", "link-local"),
    ("::ffff:10.0.0.1", "private (10.0.0.0/8)"),
    ("::ffff:172.16.0.1", "private (172.16.0.0/12)"),
    ("::ffff:192.168.0.1", "private (192.168.0.0/16)"),
    ("::ffff:100.64.0.1", "carrier-grade NAT"),
    ("::ffff:0.0.0.0", "unspecified"),
    ("::ffff:255.255.255.255", "broadcast"),
    // IPv4-translated, IPv4-compatible, NAT64 and 6to4 forms.
    ("::ffff:0:a9fe:a9fe", "link-local"),
    ("::127.0.0.1", "loopback"),
    ("::a9fe:a9fe", "link-local"),
    ("::8.8.8.8", "IPv4-compatible"),
    ("64:ff9b::a9fe:a9fe", "link-local"),
    ("64:ff9b::10.0.0.1", "private (10.0.0.0/8)"),
    ("2002:a9fe:a9fe::1", "link-local"),
    ("2002:7f00:1::1", "loopback"),
];

#[test]
fn every_forbidden_range_is_refused_by_address_and_by_url() {
    let guard = guard();
    for (ip, range) in FORBIDDEN {
        let addr: IpAddr = ip.parse().expect("ip");
        let found = forbidden_range(addr).unwrap_or_else(|| panic!("{ip} must be refused"));
        assert!(
            found.contains(range),
            "{ip}: {found:?} should name {range:?}"
        );
        match guard.check_ip(ip, addr) {
            Err(SsrfError::Forbidden {
                ip: refused,
                range: named,
                ..
            }) => {
                assert_eq!(refused, addr);
                assert_eq!(named, found);
            }
            other => panic!("{ip}: {other:?}"),
        }
        let literal = match addr {
            IpAddr::V4(_) => format!("http://{ip}/hook"),
            IpAddr::V6(_) => format!("http://[{ip}]:8080/hook"),
        };
        let err = guard.check_url(&url(&literal)).expect_err(&literal);
        assert!(
            matches!(err, SsrfError::Forbidden { .. }),
            "{literal}: {err}"
        );
        assert!(err.to_string().contains("refusing to call"), "{err}");
        assert!(
            !err.to_string().contains(found),
            "the refusal does not name the range: {err}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_servers_own_listener_is_refused_even_where_loopback_is_allowed() {
    let own: std::net::SocketAddr = "127.0.0.1:8080".parse().unwrap();
    let guard = SsrfGuard::new()
        .allow(IpNetwork::new([127, 0, 0, 0].into(), 8).unwrap())
        .deny(own);
    assert!(guard.check_url(&url("http://127.0.0.1:8081/hook")).is_ok());
    for target in [
        "http://127.0.0.1:8080/admin/api/dead-letters/x/discard",
        "http://127.0.0.1:8080",
    ] {
        let err = guard.check_url(&url(target)).expect_err(target);
        assert!(
            matches!(err, SsrfError::Forbidden { .. }),
            "{target}: {err}"
        );
    }
    let err = guard
        .check("http://localhost:8080/admin/api/dead-letters/x/discard")
        .await
        .expect_err("a name for the own listener");
    assert!(matches!(err, SsrfError::Forbidden { .. }), "{err}");
    let everywhere = SsrfGuard::new().deny("0.0.0.0:9000".parse().unwrap());
    assert!(
        everywhere
            .check_url(&url("http://93.184.215.14:9000/"))
            .is_err(),
        "a listener on 0.0.0.0 answers on every address"
    );
    assert!(
        everywhere
            .check_url(&url("http://93.184.215.14:9001/"))
            .is_ok()
    );
}

#[test]
fn odd_ipv4_spellings_are_normalised_then_refused() {
    for text in [
        "http://2130706433/",      // 127.0.0.1 as one number
        "http://0x7f.0.0.1/",      // hex
        "http://0177.0.0.1/",      // octal
        "http://127.1/",           // short form
        "http://0xa9fea9fe/",      // 169.254.169.254
        "http://[::ffff:7f00:1]/", // mapped, hex
        "https://[0:0:0:0:0:ffff:169.254.169.254]/",
    ] {
        let err = guard().check_url(&url(text)).expect_err(text);
        assert!(matches!(err, SsrfError::Forbidden { .. }), "{text}: {err}");
    }
}

#[test]
fn public_addresses_and_names_pass_the_syntax_check() {
    for text in [
        "https://93.184.215.14/hooks",
        "http://[2606:4700:4700::1111]/",
        "http://[::ffff:8.8.8.8]/",
        "https://hooks.example.com/a",
    ] {
        guard()
            .check_url(&url(text))
            .unwrap_or_else(|e| panic!("{text}: {e}"));
    }
}

#[test]
fn bad_urls_are_refused() {
    type Expect = fn(&SsrfError) -> bool;
    let cases: &[(&str, Expect)] = &[
        ("ftp://example.com/", |e| {
            matches!(e, SsrfError::Scheme { .. })
        }),
        ("file:///etc/passwd", |e| {
            matches!(e, SsrfError::Scheme { .. })
        }),
        ("http://user:pw@example.com/", |e| {
            matches!(e, SsrfError::Credentials)
        }),
        ("unix:/var/run/docker.sock", |e| {
            matches!(e, SsrfError::Scheme { .. })
        }),
    ];
    for (text, expected) in cases {
        let err = guard().check_url(&url(text)).expect_err(text);
        assert!(expected(&err), "{text}: {err}");
    }
    let https = SsrfGuard::new().https_only(true);
    assert!(matches!(
        https.check_url(&url("http://example.com/")),
        Err(SsrfError::Scheme {
            allowed: "https",
            ..
        })
    ));
    let long = format!("https://example.com/{}", "a".repeat(3000));
    assert!(matches!(
        guard().check_url(&url(&long)),
        Err(SsrfError::TooLong { .. })
    ));
}

#[test]
fn the_allow_list_lets_exactly_its_networks_through() {
    let guard = SsrfGuard::new().allow("127.0.0.1/32".parse().expect("net"));
    assert!(guard.check_url(&url("http://127.0.0.1:9000/")).is_ok());
    assert!(
        guard
            .check_url(&url("http://[::ffff:127.0.0.1]:9000/"))
            .is_ok(),
        "the same address"
    );
    assert!(guard.check_url(&url("http://127.0.0.2/")).is_err());
    assert!(guard.check_url(&url("http://[::1]/")).is_err());
    assert!(guard.check_url(&url("http://169.254.169.254/")).is_err());
    let net: IpNetwork = "10.20.0.0/16".parse().expect("net");
    let internal = SsrfGuard::new().allow(net);
    assert!(
        internal
            .check_ip("svc", "10.20.1.2".parse().expect("ip"))
            .is_ok()
    );
    assert!(
        internal
            .check_ip("svc", "10.21.1.2".parse().expect("ip"))
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_name_resolving_to_a_private_address_is_refused() {
    let err = guard()
        .resolve("localhost", 80)
        .await
        .expect_err("localhost is loopback");
    match &err {
        SsrfError::Forbidden { host, range, .. } => {
            assert_eq!(host, "localhost");
            assert!(range.contains("loopback"), "{range}");
        }
        other => panic!("{other:?}"),
    }
    let err = guard()
        .check("http://localhost:8080/hook")
        .await
        .expect_err("refused");
    assert!(matches!(err, SsrfError::Forbidden { .. }), "{err}");

    // The guarded client refuses it at connection time too, so a real
    // loopback server behind the name never sees the request.
    let (hits, addr) = counting_server().await;
    let client = guard().client_builder().build().expect("client");
    let err = client
        .get(format!("http://localhost:{}/", addr.port()))
        .send()
        .await
        .expect_err("refused");
    let ssrf = keel_core::error::find_cause::<SsrfError>(&err).expect("the cause is the guard");
    assert!(matches!(ssrf, SsrfError::Forbidden { .. }), "{ssrf}");
    assert_eq!(hits.load(Ordering::SeqCst), 0);
}

/// A resolver that answers `answers` in turn, for the same name.
fn rebinding(answers: Vec<IpAddr>) -> ResolveFn {
    let next = Arc::new(AtomicUsize::new(0));
    Arc::new(move |_host: String, port: u16| {
        let i = next.fetch_add(1, Ordering::SeqCst).min(answers.len() - 1);
        let addr = SocketAddr::new(answers[i], port);
        Box::pin(async move { Ok(vec![addr]) })
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dns_rebind_between_check_and_connect_is_refused() {
    let (hits, addr) = counting_server().await;
    // First answer: the allowed test server. Every later answer: metadata.
    let guard = SsrfGuard::new()
        .allow("127.0.0.1/32".parse().expect("net"))
        .resolver(rebinding(vec![
            "127.0.0.1".parse().expect("ip"),
            "169.254.169.254".parse().expect("ip"),
        ]));
    let target = format!("http://rebind.example:{}/", addr.port());
    guard
        .check(&target)
        .await
        .expect("the registration-time check passes");
    // The connection resolves again, through the guard, and is refused.
    let client = guard.client_builder().build().expect("client");
    let err = client
        .post(&target)
        .send()
        .await
        .expect_err("refused at connect");
    let ssrf = keel_core::error::find_cause::<SsrfError>(&err).expect("the cause is the guard");
    assert!(matches!(ssrf, SsrfError::Forbidden { .. }), "{ssrf}");
    assert!(!ssrf.to_string().contains("169.254.169.254"), "{ssrf}");
    assert_eq!(hits.load(Ordering::SeqCst), 0, "nothing was sent anywhere");
}

async fn counting_server() -> (Arc<AtomicUsize>, SocketAddr) {
    let hits = Arc::new(AtomicUsize::new(0));
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let counter = Arc::clone(&hits);
    let app = Router::new().fallback(move || {
        counter.fetch_add(1, Ordering::SeqCst);
        async { "hello" }
    });
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    (hits, addr)
}

// ---------------------------------------------------------------- redirects

/// A request as the redirecting server saw it: path, method, headers, body.
type Seen = (String, Method, HeaderMap, Bytes);

#[derive(Clone, Default)]
struct Redirector {
    location: Arc<Mutex<Option<String>>>,
    seen: Arc<Mutex<Vec<Seen>>>,
}

async fn redirecting(
    State(r): State<Redirector>,
    method: Method,
    uri: axum::http::Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    r.seen
        .lock()
        .push((uri.path().to_owned(), method, headers, body));
    if uri.path() == "/final" {
        return (StatusCode::OK, "arrived").into_response();
    }
    match r.location.lock().clone() {
        Some(location) => {
            (StatusCode::TEMPORARY_REDIRECT, [("location", location)]).into_response()
        }
        None => StatusCode::OK.into_response(),
    }
}

struct Fx {
    store: SqliteStore,
    _dir: tempfile::TempDir,
    clock: WallClock,
    addr: SocketAddr,
    redirector: Redirector,
}

async fn fx() -> Fx {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("keel.db"))
        .await
        .expect("open");
    let redirector = Redirector::default();
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let app = Router::new()
        .fallback(redirecting)
        .with_state(redirector.clone());
    tokio::spawn(async move { axum::serve(listener, app).await.expect("serve") });
    let start: DateTime<Utc> = "2026-11-29T10:00:00Z".parse().expect("time");
    Fx {
        store,
        _dir: dir,
        clock: WallClock::manual(start),
        addr,
        redirector,
    }
}

impl Fx {
    fn guard(&self) -> SsrfGuard {
        SsrfGuard::new().allow("127.0.0.1/32".parse().expect("net"))
    }

    /// Sends one event to `/start` and returns the logged attempt.
    async fn deliver_through(&self, location: &str) -> keel_webhooks::DeliveryAttempt {
        *self.redirector.location.lock() = Some(location.to_owned());
        let endpoints = Endpoints::new(self.store.clone(), self.guard()).clock(self.clock.clone());
        let (endpoint, _) = endpoints
            .create(NewEndpoint::new(format!("http://{}/start", self.addr)))
            .await
            .expect("create");
        let mut tx = self.store.begin().await.expect("begin");
        WebhookOutbox::new(self.store.clone())
            .clock(self.clock.clone())
            .enqueue(
                &mut tx,
                &[WebhookEvent::new("t", serde_json::json!({"n": 1}))],
            )
            .await
            .expect("enqueue");
        self.store.commit(tx).await.expect("commit");
        let options = WorkerOptions::new()
            .guard(self.guard())
            .clock(self.clock.clone())
            .backoff(Backoff::schedule(DEFAULT_SCHEDULE).expect("schedule"));
        DeliveryWorker::new(self.store.clone(), options)
            .expect("worker")
            .run_once()
            .await
            .expect("run");
        let delivery = endpoints
            .deliveries(&DeliveryFilter {
                endpoint_id: Some(endpoint.id.clone()),
                ..DeliveryFilter::default()
            })
            .await
            .expect("list")
            .remove(0);
        let mut attempts = endpoints.attempts(delivery.id).await.expect("attempts");
        assert_eq!(attempts.len(), 1);
        if attempts[0].response_status == Some(200) {
            assert_eq!(delivery.status, DeliveryStatus::Succeeded);
        }
        // One endpoint per call: the next call's event must not reach it.
        endpoints.delete(&endpoint.id).await.expect("delete");
        attempts.remove(0)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_to_an_allowed_address_is_followed_with_the_same_signed_post() {
    let f = fx().await;
    let attempt = f.deliver_through(&format!("http://{}/final", f.addr)).await;
    assert_eq!(attempt.response_status, Some(200));
    assert_eq!(
        attempt.url,
        format!("http://{}/final", f.addr),
        "the log names the last hop"
    );
    let seen = f.redirector.seen.lock().clone();
    assert_eq!(seen.len(), 2);
    let (first, last) = (&seen[0], &seen[1]);
    assert_eq!((first.0.as_str(), last.0.as_str()), ("/start", "/final"));
    assert_eq!(last.1, Method::POST, "the method is kept");
    assert_eq!(last.3, first.3, "the body is kept");
    assert_eq!(last.2["webhook-signature"], first.2["webhook-signature"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_to_another_origin_is_not_followed_forbidden_or_not() {
    let f = fx().await;
    for location in [
        "http://169.254.169.254/latest/meta-data/iam/",
        "http://[::ffff:a9fe:a9fe]/",
        "http://10.0.0.1:6379/",
        "http://[::1]:9/",
        "http://127.0.0.2/",
        "https://collector.example/",
    ] {
        f.redirector.seen.lock().clear();
        let attempt = f.deliver_through(location).await;
        let error = attempt.error.unwrap_or_default();
        assert!(error.contains("another origin"), "{location}: {error}");
        assert_eq!(attempt.response_status, None, "{location}");
        assert_eq!(
            f.redirector.seen.lock().len(),
            1,
            "the signed request went to the endpoint's origin only"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redirects_stop_after_the_limit() {
    let f = fx().await;
    let attempt = f.deliver_through(&format!("http://{}/start", f.addr)).await;
    assert_eq!(attempt.error.as_deref(), Some("more than 5 redirects"));
    assert_eq!(
        f.redirector.seen.lock().len(),
        6,
        "the first request and five redirects"
    );
}
