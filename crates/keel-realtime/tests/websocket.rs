//! WebSocket against a real server on 127.0.0.1:0 and a real SqliteStore,
//! with a small RFC 6455 client written here (so the test sees the exact
//! bytes, statuses and close codes): Origin and auth at the handshake, the
//! subprotocol, acks with deduplication across connections, resume,
//! heartbeats, `1013` for a client that falls behind, `1001` on drain.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use keel_realtime::{EventLog, Realtime, RealtimeOptions, SendMessage, SendRejected, StreamId};
use keel_sqlite::SqliteStore;
use keel_store::Store;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::watch;

mod common;
use common::alice;

const ORIGIN: &str = "https://shop.example";

struct Fixture {
    log: EventLog<SqliteStore>,
    realtime: Realtime<SqliteStore>,
    addr: SocketAddr,
    drain: watch::Sender<bool>,
    /// How many times the application's send handler ran.
    effects: Arc<AtomicUsize>,
    _served: common::Fixture,
}

fn options() -> RealtimeOptions {
    RealtimeOptions::new().allowed_origins([ORIGIN])
}

async fn fixture(options: RealtimeOptions) -> Fixture {
    let effects = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&effects);
    // The application's handler: "text" is required; "fail" fails for now.
    let on_send = move |_stream: StreamId, message: SendMessage| {
        let counter = Arc::clone(&counter);
        async move {
            if message.body.get("fail").is_some() {
                return Err(SendRejected::Unavailable("chat store down".into()));
            }
            if !message.body.get("text").is_some_and(Value::is_string) {
                return Err(SendRejected::Invalid("`text` is required".into()));
            }
            counter.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    };
    let served = common::fixture(
        options,
        "/ws",
        |builder| builder.on_send(on_send),
        Realtime::websocket,
    )
    .await;
    // A small send buffer on the listener (inherited by accepted sockets),
    // so a client that does not read stalls the server quickly.
    let socket = TcpSocket::new_v4().expect("socket");
    socket.set_send_buffer_size(8 * 1024).expect("send buffer");
    socket
        .bind("127.0.0.1:0".parse().expect("addr"))
        .expect("bind");
    let listener = socket.listen(128).expect("listen");
    let addr = listener.local_addr().expect("addr");
    let app = served.app.clone();
    tokio::spawn(async move { axum::serve(listener, app).await });
    Fixture {
        log: served.log.clone(),
        realtime: served.realtime.clone(),
        addr,
        drain: served.drain.clone(),
        effects,
        _served: served,
    }
}

async fn publish(log: &EventLog<SqliteStore>, n: i64) -> i64 {
    log.publish(&alice(), "chat.message", &json!({ "n": n }))
        .await
        .expect("publish")
}

/// A frame from the server.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Incoming {
    Text(Value),
    Ping,
    Pong,
    Close(u16, String),
    /// The connection ended without a close frame.
    Eof,
}

/// A minimal RFC 6455 client over a raw socket.
#[derive(Debug)]
struct WsClient {
    socket: TcpStream,
    buffer: Vec<u8>,
}

/// A refused handshake: its status and body.
#[derive(Debug)]
struct Refused {
    status: u16,
    headers: String,
    body: String,
}

