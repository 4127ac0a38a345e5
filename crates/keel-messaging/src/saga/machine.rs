//! The saga state machine: pure functions from a persisted record (and a
//! call's outcome) to the next record. No I/O, no clock, no randomness
//! beyond backoff jitter, so every crash-and-resume path can be tested by
//! replaying records.
//!
//! The record's fields mean (see [`SagaRecord`]):
//!
//! - `Running`, `step = i`: step `i` is next (or being attempted).
//! - `Compensating`, `step = u`: steps below `u` may need undoing; the next
//!   undo is the highest compensable step below `u`.
//! - `Stuck`, `step = i`: step `i`'s action (at or after the pivot) or its
//!   compensation (before the pivot) keeps failing; an operator decides.
//! - `attempts`: attempts *started* at the current call. It is counted when
//!   the call is claimed, before it runs, so an orchestrator that crashes on
//!   every attempt (a poison step) still runs out of attempts.
//! - `next_attempt_at`: when the saga is due; while a call runs it is the
//!   claim's lease (step timeout plus grace), so other orchestrators leave
//!   it alone, and a crashed one's saga becomes due again when it expires.
//!   A stuck saga is parked a century ahead: only an operator's retry or
//!   cancel makes it due again.

use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use keel_core::ErrorClass;
use keel_policy::retry::Backoff;
use serde_json::Value;

use super::SagaError;
use crate::store::{SagaRecord, SagaStatus};

/// `last_error` of a saga an operator cancelled (later errors are appended).
pub(crate) const CANCELLED_BY_OPERATOR: &str = "cancelled by operator";

/// How far ahead a stuck saga's `next_attempt_at` is set: it waits for an
/// operator, so the store's due scan must not keep returning it (stuck is
/// not terminal) and crowd out sagas that can make progress.
const PARKED: TimeDelta = TimeDelta::days(365 * 100);

/// The parts of a definition the state machine needs.
#[derive(Debug, Clone)]
pub(crate) struct Shape {
    pub(crate) steps: Vec<StepShape>,
    pub(crate) pivot: Option<usize>,
    pub(crate) stuck_after: u32,
    pub(crate) backoff: Backoff,
}

#[derive(Debug, Clone)]
pub(crate) struct StepShape {
    pub(crate) name: Arc<str>,
    pub(crate) timeout: Duration,
    pub(crate) max_attempts: u32,
    pub(crate) compensable: bool,
}

impl Shape {
    fn len(&self) -> usize {
        self.steps.len()
    }

    /// Whether step `i` comes after the pivot (no way back).
    fn past_pivot(&self, i: usize) -> bool {
        self.pivot.is_some_and(|p| i > p)
    }

    fn is_pivot(&self, i: usize) -> bool {
        self.pivot == Some(i)
    }

    /// Attempts allowed at `call` before giving up.
    fn attempt_limit(&self, call: Call) -> u32 {
        match call {
            Call::Action(i) if self.past_pivot(i) => self.stuck_after,
            Call::Action(i) => self.steps[i].max_attempts,
            Call::Compensation(_) => self.stuck_after,
        }
    }

    /// The highest compensable step below `upper`.
    fn compensable_below(&self, upper: usize) -> Option<usize> {
        (0..upper.min(self.len()))
            .rev()
            .find(|&j| self.steps[j].compensable)
    }

    /// The step a call is about.
    pub(crate) fn step(&self, call: Call) -> &StepShape {
        &self.steps[call.index()]
    }

    fn delay(&self, attempts: u32) -> Duration {
        self.backoff
            .delay(attempts.saturating_sub(1))
            .unwrap_or_else(|| self.backoff.max_delay())
    }
}

/// A call the orchestrator makes for a saga.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Call {
    /// Run step `i`'s action.
    Action(usize),
    /// Run step `i`'s compensation.
    Compensation(usize),
}

impl Call {
    pub(crate) fn index(self) -> usize {
        match self {
            Self::Action(i) | Self::Compensation(i) => i,
        }
    }

