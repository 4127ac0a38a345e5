use std::collections::BTreeSet;

use keel_policy::retry::Jitter;
use proptest::prelude::*;
use serde_json::json;

use super::*;
use crate::saga::SagaError;

mod compensation;

const GRACE: Duration = Duration::from_secs(1);

/// The order saga: capture_payment, reserve_stock, schedule_shipment (the
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
        forward_budget: FORWARD_BUDGET,
        refusal_wait: Duration::from_secs(3),
        deadline: None,
    }
}

/// The order saga's forward budget.
const FORWARD_BUDGET: Duration = Duration::from_secs(30);

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
        outcome_unknown: false,
        first_attempt_at: None,
        last_error: None,
        next_attempt_at: t0(),
        created_at: t0(),
        updated_at: t0(),
        version: 1,
        traceparent: None,
    }
}

fn claim(record: &SagaRecord, shape: &Shape) -> Claim {
    match plan(
        record,
        shape,
        record.next_attempt_at.max(record.updated_at),
        GRACE,
    ) {
        Plan::Call(claim) => claim,
        other => panic!("expected a call, got {other:?}"),
    }
}

fn run(record: &SagaRecord, shape: &Shape, outcome: Outcome) -> (Call, SagaRecord) {
    let claim = claim(record, shape);
    let now = claim.record.updated_at;
    (claim.call, decide(&claim, shape, outcome, now))
}

fn ok() -> Outcome {
    Outcome::Done(json!({}))
}

fn failed(class: ErrorClass) -> Outcome {
    Outcome::Failed {
        class,
        error: "boom".into(),
        retry_after: None,
    }
}

/// A breaker's refusal: the call never left.
fn refused(retry_after: Option<Duration>) -> Outcome {
    Outcome::Failed {
        class: ErrorClass::Rejected,
        error: "circuit breaker `payments` is open".into(),
        retry_after,
    }
}

