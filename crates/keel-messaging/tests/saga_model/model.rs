//! The reference model of the saga machine: the record as the docs of
//! `saga/machine.rs` describe it, with time in whole minutes from the
//! saga's start.

use std::collections::VecDeque;

use keel_messaging::store::SagaStatus;

use super::{Answer, FAR, ID, NAMES};

/// A definition: steps, the pivot, which steps have a compensation, and
/// the limits, in minutes where they are times. Every step times out after
/// a minute and its lease has a minute of grace; backoffs are 1, 2, then
/// 4 minutes; a refusal without `Retry-After` waits a minute.
#[derive(Debug, Clone)]
pub(crate) struct Def {
    pub(crate) n: usize,
    pub(crate) pivot: Option<usize>,
    pub(crate) compensable: Vec<bool>,
    pub(crate) max_attempts: Vec<u32>,
    pub(crate) stuck_after: u32,
    pub(crate) budget: u32,
    pub(crate) deadline: Option<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Call {
    Action(usize),
    Undo(usize),
}

impl Call {
    /// The derived idempotency key every attempt at this call must carry.
    pub(crate) fn key(self) -> String {
        match self {
            Self::Action(i) => format!("{ID}:{}", NAMES[i]),
            Self::Undo(i) => format!("{ID}:undo:{}", NAMES[i]),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    Done,
    Retryable,
    Permanent,
    Unknown,
    Refused(Option<u32>),
}

/// The persisted record, as far as the model follows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rec {
    pub(crate) status: SagaStatus,
    pub(crate) step: usize,
    pub(crate) attempts: u32,
    /// The current step's action may have taken effect.
    pub(crate) unknown: bool,
    pub(crate) first: Option<u32>,
    pub(crate) next: u32,
}

/// A call claimed: the record as saved before it, and the version saved.
#[derive(Debug, Clone)]
pub(crate) struct Claim {
    call: Call,
    rec: Rec,
    unknown_before: bool,
    version: u64,
    applied: bool,
    /// The clock jumped since the call stalled.
    jumped: bool,
}

enum Plan {
    Idle,
    Save(Rec),
    Call(Claim),
}

pub(crate) struct Model {
    pub(crate) def: Def,
    pub(crate) now: u32,
    pub(crate) rec: Rec,
    /// Saves so far: an outcome for an older claim is not saved.
    version: u64,
    /// The claim whose call stalled, if its process still lives.
    pub(crate) straggler: Option<Claim>,
}

impl Model {
    pub(crate) fn new(def: Def) -> Self {
        let rec = Rec {
            status: SagaStatus::Running,
            step: 0,
            attempts: 0,
            unknown: false,
            first: None,
            next: 0,
        };
        Self {
            def,
            now: 0,
            rec,
            version: 1,
            straggler: None,
        }
    }

    /// At or past the pivot, or the pivot once it may have happened: no
    /// way back.
    fn forward_only(&self, i: usize, unknown: bool) -> bool {
        self.def.pivot.is_some_and(|p| i > p || (i == p && unknown))
    }

    fn compensable_below(&self, upper: usize) -> Option<usize> {
        (0..upper.min(self.def.n))
            .rev()
            .find(|&j| self.def.compensable[j])
    }

    /// The deadline, while it applies to `rec`: not past the pivot.
    fn deadline_for(&self, rec: &Rec) -> Option<u32> {
        let forward = self.forward_only(rec.step, rec.unknown);
        self.def.deadline.filter(|_| !forward)
    }

    /// The backoff after `attempts`: 1, 2, then 4 minutes.
    fn delay(attempts: u32) -> u32 {
        1 << attempts.saturating_sub(1).min(2)
    }

    fn enter_compensation(&self, rec: &mut Rec, upper: usize) {
        rec.status = SagaStatus::Compensating;
        rec.attempts = 0;
        rec.first = None;
        rec.unknown = false;
        match self.compensable_below(upper) {
            Some(j) => rec.step = j + 1,
            None => {
                rec.step = 0;
                rec.status = SagaStatus::Compensated;
            }
        }
    }

    fn park(rec: &mut Rec) {
        rec.status = SagaStatus::Stuck;
        rec.next = FAR;
    }

    /// Forward recovery: wait, or stuck once the budget from the call's
    /// first attempt would be spent.
    fn retry_forward(&self, rec: &mut Rec, wait: u32) {
        let at = self.now + wait;
        if rec.first.is_some_and(|f| at >= f + self.def.budget) {
            Self::park(rec);
        } else {
            rec.next = at;
        }
    }

    /// The deadline passed at running step `i`, before the pivot: back.
    fn expire(&self, i: usize) -> Rec {
        let mut rec = self.rec.clone();
        let upper = if rec.unknown { i + 1 } else { i };
        self.enter_compensation(&mut rec, upper);
        rec
    }

