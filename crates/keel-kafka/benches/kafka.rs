//! Publish and consume rates through [`KafkaBroker`] against the raw
//! rdkafka client doing the same work on the same server, in the same run.
//!
//! - `kafka/publish/{keel,raw}`: a batch of `BATCH` messages of 256 B with
//!   unique ids and keys, every acknowledgement awaited. The raw side is a
//!   `FutureProducer` with Keel's producer settings (idempotent,
//!   `acks=all`, murmur2 partitioning, `linger.ms=1`) sending records with
//!   the id as a header, every record handed over before the first
//!   acknowledgement is awaited, as Keel does.
//! - `kafka/consume/{keel,raw}`: receive `BATCH` already-published messages
//!   and ack each (raw: a `StreamConsumer` in a group of its own with
//!   Keel's consumer settings, each record's offset stored as it is
//!   taken; Keel: its subscription's `receive`, which keeps each
//!   delivery's lease and per-key hold, and `ack`). Each message has its
//!   own key, so per-key order never holds one back.
//!
//! The summary at the end gives this process's CPU time and context
//! switches per message, counted over the timed windows only.
//!
//! Needs `KEEL_TEST_KAFKA_URL`; run through `scripts/services.sh run
//! cargo bench -p keel-kafka --bench kafka`.

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use keel_kafka::{KafkaBroker, KafkaBrokerOptions};
use keel_store::broker::{Broker, SubscribeOptions};
use keel_testkit::bench::{
    BROKER_PAYLOAD, BrokerUsage, next_unique, receive_and_ack, timed_batches, unique_messages,
};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio::runtime::Runtime;
use tokio::sync::Mutex;

const BATCH: usize = 100;
const PARTITIONS: i32 = 12;

/// The raw client's side: a topic to publish to and one to consume from,
/// as Keel's side has.
struct Raw {
    producer: FutureProducer,
    publish_topic: String,
    consume_topic: String,
}

impl Raw {
    async fn connect(bootstrap: &str, prefix: &str) -> Self {
        let (publish_topic, consume_topic) =
            (format!("{prefix}.raw-pub"), format!("{prefix}.raw-consume"));
        let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .create()
            .expect("admin");
        let topics = [&publish_topic, &consume_topic]
            .map(|topic| NewTopic::new(topic, PARTITIONS, TopicReplication::Fixed(1)));
        admin
            .create_topics(&topics, &AdminOptions::new())
            .await
            .expect("create the raw topics");
        let producer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .set("partitioner", "murmur2_random")
            .set("linger.ms", "1")
            .create()
            .expect("raw producer");
        Self {
            producer,
            publish_topic,
            consume_topic,
        }
    }

    async fn publish(&self, topic: &str) {
        let mut acks = Vec::with_capacity(BATCH);
        for _ in 0..BATCH {
            let n = next_unique();
            let (id, key) = (format!("r-{n}"), format!("k-{n}"));
            let headers = OwnedHeaders::new().insert(Header {
                key: "event-id",
                value: Some(id.as_str()),
            });
            let record = FutureRecord::to(topic)
                .key(key.as_bytes())
                .payload(BROKER_PAYLOAD)
                .headers(headers);
            acks.push(self.producer.send_result(record).expect("raw enqueue"));
        }
        for ack in acks {
            ack.await.expect("raw delivery").expect("raw ack");
        }
    }

    /// A consumer in a group of its own, with Keel's consumer settings.
    fn consumer(&self, bootstrap: &str) -> StreamConsumer {
        let consumer: StreamConsumer = ClientConfig::new()
            .set("bootstrap.servers", bootstrap)
            .set("group.id", format!("{}.readers", self.consume_topic))
            .set("enable.auto.commit", "true")
            .set("auto.commit.interval.ms", "200")
            .set("enable.auto.offset.store", "false")
            .set("auto.offset.reset", "earliest")
            .set("partition.assignment.strategy", "cooperative-sticky")
            .set("fetch.wait.max.ms", "100")
            .create()
            .expect("raw consumer");
        consumer
            .subscribe(&[&self.consume_topic])
            .expect("raw subscribe");
        consumer
    }
}

