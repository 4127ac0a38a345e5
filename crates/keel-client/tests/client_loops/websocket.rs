use std::sync::atomic::Ordering;

use keel_client::{KeelSocket, LoopError, SocketMessage};
use serde_json::{Map, Value, json};

use super::server::{ORIGIN, Server, USER};
use super::{STEP, quick_reconnect};

fn body(value: Value) -> Map<String, Value> {
    value.as_object().cloned().expect("an object")
}

/// Drives the socket until `done` says it saw enough, collecting events
/// and acks.
async fn drive(socket: &mut KeelSocket, seen: &mut Seen, done: impl Fn(&Seen) -> bool) {
    tokio::time::timeout(STEP, async {
        while !done(seen) {
            match socket
                .next()
                .await
                .expect("the socket rides out the restart")
            {
                SocketMessage::Event { seq, data, .. } => {
                    assert_eq!(data, json!({ "n": seq }));
                    seen.events.push(seq);
                }
                SocketMessage::Acked { id } => seen.acks.push(id),
                other => panic!("unexpected {other:?}"),
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("stuck at {seen:?}"));
}

#[derive(Debug, Default)]
struct Seen {
    events: Vec<i64>,
    acks: Vec<String>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_socket_resumes_and_resends_across_a_killed_server_missing_and_repeating_nothing() {
    let mut server = Server::start().await;
    let mut socket = KeelSocket::builder(format!("ws://{}/ws", server.addr).parse().expect("url"))
        .origin(ORIGIN)
        .header("x-user", USER)
        .after(0)
        .reconnect(quick_reconnect())
        .build()
        .expect("valid headers");
    let mut seen = Seen::default();
    for n in 1..=3 {
        server.publish(n).await;
    }
    drive(&mut socket, &mut seen, |seen| seen.events.len() == 3).await;
    let first = socket
        .send(body(json!({ "text": "one" })))
        .await
        .expect("queued");
    drive(&mut socket, &mut seen, |seen| seen.acks.len() == 1).await;

    // Sent, never acked: the server dies while its handler runs.
    let stalled = socket
        .send(body(json!({ "stall": true })))
        .await
        .expect("queued");
    tokio::time::timeout(STEP, async {
        while !server.effects.stalled_once.load(Ordering::SeqCst) {
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("the stalled message reached the server");
    server.kill();
    // Queued while the server is down, and events published meanwhile.
    let queued = socket
        .send(body(json!({ "text": "three" })))
        .await
        .expect("queued");
    server.publish_while_down_then_restart().await;
    drive(&mut socket, &mut seen, |seen| {
        seen.events.len() == 9 && seen.acks.len() == 3
    })
    .await;

    assert_eq!(seen.events, (1..=9).collect::<Vec<_>>());
    assert_eq!(seen.acks[0], first);
    let mut later = seen.acks[1..].to_vec();
    later.sort();
    let mut expected = vec![stalled.clone(), queued.clone()];
    expected.sort();
    assert_eq!(later, expected);
    assert_eq!(socket.unacked(), 0);
    assert!(socket.connections() >= 2);
    let handled = server.effects.handled.lock().clone();
    for id in [&first, &stalled, &queued] {
        assert_eq!(handled.get(id), Some(&1), "{id} handled {handled:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_violation_close_stops_the_socket_for_good() {
    let server = Server::start().await;
    // No x-user: the server accepts the upgrade and closes with 1008.
    let mut socket = KeelSocket::builder(format!("ws://{}/ws", server.addr).parse().expect("url"))
        .origin(ORIGIN)
        .reconnect(quick_reconnect())
        .build()
        .expect("valid headers");
    let outcome = tokio::time::timeout(STEP, socket.next())
        .await
        .expect("an answer");
    assert!(
        matches!(outcome, Err(LoopError::PolicyViolation { .. })),
        "{outcome:?}"
    );
    let again = tokio::time::timeout(STEP, socket.next())
        .await
        .expect("an answer");
    assert!(
        matches!(again, Err(LoopError::PolicyViolation { .. })),
        "{again:?}"
    );
    assert!(matches!(
        socket.send(Map::new()).await,
        Err(LoopError::PolicyViolation { .. })
    ));
    assert_eq!(socket.connections(), 1, "no reconnect after 1008");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_handshake_is_a_typed_error_not_a_retry_loop() {
    let server = Server::start().await;
    let mut socket = KeelSocket::builder(format!("ws://{}/ws", server.addr).parse().expect("url"))
        .origin("https://evil.example")
        .header("x-user", USER)
        .reconnect(quick_reconnect())
        .build()
        .expect("valid headers");
    let outcome = tokio::time::timeout(STEP, socket.next())
        .await
        .expect("an answer");
    match outcome {
        Err(LoopError::Call(error)) => {
            assert_eq!(error.status(), Some(http::StatusCode::FORBIDDEN))
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(socket.connections(), 0);
}
