//! How a [`Retry`] is configured: the serde form, the builder, and the one
//! validation path both go through.

use std::fmt;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use keel_core::Name;
use serde::{Deserialize, Serialize};

use super::{
    Backoff, BackoffConfig, ByClass, Retry, RetryBudget, RetryBudgetConfig, RetryIf, RetryMetrics,
    RetryOnResult, Shared,
};
use crate::ConfigError;

/// The serde form of a [`Retry`]; `Default` is the documented defaults.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryConfig {
    /// Attempts in total, the first included (default 3).
    pub max_attempts: NonZeroU32,
    /// The delays between attempts (default: 200 ms × 2ⁿ up to 10 s, full jitter).
    pub backoff: BackoffConfig,
    /// The longest `Retry-After` honoured; a longer one ends the call
    /// (default 30 s).
    #[serde(with = "humantime_serde")]
    pub retry_after_max: Duration,
    /// Whether the operation is idempotent, so an `OutcomeUnknown` error may
    /// be retried (default false).
    pub retry_outcome_unknown: bool,
    /// The budget, one per `Retry` (default [`RetryBudgetConfig::default`]);
    /// `null` for none.
    pub budget: Option<RetryBudgetConfig>,
    /// Answer [`Rejected::BudgetExhausted`](keel_core::Rejected::BudgetExhausted) instead of the last error when the
    /// budget stops a retry (default false).
    pub reject_on_budget_exhausted: bool,
}

const DEFAULT_ATTEMPTS: NonZeroU32 = NonZeroU32::new(3).unwrap();
const DEFAULT_RETRY_AFTER_MAX: Duration = Duration::from_secs(30);

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            max_attempts: DEFAULT_ATTEMPTS,
            backoff: BackoffConfig::default(),
            retry_after_max: DEFAULT_RETRY_AFTER_MAX,
            retry_outcome_unknown: false,
            budget: Some(RetryBudgetConfig::default()),
            reject_on_budget_exhausted: false,
        }
    }
}

impl RetryConfig {
    /// Validates and builds the policy (classification decides what is
    /// retried; use [`Retry::builder`] for predicates and hooks).
    pub fn build(self, name: impl Into<Name>) -> Result<Retry, ConfigError> {
        Parts::new(name.into(), self, ByClass).build()
    }
}

/// Called before each retry with what is about to happen.
pub type OnRetry = Arc<dyn Fn(&RetryEvent<'_>) + Send + Sync>;

/// A retry about to happen, as seen by an [`on_retry`](RetryBuilder::on_retry) hook.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct RetryEvent<'a> {
    /// The policy's name.
    pub name: &'a str,
    /// The attempt about to start (2 for the first retry).
    pub attempt: u32,
    /// How long the call waits first.
    pub delay: Duration,
}

enum BudgetChoice {
    FromConfig,
    Shared(RetryBudget),
}

/// Everything a builder collects; the one path to a valid [`Retry`].
struct Parts<P> {
    name: Name,
    config: RetryConfig,
    /// The builder's `max_attempts`, kept apart so zero is refused by name.
    attempts: u32,
    budget: BudgetChoice,
    policy: P,
    on_retry: Option<OnRetry>,
    seed: Option<u64>,
}

impl<P> Parts<P> {
    fn new(name: Name, config: RetryConfig, policy: P) -> Self {
        let attempts = config.max_attempts.get();
        Self {
            name,
            config,
            attempts,
            budget: BudgetChoice::FromConfig,
            policy,
            on_retry: None,
            seed: None,
        }
    }

    fn map_policy<Q>(self, f: impl FnOnce(P) -> Q) -> Parts<Q> {
        Parts {
            name: self.name,
            config: self.config,
            attempts: self.attempts,
            budget: self.budget,
            policy: f(self.policy),
            on_retry: self.on_retry,
            seed: self.seed,
        }
    }

    fn build(self) -> Result<Retry<P>, ConfigError> {
        let mut config = self.config;
        config.max_attempts = NonZeroU32::new(self.attempts).ok_or_else(|| {
            ConfigError::new(
                "max_attempts",
                "must be at least 1 (the first attempt counts)",
            )
        })?;
        ConfigError::ensure(
            !config.retry_after_max.is_zero(),
            "retry_after_max",
            "must be greater than zero",
        )?;
        let backoff = config.backoff.clone().build()?;
        let budget = match self.budget {
            BudgetChoice::Shared(budget) => Some(budget),
            BudgetChoice::FromConfig => match config.budget.clone() {
                Some(budget) => Some(budget.build(self.name)?),
                None => None,
            },
        };
        let shared = Shared {
            metrics: RetryMetrics::new(&self.name),
            max_attempts: self.attempts,
            retry_after_max: config.retry_after_max,
            idempotent: config.retry_outcome_unknown,
            reject_on_budget_exhausted: config.reject_on_budget_exhausted,
            backoff,
            budget,
            on_retry: self.on_retry,
            seed: self.seed,
            seeded_calls: AtomicU64::new(0),
            policy: self.policy,
            name: self.name,
            config,
        };
        Ok(Retry {
            shared: Arc::new(shared),
        })
    }
}

