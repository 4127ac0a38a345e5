//! An end-to-end invariant checker for durable messaging: fed facts, it says
//! what was lost, applied twice, leaked from an aborted transaction, applied
//! out of order, or left a saga half done.
//!
//! Asserting "the charges table has 40 rows" after a crash test proves
//! little: 40 rows can hide one lost charge and one double charge. The
//! guarantees users rely on are relations between *histories*: every
//! committed event is applied once by every handler, nothing from an
//! aborted transaction ever leaves, each entity's events take effect in
//! order, and every saga ends completed or fully compensated. A
//! [`Ledger`] holds those histories, fed by a test (or by `keel chaos`, or
//! a PostgreSQL/NATS run) from wherever it observes them, and
//! [`check`](Ledger::check) compares them. It knows no database or broker:
//! facts are plain ids, so the same checker judges every backend.
//!
//! The facts:
//!
//! - [`committed`](Ledger::committed): a business transaction committed an
//!   event (its id, its partition key, its per-key sequence);
//! - [`aborted`](Ledger::aborted): a transaction that wrote an event rolled
//!   back (or never committed);
//! - [`published`](Ledger::published): the event was seen on the broker, in
//!   the order observed;
//! - [`applied`](Ledger::applied): a handler's effect for the event
//!   committed, in commit order;
//! - [`dead_lettered`](Ledger::dead_lettered): a handler gave the event up
//!   to the dead-letter store;
//! - [`saga_started`](Ledger::saga_started), [`saga_action`](Ledger::saga_action),
//!   [`saga_compensation`](Ledger::saga_compensation) and
//!   [`saga_ended`](Ledger::saga_ended): a saga's steps, the effects its
//!   calls had, and where it ended.
//!
//! Feed effects in the order they *committed* (read them back ordered by an
//! autoincrement column of the effect table, say), not in the order handlers
//! were called: a handler whose transaction rolled back had no effect.
//!
//! ```
//! use keel_testkit::ledger::Ledger;
//!
//! let ledger = Ledger::with_handlers(["billing"]);
//! ledger.committed("e1", "order-7", 1);
//! ledger.committed("e2", "order-7", 2);
//! ledger.aborted("e3");
//! ledger.published("e1");
//! ledger.published("e2");
//! ledger.published("e3"); // leaked from a rolled-back transaction
//! ledger.applied("e2", "billing");
//! ledger.applied("e1", "billing"); // out of order
//! ledger.applied("e1", "billing"); // twice
//!
//! let err = ledger.check().unwrap_err();
//! assert_eq!(err.report().leaked[0].event_id, "e3");
//! assert_eq!(err.report().duplicated[0].event_id, "e1");
//! assert_eq!(err.report().out_of_order[0].event_id, "e1");
//! assert!(err.to_string().contains("e3"));
//! ```

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use keel_messaging::store::SagaStatus;

/// Collects facts about a messaging history and checks its invariants.
/// Cheap to clone (clones share the facts) and safe to feed from many
/// threads at once; every fact costs one short lock and one push.
#[derive(Debug, Clone, Default)]
pub struct Ledger {
    facts: Arc<RwLock<Facts>>,
}

#[derive(Debug, Default)]
struct Facts {
    /// Handlers every committed event must reach.
    handlers: BTreeSet<String>,
    /// Event id → where it belongs.
    committed: HashMap<String, Committed>,
    aborted: BTreeSet<String>,
    /// Event ids in the order they were seen published (repeats included).
    publishes: Vec<String>,
    /// (event id, handler) in commit order (repeats included).
    effects: Vec<(String, String)>,
    /// (event id, handler) given up to the dead-letter store.
    dead: Vec<(String, String)>,
    sagas: BTreeMap<String, SagaFacts>,
}

#[derive(Debug, Clone)]
struct Committed {
    key: String,
    seq: u64,
}

#[derive(Debug, Default)]
struct SagaFacts {
    steps: Option<Vec<String>>,
    /// (step, is a compensation) in the order the effects happened.
    effects: Vec<(String, bool)>,
    ended: Option<SagaStatus>,
}

impl Ledger {
    /// An empty ledger with no mandatory handler: an event then counts as
    /// delivered once it is published or applied by anyone.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty ledger in which every committed event must be applied (or
    /// dead-lettered) by each of `handlers`.
    pub fn with_handlers<I, S>(handlers: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let ledger = Self::new();
        for handler in handlers {
            ledger.expect_handler(handler);
        }
        ledger
    }

