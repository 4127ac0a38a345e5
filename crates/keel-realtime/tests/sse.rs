//! Server-Sent Events against a real SqliteStore on a temporary file,
//! called in-process and read frame by frame: headers and frames, resume
//! across a disconnect with no gap and no duplicate (also for events
//! published during the replay), keepalives (paused time), the slow-client
//! cut-off at 1 MiB, drain, and bad input.

use std::collections::BTreeSet;
use std::num::{NonZeroU64, NonZeroUsize};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::{Request, StatusCode, header};
use axum::response::Response;
use http_body_util::BodyExt;
use keel_realtime::{EventLog, Realtime, RealtimeOptions, Retention};
use keel_sqlite::SqliteStore;
use keel_store::Store;
use serde_json::{Value, json};
use tokio::time::Instant;
use tower::ServiceExt;

mod common;
use common::{Fixture, alice};

async fn fixture(options: RealtimeOptions) -> Fixture {
    common::fixture(options, "/stream", |builder| builder, Realtime::sse).await
}

async fn publish(log: &EventLog<SqliteStore>, n: i64) -> i64 {
    log.publish(&alice(), "order.updated", &json!({ "n": n }))
        .await
        .expect("publish")
}

/// One SSE frame, parsed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Frame {
    id: Option<i64>,
    event: Option<String>,
    retry: Option<u64>,
    data: Option<String>,
    comment: Option<String>,
    len: usize,
}

impl Frame {
    fn parse(text: &str) -> Self {
        let mut frame = Self {
            len: text.len() + 2,
            ..Self::default()
        };
        for line in text.lines() {
            if let Some(comment) = line.strip_prefix(':') {
                frame.comment = Some(comment.trim().to_owned());
                continue;
            }
            let (field, value) = line.split_once(": ").expect("field: value");
            match field {
                "id" => frame.id = Some(value.parse().expect("numeric id")),
                "event" => frame.event = Some(value.to_owned()),
                "retry" => frame.retry = Some(value.parse().expect("numeric retry")),
                "data" => frame.data = Some(value.to_owned()),
                other => panic!("unexpected field {other}"),
            }
        }
        frame
    }

    fn json(&self) -> Value {
        serde_json::from_str(self.data.as_deref().expect("data")).expect("JSON data")
    }
}

/// A client reading an SSE response body frame by frame.
struct Client {
    body: Body,
    buffer: String,
}

/// What the body did instead of giving a frame.
#[derive(Debug, PartialEq, Eq)]
enum End {
    /// The stream ended cleanly.
    Clean,
    /// The stream was aborted (an error frame).
    Aborted,
    /// Nothing within the wait.
    Quiet,
}

impl Client {
    fn new(response: Response) -> Self {
        Self {
            body: response.into_body(),
            buffer: String::new(),
        }
    }

    async fn next(&mut self, wait: Duration) -> Result<Frame, End> {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let text: String = self.buffer.drain(..end + 2).collect();
                return Ok(Frame::parse(&text[..text.len() - 2]));
            }
            let chunk = match tokio::time::timeout(wait, self.body.frame()).await {
                Err(_) => return Err(End::Quiet),
                Ok(None) => return Err(End::Clean),
                Ok(Some(Err(_))) => return Err(End::Aborted),
                Ok(Some(Ok(frame))) => frame.into_data().expect("data frame"),
            };
            self.buffer
                .push_str(std::str::from_utf8(&chunk).expect("UTF-8"));
        }
    }

    async fn frame(&mut self) -> Frame {
        self.next(Duration::from_secs(5)).await.expect("a frame")
    }

    /// The next `n` event frames' ids.
    async fn ids(&mut self, n: usize) -> Vec<i64> {
        let mut ids = Vec::new();
        while ids.len() < n {
            let frame = self.frame().await;
            if frame.comment.is_none() {
                ids.push(frame.id.expect("event frame with an id"));
            }
        }
        ids
    }
}

async fn connect(app: &Router, headers: &[(&str, &str)], query: &str) -> Response {
    let mut request = Request::get(format!("/stream{query}"));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(Body::empty()).expect("request");
    app.clone().oneshot(request).await.expect("infallible")
}

/// Connects as alice and reads the opening `retry:` frame.
async fn open(app: &Router, headers: &[(&str, &str)], query: &str) -> (Client, u64) {
    let mut all = vec![("x-user", "alice")];
    all.extend_from_slice(headers);
    let response = connect(app, &all, query).await;
    assert_eq!(response.status(), StatusCode::OK);
    let mut client = Client::new(response);
    let first = client.frame().await;
    let retry = first
        .retry
        .expect("the first frame is the connection's retry");
    assert_eq!((first.id, first.data), (None, None));
    (client, retry)
}

