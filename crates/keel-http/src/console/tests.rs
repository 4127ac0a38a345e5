//! The console without a browser: login and its cookie, CSRF refusals,
//! escaping of hostile text, actions answering `303` with a notice, and
//! the live stream's first event.

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use chrono::Utc;
use http_body_util::BodyExt;
use keel_messaging::broker::Message;
use keel_messaging::store::{AttemptError, DeadLetter, DeadLetterStatus, DeadLetterStore};
use keel_sqlite::store::SqliteStore;
use tower::ServiceExt;

use super::Console;
use crate::admin::{Admin, AdminToken, SESSION_COOKIE};

const TOKEN: &str = "console-unit-token-0123456789";
const HOST: &str = "127.0.0.1:8080";
const ORIGIN: &str = "http://127.0.0.1:8080";

async fn app(token: AdminToken) -> (tempfile::TempDir, SqliteStore, Router) {
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
            at: Utc::now(),
        }],
        dead_at: Utc::now(),
        status: DeadLetterStatus::Pending,
    };
    store.dead_letter_put(&letter).await.unwrap();
    let admin = Admin::builder(store.clone()).token(token).build();
    let console = Console::new(admin).refresh_interval(Duration::from_millis(100));
    (dir, store, console.router())
}

fn cookie() -> String {
    let token = AdminToken::new(TOKEN).unwrap();
    format!("{SESSION_COOKIE}={}", token.session_value().unwrap())
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
    let (_dir, _store, app) = app(AdminToken::new(TOKEN).unwrap()).await;
    let anonymous = Request::get("/console").body(Body::empty()).unwrap();
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
    let set = response.headers()[header::SET_COOKIE].to_str().unwrap();
    assert!(set.starts_with(&cookie()), "{set}");
    assert!(set.contains("HttpOnly") && set.contains("SameSite=Strict"));
    assert!(!set.contains(TOKEN), "the cookie never holds the token");
}

#[tokio::test]
async fn the_page_escapes_whatever_the_messages_say() {
    let (_dir, _store, app) = app(AdminToken::new(TOKEN).unwrap()).await;
    let page = Request::get("/console")
        .header(header::COOKIE, cookie())
        .body(Body::empty())
        .unwrap();
    let (status, _, html) = send(&app, page).await;
    assert_eq!(status, StatusCode::OK);
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
async fn actions_answer_303_with_a_notice_and_refuse_other_origins() {
    let (_dir, store, app) = app(AdminToken::new(TOKEN).unwrap()).await;
    let action = |origin: &str| {
        Request::post("/console/dead-letters/billing:%3Cevil%3E/discard")
            .header(header::COOKIE, cookie())
            .header(header::HOST, HOST)
            .header(header::ORIGIN, origin)
            .body(Body::empty())
            .unwrap()
    };
    let (status, _, _) = send(&app, action("http://evil.example")).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    let letter = store.dead_letter_get("billing:<evil>").await.unwrap();
    assert_eq!(letter.unwrap().status, DeadLetterStatus::Pending);

    let (status, location, _) = send(&app, action(ORIGIN)).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    let location = location.unwrap();
    assert!(
        location.starts_with("/console?notice=Discarded%20dead%20letter%20billing:%3Cevil%3E"),
        "{location}"
    );
    let letter = store.dead_letter_get("billing:<evil>").await.unwrap();
    assert_eq!(letter.unwrap().status, DeadLetterStatus::Discarded);

    let (status, location, _) = send(&app, action(ORIGIN)).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert!(
        location.unwrap().starts_with("/console?error="),
        "a 409 is shown"
    );

    let page = Request::get("/console?error=%3Cb%3Eboom")
        .header(header::COOKIE, cookie())
        .body(Body::empty())
        .unwrap();
    let (_, _, html) = send(&app, page).await;
    assert!(html.contains("data-notice-kind=\"error\">&lt;b&gt;boom</div>"));
}

#[tokio::test]
async fn the_live_stream_starts_with_every_section() {
    let (_dir, _store, app) = app(AdminToken::new(TOKEN).unwrap()).await;
    let events = Request::get("/console/events")
        .header(header::COOKIE, cookie())
        .body(Body::empty())
        .unwrap();
    let response = app.clone().oneshot(events).await.unwrap();
    assert_eq!(response.status(), StatusCode::OK);
    assert_eq!(
        response.headers()[header::CONTENT_TYPE],
        "text/event-stream"
    );
    let mut body = response.into_body();
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
    assert!(text.starts_with("event: sections\ndata: "), "{text}");
    let json = text.lines().find_map(|l| l.strip_prefix("data: ")).unwrap();
    let sections: serde_json::Value = serde_json::from_str(json).unwrap();
    for id in super::render::SECTIONS {
        assert!(sections[id]["hash"].is_string(), "{id}");
        assert!(sections[id]["html"].is_string(), "{id}");
    }
}

#[tokio::test]
async fn without_a_token_there_is_no_login_but_still_no_cross_site_post() {
    let (_dir, _store, app) = app(AdminToken::none()).await;
    let (status, location, _) = send(
        &app,
        Request::get("/console/login").body(Body::empty()).unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    assert_eq!(location.as_deref(), Some("/console"));
    let (status, _, _) = send(&app, Request::get("/console").body(Body::empty()).unwrap()).await;
    assert_eq!(status, StatusCode::OK);
    let cross = Request::post("/console/dead-letters/x/replay")
        .header(header::HOST, HOST)
        .header(header::ORIGIN, "http://evil.example")
        .body(Body::empty())
        .unwrap();
    let (status, _, _) = send(&app, cross).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
}

/// A parked outbox row is shown with its refusal and the rows behind it,
/// and its Replay button unparks it (same origin only).
#[tokio::test]
async fn a_parked_outbox_row_is_shown_and_replayed_from_the_console() {
    use keel_messaging::store::{OutboxRecord, OutboxStore, Store};
    let (_dir, store, app) = app(AdminToken::new(TOKEN).unwrap()).await;
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

    let page = Request::get("/console")
        .header(header::COOKIE, cookie())
        .body(Body::empty())
        .unwrap();
    let (_, _, html) = send(&app, page).await;
    assert!(html.contains(&format!("data-parked-id=\"{id}\"")), "{html}");
    assert!(html.contains(&format!("/console/outbox/parked/{id}/replay")));
    assert!(html.contains("&lt;b&gt;line break&lt;/b&gt;"), "escaped");
    assert!(html.contains("data-summary=\"parked-outbox\">1<"));

    let replay = |origin: &str| {
        Request::post(format!("/console/outbox/parked/{id}/replay"))
            .header(header::COOKIE, cookie())
            .header(header::HOST, HOST)
            .header(header::ORIGIN, origin)
            .body(Body::empty())
            .unwrap()
    };
    let (status, _, _) = send(&app, replay("http://evil.example")).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(store.outbox_parked_get(id).await.unwrap().is_some());
    let (status, location, _) = send(&app, replay(ORIGIN)).await;
    assert_eq!(status, StatusCode::SEE_OTHER);
    let location = location.unwrap();
    assert!(
        location.starts_with(&format!(
            "/console?notice=Replayed%20parked%20outbox%20row%20{id}"
        )),
        "{location}"
    );
    assert!(store.outbox_parked_get(id).await.unwrap().is_none());
    assert_eq!(store.outbox_stats().await.unwrap().unpublished, 1);
}
