//! The saga orchestrator on SqliteStore: the order saga runs,
//! compensates, sticks and is steered by an operator; and a crash at any
//! save, a process killed mid-step, or two orchestrators racing never make
//! an effect happen twice or leave a saga anywhere but completed, fully
//! compensated, or visibly stuck.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use keel_core::BoxError;
use keel_messaging::envelope::{Envelope, Event, EventMeta};
use keel_messaging::outbox::Outbox;
use keel_messaging::saga::DEFAULT_FORWARD_BUDGET;
use keel_messaging::saga::choreography::{Next, reaction};
use keel_messaging::saga::flow::{FLOW_EXPIRED, Flow, FlowError, FlowWatch};
use keel_messaging::saga::{SagaDefinition, SagaError, SagaOrchestrator, Step, StepContext};
use keel_messaging::store::{
    OutboxStore, SagaFilter, SagaRecord, SagaStatus, SagaStore, Store, StoreError,
};
use keel_sqlite::store::SqliteStore;
use parking_lot::Mutex;
use tempfile::TempDir;

type Tx = <SqliteStore as Store>::Tx;

#[path = "support/saga_fixture.rs"]
mod fixture;
use fixture::*;

const ALL_STEPS: [&str; 4] = [
    "capture_payment",
    "reserve_stock",
    "schedule_shipment",
    "send_receipt",
];
const COMPENSATED: [&str; 4] = [
    "capture_payment",
    "reserve_stock",
    "undo:reserve_stock",
    "undo:capture_payment",
];

// ---------------------------------------------------------------- world --

struct World<S: SagaStore> {
    _dir: Arc<TempDir>,
    sqlite: SqliteStore,
    store: S,
    svc: Arc<Services>,
    def: SagaDefinition<Order>,
    orch: SagaOrchestrator<S>,
}

async fn sqlite() -> (Arc<TempDir>, SqliteStore) {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("app.db")).await.unwrap();
    (Arc::new(dir), store)
}

fn orchestrator<S: SagaStore>(store: &S, def: &SagaDefinition<Order>) -> SagaOrchestrator<S> {
    SagaOrchestrator::builder(store.clone())
        .saga(def)
        .lease_grace(Duration::from_millis(50))
        .poll_interval(Duration::from_millis(10))
        .build()
        .unwrap()
}

async fn world() -> World<SqliteStore> {
    let (dir, sqlite) = sqlite().await;
    world_over(dir, sqlite.clone(), sqlite).await
}

async fn world_over<S: SagaStore>(dir: Arc<TempDir>, sqlite: SqliteStore, store: S) -> World<S> {
    let svc = Arc::new(Services::default());
    let def = seed_saga(&svc);
    let orch = orchestrator(&store, &def);
    World {
        _dir: dir,
        sqlite,
        store,
        svc,
        def,
        orch,
    }
}

impl<S: SagaStore> World<S> {
    async fn start(&self, id: &str) {
        let mut tx = self.store.begin().await.unwrap();
        assert!(
            self.orch
                .start(&mut tx, &self.def, id, &order(id))
                .await
                .unwrap()
        );
        self.store.commit(tx).await.unwrap();
    }

    /// What the passing of time does to leases and backoffs (without
    /// waiting for it).
    async fn expire_waits(&self) {
        sqlx::query(
            "UPDATE keel_sagas SET next_attempt_at = 0 WHERE status IN ('running', 'compensating')",
        )
        .execute(self.sqlite.pool())
        .await
        .unwrap();
    }

    /// Drives the saga until it finishes or sticks.
    async fn settle(&self, id: &str) -> SagaRecord {
        for _ in 0..500 {
            let record = self.orch.drive(id).await.unwrap();
            if record.status.is_terminal() || record.status == SagaStatus::Stuck {
                return record;
            }
            tokio::time::sleep(Duration::from_millis(3)).await;
        }
        panic!("saga {id} did not settle");
    }
}

// ------------------------------------------------------------ scenarios --

