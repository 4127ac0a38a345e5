//! The whole saga's deadline: elapsed time from the saga's start, however
//! its steps spend it. A step does not start with too little time left, a
//! call is cut to the time left, and when it passes the saga turns back.
//!
//! Past the pivot there is no way back, so the deadline no longer applies:
//! forward recovery goes on with backoff ("retry forever"), within
//! its own budget, and parks only when that budget is spent. Parking there
//! for the deadline instead left a saga no operator could move: a retry met
//! the passed deadline again at once (the saga model found it).

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::{Call, Shape, bump, delta, enter_compensation, note_error};
use crate::store::SagaRecord;

impl Shape {
    /// When `record`'s whole-saga deadline passes, if it has one and it
    /// still applies: not past the pivot, where the saga cannot turn back.
    pub(crate) fn deadline_at(&self, record: &SagaRecord) -> Option<DateTime<Utc>> {
        if self.forward_only(record.step as usize, record.outcome_unknown) {
            return None;
        }
        self.deadline.map(|d| record.created_at + delta(d))
    }
}

/// How long `call` may run now: its step's timeout, cut to the time left
/// before the saga's deadline for an action (an undo is never cut short).
pub(crate) fn call_timeout(
    record: &SagaRecord,
    shape: &Shape,
    call: Call,
    now: DateTime<Utc>,
) -> Duration {
    let timeout = shape.step(call).timeout;
    match (call, shape.deadline_at(record)) {
        (Call::Action(_), Some(at)) => (at - now).to_std().unwrap_or_default().min(timeout),
        _ => timeout,
    }
}

/// A running saga at step `i` whose deadline passed, before the pivot:
/// compensating what was done, and step `i` if it may have happened.
pub(super) fn expire(
    record: &SagaRecord,
    shape: &Shape,
    i: usize,
    now: DateTime<Utc>,
) -> SagaRecord {
    let mut next = bump(record, now);
    let deadline = shape.deadline.unwrap_or_default();
    let step = &shape.steps[i].name;
    note_error(
        &mut next,
        format!("saga deadline of {deadline:?} passed at step `{step}`: compensating"),
    );
    let upper = if record.outcome_unknown { i + 1 } else { i };
    enter_compensation(&mut next, shape, upper);
    next
}
