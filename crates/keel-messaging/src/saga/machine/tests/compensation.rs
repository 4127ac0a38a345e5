//! Compensation across a step that has none, when compensations are tried
//! again, how long a stuck saga waits, what an operator's cancel does to a
//! saga already undoing or stuck, and what the record says about attempts
//! that may have taken effect.

use super::*;

/// The order saga with a fraud check between the payment and the stock:
/// it reads, so it has nothing to undo.
fn shape_with_a_read_only_step() -> Shape {
    let mut shape = seed_shape();
    let mut check = shape.steps[0].clone();
    check.name = "check_fraud".into();
    check.compensable = false;
    shape.steps.insert(1, check);
    shape.pivot = Some(3);
    shape
}

/// A record saved under an earlier definition, in which the fraud check had
/// a compensation, is partway through undoing it: the cursor moves past the
/// step that has none, and the payment's refund starts with attempts of its
/// own.
#[test]
fn a_step_without_compensation_is_skipped_and_the_next_undo_starts_afresh() {
    let shape = shape_with_a_read_only_step();
    let mut record = new_saga();
    record.status = SagaStatus::Compensating;
    record.step = 2;
    record.attempts = 2;
    record.first_attempt_at = Some(t0());
    let Plan::Save(moved) = plan(&record, &shape, t0(), GRACE) else {
        panic!("expected the cursor to move past the fraud check first");
    };
    assert_eq!((moved.step, moved.attempts), (1, 0));
    assert_eq!(moved.first_attempt_at, None);
    let claimed = claim(&moved, &shape);
    assert_eq!(
        claimed.call,
        Call::Compensation(0),
        "the payment is refunded"
    );
    assert_eq!(claimed.record.attempts, 1, "with attempts of its own");
    let (_, done) = run(&moved, &shape, ok());
    assert_eq!(done.status, SagaStatus::Compensated);
}

/// Compensations retry later, never at once: a refusal waits its
/// `Retry-After`, a failure the backoff.
#[test]
fn a_compensation_is_tried_again_after_its_wait_not_at_once() {
    let shape = seed_shape();
    let mut record = new_saga();
    record = run(&record, &shape, ok()).1;
    record = run(&record, &shape, failed(ErrorClass::Permanent)).1;
    assert_eq!(record.status, SagaStatus::Compensating);
    let refusal = claim(&record, &shape);
    let now = refusal.record.updated_at;
    let waiting = decide(&refusal, &shape, refused(Some(Duration::from_secs(5))), now);
    assert_eq!(waiting.next_attempt_at, now + TimeDelta::seconds(5));
    let failure = claim(&waiting, &shape);
    let now = failure.record.updated_at;
    let backing_off = decide(&failure, &shape, failed(ErrorClass::Retryable), now);
    assert_eq!(backing_off.status, SagaStatus::Compensating);
    assert_eq!(backing_off.next_attempt_at, now + TimeDelta::seconds(1));
}

/// A stuck saga waits for an operator, however long that takes: the due
/// scan must not pick it up again by itself.
#[test]
fn a_stuck_saga_is_parked_for_a_century() {
    let shape = seed_shape();
    let mut record = new_saga();
    record = run(&record, &shape, ok()).1;
    record = run(&record, &shape, failed(ErrorClass::Permanent)).1;
    let mut now = record.updated_at;
    while record.status == SagaStatus::Compensating {
        let claimed = claim(&record, &shape);
        now = claimed.record.updated_at;
        record = decide(&claimed, &shape, failed(ErrorClass::Retryable), now);
    }
    assert_eq!(record.status, SagaStatus::Stuck);
    assert!(record.next_attempt_at >= now + TimeDelta::days(365 * 99));
}

/// Each failed attempt's note replaces the last one (only a cancellation's
/// marker stays in front) and says whether it, or an earlier attempt, may
/// have taken effect.
#[test]
fn an_attempts_note_says_which_attempt_may_have_taken_effect() {
    let shape = seed_shape();
    let plain = run(&new_saga(), &shape, failed(ErrorClass::Retryable)).1;
    assert!(
        !plain.last_error.as_deref().unwrap().contains("may have"),
        "{:?}",
        plain.last_error
    );
    let unknown = run(&new_saga(), &shape, failed(ErrorClass::OutcomeUnknown)).1;
    let note = unknown.last_error.clone().unwrap();
    assert!(
        note.contains("attempt 1 (it may have taken effect)"),
        "{note}"
    );
    let later = run(&unknown, &shape, failed(ErrorClass::Retryable)).1;
    let note = later.last_error.unwrap();
    assert!(
        note.contains("attempt 2 (an earlier attempt may have taken effect)")
            && !note.contains("attempt 1"),
        "only the latest attempt's note is kept: {note}"
    );
}

/// The `call` label of the saga's metrics and spans.
#[test]
fn calls_are_labelled_action_or_compensation() {
    assert_eq!(Call::Action(0).kind(), "action");
    assert_eq!(Call::Compensation(0).kind(), "compensation");
}

/// Cancelling a saga that is already undoing (its step failed for good)
/// only marks it: its cursor and attempts stay, and it ends `Cancelled`.
#[test]
fn cancelling_a_compensating_saga_marks_it_and_keeps_its_place() {
    let shape = seed_shape();
    let mut record = new_saga();
    record = run(&record, &shape, ok()).1;
    record = run(&record, &shape, failed(ErrorClass::Permanent)).1;
    record = run(&record, &shape, failed(ErrorClass::Retryable)).1;
    assert_eq!(
        (record.status, record.step, record.attempts),
        (SagaStatus::Compensating, 1, 1)
    );
    let cancelled = cancel(&record, &shape, t0()).unwrap().expect("marked");
    assert!(cancel_requested(&cancelled));
    assert_eq!(
        (cancelled.status, cancelled.step, cancelled.attempts),
        (SagaStatus::Compensating, 1, 1)
    );
    let (call, done) = run(&cancelled, &shape, ok());
    assert_eq!(call, Call::Compensation(0));
    assert_eq!(done.status, SagaStatus::Cancelled);
}

/// Cancelling a saga stuck on a compensation before the pivot tries that
/// compensation again, with fresh attempts; it is never skipped.
#[test]
fn cancelling_a_stuck_compensation_retries_it_and_skips_nothing() {
    let shape = seed_shape();
    let mut record = new_saga();
    record = run(&record, &shape, ok()).1;
    record = run(&record, &shape, failed(ErrorClass::Permanent)).1;
    while record.status == SagaStatus::Compensating {
        record = run(&record, &shape, failed(ErrorClass::Retryable)).1;
    }
    assert_eq!((record.status, record.step), (SagaStatus::Stuck, 0));
    let cancelled = cancel(&record, &shape, t0()).unwrap().expect("resumed");
    assert_eq!(
        (cancelled.status, cancelled.step, cancelled.attempts),
        (SagaStatus::Compensating, 1, 0)
    );
    assert_eq!(cancelled.next_attempt_at, t0(), "due now");
    let (call, done) = run(&cancelled, &shape, ok());
    assert_eq!(call, Call::Compensation(0), "the stuck refund, not skipped");
    assert_eq!(done.status, SagaStatus::Cancelled);
}
