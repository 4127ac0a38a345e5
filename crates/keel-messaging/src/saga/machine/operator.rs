//! What an operator does to a saga: retry it, confirm that a stuck step
//! did not happen, cancel it. Each is a pure transition like the machine's.

use chrono::{DateTime, Utc};

use super::{CANCELLED_BY_OPERATOR, Shape, bump, cancel_requested, enter_compensation};
use crate::saga::SagaError;
use crate::store::{SagaRecord, SagaStatus};

/// An operator's retry of a stuck saga: attempts reset, due now, in the
/// direction it was going.
pub(crate) fn retry(
    record: &SagaRecord,
    shape: &Shape,
    now: DateTime<Utc>,
) -> Result<SagaRecord, SagaError> {
    if record.status != SagaStatus::Stuck {
        return Err(SagaError::NotStuck {
            id: record.id.clone(),
            status: record.status,
        });
    }
    let mut next = bump(record, now);
    next.attempts = 0;
    next.next_attempt_at = now;
    // A fresh budget for forward recovery.
    next.first_attempt_at = None;
    if shape.pivot.is_some_and(|p| record.step as usize >= p) {
        next.status = SagaStatus::Running;
    } else {
        next.status = SagaStatus::Compensating;
        next.step = record.step.saturating_add(1);
    }
    Ok(next)
}

/// An operator's word that the stuck step's action did *not* take effect
/// (they looked it up at the dependency, under the step's key, and made
/// sure it never will): the mark is cleared and the saga is due now, with
/// fresh attempts, so the machine decides again knowing that. A pivot that
/// keeps refusing then turns back and compensates.
pub(crate) fn confirm_not_applied(
    record: &SagaRecord,
    now: DateTime<Utc>,
) -> Result<SagaRecord, SagaError> {
    if record.status != SagaStatus::Stuck {
        return Err(SagaError::NotStuck {
            id: record.id.clone(),
            status: record.status,
        });
    }
    let mut next = bump(record, now);
    next.status = SagaStatus::Running;
    next.outcome_unknown = false;
    next.attempts = 0;
    next.first_attempt_at = None;
    next.next_attempt_at = now;
    Ok(next)
}

/// An operator's cancel: compensate what was done, if the pivot has not
/// been reached. `None` if there is nothing to change.
pub(crate) fn cancel(
    record: &SagaRecord,
    shape: &Shape,
    now: DateTime<Utc>,
) -> Result<Option<SagaRecord>, SagaError> {
    let i = record.step as usize;
    let past_pivot = |maybe_applied: bool| shape.forward_only(i, maybe_applied);
    let mut next = bump(record, now);
    match record.status {
        s if s.is_terminal() => {
            return Err(SagaError::Finished {
                id: record.id.clone(),
                status: s,
            });
        }
        SagaStatus::Compensating if cancel_requested(record) => return Ok(None),
        SagaStatus::Compensating => {}
        SagaStatus::Stuck if past_pivot(true) => return Err(past_pivot_error(record, shape)),
        SagaStatus::Stuck => {
            next.status = SagaStatus::Compensating;
            next.step = record.step.saturating_add(1);
            next.attempts = 0;
            next.next_attempt_at = now;
        }
        _ if past_pivot(record.outcome_unknown) => return Err(past_pivot_error(record, shape)),
        _ => {
            // An attempt at step i may be running or may have taken
            // effect: undo it too, but not before its lease (or backoff)
            // ends.
            let started = record.outcome_unknown;
            let upper = if started { i + 1 } else { i };
            let due = if started {
                record.next_attempt_at.max(now)
            } else {
                now
            };
            enter_compensation(&mut next, shape, upper);
            next.next_attempt_at = due;
        }
    }
    let reason = record.last_error.as_deref().unwrap_or("no error");
    next.last_error = Some(format!("{CANCELLED_BY_OPERATOR} (was: {reason})"));
    if next.status == SagaStatus::Compensated {
        next.status = SagaStatus::Cancelled;
    }
    Ok(Some(next))
}

fn past_pivot_error(record: &SagaRecord, shape: &Shape) -> SagaError {
    let pivot = shape
        .pivot
        .and_then(|p| shape.steps.get(p))
        .map_or_else(String::new, |s| s.name.to_string());
    SagaError::PastPivot {
        id: record.id.clone(),
        pivot,
    }
}
