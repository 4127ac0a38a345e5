//! Interop with a Kafka client that is not Keel: Confluent's Python client
//! (confluent-kafka, `scripts/kafka_python.sh`) reads what Keel publishes
//! and writes what Keel consumes, on the same topics of the test server.

mod common;

use std::collections::BTreeMap;
use std::process::Command;
use std::time::Duration;

use keel_store::broker::{Broker, Message, SubscribeOptions};

/// Reads `n` records of a topic from the start as a consumer group of its
/// own, and prints them as JSON.
const CONSUME: &str = r#"
import json, sys, time
from confluent_kafka import Consumer
bootstrap, topic, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "foreign-reader",
                     "auto.offset.reset": "earliest"})
consumer.subscribe([topic])
records, deadline = [], time.time() + 30
while len(records) < n and time.time() < deadline:
    record = consumer.poll(0.5)
    if record is None or record.error():
        continue
    records.append({"key": record.key().decode(), "value": record.value().decode(),
                    "headers": {k: v.decode() for k, v in (record.headers() or [])}})
consumer.close()
print(json.dumps(records))
"#;

/// Publishes three keyed records with CloudEvents headers (the Kafka
/// binding's binary mode) through an idempotent producer.
const PRODUCE: &str = r#"
import sys
from confluent_kafka import Producer
bootstrap, topic = sys.argv[1], sys.argv[2]
producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True,
                     "acks": "all", "partitioner": "murmur2_random"})
for i in range(3):
    producer.produce(topic, key=f"key-{i % 2}", value=f"value-{i}",
                     headers=[("ce_type", "com.example.foreign"), ("ce_id", f"foreign-{i}")])
assert producer.flush(10) == 0
"#;

/// The python with confluent-kafka, or `None` (skip) outside CI.
fn python() -> Option<String> {
    if let Ok(python) = std::env::var("KEEL_TEST_KAFKA_PYTHON") {
        return Some(python);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "KEEL_TEST_KAFKA_PYTHON is not set (scripts/test.sh sets it); in CI this is an error"
    );
    eprintln!("skipped: KEEL_TEST_KAFKA_PYTHON is not set");
    None
}

fn run(python: &str, script: &str, args: &[&str]) -> String {
    let output = Command::new(python)
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .expect("run python");
    assert!(
        output.status.success(),
        "the Python client failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("utf-8")
}

fn bootstrap() -> Option<String> {
    let url = keel_testkit::services::kafka_url()?;
    Some(url.trim_start_matches("kafka://").to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_consumer_reads_what_keel_publishes() {
    let (Some(python), Some(broker), Some(bootstrap)) =
        (python(), common::fresh_broker().await, bootstrap())
    else {
        return;
    };
    let topic = format!("interop.from-keel.{}", keel_core::id::new_id().simple());
    let sent: Vec<Message> = (0..3)
        .map(|i| {
            Message::new(
                format!("keel-{i}"),
                &topic,
                format!("key-{i}"),
                format!("body-{i}"),
            )
            .with_header("ce-type", "com.example.keel")
        })
        .collect();
    broker.publish(&sent).await.expect("publish");
    let printed = run(python.as_str(), CONSUME, &[&bootstrap, &topic, "3"]);
    let records: Vec<serde_json::Value> = serde_json::from_str(&printed).expect("JSON records");
    let mut by_key = BTreeMap::new();
    for record in &records {
        by_key.insert(record["key"].as_str().unwrap().to_owned(), record.clone());
    }
    assert_eq!(by_key.len(), 3, "every message, once: {records:?}");
    for (i, message) in sent.iter().enumerate() {
        let record = &by_key[&message.key];
        assert_eq!(record["value"], format!("body-{i}"));
        assert_eq!(record["headers"]["event-id"], message.id);
        assert_eq!(
            record["headers"]["ce_type"], "com.example.keel",
            "CloudEvents attributes as the Kafka binding names them"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keel_consumes_what_a_foreign_producer_publishes() {
    let (Some(python), Some(broker), Some(bootstrap)) =
        (python(), common::fresh_broker().await, bootstrap())
    else {
        return;
    };
    let topic = format!("interop.to-keel.{}", keel_core::id::new_id().simple());
    let mut sub = broker
        .subscribe(SubscribeOptions::new(&topic, "keel-reader"))
        .await
        .expect("subscribe");
    run(python.as_str(), PRODUCE, &[&bootstrap, &topic]);
    let mut got = Vec::new();
    let deadline = keel_core::clock::now() + Duration::from_secs(20);
    while got.len() < 3 && keel_core::clock::now() < deadline {
        // A key's next record comes once its earlier one is settled.
        for delivery in sub
            .receive(10, Duration::from_millis(500))
            .await
            .expect("receive")
        {
            delivery.ack().await.expect("ack");
            got.push(delivery);
        }
    }
    let mut values: Vec<String> = got
        .iter()
        .map(|d| String::from_utf8_lossy(&d.message.payload).into_owned())
        .collect();
    values.sort();
    assert_eq!(values, ["value-0", "value-1", "value-2"]);
    for delivery in &got {
        let message = &delivery.message;
        assert!(message.key.starts_with("key-"), "{message:?}");
        assert_eq!(message.header("ce-type"), Some("com.example.foreign"));
        assert_eq!(message.topic, topic);
    }
    // Records of one key kept their order.
    let key_zero: Vec<&str> = got
        .iter()
        .filter(|d| d.message.key == "key-0")
        .map(|d| std::str::from_utf8(&d.message.payload).unwrap())
        .collect();
    assert_eq!(key_zero, ["value-0", "value-2"]);
}
