//! The predecessor a published message states for its key, which the
//! server verifies and the consumer's head check trusts: what is stored,
//! what happens to a wrong guess, and what is not trusted.

mod common;

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, stream::Stream};
use common::{TestBroker, fresh_broker};
use keel_nats::{KEY_HEADER, MESSAGE_ID_HEADER};
use keel_store::broker::{Broker, Delivery, Message, SubscribeOptions, Subscription};

const EXPECTED: &str = "Nats-Expected-Last-Subject-Sequence";
const LEASE: Duration = Duration::from_secs(30);

/// The raw client's view of the broker's `orders` stream.
async fn raw_stream(broker: &TestBroker) -> (jetstream::Context, Stream, String) {
    let client = async_nats::connect(&broker.url).await.expect("raw client");
    let context = jetstream::new(client);
    let prefix = &broker.broker.options().stream_prefix;
    let stream = context
        .get_stream(format!("{prefix}_orders"))
        .await
        .expect("the orders stream");
    (context, stream, format!("{prefix}.orders.k."))
}

/// Every message stored on `subject`, in order: (sequence, stated predecessor).
async fn stored(stream: &Stream, subject: &str) -> Vec<(u64, Option<String>)> {
    let mut out = Vec::new();
    let mut from = 1;
    while let Ok(message) = stream
        .direct_get_next_for_subject(subject, Some(from))
        .await
    {
        let expected = message
            .headers
            .get(EXPECTED)
            .map(|value| value.as_str().to_owned());
        out.push((message.sequence, expected));
        from = message.sequence + 1;
    }
    out
}

async fn receive_one(sub: &mut dyn Subscription, within: Duration) -> Option<Delivery> {
    let mut got = sub.receive(1, within).await.expect("receive");
    assert!(got.len() <= 1);
    got.pop()
}

fn message(id: &str, key: &str) -> Message {
    Message::new(id, "orders", key, "x")
}

