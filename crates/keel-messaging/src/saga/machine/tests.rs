use std::collections::BTreeSet;

use keel_policy::retry::Jitter;
use proptest::prelude::*;
use serde_json::json;

use super::*;

const GRACE: Duration = Duration::from_secs(1);

/// Seed 000's saga: capture_payment, reserve_stock, schedule_shipment (the
/// pivot), send_receipt.
fn seed_shape() -> Shape {
    let step = |name: &str, compensable| StepShape {
        name: name.into(),
        timeout: Duration::from_secs(5),
        max_attempts: 3,
        compensable,
    };
    Shape {
        steps: vec![
            step("capture_payment", true),
            step("reserve_stock", true),
            step("schedule_shipment", false),
            step("send_receipt", false),
        ],
        pivot: Some(2),
        stuck_after: 4,
        backoff: Backoff::exponential(Duration::from_secs(1), 2.0, Duration::from_secs(10))
            .unwrap()
            .with_jitter(Jitter::None)
            .unwrap(),
    }
}

fn t0() -> DateTime<Utc> {
    DateTime::parse_from_rfc3339("2026-09-16T10:31:02Z")
        .unwrap()
        .with_timezone(&Utc)
}

fn new_saga() -> SagaRecord {
    SagaRecord {
        id: "A-4471".into(),
        kind: "order".into(),
        status: SagaStatus::Running,
        step: 0,
        data: json!({}),
        attempts: 0,
        last_error: None,
        next_attempt_at: t0(),
        created_at: t0(),
        updated_at: t0(),
        version: 1,
    }
}

fn claim(record: &SagaRecord, shape: &Shape) -> (Call, SagaRecord) {
    match plan(
        record,
        shape,
        record.next_attempt_at.max(record.updated_at),
        GRACE,
    ) {
        Plan::Call { call, claimed } => (call, claimed),
        other => panic!("expected a call, got {other:?}"),
    }
}

fn run(record: &SagaRecord, shape: &Shape, outcome: Outcome) -> (Call, SagaRecord) {
    let (call, claimed) = claim(record, shape);
    let now = claimed.updated_at;
    (call, decide(&claimed, shape, call, outcome, now))
}

fn ok() -> Outcome {
    Outcome::Done(json!({}))
}

fn failed(class: ErrorClass) -> Outcome {
    Outcome::Failed {
        class,
        error: "boom".into(),
    }
}

#[test]
fn the_happy_path_runs_every_step_with_derived_keys_and_bumps_the_version_each_time() {
    let shape = seed_shape();
    let mut record = new_saga();
    let mut keys = Vec::new();
    while record.status == SagaStatus::Running {
        let (call, claimed) = claim(&record, &shape);
        assert_eq!(claimed.version, record.version + 1, "the claim is a save");
        assert_eq!(claimed.attempts, 1);
        assert_eq!(
            claimed.next_attempt_at,
            claimed.updated_at + TimeDelta::seconds(6),
            "leased for timeout + grace"
        );
        keys.push(call.idempotency_key(&record.id, &shape));
        let next = decide(&claimed, &shape, call, ok(), claimed.updated_at);
        assert_eq!(
            next.version,
            claimed.version + 1,
            "persisted after every step"
        );
        record = next;
    }
    assert_eq!(record.status, SagaStatus::Completed);
    assert_eq!(
        keys,
        [
            "A-4471:capture_payment",
            "A-4471:reserve_stock",
            "A-4471:schedule_shipment",
            "A-4471:send_receipt"
        ]
    );
    assert_eq!(plan(&record, &shape, t0(), GRACE), Plan::Idle);
}

#[test]
fn a_step_before_the_pivot_is_retried_then_completed_steps_are_undone_in_reverse() {
    let shape = seed_shape();
    let (_, mut record) = run(&new_saga(), &shape, ok()); // capture_payment
    for attempt in 1..=3 {
        let (call, next) = run(&record, &shape, failed(ErrorClass::Retryable));
        assert_eq!(call, Call::Action(1));
        record = next;
        if attempt < 3 {
            assert_eq!(record.status, SagaStatus::Running);
            let backoff = TimeDelta::seconds(1 << (attempt - 1));
            assert_eq!(record.next_attempt_at, record.updated_at + backoff);
        }
    }
    assert_eq!(record.status, SagaStatus::Compensating);
    assert_eq!(
        record.step, 1,
        "reserve_stock never took effect: only capture is undone"
    );
    let (call, record) = run(&record, &shape, ok());
    assert_eq!(call, Call::Compensation(0));
    assert_eq!(
        call.idempotency_key("A-4471", &shape),
        "A-4471:undo:capture_payment"
    );
    assert_eq!(record.status, SagaStatus::Compensated);
    assert!(record.last_error.unwrap().contains("reserve_stock"));
}