#[tokio::test]
async fn headers_and_frames() {
    let f = fixture(RealtimeOptions::new()).await;
    publish(&f.log, 1).await;
    let response = connect(&f.app, &[("x-user", "alice")], "").await;
    assert_eq!(response.status(), StatusCode::OK);
    let headers = response.headers();
    assert_eq!(headers[header::CONTENT_TYPE], "text/event-stream");
    assert_eq!(headers[header::CACHE_CONTROL], "no-cache");
    assert_eq!(headers["x-accel-buffering"], "no");

    let mut client = Client::new(response);
    let opening = client.frame().await;
    let retry = opening.retry.expect("retry");
    assert!(
        (2_000..=8_000).contains(&retry),
        "jittered within 2-8 s: {retry}"
    );
    let event = client.frame().await;
    assert_eq!(event.id, Some(1));
    assert_eq!(event.event.as_deref(), Some("order.updated"));
    assert_eq!(
        event.retry,
        Some(retry),
        "the connection's own retry on every event"
    );
    assert_eq!(event.json(), json!({ "n": 1 }));
}

#[tokio::test]
async fn retry_is_jittered_per_connection() {
    let f = fixture(RealtimeOptions::new()).await;
    let mut seen = BTreeSet::new();
    for _ in 0..20 {
        let (_client, retry) = open(&f.app, &[], "").await;
        assert!((2_000..=8_000).contains(&retry), "{retry}");
        seen.insert(retry);
    }
    assert!(seen.len() > 1, "20 connections, one retry value: {seen:?}");
}

#[tokio::test]
async fn resume_across_a_disconnect_has_no_gap_and_no_duplicate() {
    let f = fixture(RealtimeOptions::new()).await;
    for n in 1..=3 {
        publish(&f.log, n).await;
    }
    let (mut client, _) = open(&f.app, &[], "").await;
    assert_eq!(client.ids(3).await, vec![1, 2, 3]);
    drop(client); // the connection drops

    for n in 4..=6 {
        publish(&f.log, n).await; // published while disconnected
    }
    // The browser reconnects with the last id it saw.
    let (mut client, _) = open(&f.app, &[("last-event-id", "3")], "").await;
    assert_eq!(client.ids(3).await, vec![4, 5, 6]);
    publish(&f.log, 7).await;
    assert_eq!(client.ids(1).await, vec![7], "then live");
    let quiet = client.next(Duration::from_millis(100)).await;
    assert_eq!(quiet, Err(End::Quiet), "and nothing twice");
    assert_eq!(f.realtime.stats().sse_connections, 1);
    drop(client);
}

#[tokio::test]
async fn after_is_for_the_first_connection_and_last_event_id_wins() {
    let f = fixture(RealtimeOptions::new()).await;
    for n in 1..=4 {
        publish(&f.log, n).await;
    }
    let (mut client, _) = open(&f.app, &[], "?after=2").await;
    assert_eq!(client.ids(2).await, vec![3, 4]);
    let (mut client, _) = open(&f.app, &[("last-event-id", "3")], "?after=1").await;
    assert_eq!(client.ids(1).await, vec![4]);
}

#[tokio::test]
async fn events_published_during_the_replay_are_neither_lost_nor_duplicated() {
    // Tiny batches and a tiny buffer: the replay is paced by the client, so
    // it is still running when the test publishes more.
    let options = RealtimeOptions::new()
        .read_batch(NonZeroUsize::new(2).expect("non-zero"))
        .max_buffered(200);
    let f = fixture(options).await;
    for n in 1..=5 {
        publish(&f.log, n).await;
    }
    let (mut client, _) = open(&f.app, &[], "").await;
    assert_eq!(client.ids(1).await, vec![1]);
    // The replay has queued a few events and waits for room.
    for n in 6..=7 {
        publish(&f.log, n).await;
    }
    assert_eq!(client.ids(6).await, vec![2, 3, 4, 5, 6, 7]);
    publish(&f.log, 8).await;
    assert_eq!(client.ids(1).await, vec![8]);
    let quiet = client.next(Duration::from_millis(100)).await;
    assert_eq!(quiet, Err(End::Quiet), "nothing twice");
}