    /// `saga_id:step`, or `saga_id:undo:step`.
    pub(crate) fn idempotency_key(self, saga_id: &str, shape: &Shape) -> String {
        let name = &shape.step(self).name;
        match self {
            Self::Action(_) => format!("{saga_id}:{name}"),
            Self::Compensation(_) => format!("{saga_id}:undo:{name}"),
        }
    }

    pub(crate) fn kind(self) -> &'static str {
        match self {
            Self::Action(_) => "action",
            Self::Compensation(_) => "compensation",
        }
    }
}

/// How a call ended.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Outcome {
    /// It succeeded; the saga's data afterwards.
    Done(Value),
    /// It failed.
    Failed {
        /// Retryable: did not take effect. OutcomeUnknown: may have
        /// (timeouts, crashes). Permanent: will fail the same way again.
        class: ErrorClass,
        /// The error, for the operator.
        error: String,
    },
}

/// What to do with a saga now.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Plan {
    /// Nothing: finished, stuck, or not due yet.
    Idle,
    /// Save this record; no call is needed for the transition.
    Save(SagaRecord),
    /// Save `claimed` (the attempt counted, the lease taken), then make
    /// `call`, then save what [`decide`] says.
    Call { call: Call, claimed: SagaRecord },
}

/// What to do with `record` at `now`.
pub(crate) fn plan(
    record: &SagaRecord,
    shape: &Shape,
    now: DateTime<Utc>,
    lease_grace: Duration,
) -> Plan {
    if record.next_attempt_at > now || shape.steps.is_empty() {
        return Plan::Idle;
    }
    let call = match record.status {
        SagaStatus::Running => {
            let i = record.step as usize;
            if i >= shape.len() {
                let mut done = bump(record, now);
                done.status = SagaStatus::Completed;
                return Plan::Save(done);
            }
            Call::Action(i)
        }
        SagaStatus::Compensating => match shape.compensable_below(record.step as usize) {
            None => {
                let mut done = bump(record, now);
                finish_compensation(&mut done);
                return Plan::Save(done);
            }
            Some(j) if j + 1 != record.step as usize => {
                let mut next = bump(record, now);
                next.step = index_u32(j + 1);
                next.attempts = 0;
                return Plan::Save(next);
            }
            Some(j) => Call::Compensation(j),
        },
        _ => return Plan::Idle,
    };
    if record.attempts >= shape.attempt_limit(call) {
        // Every allowed attempt was started and none reported back: the
        // orchestrator crashed or lost its lease each time.
        let outcome = Outcome::Failed {
            class: ErrorClass::OutcomeUnknown,
            error: format!(
                "no outcome recorded for {} attempts: the orchestrator stopped or lost its lease \
                 during each",
                record.attempts
            ),
        };
        return Plan::Save(decide(record, shape, call, outcome, now));
    }
    let mut claimed = bump(record, now);
    claimed.attempts = record.attempts.saturating_add(1);
    claimed.next_attempt_at = now + delta(shape.step(call).timeout + lease_grace);
    Plan::Call { call, claimed }
}