#[test]
fn a_permanent_error_compensates_at_once_and_an_unknown_outcome_is_undone_too() {
    let shape = seed_shape();
    let (_, paid) = run(&new_saga(), &shape, ok());
    let (_, record) = run(&paid, &shape, failed(ErrorClass::Permanent));
    assert_eq!((record.status, record.step), (SagaStatus::Compensating, 1));

    let mut record = paid;
    for _ in 0..3 {
        record = run(&record, &shape, failed(ErrorClass::OutcomeUnknown)).1;
    }
    assert_eq!(record.status, SagaStatus::Compensating);
    let (first_undo, record) = run(&record, &shape, ok());
    assert_eq!(
        first_undo,
        Call::Compensation(1),
        "the reservation may exist: release it"
    );
    let (second_undo, record) = run(&record, &shape, ok());
    assert_eq!(second_undo, Call::Compensation(0));
    assert_eq!(record.status, SagaStatus::Compensated);
}

#[test]
fn after_the_pivot_the_saga_retries_forward_with_backoff_then_is_stuck_until_retried() {
    let shape = seed_shape();
    let mut record = new_saga();
    for _ in 0..3 {
        record = run(&record, &shape, ok()).1;
    }
    assert_eq!(record.step, 3);
    let mut delays = Vec::new();
    for _ in 0..shape.stuck_after {
        record = run(&record, &shape, failed(ErrorClass::Permanent)).1;
        delays.push((record.next_attempt_at - record.updated_at).num_seconds());
    }
    assert_eq!(delays[..3], [1, 2, 4], "backoff");
    assert!(
        delays[3] > 365 * 24 * 3600,
        "stuck: parked until an operator acts"
    );
    assert_eq!((record.status, record.step), (SagaStatus::Stuck, 3));
    assert_eq!(
        plan(&record, &shape, t0() + TimeDelta::days(1), GRACE),
        Plan::Idle
    );
    assert!(matches!(
        cancel(&record, &shape, t0()),
        Err(SagaError::PastPivot { .. })
    ));

    let retried = retry(&record, &shape, record.updated_at).unwrap();
    assert_eq!(
        (retried.status, retried.step, retried.attempts),
        (SagaStatus::Running, 3, 0)
    );
    let (call, done) = run(&retried, &shape, ok());
    assert_eq!(call, Call::Action(3));
    assert_eq!(done.status, SagaStatus::Completed);
}

#[test]
fn a_pivot_of_unknown_outcome_is_stuck_not_compensated() {
    let shape = seed_shape();
    let mut record = new_saga();
    for _ in 0..2 {
        record = run(&record, &shape, ok()).1;
    }
    for _ in 0..3 {
        record = run(&record, &shape, failed(ErrorClass::OutcomeUnknown)).1;
    }
    assert_eq!((record.status, record.step), (SagaStatus::Stuck, 2));
    let retried = retry(&record, &shape, t0()).unwrap();
    assert_eq!((retried.status, retried.step), (SagaStatus::Running, 2));
}

#[test]
fn a_failing_compensation_is_stuck_and_a_retry_resumes_compensating() {
    let shape = seed_shape();
    let mut record = new_saga();
    record = run(&record, &shape, ok()).1;
    record = run(&record, &shape, ok()).1;
    record = run(&record, &shape, failed(ErrorClass::Permanent)).1; // the pivot refuses
    assert_eq!((record.status, record.step), (SagaStatus::Compensating, 2));
    record = run(&record, &shape, ok()).1; // release stock
    for _ in 0..shape.stuck_after {
        let (call, next) = run(&record, &shape, failed(ErrorClass::Retryable));
        assert_eq!(call, Call::Compensation(0));
        record = next;
    }
    assert_eq!((record.status, record.step), (SagaStatus::Stuck, 0));
    let retried = retry(&record, &shape, t0()).unwrap();
    assert_eq!(
        (retried.status, retried.step),
        (SagaStatus::Compensating, 1)
    );
    let (call, done) = run(&retried, &shape, ok());
    assert_eq!(call, Call::Compensation(0));
    assert_eq!(done.status, SagaStatus::Compensated);
}

