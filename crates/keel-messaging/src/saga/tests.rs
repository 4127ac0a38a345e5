//! Orchestrator behaviour over an in-memory store with paused time: the
//! scenarios that need a clock or a scripted reply. Crashes at every save
//! and a process killed mid-step run on SQLite, in this crate's
//! `tests/saga.rs`, over the same fixture.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chrono::{DateTime, Utc};
use parking_lot::Mutex;

use super::*;
use crate::store::{
    OutboxAdminStore, OutboxRecord, OutboxStats, OutboxStore, PendingOutbox, PublishedOutbox,
    SagaFilter, SagaRecord, SagaStatus, SagaStore, Store, StoreError,
};

// ------------------------------------------------------------------ store --

#[derive(Default)]
struct State {
    sagas: BTreeMap<String, SagaRecord>,
    outbox: Vec<OutboxRecord>,
    saves: usize,
    /// The status of every save that landed, in order.
    saved_statuses: Vec<SagaStatus>,
}

#[derive(Clone, Default)]
struct MemStore {
    state: Arc<Mutex<State>>,
}

#[derive(Default)]
struct MemTx {
    sagas: Vec<SagaRecord>,
    outbox: Vec<OutboxRecord>,
}

impl MemStore {
    fn saves(&self) -> usize {
        self.state.lock().saves
    }

    fn saved_statuses(&self) -> Vec<SagaStatus> {
        self.state.lock().saved_statuses.clone()
    }

    /// What the passing of time does to leases and backoffs.
    fn expire_waits(&self) {
        let now = keel_core::clock::utc_now();
        for s in self.state.lock().sagas.values_mut() {
            s.next_attempt_at = s.next_attempt_at.min(now);
        }
    }
}

fn unsupported() -> StoreError {
    StoreError::other("not supported by the saga test store")
}

#[async_trait]
impl Store for MemStore {
    type Tx = MemTx;

    async fn begin(&self) -> Result<MemTx, StoreError> {
        Ok(MemTx::default())
    }

    async fn commit(&self, tx: MemTx) -> Result<(), StoreError> {
        let mut state = self.state.lock();
        for s in tx.sagas {
            state.sagas.entry(s.id.clone()).or_insert(s);
        }
        state.outbox.extend(tx.outbox);
        Ok(())
    }

    async fn rollback(&self, _tx: MemTx) -> Result<(), StoreError> {
        Ok(())
    }