/// The record after `call`, claimed in `claimed`, ended with `outcome`.
pub(crate) fn decide(
    claimed: &SagaRecord,
    shape: &Shape,
    call: Call,
    outcome: Outcome,
    now: DateTime<Utc>,
) -> SagaRecord {
    let mut next = bump(claimed, now);
    next.next_attempt_at = now;
    let attempts = claimed.attempts;
    match (call, outcome) {
        (Call::Action(i), Outcome::Done(data)) => {
            next.data = data;
            next.step = index_u32(i + 1);
            next.attempts = 0;
            next.last_error = None;
            if i + 1 >= shape.len() {
                next.status = SagaStatus::Completed;
            }
        }
        (Call::Action(i), Outcome::Failed { class, error }) => {
            note_error(
                &mut next,
                format!("step `{}` attempt {attempts}: {error}", shape.steps[i].name),
            );
            let out_of_attempts = attempts >= shape.attempt_limit(call);
            if shape.past_pivot(i) {
                // No way back: retry forward until a human must look.
                if out_of_attempts {
                    park(&mut next, now);
                } else {
                    next.next_attempt_at = now + delta(shape.delay(attempts));
                }
            } else if !(out_of_attempts || class == ErrorClass::Permanent) {
                next.next_attempt_at = now + delta(shape.delay(attempts));
            } else if shape.is_pivot(i) && class == ErrorClass::OutcomeUnknown {
                // The pivot may or may not have happened: neither direction
                // is safe to take alone.
                park(&mut next, now);
            } else {
                // A call of unknown outcome may have taken effect: undo it too.
                let upper = if class == ErrorClass::OutcomeUnknown {
                    i + 1
                } else {
                    i
                };
                enter_compensation(&mut next, shape, upper);
            }
        }
        (Call::Compensation(j), Outcome::Done(data)) => {
            next.data = data;
            enter_compensation(&mut next, shape, j);
        }
        (Call::Compensation(j), Outcome::Failed { class, error }) => {
            note_error(
                &mut next,
                format!(
                    "compensation of `{}` attempt {attempts}: {error}",
                    shape.steps[j].name
                ),
            );
            if attempts >= shape.attempt_limit(call) || class == ErrorClass::Permanent {
                park(&mut next, now);
                next.step = index_u32(j);
            } else {
                next.next_attempt_at = now + delta(shape.delay(attempts));
            }
        }
    }
    next
}

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
    if shape.pivot.is_some_and(|p| record.step as usize >= p) {
        next.status = SagaStatus::Running;
    } else {
        next.status = SagaStatus::Compensating;
        next.step = record.step.saturating_add(1);
    }
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
    let past_pivot = |started: bool| shape.pivot.is_some_and(|p| i > p || (i == p && started));
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
        _ if past_pivot(record.attempts > 0) => return Err(past_pivot_error(record, shape)),
        _ => {
            // An attempt at step i may be running or may have taken
            // effect: undo it too, but not before its lease ends.
            let started = record.attempts > 0;
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

/// Whether an operator cancelled this saga.
pub(crate) fn cancel_requested(record: &SagaRecord) -> bool {
    record
        .last_error
        .as_deref()
        .is_some_and(|e| e.starts_with(CANCELLED_BY_OPERATOR))
}

fn note_error(record: &mut SagaRecord, error: String) {
    record.last_error = Some(match &record.last_error {
        Some(prev) if cancel_requested(record) => {
            let head = prev.split("; then ").next().unwrap_or(prev);
            format!("{head}; then {error}")
        }
        _ => error,
    });
}

/// Compensating from `upper`: the next undo is the highest compensable step
/// below it; with none left, the saga is compensated (or cancelled).
fn enter_compensation(record: &mut SagaRecord, shape: &Shape, upper: usize) {
    record.status = SagaStatus::Compensating;
    record.attempts = 0;
    match shape.compensable_below(upper) {
        Some(j) => record.step = index_u32(j + 1),
        None => {
            record.step = 0;
            finish_compensation(record);
        }
    }
}

/// Stuck: waits for an operator, out of the due scan.
fn park(record: &mut SagaRecord, now: DateTime<Utc>) {
    record.status = SagaStatus::Stuck;
    record.next_attempt_at = now + PARKED;
}

fn finish_compensation(record: &mut SagaRecord) {
    record.status = if cancel_requested(record) {
        SagaStatus::Cancelled
    } else {
        SagaStatus::Compensated
    };
}

/// The record as the next version, changed now.
fn bump(record: &SagaRecord, now: DateTime<Utc>) -> SagaRecord {
    let mut next = record.clone();
    next.version = record.version.saturating_add(1);
    next.updated_at = now;
    next
}

fn delta(d: Duration) -> TimeDelta {
    TimeDelta::from_std(d).unwrap_or(TimeDelta::MAX)
}

fn index_u32(i: usize) -> u32 {
    u32::try_from(i).unwrap_or(u32::MAX)
}

#[cfg(test)]
mod tests;
