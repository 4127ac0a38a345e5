//! JetStream publish and consume rates through [`NatsBroker`] against the
//! raw async-nats client doing the same work in the same run.
//!
//! - `nats/publish/{keel,raw}`: a batch of `BATCH` messages with unique
//!   ids (`Nats-Msg-Id`) and unique keys (raw: a subject per message, as a
//!   keyed publisher writes them), all PubAcks awaited.
//! - `nats/consume/{keel,raw}`: receive `BATCH` already-published
//!   messages through a durable pull consumer and ack each, confirmed (raw:
//!   JetStream's double ack; Keel: its key-cursor write, then a plain
//!   `+ACK`), acks of a batch sent concurrently. Each message has its own key,
//!   so Keel's per-key order never holds one back; the difference is the
//!   per-key bookkeeping (a head check per delivery, a cursor write per
//!   ack).
//!
//! Each group deletes the streams it wrote before the next one starts, and
//! the run deletes everything it made, so every figure measures only its
//! own messages (the raw consumer once started behind the publish group's
//! backlog, and a long-lived server kept every earlier run's streams).
//!
//! Needs `KEEL_TEST_NATS_URL`; run through `scripts/services.sh run cargo
//! bench -p keel-nats --bench nats`.

use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::{self, consumer::pull, stream};
use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use futures_util::StreamExt;
use futures_util::future::join_all;
use keel_core::clock;
use keel_nats::NatsBrokerOptions;
use keel_store::broker::{Broker, SubscribeOptions};
use keel_testkit::bench::{BROKER_PAYLOAD, next_unique, receive_and_ack, unique_messages};

const BATCH: usize = 100;

async fn raw_publish(context: &jetstream::Context, base: &str) {
    let mut acks = Vec::with_capacity(BATCH);
    for _ in 0..BATCH {
        let n = next_unique();
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", format!("r-{n}").as_str());
        acks.push(
            context
                .publish_with_headers(
                    format!("{base}.k.r-{n}"),
                    headers,
                    Bytes::from_static(BROKER_PAYLOAD),
                )
                .await
                .expect("raw publish"),
        );
    }
    for ack in acks {
        ack.await.expect("raw pub ack");
    }
}

fn benches(c: &mut Criterion) {
    let Ok(url) = std::env::var("KEEL_TEST_NATS_URL") else {
        eprintln!(
            "KEEL_TEST_NATS_URL is not set: run `scripts/services.sh run cargo bench -p keel-nats --bench nats`"
        );
        return;
    };
    let rt = tokio::runtime::Runtime::new().expect("runtime");
    let prefix = format!("bench{}", std::process::id());
    let (broker, context) = rt.block_on(async {
        let broker = NatsBrokerOptions::new()
            .stream_prefix(&prefix)
            .open(&url)
            .await
            .expect("connect keel");
        let client = async_nats::connect(&url).await.expect("connect raw");
        (broker, jetstream::new(client))
    });

    let raw_pub = format!("{prefix}rawpub");
    rt.block_on(raw_stream(&context, &raw_pub));
    let mut group = c.benchmark_group("nats/publish");
    group.throughput(Throughput::Elements(BATCH as u64));
    group.sample_size(20);
    group.bench_function("keel", |b| {
        b.to_async(&rt).iter(|| async {
            broker
                .publish(&unique_messages("pub", BATCH))
                .await
                .expect("publish");
        });
    });
    group.bench_function("raw", |b| {
        b.to_async(&rt)
            .iter(|| async { raw_publish(&context, &raw_pub).await });
    });
    group.finish();
    rt.block_on(delete_streams(
        &context,
        &[format!("{prefix}_pub"), raw_pub],
    ));

    let mut group = c.benchmark_group("nats/consume");
    group.throughput(Throughput::Elements(BATCH as u64));
    group.sample_size(20);
    let sub = tokio::sync::Mutex::new(rt.block_on(async {
        broker
            .subscribe(SubscribeOptions::new("consume", "bench"))
            .await
            .expect("subscribe")
    }));
    group.bench_function("keel", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let (broker, sub) = (&broker, &sub);
            async move {
                let mut sub = sub.lock().await;
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    broker
                        .publish(&unique_messages("consume", BATCH))
                        .await
                        .expect("publish");
                    let started = clock::now();
                    receive_and_ack(sub.as_mut(), BATCH).await;
                    total += started.elapsed();
                }
                total
            }
        });
    });
    let raw_con = format!("{prefix}rawcon");
    let consumer = rt.block_on(async {
        raw_stream(&context, &raw_con)
            .await
            .get_or_create_consumer(
                "bench",
                pull::Config {
                    durable_name: Some("bench".into()),
                    ack_wait: Duration::from_secs(30),
                    max_deliver: -1,
                    max_ack_pending: 4096,
                    ..Default::default()
                },
            )
            .await
            .expect("raw consumer")
    });
    group.bench_function("raw", |b| {
        b.to_async(&rt).iter_custom(|iters| {
            let (context, consumer, subject) = (&context, &consumer, &raw_con);
            async move {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    raw_publish(context, subject).await;
                    let started = clock::now();
                    let mut got = 0;
                    while got < BATCH {
                        let mut messages = consumer
                            .fetch()
                            .max_messages(BATCH - got)
                            .expires(Duration::from_secs(5))
                            .messages()
                            .await
                            .expect("fetch");
                        let mut batch = Vec::new();
                        while let Some(message) = messages.next().await {
                            batch.push(message.expect("message"));
                        }
                        assert!(!batch.is_empty(), "raw consume stalled");
                        got += batch.len();
                        for outcome in join_all(batch.iter().map(|m| m.double_ack())).await {
                            outcome.expect("ack");
                        }
                    }
                    total += started.elapsed();
                }
                total
            }
        });
    });
    group.finish();
    rt.block_on(async {
        drop(sub);
        delete_streams(
            &context,
            &[
                format!("{prefix}_consume"),
                format!("KV_{prefix}_cursors"),
                raw_con,
            ],
        )
        .await;
    });
}

/// A stream for the raw client with the settings `NatsBroker` uses.
async fn raw_stream(context: &jetstream::Context, name: &str) -> stream::Stream {
    context
        .get_or_create_stream(stream::Config {
            name: name.to_owned(),
            subjects: vec![format!("{name}.>")],
            storage: stream::StorageType::File,
            duplicate_window: Duration::from_secs(600),
            max_age: Duration::from_secs(7 * 24 * 3600),
            allow_direct: true,
            ..Default::default()
        })
        .await
        .expect("raw stream")
}

async fn delete_streams(context: &jetstream::Context, names: &[String]) {
    for name in names {
        if let Err(error) = context.delete_stream(name).await {
            eprintln!("could not delete stream {name}: {error}");
        }
    }
}

criterion_group!(nats, benches);
criterion_main!(nats);