    fn plan(&self) -> Plan {
        let r = &self.rec;
        if r.next > self.now {
            return Plan::Idle;
        }
        let call = match r.status {
            SagaStatus::Running if self.deadline_for(r).is_some_and(|d| self.now >= d) => {
                return Plan::Save(self.expire(r.step));
            }
            SagaStatus::Running => Call::Action(r.step),
            SagaStatus::Compensating => match self.compensable_below(r.step) {
                None => {
                    let done = Rec {
                        status: SagaStatus::Compensated,
                        ..r.clone()
                    };
                    return Plan::Save(done);
                }
                Some(j) if j + 1 != r.step => {
                    let next = Rec {
                        step: j + 1,
                        attempts: 0,
                        first: None,
                        ..r.clone()
                    };
                    return Plan::Save(next);
                }
                Some(j) => Call::Undo(j),
            },
            _ => return Plan::Idle,
        };
        let given_up = match call {
            Call::Action(i) if self.forward_only(i, r.unknown) => {
                r.first.is_some_and(|f| self.now >= f + self.def.budget)
            }
            Call::Action(i) => r.attempts >= self.def.max_attempts[i],
            Call::Undo(_) => r.attempts >= self.def.stuck_after,
        };
        let mut claim = Claim {
            call,
            rec: r.clone(),
            unknown_before: r.unknown,
            version: 0,
            applied: false,
            jumped: false,
        };
        if given_up {
            // Every attempt was started and none reported back.
            return Plan::Save(self.decide(&claim, Outcome::Unknown));
        }
        let c = &mut claim.rec;
        c.attempts += 1;
        c.next = self.now + 2;
        c.first.get_or_insert(self.now);
        if let Call::Action(_) = call {
            c.unknown = true;
        }
        Plan::Call(claim)
    }

    fn decide(&self, claim: &Claim, outcome: Outcome) -> Rec {
        let mut next = claim.rec.clone();
        next.next = self.now;
        let attempts = claim.rec.attempts;
        let retryable = matches!(outcome, Outcome::Retryable | Outcome::Unknown);
        match (claim.call, outcome) {
            (Call::Action(i), Outcome::Done) => {
                next.step = i + 1;
                next.attempts = 0;
                next.unknown = false;
                next.first = None;
                if i + 1 >= self.def.n {
                    next.status = SagaStatus::Completed;
                }
            }
            (Call::Action(i), Outcome::Refused(after)) => {
                next.attempts = attempts.saturating_sub(1);
                next.unknown = claim.unknown_before;
                let wait = after.unwrap_or(1);
                if self.forward_only(i, claim.unknown_before) {
                    self.retry_forward(&mut next, wait);
                } else {
                    next.next = self.now + wait;
                }
            }
            (Call::Action(i), _) => {
                let unknown = claim.unknown_before || outcome == Outcome::Unknown;
                next.unknown = unknown;
                if self.forward_only(i, unknown) {
                    self.retry_forward(&mut next, Self::delay(attempts));
                } else if retryable && attempts < self.def.max_attempts[i] {
                    next.next = self.now + Self::delay(attempts);
                } else {
                    self.enter_compensation(&mut next, if unknown { i + 1 } else { i });
                }
            }
            (Call::Undo(j), Outcome::Done) => self.enter_compensation(&mut next, j),
            (Call::Undo(_), Outcome::Refused(after)) => {
                next.attempts = attempts.saturating_sub(1);
                next.next = self.now + after.unwrap_or(1);
            }
            (Call::Undo(j), _) if !(retryable && attempts < self.def.stuck_after) => {
                Self::park(&mut next);
                next.step = j;
            }
            (Call::Undo(_), _) => next.next = self.now + Self::delay(attempts),
        }
        if let (SagaStatus::Running, Some(d)) = (next.status, self.deadline_for(&next)) {
            // A retry waits no longer than the deadline, which then decides.
            next.next = next.next.min(d);
        }
        next
    }

    fn save(&mut self, rec: Rec) {
        self.rec = rec;
        self.version += 1;
    }

    /// An orchestrator drives the saga: planned saves and calls until it
    /// rests, or a call stalls. Calls get `answers`, then refusals.
    pub(crate) fn drive(&mut self, answers: &mut VecDeque<Answer>) {
        loop {
            match self.plan() {
                Plan::Idle => return,
                Plan::Save(rec) => self.save(rec),
                Plan::Call(mut claim) => {
                    self.save(claim.rec.clone());
                    let answer = answers.pop_front().unwrap_or(Answer::Refused(None));
                    if let Answer::Stall { applied } = answer {
                        claim.version = self.version;
                        claim.applied = applied;
                        self.straggler = Some(claim);
                        return;
                    }
                    let next = self.decide(&claim, answer.outcome());
                    self.save(next);
                }
            }
        }
    }

    /// The clock moves.
    pub(crate) fn advance(&mut self, minutes: u32) {
        self.now += minutes;
        if let Some(claim) = &mut self.straggler {
            claim.jumped = true;
        }
    }

    /// Whether the stalled call's process holds a copy of the record the
    /// test cannot keep true: the clock jumped (the test moved the stored
    /// instants back, not the ones that process holds) and its claim is
    /// still the latest, so it would save them.
    pub(crate) fn straggler_is_off_clock(&self) -> bool {
        self.straggler
            .as_ref()
            .is_some_and(|c| c.jumped && c.version == self.version)
    }

    /// The stalled call returns `answer`: saved only if its claim is still
    /// the latest version; then its orchestrator goes on, refused.
    pub(crate) fn resume(&mut self, answer: Answer) {
        let Some(claim) = self.straggler.take() else {
            return;
        };
        if claim.version != self.version {
            return;
        }
        let answer = if claim.applied {
            answer.after_effect()
        } else {
            answer
        };
        let next = self.decide(&claim, answer.outcome());
        self.save(next);
        self.drive(&mut VecDeque::new());
    }

    /// An operator's retry: only of a stuck saga; attempts reset, due now,
    /// forward at or past the pivot, else compensating.
    pub(crate) fn retry(&mut self) -> bool {
        if self.rec.status != SagaStatus::Stuck {
            return false;
        }
        let mut rec = self.rec.clone();
        rec.attempts = 0;
        rec.next = self.now;
        rec.first = None;
        if self.def.pivot.is_some_and(|p| rec.step >= p) {
            rec.status = SagaStatus::Running;
        } else {
            rec.status = SagaStatus::Compensating;
            rec.step += 1;
        }
        self.save(rec);
        true
    }
}
