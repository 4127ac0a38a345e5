//! Request-reply over direct reply-to on the test server: Keel's responder
//! answers a [`RabbitRequester`], and so does a plain AMQP RPC server that
//! knows nothing of Keel; no responder is a refusal at once, a slow one a
//! timeout that leaves nothing waiting, a request nobody took in time is
//! dropped by RabbitMQ itself.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use keel_core::clock;
use keel_messaging::reply::{IncomingRequest, Responder};
use keel_rabbitmq::{RabbitBroker, RabbitRequester, ReplyError};
use keel_store::broker::{Broker, Headers, SubscribeOptions, header};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicPublishOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};

/// Runs Keel's responder on `topic` until the returned sender is dropped;
/// the handler answers `quote for <payload>` after `delay`, and counts
/// its runs.
async fn respond(
    broker: &RabbitBroker,
    topic: &str,
    delay: Duration,
) -> (tokio::sync::oneshot::Sender<()>, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let counted = Arc::clone(&runs);
    let options = SubscribeOptions::new(topic, "responders");
    broker.declare_group(&options).await.expect("declare");
    let responder = Responder::builder(Arc::new(broker.clone()), options).build(
        move |request: IncomingRequest| {
            let counted = Arc::clone(&counted);
            async move {
                counted.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(delay).await;
                let body = String::from_utf8_lossy(request.payload()).into_owned();
                if body == "refuse" {
                    return Err(std::io::Error::other("out of stock"));
                }
                Ok(Bytes::from(format!("quote for {body}")))
            }
        },
    );
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(responder.run(async move {
        let _ = stopped.await;
    }));
    (stop, runs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keels_responder_answers_through_direct_reply_to() {
    let Some(broker) = common::fresh_broker().await else {
        return;
    };
    let (_stop, runs) = respond(&broker, "pricing", Duration::ZERO).await;
    let requester = RabbitRequester::new(&broker);
    for sku in ["sku-1", "sku-2", "sku-3"] {
        let reply = requester
            .call("pricing", Bytes::from(sku))
            .await
            .expect("a reply");
        assert_eq!(reply.payload, Bytes::from(format!("quote for {sku}")));
        assert!(reply.headers.contains_key(header::CORRELATION_ID));
    }
    let refused = requester.call("pricing", Bytes::from("refuse")).await;
    match refused {
        Err(ReplyError::Refused(reason)) => assert!(reason.contains("out of stock"), "{reason}"),
        other => panic!("expected a refusal, got {other:?}"),
    }
    assert_eq!(runs.load(Ordering::SeqCst), 4);
    assert_eq!(requester.pending(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_request_id_is_answered_from_the_responders_memory() {
    let Some(broker) = common::fresh_broker().await else {
        return;
    };
    let (_stop, runs) = respond(&broker, "pricing", Duration::ZERO).await;
    let requester = RabbitRequester::new(&broker);
    let headers = Headers::from([(
        keel_store::broker::reply::REQUEST_ID.to_owned(),
        "quote-42".to_owned(),
    )]);
    for _ in 0..2 {
        let reply = requester
            .call_with("pricing", Bytes::from("sku-9"), &headers, None)
            .await
            .expect("a reply");
        assert_eq!(reply.payload, Bytes::from("quote for sku-9"));
    }
    assert_eq!(
        runs.load(Ordering::SeqCst),
        1,
        "the retry ran the handler again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_without_a_responder_group_is_refused_at_once() {
    let Some(broker) = common::fresh_broker().await else {
        return;
    };
    let requester = RabbitRequester::new(&broker).timeout(Duration::from_secs(5));
    let started = clock::now();
    let outcome = requester.call("nobody.listens", Bytes::from("?")).await;
    assert!(
        matches!(outcome, Err(ReplyError::NoResponders(ref topic)) if topic == "nobody.listens"),
        "{outcome:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(requester.pending(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_responder_times_out_and_its_late_reply_is_dropped() {
    let Some(broker) = common::fresh_broker().await else {
        return;
    };
    let (_stop, runs) = respond(&broker, "slow", Duration::from_millis(600)).await;
    let requester = RabbitRequester::new(&broker).timeout(Duration::from_millis(300));
    let outcome = requester.call("slow", Bytes::from("sku-1")).await;
    assert!(
        matches!(outcome, Err(ReplyError::Timeout(_))),
        "{outcome:?}"
    );
    assert_eq!(requester.pending(), 0);
    // The late reply arrives and is discarded; the requester still works.
    tokio::time::sleep(Duration::from_millis(600)).await;
    let reply = requester
        .call_with(
            "slow",
            Bytes::from("sku-2"),
            &Headers::new(),
            Some(Duration::from_secs(5)),
        )
        .await
        .expect("a reply within 5 s");
    assert_eq!(reply.payload, Bytes::from("quote for sku-2"));
    assert_eq!(runs.load(Ordering::SeqCst), 2);
    assert_eq!(requester.pending(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_nobody_took_before_its_deadline_is_dropped_by_rabbitmq() {
    let Some(broker) = common::fresh_broker().await else {
        return;
    };
    let options = SubscribeOptions::new("closed", "responders");
    broker.declare_group(&options).await.expect("declare");
    let requester = RabbitRequester::new(&broker).timeout(Duration::from_millis(300));
    let outcome = requester.call("closed", Bytes::from("sku-1")).await;
    assert!(
        matches!(outcome, Err(ReplyError::Timeout(_))),
        "{outcome:?}"
    );
    // The message's expiration is the deadline: RabbitMQ drops it from the
    // group's queue without any consumer looking at it.
    let deadline = clock::now() + Duration::from_secs(10);
    loop {
        let backlog = broker
            .backlog("closed", "responders")
            .await
            .expect("backlog");
        if backlog.is_some_and(|b| b.total() == 0) {
            break;
        }
        assert!(
            clock::now() < deadline,
            "the expired request is still queued: {backlog:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An AMQP RPC server that knows nothing of Keel: it reads `reply_to` and
/// `correlation_id` from the request's properties and publishes its answer
/// to the default exchange, as every AMQP tutorial's server does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_amqp_rpc_server_answers_a_keel_requester() {
    let Some((broker, prefix)) = common::fresh_broker_and_prefix().await else {
        return;
    };
    let url = keel_testkit::services::rabbitmq_url().expect("url");
    let options = SubscribeOptions::new("plain", "rpc");
    broker.declare_group(&options).await.expect("declare");
    let connection = Connection::connect(
        &url,
        ConnectionProperties::default()
            .with_executor(tokio_executor_trait::Tokio::current())
            .with_reactor(tokio_reactor_trait::Tokio::current()),
    )
    .await
    .expect("connect");
    let channel = connection.create_channel().await.expect("channel");
    let mut consumers = Vec::new();
    for shard in 0..4 {
        consumers.push(
            channel
                .basic_consume(
                    &format!("{prefix}/plain/rpc/{shard}"),
                    "",
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .expect("consume a shard"),
        );
    }
    let server = tokio::spawn(async move {
        let mut requests = futures_util::stream::select_all(consumers);
        let delivery = requests.next().await.expect("a request").expect("delivery");
        let reply_to = delivery.properties.reply_to().clone().expect("reply_to");
        let correlation = delivery
            .properties
            .correlation_id()
            .clone()
            .expect("correlation_id");
        let body = format!("plain {}", String::from_utf8_lossy(&delivery.data));
        channel
            .basic_publish(
                "",
                reply_to.as_str(),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default().with_correlation_id(correlation),
            )
            .await
            .expect("publish the reply");
        delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .expect("ack");
        reply_to.as_str().to_owned()
    });
    let reply = RabbitRequester::new(&broker)
        .call("plain", Bytes::from("hello"))
        .await
        .expect("a reply");
    assert_eq!(reply.payload, Bytes::from("plain hello"));
    let reply_to = server.await.expect("the server");
    assert!(reply_to.starts_with("amq.rabbitmq.reply-to."), "{reply_to}");
}