    async fn ready(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

#[async_trait]
impl SagaStore for MemStore {
    async fn saga_insert(&self, tx: &mut MemTx, saga: &SagaRecord) -> Result<bool, StoreError> {
        let exists = self.state.lock().sagas.contains_key(&saga.id)
            || tx.sagas.iter().any(|s| s.id == saga.id);
        if !exists {
            tx.sagas.push(saga.clone());
        }
        Ok(!exists)
    }

    async fn saga_get(&self, id: &str) -> Result<Option<SagaRecord>, StoreError> {
        Ok(self.state.lock().sagas.get(id).cloned())
    }

    async fn saga_save(&self, saga: &SagaRecord) -> Result<bool, StoreError> {
        let mut state = self.state.lock();
        state.saves += 1;
        let Some(stored) = state.sagas.get_mut(&saga.id) else {
            return Ok(false);
        };
        if stored.version != saga.version - 1 {
            return Ok(false);
        }
        *stored = saga.clone();
        state.saved_statuses.push(saga.status);
        Ok(true)
    }

    async fn saga_save_in(&self, _tx: &mut MemTx, _saga: &SagaRecord) -> Result<bool, StoreError> {
        Err(unsupported())
    }

    async fn saga_get_in(
        &self,
        _tx: &mut MemTx,
        _id: &str,
    ) -> Result<Option<SagaRecord>, StoreError> {
        Err(unsupported())
    }

    async fn saga_due(
        &self,
        kinds: &[&str],
        now: DateTime<Utc>,
        limit: usize,
    ) -> Result<Vec<SagaRecord>, StoreError> {
        let mut due: Vec<SagaRecord> = self
            .state
            .lock()
            .sagas
            .values()
            .filter(|s| kinds.contains(&s.kind.as_str()))
            // Like the contract (and SQLite): stuck is not terminal.
            .filter(|s| !s.status.is_terminal())
            .filter(|s| s.next_attempt_at <= now)
            .cloned()
            .collect();
        due.sort_by_key(|s| s.next_attempt_at);
        due.truncate(limit);
        Ok(due)
    }

    async fn saga_list(&self, filter: &SagaFilter) -> Result<Vec<SagaRecord>, StoreError> {
        let mut list: Vec<SagaRecord> = self
            .state
            .lock()
            .sagas
            .values()
            .filter(|s| filter.status.is_none_or(|st| st == s.status))
            .filter(|s| filter.updated_before.is_none_or(|t| s.updated_at < t))
            .cloned()
            .collect();
        list.sort_by_key(|s| s.updated_at);
        list.truncate(filter.limit.unwrap_or(100));
        Ok(list)
    }

    async fn saga_counts(&self) -> Result<Vec<(SagaStatus, u64)>, StoreError> {
        let mut counts: HashMap<SagaStatus, u64> = HashMap::new();
        for s in self.state.lock().sagas.values() {
            *counts.entry(s.status).or_default() += 1;
        }
        Ok(counts.into_iter().collect())
    }
}

#[async_trait]
impl OutboxStore for MemStore {
    async fn outbox_append(
        &self,
        tx: &mut MemTx,
        records: &[OutboxRecord],
    ) -> Result<(), StoreError> {
        tx.outbox.extend_from_slice(records);
        Ok(())
    }
    async fn outbox_claim(
        &self,
        _relay: &str,
        _limit: usize,
        _lease: Duration,
    ) -> Result<Vec<PendingOutbox>, StoreError> {
        Err(unsupported())
    }
    async fn outbox_mark_published(&self, _ids: &[i64]) -> Result<(), StoreError> {
        Err(unsupported())
    }
    async fn outbox_release(&self, _relay: &str, _ids: &[i64]) -> Result<(), StoreError> {
        Err(unsupported())
    }
    async fn outbox_prune(&self, _before: DateTime<Utc>, _batch: usize) -> Result<u64, StoreError> {
        Err(unsupported())
    }
    async fn outbox_stats(&self) -> Result<OutboxStats, StoreError> {
        Err(unsupported())
    }
}

#[async_trait]
impl OutboxAdminStore for MemStore {
    async fn outbox_published(
        &self,
        _after: i64,
        _limit: usize,
    ) -> Result<Vec<PublishedOutbox>, StoreError> {
        Err(unsupported())
    }
}

#[path = "../../tests/support/saga_fixture.rs"]
mod fixture;
use fixture::*;

// ------------------------------------------------------------------ world --

struct World {
    store: MemStore,
    svc: Arc<Services>,
    def: SagaDefinition<Order>,
    orch: SagaOrchestrator<MemStore>,
}

fn world() -> World {
    let store = MemStore::default();
    let svc = Arc::new(Services::default());
    let def = seed_saga(&svc);
    let orch = orchestrator(&store, &def);
    World {
        store,
        svc,
        def,
        orch,
    }
}

fn orchestrator(store: &MemStore, def: &SagaDefinition<Order>) -> SagaOrchestrator<MemStore> {
    SagaOrchestrator::builder(store.clone())
        .saga(def)
        .lease_grace(Duration::ZERO)
        .poll_interval(Duration::from_millis(5))
        .build()
        .unwrap()
}

impl World {
    async fn start(&self, id: &str) {
        let mut tx = self.store.begin().await.unwrap();
        let order = order(id);
        assert!(
            self.orch
                .start(&mut tx, &self.def, id, &order)
                .await
                .unwrap()
        );
        assert!(
            !self
                .orch
                .start(&mut tx, &self.def, id, &order)
                .await
                .unwrap(),
            "starting the same saga twice is a no-op"
        );
        self.store.commit(tx).await.unwrap();
    }

    /// Drives the saga until it finishes or sticks, letting backoffs pass.
    async fn settle(&self, id: &str) -> SagaRecord {
        for _ in 0..200 {
            let record = self.orch.drive(id).await.unwrap();
            if record.status.is_terminal() || record.status == SagaStatus::Stuck {
                return record;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        panic!("saga {id} did not settle");
    }

    /// Drives the saga until it finishes or sticks, with every backoff,
    /// lease and `Retry-After` passed at once (the clock is paused, so
    /// step timeouts pass at once too).
    async fn settle_now(&self, id: &str) -> SagaRecord {
        for _ in 0..200 {
            let record = self.orch.drive(id).await.unwrap();
            if record.status.is_terminal() || record.status == SagaStatus::Stuck {
                return record;
            }
            self.store.expire_waits();
        }
        panic!("saga {id} did not settle");
    }
}

#[tokio::test]
async fn a_saga_runs_every_step_once_and_saves_each_result_with_the_next_claim() {
    let w = world();
    w.start("A-1").await;
    let done = w.settle("A-1").await;
    assert_eq!(done.status, SagaStatus::Completed);
    let all = [
        "capture_payment",
        "reserve_stock",
        "schedule_shipment",
        "send_receipt",
    ];
    assert_eq!(w.svc.effects(), keys("A-1", &all));
    assert_eq!(
        w.store.saves(),
        5,
        "a claim per step, each carrying the result before it, then the last result"
    );
    assert_eq!(done.version, 6);
    let order: Order = serde_json::from_value(done.data).unwrap();
    assert_eq!(order.payment_id.as_deref(), Some("pay-A-1"));
}

const ALL_STEPS: [&str; 4] = [
    "capture_payment",
    "reserve_stock",
    "schedule_shipment",
    "send_receipt",
];

impl World {
    /// Starts `id` with its first call claimed and commits; returns what
    /// to hand to the orchestrator.
    async fn start_claimed(&self, orch: &SagaOrchestrator<MemStore>, id: &str) -> StartedSaga {
        let mut tx = self.store.begin().await.unwrap();
        let started = orch
            .start_claimed(&mut tx, &self.def, id, &order(id))
            .await
            .unwrap();
        assert!(started.created());
        self.store.commit(tx).await.unwrap();
        started
    }
}

#[tokio::test]
async fn a_claimed_start_makes_its_first_call_after_the_commit_without_a_save_of_its_own() {
    let w = world();
    let orch = SagaOrchestrator::builder(w.store.clone())
        .saga(&w.def)
        .build()
        .unwrap();
    let started = w.start_claimed(&orch, "C-1").await;
    let stored = w.store.state.lock().sagas["C-1"].clone();
    assert_eq!((stored.attempts, stored.outcome_unknown), (1, true));
    assert!(
        stored.next_attempt_at > keel_core::clock::utc_now(),
        "leased"
    );
    assert_eq!(
        orch.tick().await.unwrap(),
        0,
        "not due: its claim is leased"
    );
    assert!(w.svc.effects().is_empty(), "no call before the hand-over");

    orch.committed(started);
    assert_eq!(orch.tick().await.unwrap(), 1);
    let done = orch.drive("C-1").await.unwrap();
    assert_eq!(done.status, SagaStatus::Completed);
    assert_eq!(w.svc.effects(), keys("C-1", &ALL_STEPS));
    assert_eq!(
        w.store.saves(),
        4,
        "the first claim rode in the insert: a claim per later step, then the last result"
    );
}

#[tokio::test]
async fn a_claimed_start_never_handed_over_runs_once_its_lease_ends() {
    let w = world();
    let orch = SagaOrchestrator::builder(w.store.clone())
        .saga(&w.def)
        .build()
        .unwrap();
    // The process stopped between the commit and the hand-over.
    drop(w.start_claimed(&orch, "C-2").await);
    assert_eq!(orch.tick().await.unwrap(), 0);
    w.store.expire_waits();
    let done = w.settle("C-2").await;
    assert_eq!(done.status, SagaStatus::Completed);
    assert_eq!(w.svc.effects(), keys("C-2", &ALL_STEPS), "each step once");
}

#[tokio::test]
async fn a_claimed_start_handed_over_too_late_for_its_lease_claims_anew() {
    // No lease grace: by the time the run loop takes it, a claim could not
    // cover the call, so the attempt it counted is given back.
    let w = world();
    let started = w.start_claimed(&w.orch, "C-3").await;
    w.orch.committed(started);
    assert_eq!(w.orch.tick().await.unwrap(), 1);
    let done = w.orch.drive("C-3").await.unwrap();
    assert_eq!(done.status, SagaStatus::Completed);
    assert_eq!(w.svc.effects(), keys("C-3", &ALL_STEPS));
    assert_eq!(w.store.saves(), 5, "the first step claimed again");
}

#[tokio::test]
async fn a_claimed_start_that_rolled_back_leaves_nothing_to_run() {
    let w = world();
    let mut tx = w.store.begin().await.unwrap();
    let started = w
        .orch
        .start_claimed(&mut tx, &w.def, "C-4", &order("C-4"))
        .await
        .unwrap();
    w.store.rollback(tx).await.unwrap();
    drop(started);
    assert_eq!(w.orch.tick().await.unwrap(), 0);
    assert!(w.store.state.lock().sagas.is_empty());
    assert!(w.svc.effects().is_empty());
}

#[tokio::test]
async fn a_failure_before_the_pivot_undoes_completed_steps_in_reverse() {
    let w = world();
    w.svc.set("schedule_shipment", Behaviour::Refuse);
    w.start("A-2").await;
    let done = w.settle("A-2").await;
    assert_eq!(done.status, SagaStatus::Compensated);
    assert!(
        done.last_error
            .unwrap()
            .contains("schedule_shipment refused")
    );
    assert_eq!(
        w.svc.effects(),
        keys(
            "A-2",
            &[
                "capture_payment",
                "reserve_stock",
                "undo:reserve_stock",
                "undo:capture_payment"
            ]
        )
    );
    use SagaStatus::{Compensated, Compensating, Running};
    assert_eq!(
        w.store.saved_statuses(),
        [
            Running,
            Running,
            Running,
            Compensating,
            Compensating,
            Compensating,
            Compensated
        ],
        "each change of status in a save of its own (hooks see every one), \
         each other result with the next claim"
    );
}

#[tokio::test]
async fn transient_failures_are_retried_with_the_same_key() {
    let w = world();
    w.svc.set("reserve_stock", Behaviour::FailTimes(1));
    w.start("A-3").await;
    assert_eq!(w.settle("A-3").await.status, SagaStatus::Completed);
    let calls = w.svc.calls();
    assert_eq!(
        calls.iter().filter(|k| *k == "A-3:reserve_stock").count(),
        2,
        "{calls:?}"
    );
}

#[tokio::test]
async fn after_the_pivot_it_retries_forward_past_any_count_then_sticks_until_an_operator_retries() {
    // Forward recovery is bounded by time, not by `stuck_after` (3 here).
    let w = world();
    w.svc.set("send_receipt", Behaviour::FailTimes(5));
    w.start("A-4a").await;
    assert_eq!(w.settle("A-4a").await.status, SagaStatus::Completed);
    let receipts = |id: &str| {
        let key = format!("{id}:send_receipt");
        w.svc.calls().iter().filter(|k| **k == key).count()
    };
    assert_eq!(receipts("A-4a"), 6, "the same key, until it worked");

    // With its budget spent, it is stuck for an operator.
    let def = seed_saga_with(&w.svc, Duration::from_millis(1), Duration::ZERO);
    let w = World {
        orch: orchestrator(&w.store, &def),
        def,
        ..w
    };
    w.svc.set("send_receipt", Behaviour::FailTimes(100));
    w.start("A-4").await;
    let stuck = w.settle("A-4").await;
    assert_eq!((stuck.status, stuck.step), (SagaStatus::Stuck, 3));
    assert!(
        stuck
            .last_error
            .as_deref()
            .unwrap()
            .contains("gave up going forward")
    );
    assert_eq!(
        w.svc
            .calls()
            .iter()
            .filter(|k| *k == "A-4:send_receipt")
            .count(),
        1
    );
    let views = w
        .orch
        .list(&SagaFilter {
            status: Some(SagaStatus::Stuck),
            ..SagaFilter::default()
        })
        .await
        .unwrap();
    assert_eq!(views.len(), 1);
    assert_eq!(views[0].step_name.as_deref(), Some("send_receipt"));
    assert!(
        views[0]
            .record
            .last_error
            .as_ref()
            .unwrap()
            .contains("unavailable")
    );

    let err = w.orch.cancel("A-4").await.unwrap_err();
    assert!(matches!(err, SagaError::PastPivot { .. }), "{err}");
    assert!(err.to_string().contains("schedule_shipment"));

    w.svc.clear("send_receipt");
    let retried = w.orch.retry("A-4").await.unwrap();
    assert_eq!(retried.status, SagaStatus::Running);
    assert_eq!(w.settle("A-4").await.status, SagaStatus::Completed);
    assert!(matches!(
        w.orch.retry("A-4").await,
        Err(SagaError::NotStuck { .. })
    ));
}

#[tokio::test]
async fn a_step_that_times_out_counts_as_failed_and_may_have_happened_so_is_undone() {
    let w = world();
    w.svc.set("reserve_stock", Behaviour::Hang);
    w.start("A-5").await;
    let done = w.settle("A-5").await;
    assert_eq!(done.status, SagaStatus::Compensated);
    let timed_out = format!("timed out after {}ms", STEP_TIMEOUT.as_millis());
    assert!(done.last_error.unwrap().contains(&timed_out));
    let effects = w.svc.effects();
    assert!(
        effects.contains(&"A-5:undo:reserve_stock".to_owned()),
        "{effects:?}"
    );
    assert!(effects.contains(&"A-5:undo:capture_payment".to_owned()));
}

// Real time: the saga's deadline is wall-clock time, like its rows.
#[tokio::test]
async fn the_whole_saga_deadline_cuts_step_timeouts_stops_calling_and_compensates() {
    let w = world();
    let def = SagaDefinition::builder("order_fulfilment")
        .step(compensable(&w.svc, "capture_payment"))
        // Attempts enough that only the deadline can stop them.
        .step(compensable(&w.svc, "reserve_stock").max_attempts(5))
        .pivot(step(&w.svc, "schedule_shipment"))
        .deadline(Duration::from_millis(300))
        .build()
        .unwrap();
    let w = World {
        orch: orchestrator(&w.store, &def),
        def,
        ..w
    };
    w.svc.set("reserve_stock", Behaviour::Hang);
    w.start("A-D").await;
    let done = w.settle("A-D").await;
    assert_eq!(done.status, SagaStatus::Compensated);
    let reason = done.last_error.unwrap();
    assert!(
        reason.contains("saga deadline of 300ms passed at step `reserve_stock`"),
        "{reason}"
    );
    let calls = w.svc.calls();
    let attempts = calls.iter().filter(|k| *k == "A-D:reserve_stock").count();
    // A 200 ms attempt, then (on a machine not too loaded to start it within
    // 250 ms) one cut to the time left; never the third its 3 attempts allow.
    assert!((1..=2).contains(&attempts), "{calls:?}");
    assert_eq!(
        w.svc.effects(),
        keys(
            "A-D",
            &[
                "capture_payment",
                "undo:reserve_stock",
                "undo:capture_payment"
            ]
        ),
        "the step that may have happened is undone too"
    );
}

#[tokio::test(start_paused = true)]
async fn a_pivot_that_timed_out_after_shipping_then_met_two_breaker_refusals_completes() {
    let w = world();
    let open = Reply::BreakerOpen {
        retry_after: Duration::from_secs(30),
    };
    w.svc
        .script("schedule_shipment", &[Reply::ApplyThenHang, open, open]);
    w.start("B-1").await;
    let done = w.settle_now("B-1").await;
    assert_eq!(done.status, SagaStatus::Completed, "{:?}", done.last_error);
    assert_eq!(
        w.svc.effects(),
        keys(
            "B-1",
            &[
                "capture_payment",
                "reserve_stock",
                "schedule_shipment",
                "send_receipt"
            ]
        ),
        "shipped once, nothing refunded or released"
    );
    let calls = w.svc.calls();
    assert_eq!(
        calls
            .iter()
            .filter(|k| *k == "B-1:schedule_shipment")
            .count(),
        4,
        "the same key each time: {calls:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_refusal_waits_its_retry_after_and_does_not_use_an_attempt() {
    let w = world();
    let open = Reply::BreakerOpen {
        retry_after: Duration::from_secs(30),
    };
    w.svc.script("capture_payment", &[open]);
    w.start("B-2").await;
    let before = keel_core::clock::utc_now();
    let waiting = w.orch.drive("B-2").await.unwrap();
    assert_eq!((waiting.status, waiting.step), (SagaStatus::Running, 0));
    assert_eq!(waiting.attempts, 0, "the call never left");
    let wait = waiting.next_attempt_at - before;
    assert!(
        wait >= chrono::TimeDelta::seconds(29) && wait <= chrono::TimeDelta::seconds(31),
        "waits the breaker's Retry-After: {wait:?}"
    );
    assert!(
        waiting
            .last_error
            .as_deref()
            .unwrap()
            .contains("refused before it was sent")
    );
}

#[tokio::test(start_paused = true)]
async fn a_step_with_three_attempts_survives_five_refusals_then_succeeds() {
    let w = world();
    let def = SagaDefinition::<Order>::builder("order_fulfilment")
        .step(compensable(&w.svc, "capture_payment").max_attempts(3))
        .pivot(step(&w.svc, "schedule_shipment"))
        .build()
        .unwrap();
    let w = World {
        orch: orchestrator(&w.store, &def),
        def,
        ..w
    };
    let open = Reply::BreakerOpen {
        retry_after: Duration::ZERO,
    };
    w.svc.script("capture_payment", &[open; 5]);
    w.start("B-3").await;
    let done = w.settle_now("B-3").await;
    assert_eq!(done.status, SagaStatus::Completed, "{:?}", done.last_error);
    assert_eq!(
        w.svc.effects(),
        keys("B-3", &["capture_payment", "schedule_shipment"])
    );
}

#[tokio::test(start_paused = true)]
async fn a_capture_that_committed_but_timed_out_then_failed_is_refunded() {
    let w = world();
    // Attempt 1 charges the card and its reply is lost; attempt 2 (the
    // last of two) meets a 503. The last attempt says "not done"; the
    // first may have charged.
    w.svc.script(
        "capture_payment",
        &[Reply::ApplyThenHang, Reply::Unavailable],
    );
    w.start("B-4").await;
    let done = w.settle_now("B-4").await;
    assert_eq!(
        done.status,
        SagaStatus::Compensated,
        "{:?}",
        done.last_error
    );
    assert_eq!(
        w.svc.effects(),
        keys("B-4", &["capture_payment", "undo:capture_payment"]),
        "refunded"
    );

    // And with a permanent error last.
    w.svc
        .script("capture_payment", &[Reply::ApplyThenHang, Reply::Permanent]);
    w.start("B-5").await;
    let done = w.settle_now("B-5").await;
    assert_eq!(done.status, SagaStatus::Compensated);
    assert!(
        w.svc
            .effects()
            .contains(&"B-5:undo:capture_payment".to_owned())
    );
}

#[tokio::test(start_paused = true)]
async fn an_action_that_arrives_after_its_compensation_is_refused_by_the_tombstone() {
    let w = world();
    // The capture request is held up in the network (nothing done yet),
    // the next attempt meets a 503, and the saga gives up: the capture may
    // have happened, so it is refunded. There is nothing to refund, but
    // the refund tombstones the capture's key.
    w.svc
        .script("capture_payment", &[Reply::Lost, Reply::Unavailable]);
    w.start("B-6").await;
    let done = w.settle_now("B-6").await;
    assert_eq!(
        done.status,
        SagaStatus::Compensated,
        "{:?}",
        done.last_error
    );
    assert_eq!(w.svc.effects(), keys("B-6", &["undo:capture_payment"]));
    // The held-up request arrives after its undo: refused, so no charge
    // is left standing without its refund.
    let late = w.svc.call("capture_payment", "B-6:capture_payment").await;
    assert!(late.unwrap_err().to_string().contains("was undone"));
    assert_eq!(w.svc.effects(), keys("B-6", &["undo:capture_payment"]));
}

#[tokio::test]
async fn cancel_before_the_pivot_compensates_and_ends_cancelled() {
    let w = world();
    // A long backoff, so the saga is waiting when the operator cancels.
    let def = seed_saga_with(&w.svc, Duration::from_secs(60), DEFAULT_FORWARD_BUDGET);
    let w = World {
        orch: orchestrator(&w.store, &def),
        def,
        ..w
    };
    w.svc.set("reserve_stock", Behaviour::FailTimes(1));
    w.start("A-6").await;
    // Capture succeeds; reserve fails once and waits for its backoff.
    let record = w.orch.drive("A-6").await.unwrap();
    assert_eq!((record.status, record.step), (SagaStatus::Running, 1));
    let cancelled = w.orch.cancel("A-6").await.unwrap();
    assert_eq!(cancelled.status, SagaStatus::Compensating);
    w.store.expire_waits();
    let done = w.settle("A-6").await;
    assert_eq!(done.status, SagaStatus::Cancelled);
    assert!(
        done.last_error
            .unwrap()
            .starts_with("cancelled by operator")
    );
    assert!(
        w.svc
            .effects()
            .contains(&"A-6:undo:capture_payment".to_owned())
    );
    assert!(matches!(
        w.orch.cancel("A-6").await,
        Err(SagaError::Finished { .. })
    ));
    let counts = w.orch.counts().await.unwrap();
    assert_eq!(counts, vec![(SagaStatus::Cancelled, 1)]);
}

#[tokio::test]
async fn unknown_kinds_and_ids_are_clear_errors() {
    let w = world();
    let other = SagaDefinition::<Order>::builder("other")
        .step(step(&w.svc, "x"))
        .build()
        .unwrap();
    let mut tx = w.store.begin().await.unwrap();
    let order = order("x");
    let err = w
        .orch
        .start(&mut tx, &other, "x", &order)
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("OrchestratorBuilder::saga"),
        "{err}"
    );
    assert!(matches!(
        w.orch.retry("nope").await,
        Err(SagaError::NotFound { .. })
    ));
    let dup = SagaOrchestrator::builder(w.store.clone())
        .saga(&w.def)
        .saga(&w.def)
        .build();
    assert!(matches!(dup, Err(SagaError::DuplicateKind { .. })));
}

/// Crash at every save (before it is written, and after it is written but
/// before the orchestrator hears back), then resume with a fresh
/// orchestrator: the saga ends in the same state, every effect happened
/// exactly once, and a repeated call reused its key.
#[cfg(feature = "failpoints")]
#[tokio::test]
async fn failpoints_between_call_and_save_resume_without_double_effects() {
    let scenario = fail::FailScenario::setup();
    for (failpoint, failing) in [
        ("keel-saga-after-claim", false),
        ("keel-saga-after-step", false),
        ("keel-saga-after-compensation", true),
    ] {
        let w = world();
        if failing {
            w.svc.set("reserve_stock", Behaviour::Refuse);
        }
        let id = format!("fp-{failpoint}");
        w.start(&id).await;
        fail::cfg(failpoint, &format!("return({id})")).unwrap();
        let err = w.orch.drive(&id).await.unwrap_err();
        assert!(
            matches!(err, SagaError::Crashed(name) if name == failpoint),
            "{err}"
        );
        fail::remove(failpoint);
        w.store.expire_waits();
        let done = w.settle(&id).await;
        let expected = if failing {
            SagaStatus::Compensated
        } else {
            SagaStatus::Completed
        };
        assert_eq!(done.status, expected, "{failpoint}");
        let effects = w.svc.effects();
        let mut unique = effects.clone();
        unique.dedup();
        assert_eq!(effects, unique, "{failpoint}: every effect once");
    }
    scenario.teardown();
}

// ------------------------------------------------------------ choreography --

mod choreography_tests {
    use super::*;
    use crate::envelope::{Envelope, EventMeta};
    use crate::outbox::Outbox;
    use crate::saga::choreography::{CAUSATION_ID, CORRELATION_ID, Next, reaction};

    #[tokio::test]
    async fn a_reaction_emits_the_next_event_in_the_same_transaction_with_a_derived_id() {
        let store = MemStore::default();
        let reserve = reaction(
            Outbox::new(store.clone()),
            "/services/inventory",
            "stock",
            |_tx: &mut MemTx, placed: OrderPlaced, _env| {
                Box::pin(async move {
                    Ok(Some(Next::new(
                        StockReserved {
                            order_id: placed.order_id,
                        },
                        2,
                    )))
                })
            },
        );
        let mut cause = Envelope::from_event(
            "/services/orders",
            &OrderPlaced {
                order_id: "A-4471".into(),
            },
            EventMeta::new(1),
        )
        .unwrap();
        cause.traceparent =
            Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".to_owned());

        let mut tx = store.begin().await.unwrap();
        let next = reserve.react(&mut tx, &cause).await.unwrap().unwrap();
        assert!(
            store.state.lock().outbox.is_empty(),
            "nothing before commit"
        );
        store.commit(tx).await.unwrap();

        assert_eq!(next.id, format!("{}:shop.stock.reserved.v1", cause.id));
        assert_eq!(next.subject.as_deref(), Some("A-4471"));
        assert_eq!(next.extensions[CAUSATION_ID], cause.id.as_str());
        assert_eq!(next.extensions[CORRELATION_ID], cause.id.as_str());
        let trace = next.trace_parent().unwrap();
        assert_eq!(trace.trace_id(), cause.trace_parent().unwrap().trace_id());
        let outbox = store.state.lock().outbox.clone();
        assert_eq!(outbox.len(), 1);
        assert_eq!(outbox[0].event_id, next.id);
        assert_eq!(outbox[0].topic, "stock");
        assert_eq!(outbox[0].partition_key, "A-4471");

        // The same cause again (a redelivery) derives the same id.
        let mut tx = store.begin().await.unwrap();
        let again = reserve.react(&mut tx, &cause).await.unwrap().unwrap();
        assert_eq!(again.id, next.id);

        // Another event type is refused, not skipped.
        let mut wrong = cause.clone();
        wrong.ty = "shop.order.cancelled.v1".into();
        let err = reserve.react(&mut tx, &wrong).await.unwrap_err();
        assert!(err.is_malformed(), "{err}");
    }
}
