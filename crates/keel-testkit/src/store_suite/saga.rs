//! Saga instances: created once, saved with optimistic concurrency, found
//! when due and by the operator.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use keel_core::Classified;
use keel_messaging::saga::{
    AfterCommit, Backoff, SagaDefinition, SagaHook, SagaOrchestrator, Step, StepContext,
};
use keel_messaging::{MessagingStore, StoreError};
use keel_store::{OutboxRecord, SagaFilter, SagaRecord, SagaStatus};

use super::now_ms;

/// A fresh saga `id` of kind `order_fulfilment`, running, version 1, due at
/// `due`, created and updated at `at`.
pub fn saga(id: &str, status: SagaStatus, at: DateTime<Utc>, due: DateTime<Utc>) -> SagaRecord {
    SagaRecord {
        id: id.to_owned(),
        kind: "order_fulfilment".to_owned(),
        status,
        step: 0,
        data: serde_json::json!({ "orderId": id, "totalMinor": 8210, "items": [{ "sku": "TT-01", "qty": 2 }] }),
        attempts: 0,
        outcome_unknown: false,
        first_attempt_at: None,
        last_error: None,
        next_attempt_at: due,
        created_at: at,
        updated_at: at,
        version: 1,
        traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned()),
    }
}

async fn insert_committed<S: MessagingStore>(store: &S, record: &SagaRecord) -> bool {
    let mut tx = store.begin().await.expect("begin");
    let inserted = store.saga_insert(&mut tx, record).await.expect("insert");
    store.commit(tx).await.expect("commit");
    inserted
}

fn ids(sagas: &[SagaRecord]) -> Vec<&str> {
    sagas.iter().map(|s| s.id.as_str()).collect()
}

/// Inserting a saga id twice (a redelivered trigger) keeps the first and
/// reports `false`; the saga comes back exactly as inserted.
pub async fn insert_is_idempotent<S: MessagingStore>(store: &S) {
    let t = now_ms();
    let first = saga("saga-1", SagaStatus::Running, t, t);
    assert!(insert_committed(store, &first).await);

    let mut second = first.clone();
    second.data = serde_json::json!({ "other": true });
    second.step = 3;
    assert!(
        !insert_committed(store, &second).await,
        "the duplicate is not an error"
    );

    let loaded = store.saga_get("saga-1").await.expect("get");
    assert_eq!(loaded.as_ref(), Some(&first), "the first insert stands");
    assert_eq!(store.saga_get("saga-404").await.expect("get"), None);
}

/// A batch read by ids returns the sagas that exist, each once, and
/// nothing for an empty list.
pub async fn get_many_returns_the_existing_ones<S: MessagingStore>(store: &S) {
    let t = now_ms();
    for id in ["saga-1", "saga-2", "saga-3"] {
        assert!(insert_committed(store, &saga(id, SagaStatus::Running, t, t)).await);
    }
    let asked = ["saga-3", "saga-404", "saga-1", "saga-1"].map(String::from);
    let mut found = store.saga_get_many(&asked).await.expect("get many");
    found.sort_by(|a, b| a.id.cmp(&b.id));
    assert_eq!(ids(&found), ["saga-1", "saga-3"]);
    assert_eq!(found[0], saga("saga-1", SagaStatus::Running, t, t));
    assert!(store.saga_get_many(&[]).await.expect("get none").is_empty());
}

/// A saga inserted in a transaction that rolls back does not exist; the
/// transaction itself reads what it inserted.
pub async fn rolled_back_insert_leaves_nothing<S: MessagingStore>(store: &S) {
    let t = now_ms();
    let mut tx = store.begin().await.expect("begin");
    let record = saga("saga-1", SagaStatus::Running, t, t);
    assert!(store.saga_insert(&mut tx, &record).await.expect("insert"));
    assert_eq!(
        store
            .saga_get_in(&mut tx, "saga-1")
            .await
            .expect("get in tx"),
        Some(record),
        "the transaction reads its own insert"
    );
    assert_eq!(
        store
            .saga_get_in(&mut tx, "other")
            .await
            .expect("get in tx"),
        None
    );
    store.rollback(tx).await.expect("rollback");
    assert_eq!(store.saga_get("saga-1").await.expect("get"), None);
    assert!(insert_committed(store, &saga("saga-1", SagaStatus::Running, t, t)).await);
}

