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
//! use keel_ledger::Ledger;
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

#![cfg_attr(docsrs, feature(doc_cfg))]

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use keel_store::SagaStatus;

mod check;
mod report;

pub use report::{
    Duplicated, LedgerError, LedgerReport, Lost, OutOfOrder, SagaProblem, Stage, Stray,
    UnsettledSaga,
};

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

#[cfg(test)]
mod tests;
