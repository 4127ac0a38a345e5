//! Publish and consume rates through [`RabbitBroker`] against the raw lapin
//! client doing the same work on the same server, in the same run.
//!
//! - `rabbitmq/publish/{keel,raw}`: a batch of `BATCH` persistent messages
//!   of 256 B with unique ids and unique keys, every publisher confirm
//!   awaited. The raw side publishes on a confirm-mode channel to a direct
//!   exchange bound to the same eight quorum queues Keel declares (routed by
//!   the key's shard), with the message id and key as properties.
//! - `rabbitmq/consume/{keel,raw}`: receive `BATCH` already-published
//!   messages and ack each, the acks of a batch sent concurrently (raw: one
//!   channel with a prefetch of 256 and a consumer per shard queue, as
//!   Keel's member has, taking what has arrived as a batch; Keel: its
//!   subscription's `receive`, which keeps each delivery's lease and
//!   per-key hold). Each message has its own key, so per-key order never
//!   holds one back; the difference is Keel's bookkeeping and its
//!   forwarder task.
//!
//! The summary at the end gives this process's CPU time and context
//! switches per message, counted over the timed windows only.
//!
//! Every queue and exchange is the run's own and is deleted at its end.
//!
//! Needs `KEEL_TEST_RABBITMQ_URL`; run through `scripts/services.sh run
//! cargo bench -p keel-rabbitmq --bench rabbitmq`.

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use futures_util::future::{join_all, try_join_all};
use futures_util::stream::{SelectAll, select_all};
use futures_util::{FutureExt, StreamExt};
use keel_rabbitmq::{RabbitBroker, RabbitBrokerOptions};
use keel_store::broker::{Broker, SubscribeOptions};
use keel_testkit::bench::{
    BROKER_PAYLOAD, BrokerUsage, next_unique, receive_and_ack, timed_batches, unique_messages,
};
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, Consumer, ExchangeKind};
use tokio::runtime::Runtime;
use tokio::sync::Mutex;

const BATCH: usize = 100;
/// Keel's defaults, which the raw side copies.
const SHARDS: u16 = 8;
const PREFETCH: u16 = 256;

/// The raw client's side: a confirm-mode channel and the names it uses.
struct Raw {
    connection: Connection,
    publisher: Channel,
    exchange: String,
    queues: Vec<String>,
}

impl Raw {
    async fn connect(url: &str, prefix: &str) -> Self {
        let properties = ConnectionProperties::default()
            .with_executor(tokio_executor_trait::Tokio::current())
            .with_reactor(tokio_reactor_trait::Tokio::current());
        let connection = Connection::connect(url, properties)
            .await
            .expect("connect raw");
        let publisher = connection.create_channel().await.expect("raw channel");
        publisher
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .expect("confirm mode");
        let exchange = format!("{prefix}.raw");
        let queues = (0..SHARDS)
            .map(|shard| format!("{exchange}.{shard}"))
            .collect();
        Self {
            connection,
            publisher,
            exchange,
            queues,
        }
    }