/// A save succeeds only on top of the version it was loaded at: of two
/// workers that loaded the same version, the second to save loses.
pub async fn save_is_optimistic_on_version<S: MessagingStore>(store: &S) {
    let t = now_ms();
    assert!(insert_committed(store, &saga("saga-1", SagaStatus::Running, t, t)).await);
    let loaded = store
        .saga_get("saga-1")
        .await
        .expect("get")
        .expect("saga-1");

    let mut worker_a = loaded.clone();
    worker_a.version += 1;
    worker_a.step = 1;
    worker_a.attempts = 2;
    worker_a.last_error = Some("payments timed out".to_owned());
    worker_a.next_attempt_at = t + TimeDelta::seconds(30);
    worker_a.updated_at = t + TimeDelta::seconds(1);
    worker_a.data["paymentId"] = serde_json::json!("pay-9");
    let mut worker_b = loaded.clone();
    worker_b.version += 1;
    worker_b.status = SagaStatus::Compensating;

    assert!(
        store.saga_save(&worker_a).await.expect("save"),
        "first save wins"
    );
    assert!(
        !store.saga_save(&worker_b).await.expect("save"),
        "stale save loses"
    );
    assert!(
        !store.saga_save(&worker_a).await.expect("save"),
        "the same version twice loses"
    );

    let stored = store
        .saga_get("saga-1")
        .await
        .expect("get")
        .expect("saga-1");
    assert_eq!(stored, worker_a, "the winner's state is stored, whole");

    let mut next = stored.clone();
    next.version += 1;
    next.status = SagaStatus::Completed;
    assert!(store.saga_save(&next).await.expect("save"), "saves chain");

    let mut missing = saga("saga-404", SagaStatus::Running, t, t);
    missing.version = 2;
    let err = store.saga_save(&missing).await.expect_err("no such saga");
    assert!(matches!(err, StoreError::NotFound(_)), "got {err:?}");
}

/// Due sagas are the unfinished ones of the kinds asked for whose next
/// attempt time has come, most overdue first, at most `limit`. Stuck sagas
/// are retried too.
pub async fn due_returns_unfinished_due_sagas_oldest_first<S: MessagingStore>(store: &S) {
    let now = now_ms();
    let min = TimeDelta::minutes;
    for record in [
        saga(
            "due-2",
            SagaStatus::Compensating,
            now - min(10),
            now - min(2),
        ),
        saga("later", SagaStatus::Running, now - min(10), now + min(5)),
        saga("due-1", SagaStatus::Running, now - min(10), now - min(3)),
        saga("done", SagaStatus::Completed, now - min(10), now - min(9)),
        saga(
            "undone",
            SagaStatus::Compensated,
            now - min(10),
            now - min(8),
        ),
        saga(
            "cancelled",
            SagaStatus::Cancelled,
            now - min(10),
            now - min(7),
        ),
        saga("due-3", SagaStatus::Stuck, now - min(10), now - min(1)),
        saga("due-now", SagaStatus::Running, now - min(10), now),
    ] {
        assert!(insert_committed(store, &record).await);
    }
    let mut other_kind = saga(
        "other-kind",
        SagaStatus::Running,
        now - min(10),
        now - min(9),
    );
    other_kind.kind = "refund".to_owned();
    assert!(insert_committed(store, &other_kind).await);
    let kinds = ["order_fulfilment"];
    let due = store.saga_due(&kinds, now, 100).await.expect("due");
    assert_eq!(ids(&due), ["due-1", "due-2", "due-3", "due-now"]);
    let first_two = store.saga_due(&kinds, now, 2).await.expect("due");
    assert_eq!(ids(&first_two), ["due-1", "due-2"]);
    let later = store
        .saga_due(&kinds, now + min(10), 100)
        .await
        .expect("due");
    assert_eq!(ids(&later), ["due-1", "due-2", "due-3", "due-now", "later"]);
    let both = store
        .saga_due(&["refund", "order_fulfilment"], now, 100)
        .await
        .expect("due");
    assert_eq!(
        ids(&both),
        ["other-kind", "due-1", "due-2", "due-3", "due-now"]
    );
    let none = store.saga_due(&[], now, 100).await.expect("due");
    assert!(none.is_empty(), "no kinds, no sagas");
}

