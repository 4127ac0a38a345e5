//! The [`JobStore`] conformance suite: what every backend behind the HTTP
//! async-jobs pattern (`202 Accepted`, then `/jobs/{id}`) must do.
//!
//! Two properties carry the pattern and are checked here through the trait
//! alone: a retried creation with the same key returns the *same* job (also
//! when the retries race), and no update moves a job out of a final state
//! (so a cancel and a success cannot both win).
//!
//! Run it from a backend's integration tests with
//! [`jobs_conformance_tests!`](crate::jobs_conformance_tests), giving an
//! async expression that makes a *fresh, empty* store (or a
//! [`Fixture`](crate::store_suite::Fixture)):
//!
//! ```ignore
//! keel_testkit::jobs_conformance_tests!(async {
//!     let dir = tempfile::tempdir().expect("temp dir");
//!     let store = SqliteStore::open(dir.path().join("keel.db")).await.expect("open");
//!     keel_testkit::store_suite::Fixture::new(store).keep_alive(dir)
//! });
//! ```
//!
//! [`JobStore`]: keel_store::JobStore

use chrono::Duration;
use keel_store::StoreError;
use keel_store::{JobRecord, JobStatus, JobStore};

use crate::store_suite::now_ms;

/// A queued job of `kind` with `key`, id `id`, expiring in a day.
pub fn job(id: &str, kind: &str, key: &str) -> JobRecord {
    let now = now_ms();
    JobRecord {
        id: id.to_owned(),
        kind: kind.to_owned(),
        idempotency_key: key.to_owned(),
        params: serde_json::json!({ "month": "2026-09", "format": "csv" }),
        status: JobStatus::Queued,
        progress: 0,
        result_location: None,
        error: None,
        created_at: now,
        updated_at: now,
        expires_at: now + Duration::hours(24),
    }
}

async fn create<S: JobStore>(store: &S, job: &JobRecord) -> JobRecord {
    let mut tx = store.begin().await.expect("begin");
    let stored = store.job_create(&mut tx, job).await.expect("job_create");
    store.commit(tx).await.expect("commit");
    stored
}

/// A created job reads back field for field.
pub async fn create_then_get_round_trips<S: JobStore>(store: &S) {
    let job = job("j1", "report", "key-1");
    assert_eq!(create(store, &job).await, job);
    assert_eq!(store.job_get("j1").await.expect("get"), Some(job));
    assert_eq!(store.job_get("unknown").await.expect("get"), None);
}

/// The same kind and key return the first job and create nothing; another
/// kind with the same key is another job.
pub async fn create_is_idempotent_per_kind_and_key<S: JobStore>(store: &S) {
    let first = job("j1", "report", "key-1");
    create(store, &first).await;
    let retry = job("j2", "report", "key-1");
    assert_eq!(create(store, &retry).await, first, "same key: same job");
    assert_eq!(store.job_get("j2").await.expect("get"), None);
    let export = job("j3", "export", "key-1");
    assert_eq!(
        create(store, &export).await,
        export,
        "kinds do not share keys"
    );
}

/// A creation rolled back leaves nothing, and the key is free again.
pub async fn rolled_back_create_leaves_nothing<S: JobStore>(store: &S) {
    let job1 = job("j1", "report", "key-1");
    let mut tx = store.begin().await.expect("begin");
    store.job_create(&mut tx, &job1).await.expect("job_create");
    store.rollback(tx).await.expect("rollback");
    assert_eq!(store.job_get("j1").await.expect("get"), None);
    let job2 = job("j2", "report", "key-1");
    assert_eq!(create(store, &job2).await, job2);
}

/// Updates move a job through running to a final state; after that every
/// update is refused (`false`) and changes nothing.
pub async fn updates_stop_at_a_final_state<S: JobStore>(store: &S) {
    let mut job = create(store, &job("j1", "report", "key-1")).await;
    job.status = JobStatus::Running;
    job.progress = 40;
    assert!(store.job_update(&job).await.expect("update"));
    let running = store.job_get("j1").await.expect("get").expect("job");
    assert_eq!((running.status, running.progress), (JobStatus::Running, 40));
    assert!(running.updated_at >= job.created_at);

    job.status = JobStatus::Succeeded;
    job.progress = 100;
    job.result_location = Some("/reports/7".into());
    job.expires_at = now_ms() + Duration::hours(48);
    assert!(store.job_update(&job).await.expect("update"));
    let done = store.job_get("j1").await.expect("get").expect("job");
    assert_eq!(done.expires_at, job.expires_at, "expires_at is updated too");

    for status in [JobStatus::Cancelled, JobStatus::Running, JobStatus::Failed] {
        let mut late = job.clone();
        late.status = status;
        late.error = Some("late".into());
        assert!(
            !store.job_update(&late).await.expect("update"),
            "a succeeded job cannot become {status:?}"
        );
    }
    let done = store.job_get("j1").await.expect("get").expect("job");
    assert_eq!(done.status, JobStatus::Succeeded);
    assert_eq!(done.result_location.as_deref(), Some("/reports/7"));
    assert_eq!(done.error, None);
}

