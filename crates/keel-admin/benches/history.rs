//! What the console's history costs the process that keeps it.
//!
//! - `record`: one metric update as the application makes it (register the
//!   handle, then record), through the Prometheus exporter alone and
//!   through the history's recorder wrapped around the same exporter, for
//!   a metric the history copies and for one it does not.
//! - `sample`: one sample of 20 subjects (10 consumer groups, 10
//!   dependencies), each with 500 histogram values in the interval.
//!
//! The rings' memory at the defaults, full, is printed once.
//!
//! Run: `cargo bench -p keel-admin --bench history`.

use std::hint::black_box;

use criterion::{Criterion, criterion_group, criterion_main};
use keel_admin::history::History;
use metrics::{Key, Label, Level, Metadata, Recorder};
use metrics_exporter_prometheus::PrometheusBuilder;

const METADATA: Metadata<'static> = Metadata::new(module_path!(), Level::INFO, None);

fn key(name: &'static str, labels: &[(&'static str, &'static str)]) -> Key {
    let labels: Vec<Label> = labels.iter().map(|(k, v)| Label::new(*k, *v)).collect();
    Key::from_parts(name, labels)
}

fn record(c: &mut Criterion) {
    let mut group = c.benchmark_group("record");
    let tracked = key(
        "keel_consumer_handler_seconds",
        &[("topic", "orders"), ("group", "fulfilment")],
    );
    let untracked = key(
        "keel_http_request_duration_seconds",
        &[("route", "/orders"), ("status", "201")],
    );
    let exporter = PrometheusBuilder::new().build_recorder();
    let history = History::builder().build();
    let wrapped = history.recorder(PrometheusBuilder::new().build_recorder());
    for (name, key) in [("tracked", &tracked), ("untracked", &untracked)] {
        group.bench_function(format!("prometheus_alone/{name}"), |b| {
            b.iter(|| {
                exporter
                    .register_histogram(black_box(key), &METADATA)
                    .record(0.004)
            });
        });
        group.bench_function(format!("history_over_prometheus/{name}"), |b| {
            b.iter(|| {
                wrapped
                    .register_histogram(black_box(key), &METADATA)
                    .record(0.004)
            });
        });
    }
    // Keep the copies drained, as the sampler would.
    history.sample_now();
    group.finish();
}

/// A history with 20 subjects whose histograms hold `values` each.
fn filled(history: &History, values: usize) {
    let recorder = history.recorder(metrics::NoopRecorder);
    for name in GROUPS {
        let group = key(
            "keel_consumer_handler_seconds",
            &[("topic", "orders"), ("group", name)],
        );
        let dependency = key(
            "keel_client_call_duration_seconds",
            &[("dependency", name), ("outcome", "ok")],
        );
        let lag = key("keel_consumer_lag", &[("topic", "orders"), ("group", name)]);
        let handler = recorder.register_histogram(&group, &METADATA);
        let calls = recorder.register_histogram(&dependency, &METADATA);
        recorder.register_gauge(&lag, &METADATA).set(3.0);
        for v in 0..values {
            handler.record(v as f64 / 1000.0);
            calls.record(v as f64 / 500.0);
        }
    }
}

const GROUPS: [&str; 10] = ["g0", "g1", "g2", "g3", "g4", "g5", "g6", "g7", "g8", "g9"];

fn sample(c: &mut Criterion) {
    let mut group = c.benchmark_group("sample");
    let history = History::builder().build();
    group.bench_function("20_subjects_500_values_each", |b| {
        b.iter_batched(
            || filled(&history, 500),
            |()| history.sample_now(),
            criterion::BatchSize::PerIteration,
        );
    });
    group.finish();

    let full = History::builder().build();
    filled(&full, 1);
    let samples = keel_admin::history::DEFAULT_FINE_POINTS.max(
        keel_admin::history::DEFAULT_COARSE_EVERY * keel_admin::history::DEFAULT_COARSE_POINTS,
    );
    for _ in 0..samples {
        full.sample_now();
    }
    eprintln!(
        "history memory, 20 subjects with full rings: {} KiB ({} B per subject)",
        full.memory_bytes() / 1024,
        full.memory_bytes() / 20
    );
}

criterion_group!(benches, record, sample);
criterion_main!(benches);