#[test]
fn a_step_that_crashes_the_orchestrator_every_time_runs_out_of_attempts() {
    let shape = seed_shape();
    let paid = run(&new_saga(), &shape, ok()).1;
    let mut record = paid;
    for _ in 0..3 {
        // Claimed and saved, then the process dies: only the claim persists.
        record = claim(&record, &shape).1;
    }
    let now = record.next_attempt_at;
    let Plan::Save(next) = plan(&record, &shape, now, GRACE) else {
        panic!("expected the saga to give up on the step");
    };
    assert_eq!(next.status, SagaStatus::Compensating);
    assert_eq!(
        next.step, 2,
        "the crashed step may have happened: it is undone too"
    );
    assert!(
        next.last_error
            .unwrap()
            .contains("no outcome recorded for 3 attempts")
    );
}

#[test]
fn cancel_before_the_pivot_compensates_and_ends_cancelled() {
    let shape = seed_shape();
    let fresh = new_saga();
    let cancelled = cancel(&fresh, &shape, t0()).unwrap().unwrap();
    assert_eq!(cancelled.status, SagaStatus::Cancelled, "nothing to undo");

    let paid = run(&fresh, &shape, ok()).1;
    let record = cancel(&paid, &shape, t0()).unwrap().unwrap();
    assert_eq!((record.status, record.step), (SagaStatus::Compensating, 1));
    assert_eq!(
        cancel(&record, &shape, t0()).unwrap(),
        None,
        "already cancelling"
    );
    let (_, record) = run(&record, &shape, failed(ErrorClass::Retryable));
    assert!(
        cancel_requested(&record),
        "the marker survives errors: {:?}",
        record.last_error
    );
    let (_, record) = run(&record, &shape, ok());
    assert_eq!(record.status, SagaStatus::Cancelled);
    assert!(matches!(
        cancel(&record, &shape, t0()),
        Err(SagaError::Finished { .. })
    ));
}

#[test]
fn cancel_during_an_attempt_undoes_that_step_too_but_only_after_its_lease() {
    let shape = seed_shape();
    let paid = run(&new_saga(), &shape, ok()).1;
    let (_, claimed) = claim(&paid, &shape); // reserve_stock in flight
    let record = cancel(&claimed, &shape, claimed.updated_at)
        .unwrap()
        .unwrap();
    assert_eq!((record.status, record.step), (SagaStatus::Compensating, 2));
    assert_eq!(record.next_attempt_at, claimed.next_attempt_at);

    // Once the pivot has been attempted, it is too late.
    let mut at_pivot = paid;
    at_pivot = run(&at_pivot, &shape, ok()).1;
    assert!(
        cancel(&at_pivot, &shape, t0()).is_ok(),
        "pivot not attempted yet"
    );
    let (_, pivot_claimed) = claim(&at_pivot, &shape);
    let err = cancel(&pivot_claimed, &shape, t0()).unwrap_err();
    assert!(err.to_string().contains("schedule_shipment"), "{err}");
}

// ---------------------------------------------------------------------------
// Property: whatever happens, every saga ends completed, fully compensated,
// or visibly stuck, and the effects agree with its status.
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
enum Fate {
    Ok,
    Retryable,
    Permanent,
    /// A timeout: the call may or may not have taken effect.
    Unknown {
        happened: bool,
    },
    /// The orchestrator dies after the claim was saved.
    Crash {
        happened: bool,
    },
    /// An operator cancels while this call runs; the call's own save then
    /// loses (version conflict).
    CancelDuring {
        happened: bool,
    },
}

fn fate() -> impl Strategy<Value = Fate> {
    prop_oneof![
        6 => Just(Fate::Ok),
        2 => Just(Fate::Retryable),
        1 => Just(Fate::Permanent),
        1 => any::<bool>().prop_map(|happened| Fate::Unknown { happened }),
        1 => any::<bool>().prop_map(|happened| Fate::Crash { happened }),
        1 => any::<bool>().prop_map(|happened| Fate::CancelDuring { happened }),
    ]
}

#[derive(Debug, Default)]
struct Ledger {
    /// Actions that took effect (services dedupe on the idempotency key).
    done: BTreeSet<usize>,
    /// Compensations that took effect.
    undone: BTreeSet<usize>,
    /// Every call, in order.
    calls: Vec<Call>,
}

