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
//!   every attempt (a poison step) still runs out of attempts. A refusal by
//!   a policy (breaker open, bulkhead full, budget empty: the call never
//!   left) gives its attempt back and waits the refusal's `Retry-After`.
//! - `outcome_unknown`: the current step's action may have taken effect.
//!   The claim sets it (whatever happens to this process now, the call may
//!   land), and the outcome keeps it only if an earlier attempt was already
//!   unknown or this one is: a timeout followed by 503s is still "maybe
//!   applied". The direction is decided by everything that happened at the
//!   step, not by its last attempt: compensation includes a maybe-applied
//!   step, and a maybe-applied pivot only goes forward.
//! - `first_attempt_at`: when the first attempt at the current call was
//!   claimed. Forward recovery (at or past the pivot) retries with the same
//!   key until the definition's forward budget has passed since then, and only
//!   then parks the saga as stuck; it never compensates past the pivot.
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

use super::MAX_REFUSAL_WAIT;
use crate::store::{SagaRecord, SagaStatus};

mod deadline;
mod operator;

pub(crate) use deadline::call_timeout;
use deadline::expire;
pub(crate) use operator::{cancel, confirm_not_applied, retry};

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
    /// How long forward recovery retries a step at or past the pivot
    /// before the saga is stuck.
    pub(crate) forward_budget: Duration,
    /// How long to wait after a policy's refusal that names no
    /// `Retry-After`.
    pub(crate) refusal_wait: Duration,
    /// How long the whole saga may take from its creation.
    pub(crate) deadline: Option<Duration>,
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

    /// Whether the action of step `i` may only go forward: it comes after
    /// the pivot, or it is the pivot and may have taken effect. There is no
    /// way back from either: the shipment may exist.
    fn forward_only(&self, i: usize, outcome_unknown: bool) -> bool {
        self.pivot
            .is_some_and(|p| i > p || (i == p && outcome_unknown))
    }

    /// Attempts allowed at `call` before giving up, for the calls bounded
    /// by a count (forward recovery is bounded by time instead).
    fn attempt_limit(&self, call: Call) -> u32 {
        match call {
            Call::Action(i) => self.steps[i].max_attempts,
            Call::Compensation(_) => self.stuck_after,
        }
    }

    /// Whether forward recovery of `record`'s current call has used its
    /// time budget.
    fn budget_spent(&self, record: &SagaRecord, now: DateTime<Utc>) -> bool {
        record
            .first_attempt_at
            .is_some_and(|first| now >= first + delta(self.forward_budget))
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

    /// How long to wait after a refusal that named `retry_after`.
    fn refusal_wait(&self, retry_after: Option<Duration>) -> Duration {
        retry_after.map_or(self.refusal_wait, |wait| wait.min(MAX_REFUSAL_WAIT))
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
        /// (timeouts, crashes). Rejected: a policy refused it, it never
        /// left. Permanent (and anything unclassified): will fail the same
        /// way again.
        class: ErrorClass,
        /// The error, for the operator.
        error: String,
        /// When the refusing side asked to be tried again, if it did.
        retry_after: Option<Duration>,
    },
}

/// A call claimed for a saga: the record saved before the call is made.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Claim {
    /// The call to make.
    pub(crate) call: Call,
    /// The record as claimed: the attempt counted, the lease taken, and,
    /// for an action, the step marked as maybe applied (from now on the
    /// call may land, whatever happens to this process).
    pub(crate) record: SagaRecord,
    /// Whether the step may have taken effect *before* this attempt: what
    /// the mark goes back to if this attempt is known not to have landed.
    pub(crate) unknown_before: bool,
}

