//! Receiving webhooks: signature test vectors written from the Standard
//! Webhooks specification, secret rotation, and the `VerifiedWebhook`
//! extractor and hand-off routes answering every case with the right status.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, HeaderName, HeaderValue, Request, StatusCode, header};
use axum::response::Response;
use axum::routing::post;
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use chrono::{DateTime, Utc};
use hmac::{Hmac, Mac};
use http_body_util::BodyExt;
use keel_http::problem::PROBLEM_JSON;
use keel_sqlite::SqliteStore;
use keel_store::OutboxStore;
use keel_webhooks::signing::{
    Secret, SignatureScheme, Verifier, VerifyError, sign_standard, sign_timestamped_hex,
    signature_headers,
};
use keel_webhooks::{VerifiedWebhook, WallClock, WebhookReceiver};
use sha2::Sha256;
use tower::ServiceExt;

// ------------------------------------------------------- specification vectors

/// The Standard Webhooks specification's example: secret, message id,
/// timestamp and body, and the signature it publishes for them.
const SPEC_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const SPEC_ID: &str = "msg_p5jXN8AQM9LWM0D4loKWxJek";
const SPEC_TS: i64 = 1_614_265_330;
const SPEC_BODY: &[u8] = br#"{"test": 2432232314}"#;
const SPEC_SIGNATURE: &str = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=";

/// The specification's algorithm, written out independently of the crate:
/// the key is the base64 after `whsec_`; the signed content is
/// `{id}.{timestamp}.{body}`; the signature is `v1,` + base64(HMAC-SHA256).
fn spec_sign(secret: &str, id: &str, ts: i64, body: &[u8]) -> String {
    let key = BASE64
        .decode(secret.strip_prefix("whsec_").expect("whsec_ prefix"))
        .expect("base64 key");
    let mut content = format!("{id}.{ts}.").into_bytes();
    content.extend_from_slice(body);
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).expect("key");
    mac.update(&content);
    format!("v1,{}", BASE64.encode(mac.finalize().into_bytes()))
}

fn spec_headers(id: &str, ts: i64, signature: &str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert("webhook-id", HeaderValue::from_str(id).expect("id"));
    headers.insert("webhook-timestamp", HeaderValue::from(ts));
    headers.insert(
        "webhook-signature",
        HeaderValue::from_str(signature).expect("sig"),
    );
    headers
}

#[test]
fn the_specification_vector_signs_exactly() {
    // Our independent rendering of the algorithm reproduces the published value...
    assert_eq!(
        spec_sign(SPEC_SECRET, SPEC_ID, SPEC_TS, SPEC_BODY),
        SPEC_SIGNATURE
    );
    // ...and so does the crate, header for header.
    let secret = Secret::parse(SPEC_SECRET).expect("secret");
    assert_eq!(
        sign_standard(&secret, SPEC_ID, SPEC_TS, SPEC_BODY),
        SPEC_SIGNATURE
    );
    let headers = signature_headers(
        &SignatureScheme::StandardWebhooks,
        [&secret],
        SPEC_ID,
        SPEC_TS,
        SPEC_BODY,
    )
    .expect("headers");
    let rendered: Vec<(String, String)> = headers
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_str().expect("ascii").to_owned()))
        .collect();
    assert_eq!(
        rendered,
        [
            ("webhook-id".to_owned(), SPEC_ID.to_owned()),
            ("webhook-timestamp".to_owned(), "1614265330".to_owned()),
            ("webhook-signature".to_owned(), SPEC_SIGNATURE.to_owned()),
        ]
    );
}

