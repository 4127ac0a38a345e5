//! What a ledger check found: each kind of violation, and the report.

use std::fmt;

use keel_store::SagaStatus;

/// What a [`Ledger`](super::Ledger) found: counts of what it was told, and every
/// violation, grouped by invariant, sorted by id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct LedgerReport {
    /// Events committed.
    pub committed: usize,
    /// Events whose transaction aborted.
    pub aborted: usize,
    /// Distinct events seen published.
    pub published: usize,
    /// Publish observations beyond the first of each event (republishes).
    pub republished: usize,
    /// Effects recorded, repeats included.
    pub applied: usize,
    /// Dead-lettered (event id, handler) pairs.
    pub dead_lettered: Vec<(String, String)>,
    /// Handlers every event had to reach.
    pub handlers: Vec<String>,
    /// Sagas known.
    pub sagas: usize,
    /// Committed events some mandatory handler never applied (nor
    /// dead-lettered); with no mandatory handler, committed events never
    /// published nor applied.
    pub lost: Vec<Lost>,
    /// Events a handler applied more than once, or applied and also
    /// dead-lettered.
    pub duplicated: Vec<Duplicated>,
    /// Events of aborted transactions that were published, applied or
    /// dead-lettered.
    pub leaked: Vec<Stray>,
    /// Events published, applied or dead-lettered that were never
    /// committed (nor aborted): phantoms, or facts fed wrong.
    pub unknown: Vec<Stray>,
    /// Events recorded both as committed and as aborted (when they were
    /// also seen, they are in `leaked` too).
    pub contradictions: Vec<String>,
    /// Events published or applied after a later event of their key.
    pub out_of_order: Vec<OutOfOrder>,
    /// Sagas that did not end completed or fully compensated.
    pub sagas_unsettled: Vec<UnsettledSaga>,
}

/// A committed event that did not reach everyone it had to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lost {
    /// The event.
    pub event_id: String,
    /// Its partition key.
    pub key: String,
    /// Its sequence within the key.
    pub seq: u64,
    /// The mandatory handlers that never applied it (empty when there is
    /// none and it was never published).
    pub missing: Vec<String>,
    /// Whether it was ever seen published (tells a relay loss from a
    /// consumer loss).
    pub published: bool,
}

/// An event applied more than once by one handler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Duplicated {
    /// The event.
    pub event_id: String,
    /// The handler.
    pub handler: String,
    /// How many effects it had.
    pub times: usize,
    /// Whether it was also dead-lettered by that handler.
    pub dead_lettered: bool,
}

/// An event seen where it should not exist.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stray {
    /// The event.
    pub event_id: String,
    /// How many times it was seen published.
    pub published: usize,
    /// The handlers that applied it.
    pub applied_by: Vec<String>,
    /// The handlers that dead-lettered it.
    pub dead_lettered_by: Vec<String>,
}

/// Where an order violation was seen.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stage {
    /// In the order events were published.
    Published,
    /// In the order a handler's effects committed.
    Applied {
        /// The handler.
        handler: String,
    },
}

impl fmt::Display for Stage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Published => f.write_str("published"),
            Self::Applied { handler } => write!(f, "applied by {handler}"),
        }
    }
}

/// An event that came after a later event of its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutOfOrder {
    /// The partition key.
    pub key: String,
    /// Where.
    pub stage: Stage,
    /// The event that came too late.
    pub event_id: String,
    /// Its sequence.
    pub seq: u64,
    /// The later event that came before it.
    pub after_event_id: String,
    /// That event's sequence.
    pub after_seq: u64,
}

/// A saga that did not end well.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnsettledSaga {
    /// The saga.
    pub saga_id: String,
    /// What is wrong with it.
    pub problem: SagaProblem,
}

/// What is wrong with a saga.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SagaProblem {
    /// Its end was never recorded.
    NotEnded,
    /// It ended neither completed nor compensated.
    EndedAs(SagaStatus),
    /// Completed, but these steps' actions never took effect.
    StepsMissing(Vec<String>),
    /// Completed, but these steps were compensated.
    UndoneButCompleted(Vec<String>),
    /// Compensated, but these steps' actions took effect and were never
    /// undone.
    NotUndone(Vec<String>),
    /// An action or a compensation took effect more than once.
    DuplicateEffect {
        /// The step.
        step: String,
        /// Whether it is the compensation.
        compensation: bool,
        /// How many times.
        times: usize,
    },
    /// Its effects happened in an impossible order (actions not in step
    /// order, compensations not in reverse, an action after an undo); the
    /// effects as observed, `undo:` marking compensations.
    OutOfOrder(Vec<String>),
    /// An effect names a step the saga does not have.
    UnknownStep(String),
}

