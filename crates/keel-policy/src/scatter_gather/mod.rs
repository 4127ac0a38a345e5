//! Scatter-gather: ask several targets at once, answer with what arrived in
//! time, and say what is missing.
//!
//! A search over shards, a quote from several carriers, a page built from
//! several services: the answer is worth something even when one part is
//! slow or down. [`ScatterGather`] sends one request to every named target
//! concurrently and gathers under one time budget:
//!
//! - the budget is the smaller of its own ([`budget`](ScatterGatherBuilder::budget),
//!   default 1 s) and the time left before the task's current
//!   [`Deadline`]; each target runs with that deadline as its own, so what it
//!   calls (a [`Timeout`](crate::timeout), an outgoing HTTP request) sees it;
//! - when the budget ends, the targets still running are dropped, which
//!   cancels them: *stop work nobody will read*;
//! - a target that failed, was cut off, or whose breaker is open is listed
//!   in [`Gathered::missing`] with why, and the others are returned:
//!   *degrade, do not fail*; [`Gathered::is_partial`] tells the caller the
//!   answer is incomplete *instead of pretending*;
//! - every target is behind its own [`CircuitBreaker`]: a carrier that keeps
//!   failing (or keeps running out the budget, which counts as a timeout) is
//!   not called again until its breaker lets a probe through, so a gather
//!   spends no budget and no connection on it;
//! - with less than [`min_time_to_start`](ScatterGatherBuilder::min_time_to_start)
//!   (50 ms) left, no target is called at all and every one is missing with
//!   [`Rejected::DeadlineExceeded`].
//!
//! A gather that is itself dropped (its caller gave up) records nothing in
//! the breakers: a cancelled call says nothing about the target.
//!
//! Observability: `keel_scatter_gather_total{name, answer}` (`complete` or
//! `partial`) per gather, `keel_scatter_gather_missing_total{name, target,
//! reason}` per missing target (`failed`, `circuit_open`, `timeout`,
//! `deadline_exceeded`).
//!
//! ```
//! use std::time::Duration;
//! use keel_policy::scatter_gather::ScatterGather;
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
//! let quotes = ScatterGather::builder("shipping-quote")
//!     .target("fastship")
//!     .target("slowboat")
//!     .budget(Duration::from_millis(300))
//!     .build()?;
//!
//! let answer = quotes
//!     .call(|carrier| async move {
//!         if &*carrier == "slowboat" {
//!             tokio::time::sleep(Duration::from_secs(5)).await; // nobody will read this
//!         }
//!         Ok::<u64, std::io::Error>(1_250)
//!     })
//!     .await;
//! assert!(answer.is_partial());
//! assert_eq!(answer.missing_targets(), ["slowboat"]);
//! assert_eq!(answer.results.len(), 1);
//! # Ok::<_, keel_policy::ConfigError>(())
//! # }).unwrap();
//! ```
//!
//! [`Deadline`]: keel_core::Deadline

mod gathered;
#[cfg(test)]
mod tests;

pub use gathered::{Gathered, Missing};

use std::collections::HashSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::stream::FuturesUnordered;
use keel_core::clock;
use keel_core::{Classify, Deadline, Name, PolicyError, Rejected};
use serde::{Deserialize, Serialize};

use crate::ConfigError;
use crate::breaker::{BreakerRegistry, CircuitBreaker, CircuitBreakerConfig, Outcome, OwnedPermit};

/// The default budget of one gather: 1 s.
pub const DEFAULT_BUDGET: Duration = Duration::from_secs(1);

/// The timing of a [`ScatterGather`], as read from a file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScatterGatherConfig {
    /// The most one gather may take (default [`DEFAULT_BUDGET`]); a closer
    /// current deadline shortens it. Must be more than zero.
    #[serde(with = "humantime_serde")]
    pub budget: Duration,
    /// Call no target when no more than this is left (default
    /// [`keel_core::deadline::MIN_TIME_TO_START`], 50 ms).
    #[serde(with = "humantime_serde")]
    pub min_time_to_start: Duration,
}

impl Default for ScatterGatherConfig {
    fn default() -> Self {
        Self {
            budget: DEFAULT_BUDGET,
            min_time_to_start: keel_core::deadline::MIN_TIME_TO_START,
        }
    }
}

/// Builds a [`ScatterGather`]: at least one target, each name once.
#[derive(Debug)]
#[must_use]
pub struct ScatterGatherBuilder {
    name: Name,
    config: ScatterGatherConfig,
    registry: Option<BreakerRegistry>,
    targets: Vec<(Name, Option<CircuitBreaker>)>,
}