impl WsClient {
    async fn connect(
        addr: SocketAddr,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<(Self, String), Refused> {
        Self::connect_with(
            TcpStream::connect(addr).await.expect("connect"),
            path,
            headers,
        )
        .await
    }

    async fn connect_with(
        mut socket: TcpStream,
        path: &str,
        headers: &[(&str, &str)],
    ) -> Result<(Self, String), Refused> {
        let mut request = format!(
            "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n\
             Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\
             Sec-WebSocket-Version: 13\r\n"
        );
        for (name, value) in headers {
            request.push_str(&format!("{name}: {value}\r\n"));
        }
        request.push_str("\r\n");
        socket
            .write_all(request.as_bytes())
            .await
            .expect("write handshake");
        let mut buffer = Vec::new();
        let head_end = loop {
            if let Some(at) = buffer.windows(4).position(|w| w == b"\r\n\r\n") {
                break at + 4;
            }
            let mut chunk = [0; 4096];
            let n = socket.read(&mut chunk).await.expect("read handshake");
            assert!(n > 0, "connection closed during the handshake");
            buffer.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8(buffer[..head_end].to_vec()).expect("ASCII head");
        let status: u16 = head[9..12].parse().expect("status");
        buffer.drain(..head_end);
        if status == 101 {
            return Ok((Self { socket, buffer }, head));
        }
        let length: usize = head
            .lines()
            .find_map(|l| {
                let (name, value) = l.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse().ok())?
            })
            .unwrap_or(0);
        while buffer.len() < length {
            let mut chunk = [0; 4096];
            let n = socket.read(&mut chunk).await.expect("read body");
            if n == 0 {
                break;
            }
            buffer.extend_from_slice(&chunk[..n]);
        }
        Err(Refused {
            status,
            headers: head,
            body: String::from_utf8_lossy(&buffer).into_owned(),
        })
    }

    async fn send_frame(&mut self, opcode: u8, payload: &[u8]) {
        let mask = [0x37, 0xfa, 0x21, 0x3d];
        let mut frame = vec![0x80 | opcode];
        match payload.len() {
            n if n < 126 => frame.push(0x80 | u8::try_from(n).expect("small")),
            n if n <= 0xffff => {
                frame.push(0x80 | 126);
                frame.extend_from_slice(&u16::try_from(n).expect("u16").to_be_bytes());
            }
            n => {
                frame.push(0x80 | 127);
                frame.extend_from_slice(&(n as u64).to_be_bytes());
            }
        }
        frame.extend_from_slice(&mask);
        frame.extend(payload.iter().enumerate().map(|(i, b)| b ^ mask[i % 4]));
        self.socket.write_all(&frame).await.expect("write frame");
    }

    async fn send_json(&mut self, value: Value) {
        self.send_frame(0x1, value.to_string().as_bytes()).await;
    }

    async fn fill(&mut self, n: usize) -> bool {
        while self.buffer.len() < n {
            let mut chunk = vec![0; 64 * 1024];
            match self.socket.read(&mut chunk).await {
                Ok(0) | Err(_) => return false,
                Ok(read) => self.buffer.extend_from_slice(&chunk[..read]),
            }
        }
        true
    }

    /// The next frame, or `Eof`.
    async fn frame(&mut self) -> Incoming {
        if !self.fill(2).await {
            return Incoming::Eof;
        }
        let opcode = self.buffer[0] & 0x0f;
        let (len, header) = match self.buffer[1] & 0x7f {
            126 => {
                if !self.fill(4).await {
                    return Incoming::Eof;
                }
                (
                    usize::from(u16::from_be_bytes([self.buffer[2], self.buffer[3]])),
                    4,
                )
            }
            127 => {
                if !self.fill(10).await {
                    return Incoming::Eof;
                }
                let mut bytes = [0; 8];
                bytes.copy_from_slice(&self.buffer[2..10]);
                (usize::try_from(u64::from_be_bytes(bytes)).expect("len"), 10)
            }
            n => (usize::from(n), 2),
        };
        if !self.fill(header + len).await {
            return Incoming::Eof;
        }
        let payload: Vec<u8> = self.buffer.drain(..header + len).skip(header).collect();
        match opcode {
            0x1 => Incoming::Text(serde_json::from_slice(&payload).expect("JSON text")),
            0x8 if payload.len() < 2 => Incoming::Close(1005, String::new()), // no status
            0x8 => {
                let code = u16::from_be_bytes([payload[0], payload[1]]);
                Incoming::Close(code, String::from_utf8_lossy(&payload[2..]).into_owned())
            }
            0x9 => Incoming::Ping,
            0xa => Incoming::Pong,
            other => panic!("unexpected opcode {other}"),
        }
    }

    /// The next frame that is not a ping (answering pings), within 5 s.
    async fn next(&mut self) -> Incoming {
        tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match self.frame().await {
                    Incoming::Ping => self.send_frame(0xa, b"").await,
                    other => return other,
                }
            }
        })
        .await
        .expect("a frame within 5 s")
    }

    async fn text(&mut self) -> Value {
        match self.next().await {
            Incoming::Text(value) => value,
            other => panic!("expected a text message, got {other:?}"),
        }
    }

    /// The seqs of the next `n` events.
    async fn seqs(&mut self, n: usize) -> Vec<i64> {
        let mut seqs = Vec::new();
        while seqs.len() < n {
            let message = self.text().await;
            seqs.push(
                message["seq"]
                    .as_i64()
                    .unwrap_or_else(|| panic!("an event: {message}")),
            );
        }
        seqs
    }

    /// A round trip (an invalid `resume`, answered with an error): once it
    /// is back, the server's loop runs and its cursor is set, so what is
    /// published next is live.
    /// Whether the server keeps the connection open for a moment rather
    /// than closing it at once.
    async fn stays_open(&mut self) -> bool {
        match tokio::time::timeout(Duration::from_millis(300), self.frame()).await {
            Err(_) => true,
            Ok(frame) => !matches!(frame, Incoming::Close(..) | Incoming::Eof),
        }
    }

    async fn round_trip(&mut self) {
        self.send_json(json!({ "type": "resume", "after": -1 }))
            .await;
        assert_eq!(self.text().await["type"], "error");
    }

    /// Asserts nothing arrives for a while (pings aside).
    async fn assert_quiet(&mut self) {
        let quiet = tokio::time::timeout(Duration::from_millis(150), async {
            loop {
                match self.frame().await {
                    Incoming::Ping => self.send_frame(0xa, b"").await,
                    other => return other,
                }
            }
        })
        .await;
        assert!(quiet.is_err(), "expected nothing, got {quiet:?}");
    }
}