/// Publishes message `id` of key `k` the way another client would, with
/// `extra` headers, and waits for its PubAck.
async fn publish_raw(context: &jetstream::Context, base: &str, id: &str, extra: &[(&str, &str)]) {
    let mut headers = HeaderMap::new();
    headers.insert(MESSAGE_ID_HEADER, id);
    headers.insert(KEY_HEADER, "k");
    for (name, value) in extra {
        headers.insert(*name, *value);
    }
    context
        .publish_with_headers(format!("{base}k"), headers, "x".into())
        .await
        .expect("raw publish")
        .await
        .expect("the server stores it");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_message_states_its_previous_one_even_a_key_twice_in_a_publish() {
    let Some(broker) = fresh_broker().await else {
        return;
    };
    broker
        .publish(&[message("a", "k1")])
        .await
        .expect("publish");
    broker
        .publish(&[message("b", "k1")])
        .await
        .expect("publish");
    broker
        .publish(&[message("c", "k2"), message("d", "k2"), message("e", "k3")])
        .await
        .expect("publish");
    let (_, stream, base) = raw_stream(&broker).await;

    let k1 = stored(&stream, &format!("{base}k1")).await;
    assert_eq!(k1.len(), 2);
    assert_eq!(k1[0].1.as_deref(), Some("0"), "a new key: no predecessor");
    assert_eq!(k1[1].1, Some(k1[0].0.to_string()), "b follows a");
    // A key twice in one publish: d is sent once c is stored, and states
    // it. Sent side by side with no statement (as before), a reconnect
    // that lost c on its way could store d first.
    let k2 = stored(&stream, &format!("{base}k2")).await;
    assert_eq!(k2.len(), 2);
    assert_eq!(k2[0].1.as_deref(), Some("0"), "c: a new key");
    assert_eq!(k2[1].1, Some(k2[0].0.to_string()), "d follows c");
    let k3 = stored(&stream, &format!("{base}k3")).await;
    assert_eq!(k3[0].1.as_deref(), Some("0"));
}

/// Another publisher wrote to the key after this one: the server refuses
/// the stale guess, and the message is stored once, without a statement,
/// after the other publisher's message; the consumer delivers all three in
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_guess_is_published_again_without_it() {
    let Some(broker) = fresh_broker().await else {
        return;
    };
    broker.publish(&[message("a", "k")]).await.expect("publish");
    let (context, stream, base) = raw_stream(&broker).await;
    let subject = format!("{base}k");
    publish_raw(&context, &base, "r", &[]).await;
    broker.publish(&[message("b", "k")]).await.expect("publish");

    let on_key = stored(&stream, &subject).await;
    assert_eq!(on_key.len(), 3, "b stored once: {on_key:?}");
    assert_eq!(on_key[2].1, None, "b went again without the refused guess");

    let mut sub = broker
        .subscribe(SubscribeOptions::new("orders", "g").lease(LEASE))
        .await
        .expect("subscribe");
    for id in ["a", "r", "b"] {
        let delivery = receive_one(sub.as_mut(), Duration::from_secs(5))
            .await
            .expect("a delivery");
        assert_eq!(delivery.message.id, id);
        delivery.ack().await.expect("ack");
    }
}

/// An expectation checked against another subject says nothing about this
/// one: the message behind an unfinished one of its key is not handed to
/// another member of the group.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expectation_about_another_subject_proves_nothing() {
    let Some(broker) = fresh_broker().await else {
        return;
    };
    broker
        .publish(&[message("first", "k")])
        .await
        .expect("publish");
    let (context, _, base) = raw_stream(&broker).await;
    // The server takes it: the other subject is empty.
    let empty = format!("{base}empty");
    let other_subject = [
        (EXPECTED, "0"),
        (
            "Nats-Expected-Last-Subject-Sequence-Subject",
            empty.as_str(),
        ),
    ];
    publish_raw(&context, &base, "second", &other_subject).await;

    let options = || SubscribeOptions::new("orders", "g").lease(LEASE);
    let mut holder = broker.subscribe(options()).await.expect("subscribe");
    let first = receive_one(holder.as_mut(), Duration::from_secs(5))
        .await
        .expect("the first message");
    assert_eq!(first.message.id, "first");
    let mut other = broker.subscribe(options()).await.expect("subscribe");
    let early = receive_one(other.as_mut(), Duration::from_secs(1)).await;
    assert!(early.is_none(), "handed out behind an unfinished message");
    first.ack().await.expect("ack");
    let second = receive_one(other.as_mut(), Duration::from_secs(5))
        .await
        .expect("the second message once the first is finished");
    assert_eq!(second.message.id, "second");
    second.ack().await.expect("ack");
}

/// With the stream's direct get failing, a message that states its
/// predecessor is still delivered (its head check asks nobody), and one
/// that does not is not (its head check needs the stream).
#[cfg(feature = "failpoints")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stated_predecessor_needs_no_round_trip() {
    let Some(broker) = fresh_broker().await else {
        return;
    };
    broker
        .publish(&[message("stated", "k1")])
        .await
        .expect("publish");
    // Another client's message states nothing: its head check asks the
    // stream.
    let (context, _, base) = raw_stream(&broker).await;
    publish_raw(&context, &base, "unstated", &[]).await;
    let mut sub = broker
        .subscribe(SubscribeOptions::new("orders", "g").lease(LEASE))
        .await
        .expect("subscribe");
    fail::cfg("keel-nats-direct-get", "return").unwrap();
    let stated = receive_one(sub.as_mut(), Duration::from_secs(5)).await;
    let unstated = sub.receive(1, Duration::from_millis(500)).await;
    fail::remove("keel-nats-direct-get");
    let stated = stated.expect("delivered without a direct get");
    assert_eq!(stated.message.id, "stated");
    assert!(unstated.is_err(), "{unstated:?}");
    stated.ack().await.expect("ack");
    let next = receive_one(sub.as_mut(), Duration::from_secs(5))
        .await
        .expect("delivered once the stream answers");
    assert_eq!(next.message.id, "unstated");
}