#[tokio::test]
async fn the_order_saga_completes_with_derived_keys_and_persisted_data() {
    let w = world().await;
    w.start("A-4471").await;
    let done = w.settle("A-4471").await;
    assert_eq!(done.status, SagaStatus::Completed);
    assert_eq!(
        done.version, 6,
        "inserted, then a claim per step carrying the result before it, then the last result"
    );
    assert_eq!(w.svc.effects(), keys("A-4471", &ALL_STEPS));
    let stored = w.orch.get("A-4471").await.unwrap().unwrap();
    let data: Order = serde_json::from_value(stored.data).unwrap();
    assert_eq!(data.payment_id.as_deref(), Some("pay-A-4471"));
}

#[tokio::test]
async fn a_saga_started_in_a_rolled_back_transaction_never_exists() {
    let w = world().await;
    let mut tx: Tx = w.store.begin().await.unwrap();
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (id TEXT PRIMARY KEY)")
        .execute(&mut *tx)
        .await
        .unwrap();
    assert!(
        w.orch
            .start(&mut tx, &w.def, "A-1", &order("A-1"))
            .await
            .unwrap()
    );
    w.store.rollback(tx).await.unwrap();
    assert!(w.orch.get("A-1").await.unwrap().is_none());
    assert_eq!(w.orch.tick().await.unwrap(), 0);

    w.start("A-1").await;
    let mut tx = w.store.begin().await.unwrap();
    assert!(
        !w.orch
            .start(&mut tx, &w.def, "A-1", &order("A-1"))
            .await
            .unwrap(),
        "a redelivered trigger does not start a second saga"
    );
}

#[tokio::test]
async fn a_refused_pivot_undoes_completed_steps_in_reverse() {
    let w = world().await;
    w.svc.set("schedule_shipment", Behaviour::Refuse);
    w.start("A-2").await;
    let done = w.settle("A-2").await;
    assert_eq!(done.status, SagaStatus::Compensated);
    assert_eq!(w.svc.effects(), keys("A-2", &COMPENSATED));
    assert!(
        done.last_error
            .unwrap()
            .contains("schedule_shipment refused")
    );
}

#[tokio::test]
async fn a_step_that_times_out_is_undone_because_it_may_have_happened() {
    let w = world().await;
    w.svc.set("reserve_stock", Behaviour::Hang);
    w.start("A-3").await;
    let done = w.settle("A-3").await;
    assert_eq!(done.status, SagaStatus::Compensated);
    assert!(done.last_error.unwrap().contains("timed out"));
    assert!(
        w.svc
            .effects()
            .contains(&"A-3:undo:reserve_stock".to_owned())
    );
    assert!(
        w.svc
            .effects()
            .contains(&"A-3:undo:capture_payment".to_owned())
    );
}