/// The operator view filters by status and by "not updated since", oldest
/// update first, with a limit.
pub async fn list_filters_by_status_and_age<S: MessagingStore>(store: &S) {
    let now = now_ms();
    let min = TimeDelta::minutes;
    for record in [
        saga("stuck-new", SagaStatus::Stuck, now - min(1), now),
        saga("running-old", SagaStatus::Running, now - min(50), now),
        saga("stuck-old", SagaStatus::Stuck, now - min(40), now),
        saga("done", SagaStatus::Completed, now - min(30), now),
    ] {
        assert!(insert_committed(store, &record).await);
    }
    let list = |filter: SagaFilter| async move { store.saga_list(&filter).await.expect("list") };

    assert_eq!(
        ids(&list(SagaFilter::default()).await),
        ["running-old", "stuck-old", "done", "stuck-new"]
    );
    let stuck = SagaFilter {
        status: Some(SagaStatus::Stuck),
        ..Default::default()
    };
    assert_eq!(ids(&list(stuck).await), ["stuck-old", "stuck-new"]);
    let stuck_long = SagaFilter {
        status: Some(SagaStatus::Stuck),
        updated_before: Some(now - min(10)),
        limit: None,
    };
    assert_eq!(ids(&list(stuck_long).await), ["stuck-old"]);
    let old = SagaFilter {
        updated_before: Some(now - min(35)),
        ..Default::default()
    };
    assert_eq!(ids(&list(old).await), ["running-old", "stuck-old"]);
    let limited = SagaFilter {
        limit: Some(1),
        ..Default::default()
    };
    assert_eq!(ids(&list(limited).await), ["running-old"]);
}

/// Counts by status.
pub async fn counts_by_status<S: MessagingStore>(store: &S) {
    let t = now_ms();
    for (id, status) in [
        ("s-1", SagaStatus::Running),
        ("s-2", SagaStatus::Running),
        ("s-3", SagaStatus::Stuck),
        ("s-4", SagaStatus::Completed),
    ] {
        assert!(insert_committed(store, &saga(id, status, t, t)).await);
    }
    let counts: HashMap<SagaStatus, u64> = store
        .saga_counts()
        .await
        .expect("counts")
        .into_iter()
        .filter(|(_, n)| *n > 0)
        .collect();
    let expected = HashMap::from([
        (SagaStatus::Running, 2),
        (SagaStatus::Stuck, 1),
        (SagaStatus::Completed, 1),
    ]);
    assert_eq!(counts, expected);
}

/// Whether an attempt may have taken effect, and when the first attempt
/// was made, are stored whole and come back from every read (get, due,
/// list): a restarted orchestrator must not forget them.
pub async fn unknown_outcome_and_first_attempt_round_trip<S: MessagingStore>(store: &S) {
    let t = now_ms();
    let fresh = saga("saga-1", SagaStatus::Running, t, t);
    assert!(insert_committed(store, &fresh).await);
    let loaded = store
        .saga_get("saga-1")
        .await
        .expect("get")
        .expect("saga-1");
    assert!(!loaded.outcome_unknown);
    assert_eq!(loaded.first_attempt_at, None);

    let mut unknown = loaded.clone();
    unknown.version += 1;
    unknown.attempts = 1;
    unknown.outcome_unknown = true;
    unknown.first_attempt_at = Some(t - TimeDelta::seconds(90));
    unknown.last_error = Some("step `capture_payment` attempt 1: timed out".to_owned());
    assert!(store.saga_save(&unknown).await.expect("save"));
    assert_eq!(
        store.saga_get("saga-1").await.expect("get").as_ref(),
        Some(&unknown)
    );
    assert_eq!(
        store
            .saga_due(&["order_fulfilment"], t, 10)
            .await
            .expect("due"),
        [unknown.clone()]
    );
    assert_eq!(
        store.saga_list(&SagaFilter::default()).await.expect("list"),
        [unknown.clone()]
    );

    let mut cleared = unknown.clone();
    cleared.version += 1;
    cleared.step = 1;
    cleared.outcome_unknown = false;
    cleared.first_attempt_at = None;
    assert!(store.saga_save(&cleared).await.expect("save"));
    assert_eq!(
        store.saga_get("saga-1").await.expect("get").as_ref(),
        Some(&cleared)
    );

    // A saga created as maybe applied (a copy, an import) keeps it too.
    let mut imported = saga("saga-2", SagaStatus::Running, t, t);
    imported.outcome_unknown = true;
    imported.first_attempt_at = Some(t);
    assert!(insert_committed(store, &imported).await);
    assert_eq!(
        store.saga_get("saga-2").await.expect("get").as_ref(),
        Some(&imported)
    );
}