fn browser(user: Option<&'static str>) -> Vec<(&'static str, &'static str)> {
    let mut headers = vec![("Origin", ORIGIN), ("Sec-WebSocket-Protocol", "keel.v1")];
    if let Some(user) = user {
        headers.push(("x-user", user));
    }
    headers
}

async fn open(f: &Fixture, path: &str) -> WsClient {
    let (client, head) = WsClient::connect(f.addr, path, &browser(Some("alice")))
        .await
        .expect("upgraded");
    assert!(
        head.to_ascii_lowercase()
            .contains("sec-websocket-protocol: keel.v1"),
        "the subprotocol is selected: {head}"
    );
    client
}

fn assert_problem(refused: &Refused, status: u16, detail_has: &str) {
    assert_eq!(refused.status, status, "{refused:?}");
    assert!(
        refused
            .headers
            .to_ascii_lowercase()
            .contains("content-type: application/problem+json"),
        "{refused:?}"
    );
    let body: Value = serde_json::from_str(&refused.body).expect("problem JSON");
    assert_eq!(body["status"], status);
    let detail = body["detail"].as_str().expect("detail");
    assert!(detail.contains(detail_has), "{detail}");
}

#[tokio::test]
async fn a_foreign_origin_is_refused_with_403() {
    let f = fixture(options()).await;
    for origin in [
        "https://evil.example",
        "https://shop.example.evil.example",
        "null",
    ] {
        let headers = [
            ("Origin", origin),
            ("Sec-WebSocket-Protocol", "keel.v1"),
            ("x-user", "alice"),
        ];
        let refused = WsClient::connect(f.addr, "/ws", &headers)
            .await
            .expect_err(origin);
        assert_problem(&refused, 403, "origin not allowed");
    }
    // No Origin at all (not a browser) is refused unless allowed.
    let headers = [("Sec-WebSocket-Protocol", "keel.v1"), ("x-user", "alice")];
    let refused = WsClient::connect(f.addr, "/ws", &headers)
        .await
        .expect_err("no origin");
    assert_problem(&refused, 403, "origin");
    // The allowed origin, spelled in another case, is the same origin.
    let headers = [
        ("Origin", "HTTPS://Shop.Example"),
        ("Sec-WebSocket-Protocol", "keel.v1"),
        ("x-user", "alice"),
    ];
    assert!(WsClient::connect(f.addr, "/ws", &headers).await.is_ok());
}

#[tokio::test]
async fn a_missing_origin_can_be_allowed_for_non_browser_clients() {
    let f = fixture(options().allow_missing_origin(true)).await;
    let headers = [("Sec-WebSocket-Protocol", "keel.v1"), ("x-user", "alice")];
    assert!(WsClient::connect(f.addr, "/ws", &headers).await.is_ok());
    let headers = [
        ("Origin", "https://evil.example"),
        ("Sec-WebSocket-Protocol", "keel.v1"),
        ("x-user", "alice"),
    ];
    let refused = WsClient::connect(f.addr, "/ws", &headers)
        .await
        .expect_err("evil");
    assert_eq!(refused.status, 403);
}

