//! A token bucket over recent traffic that caps retries at a fraction of the
//! requests: requests earn, retries spend.
//!
//! # Why a budget, and not only a maximum number of attempts?
//!
//! "Three attempts" is harmless while failures are rare and multiplies the
//! load by three exactly when a dependency is down for everyone, which is
//! when it can least take it. A budget shared by all calls to one dependency
//! lets each request earn `ratio` of a retry (default 0.1, so at most ~10%
//! extra load), plus `min_per_sec` retries per second regardless of traffic so
//! that a quiet service can still retry its occasional failure. In a
//! widespread outage the budget empties within a moment and retries stop on
//! their own; when traffic succeeds again it refills.
//!
//! Every request deposits, so [`RetryBudget::deposit`] is lock-free and, once
//! the bucket is full (the normal state), a single atomic load. Tokens are
//! fixed-point (millionths) in atomics.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use keel_core::clock::{self, Instant};
use keel_core::{Name, Rejected};
use serde::{Deserialize, Serialize};

use crate::ConfigError;

/// Millionths of a token.
const SCALE: f64 = 1_000_000.0;
const ONE: u64 = 1_000_000;
/// Larger values make no practical sense and could overflow the fixed point.
const LIMIT: f64 = 1e9;

/// A retry budget shared (cheaply cloned) by every call to one dependency.
///
/// ```
/// use keel_policy::retry::RetryBudget;
///
/// let budget = RetryBudget::builder("payments").ratio(0.2).min_per_sec(0.0).build()?;
/// for _ in 0..10 {
///     budget.deposit(); // ten requests earn two retries
/// }
/// assert!(budget.try_withdraw());
/// assert!(budget.try_withdraw());
/// assert!(!budget.try_withdraw());
/// # Ok::<(), keel_policy::ConfigError>(())
/// ```
#[derive(Clone)]
pub struct RetryBudget {
    inner: Arc<Inner>,
}

struct Inner {
    name: Name,
    config: RetryBudgetConfig,
    per_request: u64,
    max_tokens: u64,
    tokens: AtomicU64,
    reserve: AtomicU64,
    reserve_cap: u64,
    reserve_per_sec: u64,
    epoch: Instant,
    refilled_at_nanos: AtomicU64,
    exhausted: metrics::Counter,
}

/// The serde form of a [`RetryBudget`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetryBudgetConfig {
    /// Retries earned by each request, in `(0, 1]` (default 0.1: at most 10%
    /// extra load from retries).
    pub ratio: f64,
    /// Retries allowed per second regardless of traffic, at least 0
    /// (default 10). Up to one second's worth (at least one) can be saved up.
    pub min_per_sec: f64,
    /// The most tokens requests can save up, at least 1 (default 100): the
    /// largest burst of retries after a quiet, healthy period.
    pub max_tokens: f64,
}

impl Default for RetryBudgetConfig {
    fn default() -> Self {
        Self {
            ratio: 0.1,
            min_per_sec: 10.0,
            max_tokens: 100.0,
        }
    }
}

impl RetryBudgetConfig {
    /// Validates and builds the budget.
    pub fn build(self, name: impl Into<Name>) -> Result<RetryBudget, ConfigError> {
        self.validate()?;
        Ok(RetryBudget::from_valid(name.into(), self))
    }

    fn validate(&self) -> Result<(), ConfigError> {
        ConfigError::ensure(
            self.ratio.is_finite() && self.ratio > 0.0 && self.ratio <= 1.0,
            "ratio",
            "must be in (0, 1]: the retries each request earns, e.g. 0.1 for 10%",
        )?;
        ConfigError::ensure(
            self.min_per_sec.is_finite() && (0.0..=LIMIT).contains(&self.min_per_sec),
            "min_per_sec",
            "must be a finite number of retries per second, at least 0",
        )?;
        ConfigError::ensure(
            self.max_tokens.is_finite() && (1.0..=LIMIT).contains(&self.max_tokens),
            "max_tokens",
            "must be a finite number of at least 1 (a budget must hold one retry)",
        )
    }
}

/// Builds a [`RetryBudget`]; see [`RetryBudgetConfig`] for the defaults.
#[derive(Debug, Clone)]
pub struct RetryBudgetBuilder {
    name: Name,
    config: RetryBudgetConfig,
}

impl RetryBudgetBuilder {
    /// Retries earned by each request, in `(0, 1]` (default 0.1).
    pub fn ratio(mut self, ratio: f64) -> Self {
        self.config.ratio = ratio;
        self
    }

    /// Retries allowed per second regardless of traffic (default 10).
    pub fn min_per_sec(mut self, min_per_sec: f64) -> Self {
        self.config.min_per_sec = min_per_sec;
        self
    }

    /// The most tokens requests can save up (default 100).
    pub fn max_tokens(mut self, max_tokens: f64) -> Self {
        self.config.max_tokens = max_tokens;
        self
    }

    /// Validates and builds the budget.
    pub fn build(self) -> Result<RetryBudget, ConfigError> {
        self.config.build(self.name)
    }
}

impl RetryBudget {
    /// A builder with the defaults of [`RetryBudgetConfig`].
    pub fn builder(name: impl Into<Name>) -> RetryBudgetBuilder {
        RetryBudgetBuilder {
            name: name.into(),
            config: RetryBudgetConfig::default(),
        }
    }