/// A capture that took effect but whose reply was lost is remembered on the
/// saga record: an orchestrator started afresh (no memory but the store)
/// that then sees the capture fail for good still refunds it, under the
/// compensation's key, naming the capture's key for its tombstone.
pub async fn an_unknown_outcome_survives_an_orchestrator_restart<S: MessagingStore>(store: &S) {
    type Data = serde_json::Value;
    let charged = Arc::new(AtomicUsize::new(0));
    let refunds: Arc<tokio::sync::Mutex<Vec<(String, String)>>> = Arc::default();
    // `capture` is what the payments service does this time.
    let definition = |capture: fn(&AtomicUsize) -> Result<(), Classified>| {
        let charged = charged.clone();
        let refunds = refunds.clone();
        let capture = Step::new("capture_payment", move |_ctx: StepContext<Data>| {
            let charged = charged.clone();
            async move { capture(&charged) }
        })
        .compensate_with(move |ctx: StepContext<Data>| {
            let refunds = refunds.clone();
            async move {
                let keys = (ctx.idempotency_key().to_owned(), ctx.action_key());
                refunds.lock().await.push(keys);
                Ok::<_, Classified>(())
            }
        });
        SagaDefinition::<Data>::builder("order_fulfilment")
            .step(capture)
            .pivot(Step::new(
                "schedule_shipment",
                |_ctx: StepContext<Data>| async { Ok::<_, Classified>(()) },
            ))
            // Long enough that the first orchestrator stops waiting.
            .backoff(
                Backoff::exponential(Duration::from_secs(3600), 1.0, Duration::from_secs(3600))
                    .expect("backoff"),
            )
            .build()
            .expect("definition")
    };
    let orchestrator = |def: &SagaDefinition<Data>| {
        SagaOrchestrator::builder(store.clone())
            .saga(def)
            .build()
            .expect("orchestrator")
    };

    // The first process: the capture charges, then its reply is lost.
    let first = definition(|charged| {
        charged.fetch_add(1, Ordering::SeqCst);
        Err(Classified::outcome_unknown(
            "payments: reply lost after commit",
        ))
    });
    let before = orchestrator(&first);
    let mut tx = store.begin().await.expect("begin");
    let data = serde_json::json!({ "orderId": "A-4471" });
    assert!(
        before
            .start(&mut tx, &first, "A-4471", &data)
            .await
            .expect("start")
    );
    store.commit(tx).await.expect("commit");
    let waiting = before.drive("A-4471").await.expect("drive");
    assert_eq!((waiting.status, waiting.step), (SagaStatus::Running, 0));
    assert!(waiting.outcome_unknown, "the lost reply is on the record");
    assert_eq!(charged.load(Ordering::SeqCst), 1);
    drop(before);

    // Its backoff passes while no process runs.
    let stored = store.saga_get("A-4471").await.expect("get").expect("saga");
    assert!(stored.outcome_unknown, "persisted");
    let mut due = stored.clone();
    due.version += 1;
    due.next_attempt_at = now_ms() - TimeDelta::milliseconds(1);
    assert!(store.saga_save(&due).await.expect("save"));

    // A fresh process: the capture now fails for good.
    let second = definition(|_| Err(Classified::permanent("payments: card expired")));
    let after = orchestrator(&second);
    let done = after.drive("A-4471").await.expect("drive");
    assert_eq!(
        done.status,
        SagaStatus::Compensated,
        "{:?}",
        done.last_error
    );
    assert_eq!(
        *refunds.lock().await,
        [(
            "A-4471:undo:capture_payment".to_owned(),
            "A-4471:capture_payment".to_owned()
        )],
        "the charge that may exist is refunded, and its key tombstoned"
    );
}

/// A save inside the caller's transaction is optimistic like the plain
/// save, and lands only if that transaction commits.
pub async fn save_in_lands_with_its_transaction<S: MessagingStore>(store: &S) {
    let t = now_ms();
    assert!(insert_committed(store, &saga("saga-1", SagaStatus::Running, t, t)).await);
    let loaded = store
        .saga_get("saga-1")
        .await
        .expect("get")
        .expect("saga-1");
    let mut next = loaded.clone();
    next.version += 1;
    next.status = SagaStatus::Completed;

    let mut tx = store.begin().await.expect("begin");
    assert!(store.saga_save_in(&mut tx, &next).await.expect("save"));
    store.rollback(tx).await.expect("rollback");
    assert_eq!(
        store.saga_get("saga-1").await.expect("get").as_ref(),
        Some(&loaded),
        "a rolled-back save changed nothing"
    );

    let mut tx = store.begin().await.expect("begin");
    assert!(store.saga_save_in(&mut tx, &next).await.expect("save"));
    assert!(
        !store.saga_save_in(&mut tx, &next).await.expect("save"),
        "the same version twice loses, in one transaction too"
    );
    store.commit(tx).await.expect("commit");
    assert_eq!(
        store.saga_get("saga-1").await.expect("get").as_ref(),
        Some(&next)
    );

    let mut missing = saga("saga-404", SagaStatus::Running, t, t);
    missing.version = 2;
    let mut tx = store.begin().await.expect("begin");
    let err = store
        .saga_save_in(&mut tx, &missing)
        .await
        .expect_err("no such saga");
    assert!(matches!(err, StoreError::NotFound(_)), "got {err:?}");
    store.rollback(tx).await.expect("rollback");
}

