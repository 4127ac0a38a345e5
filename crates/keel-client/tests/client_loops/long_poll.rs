use keel_client::{LongPoll, PropagatingClient};
use serde_json::json;
use tokio::sync::mpsc;

use super::server::{Server, USER};
use super::{STEP, quick_reconnect};

pub(crate) fn client() -> PropagatingClient {
    let mut headers = reqwest::header::HeaderMap::new();
    headers.insert("x-user", USER.parse().expect("header"));
    PropagatingClient::new(
        reqwest::Client::builder()
            .default_headers(headers)
            .build()
            .expect("client"),
    )
}

/// Receives `count` seqs from `events`, failing after [`STEP`] without one.
pub(crate) async fn take(events: &mut mpsc::UnboundedReceiver<i64>, count: usize) -> Vec<i64> {
    let mut seqs = Vec::new();
    while seqs.len() < count {
        let seq = tokio::time::timeout(STEP, events.recv())
            .await
            .unwrap_or_else(|_| panic!("only {seqs:?} of {count} events arrived"))
            .expect("the consumer runs");
        seqs.push(seq);
    }
    seqs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_poll_resumes_across_a_killed_server_missing_and_repeating_nothing() {
    let mut server = Server::start().await;
    let mut updates = LongPoll::builder(&client(), server.url("/updates"))
        .reconnect(quick_reconnect())
        .build();
    let (tx, mut events) = mpsc::unbounded_channel();
    let consumer = tokio::spawn(async move {
        loop {
            let batch = updates
                .next()
                .await
                .expect("the consumer rides out the restart");
            for event in batch.events {
                assert_eq!(event.data, json!({ "n": event.seq }));
                let _ = tx.send(event.seq);
            }
        }
    });

    for n in 1..=3 {
        server.publish(n).await;
    }
    assert_eq!(take(&mut events, 3).await, [1, 2, 3]);
    // Killed while the consumer waits in a poll; events land while it is down.
    server.publish_while_down_then_restart().await;
    assert_eq!(take(&mut events, 6).await, [4, 5, 6, 7, 8, 9]);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(events.try_recv().is_err(), "an event came twice");
    consumer.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_poll_is_success_and_the_deadline_stops_the_consumer() {
    let server = Server::start().await;
    let mut updates = LongPoll::builder(&client(), server.url("/updates"))
        .reconnect(quick_reconnect())
        .build();
    // Two quiet polls (2 s each) fit in the deadline; then it is refused.
    let started = tokio::time::Instant::now();
    let outcome = keel_core::Deadline::after(std::time::Duration::from_secs(5))
        .scope(updates.next())
        .await;
    assert!(
        matches!(
            outcome,
            Err(keel_client::LoopError::Rejected(
                keel_core::Rejected::DeadlineExceeded
            ))
        ),
        "{outcome:?}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(6));
    assert_eq!(updates.cursor(), 0);
}