impl fmt::Display for SagaProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::NotEnded => f.write_str("never ended"),
            Self::EndedAs(status) => write!(f, "ended {}", status.as_str()),
            Self::StepsMissing(steps) => write!(f, "completed without steps {steps:?}"),
            Self::UndoneButCompleted(steps) => {
                write!(f, "completed but compensated steps {steps:?}")
            }
            Self::NotUndone(steps) => write!(f, "compensated but never undid steps {steps:?}"),
            Self::DuplicateEffect {
                step,
                compensation,
                times,
            } => {
                let what = if *compensation {
                    "compensation"
                } else {
                    "action"
                };
                write!(f, "the {what} of `{step}` took effect {times} times")
            }
            Self::OutOfOrder(effects) => write!(f, "effects out of order: {effects:?}"),
            Self::UnknownStep(step) => write!(f, "an effect of unknown step `{step}`"),
        }
    }
}

impl LedgerReport {
    /// Whether every invariant holds.
    pub fn is_clean(&self) -> bool {
        self.lost.is_empty()
            && self.duplicated.is_empty()
            && self.leaked.is_empty()
            && self.unknown.is_empty()
            && self.contradictions.is_empty()
            && self.out_of_order.is_empty()
            && self.sagas_unsettled.is_empty()
    }

    /// Every violation, one line each, with its ids.
    pub fn violations(&self) -> Vec<String> {
        let mut lines = Vec::new();
        for l in &self.lost {
            let stage = if l.published {
                "published but"
            } else {
                "never published,"
            };
            let whom = if l.missing.is_empty() {
                String::new()
            } else {
                format!(" by {}", l.missing.join(", "))
            };
            lines.push(format!(
                "lost: {} (key {} #{}) {stage} never applied{whom}",
                l.event_id, l.key, l.seq
            ));
        }
        for d in &self.duplicated {
            let dead = if d.dead_lettered {
                " and also dead-lettered"
            } else {
                ""
            };
            lines.push(format!(
                "duplicated: {} applied {} times by {}{dead}",
                d.event_id, d.times, d.handler
            ));
        }
        for (what, strays) in [
            ("leaked from an aborted transaction", &self.leaked),
            ("never committed", &self.unknown),
        ] {
            for s in strays {
                lines.push(format!(
                    "{what}: {} (published {} times, applied by {:?}, dead-lettered by {:?})",
                    s.event_id, s.published, s.applied_by, s.dead_lettered_by
                ));
            }
        }
        for id in &self.contradictions {
            lines.push(format!(
                "contradiction: {id} recorded as committed and aborted"
            ));
        }
        for o in &self.out_of_order {
            lines.push(format!(
                "out of order: key {} {}: {} (#{}) after {} (#{})",
                o.key, o.stage, o.event_id, o.seq, o.after_event_id, o.after_seq
            ));
        }
        for s in &self.sagas_unsettled {
            lines.push(format!("saga {}: {}", s.saga_id, s.problem));
        }
        lines
    }
}

impl fmt::Display for LedgerReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} committed, {} aborted, {} published ({} republishes), {} effects, \
             {} dead-lettered, {} sagas: ",
            self.committed,
            self.aborted,
            self.published,
            self.republished,
            self.applied,
            self.dead_lettered.len(),
            self.sagas
        )?;
        let violations = self.violations();
        if violations.is_empty() {
            return f.write_str("every invariant holds");
        }
        write!(f, "{} violation(s)", violations.len())?;
        for line in violations {
            write!(f, "\n  - {line}")?;
        }
        Ok(())
    }
}

/// The history broke an invariant; [`Display`](fmt::Display) lists every
/// violation with its ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerError {
    pub(super) report: Box<LedgerReport>,
}

impl LedgerError {
    /// The full report.
    pub fn report(&self) -> &LedgerReport {
        &self.report
    }

    /// Converts into the full report.
    pub fn into_report(self) -> LedgerReport {
        *self.report
    }
}

impl fmt::Display for LedgerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "messaging invariants violated: {}", self.report)
    }
}

impl std::error::Error for LedgerError {}
