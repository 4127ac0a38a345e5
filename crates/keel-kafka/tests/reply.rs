//! Request-reply over Kafka (`keel_messaging::reply`, a reply topic per
//! requester process) on the shared test server: concurrent calls each get
//! their own reply, a refusal reaches its caller, a request nobody answers
//! times out and leaves nothing waiting.

mod common;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use keel_messaging::reply::{IncomingRequest, Request, RequestError, Requester, Responder};
use keel_store::broker::{Broker, SubscribeOptions};
use tokio::sync::oneshot;

/// Answers `quote for <payload>`, or refuses `refuse`; stop it by dropping
/// the returned sender.
fn respond(broker: Arc<dyn Broker>, topic: &str) -> oneshot::Sender<()> {
    let (stop, stopped) = oneshot::channel::<()>();
    let responder = Responder::builder(broker, SubscribeOptions::new(topic, "pricing")).build(
        |request: IncomingRequest| async move {
            let body = String::from_utf8_lossy(request.payload()).into_owned();
            if body == "refuse" {
                return Err(std::io::Error::other("out of stock"));
            }
            Ok(Bytes::from(format!("quote for {body}")))
        },
    );
    tokio::spawn(responder.run(async move {
        let _ = stopped.await;
    }));
    stop
}

async fn requester(broker: Arc<dyn Broker>) -> Requester {
    let listener = Requester::builder(broker)
        .poll_wait(Duration::from_millis(100))
        .build()
        .await
        .expect("build a requester");
    let requester = listener.requester();
    tokio::spawn(listener.run(std::future::pending()));
    requester
}

fn unique_topic() -> String {
    format!("pricing.quote.{}", keel_core::id::new_id().simple())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_calls_each_get_their_own_reply_or_refusal() {
    let Some(broker) = common::fresh_broker().await else {
        return;
    };
    let broker: Arc<dyn Broker> = Arc::new(broker);
    let topic = unique_topic();
    let _responder = respond(broker.clone(), &topic);
    let requester = requester(broker.clone()).await;
    let mut calls = Vec::new();
    for i in 0..10 {
        let (requester, topic) = (requester.clone(), topic.clone());
        calls.push(tokio::spawn(async move {
            let request = Request::new(&topic, format!("sku-{i}")).timeout(Duration::from_secs(20));
            (i, requester.call(request).await)
        }));
    }
    for call in calls {
        let (i, reply) = call.await.expect("the call panicked");
        let reply = reply.expect("a reply");
        assert_eq!(reply.payload, Bytes::from(format!("quote for sku-{i}")));
    }
    let refused = requester
        .call(Request::new(&topic, "refuse").timeout(Duration::from_secs(20)))
        .await;
    assert!(
        matches!(&refused, Err(RequestError::Refused { reason, .. }) if reason.contains("out of stock")),
        "{refused:?}"
    );
    assert_eq!(requester.pending(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_nobody_answers_times_out_and_leaves_nothing_waiting() {
    let Some(broker) = common::fresh_broker().await else {
        return;
    };
    let requester = requester(Arc::new(broker)).await;
    let outcome = requester
        .call(Request::new(unique_topic(), "sku-1").timeout(Duration::from_millis(500)))
        .await;
    assert!(
        matches!(outcome, Err(RequestError::Timeout { .. })),
        "{outcome:?}"
    );
    assert_eq!(requester.pending(), 0);
}
