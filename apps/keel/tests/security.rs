//! The security regression suite: each attack of the loopback penetration
//! test, performed against a real `keel serve` process over its real
//! router and listener. Every test here failed on the server before the
//! fixes it names.
//!
//! 1. webhook management needs a tenant's API key, and a tenant sees and
//!    changes only its own endpoints and deliveries, within a limit;
//! 2. the admin API refuses unknown `Host` names (DNS rebinding), refuses
//!    state changes without proof of intent, and webhooks cannot be aimed
//!    at Keel's own listener;
//! 3. half-sent, empty and silent connections are closed, and the caps on
//!    connections and streams answer `503` with `Retry-After`;
//! 4. console sessions are per login, end at logout, are `Secure` behind
//!    HTTPS, and guessing the token is throttled;
//! 5. the smaller leaks: SSRF refusals name no address, console headers,
//!    no attacker-worded notices, secrets sealed at rest, files `0600`,
//!    metrics behind the token, no cross-origin webhook redirects.

mod common;

use std::time::Duration;

use axum::http::StatusCode as AxumStatus;
use axum::response::IntoResponse;
use common::{ACME_KEY, Server, eventually, ok_receiver, order, order_request, receiver, serve};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const TOKEN: &str = "security-suite-admin-token-0123";
const GLOBEX_KEY: &str = "globex-key-0123456789abcdef";
const SECRETS_KEY: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

/// Sends `request` as raw bytes and returns the status and the whole
/// answer (the request should say `Connection: close`).
async fn raw(s: &Server, request: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(s.host()).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer).into_owned();
    let status = answer
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {answer:?}"));
    (status, answer)
}

