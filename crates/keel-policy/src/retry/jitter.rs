//! Randomness added to backoff delays, so that clients which failed together
//! do not all come back at the same instant.
//!
//! Without jitter, every client that saw the same outage retries on the same
//! schedule and the recovering dependency is hit by synchronised waves.
//! [`Jitter::Full`] spreads them the most (AWS's analysis found it does the
//! least total work); [`Jitter::Proportional`] keeps each delay near its
//! nominal value, which is easier to reason about for long schedules;
//! [`Jitter::Equal`] keeps at least half of every delay, for retries that
//! must not come straight back (a database conflict, a store briefly down);
//! [`Jitter::Decorrelated`] grows from the previous actual delay instead of the
//! attempt number.

use serde::{Deserialize, Serialize};

use crate::ConfigError;

/// How a backoff delay is randomised.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Jitter {
    /// No randomness: every delay is exactly the nominal one. Use in tests,
    /// or where callers are already spread out.
    None,
    /// Uniform in `nominal × [1 − p, 1 + p]` (`Proportional(0.25)` is ±25%),
    /// never above the maximum delay. `p` must be in `[0, 1]`.
    Proportional(f64),
    /// Uniform in `[0, nominal]` ("full jitter").
    Full,
    /// Uniform in `[nominal / 2, nominal]` ("equal jitter"): colliding
    /// callers still spread out, yet each waits at least half the nominal
    /// delay, so a retry never lands at once on what it collided with
    /// (database conflicts, a store that is briefly down).
    Equal,
    /// `min(max, uniform(base, previous × 3))`, where `previous` is the
    /// delay actually used last time ("decorrelated jitter"). Ignores the
    /// growth factor; only for exponential backoff.
    Decorrelated,
}

impl Default for Jitter {
    /// [`Jitter::Full`].
    fn default() -> Self {
        Self::Full
    }
}

impl Jitter {
    pub(crate) fn validate(self) -> Result<(), ConfigError> {
        match self {
            Self::Proportional(p) => ConfigError::ensure(
                p.is_finite() && (0.0..=1.0).contains(&p),
                "jitter",
                "proportional jitter must be a finite fraction in [0, 1], e.g. 0.25 for ±25%",
            ),
            Self::None | Self::Full | Self::Equal | Self::Decorrelated => Ok(()),
        }
    }
}

/// Where a backoff draws its random numbers: the thread-local generator (no
/// lock, the production path) or an explicitly seeded one (deterministic tests).
#[derive(Debug, Clone)]
pub(crate) enum Rand {
    Thread,
    Seeded(fastrand::Rng),
}

impl Rand {
    pub(crate) fn seeded(seed: u64) -> Self {
        Self::Seeded(fastrand::Rng::with_seed(seed))
    }

    /// A number uniform in `[0, 1)`.
    pub(crate) fn unit(&mut self) -> f64 {
        match self {
            Self::Thread => fastrand::f64(),
            Self::Seeded(rng) => rng.f64(),
        }
    }
}
