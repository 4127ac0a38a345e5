//! The storage-backed gauges move by themselves: with nobody reading the
//! console, a dead letter, a disabled webhook endpoint or a consumer group's
//! lag reaches Prometheus' gauges within an export interval, and a kind that
//! empties goes back to 0 instead of alerting forever.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use keel_admin::{Admin, Gauge};
use keel_sqlite::store::SqliteStore;
use keel_store::WebhookEndpointStore;
use keel_store::broker::Message;
use keel_store::{AttemptError, DeadLetter, DeadLetterStatus, DeadLetterStore, WebhookEndpoint};
use keel_testkit::eventually;
use keel_testkit::metrics::MetricsRecorder;

const WITHIN: Duration = Duration::from_secs(5);

fn letter(id: &str, kind: &str) -> DeadLetter {
    let now = keel_core::clock::utc_now();
    DeadLetter {
        id: id.to_owned(),
        message: Message::new(format!("msg-{id}"), "orders", id, "{}"),
        group: "billing".to_owned(),
        error_kind: kind.to_owned(),
        attempts: vec![AttemptError {
            attempt: 1,
            error: "card declined".to_owned(),
            at: now,
        }],
        dead_at: now,
        status: DeadLetterStatus::Pending,
    }
}

fn endpoint(id: &str) -> WebhookEndpoint {
    WebhookEndpoint::registered(
        id,
        format!("https://hooks.example.com/{id}"),
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
        keel_core::clock::utc_now(),
    )
}

async fn gauge_is(recorder: &MetricsRecorder, key: &str, value: f64) {
    eventually(&format!("{key} = {value}"), WITHIN, || async {
        recorder.gauge(key) == value
    })
    .await;
}

#[tokio::test]
async fn gauges_follow_the_store_on_a_schedule_and_come_back_to_zero() {
    let recorder = MetricsRecorder::global();
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("export.db"))
        .await
        .unwrap();
    let lag = Arc::new(AtomicU64::new(12));
    let reading = Arc::clone(&lag);
    let admin = Admin::builder(store.clone())
        .gauges_fn(move || match reading.load(Ordering::SeqCst) {
            0 => Vec::new(),
            n => vec![
                Gauge::new("consumer_lag", n as f64)
                    .label("topic", "orders")
                    .label("group", "billing"),
            ],
        })
        .build();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let export = tokio::spawn(admin.gauge_export().every(Duration::from_millis(20)).run(
        async move {
            let _ = stopped.await;
        },
    ));

    store
        .dead_letter_put(&letter("dl-1", "payment_declined"))
        .await
        .unwrap();
    store
        .dead_letter_put(&letter("dl-2", "payment_declined"))
        .await
        .unwrap();
    store
        .dead_letter_put(&letter("dl-3", "malformed"))
        .await
        .unwrap();
    gauge_is(
        recorder,
        "keel_dead_letters_pending,kind=payment_declined",
        2.0,
    )
    .await;
    gauge_is(recorder, "keel_dead_letters_pending,kind=malformed", 1.0).await;
    gauge_is(
        recorder,
        "keel_consumer_lag,group=billing,topic=orders",
        12.0,
    )
    .await;

    // The letters are dealt with, the endpoint is disabled, the group
    // catches up and stops reporting: every gauge follows, none stays up.
    admin.discard_dead_letter("dl-3").await.unwrap();
    store
        .webhook_endpoint_create(&endpoint("ep_a"))
        .await
        .unwrap();
    store
        .webhook_endpoint_create(&endpoint("ep_b"))
        .await
        .unwrap();
    store
        .webhook_endpoint_disable("ep_b", "failing for 5 days", keel_core::clock::utc_now())
        .await
        .unwrap();
    lag.store(0, Ordering::SeqCst);
    gauge_is(recorder, "keel_dead_letters_pending,kind=malformed", 0.0).await;
    gauge_is(
        recorder,
        "keel_dead_letters_pending,kind=payment_declined",
        2.0,
    )
    .await;
    gauge_is(recorder, "keel_webhook_endpoints,state=disabled", 1.0).await;
    gauge_is(recorder, "keel_webhook_endpoints,state=enabled", 1.0).await;
    gauge_is(
        recorder,
        "keel_consumer_lag,group=billing,topic=orders",
        0.0,
    )
    .await;

    stop.send(()).unwrap();
    tokio::time::timeout(WITHIN, export)
        .await
        .expect("the export stops when told")
        .unwrap();
}