impl ScatterGatherBuilder {
    /// Adds a target. Its breaker is the registry's endpoint breaker
    /// `"<name>/<target>"` when [`breakers`](Self::breakers) is set, else a
    /// breaker of that name with the default configuration.
    pub fn target(mut self, target: impl Into<Name>) -> Self {
        self.targets.push((target.into(), None));
        self
    }

    /// Adds a target behind a breaker of your own.
    pub fn target_with_breaker(mut self, target: impl Into<Name>, breaker: CircuitBreaker) -> Self {
        self.targets.push((target.into(), Some(breaker)));
        self
    }

    /// Where the targets' breakers come from (their state then shows with
    /// the registry's, in the admin API); default: a breaker per target
    /// with the default configuration.
    pub fn breakers(mut self, registry: BreakerRegistry) -> Self {
        self.registry = Some(registry);
        self
    }

    /// The most one gather may take (default [`DEFAULT_BUDGET`], 1 s).
    pub fn budget(mut self, budget: Duration) -> Self {
        self.config.budget = budget;
        self
    }

    /// Call no target when no more than this is left (default 50 ms).
    pub fn min_time_to_start(mut self, min: Duration) -> Self {
        self.config.min_time_to_start = min;
        self
    }

    /// Replaces the timing with `config`.
    pub fn config(mut self, config: ScatterGatherConfig) -> Self {
        self.config = config;
        self
    }

    /// Validates the targets and the timing and builds the policy.
    pub fn build(self) -> Result<ScatterGather, ConfigError> {
        ConfigError::ensure(
            !self.config.budget.is_zero(),
            "budget",
            "must be more than zero: a zero budget gathers nothing",
        )?;
        ConfigError::ensure(
            !self.targets.is_empty(),
            "targets",
            "add at least one target: a gather of nothing answers nothing",
        )?;
        let mut seen = HashSet::new();
        for (target, _) in &self.targets {
            if !seen.insert(*target) {
                return Err(ConfigError::new(
                    "targets",
                    format!("`{target}` is listed twice: each target is asked once"),
                ));
            }
        }
        let targets =
            self.targets
                .into_iter()
                .map(|(target, breaker)| {
                    let breaker = match (breaker, &self.registry) {
                        (Some(breaker), _) => breaker,
                        (None, Some(registry)) => registry.get_endpoint(&self.name, &target),
                        (None, None) => CircuitBreakerConfig::default()
                            .build(format!("{}/{target}", self.name))?,
                    };
                    Ok(Target::new(&self.name, target, breaker))
                })
                .collect::<Result<Vec<_>, ConfigError>>()?;
        let answer = |answer: &'static str| metrics::counter!("keel_scatter_gather_total", "name" => self.name.to_string(), "answer" => answer);
        Ok(ScatterGather {
            inner: Arc::new(Inner {
                complete: answer("complete"),
                partial: answer("partial"),
                name: self.name,
                config: self.config,
                targets,
            }),
        })
    }
}

/// One request to many targets, gathered under one budget; see the
/// [module docs](self). Cheap to clone.
#[derive(Debug, Clone)]
pub struct ScatterGather {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    name: Name,
    config: ScatterGatherConfig,
    targets: Vec<Target>,
    complete: metrics::Counter,
    partial: metrics::Counter,
}

#[derive(Debug)]
struct Target {
    name: Name,
    breaker: CircuitBreaker,
    failed: metrics::Counter,
    circuit_open: metrics::Counter,
    timed_out: metrics::Counter,
    too_late: metrics::Counter,
}

impl Target {
    fn new(gather: &Name, name: Name, breaker: CircuitBreaker) -> Self {
        let missing = |reason: &'static str| metrics::counter!("keel_scatter_gather_missing_total", "name" => gather.to_string(), "target" => name.to_string(), "reason" => reason);
        Self {
            failed: missing("failed"),
            circuit_open: missing("circuit_open"),
            timed_out: missing("timeout"),
            too_late: missing("deadline_exceeded"),
            name,
            breaker,
        }
    }

    fn count_missing<E>(&self, error: &PolicyError<E>) {
        match error {
            PolicyError::Inner(_) => self.failed.increment(1),
            PolicyError::Rejected(Rejected::CircuitOpen { .. }) => self.circuit_open.increment(1),
            PolicyError::Rejected(Rejected::Timeout { .. }) => self.timed_out.increment(1),
            PolicyError::Rejected(_) => self.too_late.increment(1),
        }
    }
}