    /// Makes `handler` mandatory: each committed event must be applied (or
    /// dead-lettered) by it. Handlers seen only in facts are checked for
    /// duplicates, leaks and order, but an event they never applied is not
    /// lost (they may handle only some event types).
    pub fn expect_handler(&self, handler: impl Into<String>) {
        self.write().handlers.insert(handler.into());
    }

    /// A business transaction committed event `event_id`, the `seq`-th
    /// event of partition key `key` (sequences increase with commit order
    /// within a key, like an entity's version).
    pub fn committed(&self, event_id: impl Into<String>, key: impl Into<String>, seq: u64) {
        let committed = Committed {
            key: key.into(),
            seq,
        };
        self.write().committed.insert(event_id.into(), committed);
    }

    /// The transaction that wrote `event_id` rolled back or never
    /// committed: the event must never be seen anywhere.
    pub fn aborted(&self, event_id: impl Into<String>) {
        self.write().aborted.insert(event_id.into());
    }

    /// `event_id` was seen on the broker. Call once per observation, in the
    /// order observed; repeats (republishes) are allowed.
    pub fn published(&self, event_id: impl Into<String>) {
        self.write().publishes.push(event_id.into());
    }

    /// `handler`'s effect for `event_id` committed. Call once per effect
    /// row, in commit order.
    pub fn applied(&self, event_id: impl Into<String>, handler: impl Into<String>) {
        self.write().effects.push((event_id.into(), handler.into()));
    }

    /// `handler` gave `event_id` up to the dead-letter store: delivered, not
    /// lost, and never to be applied as well.
    pub fn dead_lettered(&self, event_id: impl Into<String>, handler: impl Into<String>) {
        self.write().dead.push((event_id.into(), handler.into()));
    }

    /// Saga `saga_id` exists, with these steps in order (so the checker
    /// knows what "completed" and "reverse order" mean for it).
    pub fn saga_started<I, S>(&self, saga_id: impl Into<String>, steps: I)
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let steps = steps.into_iter().map(Into::into).collect();
        self.write().sagas.entry(saga_id.into()).or_default().steps = Some(steps);
    }

    /// The action of `step` of saga `saga_id` took effect (as the called
    /// service saw it). Call once per effect, in the order they happened.
    pub fn saga_action(&self, saga_id: impl Into<String>, step: impl Into<String>) {
        self.saga_effect(saga_id.into(), step.into(), false);
    }

    /// The compensation of `step` of saga `saga_id` took effect.
    pub fn saga_compensation(&self, saga_id: impl Into<String>, step: impl Into<String>) {
        self.saga_effect(saga_id.into(), step.into(), true);
    }

    fn saga_effect(&self, saga_id: String, step: String, compensation: bool) {
        self.write()
            .sagas
            .entry(saga_id)
            .or_default()
            .effects
            .push((step, compensation));
    }

    /// Saga `saga_id` was last seen in `status`. The last call wins.
    pub fn saga_ended(&self, saga_id: impl Into<String>, status: SagaStatus) {
        self.write().sagas.entry(saga_id.into()).or_default().ended = Some(status);
    }

    /// Compares the histories: `Ok` with the report when every invariant
    /// holds, otherwise an error that lists every violation with its ids
    /// (and carries the same report).
    pub fn check(&self) -> Result<LedgerReport, LedgerError> {
        let report = self.report();
        if report.is_clean() {
            Ok(report)
        } else {
            Err(LedgerError {
                report: Box::new(report),
            })
        }
    }

    /// The report, clean or not.
    pub fn report(&self) -> LedgerReport {
        self.read().report()
    }

    fn read(&self) -> RwLockReadGuard<'_, Facts> {
        self.facts.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write(&self) -> RwLockWriteGuard<'_, Facts> {
        self.facts.write().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What a [`Ledger`] found: counts of what it was told, and every
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
    report: Box<LedgerReport>,
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

// ------------------------------------------------------------- checking --

/// Per event: publish count, handlers that applied it (with counts), and
/// handlers that dead-lettered it.
#[derive(Default)]
struct Seen<'a> {
    published: usize,
    applied: BTreeMap<&'a str, usize>,
    dead: BTreeSet<&'a str>,
}