#[test]
fn the_specification_vector_verifies_and_any_change_breaks_it() {
    let verifier = Verifier::new([Secret::parse(SPEC_SECRET).expect("secret")]);
    let headers = spec_headers(SPEC_ID, SPEC_TS, SPEC_SIGNATURE);
    let verified = verifier
        .verify(&headers, SPEC_BODY, SPEC_TS)
        .expect("verifies");
    assert_eq!(
        (verified.id.as_str(), verified.timestamp),
        (SPEC_ID, SPEC_TS)
    );

    // The body re-serialised (one space less) no longer verifies: raw bytes only.
    assert_eq!(
        verifier.verify(&headers, br#"{"test":2432232314}"#, SPEC_TS),
        Err(VerifyError::BadSignature)
    );
    // Another id or timestamp with the same signature: refused.
    let other_id = spec_headers("msg_other", SPEC_TS, SPEC_SIGNATURE);
    assert_eq!(
        verifier.verify(&other_id, SPEC_BODY, SPEC_TS),
        Err(VerifyError::BadSignature)
    );
    let other_ts = spec_headers(SPEC_ID, SPEC_TS + 1, SPEC_SIGNATURE);
    assert_eq!(
        verifier.verify(&other_ts, SPEC_BODY, SPEC_TS),
        Err(VerifyError::BadSignature)
    );
    // An extra, unknown signature version and a non-matching v1 next to the
    // good one (as during a sender's rotation): still verifies.
    let wrong = spec_sign(
        "whsec_c2Vjb25kLXNlY3JldC1rZXktYnl0ZXMtMjQ=",
        SPEC_ID,
        SPEC_TS,
        SPEC_BODY,
    );
    let several = spec_headers(
        SPEC_ID,
        SPEC_TS,
        &format!("v1a,ZmFrZQ== {wrong} {SPEC_SIGNATURE}"),
    );
    verifier
        .verify(&several, SPEC_BODY, SPEC_TS)
        .expect("any v1 may match");
}

#[test]
fn a_signature_by_a_second_secret_verifies_with_that_secret() {
    // A second secret, signed with the specification's algorithm.
    let second = format!(
        "whsec_{}",
        BASE64.encode(b"a second secret of 32 bytes!!!!!")
    );
    let signature = spec_sign(&second, "evt_2", 1_700_000_000, b"{}");
    let headers = spec_headers("evt_2", 1_700_000_000, &signature);
    let only_first = Verifier::new([Secret::parse(SPEC_SECRET).expect("secret")]);
    assert_eq!(
        only_first.verify(&headers, b"{}", 1_700_000_000),
        Err(VerifyError::BadSignature)
    );
    let both = Verifier::new([
        Secret::parse(SPEC_SECRET).expect("secret"),
        Secret::parse(&second).expect("secret"),
    ]);
    both.verify(&headers, b"{}", 1_700_000_000)
        .expect("the second secret verifies");
}

#[test]
fn the_seed_format_matches_the_seeds_sign_function() {
    // def sign(secret, body, timestamp):
    //     mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    //     return f"t={timestamp},v1={mac.hexdigest()}"
    let mut mac = Hmac::<Sha256>::new_from_slice(b"acme-secret").expect("key");
    mac.update(b"1700000000.{\"a\":1}");
    let expected = format!(
        "t=1700000000,v1={}",
        hex::encode(mac.finalize().into_bytes())
    );
    let secret = Secret::parse("acme-secret").expect("raw secret");
    assert_eq!(
        sign_timestamped_hex([&secret], 1_700_000_000, br#"{"a":1}"#),
        expected
    );

    let header = HeaderName::from_static("x-acme-signature");
    let mut headers = HeaderMap::new();
    headers.insert("webhook-id", HeaderValue::from_static("evt_1"));
    headers.insert(
        header.clone(),
        HeaderValue::from_str(&expected).expect("value"),
    );
    let verifier = Verifier::new([secret]).scheme(SignatureScheme::TimestampedHex { header });
    verifier
        .verify(&headers, br#"{"a":1}"#, 1_700_000_100)
        .expect("verifies");
    assert_eq!(
        verifier.verify(&headers, br#"{"a":2}"#, 1_700_000_100),
        Err(VerifyError::BadSignature)
    );
}

#[test]
fn during_a_rotation_both_secrets_verify_and_afterwards_only_the_new_one() {
    let old = Secret::generate().expect("secret");
    let new = Secret::generate().expect("secret");
    let body = br#"{"type":"order.paid"}"#;
    let by_old = spec_headers(
        "evt_1",
        1_700_000_000,
        &sign_standard(&old, "evt_1", 1_700_000_000, body),
    );
    let by_new = spec_headers(
        "evt_1",
        1_700_000_000,
        &sign_standard(&new, "evt_1", 1_700_000_000, body),
    );
    let grace = Verifier::new([old.clone(), new.clone()]);
    grace
        .verify(&by_old, body, 1_700_000_000)
        .expect("old verifies during the grace period");
    grace
        .verify(&by_new, body, 1_700_000_000)
        .expect("new verifies during the grace period");
    let after = Verifier::new([new]);
    assert_eq!(
        after.verify(&by_old, body, 1_700_000_000),
        Err(VerifyError::BadSignature)
    );
    after
        .verify(&by_new, body, 1_700_000_000)
        .expect("new verifies afterwards");
}

// ------------------------------------------------------- the extractor

fn now() -> DateTime<Utc> {
    "2026-11-29T10:00:00Z".parse().expect("time")
}

struct App {
    router: Router,
    secret: Secret,
    handled: Arc<AtomicUsize>,
}

/// A receiver whose handler counts what it processes.
fn app(configure: impl FnOnce(WebhookReceiver) -> WebhookReceiver) -> App {
    let secret = Secret::generate().expect("secret");
    let receiver =
        configure(WebhookReceiver::new([secret.clone()]).clock(WallClock::manual(now())));
    let handled = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&handled);
    let router = Router::new()
        .route(
            "/webhooks",
            post(move |hook: VerifiedWebhook| {
                let counter = Arc::clone(&counter);
                async move {
                    counter.fetch_add(1, Ordering::SeqCst);
                    format!(
                        "{} {}",
                        hook.id,
                        hook.payload["type"].as_str().unwrap_or_default()
                    )
                }
            }),
        )
        .with_state(receiver);
    App {
        router,
        secret,
        handled,
    }
}

fn signed(secret: &Secret, id: &str, ts: i64, body: &'static [u8]) -> Request<Body> {
    let mut request = Request::post("/webhooks")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .expect("request");
    for (name, value) in
        signature_headers(&SignatureScheme::default(), [secret], id, ts, body).expect("sign")
    {
        request.headers_mut().insert(name, value);
    }
    request
}

async fn call(router: &Router, request: Request<Body>) -> (StatusCode, HeaderMap, String) {
    let response: Response = router.clone().oneshot(request).await.expect("infallible");
    let status = response.status();
    let headers = response.headers().clone();
    let body = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    (status, headers, String::from_utf8_lossy(&body).into_owned())
}

async fn expect_problem(router: &Router, request: Request<Body>, status: StatusCode, detail: &str) {
    let (got, headers, body) = call(router, request).await;
    assert_eq!(got, status, "{body}");
    assert_eq!(headers[header::CONTENT_TYPE], PROBLEM_JSON);
    let problem: serde_json::Value = serde_json::from_str(&body).expect("problem json");
    assert_eq!(problem["status"], status.as_u16());
    let text = problem["detail"].as_str().unwrap_or_default();
    assert!(text.contains(detail), "{text:?} should contain {detail:?}");
    assert!(
        problem["type"]
            .as_str()
            .unwrap_or_default()
            .starts_with("urn:keel:problem:webhook:")
    );
}

const BODY: &[u8] = br#"{"id":"evt_1","type":"order.paid","data":{"orderId":"A-4471"}}"#;

#[tokio::test]
async fn a_valid_webhook_reaches_the_handler() {
    let app = app(|r| r);
    let (status, _, body) = call(
        &app.router,
        signed(&app.secret, "evt_1", now().timestamp(), BODY),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(body, "evt_1 order.paid");
    assert_eq!(app.handled.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn a_bad_signature_is_401() {
    let app = app(|r| r);
    let stranger = Secret::generate().expect("secret");
    let request = signed(&stranger, "evt_1", now().timestamp(), BODY);
    expect_problem(
        &app.router,
        request,
        StatusCode::UNAUTHORIZED,
        "bad webhook signature",
    )
    .await;
    // A tampered body, signed correctly before the change.
    let mut request = signed(&app.secret, "evt_2", now().timestamp(), BODY);
    *request.body_mut() = Body::from(r#"{"id":"evt_2","type":"order.refunded"}"#);
    expect_problem(
        &app.router,
        request,
        StatusCode::UNAUTHORIZED,
        "bad webhook signature",
    )
    .await;
    assert_eq!(app.handled.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn stale_and_future_timestamps_are_400() {
    let app = app(|r| r);
    let ts = now().timestamp();
    let stale = signed(&app.secret, "evt_1", ts - 301, BODY);
    expect_problem(
        &app.router,
        stale,
        StatusCode::BAD_REQUEST,
        "301 s old, outside the tolerance",
    )
    .await;
    let future = signed(&app.secret, "evt_2", ts + 301, BODY);
    expect_problem(
        &app.router,
        future,
        StatusCode::BAD_REQUEST,
        "301 s in the future",
    )
    .await;
    assert_eq!(app.handled.load(Ordering::SeqCst), 0);
    // Exactly at the edge of ±5 minutes is accepted.
    for (id, at) in [("evt_3", ts - 300), ("evt_4", ts + 300)] {
        let (status, _, _) = call(&app.router, signed(&app.secret, id, at, BODY)).await;
        assert_eq!(status, StatusCode::OK, "{id}");
    }
    // A narrower tolerance is a setting.
    let strict = self::app(|r| r.tolerance(Duration::from_secs(30)));
    let late = signed(&strict.secret, "evt_5", ts - 31, BODY);
    expect_problem(
        &strict.router,
        late,
        StatusCode::BAD_REQUEST,
        "outside the tolerance",
    )
    .await;
}

#[tokio::test]
async fn a_duplicate_id_is_2xx_without_processing_again() {
    let app = app(|r| r);
    let ts = now().timestamp();
    let (status, _, _) = call(&app.router, signed(&app.secret, "evt_1", ts, BODY)).await;
    assert_eq!(status, StatusCode::OK);
    // The sender's retry: same id, new timestamp and signature.
    let (status, headers, body) =
        call(&app.router, signed(&app.secret, "evt_1", ts + 10, BODY)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(headers[header::CONTENT_TYPE], "application/json");
    assert_eq!(body, r#"{"received":true,"duplicate":true}"#);
    assert_eq!(app.handled.load(Ordering::SeqCst), 1, "processed once");
    // A forged duplicate (bad signature) is refused, not acknowledged.
    let stranger = Secret::generate().expect("secret");
    let (status, _, _) = call(&app.router, signed(&stranger, "evt_1", ts, BODY)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // Without the in-memory window, the handler sees every delivery.
    let plain = self::app(WebhookReceiver::without_dedup);
    for _ in 0..2 {
        call(&plain.router, signed(&plain.secret, "evt_1", ts, BODY)).await;
    }
    assert_eq!(plain.handled.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn an_oversized_body_is_413() {
    let app = app(|r| r.max_body_bytes(64));
    const BIG: &[u8] = &[b' '; 65];
    let request = signed(&app.secret, "evt_1", now().timestamp(), BIG);
    expect_problem(
        &app.router,
        request,
        StatusCode::PAYLOAD_TOO_LARGE,
        "64-byte limit",
    )
    .await;
    // Without Content-Length (streamed), the limit holds while reading.
    let mut request = signed(&app.secret, "evt_2", now().timestamp(), BIG);
    let chunks: Vec<Result<Bytes, std::io::Error>> = vec![
        Ok(Bytes::from_static(&BIG[..40])),
        Ok(Bytes::from_static(&BIG[40..])),
    ];
    *request.body_mut() = Body::from_stream(futures_util::stream::iter(chunks));
    request.headers_mut().remove(header::CONTENT_LENGTH);
    expect_problem(
        &app.router,
        request,
        StatusCode::PAYLOAD_TOO_LARGE,
        "64-byte limit",
    )
    .await;
    assert_eq!(app.handled.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn malformed_signature_headers_are_400_never_500() {
    let app = app(|r| r);
    let ts = now().timestamp().to_string();
    let good = sign_standard(&app.secret, "evt_1", now().timestamp(), BODY);
    type Headers<'a> = Vec<(&'static str, &'a [u8])>;
    let cases: Vec<(Headers<'_>, &str)> = vec![
        (
            vec![
                ("webhook-timestamp", ts.as_bytes()),
                ("webhook-signature", good.as_bytes()),
            ],
            "`webhook-id` header is missing",
        ),
        (
            vec![
                ("webhook-id", b"evt_1"),
                ("webhook-signature", good.as_bytes()),
            ],
            "`webhook-timestamp` header is missing",
        ),
        (
            vec![
                ("webhook-id", b"evt_1"),
                ("webhook-timestamp", ts.as_bytes()),
            ],
            "`webhook-signature` header is missing",
        ),
        (
            vec![
                ("webhook-id", b"evt_1"),
                ("webhook-timestamp", b"yesterday"),
                ("webhook-signature", good.as_bytes()),
            ],
            "Unix seconds",
        ),
        (
            vec![
                ("webhook-id", b"evt_1"),
                ("webhook-timestamp", ts.as_bytes()),
                ("webhook-signature", b"v1"),
            ],
            "`v1,<base64>`",
        ),
        (
            vec![
                ("webhook-id", b"evt_1"),
                ("webhook-timestamp", ts.as_bytes()),
                ("webhook-signature", b"v1,not base64!"),
            ],
            "not valid base64",
        ),
        (
            vec![
                ("webhook-id", b"evt_1"),
                ("webhook-timestamp", ts.as_bytes()),
                ("webhook-signature", b"v1,AAAA"),
            ],
            "32 bytes",
        ),
        (
            vec![
                ("webhook-id", b"evt_1"),
                ("webhook-timestamp", ts.as_bytes()),
                ("webhook-signature", b"v2,AAAA"),
            ],
            "no `v1,<base64>`",
        ),
        (
            vec![
                ("webhook-id", b"evt_1"),
                ("webhook-timestamp", ts.as_bytes()),
                ("webhook-signature", b"\xff\xfe"),
            ],
            "visible ASCII",
        ),
        (
            vec![
                ("webhook-id", &[b'x'; 300]),
                ("webhook-timestamp", ts.as_bytes()),
                ("webhook-signature", good.as_bytes()),
            ],
            "1 to 255",
        ),
    ];
    for (headers, detail) in cases {
        let mut request = Request::post("/webhooks")
            .body(Body::from(BODY))
            .expect("request");
        for (name, value) in headers {
            request.headers_mut().append(
                HeaderName::from_static(name),
                HeaderValue::from_bytes(value).expect("value"),
            );
        }
        expect_problem(&app.router, request, StatusCode::BAD_REQUEST, detail).await;
    }
    // Two signature headers.
    let mut request = signed(&app.secret, "evt_1", now().timestamp(), BODY);
    request
        .headers_mut()
        .append("webhook-signature", HeaderValue::from_static("v1,AAAA"));
    expect_problem(&app.router, request, StatusCode::BAD_REQUEST, "sent once").await;
    // A huge header.
    let mut request = signed(&app.secret, "evt_1", now().timestamp(), BODY);
    let huge = format!("{good} {}", "v9,x".repeat(400));
    request.headers_mut().insert(
        "webhook-signature",
        HeaderValue::from_str(&huge).expect("value"),
    );
    expect_problem(
        &app.router,
        request,
        StatusCode::BAD_REQUEST,
        "longer than 1024 bytes",
    )
    .await;
    assert_eq!(app.handled.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn invalid_json_with_a_valid_signature_is_400() {
    let app = app(|r| r);
    let request = signed(&app.secret, "evt_1", now().timestamp(), b"{not json");
    expect_problem(
        &app.router,
        request,
        StatusCode::BAD_REQUEST,
        "not valid JSON",
    )
    .await;
    // It did not poison the dedupe window: a corrected delivery is processed.
    let (status, _, _) = call(
        &app.router,
        signed(&app.secret, "evt_1", now().timestamp(), BODY),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
}

#[tokio::test]
async fn a_typed_payload_is_parsed() {
    #[derive(serde::Deserialize)]
    struct OrderPaid {
        #[serde(rename = "type")]
        kind: String,
        data: Order,
    }
    #[derive(serde::Deserialize)]
    struct Order {
        #[serde(rename = "orderId")]
        order_id: String,
    }
    let secret = Secret::generate().expect("secret");
    let receiver = WebhookReceiver::new([secret.clone()]).clock(WallClock::manual(now()));
    let router = Router::new()
        .route(
            "/webhooks",
            post(|hook: VerifiedWebhook<OrderPaid>| async move {
                format!("{} {}", hook.payload.kind, hook.payload.data.order_id)
            }),
        )
        .with_state(receiver);
    let (status, _, body) = call(&router, signed(&secret, "evt_1", now().timestamp(), BODY)).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, "order.paid A-4471")
    );
    let wrong_shape = signed(&secret, "evt_2", now().timestamp(), br#"{"type":"x"}"#);
    expect_problem(
        &router,
        wrong_shape,
        StatusCode::BAD_REQUEST,
        "missing field `data`",
    )
    .await;
}

#[tokio::test]
async fn the_channel_route_answers_at_once_and_sheds_when_full() {
    let secret = Secret::generate().expect("secret");
    let receiver = WebhookReceiver::new([secret.clone()]).clock(WallClock::manual(now()));
    let (queue, mut work) = tokio::sync::mpsc::channel(1);
    let router: Router = Router::new().route("/webhooks", receiver.channel_route(queue));
    let ts = now().timestamp();
    let (status, _, body) = call(&router, signed(&secret, "evt_1", ts, BODY)).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, r#"{"received":true}"#)
    );
    // Nobody is draining the queue: the next one is shed with 503 + Retry-After.
    let (status, headers, _) = call(&router, signed(&secret, "evt_2", ts, BODY)).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(headers[header::RETRY_AFTER], "5");
    assert_eq!(headers[header::CONTENT_TYPE], PROBLEM_JSON);
    // The worker picks up the first; the sender's retry of evt_2 is taken
    // (its id was released, not remembered as seen).
    let first = work.recv().await.expect("queued");
    assert_eq!(first.id, "evt_1");
    assert_eq!(first.body.as_ref(), BODY, "the raw body travels with it");
    let (status, _, _) = call(&router, signed(&secret, "evt_2", ts + 60, BODY)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(work.recv().await.expect("queued").id, "evt_2");
    // And the duplicate of evt_1 is acknowledged without being queued.
    let (status, _, body) = call(&router, signed(&secret, "evt_1", ts + 60, BODY)).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, r#"{"received":true,"duplicate":true}"#)
    );
    assert!(work.try_recv().is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_route_dedupes_in_the_store_and_hands_off_durably() {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("keel.db"))
        .await
        .expect("open");
    let secret = Secret::generate().expect("secret");
    // No in-memory window: the store's inbox alone dedupes (across restarts).
    let receiver = WebhookReceiver::new([secret.clone()])
        .clock(WallClock::manual(now()))
        .without_dedup();
    let router: Router = Router::new().route(
        "/webhooks/acme",
        receiver.outbox_route(store.clone(), "webhooks.acme", "acme"),
    );
    let ts = now().timestamp();
    let request = |id: &str, at: i64| {
        let mut r = signed(&secret, id, at, BODY);
        *r.uri_mut() = "/webhooks/acme".parse().expect("uri");
        r
    };
    let (status, _, body) = call(&router, request("evt_1", ts)).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, r#"{"received":true}"#)
    );
    let (status, _, body) = call(&router, request("evt_1", ts + 30)).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::OK, r#"{"received":true,"duplicate":true}"#)
    );
    assert_eq!(
        store.outbox_stats().await.expect("stats").unpublished,
        1,
        "handed off once"
    );
    let pending = store
        .outbox_claim("relay", 10, Duration::from_secs(30))
        .await
        .expect("claim");
    let record = &pending[0].record;
    assert_eq!(record.event_id, "webhook:acme:evt_1");
    assert_eq!(record.topic, "webhooks.acme");
    assert_eq!(record.payload.as_ref(), BODY);
    assert_eq!(record.headers["webhook-id"], "evt_1");
    assert_eq!(record.headers["webhook-timestamp"], ts.to_string());
    // Bad input never reaches the store.
    let stranger = Secret::generate().expect("secret");
    let mut forged = signed(&stranger, "evt_9", ts, BODY);
    *forged.uri_mut() = "/webhooks/acme".parse().expect("uri");
    let (status, _, _) = call(&router, forged).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(store.outbox_stats().await.expect("stats").unpublished, 1);
}

#[tokio::test]
async fn the_seed_format_is_accepted_by_a_configured_receiver() {
    let secret = Secret::parse("acme-secret").expect("secret");
    let header = HeaderName::from_static("x-acme-signature");
    let receiver = WebhookReceiver::new([secret.clone()])
        .scheme(SignatureScheme::TimestampedHex {
            header: header.clone(),
        })
        .clock(WallClock::manual(now()));
    let (queue, mut work) = tokio::sync::mpsc::channel(4);
    let router: Router = Router::new().route("/webhooks", receiver.channel_route(queue));
    let ts = now().timestamp();
    let mut request = Request::post("/webhooks")
        .body(Body::from(BODY))
        .expect("request");
    request
        .headers_mut()
        .insert("webhook-id", HeaderValue::from_static("evt_1"));
    request.headers_mut().insert(
        header,
        HeaderValue::from_str(&sign_timestamped_hex([&secret], ts, BODY)).expect("value"),
    );
    let (status, _, _) = call(&router, request).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(work.recv().await.expect("queued").timestamp, ts);
}