fn simulate(shape: &Shape, fates: &[Fate]) -> (SagaRecord, Ledger) {
    let mut record = new_saga();
    let mut now = t0();
    let mut ledger = Ledger::default();
    let mut fates = fates.iter().copied();
    for _ in 0..10_000 {
        now = now.max(record.next_attempt_at);
        let (call, claimed) = match plan(&record, shape, now, GRACE) {
            Plan::Idle => return (record, ledger),
            Plan::Save(next) => {
                assert_eq!(next.version, record.version + 1);
                record = next;
                continue;
            }
            Plan::Call { call, claimed } => (call, claimed),
        };
        assert_eq!(claimed.version, record.version + 1);
        record = claimed.clone();
        ledger.calls.push(call);
        let fate = fates.next().unwrap_or(Fate::Ok);
        // An idempotent service that already did the work under this key
        // answers with the stored result.
        let (already, happened) = match (call, fate) {
            (Call::Action(i), _) if ledger.done.contains(&i) => (true, true),
            (Call::Compensation(j), _) if ledger.undone.contains(&j) => (true, true),
            (_, Fate::Ok) => (false, true),
            (
                _,
                Fate::Unknown { happened }
                | Fate::Crash { happened }
                | Fate::CancelDuring { happened },
            ) => (false, happened),
            _ => (false, false),
        };
        if happened {
            match call {
                Call::Action(i) => ledger.done.insert(i),
                Call::Compensation(j) => ledger.undone.insert(j),
            };
        }
        let outcome = match fate {
            Fate::Crash { .. } => continue,
            Fate::CancelDuring { .. } => {
                if let Ok(Some(cancelled)) = cancel(&claimed, shape, now) {
                    record = cancelled;
                    continue; // the worker's save of its outcome conflicts
                }
                // Refused or already cancelling: the call ends as it went.
                if happened {
                    ok()
                } else {
                    failed(ErrorClass::Retryable)
                }
            }
            Fate::Unknown { .. } => failed(ErrorClass::OutcomeUnknown),
            _ if already => ok(),
            Fate::Ok => ok(),
            Fate::Retryable => failed(ErrorClass::Retryable),
            Fate::Permanent => failed(ErrorClass::Permanent),
        };
        let next = decide(&claimed, shape, call, outcome, now);
        assert_eq!(next.version, claimed.version + 1);
        record = next;
        now += TimeDelta::milliseconds(1);
    }
    panic!("the saga did not settle: {record:?}");
}

proptest! {
    #[test]
    fn every_saga_ends_completed_compensated_or_visibly_stuck(
        fates in proptest::collection::vec(fate(), 0..60)
    ) {
        let shape = seed_shape();
        let pivot = shape.pivot.unwrap();
        let (record, ledger) = simulate(&shape, &fates);
        match record.status {
            SagaStatus::Completed => {
                prop_assert_eq!(ledger.done.len(), shape.steps.len());
                prop_assert!(ledger.undone.is_empty());
            }
            SagaStatus::Compensated | SagaStatus::Cancelled => {
                // Every compensable step that took effect was undone, and
                // nothing at or past the pivot ever took effect.
                for i in &ledger.done {
                    prop_assert!(*i < pivot, "step {} done, yet compensated", i);
                    prop_assert!(ledger.undone.contains(i), "step {} not undone", i);
                }
                prop_assert_eq!(
                    record.status == SagaStatus::Cancelled,
                    cancel_requested(&record)
                );
            }
            SagaStatus::Stuck => {
                prop_assert!(record.last_error.is_some(), "a stuck saga says why");
            }
            other => prop_assert!(false, "saga left {:?}", other),
        }
        // Compensation only runs backwards, never past the pivot, and the
        // saga never goes forward again once it started undoing.
        let first_undo = ledger.calls.iter().position(|c| matches!(c, Call::Compensation(_)));
        if let Some(first) = first_undo {
            let undos: Vec<usize> = ledger.calls[first..]
                .iter()
                .map(|c| match c {
                    Call::Compensation(j) => Ok(*j),
                    Call::Action(i) => Err(*i),
                })
                .collect::<Result<_, _>>()
                .map_err(|i| TestCaseError::fail(format!("action {i} after compensation began")))?;
            prop_assert!(undos.windows(2).all(|w| w[1] <= w[0]), "undo order {:?}", undos);
            prop_assert!(undos.iter().all(|j| *j < pivot));
        }
    }
}