impl Facts {
    fn report(&self) -> LedgerReport {
        let seen = self.seen();
        let mut report = LedgerReport {
            committed: self.committed.len(),
            aborted: self.aborted.len(),
            published: seen.values().filter(|s| s.published > 0).count(),
            republished: seen.values().map(|s| s.published.saturating_sub(1)).sum(),
            applied: self.effects.len(),
            dead_lettered: sorted_unique(&self.dead),
            handlers: self.handlers.iter().cloned().collect(),
            sagas: self.sagas.len(),
            ..LedgerReport::default()
        };
        self.check_events(&seen, &mut report);
        report.contradictions.sort();
        self.check_order(&mut report);
        self.check_sagas(&mut report);
        report
    }

    fn seen(&self) -> BTreeMap<&str, Seen<'_>> {
        let mut seen: BTreeMap<&str, Seen<'_>> = BTreeMap::new();
        for id in &self.publishes {
            seen.entry(id).or_default().published += 1;
        }
        for (id, handler) in &self.effects {
            *seen
                .entry(id)
                .or_default()
                .applied
                .entry(handler)
                .or_default() += 1;
        }
        for (id, handler) in &self.dead {
            seen.entry(id).or_default().dead.insert(handler);
        }
        seen
    }

    /// Lost, duplicated, leaked, unknown and contradictory events.
    fn check_events(&self, seen: &BTreeMap<&str, Seen<'_>>, report: &mut LedgerReport) {
        let nothing = Seen::default();
        let mut committed: Vec<(&String, &Committed)> = self.committed.iter().collect();
        committed.sort_by(|a, b| (&a.1.key, a.1.seq, a.0).cmp(&(&b.1.key, b.1.seq, b.0)));
        for (id, c) in committed {
            let s = seen.get(id.as_str()).unwrap_or(&nothing);
            let missing: Vec<String> = self
                .handlers
                .iter()
                .filter(|h| !s.applied.contains_key(h.as_str()) && !s.dead.contains(h.as_str()))
                .cloned()
                .collect();
            let unseen = self.handlers.is_empty()
                && s.published == 0
                && s.applied.is_empty()
                && s.dead.is_empty();
            if !missing.is_empty() || unseen {
                report.lost.push(Lost {
                    event_id: id.clone(),
                    key: c.key.clone(),
                    seq: c.seq,
                    missing,
                    published: s.published > 0,
                });
            }
            if self.aborted.contains(id) {
                report.contradictions.push(id.clone());
            }
        }
        for (id, s) in seen {
            for (handler, times) in &s.applied {
                let dead = s.dead.contains(handler);
                if *times > 1 || dead {
                    report.duplicated.push(Duplicated {
                        event_id: (*id).to_owned(),
                        handler: (*handler).to_owned(),
                        times: *times,
                        dead_lettered: dead,
                    });
                }
            }
            let stray = || Stray {
                event_id: (*id).to_owned(),
                published: s.published,
                applied_by: s.applied.keys().map(|h| (*h).to_owned()).collect(),
                dead_lettered_by: s.dead.iter().map(|h| (*h).to_owned()).collect(),
            };
            // An event recorded both ways is a contradiction *and*, if it
            // was seen, a leak: the user believed it aborted.
            if self.aborted.contains(*id) {
                report.leaked.push(stray());
            } else if !self.committed.contains_key(*id) {
                report.unknown.push(stray());
            }
        }
    }

    /// Per key, the first publication and each handler's first effect of
    /// every committed event must follow the key's sequence.
    fn check_order(&self, report: &mut LedgerReport) {
        let mut streams: BTreeMap<Stage, Vec<&str>> = BTreeMap::new();
        streams.insert(
            Stage::Published,
            self.publishes.iter().map(String::as_str).collect(),
        );
        for (id, handler) in &self.effects {
            streams
                .entry(Stage::Applied {
                    handler: handler.clone(),
                })
                .or_default()
                .push(id);
        }
        for (stage, ids) in streams {
            let mut first_seen = BTreeSet::new();
            // Key → the highest (seq, event id) seen so far.
            let mut high: HashMap<&str, (u64, &str)> = HashMap::new();
            for id in ids {
                if !first_seen.insert(id) {
                    continue; // repeats are duplicates, not order problems
                }
                let Some(c) = self.committed.get(id) else {
                    continue;
                };
                match high.get(c.key.as_str()) {
                    Some(&(seq, after)) if seq >= c.seq => {
                        report.out_of_order.push(OutOfOrder {
                            key: c.key.clone(),
                            stage: stage.clone(),
                            event_id: id.to_owned(),
                            seq: c.seq,
                            after_event_id: after.to_owned(),
                            after_seq: seq,
                        });
                    }
                    _ => {
                        high.insert(c.key.as_str(), (c.seq, id));
                    }
                }
            }
        }
    }

    fn check_sagas(&self, report: &mut LedgerReport) {
        for (id, saga) in &self.sagas {
            for problem in saga.problems() {
                report.sagas_unsettled.push(UnsettledSaga {
                    saga_id: id.clone(),
                    problem,
                });
            }
        }
    }
}