impl ScatterGather {
    /// A builder named `name` (its breakers and metrics carry the name).
    pub fn builder(name: impl Into<Name>) -> ScatterGatherBuilder {
        ScatterGatherBuilder {
            name: name.into(),
            config: ScatterGatherConfig::default(),
            registry: None,
            targets: Vec::new(),
        }
    }

    /// The policy's name.
    pub fn name(&self) -> &Name {
        &self.inner.name
    }

    /// The targets, in the order they were added.
    pub fn targets(&self) -> impl Iterator<Item = &Name> {
        self.inner.targets.iter().map(|t| &t.name)
    }

    /// The breaker in front of `target`, if it is one of the targets.
    pub fn breaker(&self, target: &str) -> Option<&CircuitBreaker> {
        self.inner
            .targets
            .iter()
            .find(|t| &*t.name == target)
            .map(|t| &t.breaker)
    }

    /// Asks every target whose breaker allows it with `ask(target)`,
    /// concurrently, and gathers what answers within the budget. Never
    /// fails as a whole: what did not answer is in [`Gathered::missing`].
    pub async fn call<T, E, F, Fut>(&self, ask: F) -> Gathered<T, E>
    where
        E: Classify,
        F: Fn(Name) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let inner = &self.inner;
        let started = clock::now();
        let deadline = Deadline::after(inner.config.budget).min_with(Deadline::current());
        let mut slots: Vec<Option<Result<T, PolicyError<E>>>> =
            inner.targets.iter().map(|_| None).collect();
        if deadline.too_late_to_start(inner.config.min_time_to_start) {
            for slot in &mut slots {
                *slot = Some(Err(PolicyError::Rejected(Rejected::DeadlineExceeded)));
            }
            return self.finish(slots);
        }
        let mut permits: Vec<Option<OwnedPermit>> = Vec::with_capacity(slots.len());
        let running = FuturesUnordered::new();
        for (i, target) in inner.targets.iter().enumerate() {
            match target.breaker.try_acquire_owned() {
                Ok(permit) => {
                    permits.push(Some(permit));
                    let asked = deadline.scope(ask(target.name));
                    running.push(async move { (i, asked.await) });
                }
                Err(refused) => {
                    permits.push(None);
                    slots[i] = Some(Err(PolicyError::Rejected(refused)));
                }
            }
        }
        gather(running, deadline, &mut permits, &mut slots).await;
        let budget = deadline.instant().saturating_duration_since(started);
        for (i, permit) in permits.iter_mut().enumerate() {
            if let Some(permit) = permit.take() {
                // Cut off at the budget: a timeout, held against the target
                // as a `Timeout` inside a breaker would be.
                permit.record(Outcome::Failure);
                slots[i] = Some(Err(PolicyError::Rejected(Rejected::Timeout {
                    name: inner.targets[i].name,
                    after: budget,
                })));
            }
        }
        self.finish(slots)
    }

    fn finish<T, E>(&self, slots: Vec<Option<Result<T, PolicyError<E>>>>) -> Gathered<T, E> {
        let mut gathered = Gathered::default();
        for (target, slot) in self.inner.targets.iter().zip(slots) {
            match slot {
                Some(Ok(value)) => gathered.results.push((target.name, value)),
                Some(Err(error)) => {
                    target.count_missing(&error);
                    gathered.missing.push(Missing {
                        target: target.name,
                        error,
                    });
                }
                None => unreachable!("every target's slot is settled before the gather ends"),
            }
        }
        if gathered.is_partial() {
            self.inner.partial.increment(1);
        } else {
            self.inner.complete.increment(1);
        }
        gathered
    }
}

/// Settles each target as it answers, until all have or the deadline
/// passes; a target still running then keeps its permit (and no slot).
async fn gather<T, E, Fut>(
    mut running: FuturesUnordered<Fut>,
    deadline: Deadline,
    permits: &mut [Option<OwnedPermit>],
    slots: &mut [Option<Result<T, PolicyError<E>>>],
) where
    E: Classify,
    Fut: Future<Output = (usize, Result<T, E>)>,
{
    let settle_all = async {
        while let Some((i, result)) = running.next().await {
            if let Some(permit) = permits[i].take() {
                permit.record(Outcome::of(&result));
            }
            slots[i] = Some(result.map_err(PolicyError::Inner));
        }
    };
    let _ = tokio::time::timeout_at(deadline.instant(), settle_all).await;
}