fn bench_publish(
    c: &mut Criterion,
    rt: &Runtime,
    (broker, raw): (&KafkaBroker, &Raw),
    usage: &BrokerUsage,
) {
    let mut group = c.benchmark_group("kafka/publish");
    group.throughput(Throughput::Elements(BATCH as u64));
    group.sample_size(20);
    group.bench_function("keel", |b| {
        b.to_async(rt).iter_custom(|iters| {
            timed_batches(
                iters,
                BATCH,
                &usage.publish_keel,
                || async {},
                || async {
                    broker
                        .publish(&unique_messages("pub", BATCH))
                        .await
                        .expect("publish");
                },
            )
        });
    });
    group.bench_function("raw", |b| {
        b.to_async(rt).iter_custom(|iters| {
            timed_batches(
                iters,
                BATCH,
                &usage.publish_raw,
                || async {},
                || raw.publish(&raw.publish_topic),
            )
        });
    });
    group.finish();
}

/// The consume benchmarks publish each batch, untimed, then time its
/// consumption.
fn bench_consume(
    c: &mut Criterion,
    rt: &Runtime,
    (broker, raw, bootstrap): (&KafkaBroker, &Raw, &str),
    usage: &BrokerUsage,
) {
    let mut group = c.benchmark_group("kafka/consume");
    group.throughput(Throughput::Elements(BATCH as u64));
    group.sample_size(20);
    let sub = Mutex::new(rt.block_on(async {
        broker
            .subscribe(SubscribeOptions::new("consume", "bench"))
            .await
            .expect("subscribe")
    }));
    group.bench_function("keel", |b| {
        b.to_async(rt).iter_custom(|iters| {
            let sub = &sub;
            let publish = || async {
                broker
                    .publish(&unique_messages("consume", BATCH))
                    .await
                    .expect("publish");
            };
            let consume = || async {
                receive_and_ack(sub.lock().await.as_mut(), BATCH).await;
            };
            timed_batches(iters, BATCH, &usage.consume_keel, publish, consume)
        });
    });
    // Untimed: the first batch waits for the group's first assignment.
    let consumer = rt.block_on(async {
        let consumer = raw.consumer(bootstrap);
        raw.publish(&raw.consume_topic).await;
        for _ in 0..BATCH {
            let record = tokio::time::timeout(Duration::from_secs(30), consumer.recv())
                .await
                .expect("the raw consumer never joined")
                .expect("raw record");
            consumer
                .store_offset_from_message(&record)
                .expect("raw store");
        }
        consumer
    });
    group.bench_function("raw", |b| {
        b.to_async(rt).iter_custom(|iters| {
            let consumer = &consumer;
            let consume = || async {
                for _ in 0..BATCH {
                    let record = tokio::time::timeout(Duration::from_secs(5), consumer.recv())
                        .await
                        .expect("raw consume stalled")
                        .expect("raw record");
                    consumer
                        .store_offset_from_message(&record)
                        .expect("raw store");
                }
            };
            let publish = || raw.publish(&raw.consume_topic);
            timed_batches(iters, BATCH, &usage.consume_raw, publish, consume)
        });
    });
    group.finish();
}

fn benches(c: &mut Criterion) {
    let Ok(url) = std::env::var(keel_testkit::services::KAFKA_URL) else {
        eprintln!(
            "{} is not set: run `scripts/services.sh run cargo bench -p keel-kafka --bench kafka`",
            keel_testkit::services::KAFKA_URL
        );
        return;
    };
    let bootstrap = url.trim_start_matches("kafka://").to_owned();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let prefix = format!("bench{}", std::process::id());
    let (broker, raw) = rt.block_on(async {
        let options = KafkaBrokerOptions::new(&bootstrap)
            .prefix(&prefix)
            .partitions(PARTITIONS)
            .delete_topics(false);
        let broker = KafkaBroker::connect(options).await.expect("connect keel");
        let raw = Raw::connect(&bootstrap, &prefix).await;
        (broker, raw)
    });
    let usage = BrokerUsage::default();
    bench_publish(c, &rt, (&broker, &raw), &usage);
    bench_consume(c, &rt, (&broker, &raw, &bootstrap), &usage);
    usage.report("kafka");
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average at the end: {}", load.trim());
}

criterion_group!(kafka, benches);
criterion_main!(kafka);