/// Of a cancel and a success racing, exactly one wins.
pub async fn cancel_and_success_race_has_one_winner<S: JobStore>(store: &S) {
    for round in 0..10 {
        let id = format!("j{round}");
        let job = create(store, &job(&id, "report", &format!("key-{round}"))).await;
        let mut cancel = job.clone();
        cancel.status = JobStatus::Cancelled;
        let mut succeed = job.clone();
        succeed.status = JobStatus::Succeeded;
        succeed.result_location = Some("/reports/1".into());
        let (a, b) = tokio::join!(
            {
                let store = store.clone();
                async move { store.job_update(&cancel).await.expect("cancel") }
            },
            {
                let store = store.clone();
                async move { store.job_update(&succeed).await.expect("succeed") }
            }
        );
        assert!(a ^ b, "exactly one of cancel ({a}) and success ({b}) wins");
        let stored = store.job_get(&id).await.expect("get").expect("job");
        let expected = if a {
            JobStatus::Cancelled
        } else {
            JobStatus::Succeeded
        };
        assert_eq!(stored.status, expected);
    }
}

/// Updating a job that does not exist is `NotFound`.
pub async fn update_of_unknown_job_is_not_found<S: JobStore>(store: &S) {
    let err = store
        .job_update(&job("ghost", "report", "k"))
        .await
        .expect_err("no such job");
    assert!(matches!(err, StoreError::NotFound(_)), "{err:?}");
}

/// Many concurrent creations with one key make one job, and all of them
/// are told about that one.
pub async fn concurrent_creates_make_one_job<S: JobStore>(store: &S) {
    const TASKS: usize = 10;
    let mut handles = Vec::new();
    for i in 0..TASKS {
        let store = store.clone();
        handles.push(tokio::spawn(async move {
            create(&store, &job(&format!("j{i}"), "report", "same-key")).await
        }));
    }
    let mut ids = std::collections::BTreeSet::new();
    for handle in handles {
        ids.insert(handle.await.expect("task").id);
    }
    assert_eq!(
        ids.len(),
        1,
        "every creation returned the same job: {ids:?}"
    );
    let mut stored = 0;
    for i in 0..TASKS {
        stored += usize::from(
            store
                .job_get(&format!("j{i}"))
                .await
                .expect("get")
                .is_some(),
        );
    }
    assert_eq!(stored, 1, "exactly one job row exists");
}

/// Prune deletes jobs that expired before the given time, at most `batch`
/// at a time, and leaves the others.
pub async fn prune_deletes_expired_jobs_in_batches<S: JobStore>(store: &S) {
    for i in 0..5 {
        let mut old = job(&format!("old-{i}"), "report", &format!("old-{i}"));
        old.expires_at = now_ms() - Duration::hours(1);
        create(store, &old).await;
    }
    create(store, &job("live", "report", "live")).await;
    let before = now_ms();
    assert_eq!(store.job_prune(before, 0).await.expect("prune"), 0);
    assert_eq!(store.job_prune(before, 3).await.expect("prune"), 3);
    assert_eq!(store.job_prune(before, 3).await.expect("prune"), 2);
    assert_eq!(store.job_prune(before, 3).await.expect("prune"), 0);
    assert!(store.job_get("live").await.expect("get").is_some());
    assert!(store.job_get("old-0").await.expect("get").is_none());
}

/// Expands into one `#[tokio::test]` per [`JobStore`] behaviour, each
/// against the store made by `$make` (an async expression yielding a store
/// or a [`Fixture`](crate::store_suite::Fixture)). The tests are named
/// `jobs_conformance::<behaviour>`. See the [module docs](crate::jobs_suite).
///
/// [`JobStore`]: keel_store::JobStore
#[macro_export]
macro_rules! jobs_conformance_tests {
    ($make:expr) => {
        $crate::__jobs_conformance_tests! {
            $make;
            create_then_get_round_trips,
            create_is_idempotent_per_kind_and_key,
            rolled_back_create_leaves_nothing,
            updates_stop_at_a_final_state,
            cancel_and_success_race_has_one_winner,
            update_of_unknown_job_is_not_found,
            concurrent_creates_make_one_job,
            prune_deletes_expired_jobs_in_batches,
        }
    };
}

/// The expansion of [`jobs_conformance_tests!`]; not for direct use.
#[doc(hidden)]
#[macro_export]
macro_rules! __jobs_conformance_tests {
    ($make:expr; $($test:ident),* $(,)?) => {
        mod jobs_conformance {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    let fixture = $crate::store_suite::Fixture::from($make.await);
                    $crate::jobs_suite::$test(fixture.store()).await;
                }
            )*
        }
    };
}