impl SagaFacts {
    fn problems(&self) -> Vec<SagaProblem> {
        let mut problems = Vec::new();
        match self.ended {
            None => problems.push(SagaProblem::NotEnded),
            Some(SagaStatus::Completed | SagaStatus::Compensated) => {}
            Some(status) => problems.push(SagaProblem::EndedAs(status)),
        }
        let mut counts: BTreeMap<(&str, bool), usize> = BTreeMap::new();
        for (step, undo) in &self.effects {
            *counts.entry((step, *undo)).or_default() += 1;
        }
        for (&(step, compensation), &times) in &counts {
            if times > 1 {
                problems.push(SagaProblem::DuplicateEffect {
                    step: step.to_owned(),
                    compensation,
                    times,
                });
            }
        }
        let done = |undo: bool| -> Vec<String> {
            counts
                .keys()
                .filter(|(_, u)| *u == undo)
                .map(|(s, _)| (*s).to_owned())
                .collect()
        };
        match self.ended {
            Some(SagaStatus::Completed) => {
                if let Some(steps) = &self.steps {
                    let missing: Vec<String> = steps
                        .iter()
                        .filter(|s| !counts.contains_key(&(s.as_str(), false)))
                        .cloned()
                        .collect();
                    if !missing.is_empty() {
                        problems.push(SagaProblem::StepsMissing(missing));
                    }
                }
                let undone = done(true);
                if !undone.is_empty() {
                    problems.push(SagaProblem::UndoneButCompleted(undone));
                }
            }
            Some(SagaStatus::Compensated) => {
                let not_undone: Vec<String> = done(false)
                    .into_iter()
                    .filter(|s| !counts.contains_key(&(s.as_str(), true)))
                    .collect();
                if !not_undone.is_empty() {
                    problems.push(SagaProblem::NotUndone(self.in_step_order(not_undone)));
                }
            }
            _ => {}
        }
        if let Some(steps) = &self.steps {
            problems.extend(self.order_problems(steps));
        }
        problems
    }

    fn in_step_order(&self, mut names: Vec<String>) -> Vec<String> {
        if let Some(steps) = &self.steps {
            names.sort_by_key(|n| steps.iter().position(|s| s == n));
        }
        names
    }

    /// Actions in step order, compensations in reverse, no action after the
    /// first compensation (repeats ignored).
    fn order_problems(&self, steps: &[String]) -> Vec<SagaProblem> {
        let mut problems = Vec::new();
        let mut last_action: Option<usize> = None;
        let mut last_undo: Option<usize> = None;
        let mut in_order = true;
        let mut seen = BTreeSet::new();
        for (step, undo) in &self.effects {
            let Some(index) = steps.iter().position(|s| s == step) else {
                problems.push(SagaProblem::UnknownStep(step.clone()));
                continue;
            };
            if !seen.insert((index, *undo)) {
                continue;
            }
            if *undo {
                in_order &= last_undo.is_none_or(|prev| index < prev);
                last_undo = Some(index);
            } else {
                in_order &= last_undo.is_none() && last_action.is_none_or(|prev| index > prev);
                last_action = Some(index);
            }
        }
        if !in_order {
            let observed = self
                .effects
                .iter()
                .map(|(step, undo)| {
                    if *undo {
                        format!("undo:{step}")
                    } else {
                        step.clone()
                    }
                })
                .collect();
            problems.push(SagaProblem::OutOfOrder(observed));
        }
        problems
    }
}

