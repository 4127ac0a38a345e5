//! A terminated delivery is written to its group's dead-letter topic
//! before it is settled, with what the member knew of it.

mod common;

use std::time::Duration;

use keel_core::clock;
use keel_store::broker::{Broker, Delivery, Message, SubscribeOptions, Subscription};

async fn receive_one(sub: &mut dyn Subscription) -> Delivery {
    let deadline = clock::now() + Duration::from_secs(10);
    while clock::now() < deadline {
        if let Some(delivery) = sub
            .receive(1, Duration::from_millis(500))
            .await
            .expect("receive")
            .pop()
        {
            return delivery;
        }
    }
    panic!("nothing arrived within 10 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_message_lands_on_its_groups_dead_letter_topic() {
    let Some(broker) = common::fresh_broker().await else {
        return;
    };
    let topic = format!("payments.{}", keel_core::id::new_id().simple());
    let mut sub = broker
        .subscribe(SubscribeOptions::new(&topic, "billing"))
        .await
        .expect("subscribe");
    let poison =
        Message::new("m-1", &topic, "k", "poison").with_header("ce-type", "com.example.paid");
    broker.publish(&[poison]).await.expect("publish");
    let first = receive_one(sub.as_mut()).await;
    first.nack(Duration::ZERO).await.expect("nack");
    let again = receive_one(sub.as_mut()).await;
    again.terminate().await.expect("terminate");

    let mut operators = broker
        .subscribe(SubscribeOptions::new(
            format!("{topic}.dead.billing"),
            "operators",
        ))
        .await
        .expect("subscribe to the dead letters");
    let letter = receive_one(operators.as_mut()).await;
    let message = &letter.message;
    assert_eq!(message.id, "m-1");
    assert_eq!(message.key, "k");
    assert_eq!(&message.payload[..], b"poison");
    assert_eq!(message.header("ce-type"), Some("com.example.paid"));
    assert_eq!(message.header("keel-dead-letter-group"), Some("billing"));
    assert_eq!(
        message.header("keel-delivery-count"),
        Some("2"),
        "delivered twice before it was given up"
    );
    letter.ack().await.expect("ack");
    let more = sub
        .receive(1, Duration::from_millis(500))
        .await
        .expect("receive");
    assert!(more.is_empty(), "a terminated message came back");
}
