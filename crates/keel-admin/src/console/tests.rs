//! The console without a browser: login and its session, CSRF refusals,
//! escaping of hostile text, actions answering `303` with a server-kept
//! notice, security headers, and the live stream's first event.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use http_body_util::BodyExt;
use keel_sqlite::store::SqliteStore;
use keel_store::broker::Message;
use keel_store::{AttemptError, DeadLetter, DeadLetterStatus, DeadLetterStore};
use tower::ServiceExt;

use super::Console;
use crate::{Admin, AdminToken, SESSION_COOKIE};

type App = (tempfile::TempDir, SqliteStore, Router, Admin<SqliteStore>);

const TOKEN: &str = "console-unit-token-0123456789";
const HOST: &str = "127.0.0.1:8080";
const ORIGIN: &str = "http://127.0.0.1:8080";

async fn app(token: AdminToken) -> App {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("c.db")).await.unwrap();
    let letter = DeadLetter {
        id: "billing:<evil>".to_owned(),
        message: Message::new("m-1", "orders", "k", "<script>alert(1)</script>"),
        group: "billing".to_owned(),
        error_kind: "permanent".to_owned(),
        attempts: vec![AttemptError {
            attempt: 1,
            error: "<img src=x onerror=alert(1)>".to_owned(),
            at: keel_core::clock::utc_now(),
        }],
        dead_at: keel_core::clock::utc_now(),
        status: DeadLetterStatus::Pending,
    };
    store.dead_letter_put(&letter).await.unwrap();
    let admin = Admin::builder(store.clone()).token(token).build();
    let console = Console::new(admin.clone()).refresh_interval(Duration::from_millis(100));
    (dir, store, console.router(), admin)
}

/// A logged-in session: its cookie header and CSRF token.
fn session(admin: &Admin<SqliteStore>) -> (String, String) {
    let (session, value) = admin.access().sessions().issue();
    (format!("{SESSION_COOKIE}={value}"), session.csrf)
}

fn get(path: &str, cookie: &str) -> Request<Body> {
    Request::get(path)
        .header(header::HOST, HOST)
        .header(header::COOKIE, cookie)
        .body(Body::empty())
        .unwrap()
}

/// A console form POST, as the page's buttons send it.
fn form_post(path: &str, cookie: &str, origin: &str, csrf: &str) -> Request<Body> {
    Request::post(path)
        .header(header::HOST, HOST)
        .header(header::ORIGIN, origin)
        .header(header::COOKIE, cookie)
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(Body::from(format!("csrf={csrf}")))
        .unwrap()
}

async fn send(app: &Router, request: Request<Body>) -> (StatusCode, Option<String>, String) {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let location = response
        .headers()
        .get(header::LOCATION)
        .map(|v| v.to_str().unwrap().to_owned());
    let set_cookie = response
        .headers()
        .get(header::SET_COOKIE)
        .map(|v| v.to_str().unwrap().to_owned());
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let body = String::from_utf8_lossy(&body).into_owned();
    (status, location.or(set_cookie), body)
}

fn login(token: &str, origin: &str) -> Request<Body> {
    Request::post("/console/login")
        .header(header::HOST, HOST)
        .header(header::ORIGIN, origin)
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(Body::from(format!("token={token}")))
        .unwrap()
}