fn sorted_unique(pairs: &[(String, String)]) -> Vec<(String, String)> {
    let set: BTreeSet<&(String, String)> = pairs.iter().collect();
    set.into_iter().cloned().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const STEPS: [&str; 3] = ["capture", "reserve", "ship"];

    /// Two keys, three events, two handlers, everything right.
    fn clean() -> Ledger {
        let ledger = Ledger::with_handlers(["billing", "audit"]);
        ledger.committed("a1", "A", 1);
        ledger.committed("a2", "A", 2);
        ledger.committed("b1", "B", 1);
        ledger.aborted("x1");
        for id in ["a1", "b1", "a1", "a2"] {
            ledger.published(id); // a republish of a1 is fine
        }
        for (id, handler) in [
            ("b1", "billing"),
            ("a1", "billing"),
            ("a1", "audit"),
            ("a2", "billing"),
            ("b1", "audit"),
            ("a2", "audit"),
        ] {
            ledger.applied(id, handler);
        }
        ledger.saga_started("s1", STEPS);
        for step in STEPS {
            ledger.saga_action("s1", step);
        }
        ledger.saga_ended("s1", SagaStatus::Completed);
        ledger.saga_started("s2", STEPS);
        ledger.saga_action("s2", "capture");
        ledger.saga_action("s2", "reserve");
        ledger.saga_compensation("s2", "reserve");
        ledger.saga_compensation("s2", "capture");
        ledger.saga_ended("s2", SagaStatus::Compensated);
        ledger
    }

    #[test]
    fn a_clean_history_passes_with_its_counts() {
        let report = clean().check().expect("clean");
        assert_eq!(report.committed, 3);
        assert_eq!(report.aborted, 1);
        assert_eq!(report.published, 3);
        assert_eq!(report.republished, 1);
        assert_eq!(report.applied, 6);
        assert_eq!(report.sagas, 2);
        assert_eq!(report.handlers, ["audit", "billing"]);
        assert!(report.to_string().ends_with("every invariant holds"));
    }

    #[test]
    fn a_committed_event_a_handler_never_applied_is_lost() {
        let ledger = clean();
        ledger.committed("a3", "A", 3);
        ledger.published("a3");
        ledger.applied("a3", "audit");
        ledger.committed("b2", "B", 2);
        let err = ledger.check().unwrap_err();
        let lost = &err.report().lost;
        assert_eq!(lost.len(), 2);
        assert_eq!(
            lost[0],
            Lost {
                event_id: "a3".into(),
                key: "A".into(),
                seq: 3,
                missing: vec!["billing".into()],
                published: true,
            }
        );
        assert_eq!(lost[1].event_id, "b2");
        assert_eq!(lost[1].missing, ["audit", "billing"]);
        assert!(!lost[1].published);
        let text = err.to_string();
        assert!(text.contains("lost: a3 (key A #3) published but never applied by billing"));
        assert!(text.contains("lost: b2 (key B #2) never published"));
    }

    #[test]
    fn a_dead_lettered_event_is_delivered_not_lost() {
        let ledger = clean();
        ledger.committed("poison", "P", 1);
        ledger.published("poison");
        ledger.dead_lettered("poison", "billing");
        ledger.dead_lettered("poison", "audit");
        let report = ledger.check().expect("dead letters are an outcome");
        assert_eq!(report.dead_lettered.len(), 2);
    }

    #[test]
    fn without_mandatory_handlers_an_unpublished_event_is_lost() {
        let ledger = Ledger::new();
        ledger.committed("e1", "K", 1);
        ledger.committed("e2", "K", 2);
        ledger.published("e1");
        let err = ledger.check().unwrap_err();
        assert_eq!(err.report().lost.len(), 1);
        assert_eq!(err.report().lost[0].event_id, "e2");
        assert!(err.report().lost[0].missing.is_empty());
    }

    #[test]
    fn an_effect_applied_twice_or_applied_and_dead_lettered_is_duplicated() {
        let ledger = clean();
        ledger.applied("a1", "billing");
        ledger.applied("a1", "billing");
        ledger.dead_lettered("b1", "audit");
        let err = ledger.check().unwrap_err();
        let dup = &err.report().duplicated;
        assert_eq!(dup.len(), 2);
        assert_eq!(
            (
                dup[0].event_id.as_str(),
                dup[0].handler.as_str(),
                dup[0].times
            ),
            ("a1", "billing", 3)
        );
        assert_eq!(
            (dup[1].event_id.as_str(), dup[1].dead_lettered),
            ("b1", true)
        );
        assert!(
            err.to_string()
                .contains("duplicated: a1 applied 3 times by billing")
        );
        assert!(
            err.report().out_of_order.is_empty(),
            "a repeat is a duplicate, not an order violation"
        );
    }

    #[test]
    fn an_aborted_event_seen_anywhere_is_leaked() {
        let ledger = clean();
        ledger.aborted("x2");
        ledger.aborted("x3");
        ledger.published("x1");
        ledger.applied("x2", "audit");
        ledger.dead_lettered("x3", "billing");
        let err = ledger.check().unwrap_err();
        let leaked: Vec<&str> = err
            .report()
            .leaked
            .iter()
            .map(|s| s.event_id.as_str())
            .collect();
        assert_eq!(leaked, ["x1", "x2", "x3"]);
        assert_eq!(err.report().leaked[1].applied_by, ["audit"]);
        assert!(
            err.to_string()
                .contains("leaked from an aborted transaction: x1 (published 1 times")
        );
    }

    #[test]
    fn an_event_nobody_committed_is_unknown_and_a_double_fact_a_contradiction() {
        let ledger = clean();
        ledger.published("ghost");
        ledger.aborted("a2");
        let err = ledger.check().unwrap_err();
        assert_eq!(err.report().unknown[0].event_id, "ghost");
        assert_eq!(err.report().contradictions, ["a2"]);
        assert_eq!(
            err.report().leaked[0].event_id,
            "a2",
            "seen although believed aborted"
        );
    }

    #[test]
    fn effects_or_publishes_against_the_key_sequence_are_out_of_order() {
        let ledger = Ledger::with_handlers(["billing"]);
        for (id, seq) in [("a1", 1), ("a2", 2), ("a3", 3)] {
            ledger.committed(id, "A", seq);
        }
        ledger.committed("b1", "B", 1);
        for id in ["a2", "b1", "a1", "a3"] {
            ledger.published(id);
        }
        for id in ["a1", "b1", "a3", "a2"] {
            ledger.applied(id, "billing");
        }
        let err = ledger.check().unwrap_err();
        let order = &err.report().out_of_order;
        assert_eq!(order.len(), 2, "{err}");
        assert_eq!(
            order[0],
            OutOfOrder {
                key: "A".into(),
                stage: Stage::Published,
                event_id: "a1".into(),
                seq: 1,
                after_event_id: "a2".into(),
                after_seq: 2,
            }
        );
        assert_eq!(
            order[1].stage,
            Stage::Applied {
                handler: "billing".into()
            }
        );
        assert_eq!(
            (order[1].event_id.as_str(), order[1].after_event_id.as_str()),
            ("a2", "a3")
        );
        assert!(
            err.to_string()
                .contains("out of order: key A applied by billing: a2 (#2) after a3 (#3)")
        );
    }

    fn saga_problems(ledger: &Ledger, saga: &str) -> Vec<SagaProblem> {
        let report = ledger.report();
        report
            .sagas_unsettled
            .into_iter()
            .filter(|s| s.saga_id == saga)
            .map(|s| s.problem)
            .collect()
    }

    #[test]
    fn a_saga_that_never_ended_or_ended_stuck_is_unsettled() {
        let ledger = clean();
        ledger.saga_started("s3", STEPS);
        ledger.saga_action("s3", "capture");
        ledger.saga_started("s4", STEPS);
        ledger.saga_ended("s4", SagaStatus::Stuck);
        ledger.saga_ended("s5", SagaStatus::Cancelled);
        assert_eq!(saga_problems(&ledger, "s3"), [SagaProblem::NotEnded]);
        assert_eq!(
            saga_problems(&ledger, "s4"),
            [SagaProblem::EndedAs(SagaStatus::Stuck)]
        );
        assert_eq!(
            saga_problems(&ledger, "s5"),
            [SagaProblem::EndedAs(SagaStatus::Cancelled)]
        );
        let err = ledger.check().unwrap_err();
        assert!(err.to_string().contains("saga s4: ended stuck"));
    }

    #[test]
    fn a_completed_saga_needs_every_action_and_no_undo() {
        let ledger = Ledger::new();
        ledger.saga_started("s", STEPS);
        ledger.saga_action("s", "capture");
        ledger.saga_compensation("s", "capture");
        ledger.saga_ended("s", SagaStatus::Completed);
        assert_eq!(
            saga_problems(&ledger, "s"),
            [
                SagaProblem::StepsMissing(vec!["reserve".into(), "ship".into()]),
                SagaProblem::UndoneButCompleted(vec!["capture".into()]),
            ]
        );
    }

    #[test]
    fn a_compensated_saga_must_undo_every_action_once_in_reverse() {
        let ledger = Ledger::new();
        ledger.saga_started("s", STEPS);
        ledger.saga_action("s", "capture");
        ledger.saga_action("s", "reserve");
        ledger.saga_compensation("s", "capture");
        ledger.saga_compensation("s", "capture");
        ledger.saga_ended("s", SagaStatus::Compensated);
        let problems = saga_problems(&ledger, "s");
        assert!(problems.contains(&SagaProblem::NotUndone(vec!["reserve".into()])));
        assert!(problems.contains(&SagaProblem::DuplicateEffect {
            step: "capture".into(),
            compensation: true,
            times: 2,
        }));

        let ledger = Ledger::new();
        ledger.saga_started("s", STEPS);
        ledger.saga_action("s", "capture");
        ledger.saga_action("s", "reserve");
        ledger.saga_compensation("s", "capture");
        ledger.saga_compensation("s", "reserve");
        ledger.saga_ended("s", SagaStatus::Compensated);
        assert_eq!(
            saga_problems(&ledger, "s"),
            [SagaProblem::OutOfOrder(vec![
                "capture".into(),
                "reserve".into(),
                "undo:capture".into(),
                "undo:reserve".into(),
            ])]
        );
    }

    #[test]
    fn saga_actions_out_of_step_order_or_after_an_undo_are_caught() {
        let ledger = Ledger::new();
        ledger.saga_started("s", STEPS);
        ledger.saga_action("s", "reserve");
        ledger.saga_action("s", "capture");
        ledger.saga_action("s", "ship");
        ledger.saga_action("s", "teleport");
        ledger.saga_ended("s", SagaStatus::Completed);
        let problems = saga_problems(&ledger, "s");
        assert!(problems.contains(&SagaProblem::UnknownStep("teleport".into())));
        assert!(matches!(problems.last(), Some(SagaProblem::OutOfOrder(_))));

        let ledger = Ledger::new();
        ledger.saga_started("s", STEPS);
        ledger.saga_action("s", "capture");
        ledger.saga_compensation("s", "capture");
        ledger.saga_action("s", "reserve");
        ledger.saga_compensation("s", "reserve");
        ledger.saga_ended("s", SagaStatus::Compensated);
        assert!(matches!(
            saga_problems(&ledger, "s").as_slice(),
            [SagaProblem::OutOfOrder(_)]
        ));
    }

    #[test]
    fn a_compensation_without_its_action_is_fine() {
        // A timed-out action is compensated because it may have happened.
        let ledger = Ledger::new();
        ledger.saga_started("s", STEPS);
        ledger.saga_action("s", "capture");
        ledger.saga_compensation("s", "reserve");
        ledger.saga_compensation("s", "capture");
        ledger.saga_ended("s", SagaStatus::Compensated);
        assert!(ledger.check().is_ok(), "{}", ledger.report());
    }

    #[test]
    fn the_error_lists_every_violation() {
        let ledger = clean();
        ledger.committed("lost", "L", 1);
        ledger.applied("a1", "audit");
        ledger.published("x1");
        ledger.saga_ended("s1", SagaStatus::Stuck);
        let err = ledger.check().unwrap_err();
        let report = err.report();
        assert_eq!(report.violations().len(), 4, "{err}");
        let text = err.to_string();
        for id in ["lost", "a1", "x1", "s1"] {
            assert!(text.contains(id), "{id} missing from {text}");
        }
        assert!(text.contains("4 violation(s)"));
    }

    #[test]
    fn facts_from_many_threads_all_count() {
        let ledger = Ledger::with_handlers(["h"]);
        std::thread::scope(|scope| {
            for t in 0..4 {
                let ledger = ledger.clone();
                scope.spawn(move || {
                    for i in 0..250u64 {
                        let id = format!("t{t}-{i}");
                        ledger.committed(id.clone(), format!("k{t}"), i);
                        ledger.published(id.clone());
                        ledger.applied(id, "h");
                    }
                });
            }
        });
        let report = ledger.check().expect("clean");
        assert_eq!((report.committed, report.applied), (1000, 1000));
    }
}