#[tokio::test]
async fn an_unauthenticated_client_is_closed_with_1008() {
    let f = fixture(options()).await;
    let (mut client, _) = WsClient::connect(f.addr, "/ws", &browser(None))
        .await
        .expect("upgraded, then closed");
    assert_eq!(
        client.next().await,
        Incoming::Close(1008, "authentication required".into())
    );
}

#[tokio::test]
async fn past_the_connection_cap_a_socket_is_closed_with_1013_until_one_leaves() {
    let f = fixture(options().max_connections(1, 1)).await;
    let mut first = open(&f, "/ws").await;
    first.round_trip().await;
    let (mut second, _) = WsClient::connect(f.addr, "/ws", &browser(Some("alice")))
        .await
        .expect("upgraded, then closed");
    match second.next().await {
        Incoming::Close(code, reason) => {
            assert_eq!(code, 1013, "try again later");
            assert!(reason.contains("too many"), "{reason}");
        }
        other => panic!("expected a close, got {other:?}"),
    }
    drop(first);
    let mut third = None;
    for _ in 0..50 {
        let mut client = open(&f, "/ws").await;
        if client.stays_open().await {
            third = Some(client);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(third.is_some(), "the slot came back when the first left");
}

#[tokio::test]
async fn the_subprotocol_is_required() {
    let f = fixture(options()).await;
    let headers = [("Origin", ORIGIN), ("x-user", "alice")];
    let refused = WsClient::connect(f.addr, "/ws", &headers)
        .await
        .expect_err("none offered");
    assert_problem(&refused, 400, "keel.v1");
    let headers = [
        ("Origin", ORIGIN),
        ("Sec-WebSocket-Protocol", "chat.v2"),
        ("x-user", "alice"),
    ];
    let refused = WsClient::connect(f.addr, "/ws", &headers)
        .await
        .expect_err("another");
    assert_problem(&refused, 400, "keel.v1");
    let headers = [
        ("Origin", ORIGIN),
        ("Sec-WebSocket-Protocol", "chat.v2, keel.v1"),
        ("x-user", "alice"),
    ];
    assert!(
        WsClient::connect(f.addr, "/ws", &headers).await.is_ok(),
        "one of several"
    );
}

#[tokio::test]
async fn bad_handshakes_are_4xx_problems() {
    let f = fixture(options()).await;
    let refused = WsClient::connect(f.addr, "/ws?after=abc", &browser(Some("alice")))
        .await
        .expect_err("bad cursor");
    assert_problem(&refused, 400, "cursor");
    // A plain GET, not an upgrade.
    let mut socket = TcpStream::connect(f.addr).await.expect("connect");
    socket
        .write_all(b"GET /ws HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: https://shop.example\r\n\r\n")
        .await
        .expect("write");
    let mut head = vec![0; 4096];
    let n = socket.read(&mut head).await.expect("read");
    let head = String::from_utf8_lossy(&head[..n]).to_ascii_lowercase();
    assert!(head.starts_with("http/1.1 4"), "{head}");
    assert!(
        head.contains("content-type: application/problem+json"),
        "{head}"
    );
}

#[tokio::test]
async fn sends_are_acked_by_id_and_deduplicated_across_connections() {
    let f = fixture(options()).await;
    let mut client = open(&f, "/ws").await;
    let message = json!({ "type": "send", "id": "m-1", "room": "general", "text": "hello" });
    client.send_json(message.clone()).await;
    client.send_json(message.clone()).await; // a resend: same id
    assert_eq!(client.text().await, json!({ "type": "ack", "id": "m-1" }));
    assert_eq!(client.text().await, json!({ "type": "ack", "id": "m-1" }));
    assert_eq!(f.effects.load(Ordering::SeqCst), 1, "one effect, two acks");
    drop(client);

    // The resend after a reconnect is the common case.
    let mut client = open(&f, "/ws").await;
    client.send_json(message).await;
    assert_eq!(client.text().await, json!({ "type": "ack", "id": "m-1" }));
    assert_eq!(f.effects.load(Ordering::SeqCst), 1);
    assert_eq!(f.realtime.stats().websocket_duplicates, 2);

    client
        .send_json(json!({ "type": "send", "id": "m-2", "text": "again" }))
        .await;
    assert_eq!(client.text().await, json!({ "type": "ack", "id": "m-2" }));
    assert_eq!(
        f.effects.load(Ordering::SeqCst),
        2,
        "another id is another message"
    );
}

#[tokio::test]
async fn a_failed_send_is_nacked_and_may_be_resent() {
    let f = fixture(options()).await;
    let mut client = open(&f, "/ws").await;
    client
        .send_json(json!({ "type": "send", "id": "m-1", "text": "hi", "fail": true }))
        .await;
    let nack = client.text().await;
    assert_eq!(
        (
            nack["type"].clone(),
            nack["id"].clone(),
            nack["retryable"].clone()
        ),
        (json!("nack"), json!("m-1"), json!(true))
    );
    // Not remembered: the resend is handled.
    client
        .send_json(json!({ "type": "send", "id": "m-1", "text": "hi" }))
        .await;
    assert_eq!(client.text().await, json!({ "type": "ack", "id": "m-1" }));
    assert_eq!(f.effects.load(Ordering::SeqCst), 1);
    // A message the application refuses for good.
    client
        .send_json(json!({ "type": "send", "id": "m-2" }))
        .await;
    let nack = client.text().await;
    assert_eq!(
        (nack["type"].clone(), nack["retryable"].clone()),
        (json!("nack"), json!(false))
    );
    assert_eq!(nack["detail"], "`text` is required");
}

#[tokio::test]
async fn unreadable_messages_get_an_error_and_the_connection_stays() {
    let f = fixture(options()).await;
    let mut client = open(&f, "/ws").await;
    client.send_frame(0x1, b"{not json").await;
    assert_eq!(client.text().await["type"], "error");
    client.send_json(json!({ "type": "dance" })).await;
    assert_eq!(client.text().await["type"], "error");
    client
        .send_json(json!({ "type": "send", "id": "", "text": "x" }))
        .await;
    assert_eq!(client.text().await["type"], "error");
    client
        .send_json(json!({ "type": "send", "id": "x".repeat(256), "text": "x" }))
        .await;
    assert_eq!(client.text().await["type"], "error");
    client
        .send_json(json!({ "type": "resume", "after": -1 }))
        .await;
    assert_eq!(client.text().await["type"], "error");
    client.send_frame(0x2, b"\x00\x01").await;
    assert_eq!(client.text().await["type"], "error");
    assert_eq!(f.effects.load(Ordering::SeqCst), 0);
    publish(&f.log, 1).await;
    assert_eq!(client.seqs(1).await, vec![1], "still serving");
}

#[tokio::test]
async fn a_message_over_the_size_limit_closes_with_1009() {
    let f = fixture(options().max_message_size(1024)).await;
    let mut client = open(&f, "/ws").await;
    client
        .send_json(json!({ "type": "send", "id": "big", "text": "x".repeat(2000) }))
        .await;
    assert_eq!(
        client.next().await,
        Incoming::Close(1009, "message too big".into())
    );
    assert_eq!(f.effects.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn events_are_pushed_live_and_resume_replays_after_a_seq() {
    let f = fixture(options()).await;
    for n in 1..=5 {
        publish(&f.log, n).await;
    }
    // Without a cursor: live from the stream's current end.
    let mut client = open(&f, "/ws").await;
    client.round_trip().await;
    client.assert_quiet().await;
    publish(&f.log, 6).await;
    let event = client.text().await;
    assert_eq!(
        event,
        json!({ "type": "chat.message", "seq": 6, "data": { "n": 6 } })
    );

    // Resume after 2: exactly 3..=6, then live again.
    client
        .send_json(json!({ "type": "resume", "after": 2 }))
        .await;
    assert_eq!(client.seqs(4).await, vec![3, 4, 5, 6]);
    client.assert_quiet().await;
    publish(&f.log, 7).await;
    assert_eq!(client.seqs(1).await, vec![7]);

    // A cursor in the handshake replays from it.
    let mut client = open(&f, "/ws?after=5").await;
    assert_eq!(client.seqs(2).await, vec![6, 7]);
    client.assert_quiet().await;
}

#[tokio::test]
async fn a_client_that_answers_pings_stays_and_one_that_does_not_is_terminated() {
    let f = fixture(options().ping_interval(Duration::from_millis(100))).await;
    let mut healthy = open(&f, "/ws").await;
    // The healthy client reads all along, answering pings.
    let healthy = tokio::spawn(async move { healthy.seqs(1).await });
    let (mut silent, _) = WsClient::connect(f.addr, "/ws", &browser(Some("bob")))
        .await
        .expect("upgraded");

    // The silent client gets a ping, does not answer, and is dropped at the
    // next ping (a terminate: no close frame).
    assert_eq!(
        tokio::time::timeout(Duration::from_secs(2), silent.frame())
            .await
            .expect("ping"),
        Incoming::Ping
    );
    let end = tokio::time::timeout(Duration::from_secs(2), silent.frame())
        .await
        .expect("terminated within two ping intervals");
    assert_eq!(end, Incoming::Eof);
    assert_eq!(f.realtime.stats().websocket_heartbeat_timeouts, 1);

    // The healthy one is still served after many ping intervals.
    tokio::time::sleep(Duration::from_millis(500)).await;
    publish(&f.log, 1).await;
    assert_eq!(healthy.await.expect("task"), vec![1]);
    assert_eq!(f.realtime.stats().websocket_heartbeat_timeouts, 1);
}

#[tokio::test]
async fn a_client_that_falls_behind_is_closed_with_1013_and_resumes() {
    let f = fixture(options().max_buffered(64 * 1024)).await;
    // A client with a small receive window that does not read.
    let socket = TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4 * 1024).expect("recv buffer");
    let stream = socket.connect(f.addr).await.expect("connect");
    let (mut client, _) = WsClient::connect_with(stream, "/ws", &browser(Some("alice")))
        .await
        .expect("upgraded");
    client.round_trip().await; // then it stops reading

    // 40 events of 16 KiB committed at once: live, far over 64 KiB.
    let store = f.log.store().clone();
    let mut tx = store.begin().await.expect("begin");
    let mut appended = Vec::new();
    for n in 0..40 {
        let data = json!({ "n": n, "blob": "x".repeat(16 * 1024) });
        appended.push(
            f.log
                .append(&mut tx, &alice(), "big", &data)
                .await
                .expect("append"),
        );
    }
    f.log.commit(tx, appended).await.expect("commit");
    for _ in 0..1000 {
        if f.realtime.stats().websocket_slow_clients == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(f.realtime.stats().websocket_slow_clients, 1);

    // Now it reads: some events, then the close 1013, nothing after.
    let mut last = 0;
    let close = loop {
        match client.next().await {
            Incoming::Text(event) => last = event["seq"].as_i64().expect("seq"),
            other => break other,
        }
    };
    assert!(
        matches!(&close, Incoming::Close(1013, _)),
        "expected 1013 (try again later), got {close:?}"
    );
    assert!(last < 40, "it was cut off before the end ({last})");

    // It reconnects, resumes after the last seq it has, and loses nothing.
    let mut client = open(&f, &format!("/ws?after={last}")).await;
    let rest = client
        .seqs(usize::try_from(40 - last).expect("count"))
        .await;
    assert_eq!(rest, ((last + 1)..=40).collect::<Vec<_>>());
}

#[tokio::test]
async fn drain_closes_with_1001_and_refuses_new_handshakes() {
    let f = fixture(options()).await;
    let mut client = open(&f, "/ws?after=0").await;
    publish(&f.log, 1).await;
    assert_eq!(client.seqs(1).await, vec![1]);
    f.drain.send_replace(true);
    match client.next().await {
        Incoming::Close(code, _) => assert_eq!(code, 1001),
        other => panic!("expected 1001, got {other:?}"),
    }
    let refused = WsClient::connect(f.addr, "/ws", &browser(Some("alice")))
        .await
        .expect_err("draining");
    assert_problem(&refused, 503, "shutting down");
    assert!(
        refused
            .headers
            .to_ascii_lowercase()
            .contains("retry-after: 1")
    );
}