/// Builds a [`Retry`]; see [`RetryConfig`] for the defaults.
pub struct RetryBuilder<P = ByClass> {
    parts: Parts<P>,
}

impl<P: fmt::Debug> fmt::Debug for RetryBuilder<P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryBuilder")
            .field("name", &self.parts.name)
            .field("config", &self.parts.config)
            .field("policy", &self.parts.policy)
            .finish_non_exhaustive()
    }
}

impl Retry {
    /// A builder with the documented defaults, retrying by error class.
    pub fn builder(name: impl Into<Name>) -> RetryBuilder {
        RetryBuilder {
            parts: Parts::new(name.into(), RetryConfig::default(), ByClass),
        }
    }
}

impl<P> RetryBuilder<P> {
    /// Attempts in total, the first included (default 3).
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.parts.attempts = attempts;
        self
    }

    /// The delays between attempts (default: 200 ms × 2ⁿ up to 10 s, full jitter).
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.parts.config.backoff = backoff.to_config();
        self
    }

    /// The longest `Retry-After` honoured (default 30 s). When a dependency
    /// asks for longer, the call gives up and returns its error.
    pub fn retry_after_max(mut self, max: Duration) -> Self {
        self.parts.config.retry_after_max = max;
        self
    }

    /// Marks the operation idempotent, so errors of unknown outcome (a
    /// timeout after sending) are retried too (default false: the first
    /// attempt may have taken effect, and repeating it could do it twice).
    pub fn retry_outcome_unknown(mut self, idempotent: bool) -> Self {
        self.parts.config.retry_outcome_unknown = idempotent;
        self
    }

    /// Shares an existing budget (e.g. one per dependency across several
    /// policies) instead of creating one.
    pub fn budget(mut self, budget: RetryBudget) -> Self {
        self.parts.budget = BudgetChoice::Shared(budget);
        self
    }

    /// The configuration of this policy's own budget (default
    /// [`RetryBudgetConfig::default`]); `None` retries without a budget.
    pub fn budget_config(mut self, budget: Option<RetryBudgetConfig>) -> Self {
        self.parts.config.budget = budget;
        self.parts.budget = BudgetChoice::FromConfig;
        self
    }

    /// Answer [`Rejected::BudgetExhausted`](keel_core::Rejected::BudgetExhausted) instead of the last error when the
    /// budget stops a retry (default false).
    pub fn reject_on_budget_exhausted(mut self, reject: bool) -> Self {
        self.parts.config.reject_on_budget_exhausted = reject;
        self
    }

    /// Calls `hook` before each retry (for logs or tests). A `tracing` debug
    /// event is emitted regardless.
    pub fn on_retry(mut self, hook: impl Fn(&RetryEvent<'_>) + Send + Sync + 'static) -> Self {
        self.parts.on_retry = Some(Arc::new(hook));
        self
    }

    /// Seeds the jitter so delays are reproducible (tests). Unseeded, each
    /// thread uses its own generator, without locks.
    pub fn seed(mut self, seed: u64) -> Self {
        self.parts.seed = Some(seed);
        self
    }

    /// Retries the errors `predicate` picks (returning `bool` or a
    /// [`Verdict`](super::Verdict)) instead of classifying them.
    pub fn retry_if<F>(self, predicate: F) -> RetryBuilder<RetryIf<F>> {
        RetryBuilder {
            parts: self.parts.map_policy(|_| RetryIf::new(predicate)),
        }
    }

    /// Also retries successful results that `predicate` picks (returning
    /// `bool` or a [`Verdict`](super::Verdict), e.g. with the `Retry-After` of a `503`).
    /// When retries run out, the last result is returned as it is.
    pub fn retry_on_result<F>(self, predicate: F) -> RetryBuilder<RetryOnResult<P, F>> {
        RetryBuilder {
            parts: self
                .parts
                .map_policy(|errors| RetryOnResult::new(errors, predicate)),
        }
    }

    /// Validates and builds the policy.
    pub fn build(self) -> Result<Retry<P>, ConfigError> {
        self.parts.build()
    }
}