/// What a [`SagaHook`] writes commits with the saga's new status, once per
/// change; when the hook fails, the status change is not saved either, and
/// it lands (with the hook's write) when the saga is driven again.
pub async fn a_hook_writes_with_the_status_change<S: MessagingStore>(store: &S) {
    type Data = serde_json::Value;
    let failures_left = Arc::new(AtomicUsize::new(1));
    let woken = Arc::new(AtomicUsize::new(0));
    let hook = AnnouncingHook {
        store: store.clone(),
        failures_left: failures_left.clone(),
        woken: woken.clone(),
    };
    let definition = SagaDefinition::<Data>::builder("order_fulfilment")
        .step(Step::new(
            "capture_payment",
            |_ctx: StepContext<Data>| async { Ok::<_, Classified>(()) },
        ))
        .build()
        .expect("definition");
    let orchestrator = SagaOrchestrator::builder(store.clone())
        .saga(&definition)
        .hook(hook)
        .build()
        .expect("orchestrator");
    let mut tx = store.begin().await.expect("begin");
    let data = serde_json::json!({ "orderId": "A-4471" });
    assert!(
        orchestrator
            .start(&mut tx, &definition, "A-4471", &data)
            .await
            .expect("start")
    );
    store.commit(tx).await.expect("commit");

    orchestrator
        .drive("A-4471")
        .await
        .expect_err("the hook's failure is the save's");
    let stored = store.saga_get("A-4471").await.expect("get").expect("saga");
    assert_eq!(
        stored.status,
        SagaStatus::Running,
        "not completed without its hook"
    );
    assert_eq!(store.outbox_stats().await.expect("stats").unpublished, 0);
    assert_eq!(
        woken.load(Ordering::SeqCst),
        0,
        "nothing committed, nobody woken"
    );

    let mut due = stored.clone();
    due.version += 1;
    due.next_attempt_at = now_ms() - TimeDelta::seconds(60);
    assert!(store.saga_save(&due).await.expect("save"));
    let done = orchestrator.drive("A-4471").await.expect("drive");
    assert_eq!(done.status, SagaStatus::Completed);
    let announced = store
        .outbox_claim("audit", 10, Duration::from_secs(30))
        .await
        .expect("claim");
    let ids: Vec<&str> = announced
        .iter()
        .map(|r| r.record.event_id.as_str())
        .collect();
    assert_eq!(
        ids,
        ["A-4471:running->completed"],
        "one write, with the change"
    );
    assert_eq!(woken.load(Ordering::SeqCst), 1);
}

/// Announces every status change in the outbox, failing the first
/// `failures_left` times; counts its after-commit runs.
struct AnnouncingHook<S> {
    store: S,
    failures_left: Arc<AtomicUsize>,
    woken: Arc<AtomicUsize>,
}

#[async_trait::async_trait]
impl<S: MessagingStore> SagaHook<S> for AnnouncingHook<S> {
    async fn status_changed(
        &self,
        tx: &mut S::Tx,
        prev: &SagaRecord,
        next: &SagaRecord,
    ) -> Result<AfterCommit, StoreError> {
        let change = format!("{}->{}", prev.status.as_str(), next.status.as_str());
        let record = OutboxRecord {
            event_id: format!("{}:{change}", next.id),
            topic: "sagas".to_owned(),
            partition_key: next.id.clone(),
            headers: Default::default(),
            payload: change.into_bytes().into(),
        };
        self.store.outbox_append(tx, &[record]).await?;
        let fail = self
            .failures_left
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if fail {
            return Err(StoreError::Unavailable(
                "the projection's table is gone".into(),
            ));
        }
        let woken = self.woken.clone();
        Ok(AfterCommit::then(move || {
            woken.fetch_add(1, Ordering::SeqCst);
        }))
    }
}
