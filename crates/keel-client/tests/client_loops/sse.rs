use keel_client::SseClient;
use serde_json::json;
use tokio::sync::mpsc;

use super::long_poll::{client, take};
use super::quick_reconnect;
use super::server::Server;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sse_resumes_with_last_event_id_across_a_killed_server_missing_and_repeating_nothing() {
    let mut server = Server::start().await;
    let mut sse = SseClient::builder(&client(), server.url("/stream"))
        .reconnect(quick_reconnect())
        .build();
    let (tx, mut events) = mpsc::unbounded_channel();
    let consumer = tokio::spawn(async move {
        loop {
            let event = sse.next().await.expect("the stream rides out the restart");
            assert_eq!(event.event, "tick");
            let seq: i64 = event
                .id
                .as_deref()
                .and_then(|id| id.parse().ok())
                .expect("a seq id");
            let data: serde_json::Value = serde_json::from_str(&event.data).expect("JSON data");
            assert_eq!(data, json!({ "n": seq }));
            let _ = tx.send(seq);
        }
    });

    for n in 1..=3 {
        server.publish(n).await;
    }
    assert_eq!(take(&mut events, 3).await, [1, 2, 3]);
    server.publish_while_down_then_restart().await;
    assert_eq!(take(&mut events, 6).await, [4, 5, 6, 7, 8, 9]);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(events.try_recv().is_err(), "an event came twice");
    consumer.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_saved_last_event_id_resumes_a_new_client_after_it() {
    let server = Server::start().await;
    for n in 1..=4 {
        server.publish(n).await;
    }
    let mut sse = SseClient::builder(&client(), server.url("/stream"))
        .last_event_id("2")
        .reconnect(quick_reconnect())
        .build();
    let first = sse.next().await.expect("an event");
    assert_eq!(first.id.as_deref(), Some("3"));
    assert_eq!(sse.last_event_id(), Some("3"));
}