#[tokio::test]
async fn logging_in_sets_a_strict_http_only_cookie_and_only_the_right_token_does() {
    let (_dir, _store, app, admin) = app(AdminToken::new(TOKEN).unwrap()).await;
    let anonymous = Request::get("/console")
        .header(header::HOST, HOST)
        .body(Body::empty())
        .unwrap();
    let (status, location, _) = send(&app, anonymous).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert_eq!(location.as_deref(), Some("/console/login"));

    let (status, _, body) = send(&app, login("wrong-token-wrong-token", ORIGIN)).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert!(body.contains("not the admin token"));

    let (status, _, _) = send(&app, login(TOKEN, "http://evil.example")).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "login CSRF is refused");

    let response = app.clone().oneshot(login(TOKEN, ORIGIN)).await.unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    let set = response.headers()[header::SET_COOKIE]
        .to_str()
        .unwrap()
        .to_owned();
    assert!(set.starts_with(&format!("{SESSION_COOKIE}=")), "{set}");
    assert!(set.contains("HttpOnly") && set.contains("SameSite=Strict"));
    assert!(
        !set.contains("Secure"),
        "plain HTTP: a Secure cookie would be dropped"
    );
    assert!(!set.contains(TOKEN), "the cookie never holds the token");
    let second = app.clone().oneshot(login(TOKEN, ORIGIN)).await.unwrap();
    let other = second.headers()[header::SET_COOKIE].to_str().unwrap();
    assert_ne!(set, other, "every login is a session of its own");

    let cookie = set.split(';').next().unwrap().to_owned();
    let value = cookie.strip_prefix(&format!("{SESSION_COOKIE}=")).unwrap();
    let live = admin.access().sessions().verify(value).unwrap();
    let (status, _, _) = send(&app, get("/console", &cookie)).await;
    assert_eq!(status, StatusCode::OK);
    let logout = form_post("/console/logout", &cookie, ORIGIN, &live.csrf);
    let (status, location, _) = send(&app, logout).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert_eq!(location.as_deref(), Some("/console/login"));
    let (status, location, _) = send(&app, get("/console", &cookie)).await;
    assert_eq!(status, StatusCode::SEE_OTHER, "the session ended at logout");
    assert_eq!(location.as_deref(), Some("/console/login"));
}

#[tokio::test]
async fn behind_an_https_proxy_the_cookie_is_secure_and_guessing_is_throttled() {
    let (_dir, _store, app, _admin) = app(AdminToken::new(TOKEN).unwrap()).await;
    let mut request = login(TOKEN, ORIGIN);
    request
        .headers_mut()
        .insert("x-forwarded-proto", "https".parse().unwrap());
    let response = app.clone().oneshot(request).await.unwrap();
    let set = response.headers()[header::SET_COOKIE].to_str().unwrap();
    assert!(set.contains("; Secure"), "{set}");
    for _ in 0..keel_http::access::DEFAULT_MAX_FAILURES {
        let (status, _, _) = send(&app, login("wrong-token-wrong-token", ORIGIN)).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
    }
    let (status, _, _) = send(&app, login(TOKEN, ORIGIN)).await;
    assert_eq!(
        status,
        StatusCode::TOO_MANY_REQUESTS,
        "the right token waits too"
    );
}