    fn from_valid(name: Name, config: RetryBudgetConfig) -> Self {
        let reserve_cap = if config.min_per_sec > 0.0 {
            config.min_per_sec.max(1.0)
        } else {
            0.0
        };
        let reserve_cap = fixed(reserve_cap);
        let exhausted =
            metrics::counter!("keel_retry_budget_exhausted_total", "name" => name.to_string());
        let inner = Inner {
            per_request: fixed(config.ratio),
            max_tokens: fixed(config.max_tokens),
            tokens: AtomicU64::new(0),
            reserve: AtomicU64::new(reserve_cap),
            reserve_cap,
            reserve_per_sec: fixed(config.min_per_sec),
            epoch: clock::now(),
            refilled_at_nanos: AtomicU64::new(0),
            exhausted,
            name,
            config,
        };
        Self {
            inner: Arc::new(inner),
        }
    }

    /// The budget's name.
    pub fn name(&self) -> &Name {
        &self.inner.name
    }

    /// The configuration it was built from.
    pub fn config(&self) -> &RetryBudgetConfig {
        &self.inner.config
    }

    /// Records one request: earns `ratio` of a retry, up to `max_tokens`.
    /// Call once per call, not per attempt.
    #[inline]
    pub fn deposit(&self) {
        let inner = &*self.inner;
        let mut current = inner.tokens.load(Ordering::Relaxed);
        while current < inner.max_tokens {
            let next = current
                .saturating_add(inner.per_request)
                .min(inner.max_tokens);
            match inner.tokens.compare_exchange_weak(
                current,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return,
                Err(actual) => current = actual,
            }
        }
    }

    /// Spends one retry if the budget has one. When it is empty, counts
    /// `keel_retry_budget_exhausted_total` and returns `false`.
    pub fn try_withdraw(&self) -> bool {
        self.try_withdraw_at(clock::now())
    }

    /// Like [`try_withdraw`](Self::try_withdraw), as a refusal for callers
    /// that want one.
    pub fn withdraw(&self) -> Result<(), Rejected> {
        if self.try_withdraw() {
            Ok(())
        } else {
            Err(Rejected::BudgetExhausted {
                name: self.inner.name,
            })
        }
    }

    /// The retries available now, as a whole number of tokens plus fraction.
    pub fn available(&self) -> f64 {
        self.refill_reserve(clock::now());
        let tokens = self.inner.tokens.load(Ordering::Relaxed);
        let reserve = self.inner.reserve.load(Ordering::Relaxed);
        (tokens + reserve) as f64 / SCALE
    }

    pub(crate) fn try_withdraw_at(&self, now: Instant) -> bool {
        let inner = &*self.inner;
        if take_one(&inner.tokens) {
            return true;
        }
        self.refill_reserve(now);
        if take_one(&inner.reserve) {
            return true;
        }
        inner.exhausted.increment(1);
        tracing::debug!(budget = %inner.name, "retry budget exhausted: not retrying");
        false
    }

    /// Adds `min_per_sec` tokens per elapsed second to the reserve. Whoever
    /// moves the refill timestamp owns that interval, so concurrent callers
    /// never credit the same time twice.
    fn refill_reserve(&self, now: Instant) {
        let inner = &*self.inner;
        if inner.reserve_per_sec == 0 {
            return;
        }
        let now_nanos = u64::try_from(now.saturating_duration_since(inner.epoch).as_nanos())
            .unwrap_or(u64::MAX);
        let last = inner.refilled_at_nanos.load(Ordering::Acquire);
        let Some(elapsed) = now_nanos.checked_sub(last) else {
            return;
        };
        let earned = u128::from(elapsed) * u128::from(inner.reserve_per_sec) / 1_000_000_000;
        let earned = u64::try_from(earned)
            .unwrap_or(u64::MAX)
            .min(inner.reserve_cap);
        if earned == 0 {
            return;
        }
        if inner
            .refilled_at_nanos
            .compare_exchange(last, now_nanos, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        let _ = inner
            .reserve
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |r| {
                Some(r.saturating_add(earned).min(inner.reserve_cap))
            });
    }

    #[cfg(test)]
    pub(crate) fn reserve_tokens(&self) -> f64 {
        self.inner.reserve.load(Ordering::Relaxed) as f64 / SCALE
    }

    #[cfg(test)]
    pub(crate) fn earned_tokens(&self) -> f64 {
        self.inner.tokens.load(Ordering::Relaxed) as f64 / SCALE
    }
}

fn take_one(tokens: &AtomicU64) -> bool {
    tokens
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| t.checked_sub(ONE))
        .is_ok()
}

/// Fixed point, rounded down so the budget never grants more than configured.
fn fixed(tokens: f64) -> u64 {
    (tokens * SCALE) as u64
}

impl std::fmt::Debug for RetryBudget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryBudget")
            .field("name", &self.inner.name)
            .field("config", &self.inner.config)
            .field(
                "tokens",
                &(self.inner.tokens.load(Ordering::Relaxed) as f64 / SCALE),
            )
            .field(
                "reserve",
                &(self.inner.reserve.load(Ordering::Relaxed) as f64 / SCALE),
            )
            .finish()
    }
}