#[tokio::test]
async fn events_committed_during_a_live_connection_arrive_in_order() {
    let f = fixture(RealtimeOptions::new()).await;
    let (mut client, _) = open(&f.app, &[], "").await;
    // Several events in one transaction, one wake-up.
    let store = f.log.store().clone();
    let mut tx = store.begin().await.expect("begin");
    let mut appended = Vec::new();
    for n in 1..=3 {
        appended.push(
            f.log
                .append(&mut tx, &alice(), "order.updated", &json!({ "n": n }))
                .await
                .expect("append"),
        );
    }
    f.log.commit(tx, appended).await.expect("commit");
    assert_eq!(client.ids(3).await, vec![1, 2, 3]);
}

#[tokio::test]
async fn an_idle_stream_gets_a_keepalive_comment_every_15_seconds() {
    let f = fixture(RealtimeOptions::new()).await;
    publish(&f.log, 1).await;
    let (mut client, _) = open(&f.app, &[], "").await;
    // Once event 1 is read, the producer has finished the replay and waits
    // on timers only: freeze the clock.
    assert_eq!(client.ids(1).await, vec![1]);
    tokio::time::pause();
    let paused_at = Instant::now();
    tokio::time::advance(Duration::from_millis(14_800)).await;
    let early = client.next(Duration::from_millis(100)).await;
    assert_eq!(early, Err(End::Quiet), "no keepalive before 15 s");
    let frame = client
        .next(Duration::from_secs(1))
        .await
        .expect("keepalive");
    assert_eq!(frame.comment.as_deref(), Some("keepalive"));
    assert_eq!((frame.id, frame.data), (None, None));
    assert!(Instant::now() >= paused_at + Duration::from_secs(15) - Duration::from_millis(100));
    let again = client.next(Duration::from_secs(16)).await.expect("again");
    assert_eq!(again.comment.as_deref(), Some("keepalive"));
}

/// The exact size of the frame the server writes for an event.
fn frame_len(seq: i64, event_type: &str, retry: u64, data: &Value) -> usize {
    format!("id: {seq}\nevent: {event_type}\nretry: {retry}\ndata: {data}\n\n").len()
}

#[tokio::test]
async fn a_slow_client_is_cut_off_past_1_mib_and_resumes_without_loss() {
    const MIB: usize = 1 << 20;
    let f = fixture(RealtimeOptions::new()).await;
    publish(&f.log, 1).await;
    let (mut client, retry) = open(&f.app, &[], "").await;
    // Once event 1 is read, the replay is over: what follows is live.
    assert_eq!(client.ids(1).await, vec![1]);

    // Events whose frames add up to exactly 1 MiB: all fit, nobody reads.
    let mut datas = Vec::new();
    let mut total = 0;
    for seq in 2..=17 {
        let data = if seq < 17 {
            json!("x".repeat(64_000))
        } else {
            let overhead = frame_len(seq, "big", retry, &json!(""));
            json!("x".repeat(MIB - total - overhead))
        };
        total += frame_len(seq, "big", retry, &data);
        datas.push(data);
    }
    assert_eq!(total, MIB);
    let store = f.log.store().clone();
    let mut tx = store.begin().await.expect("begin");
    let mut appended = Vec::new();
    for data in &datas {
        appended.push(
            f.log
                .append(&mut tx, &alice(), "big", data)
                .await
                .expect("append"),
        );
    }
    f.log.commit(tx, appended).await.expect("commit");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        f.realtime.stats().sse_slow_clients,
        0,
        "exactly 1 MiB is still fine"
    );

    // One more byte than the limit: cut off.
    f.log
        .publish(&alice(), "small", &json!(18))
        .await
        .expect("publish");
    for _ in 0..1000 {
        if f.realtime.stats().sse_slow_clients == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(f.realtime.stats().sse_slow_clients, 1, "cut off past 1 MiB");
    assert_eq!(
        client.next(Duration::from_secs(1)).await,
        Err(End::Aborted),
        "the queue was dropped and the response aborted"
    );

    // EventSource reconnects with the last id it saw and loses nothing.
    let (mut client, _) = open(&f.app, &[("last-event-id", "1")], "").await;
    assert_eq!(client.ids(17).await, (2..=18).collect::<Vec<_>>());
    assert_eq!(
        f.realtime.stats().sse_slow_clients,
        1,
        "a replay is paced, not cut off"
    );
}