    /// The exchange and its shard queues, declared as Keel declares its own.
    async fn declare(&self) {
        let options = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        self.publisher
            .exchange_declare(
                &self.exchange,
                ExchangeKind::Direct,
                options,
                FieldTable::default(),
            )
            .await
            .expect("raw exchange");
        for (shard, queue) in self.queues.iter().enumerate() {
            declare_quorum_queue(&self.publisher, queue).await;
            self.publisher
                .queue_bind(
                    queue,
                    &self.exchange,
                    &shard.to_string(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .expect("raw bind");
        }
    }

    async fn publish(&self) {
        let mut confirms = Vec::with_capacity(BATCH);
        for _ in 0..BATCH {
            let n = next_unique();
            let properties = BasicProperties::default()
                .with_message_id(format!("r-{n}").into())
                .with_delivery_mode(2)
                .with_headers(FieldTable::from(std::collections::BTreeMap::from([(
                    "key".into(),
                    AMQPValue::LongString(format!("k-{n}").into()),
                )])));
            let shard = crc32fast::hash(format!("k-{n}").as_bytes()) % u32::from(SHARDS);
            confirms.push(
                self.publisher
                    .basic_publish(
                        &self.exchange,
                        &shard.to_string(),
                        BasicPublishOptions::default(),
                        BROKER_PAYLOAD,
                        properties,
                    )
                    .await
                    .expect("raw publish"),
            );
        }
        for confirmation in try_join_all(confirms).await.expect("raw confirms") {
            assert!(!confirmation.is_nack(), "raw publish nacked");
        }
    }

    /// A consumer on every shard queue, on one channel with Keel's prefetch.
    async fn consumers(&self) -> SelectAll<Consumer> {
        let channel = self.connection.create_channel().await.expect("channel");
        channel
            .basic_qos(PREFETCH, BasicQosOptions::default())
            .await
            .expect("qos");
        let mut consumers = Vec::new();
        for queue in &self.queues {
            consumers.push(
                channel
                    .basic_consume(
                        queue,
                        "",
                        BasicConsumeOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .expect("raw consume"),
            );
        }
        select_all(consumers)
    }

    async fn delete(&self) {
        for queue in &self.queues {
            let _ = self
                .publisher
                .queue_delete(queue, QueueDeleteOptions::default())
                .await;
        }
        let _ = self
            .publisher
            .exchange_delete(&self.exchange, Default::default())
            .await;
    }
}

/// Up to `max` deliveries: the first within 5 s, then those already
/// arrived, as Keel's `receive` hands them out.
async fn raw_batch(
    consumers: &mut SelectAll<Consumer>,
    max: usize,
) -> Vec<lapin::message::Delivery> {
    let first = tokio::time::timeout(Duration::from_secs(5), consumers.next())
        .await
        .expect("raw consume stalled")
        .expect("consumer open")
        .expect("delivery");
    let mut batch = vec![first];
    while batch.len() < max {
        match consumers.next().now_or_never() {
            Some(Some(delivery)) => batch.push(delivery.expect("delivery")),
            _ => break,
        }
    }
    batch
}

/// A quorum queue with single active consumer, as Keel declares its shards.
async fn declare_quorum_queue(channel: &Channel, queue: &str) {
    let mut arguments = FieldTable::default();
    arguments.insert(
        "x-queue-type".into(),
        AMQPValue::LongString("quorum".into()),
    );
    arguments.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
    arguments.insert("x-delivery-limit".into(), AMQPValue::LongInt(20));
    let options = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue, options, arguments)
        .await
        .expect("raw queue");
}

fn bench_publish(
    c: &mut Criterion,
    rt: &Runtime,
    (broker, raw): (&RabbitBroker, &Raw),
    usage: &BrokerUsage,
) {
    let mut group = c.benchmark_group("rabbitmq/publish");
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
                || raw.publish(),
            )
        });
    });
    group.finish();
    rt.block_on(async {
        broker.remove_group("pub", "bench").await.expect("remove");
        raw.delete().await;
    });
}

/// The consume benchmarks publish each batch, untimed, then time its
/// consumption.
fn bench_consume(
    c: &mut Criterion,
    rt: &Runtime,
    (broker, raw): (&RabbitBroker, &Raw),
    usage: &BrokerUsage,
) {
    let mut group = c.benchmark_group("rabbitmq/consume");
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
    let consumers = Mutex::new(rt.block_on(async {
        raw.declare().await;
        raw.consumers().await
    }));
    group.bench_function("raw", |b| {
        b.to_async(rt).iter_custom(|iters| {
            let consumers = &consumers;
            let consume = || async {
                let mut consumers = consumers.lock().await;
                let mut got = 0;
                while got < BATCH {
                    let batch = raw_batch(&mut consumers, BATCH - got).await;
                    got += batch.len();
                    let acks = batch
                        .iter()
                        .map(|d| d.acker.ack(BasicAckOptions::default()));
                    for outcome in join_all(acks).await {
                        outcome.expect("raw ack");
                    }
                }
            };
            timed_batches(iters, BATCH, &usage.consume_raw, || raw.publish(), consume)
        });
    });
    group.finish();
    rt.block_on(async {
        drop(sub);
        broker
            .remove_group("consume", "bench")
            .await
            .expect("remove");
        raw.delete().await;
    });
}

fn benches(c: &mut Criterion) {
    let Ok(url) = std::env::var(keel_testkit::services::RABBITMQ_URL) else {
        eprintln!(
            "{} is not set: run `scripts/services.sh run cargo bench -p keel-rabbitmq --bench rabbitmq`",
            keel_testkit::services::RABBITMQ_URL
        );
        return;
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let prefix = format!("bench{}", std::process::id());
    let (broker, raw) = rt.block_on(async {
        let broker = RabbitBroker::connect(RabbitBrokerOptions::new(&url).prefix(&prefix))
            .await
            .expect("connect keel");
        broker
            .declare_group(&SubscribeOptions::new("pub", "bench"))
            .await
            .expect("declare");
        let raw = Raw::connect(&url, &prefix).await;
        raw.declare().await;
        (broker, raw)
    });
    let usage = BrokerUsage::default();
    bench_publish(c, &rt, (&broker, &raw), &usage);
    bench_consume(c, &rt, (&broker, &raw), &usage);
    usage.report("rabbitmq");
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average at the end: {}", load.trim());
}

criterion_group!(rabbitmq, benches);
criterion_main!(rabbitmq);