#[tokio::test]
async fn past_the_pivot_the_saga_sticks_visibly_and_an_operator_finishes_it() {
    let w = world().await;
    // Forward recovery is bounded by time, not by `stuck_after` (3).
    w.svc.set("send_receipt", Behaviour::FailTimes(5));
    w.start("A-4").await;
    assert_eq!(w.settle("A-4").await.status, SagaStatus::Completed);
    assert_eq!(
        w.svc.calls_of("A-4:send_receipt"),
        6,
        "retried forward with the same key until it worked"
    );

    // With no budget for going forward, it is stuck at the first failure.
    let def = seed_saga_with(&w.svc, Duration::from_millis(2), Duration::ZERO);
    let w = World {
        orch: orchestrator(&w.store, &def),
        def,
        ..w
    };
    w.svc.set("send_receipt", Behaviour::FailTimes(1000));
    w.start("A-5").await;
    w.start("A-6").await;
    let stuck = w.settle("A-5").await;
    assert_eq!((stuck.status, stuck.step), (SagaStatus::Stuck, 3));
    assert_eq!(w.svc.calls_of("A-5:send_receipt"), 1, "then stuck");
    assert!(
        stuck
            .last_error
            .as_deref()
            .unwrap()
            .contains("gave up going forward")
    );

    // The dashboard: by state and age, with the step in words.
    let views = w
        .orch
        .list(&SagaFilter {
            status: Some(SagaStatus::Stuck),
            ..SagaFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(views.len(), 1);
    assert_eq!(views[0].record.id, "A-5");
    assert_eq!(views[0].step_name.as_deref(), Some("send_receipt"));
    let counts: HashMap<SagaStatus, u64> = w.orch.counts().await.unwrap().into_iter().collect();
    assert_eq!(counts[&SagaStatus::Stuck], 1);
    assert_eq!(counts[&SagaStatus::Running], 1);
    // A stuck saga is not picked up again by itself.
    assert!(
        w.store
            .saga_due(&["order_fulfilment"], keel_core::clock::utc_now(), 10)
            .await
            .unwrap()
            .iter()
            .all(|s| s.id != "A-5")
    );

    let err = w.orch.cancel("A-5").await.unwrap_err();
    assert!(matches!(err, SagaError::PastPivot { .. }), "{err}");

    w.svc.clear("send_receipt");
    w.orch.retry("A-5").await.unwrap();
    assert_eq!(w.settle("A-5").await.status, SagaStatus::Completed);
    assert_eq!(
        w.svc
            .effects()
            .iter()
            .filter(|k| k.starts_with("A-5:"))
            .count(),
        4
    );
}

#[tokio::test]
async fn cancelling_before_the_pivot_compensates_and_ends_cancelled() {
    let w = world().await;
    // A long backoff, so the saga is waiting when the operator cancels.
    let def = seed_saga_with(&w.svc, Duration::from_secs(60), DEFAULT_FORWARD_BUDGET);
    let w = World {
        orch: orchestrator(&w.store, &def),
        def,
        ..w
    };
    w.svc.set("reserve_stock", Behaviour::FailTimes(1));
    w.start("A-7").await;
    let waiting = w.orch.drive("A-7").await.unwrap();
    assert_eq!((waiting.status, waiting.step), (SagaStatus::Running, 1));
    w.orch.cancel("A-7").await.unwrap();
    w.expire_waits().await;
    let done = w.settle("A-7").await;
    assert_eq!(done.status, SagaStatus::Cancelled);
    assert!(
        done.last_error
            .unwrap()
            .starts_with("cancelled by operator")
    );
    assert_eq!(
        w.svc.effects(),
        keys("A-7", &["capture_payment", "undo:capture_payment"]),
        "the reservation answered 503 (it did not happen): only the capture is undone"
    );
}

// ---------------------------------------------------- crash injection --

/// SqliteStore with a crash injected at one `saga_save`: before the write
/// (the process died after the call, before saving), or after it (died
/// after the save committed, before it heard back).
#[derive(Clone)]
struct CrashingStore {
    inner: SqliteStore,
    saves: Arc<AtomicUsize>,
    crash_at: Arc<Mutex<Option<(usize, bool)>>>,
}

#[async_trait]
impl Store for CrashingStore {
    type Tx = Tx;
    async fn begin(&self) -> Result<Tx, StoreError> {
        self.inner.begin().await
    }
    async fn commit(&self, tx: Tx) -> Result<(), StoreError> {
        self.inner.commit(tx).await
    }
    async fn rollback(&self, tx: Tx) -> Result<(), StoreError> {
        self.inner.rollback(tx).await
    }
    async fn ready(&self) -> Result<(), StoreError> {
        self.inner.ready().await
    }
}

#[async_trait]
impl SagaStore for CrashingStore {
    async fn saga_insert(&self, tx: &mut Tx, saga: &SagaRecord) -> Result<bool, StoreError> {
        self.inner.saga_insert(tx, saga).await
    }
    async fn saga_get(&self, id: &str) -> Result<Option<SagaRecord>, StoreError> {
        self.inner.saga_get(id).await
    }
    async fn saga_save(&self, saga: &SagaRecord) -> Result<bool, StoreError> {
        let n = self.saves.fetch_add(1, Ordering::SeqCst) + 1;
        let crash = match *self.crash_at.lock() {
            Some((at, applied)) if at == n => Some(applied),
            _ => None,
        };
        if crash == Some(false) {
            return Err(StoreError::Unavailable("crash before the save".into()));
        }
        let saved = self.inner.saga_save(saga).await?;
        if crash == Some(true) {
            return Err(StoreError::OutcomeUnknown("crash after the save".into()));
        }
        Ok(saved)
    }
    async fn saga_save_in(&self, tx: &mut Tx, saga: &SagaRecord) -> Result<bool, StoreError> {
        self.inner.saga_save_in(tx, saga).await
    }
    async fn saga_get_in(&self, tx: &mut Tx, id: &str) -> Result<Option<SagaRecord>, StoreError> {
        self.inner.saga_get_in(tx, id).await
    }
    async fn saga_due(
        &self,
        kinds: &[&str],
        now: DateTime<Utc>,
        limit: usize,
    ) -> Result<Vec<SagaRecord>, StoreError> {
        self.inner.saga_due(kinds, now, limit).await
    }
    async fn saga_list(&self, filter: &SagaFilter) -> Result<Vec<SagaRecord>, StoreError> {
        self.inner.saga_list(filter).await
    }
    async fn saga_counts(&self) -> Result<Vec<(SagaStatus, u64)>, StoreError> {
        self.inner.saga_counts().await
    }
}

async fn crashing_world(crash_at: Option<(usize, bool)>) -> World<CrashingStore> {
    let (dir, sqlite) = sqlite().await;
    let store = CrashingStore {
        inner: sqlite.clone(),
        saves: Arc::default(),
        crash_at: Arc::new(Mutex::new(crash_at)),
    };
    world_over(dir, sqlite, store).await
}

/// Crash between every pair of durable steps (each claim, with the result
/// before it, is a save, and so is the last result; the crash comes before
/// or after each one), then restart: the
/// saga ends where it would have without the crash, every effect happened
/// exactly once, and a repeated call reused its idempotency key.
#[tokio::test]
async fn a_crash_at_any_save_resumes_exactly_where_it_stopped() {
    for refuse_pivot in [false, true] {
        let probe = crashing_world(None).await;
        if refuse_pivot {
            probe.svc.set("schedule_shipment", Behaviour::Refuse);
        }
        probe.start("probe").await;
        probe.settle("probe").await;
        let total = probe.store.saves.load(Ordering::SeqCst);
        assert!(total >= 5);

        let mut pivot_maybe_sent = 0;
        for crash_at in 1..=total {
            for applied in [false, true] {
                let context =
                    format!("refuse_pivot={refuse_pivot} save={crash_at} applied={applied}");
                let w = crashing_world(Some((crash_at, applied))).await;
                // Where the pivot refuses, a crash that leaves its attempt
                // claimed but unanswered means the shipment may exist: the
                // saga only goes forward, and with no budget for that it
                // is stuck at once, for an operator.
                let w = if refuse_pivot {
                    w.svc.set("schedule_shipment", Behaviour::Refuse);
                    let def = seed_saga_with(&w.svc, Duration::from_millis(2), Duration::ZERO);
                    World {
                        orch: orchestrator(&w.store, &def),
                        def,
                        ..w
                    }
                } else {
                    w
                };
                w.start("A-8").await;
                let crashed = loop {
                    match w.orch.drive("A-8").await {
                        Err(e) => break e,
                        Ok(r) if r.status.is_terminal() => panic!("no crash; {context}"),
                        Ok(_) => tokio::time::sleep(Duration::from_millis(3)).await,
                    }
                };
                assert!(
                    matches!(crashed, SagaError::Store(_)),
                    "{crashed}; {context}"
                );

                // A new process, once the dead one's lease has run out.
                *w.store.crash_at.lock() = None;
                w.expire_waits().await;
                let w = World {
                    orch: orchestrator(&w.store, &w.def),
                    ..w
                };
                let done = w.settle("A-8").await;
                let (status, effects) = if refuse_pivot && done.status == SagaStatus::Stuck {
                    pivot_maybe_sent += 1;
                    assert_eq!(done.step, 2, "{context}");
                    assert!(done.outcome_unknown, "{context}");
                    (SagaStatus::Stuck, &ALL_STEPS[..2])
                } else if refuse_pivot {
                    (SagaStatus::Compensated, &COMPENSATED[..])
                } else {
                    (SagaStatus::Completed, &ALL_STEPS[..])
                };
                assert_eq!(done.status, status, "{context}");
                assert_eq!(w.svc.effects(), keys("A-8", effects), "{context}");
                for key in w.svc.effects() {
                    assert!(
                        w.svc.calls_of(&key) <= 2,
                        "{key} called too often; {context}"
                    );
                }
            }
        }
        // The pivot's claim written and the process gone, or its outcome
        // not written: the two crashes after which it may have been sent.
        assert_eq!(pivot_maybe_sent, if refuse_pivot { 2 } else { 0 });
    }
}

#[tokio::test]
async fn a_process_killed_mid_step_is_resumed_by_another_with_the_same_key() {
    let (dir, sqlite) = sqlite().await;
    let svc = Arc::new(Services::default());
    let entered = Arc::new(tokio::sync::Notify::new());
    let first = Arc::new(AtomicBool::new(true));
    let shipment = {
        let (svc, entered, first) = (svc.clone(), entered.clone(), first.clone());
        Step::new("schedule_shipment", move |ctx: StepContext<Order>| {
            let (svc, entered, first) = (svc.clone(), entered.clone(), first.clone());
            async move {
                svc.call("schedule_shipment", ctx.idempotency_key()).await?;
                if first.swap(false, Ordering::SeqCst) {
                    // The shipment is booked; the process dies before it
                    // hears back.
                    entered.notify_one();
                    std::future::pending::<()>().await;
                }
                Ok::<_, BoxError>(())
            }
        })
        .timeout(Duration::from_millis(400))
    };
    let def = SagaDefinition::builder("order_fulfilment")
        .step(compensable(&svc, "capture_payment"))
        .step(compensable(&svc, "reserve_stock"))
        .pivot(shipment)
        .step(step(&svc, "send_receipt"))
        .build()
        .unwrap();
    let w = World {
        _dir: dir,
        orch: orchestrator(&sqlite, &def),
        store: sqlite.clone(),
        sqlite,
        svc,
        def,
    };
    w.start("A-9").await;

    let first_process = tokio::spawn({
        let orch = w.orch.clone();
        async move { orch.run(std::future::pending()).await }
    });
    entered.notified().await;
    first_process.abort();
    let _ = first_process.await;
    let leased = w.orch.get("A-9").await.unwrap().unwrap();
    assert_eq!(
        (leased.status, leased.step, leased.attempts),
        (SagaStatus::Running, 2, 1)
    );
    assert!(
        leased.next_attempt_at > keel_core::clock::utc_now(),
        "still leased to the dead process"
    );

    // A second process waits out the lease (step timeout + grace), then
    // finishes the saga.
    let second = orchestrator(&w.store, &w.def);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let second_process = tokio::spawn({
        let orch = second.clone();
        async move {
            orch.run(async move {
                let _ = stopped.await;
            })
            .await;
        }
    });
    let done = loop {
        let r = second.get("A-9").await.unwrap().unwrap();
        if r.status.is_terminal() {
            break r;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    stop.send(()).unwrap();
    second_process.await.unwrap();
    assert_eq!(done.status, SagaStatus::Completed);
    assert_eq!(
        w.svc.calls_of("A-9:schedule_shipment"),
        2,
        "re-run with the same key"
    );
    assert_eq!(w.svc.effects(), keys("A-9", &ALL_STEPS), "booked once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_orchestrators_on_one_store_run_each_step_once() {
    let w = world().await;
    let ids: Vec<String> = (0..12).map(|i| format!("B-{i}")).collect();
    for id in &ids {
        w.start(id).await;
    }
    let other = orchestrator(&w.store, &w.def);
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let mut runners = Vec::new();
    for orch in [w.orch.clone(), other] {
        let mut stopped = stopped.clone();
        runners.push(tokio::spawn(async move {
            orch.run(async move {
                let _ = stopped.changed().await;
            })
            .await;
        }));
    }
    for _ in 0..500 {
        let counts = w.orch.counts().await.unwrap();
        if counts == vec![(SagaStatus::Completed, 12)] {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.send(true).unwrap();
    for r in runners {
        r.await.unwrap();
    }
    assert_eq!(
        w.orch.counts().await.unwrap(),
        vec![(SagaStatus::Completed, 12)]
    );
    for id in &ids {
        for key in keys(id, &ALL_STEPS) {
            assert_eq!(
                w.svc.calls_of(&key),
                1,
                "{key}: claimed by exactly one orchestrator"
            );
        }
    }
}

// -------------------------------------------------------- choreography --

#[tokio::test]
async fn a_reaction_commits_its_effect_and_the_next_event_together() {
    let (_dir, store) = sqlite().await;
    sqlx::query("CREATE TABLE reservations (order_id TEXT PRIMARY KEY)")
        .execute(store.pool())
        .await
        .unwrap();
    let reserve = reaction(
        Outbox::new(store.clone()),
        "/services/inventory",
        "stock",
        |tx: &mut Tx, placed: OrderPlaced, _cause| {
            Box::pin(async move {
                sqlx::query("INSERT INTO reservations (order_id) VALUES (?1)")
                    .bind(&placed.order_id)
                    .execute(&mut **tx)
                    .await?;
                Ok(Some(Next::new(
                    StockReserved {
                        order_id: placed.order_id,
                    },
                    1,
                )))
            })
        },
    );
    let cause = Envelope::from_event(
        "/services/orders",
        &OrderPlaced {
            order_id: "A-4471".into(),
        },
        EventMeta::new(3),
    )
    .unwrap();

    // Rolled back: neither the reservation nor the event exists.
    let mut tx = store.begin().await.unwrap();
    reserve.react(&mut tx, &cause).await.unwrap();
    store.rollback(tx).await.unwrap();
    assert!(store.outbox_stats().await.unwrap().unpublished == 0);

    // Committed: both.
    let mut tx = store.begin().await.unwrap();
    let next = reserve.react(&mut tx, &cause).await.unwrap().unwrap();
    store.commit(tx).await.unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM reservations")
        .fetch_one(store.pool())
        .await
        .unwrap();
    assert_eq!(rows, 1);
    let pending = store
        .outbox_claim("relay", 10, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(pending.len(), 1);
    assert_eq!(pending[0].record.event_id, next.id);
    assert_eq!(next.id, format!("{}:{}", cause.id, StockReserved::TYPE));
    let emitted = Envelope::from_json(&pending[0].record.payload).unwrap();
    assert_eq!(emitted.extensions["causationid"], cause.id.as_str());
}

// ------------------------------------------- choreography's safety net --

/// The order checkout as a choreography: the shop places the order, the
/// inventory reserves stock (undone by releasing it), payments capture
/// (undone by a refund), shipping schedules.
fn checkout(deadline: Duration, undo_within: Duration) -> Flow {
    Flow::builder("checkout", deadline)
        .step(OrderPlaced::TYPE)
        .compensable_step(StockReserved::TYPE)
        .compensable_step("pay.captured.v1")
        .step("ship.scheduled.v1")
        .compensation_deadline(undo_within)
        .build()
        .unwrap()
}

/// The shop places an order: the event and the flow's first step, in one
/// transaction.
async fn place(store: &SqliteStore, flow: &Flow, order_id: &str) -> Envelope {
    let placed = Envelope::from_event(
        "/services/orders",
        &OrderPlaced {
            order_id: order_id.into(),
        },
        EventMeta::new(1),
    )
    .unwrap();
    let mut tx = store.begin().await.unwrap();
    Outbox::new(store.clone())
        .append(&mut tx, "orders", &placed)
        .await
        .unwrap();
    flow.reached(store, &mut tx, &placed).await.unwrap();
    store.commit(tx).await.unwrap();
    placed
}

async fn flow_record(store: &SqliteStore, flow: &Flow, placed: &Envelope) -> SagaRecord {
    store
        .saga_get(&flow.record_id(&placed.id))
        .await
        .unwrap()
        .expect("the flow is recorded")
}

fn watch(store: &SqliteStore, flows: &[&Flow]) -> FlowWatch<SqliteStore> {
    let mut builder = FlowWatch::builder(
        store.clone(),
        Outbox::new(store.clone()),
        "/services/flow-watch",
        "flows",
    );
    for flow in flows {
        builder = builder.flow(flow);
    }
    builder.build()
}

#[tokio::test]
async fn a_stalled_choreography_is_turned_back_a_late_step_refused_and_the_undo_confirmed() {
    let (_dir, store) = sqlite().await;
    let deadline = Duration::from_millis(300);
    let flow = checkout(deadline, Duration::from_secs(30));
    let watch = watch(&store, &[&flow]);
    let started = keel_core::clock::now();
    let placed = place(&store, &flow, "A-4471").await;
    let reserve = flow.track(
        store.clone(),
        reaction(
            Outbox::new(store.clone()),
            "/services/inventory",
            "stock",
            |_tx: &mut Tx, placed: OrderPlaced, _cause| {
                Box::pin(async move {
                    let order_id = placed.order_id;
                    Ok(Some(Next::new(StockReserved { order_id }, 2)))
                })
            },
        ),
    );
    let mut tx = store.begin().await.unwrap();
    let reserved = reserve.react(&mut tx, &placed).await.unwrap().unwrap();
    store.commit(tx).await.unwrap();
    let record = flow_record(&store, &flow, &placed).await;
    assert_eq!((record.status, record.step), (SagaStatus::Running, 2));
    assert_eq!(record.kind, "checkout");
    if started.elapsed() < deadline / 2 {
        assert_eq!(watch.tick().await.unwrap(), 0, "not before its deadline");
    }

    // Payments never answer: the deadline passes.
    tokio::time::sleep(deadline + Duration::from_millis(50)).await;
    assert_eq!(watch.tick().await.unwrap(), 1);
    let record = flow_record(&store, &flow, &placed).await;
    assert_eq!(record.status, SagaStatus::Compensating);
    let reason = record.last_error.clone().unwrap();
    assert!(
        reason.contains(
            "passed after step shop.stock.reserved.v1: asked to undo shop.stock.reserved.v1"
        ),
        "{reason}"
    );
    let pending = store
        .outbox_claim("relay", 10, Duration::from_secs(30))
        .await
        .unwrap();
    let expired: Vec<Envelope> = pending
        .iter()
        .map(|p| Envelope::from_json(&p.record.payload).unwrap())
        .filter(|e| e.ty == FLOW_EXPIRED)
        .collect();
    assert_eq!(expired.len(), 1, "one expiry event, to the flows topic");
    assert_eq!(expired[0].id, format!("checkout:{}:expired", placed.id));
    assert_eq!(
        expired[0].data.as_ref().unwrap()["undo"],
        serde_json::json!([StockReserved::TYPE])
    );
    assert_eq!(expired[0].extensions["correlationid"], placed.id.as_str());
    assert_eq!(watch.tick().await.unwrap(), 0, "expired once");

    // The payment that arrives now is refused: it must not land after the undo.
    let captured = {
        let mut e = Envelope::new("/services/payments", "pay.captured.v1");
        e.extensions
            .insert("correlationid".into(), placed.id.clone().into());
        e
    };
    let mut tx = store.begin().await.unwrap();
    let late = flow.reached(&store, &mut tx, &captured).await.unwrap_err();
    assert!(
        matches!(
            late,
            FlowError::Expired {
                status: SagaStatus::Compensating,
                ..
            }
        ),
        "{late}"
    );
    store.rollback(tx).await.unwrap();
    // So is a redelivered cause in a tracked reaction, before it reacts.
    let mut tx = store.begin().await.unwrap();
    let refused = reserve.react(&mut tx, &placed).await.unwrap_err();
    assert_eq!(refused.kind(), Some("flow_expired"));
    store.rollback(tx).await.unwrap();

    // The inventory releases the stock and says so.
    let mut tx = store.begin().await.unwrap();
    let status = flow
        .compensated(&store, &mut tx, &placed.id, StockReserved::TYPE)
        .await
        .unwrap();
    store.commit(tx).await.unwrap();
    assert_eq!(status, SagaStatus::Compensated);
    assert_eq!(reserved.extensions["correlationid"], placed.id.as_str());

    // The same view as an orchestrated saga.
    let listed = store.saga_list(&SagaFilter::default()).await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].status, SagaStatus::Compensated);
    let counts: HashMap<SagaStatus, u64> = store.saga_counts().await.unwrap().into_iter().collect();
    assert_eq!(counts[&SagaStatus::Compensated], 1);
}

#[tokio::test]
async fn a_flow_in_time_is_left_alone_and_an_unconfirmed_undo_is_stuck_for_an_operator() {
    let (_dir, store) = sqlite().await;
    let (deadline, undo_within) = (Duration::from_millis(200), Duration::from_millis(200));
    let flow = checkout(deadline, undo_within);
    let watch = watch(&store, &[&flow]);

    let done = place(&store, &flow, "A-1").await;
    let mut tx = store.begin().await.unwrap();
    for ty in [StockReserved::TYPE, "pay.captured.v1", "ship.scheduled.v1"] {
        let mut step = Envelope::new("/services/x", ty);
        step.extensions
            .insert("correlationid".into(), done.id.clone().into());
        flow.reached(&store, &mut tx, &step).await.unwrap();
    }
    store.commit(tx).await.unwrap();
    assert_eq!(
        flow_record(&store, &flow, &done).await.status,
        SagaStatus::Completed
    );

    let stalled = place(&store, &flow, "A-2").await;
    let mut tx = store.begin().await.unwrap();
    let mut reserved = Envelope::new("/services/inventory", StockReserved::TYPE);
    reserved
        .extensions
        .insert("correlationid".into(), stalled.id.clone().into());
    flow.reached(&store, &mut tx, &reserved).await.unwrap();
    store.commit(tx).await.unwrap();

    let nothing_to_undo = place(&store, &flow, "A-3").await;

    tokio::time::sleep(deadline + Duration::from_millis(50)).await;
    assert_eq!(watch.tick().await.unwrap(), 2);
    assert_eq!(
        flow_record(&store, &flow, &done).await.status,
        SagaStatus::Completed
    );
    let parked = flow_record(&store, &flow, &nothing_to_undo).await;
    assert_eq!(parked.status, SagaStatus::Stuck);
    assert!(
        parked
            .last_error
            .unwrap()
            .contains("with nothing to undo: an operator decides")
    );
    assert_eq!(
        flow_record(&store, &flow, &stalled).await.status,
        SagaStatus::Compensating
    );
    // An orchestrator of other sagas never picks flows up.
    let due = store
        .saga_due(&["order_fulfilment"], keel_core::clock::utc_now(), 10)
        .await
        .unwrap();
    assert!(due.is_empty(), "{due:?}");

    // Nobody confirms the release.
    tokio::time::sleep(undo_within + Duration::from_millis(50)).await;
    assert_eq!(watch.tick().await.unwrap(), 1);
    let stuck = flow_record(&store, &flow, &stalled).await;
    assert_eq!(stuck.status, SagaStatus::Stuck);
    let reason = stuck.last_error.unwrap();
    assert!(
        reason.contains("undo not confirmed within 200ms for shop.stock.reserved.v1"),
        "{reason}"
    );
    assert!(stuck.next_attempt_at > keel_core::clock::utc_now() + chrono::TimeDelta::days(365));
    assert_eq!(
        watch.tick().await.unwrap(),
        0,
        "parked until an operator acts"
    );

    // The release is confirmed late after all: the flow is compensated.
    let mut tx = store.begin().await.unwrap();
    let status = flow
        .compensated(&store, &mut tx, &stalled.id, StockReserved::TYPE)
        .await
        .unwrap();
    store.commit(tx).await.unwrap();
    assert_eq!(status, SagaStatus::Compensated);
    // A step told twice changes nothing, even on a finished flow.
    let mut tx = store.begin().await.unwrap();
    let again = flow.reached(&store, &mut tx, &reserved).await.unwrap();
    assert_eq!(again, SagaStatus::Compensated);
    store.rollback(tx).await.unwrap();
}