#[test]
fn the_happy_path_runs_every_step_with_derived_keys_and_bumps_the_version_each_time() {
    let shape = seed_shape();
    let mut record = new_saga();
    let mut keys = Vec::new();
    while record.status == SagaStatus::Running {
        let claim = claim(&record, &shape);
        let (call, claimed) = (claim.call, claim.record.clone());
        assert_eq!(claimed.version, record.version + 1, "the claim is a save");
        assert_eq!(claimed.attempts, 1);
        assert_eq!(
            claimed.next_attempt_at,
            claimed.updated_at + TimeDelta::seconds(6),
            "leased for timeout + grace"
        );
        keys.push(call.idempotency_key(&record.id, &shape));
        let next = decide(&claim, &shape, ok(), claimed.updated_at);
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

/// The order saga with a whole-saga deadline of 20 s.
fn shape_with_deadline() -> Shape {
    Shape {
        deadline: Some(Duration::from_secs(20)),
        ..seed_shape()
    }
}

#[test]
fn the_saga_deadline_counts_elapsed_time_not_steps_and_compensates_before_the_pivot() {
    let shape = shape_with_deadline();
    let (_, record) = run(&new_saga(), &shape, ok()); // capture_payment
    // Each step is within its own 5 s timeout; together they are too slow.
    let mut slow = record.clone();
    slow.next_attempt_at = t0() + TimeDelta::seconds(18);
    let claim = claim(&slow, &shape);
    assert_eq!(claim.call, Call::Action(1));
    assert_eq!(
        claim.record.next_attempt_at,
        t0() + TimeDelta::seconds(20) + delta(GRACE),
        "the call's lease ends at the deadline: its timeout is cut to the 2 s left"
    );
    assert_eq!(
        call_timeout(
            &slow,
            &shape,
            Call::Action(1),
            t0() + TimeDelta::seconds(18)
        ),
        Duration::from_secs(2)
    );
    // The attempt fails retryably; its backoff would end after the deadline.
    let retry = decide(
        &claim,
        &shape,
        failed(ErrorClass::Retryable),
        t0() + TimeDelta::seconds(19) + TimeDelta::milliseconds(900),
    );
    assert_eq!(retry.status, SagaStatus::Running);
    assert_eq!(
        retry.next_attempt_at,
        t0() + TimeDelta::seconds(20),
        "the retry waits no longer than the deadline"
    );
    let Plan::Save(expired) = plan(&retry, &shape, retry.next_attempt_at, GRACE) else {
        panic!("the deadline decides without a call");
    };
    assert_eq!(expired.status, SagaStatus::Compensating);
    assert_eq!(
        expired.step, 1,
        "reserve_stock failed for sure: only capture_payment is undone"
    );
    let reason = expired.last_error.clone().unwrap();
    assert!(
        reason.contains("saga deadline of 20s passed at step `reserve_stock`"),
        "{reason}"
    );
    let (call, done) = run(&expired, &shape, ok());
    assert_eq!(
        call,
        Call::Compensation(0),
        "the undo is not cut by the deadline"
    );
    assert_eq!(done.status, SagaStatus::Compensated);
}

#[test]
fn a_saga_deadline_that_passes_during_a_maybe_applied_step_undoes_it_and_past_the_pivot_goes_on() {
    let shape = shape_with_deadline();
    let (_, record) = run(&new_saga(), &shape, ok()); // capture_payment
    let (_, record) = run(&record, &shape, failed(ErrorClass::OutcomeUnknown)); // reserve_stock?
    let Plan::Save(expired) = plan(&record, &shape, t0() + TimeDelta::seconds(20), GRACE) else {
        panic!("the deadline decides");
    };
    assert_eq!(expired.status, SagaStatus::Compensating);
    assert_eq!(
        expired.step, 2,
        "the maybe-applied reserve_stock is undone too"
    );

    let (_, record) = run(&new_saga(), &shape, ok());
    let (_, record) = run(&record, &shape, ok()); // reserve_stock
    let (_, record) = run(&record, &shape, failed(ErrorClass::OutcomeUnknown)); // the pivot?
    assert!(
        record.next_attempt_at < t0() + TimeDelta::seconds(20),
        "its retry backs off as usual, not cut to the deadline"
    );
    let late = t0() + TimeDelta::seconds(25);
    let Plan::Call(retry) = plan(&record, &shape, late, GRACE) else {
        panic!("no way back past a maybe-applied pivot: it is tried again");
    };
    assert_eq!(retry.call, Call::Action(2));
    assert_eq!(
        call_timeout(&record, &shape, Call::Action(2), late),
        shape.steps[2].timeout,
        "not cut to a deadline that no longer applies"
    );
    let (_, next) = run(&record, &shape, ok());
    let (_, done) = run(&next, &shape, ok()); // send_receipt, past the deadline
    assert_eq!(done.status, SagaStatus::Completed);
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
fn after_the_pivot_the_saga_retries_forward_for_its_time_budget_then_is_stuck_until_retried() {
    let shape = seed_shape();
    let mut record = new_saga();
    for _ in 0..3 {
        record = run(&record, &shape, ok()).1;
    }
    assert_eq!(record.step, 3);
    let mut delays = Vec::new();
    let mut calls = 0;
    while record.status == SagaStatus::Running {
        let (call, next) = run(&record, &shape, failed(ErrorClass::Permanent));
        assert_eq!(call, Call::Action(3), "only forward, with the same step");
        calls += 1;
        record = next;
        delays.push((record.next_attempt_at - record.updated_at).num_seconds());
    }
    assert!(
        calls > shape.stuck_after as usize,
        "a count does not bound forward recovery: {calls} calls"
    );
    assert_eq!(delays[..5], [1, 2, 4, 8, 10], "backoff");
    let first = record.first_attempt_at.expect("the budget's start");
    assert_eq!(
        (record.updated_at - first).num_seconds(),
        25,
        "the next attempt, 10 s later, would start past the 30 s budget"
    );
    assert!(
        *delays.last().unwrap() > 365 * 24 * 3600,
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
    assert_eq!(retried.first_attempt_at, None, "a fresh budget");
    let (call, done) = run(&retried, &shape, ok());
    assert_eq!(call, Call::Action(3));
    assert_eq!(done.status, SagaStatus::Completed);
}

#[test]
fn a_pivot_that_may_have_happened_only_goes_forward_then_is_stuck_never_compensated() {
    let shape = seed_shape();
    let mut record = new_saga();
    for _ in 0..2 {
        record = run(&record, &shape, ok()).1;
    }
    record = run(&record, &shape, failed(ErrorClass::OutcomeUnknown)).1;
    assert!(record.outcome_unknown, "remembered on the record");
    // Later attempts that say nothing happened, or fail for good, do not
    // make the first one not have happened.
    for class in [
        ErrorClass::Retryable,
        ErrorClass::Permanent,
        ErrorClass::Retryable,
    ] {
        let (call, next) = run(&record, &shape, failed(class));
        assert_eq!(call, Call::Action(2));
        record = next;
        assert_eq!(record.status, SagaStatus::Running, "still forward");
        assert!(record.outcome_unknown);
    }
    assert!(record.attempts > shape.steps[2].max_attempts);
    while record.status == SagaStatus::Running {
        record = run(&record, &shape, failed(ErrorClass::Retryable)).1;
    }
    assert_eq!((record.status, record.step), (SagaStatus::Stuck, 2));
    assert!(matches!(
        cancel(&record, &shape, t0()),
        Err(SagaError::PastPivot { .. })
    ));
    let retried = retry(&record, &shape, t0()).unwrap();
    assert_eq!((retried.status, retried.step), (SagaStatus::Running, 2));
    assert!(
        retried.outcome_unknown,
        "an operator's retry keeps the mark"
    );

    // An operator who checked that no shipment exists says so: the pivot
    // that refuses now turns back.
    assert!(matches!(
        confirm_not_applied(&retried, t0()),
        Err(SagaError::NotStuck { .. })
    ));
    let confirmed = confirm_not_applied(&record, record.updated_at).unwrap();
    assert_eq!(
        (
            confirmed.status,
            confirmed.outcome_unknown,
            confirmed.attempts
        ),
        (SagaStatus::Running, false, 0)
    );
    let (call, turned) = run(&confirmed, &shape, failed(ErrorClass::Permanent));
    assert_eq!(call, Call::Action(2));
    assert_eq!((turned.status, turned.step), (SagaStatus::Compensating, 2));
}

#[test]
fn a_pivot_that_timed_out_then_met_two_breaker_refusals_completes_not_compensated() {
    let shape = seed_shape();
    let mut record = new_saga();
    for _ in 0..2 {
        record = run(&record, &shape, ok()).1;
    }
    // The shipment was scheduled, but the reply timed out.
    record = run(&record, &shape, failed(ErrorClass::OutcomeUnknown)).1;
    for _ in 0..2 {
        let (call, next) = run(&record, &shape, refused(None));
        assert_eq!(call, Call::Action(2));
        record = next;
        assert_eq!(record.status, SagaStatus::Running);
    }
    let (call, record) = run(&record, &shape, ok());
    assert_eq!(call, Call::Action(2), "the same key again");
    let (call, record) = run(&record, &shape, ok());
    assert_eq!(call, Call::Action(3));
    assert_eq!(record.status, SagaStatus::Completed);
}

#[test]
fn a_capture_that_timed_out_then_failed_with_503s_and_for_good_is_still_refunded() {
    let shape = seed_shape();
    let mut record = new_saga();
    // The capture committed, but its reply timed out; then 503s; then a
    // permanent error. The last attempt says "nothing happened"; the first
    // may have charged the card.
    for class in [
        ErrorClass::OutcomeUnknown,
        ErrorClass::Retryable,
        ErrorClass::Permanent,
    ] {
        let (call, next) = run(&record, &shape, failed(class));
        assert_eq!(call, Call::Action(0));
        record = next;
    }
    assert_eq!((record.status, record.step), (SagaStatus::Compensating, 1));
    assert!(
        !record.outcome_unknown,
        "folded into the compensation range"
    );
    let (undo, record) = run(&record, &shape, ok());
    assert_eq!(undo, Call::Compensation(0), "the capture is refunded");
    assert_eq!(record.status, SagaStatus::Compensated);

    // The same with 503s until the attempts run out.
    let mut record = new_saga();
    for class in [
        ErrorClass::OutcomeUnknown,
        ErrorClass::Retryable,
        ErrorClass::Retryable,
    ] {
        record = run(&record, &shape, failed(class)).1;
    }
    assert_eq!((record.status, record.step), (SagaStatus::Compensating, 1));
}

#[test]
fn an_attempt_the_orchestrator_died_during_is_remembered_as_maybe_applied() {
    let shape = seed_shape();
    let paid = run(&new_saga(), &shape, ok()).1;
    // Claimed and saved, then the process dies: the claim marks the step.
    let crashed = claim(&paid, &shape).record;
    assert!(crashed.outcome_unknown);
    let mut record = crashed;
    record = run(&record, &shape, failed(ErrorClass::Retryable)).1;
    assert!(record.outcome_unknown, "a 503 later does not clear it");
    record = run(&record, &shape, failed(ErrorClass::Permanent)).1;
    assert_eq!(
        (record.status, record.step),
        (SagaStatus::Compensating, 2),
        "the reservation may exist: release it"
    );
}

#[test]
fn a_step_known_not_to_have_happened_is_not_compensated_and_a_pivot_that_surely_failed_turns_back()
{
    let shape = seed_shape();
    let mut record = new_saga();
    for _ in 0..2 {
        record = run(&record, &shape, ok()).1;
    }
    for _ in 0..3 {
        let next = run(&record, &shape, failed(ErrorClass::Retryable)).1;
        assert!(!next.outcome_unknown, "a 503 says nothing happened");
        record = next;
    }
    assert_eq!(
        (record.status, record.step),
        (SagaStatus::Compensating, 2),
        "the pivot never happened: undo what came before it"
    );
}

/// A breaker racing its move to half-open once answered "probe in a
/// century", and the saga parked its step for that long.
#[test]
fn no_refusal_parks_a_saga_for_longer_than_the_cap() {
    let shape = seed_shape();
    let century = Duration::from_secs(100 * 365 * 86_400);
    let (_, next) = run(&new_saga(), &shape, refused(Some(century)));
    let wait = (next.next_attempt_at - next.updated_at).to_std().unwrap();
    assert_eq!(wait, super::MAX_REFUSAL_WAIT);
}

#[test]
fn a_refusal_is_not_an_attempt_and_waits_its_retry_after() {
    let shape = seed_shape();
    let mut record = new_saga();
    assert_eq!(shape.steps[0].max_attempts, 3);
    for n in 0..5 {
        let retry_after = if n % 2 == 0 {
            Some(Duration::from_secs(7))
        } else {
            None
        };
        let (call, next) = run(&record, &shape, refused(retry_after));
        assert_eq!(call, Call::Action(0));
        assert_eq!(next.status, SagaStatus::Running);
        assert_eq!(next.attempts, 0, "refusal {n} gave its attempt back");
        assert!(!next.outcome_unknown, "the call never left");
        let wait = (next.next_attempt_at - next.updated_at).num_seconds();
        assert_eq!(
            wait,
            if n % 2 == 0 { 7 } else { 3 },
            "Retry-After, or the default"
        );
        assert!(
            next.last_error
                .as_deref()
                .unwrap()
                .contains("refused before it was sent")
        );
        record = next;
    }
    let (_, record) = run(&record, &shape, ok());
    assert_eq!(record.step, 1, "survived five refusals with three attempts");

    // A refusal after an attempt of unknown outcome keeps the mark.
    let (_, unknown) = run(&record, &shape, failed(ErrorClass::OutcomeUnknown));
    let (_, refused_after) = run(&unknown, &shape, refused(None));
    assert!(refused_after.outcome_unknown);
    assert_eq!(refused_after.attempts, 1);

    // A compensation's refusal is not an attempt either.
    let mut undoing = run(&record, &shape, failed(ErrorClass::Permanent)).1;
    assert_eq!(undoing.status, SagaStatus::Compensating);
    for _ in 0..(shape.stuck_after + 2) {
        undoing = run(&undoing, &shape, refused(None)).1;
        assert_eq!(
            (undoing.status, undoing.attempts),
            (SagaStatus::Compensating, 0)
        );
    }
    let (call, done) = run(&undoing, &shape, ok());
    assert_eq!(call, Call::Compensation(0));
    assert_eq!(done.status, SagaStatus::Compensated);
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
        record = claim(&record, &shape).record;
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
    let claimed = claim(&paid, &shape).record; // reserve_stock in flight
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
    let pivot_claimed = claim(&at_pivot, &shape).record;
    let err = cancel(&pivot_claimed, &shape, t0()).unwrap_err();
    assert!(err.to_string().contains("schedule_shipment"), "{err}");
}

// ---------------------------------------------------------------------------
// Property: whatever happens, every saga ends completed or fully
// compensated (an operator retries the stuck ones), no effect is left
// un-undone, and nothing is undone that was never attempted.
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, Copy)]
enum Fate {
    Ok,
    /// A 503: the service did nothing *this time* (an earlier attempt may
    /// have done the work: the service's dedupe never got to answer).
    Retryable,
    /// A 4xx, or an error nobody classified.
    Permanent,
    /// A policy refused the call: it never left.
    Refused,
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
        1 => Just(Fate::Refused),
        2 => any::<bool>().prop_map(|happened| Fate::Unknown { happened }),
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
    /// Actions attempted (the call may have left).
    attempted: BTreeSet<usize>,
    /// Every call, in order.
    calls: Vec<Call>,
    /// Operator retries of stuck sagas.
    operator_retries: usize,
}

fn simulate(shape: &Shape, fates: &[Fate]) -> (SagaRecord, Ledger) {
    let mut record = new_saga();
    let mut now = t0();
    let mut ledger = Ledger::default();
    let mut fates = fates.iter().copied();
    for _ in 0..10_000 {
        now = now.max(record.next_attempt_at);
        let claim = match plan(&record, shape, now, GRACE) {
            Plan::Idle if record.status == SagaStatus::Stuck => {
                // An operator looks, and retries it.
                ledger.operator_retries += 1;
                record = retry(&record, shape, now).unwrap();
                continue;
            }
            Plan::Idle => return (record, ledger),
            Plan::Save(next) => {
                assert_eq!(next.version, record.version + 1);
                record = next;
                continue;
            }
            Plan::Call(claim) => claim,
        };
        assert_eq!(claim.record.version, record.version + 1);
        let (call, claimed) = (claim.call, claim.record.clone());
        record = claimed.clone();
        ledger.calls.push(call);
        let fate = fates.next().unwrap_or(Fate::Ok);
        // Whether this call's effect lands. A service that already did the
        // work under this key does not do it again (the sets dedupe), but
        // it may still be unreachable, slow, or refuse: the fate decides
        // the answer whatever happened before.
        let happened = match fate {
            Fate::Ok => true,
            Fate::Unknown { happened }
            | Fate::Crash { happened }
            | Fate::CancelDuring { happened } => happened,
            Fate::Retryable | Fate::Permanent | Fate::Refused => false,
        };
        if let Call::Action(i) = call
            && !matches!(fate, Fate::Refused)
        {
            ledger.attempted.insert(i);
        }
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
            Fate::Ok => ok(),
            Fate::Retryable => failed(ErrorClass::Retryable),
            Fate::Permanent => failed(ErrorClass::Permanent),
            Fate::Refused => refused(None),
        };
        let next = decide(&claim, shape, outcome, now);
        assert_eq!(next.version, claimed.version + 1);
        record = next;
        now += TimeDelta::milliseconds(1);
    }
    panic!("the saga did not settle: {record:?}");
}

proptest! {
    #[test]
    fn every_saga_ends_completed_or_fully_compensated_and_no_effect_is_left_undone(
        fates in proptest::collection::vec(fate(), 0..60)
    ) {
        let shape = seed_shape();
        let pivot = shape.pivot.unwrap();
        let (record, ledger) = simulate(&shape, &fates);
        match record.status {
            SagaStatus::Completed => {
                prop_assert_eq!(ledger.done.len(), shape.steps.len());
                prop_assert!(ledger.undone.is_empty(), "undone {:?}", ledger.undone);
            }
            SagaStatus::Compensated | SagaStatus::Cancelled => {
                // Every step that took effect was undone (none is at or
                // past the pivot: there is no way back from those), and
                // nothing was undone that was never attempted.
                for i in &ledger.done {
                    prop_assert!(*i < pivot, "step {} done, yet compensated", i);
                    prop_assert!(ledger.undone.contains(i), "step {} not undone", i);
                }
                for j in &ledger.undone {
                    prop_assert!(ledger.attempted.contains(j), "step {} undone, never attempted", j);
                }
                prop_assert_eq!(
                    record.status == SagaStatus::Cancelled,
                    cancel_requested(&record)
                );
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