/// What to do with a saga now.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Plan {
    /// Nothing: finished, stuck, or not due yet.
    Idle,
    /// Save this record; no call is needed for the transition.
    Save(SagaRecord),
    /// Save the claim's record, then make its call, then save what
    /// [`decide`] says.
    Call(Claim),
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
            // Do not start what cannot finish in the time left.
            let too_late = now + delta(keel_core::deadline::MIN_TIME_TO_START);
            if shape.deadline_at(record).is_some_and(|at| too_late >= at) {
                return Plan::Save(expire(record, shape, i, now));
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
                next.first_attempt_at = None;
                return Plan::Save(next);
            }
            Some(j) => Call::Compensation(j),
        },
        _ => return Plan::Idle,
    };
    let forward = matches!(call, Call::Action(i) if shape.forward_only(i, record.outcome_unknown));
    let given_up = if forward {
        shape.budget_spent(record, now)
    } else {
        record.attempts >= shape.attempt_limit(call)
    };
    if given_up {
        // Every allowed attempt was started and none reported back: the
        // orchestrator crashed or lost its lease each time.
        let outcome = Outcome::Failed {
            class: ErrorClass::OutcomeUnknown,
            error: format!(
                "no outcome recorded for {} attempts: the orchestrator stopped or lost its lease \
                 during each",
                record.attempts
            ),
            retry_after: None,
        };
        let unclaimed = Claim {
            call,
            record: record.clone(),
            unknown_before: record.outcome_unknown,
        };
        return Plan::Save(decide(&unclaimed, shape, outcome, now));
    }
    let mut claimed = bump(record, now);
    claimed.attempts = record.attempts.saturating_add(1);
    claimed.next_attempt_at = now + delta(call_timeout(record, shape, call, now) + lease_grace);
    claimed.first_attempt_at.get_or_insert(now);
    if let Call::Action(_) = call {
        claimed.outcome_unknown = true;
    }
    Plan::Call(Claim {
        call,
        record: claimed,
        unknown_before: record.outcome_unknown,
    })
}

/// The record after `claim`'s call ended with `outcome`.
pub(crate) fn decide(
    claim: &Claim,
    shape: &Shape,
    outcome: Outcome,
    now: DateTime<Utc>,
) -> SagaRecord {
    let mut next = bump(&claim.record, now);
    next.next_attempt_at = now;
    match outcome {
        Outcome::Done(data) => match claim.call {
            Call::Action(i) => action_done(&mut next, shape, i, data),
            Call::Compensation(j) => {
                next.data = data;
                enter_compensation(&mut next, shape, j);
            }
        },
        Outcome::Failed {
            class,
            error,
            retry_after,
        } => {
            let failure = Failure {
                class,
                error: &error,
                retry_after,
            };
            match claim.call {
                Call::Action(i) if class == ErrorClass::Rejected => {
                    action_refused(&mut next, claim, shape, i, &failure, now);
                }
                Call::Action(i) => action_failed(&mut next, claim, shape, i, &failure, now),
                Call::Compensation(j) => {
                    compensation_failed(&mut next, claim, shape, j, &failure, now);
                }
            }
        }
    }
    if next.status == SagaStatus::Running
        && let Some(at) = shape.deadline_at(&next)
    {
        // A retry waits no longer than the deadline, which then decides.
        next.next_attempt_at = next.next_attempt_at.min(at);
    }
    next
}

/// Step `i` succeeded: on to the next one with a clean slate, or done.
fn action_done(next: &mut SagaRecord, shape: &Shape, i: usize, data: Value) {
    next.data = data;
    next.step = index_u32(i + 1);
    next.attempts = 0;
    next.last_error = None;
    next.outcome_unknown = false;
    next.first_attempt_at = None;
    if i + 1 >= shape.len() {
        next.status = SagaStatus::Completed;
    }
}

/// A policy refused step `i`'s call before it was sent.
fn action_refused(
    next: &mut SagaRecord,
    claim: &Claim,
    shape: &Shape,
    i: usize,
    failure: &Failure<'_>,
    now: DateTime<Utc>,
) {
    // The call never left: not an attempt, and nothing new may have
    // happened.
    note_error(
        next,
        format!(
            "step `{}` refused before it was sent (not counted as an attempt): {}",
            shape.steps[i].name, failure.error
        ),
    );
    next.attempts = claim.record.attempts.saturating_sub(1);
    next.outcome_unknown = claim.unknown_before;
    let wait = shape.refusal_wait(failure.retry_after);
    if shape.forward_only(i, claim.unknown_before) {
        retry_forward(next, shape, wait, now);
    } else {
        next.next_attempt_at = now + delta(wait);
    }
}