#[tokio::test]
async fn the_page_escapes_whatever_the_messages_say() {
    let (_dir, _store, app, admin) = app(AdminToken::new(TOKEN).unwrap()).await;
    let (cookie, csrf) = session(&admin);
    let response = app.clone().oneshot(get("/console", &cookie)).await.unwrap();
    let headers = response.headers().clone();
    let csp = headers["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("default-src 'none'") && csp.contains("frame-ancestors 'none'"));
    assert!(
        csp.contains("script-src 'sha256-"),
        "only the console's own script: {csp}"
    );
    assert_eq!(headers[header::X_FRAME_OPTIONS], "DENY");
    assert_eq!(headers[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
    assert_eq!(headers[header::CACHE_CONTROL], "no-store");
    let (status, _, html) = send(&app, get("/console", &cookie)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(
        html.contains(&format!("name=\"csrf\" value=\"{csrf}\"")),
        "forms carry the token"
    );
    assert!(
        !html.contains("onsubmit="),
        "no inline handlers (the CSP forbids them)"
    );
    for id in super::render::SECTIONS {
        assert!(html.contains(&format!("<section id=\"{id}\"")), "{id}");
    }
    assert!(html.contains("data-dead-letter-id=\"billing:&lt;evil&gt;\""));
    assert!(html.contains("/console/dead-letters/billing:%3Cevil%3E/replay"));
    assert!(html.contains("&lt;img src=x onerror=alert(1)&gt;"));
    assert!(html.contains("&lt;script&gt;alert(1)&lt;/script&gt;"));
    assert!(!html.contains("<img src=x"));
    assert!(!html.contains("<script>alert"));
}

#[tokio::test]
async fn actions_answer_303_with_a_notice_and_refuse_other_origins_and_missing_tokens() {
    let (_dir, store, app, admin) = app(AdminToken::new(TOKEN).unwrap()).await;
    let (cookie, csrf) = session(&admin);
    let path = "/console/dead-letters/billing:%3Cevil%3E/discard";
    let (status, _, _) = send(&app, form_post(path, &cookie, "http://evil.example", &csrf)).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let (status, _, _) = send(&app, form_post(path, &cookie, ORIGIN, "forged")).await;
    assert_eq!(
        status,
        StatusCode::FORBIDDEN,
        "without the session's CSRF token"
    );
    let (other_cookie, _) = session(&admin);
    let (status, _, _) = send(&app, form_post(path, &other_cookie, ORIGIN, &csrf)).await;
    assert_eq!(status, StatusCode::FORBIDDEN, "another session's token");
    let letter = store.dead_letter_get("billing:<evil>").await.unwrap();
    assert_eq!(letter.unwrap().status, DeadLetterStatus::Pending);

    let (status, location, _) = send(&app, form_post(path, &cookie, ORIGIN, &csrf)).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert_eq!(
        location.as_deref(),
        Some("/console"),
        "no text travels in the URL"
    );
    let letter = store.dead_letter_get("billing:<evil>").await.unwrap();
    assert_eq!(letter.unwrap().status, DeadLetterStatus::Discarded);
    let (_, _, html) = send(&app, get("/console", &cookie)).await;
    assert!(
        html.contains("data-notice-kind=\"ok\">Discarded dead letter billing:&lt;evil&gt;</div>"),
        "{html}"
    );
    let (_, _, html) = send(&app, get("/console", &cookie)).await;
    assert!(!html.contains("data-notice-kind"), "a notice is shown once");

    let (status, _, _) = send(&app, form_post(path, &cookie, ORIGIN, &csrf)).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    let (_, _, html) = send(&app, get("/console", &cookie)).await;
    assert!(
        html.contains("data-notice-kind=\"error\""),
        "a 409 is shown"
    );

    let (_, _, html) = send(&app, get("/console?error=%3Cb%3ECall%20us", &cookie)).await;
    assert!(
        !html.contains("Call us"),
        "attacker-worded text is never shown"
    );
}

#[tokio::test]
async fn the_live_stream_starts_with_every_section() {
    let (_dir, _store, app, admin) = app(AdminToken::new(TOKEN).unwrap()).await;
    let (cookie, _) = session(&admin);
    let response = app
        .clone()
        .oneshot(get("/console/events", &cookie))
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers()[header::CONTENT_TYPE],
        "text/event-stream"
    );
    let text = event_text(response.into_body()).await;
    assert!(text.starts_with("event: sections\ndata: "), "{text}");
    let json = text.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
    let sections: serde_json::Value = serde_json::from_str(json).unwrap();
    for id in super::render::SECTIONS {
        assert!(sections[id]["hash"].is_string(), "{id}");
        assert!(sections[id]["html"].is_string(), "{id}");
    }
}

#[tokio::test]
async fn without_a_token_a_session_is_opened_but_nothing_changes_without_it() {
    let (_dir, store, app, _admin) = app(AdminToken::none()).await;
    let (status, location, _) = send(
        &app,
        Request::get("/console")
            .header(header::HOST, HOST)
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert_eq!(location.as_deref(), Some("/console/login"));
    let response = app
        .clone()
        .oneshot(
            Request::get("/console/login")
                .header(header::HOST, HOST)
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::SEE_OTHER);
    let cookie = response.headers()[header::SET_COOKIE]
        .to_str()
        .unwrap()
        .split(';')
        .next()
        .unwrap()
        .to_owned();
    let (status, _, html) = send(&app, get("/console", &cookie)).await;
    assert_eq!(status, StatusCode::OK);
    let csrf = html
        .split("name=\"csrf\" value=\"")
        .nth(1)
        .and_then(|rest| rest.split('"').next())
        .unwrap()
        .to_owned();
    let path = "/console/dead-letters/billing:%3Cevil%3E/discard";
    let bare = Request::post(path)
        .header(header::HOST, HOST)
        .body(Body::empty())
        .unwrap();
    let (status, location, _) = send(&app, bare).await;
    assert_eq!(
        status,
        StatusCode::SEE_OTHER,
        "no session: to the login page"
    );
    assert_eq!(location.as_deref(), Some("/console/login"));
    let rebound = Request::post(path)
        .header(header::HOST, "rebind.evil.example")
        .header(header::ORIGIN, "http://rebind.evil.example")
        .header(header::COOKIE, &cookie)
        .header(header::CONTENT_TYPE, "application/x-www-form-urlencoded")
        .body(Body::from(format!("csrf={csrf}")))
        .unwrap();
    let (status, _, _) = send(&app, rebound).await;
    assert_eq!(
        status,
        StatusCode::FORBIDDEN,
        "DNS rebinding names another Host"
    );
    let (status, _, _) = send(&app, form_post(path, &cookie, "http://evil.example", &csrf)).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert_eq!(
        store
            .dead_letter_get("billing:<evil>")
            .await
            .unwrap()
            .unwrap()
            .status,
        DeadLetterStatus::Pending
    );
    let (status, _, _) = send(&app, form_post(path, &cookie, ORIGIN, &csrf)).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert_eq!(
        store
            .dead_letter_get("billing:<evil>")
            .await
            .unwrap()
            .unwrap()
            .status,
        DeadLetterStatus::Discarded
    );
}

/// A parked outbox row is shown with its refusal and the rows behind it,
/// and its Replay button unparks it (same origin only).
#[tokio::test]
async fn a_parked_outbox_row_is_shown_and_replayed_from_the_console() {
    use keel_store::{OutboxAdminStore, OutboxRecord, OutboxStore, Store};
    let (_dir, store, app, admin) = app(AdminToken::new(TOKEN).unwrap()).await;
    let (cookie, csrf) = session(&admin);
    let message = Message::new("evt-poison", "orders", "bad\nkey", "{}");
    let record = OutboxRecord {
        event_id: message.id,
        topic: message.topic,
        partition_key: message.key,
        headers: message.headers,
        payload: message.payload,
    };
    let mut tx = store.begin().await.unwrap();
    store.outbox_append(&mut tx, &[record]).await.unwrap();
    store.commit(tx).await.unwrap();
    let claimed = store
        .outbox_claim("relay", 10, Duration::from_secs(30))
        .await
        .unwrap();
    let id = claimed[0].id;
    store
        .outbox_park(id, "broker refused the request: <b>line break</b>")
        .await
        .unwrap();

    let (_, _, html) = send(&app, get("/console", &cookie)).await;
    assert!(html.contains(&format!("data-parked-id=\"{id}\"")), "{html}");
    assert!(html.contains(&format!("/console/outbox/parked/{id}/replay")));
    assert!(html.contains("&lt;b&gt;line break&lt;/b&gt;"), "escaped");
    assert!(html.contains("data-summary=\"parked-outbox\">1<"));

    let path = format!("/console/outbox/parked/{id}/replay");
    let replay = |origin: &str| form_post(&path, &cookie, origin, &csrf);
    let (status, _, _) = send(&app, replay("http://evil.example")).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(store.outbox_parked_get(id).await.unwrap().is_some());
    let (status, _, _) = send(&app, replay(ORIGIN)).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    let (_, _, html) = send(&app, get("/console", &cookie)).await;
    assert!(
        html.contains(&format!("Replayed parked outbox row {id}")),
        "{html}"
    );
    assert!(store.outbox_parked_get(id).await.unwrap().is_none());
    assert_eq!(store.outbox_stats().await.unwrap().unpublished, 1);
}

/// The stream's first event, as sent.
async fn event_text(mut body: Body) -> String {
    let mut text = String::new();
    while !text.contains("\n\n") {
        let frame = tokio::time::timeout(Duration::from_secs(5), body.frame())
            .await
            .expect("an event within 5 s")
            .unwrap()
            .unwrap();
        if let Ok(data) = frame.into_data() {
            text.push_str(&String::from_utf8_lossy(&data));
        }
    }
    text
}

/// The first event of the stream at `path`, as JSON.
async fn first_event(app: &Router, path: &str, cookie: &str) -> serde_json::Value {
    let response = app.clone().oneshot(get(path, cookie)).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    let text = event_text(response.into_body()).await;
    let json = text.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
    serde_json::from_str(json).unwrap()
}

#[tokio::test]
async fn with_a_history_rows_get_graphs_and_each_subject_a_live_detail_page() {
    use crate::history::History;
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("h.db")).await.unwrap();
    let history = History::builder().build();
    let recorder = history.recorder(metrics::NoopRecorder);
    for lag in [0.0, 5.0, 0.0] {
        metrics::with_local_recorder(&recorder, || {
            metrics::gauge!("keel_consumer_lag", "topic" => "orders", "group" => "bill<ing>")
                .set(lag);
            metrics::histogram!("keel_client_call_duration_seconds", "dependency" => "payments", "outcome" => "ok")
                .record(0.1);
            metrics::gauge!("keel_breaker_state", "name" => "payments").set(0.0);
        });
        history.sample_now();
    }
    let admin = Admin::builder(store)
        .token(AdminToken::new(TOKEN).unwrap())
        .history(history)
        .build();
    let app = Console::new(admin.clone())
        .refresh_interval(Duration::from_millis(100))
        .router();
    let (cookie, _) = session(&admin);

    let (status, _, page) = send(&app, get("/console", &cookie)).await;
    assert_eq!(status, StatusCode::OK);
    assert!(page.contains("data-group=\"bill&lt;ing&gt;\""), "{page}");
    assert!(page.contains("data-series=\"lag\" data-last=\"0\" data-peak=\"5\""));
    assert!(page.contains("data-points=\"0,5,0\""));
    assert!(page.contains("data-dependency=\"payments\""));
    assert!(page.contains("class=\"timeline\""));
    assert!(page.contains("href=\"/console/history/consumer_group/bill%3Cing%3E\""));

    let (status, _, detail) = send(
        &app,
        get("/console/history/consumer_group/bill%3Cing%3E", &cookie),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert!(detail.contains("data-resolution=\"fine\""), "{detail}");
    assert!(detail.contains("data-events=\"/console/events?view=consumer_group%2Fbill%3Cing%3E\""));
    let (status, _, _) = send(&app, get("/console/history/nope/x", &cookie)).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let event = first_event(&app, "/console/events?view=dependency%2Fpayments", &cookie).await;
    let sections = event.as_object().unwrap();
    assert_eq!(sections.keys().collect::<Vec<_>>(), ["detail"]);
    assert!(
        sections["detail"]["html"]
            .as_str()
            .unwrap()
            .contains("data-state=\"closed\"")
    );
}

#[tokio::test]
async fn without_a_token_a_proxied_request_gets_no_session() {
    // A proxy on this machine: its requests come from loopback, but carry
    // the client they forward for.
    let (_dir, _store, app, _admin) = app(AdminToken::none()).await;
    for header in ["x-forwarded-for", "forwarded", "x-real-ip"] {
        let proxied = Request::get("/console/login")
            .header(header::HOST, HOST)
            .header(header, "203.0.113.7")
            .body(Body::empty())
            .unwrap();
        let (status, _, body) = send(&app, proxied).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{header}: {body}");
        assert!(body.contains("proxied_without_token"), "{body}");
    }
    let local = Request::get("/console/login")
        .header(header::HOST, HOST)
        .body(Body::empty())
        .unwrap();
    assert_eq!(send(&app, local).await.0, StatusCode::SEE_OTHER);
}