#[tokio::test]
async fn a_client_that_takes_nothing_while_catching_up_is_cut_off_as_stalled() {
    let options = RealtimeOptions::new()
        .read_batch(NonZeroUsize::new(2).expect("non-zero"))
        .max_buffered(200)
        .stall_timeout(Duration::from_millis(200));
    let f = fixture(options).await;
    for n in 1..=10 {
        publish(&f.log, n).await;
    }
    let (mut client, _) = open(&f.app, &[], "").await;
    // It reads nothing more: the paced replay waits, then gives up.
    for _ in 0..1000 {
        if f.realtime.stats().sse_slow_clients == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(f.realtime.stats().sse_slow_clients, 1);
    assert_eq!(client.next(Duration::from_secs(1)).await, Err(End::Aborted));
}

#[tokio::test]
async fn over_a_real_socket_a_disconnect_frees_the_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let f = fixture(RealtimeOptions::new()).await;
    publish(&f.log, 1).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let app = f.app.clone();
    tokio::spawn(async move { axum::serve(listener, app).await });

    let mut socket = tokio::net::TcpStream::connect(addr).await.expect("connect");
    socket
        .write_all(b"GET /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nx-user: alice\r\n\r\n")
        .await
        .expect("write");
    let mut seen = Vec::new();
    while !seen.windows(5).any(|w| w == b"id: 1") {
        let mut chunk = [0; 1024];
        let n = socket.read(&mut chunk).await.expect("read");
        assert!(n > 0, "stream ended early");
        seen.extend_from_slice(&chunk[..n]);
    }
    let head = String::from_utf8_lossy(&seen).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert!(head.contains("content-type: text/event-stream"), "{head}");
    assert!(head.contains("cache-control: no-cache"), "{head}");
    assert!(head.contains("x-accel-buffering: no"), "{head}");
    assert_eq!(f.realtime.stats().sse_connections, 1);

    drop(socket);
    for _ in 0..1000 {
        if f.realtime.stats().sse_connections == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        f.realtime.stats().sse_connections,
        0,
        "the producer ended with the client"
    );
}

#[tokio::test]
async fn drain_ends_streams_cleanly() {
    let f = fixture(RealtimeOptions::new()).await;
    publish(&f.log, 1).await;
    let (mut client, _) = open(&f.app, &[], "").await;
    assert_eq!(client.ids(1).await, vec![1]);
    f.drain.send_replace(true);
    assert_eq!(client.next(Duration::from_secs(2)).await, Err(End::Clean));

    // A connection while draining: its retry, then a clean end (a non-200
    // status would stop EventSource for good).
    let (mut client, retry) = open(&f.app, &[], "").await;
    assert!((2_000..=8_000).contains(&retry));
    assert_eq!(client.next(Duration::from_secs(1)).await, Err(End::Clean));
}

#[tokio::test]
async fn a_cursor_behind_retention_gets_a_truncated_notice() {
    let f = fixture(RealtimeOptions::new()).await;
    for n in 1..=5 {
        publish(&f.log, n).await;
    }
    let retention = Retention::new().max_age(None).keep_last(NonZeroU64::new(2));
    f.log.trim(&retention).await.expect("trim");
    let (mut client, _) = open(&f.app, &[("last-event-id", "1")], "").await;
    let notice = client.frame().await;
    assert_eq!(notice.event.as_deref(), Some("keel.truncated"));
    assert_eq!(
        notice.id, None,
        "no id: Last-Event-ID stays where the client was"
    );
    assert_eq!(notice.json(), json!({ "after": 1, "next": 4 }));
    assert_eq!(client.ids(2).await, vec![4, 5]);
}

async fn assert_problem(response: Response, status: StatusCode) {
    assert_eq!(response.status(), status);
    assert_eq!(
        response.headers()[header::CONTENT_TYPE],
        "application/problem+json"
    );
    let bytes: Bytes = response
        .into_body()
        .collect()
        .await
        .expect("body")
        .to_bytes();
    let body: Value = serde_json::from_slice(&bytes).expect("JSON");
    assert_eq!(body["status"], status.as_u16());
}

#[tokio::test]
async fn bad_input_is_a_4xx_problem() {
    let f = fixture(RealtimeOptions::new()).await;
    assert_problem(connect(&f.app, &[], "").await, StatusCode::UNAUTHORIZED).await;
    for id in ["abc", "-1", "1e3", "123456789012345678901"] {
        let response = connect(&f.app, &[("x-user", "alice"), ("last-event-id", id)], "").await;
        assert_problem(response, StatusCode::BAD_REQUEST).await;
    }
    let response = connect(&f.app, &[("x-user", "alice")], "?after=x").await;
    assert_problem(response, StatusCode::BAD_REQUEST).await;
    // An empty Last-Event-ID is "none" (EventSource never sends one, but
    // proxies may).
    let response = connect(&f.app, &[("x-user", "alice"), ("last-event-id", "")], "").await;
    assert_eq!(response.status(), StatusCode::OK);
}
