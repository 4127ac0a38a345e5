//! What client requests grow is pruned by the running system on its own:
//! before this, `keel serve` started no pruner at all, and the event log,
//! the jobs, the webhook deliveries and the expired Idempotency-Keys grew
//! for as long as it ran.

mod common;

use std::num::NonZeroU64;
use std::sync::Arc;
use std::time::Duration;

use keel::shop::retention::Retention;
use keel::shop::{System, SystemConfig};
use keel_realtime::StreamId;
use keel_sqlite::{SqliteBroker, SqliteStore};
use keel_store::broker::Broker;
use keel_store::{JobRecord, JobStatus, JobStore, Store};

fn job(id: &str, expires_in: chrono::Duration) -> JobRecord {
    let now = keel_core::clock::utc_now();
    JobRecord {
        id: id.to_owned(),
        kind: "report".to_owned(),
        idempotency_key: format!("key-{id}"),
        params: serde_json::json!({}),
        status: JobStatus::Succeeded,
        progress: 100,
        result_location: None,
        error: None,
        created_at: now - chrono::Duration::days(3),
        updated_at: now,
        expires_at: now + expires_in,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_running_system_prunes_the_event_log_and_expired_jobs() {
    let dir = tempfile::tempdir().expect("a directory");
    let store = SqliteStore::open(dir.path().join("keel.db"))
        .await
        .expect("store");
    let broker: Arc<dyn Broker> = Arc::new(
        SqliteBroker::open(dir.path().join("broker.db"))
            .await
            .expect("broker"),
    );
    let config = SystemConfig {
        retention: Retention {
            interval: Duration::from_millis(100),
            event_log_keep_last: NonZeroU64::new(2),
            jobs_grace: Duration::from_secs(3600),
            ..Retention::default()
        },
        ..SystemConfig::default()
    };
    let handle = System::start(store.clone(), broker, config, |_| Ok(axum::Router::new()))
        .await
        .expect("start the shop");

    let stream = StreamId::new("customer:c-1").expect("stream");
    for n in 0..5 {
        handle
            .log
            .publish(&stream, "test.event", &serde_json::json!({ "n": n }))
            .await
            .expect("publish");
    }
    let mut tx = store.begin().await.expect("begin");
    // Expired two hours ago (past the grace), one minute ago (in it), and
    // not yet.
    for (id, expires_in) in [
        ("gone", chrono::Duration::hours(-2)),
        ("gone-soon", chrono::Duration::minutes(-1)),
        ("live", chrono::Duration::hours(1)),
    ] {
        store
            .job_create(&mut tx, &job(id, expires_in))
            .await
            .expect("job");
    }
    store.commit(tx).await.expect("commit");

    common::eventually("the retention pass", || async {
        let kept = handle.log.read_after(&stream, 0, 100).await.expect("read");
        let gone = store.job_get("gone").await.expect("job").is_none();
        kept.len() == 2 && gone
    })
    .await;
    let kept = handle.log.read_after(&stream, 0, 100).await.expect("read");
    let kept: Vec<_> = kept.iter().map(|e| e.data["n"].as_i64()).collect();
    assert_eq!(kept, [Some(3), Some(4)], "the newest two events stay");
    assert!(store.job_get("gone-soon").await.expect("job").is_some());
    assert!(store.job_get("live").await.expect("job").is_some());
    handle.shutdown().await;
}