/// Step `i`'s call failed (or may have taken effect): retry it, retry it
/// forward past the pivot, or compensate.
fn action_failed(
    next: &mut SagaRecord,
    claim: &Claim,
    shape: &Shape,
    i: usize,
    failure: &Failure<'_>,
    now: DateTime<Utc>,
) {
    let Failure { class, error, .. } = *failure;
    let attempts = claim.record.attempts;
    let unknown = claim.unknown_before || class == ErrorClass::OutcomeUnknown;
    let maybe = if unknown && !claim.unknown_before {
        " (it may have taken effect)"
    } else if unknown {
        " (an earlier attempt may have taken effect)"
    } else {
        ""
    };
    note_error(
        next,
        format!(
            "step `{}` attempt {attempts}{maybe}: {error}",
            shape.steps[i].name
        ),
    );
    next.outcome_unknown = unknown;
    if shape.forward_only(i, unknown) {
        // No way back: retry forward with the same key until the
        // budget is spent, then a human must look.
        retry_forward(next, shape, shape.delay(attempts), now);
    } else if worth_retrying(class) && attempts < shape.attempt_limit(claim.call) {
        next.next_attempt_at = now + delta(shape.delay(attempts));
    } else {
        // Undo everything done, and this step too if any attempt
        // at it may have taken effect.
        let upper = if unknown { i + 1 } else { i };
        enter_compensation(next, shape, upper);
    }
}

/// How a call failed.
#[derive(Clone, Copy)]
struct Failure<'a> {
    class: ErrorClass,
    error: &'a str,
    retry_after: Option<Duration>,
}

/// Step `j`'s compensation failed: retry it, or park the saga for a human.
fn compensation_failed(
    next: &mut SagaRecord,
    claim: &Claim,
    shape: &Shape,
    j: usize,
    failure: &Failure<'_>,
    now: DateTime<Utc>,
) {
    let attempts = claim.record.attempts;
    let refused = failure.class == ErrorClass::Rejected;
    let what = if refused {
        "refused before it was sent (not counted as an attempt)".to_owned()
    } else {
        format!("attempt {attempts}")
    };
    note_error(
        next,
        format!(
            "compensation of `{}` {what}: {}",
            shape.steps[j].name, failure.error
        ),
    );
    if refused {
        next.attempts = attempts.saturating_sub(1);
        next.next_attempt_at = now + delta(shape.refusal_wait(failure.retry_after));
    } else if worth_retrying(failure.class) && attempts < shape.attempt_limit(claim.call) {
        next.next_attempt_at = now + delta(shape.delay(attempts));
    } else {
        park(next, now);
        next.step = index_u32(j);
    }
}

/// Forward recovery: the next attempt after `wait`, or stuck if it would
/// start after the budget (counted from the call's first attempt) is spent.
fn retry_forward(record: &mut SagaRecord, shape: &Shape, wait: Duration, now: DateTime<Utc>) {
    let at = now + delta(wait);
    if shape.budget_spent(record, at) {
        let budget = shape.forward_budget;
        record.last_error = Some(format!(
            "{}; gave up going forward after its budget of {budget:?}: an operator must retry \
             it (it cannot be compensated)",
            record.last_error.as_deref().unwrap_or("no error")
        ));
        park(record, now);
    } else {
        record.next_attempt_at = at;
    }
}

/// Whether a failure of `class` may go away by trying again. Permanent
/// failures and anything nobody classified are not retried.
fn worth_retrying(class: ErrorClass) -> bool {
    matches!(class, ErrorClass::Retryable | ErrorClass::OutcomeUnknown)
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
    record.first_attempt_at = None;
    // Folded into `upper`: the step is undone if it may have happened.
    record.outcome_unknown = false;
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

/// `next`, worked out from a record not saved yet, as the one save over
/// `saved` that carries both: the version right after `saved`'s (every
/// transition bumps the version by one, and the store checks it).
pub(crate) fn rebase(mut next: SagaRecord, saved: &SagaRecord) -> SagaRecord {
    next.version = saved.version.saturating_add(1);
    next
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