/// Whether the server closes `stream` within `limit` (reading whatever it
/// sends first).
async fn closed_within(stream: &mut TcpStream, limit: Duration) -> bool {
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

/// Polls `request` until `pick` finds something in its JSON answer.
async fn poll(
    what: &str,
    request: impl Fn() -> reqwest::RequestBuilder,
    pick: impl Fn(&Value) -> Option<Value>,
) -> Value {
    for _ in 0..300 {
        let answer: Value = request().send().await.unwrap().json().await.unwrap();
        if let Some(found) = pick(&answer) {
            return found;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("timed out waiting for {what}");
}

async fn create_endpoint(
    http: &reqwest::Client,
    s: &Server,
    key: &str,
    url: &str,
) -> reqwest::Response {
    http.post(format!("{}/webhook-endpoints", s.url))
        .bearer_auth(key)
        .json(&json!({"url": url}))
        .send()
        .await
        .unwrap()
}

/// `GET /webhook-endpoints` as the tenant of `key`.
async fn endpoints_of(http: &reqwest::Client, s: &Server, key: &str) -> Value {
    http.get(format!("{}/webhook-endpoints", s.url))
        .bearer_auth(key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn place_order(http: &reqwest::Client, s: &Server, key: &str, fault: Option<&str>) -> Value {
    let mut request = order_request(http, s, key, &order("sec"));
    if let Some(fault) = fault {
        request = request.header("x-keel-demo-fault", fault);
    }
    let response = request.send().await.unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    response.json().await.unwrap()
}

// ------------------------------------------- 1. webhook management --

#[tokio::test]
async fn webhook_management_needs_an_api_key_even_where_the_admin_has_a_token() {
    let s = serve(&["--admin-token", TOKEN, "--allow-loopback-webhooks"]);
    let http = client();
    for (method, path) in [
        (Method::POST, "/webhook-endpoints"),
        (Method::GET, "/webhook-endpoints"),
        (Method::GET, "/webhook-endpoints/ep_x/deliveries"),
        (Method::DELETE, "/webhook-endpoints/ep_x"),
        (Method::POST, "/deliveries/1/resend"),
    ] {
        // Wrong keys count towards the address's throttle: stay under it.
        for auth in [None, Some(TOKEN)] {
            let mut request = http
                .request(method.clone(), format!("{}{path}", s.url))
                .json(&json!({"url": "http://127.0.0.1:9/hook"}));
            if let Some(auth) = auth {
                request = request.bearer_auth(auth);
            }
            let response = request.send().await.unwrap();
            assert_eq!(
                response.status(),
                StatusCode::UNAUTHORIZED,
                "{method} {path} {auth:?}"
            );
        }
    }
    assert_eq!(
        endpoints_of(&http, &s, ACME_KEY).await,
        json!([]),
        "nothing was registered anonymously"
    );
}

#[tokio::test]
async fn a_tenant_sees_and_changes_only_its_own_endpoints_and_deliveries_within_a_limit() {
    let globex = format!("globex:{GLOBEX_KEY}");
    let s = serve(&[
        "--allow-loopback-webhooks",
        "--api-key",
        &globex,
        "--max-endpoints-per-tenant",
        "2",
    ]);
    let http = client();
    let (hook, hits) = ok_receiver().await;
    let created = create_endpoint(&http, &s, ACME_KEY, &hook).await;
    assert_eq!(created.status(), StatusCode::CREATED);
    let created: Value = created.json().await.unwrap();
    let acme_endpoint = created["id"].as_str().unwrap().to_owned();
    assert!(created["secret"].as_str().unwrap().starts_with("whsec_"));

    assert_eq!(
        endpoints_of(&http, &s, GLOBEX_KEY).await,
        json!([]),
        "another tenant's URL is not listed"
    );
    for (method, path) in [
        (
            Method::GET,
            format!("/webhook-endpoints/{acme_endpoint}/deliveries"),
        ),
        (
            Method::DELETE,
            format!("/webhook-endpoints/{acme_endpoint}"),
        ),
    ] {
        let response = http
            .request(method.clone(), format!("{}{path}", s.url))
            .bearer_auth(GLOBEX_KEY)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::NOT_FOUND, "{method} {path}");
    }

    place_order(&http, &s, "sec-1", None).await;
    let deliveries_url = format!("{}/webhook-endpoints/{acme_endpoint}/deliveries", s.url);
    let delivery = poll(
        "a delivery to acme's endpoint",
        || http.get(&deliveries_url).bearer_auth(ACME_KEY),
        |list| list.as_array()?.first().map(|d| d["id"].clone()),
    )
    .await;
    eventually("the receiver to be called", || async {
        !hits.lock().is_empty()
    })
    .await;
    let resend = |key: &'static str| {
        http.post(format!("{}/deliveries/{delivery}/resend", s.url))
            .bearer_auth(key)
            .send()
    };
    assert_eq!(
        resend(GLOBEX_KEY).await.unwrap().status(),
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        resend(ACME_KEY).await.unwrap().status(),
        StatusCode::ACCEPTED
    );

    assert_eq!(
        create_endpoint(&http, &s, ACME_KEY, &hook).await.status(),
        StatusCode::CREATED
    );
    let third = create_endpoint(&http, &s, ACME_KEY, &hook).await;
    assert_eq!(
        third.status(),
        StatusCode::CONFLICT,
        "two endpoints per tenant"
    );
    assert_eq!(
        create_endpoint(&http, &s, GLOBEX_KEY, &hook).await.status(),
        StatusCode::CREATED,
        "the limit is per tenant"
    );
}

// ------------------------------------------------ 2. the admin API --

#[tokio::test]
async fn without_a_token_rebinding_headerless_posts_and_self_aimed_webhooks_change_nothing() {
    let s = serve(&["--demo-faults", "--allow-loopback-webhooks"]);
    assert!(s.log().contains("NO TOKEN"), "a loud warning: {}", s.log());
    let http = client();
    place_order(&http, &s, "sec-dl", Some("dead-letter")).await;
    let letters = format!("{}/admin/api/dead-letters", s.url);
    let id = poll(
        "a dead letter",
        || http.get(&letters),
        |list| list["items"].as_array()?.first().map(|l| l["id"].clone()),
    )
    .await;
    let id = id.as_str().unwrap().to_owned();
    let discard = format!("/admin/api/dead-letters/{id}/discard");

    let (status, _) = raw(
        &s,
        "GET /admin/api/dead-letters HTTP/1.1\r\nHost: rebind.evil.example\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 403, "a rebound name cannot even read");
    let (status, _) = raw(
        &s,
        &format!(
            "POST {discard} HTTP/1.1\r\nHost: rebind.evil.example\r\nOrigin: \
             http://rebind.evil.example\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        ),
    )
    .await;
    assert_eq!(status, 403, "DNS rebinding");
    let (status, answer) = raw(
        &s,
        &format!(
            "POST {discard} HTTP/1.1\r\nHost: {}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            s.host()
        ),
    )
    .await;
    assert_eq!(status, 403, "no proof of intent: {answer}");
    assert!(answer.contains("admin_intent_required"), "{answer}");
    let port = s.url.rsplit(':').next().unwrap();
    let grpc_port = s.grpc.rsplit(':').next().unwrap();
    for target in [
        format!("{}{discard}", s.url),
        format!("http://localhost:{port}{discard}"),
        // The same address, spelt as an IPv4-mapped IPv6 one.
        format!("http://[::ffff:127.0.0.1]:{port}{discard}"),
        // Another of Keel's own listeners.
        format!("http://127.0.0.1:{grpc_port}/shipping.v1.Shipping/CreateShipment"),
    ] {
        let aimed = create_endpoint(&http, &s, ACME_KEY, &target).await;
        assert_eq!(
            aimed.status(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "a webhook aimed at Keel itself: {target}"
        );
    }
    let letter: Value = http
        .get(format!("{letters}/{id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(letter["status"], "pending", "nothing was discarded");

    // The operator's way: a session, then its CSRF token.
    let login = http
        .post(format!("{}/admin/api/login", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(login.status(), StatusCode::CREATED);
    let cookie = login.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned();
    let csrf = login.json::<Value>().await.unwrap()["csrf"]
        .as_str()
        .unwrap()
        .to_owned();
    let done = http
        .post(format!("{}{discard}", s.url))
        .header("cookie", &cookie)
        .header("x-keel-csrf", &csrf)
        .send()
        .await
        .unwrap();
    assert_eq!(done.status(), StatusCode::OK);
}

// ---------------------------------------------------- 3. connections --

#[tokio::test]
async fn half_sent_empty_and_silent_connections_are_closed() {
    let s = serve(&["--header-read-timeout-secs", "1"]);
    let mut half = TcpStream::connect(s.host()).await.unwrap();
    half.write_all(b"GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        .await
        .unwrap();
    assert!(
        closed_within(&mut half, Duration::from_secs(5)).await,
        "half-sent head"
    );
    let mut empty = TcpStream::connect(s.host()).await.unwrap();
    assert!(
        closed_within(&mut empty, Duration::from_secs(5)).await,
        "empty connection"
    );
    let mut silent = TcpStream::connect(s.host()).await.unwrap();
    silent
        .write_all(
            b"POST /orders HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
              Idempotency-Key: slow\r\nContent-Length: 100\r\n\r\n{",
        )
        .await
        .unwrap();
    assert!(
        closed_within(&mut silent, Duration::from_secs(15)).await,
        "a body that never comes (the request's 10 s deadline)"
    );
    let alive = reqwest::get(format!("{}/livez", s.url)).await.unwrap();
    assert_eq!(alive.status(), StatusCode::OK);
}

#[tokio::test]
async fn past_the_connection_cap_a_new_connection_gets_503_with_retry_after() {
    let s = serve(&["--max-connections", "2"]);
    let _held: Vec<TcpStream> = vec![
        TcpStream::connect(s.host()).await.unwrap(),
        TcpStream::connect(s.host()).await.unwrap(),
    ];
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (status, answer) = raw(
        &s,
        "GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 503, "{answer}");
    assert!(
        answer.to_ascii_lowercase().contains("retry-after: 1"),
        "{answer}"
    );
    // Alive at the cap: a liveness probe that failed here would have the
    // orchestrator restart the server in a loop for as long as the attack
    // lasts.
    let (status, answer) = raw(
        &s,
        "GET /livez HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 200, "{answer}");
}

#[tokio::test]
async fn one_address_cannot_take_the_connections_every_other_client_needs() {
    let s = serve(&[
        "--max-connections",
        "8",
        "--max-connections-per-address",
        "3",
    ]);
    let port = s.host().rsplit(':').next().unwrap().parse::<u16>().unwrap();
    let from = |octet: u8| async move {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(([127, 0, 0, octet], 0).into()).unwrap();
        socket.connect(([127, 0, 0, 1], port).into()).await.unwrap()
    };
    // Eight from one address: without a share they would take every slot.
    let mut held = Vec::new();
    for _ in 0..8 {
        held.push(from(9).await);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut other = from(10).await;
    other
        .write_all(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), other.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 200"),
        "another address: {answer}"
    );
}

#[tokio::test]
async fn a_body_trickled_a_byte_at_a_time_is_cut_on_every_route() {
    let s = serve(&["--body-read-timeout-secs", "1", "--admin-token", TOKEN]);
    let json = "application/json";
    let form = "application/x-www-form-urlencoded";
    for (path, content_type) in [
        ("/webhooks/inbound/partner", json),
        ("/reports", json),
        ("/console/login", form),
        ("/orders", json),
    ] {
        let mut slow = TcpStream::connect(s.host()).await.unwrap();
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {content_type}\r\n\
             Origin: {}\r\nIdempotency-Key: trickle-{path}\r\nContent-Length: 100\r\n\r\n",
            s.url
        );
        slow.write_all(head.as_bytes()).await.unwrap();
        let started = tokio::time::Instant::now();
        let mut answer = Vec::new();
        let mut buf = [0u8; 4096];
        // A byte every 200 ms, reading what comes back meanwhile.
        while started.elapsed() < Duration::from_secs(8) {
            let _ = slow.write_all(b" ").await;
            if let Ok(Ok(n)) =
                tokio::time::timeout(Duration::from_millis(200), slow.read(&mut buf)).await
            {
                if n == 0 {
                    break;
                }
                answer.extend_from_slice(&buf[..n]);
            }
        }
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 408"), "{path}: {answer}");
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{path}: cut late"
        );
    }
}

#[tokio::test]
async fn one_client_holds_at_most_its_share_of_streams() {
    let s = serve(&["--max-streams-per-client", "2"]);
    let http = client();
    let stream = || http.get(format!("{}/stream?customerId=sec", s.url)).send();
    let first = stream().await.unwrap();
    let second = stream().await.unwrap();
    assert_eq!(
        (first.status(), second.status()),
        (StatusCode::OK, StatusCode::OK)
    );
    let third = stream().await.unwrap();
    assert_eq!(third.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(third.headers().contains_key("retry-after"));
    let poll = http
        .get(format!("{}/updates?customerId=sec", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(
        poll.status(),
        StatusCode::SERVICE_UNAVAILABLE,
        "long polls count too"
    );
    drop(first);
    eventually("a freed slot", || async {
        stream().await.unwrap().status() == StatusCode::OK
    })
    .await;
}

// ------------------------------------------------------- 4. sessions --

async fn console_login(
    http: &reqwest::Client,
    s: &Server,
    token: &str,
    https: bool,
) -> reqwest::Response {
    let mut request = http
        .post(format!("{}/console/login", s.url))
        .header("origin", &s.url)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("token={token}"));
    if https {
        request = request.header("x-forwarded-proto", "https");
    }
    request.send().await.unwrap()
}

fn cookie_of(response: &reqwest::Response) -> (String, String) {
    let set = response.headers()["set-cookie"]
        .to_str()
        .unwrap()
        .to_owned();
    (set.split(';').next().unwrap().to_owned(), set)
}

#[tokio::test]
async fn console_sessions_are_per_login_end_at_logout_and_are_secure_behind_https() {
    let s = serve(&["--admin-token", TOKEN]);
    let http = client();
    let first = console_login(&http, &s, TOKEN, false).await;
    assert_eq!(first.status(), StatusCode::SEE_OTHER);
    let (cookie, set) = cookie_of(&first);
    assert!(!set.contains("Secure") && set.contains("HttpOnly"), "{set}");
    let (other, _) = cookie_of(&console_login(&http, &s, TOKEN, false).await);
    assert_ne!(cookie, other, "not one static cookie for every operator");
    let (_, secure) = cookie_of(&console_login(&http, &s, TOKEN, true).await);
    assert!(secure.contains("; Secure"), "{secure}");

    let page = http
        .get(format!(
            "{}/console?error=Call%20support%20at%20evil.example",
            s.url
        ))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(page.status(), StatusCode::OK);
    let html = page.text().await.unwrap();
    assert!(
        !html.contains("Call support"),
        "attacker-worded text is not shown"
    );
    let csrf = html
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap()
        .to_owned();
    let logout = http
        .post(format!("{}/console/logout", s.url))
        .header("cookie", &cookie)
        .header("origin", &s.url)
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("csrf={csrf}"))
        .send()
        .await
        .unwrap();
    assert_eq!(logout.status(), StatusCode::SEE_OTHER);
    let after = http
        .get(format!("{}/admin/api/summary", s.url))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(
        after.status(),
        StatusCode::UNAUTHORIZED,
        "the cookie died at logout"
    );
    let still = http
        .get(format!("{}/admin/api/summary", s.url))
        .header("cookie", &other)
        .send()
        .await
        .unwrap();
    assert_eq!(still.status(), StatusCode::OK, "other sessions live on");
}

#[tokio::test]
async fn guessing_the_admin_token_is_throttled() {
    let s = serve(&["--admin-token", TOKEN]);
    let http = client();
    for attempt in 0..10 {
        let wrong = if attempt % 2 == 0 {
            console_login(&http, &s, "not-the-token-not-the-token", false)
                .await
                .status()
        } else {
            http.get(format!("{}/admin/api/summary", s.url))
                .bearer_auth("not-the-token-not-the-token")
                .send()
                .await
                .unwrap()
                .status()
        };
        assert_eq!(wrong, StatusCode::UNAUTHORIZED, "attempt {attempt}");
    }
    let right = http
        .get(format!("{}/admin/api/summary", s.url))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(right.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(right.headers().contains_key("retry-after"));
}

// -------------------------------------------------- 5. smaller leaks --

#[tokio::test]
async fn an_ssrf_refusal_does_not_say_what_a_name_resolves_to() {
    let s = serve(&[]);
    let refused = create_endpoint(&client(), &s, ACME_KEY, "http://localhost:9/hook").await;
    assert_eq!(refused.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let detail = refused.text().await.unwrap();
    for leak in ["127.0.0.1", "::1", "loopback"] {
        assert!(!detail.contains(leak), "{leak} in {detail}");
    }
    // A name that does not exist is refused in the same words and status:
    // registering URLs cannot probe which internal names exist.
    let missing = create_endpoint(
        &client(),
        &s,
        ACME_KEY,
        "http://no-such-name.invalid:9/hook",
    )
    .await;
    assert_eq!(missing.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let missing = missing.text().await.unwrap();
    let words = |detail: &str, host: &str| detail.replace(host, "HOST");
    let (a, b): (Value, Value) = (
        serde_json::from_str(&detail).unwrap(),
        serde_json::from_str(&missing).unwrap(),
    );
    assert_eq!(
        words(a["detail"].as_str().unwrap(), "localhost"),
        words(b["detail"].as_str().unwrap(), "no-such-name.invalid"),
        "{a} / {b}"
    );
    assert_eq!(a["type"], b["type"]);
}

#[tokio::test]
async fn console_pages_forbid_framing_sniffing_caching_and_foreign_scripts() {
    let s = serve(&["--admin-token", TOKEN]);
    let page = client()
        .get(format!("{}/console/login", s.url))
        .send()
        .await
        .unwrap();
    let headers = page.headers();
    let csp = headers["content-security-policy"].to_str().unwrap();
    assert!(
        csp.contains("default-src 'none'") && csp.contains("frame-ancestors 'none'"),
        "{csp}"
    );
    assert_eq!(headers["x-frame-options"], "DENY");
    assert_eq!(headers["x-content-type-options"], "nosniff");
    assert_eq!(headers["cache-control"], "no-store");
}

fn stored_bytes(s: &Server) -> Vec<u8> {
    let mut bytes = std::fs::read(&s.db).unwrap();
    let wal = s.db.with_extension("db-wal");
    bytes.extend(std::fs::read(wal).unwrap_or_default());
    bytes
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

#[tokio::test]
async fn webhook_secrets_are_sealed_at_rest_and_files_are_the_owners_only() {
    let http = client();
    let plain = serve(&["--allow-loopback-webhooks"]);
    assert!(plain.log().contains("plain text"), "{}", plain.log());
    let secret = create_endpoint(&http, &plain, ACME_KEY, "http://127.0.0.1:9/hook").await;
    let secret = secret.json::<Value>().await.unwrap()["secret"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        contains(&stored_bytes(&plain), &secret),
        "without a key the test can see it"
    );

    let sealed = serve(&["--allow-loopback-webhooks", "--secrets-key", SECRETS_KEY]);
    let secret = create_endpoint(&http, &sealed, ACME_KEY, "http://127.0.0.1:9/hook").await;
    let secret = secret.json::<Value>().await.unwrap()["secret"]
        .as_str()
        .unwrap()
        .to_owned();
    let key_part = secret.trim_start_matches("whsec_");
    assert!(
        !contains(&stored_bytes(&sealed), key_part),
        "the secret is sealed"
    );

    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let broker = sealed.db.with_extension("db.broker");
        for file in [&sealed.db, &broker] {
            let mode = std::fs::metadata(file).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", file.display());
        }
    }
}

#[tokio::test]
async fn metrics_and_the_deep_check_need_the_token_unless_made_public() {
    let http = client();
    let s = serve(&["--admin-token", TOKEN]);
    for path in ["/metrics", "/debug/deep"] {
        let anonymous = http.get(format!("{}{path}", s.url)).send().await.unwrap();
        assert_eq!(anonymous.status(), StatusCode::UNAUTHORIZED, "{path}");
        let operator = http
            .get(format!("{}{path}", s.url))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert!(
            operator.status().is_success(),
            "{path}: {}",
            operator.status()
        );
    }
    let probe = http.get(format!("{}/readyz", s.url)).send().await.unwrap();
    assert_eq!(probe.status(), StatusCode::OK, "probes stay public");
    let public = serve(&["--admin-token", TOKEN, "--public-metrics"]);
    let metrics = http
        .get(format!("{}/metrics", public.url))
        .send()
        .await
        .unwrap();
    assert_eq!(metrics.status(), StatusCode::OK);
}

#[tokio::test]
async fn a_webhook_redirect_to_another_host_is_not_followed() {
    let s = serve(&["--allow-loopback-webhooks"]);
    let http = client();
    let (elsewhere, stolen) = ok_receiver().await;
    let location = elsewhere.clone();
    let (hook, redirected) = receiver(move || {
        (
            AxumStatus::TEMPORARY_REDIRECT,
            [("location", location.clone())],
        )
            .into_response()
    })
    .await;
    assert_eq!(
        create_endpoint(&http, &s, ACME_KEY, &hook).await.status(),
        StatusCode::CREATED
    );
    place_order(&http, &s, "sec-redirect", None).await;
    eventually("a delivery attempt", || async {
        !redirected.lock().is_empty()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        stolen.lock().len(),
        0,
        "the signed POST stayed with its endpoint"
    );
}

#[tokio::test]
async fn the_shipping_grpc_port_asks_for_the_token_and_closes_silent_connections() {
    use keel::shop::shipping::pb::CreateShipmentRequest;
    use keel::shop::shipping::pb::shipping_client::ShippingClient;
    let s = serve(&["--admin-token", TOKEN, "--header-read-timeout-secs", "1"]);
    let mut client = ShippingClient::connect(s.grpc.clone()).await.unwrap();
    let forged = CreateShipmentRequest {
        order_id: "forged".to_owned(),
        request_id: "forged-1".to_owned(),
    };
    let refused = client.create_shipment(forged.clone()).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unauthenticated, "{refused:?}");
    let mut request = tonic::Request::new(forged);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {TOKEN}").parse().unwrap());
    let accepted = client.create_shipment(request).await;
    assert!(
        !matches!(&accepted, Err(status) if status.code() == tonic::Code::Unauthenticated),
        "{accepted:?}"
    );

    let grpc = s.grpc.trim_start_matches("http://").to_owned();
    let mut silent = TcpStream::connect(&grpc).await.unwrap();
    assert!(
        closed_within(&mut silent, Duration::from_secs(5)).await,
        "a connection that never sends its preface"
    );
}
