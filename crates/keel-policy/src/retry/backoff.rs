//! How long to wait before each retry: exponential growth up to a cap, or a
//! fixed schedule, randomised by a [`Jitter`].
//!
//! [`Backoff`] is a standalone value, not tied to [`Retry`](super::Retry):
//! message redelivery and webhook schedules use the same type, either
//! statelessly ([`Backoff::delay`] for a stored attempt number) or as an
//! iterator ([`Backoff::iter`]).
//!
//! The default: 200 ms doubling up to 10 s with full jitter.
//! Exponential growth backs off fast enough that a struggling dependency
//! sees retries thin out; the cap keeps a caller from waiting longer than a
//! user would; jitter keeps callers that failed together from retrying
//! together.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::jitter::{Jitter, Rand};
use crate::ConfigError;

/// A sequence of retry delays: exponential or an explicit schedule, with
/// jitter. Cheap to clone.
///
/// ```
/// use std::time::Duration;
/// use keel_policy::retry::{Backoff, Jitter};
///
/// let backoff = Backoff::exponential(Duration::from_millis(100), 2.0, Duration::from_secs(1))?
///     .with_jitter(Jitter::None)?;
/// let delays: Vec<_> = backoff.iter().take(5).map(|d| d.as_millis()).collect();
/// assert_eq!(delays, [100, 200, 400, 800, 1000]);
///
/// // A webhook schedule: seven deliveries after the first, then give up.
/// let webhook = Backoff::schedule([5, 300, 1800, 7200, 18_000, 36_000, 36_000].map(Duration::from_secs))?;
/// assert_eq!(webhook.iter().count(), 7);
/// assert_eq!(webhook.delay(1), Some(Duration::from_secs(300)));
/// # Ok::<(), keel_policy::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Backoff {
    shape: Shape,
    jitter: Jitter,
    /// The longest delay, computed once (a schedule's largest).
    max: Duration,
}

#[derive(Debug, Clone, PartialEq)]
enum Shape {
    Exponential {
        base: Duration,
        factor: f64,
        max: Duration,
    },
    Schedule(Arc<[Duration]>),
}

const DEFAULT_BASE: Duration = Duration::from_millis(200);
const DEFAULT_FACTOR: f64 = 2.0;
const DEFAULT_MAX: Duration = Duration::from_secs(10);

impl Default for Backoff {
    /// 200 ms × 2ⁿ, at most 10 s, full jitter.
    fn default() -> Self {
        Self {
            shape: Shape::Exponential {
                base: DEFAULT_BASE,
                factor: DEFAULT_FACTOR,
                max: DEFAULT_MAX,
            },
            jitter: Jitter::Full,
            max: DEFAULT_MAX,
        }
    }
}

impl Backoff {
    /// `base × factorⁿ` before retry `n` (counting from 0), never more than
    /// `max_delay`, without jitter (add it with [`with_jitter`](Self::with_jitter)).
    ///
    /// Refuses a zero `base`, a `factor` below 1 (or NaN/infinite), and a
    /// `max_delay` below `base`. A factor of 1 gives a constant delay.
    pub fn exponential(
        base: Duration,
        factor: f64,
        max_delay: Duration,
    ) -> Result<Self, ConfigError> {
        BackoffConfig::Exponential {
            base,
            factor,
            max_delay,
            jitter: Jitter::None,
        }
        .build()
    }

    /// An explicit list of delays, one per retry; the sequence ends after the
    /// last one (a caller gives up). Refuses an empty list.
    pub fn schedule(delays: impl IntoIterator<Item = Duration>) -> Result<Self, ConfigError> {
        BackoffConfig::Schedule {
            delays: delays.into_iter().collect(),
            jitter: Jitter::None,
        }
        .build()
    }

    /// The same delays, randomised by `jitter`. Refuses NaN or out-of-range
    /// proportions, and decorrelated jitter on a fixed schedule (it would
    /// not follow the schedule).
    pub fn with_jitter(self, jitter: Jitter) -> Result<Self, ConfigError> {
        let candidate = Self { jitter, ..self };
        candidate.validate()?;
        Ok(candidate)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        self.jitter.validate()?;
        match &self.shape {
            Shape::Exponential { base, factor, max } => {
                ConfigError::ensure(!base.is_zero(), "base", "must be greater than zero")?;
                ConfigError::ensure(
                    factor.is_finite() && *factor >= 1.0,
                    "factor",
                    "must be a finite number of at least 1 (1 keeps the delay constant)",
                )?;
                ConfigError::ensure(max >= base, "max_delay", "must be at least `base`")
            }
            Shape::Schedule(delays) => {
                ConfigError::ensure(!delays.is_empty(), "delays", "must list at least one delay")?;
                ConfigError::ensure(
                    self.jitter != Jitter::Decorrelated,
                    "jitter",
                    "decorrelated jitter cannot follow a fixed schedule; use none, proportional or full",
                )
            }
        }
    }

    /// The jitter applied to every delay.
    pub fn jitter(&self) -> Jitter {
        self.jitter
    }

    /// The longest delay this backoff ever yields.
    pub fn max_delay(&self) -> Duration {
        self.max
    }

    /// How many retries the sequence allows: the schedule's length, or
    /// `None` when it never ends (exponential).
    pub fn max_retries(&self) -> Option<usize> {
        match &self.shape {
            Shape::Exponential { .. } => None,
            Shape::Schedule(delays) => Some(delays.len()),
        }
    }

    /// The delay before retry `attempt` (0 is the first retry) without
    /// jitter, or `None` after the end of a schedule.
    pub fn nominal_delay(&self, attempt: u32) -> Option<Duration> {
        self.nominal_nanos(attempt).map(|n| self.to_duration(n))
    }

    /// The delay before retry `attempt` (0 is the first retry) with jitter,
    /// or `None` after the end of a schedule. Stateless, for callers that
    /// store only the attempt number: decorrelated jitter then grows from
    /// the previous nominal delay.
    pub fn delay(&self, attempt: u32) -> Option<Duration> {
        let prev = match self.jitter {
            Jitter::Decorrelated => attempt.checked_sub(1).and_then(|a| self.nominal_delay(a)),
            _ => None,
        };
        let mut cursor = Cursor {
            retry: attempt,
            prev,
            rand: Rand::Thread,
        };
        self.advance(&mut cursor)
    }

    /// The delays in order, randomised with the thread-local generator.
    pub fn iter(&self) -> Delays<'_> {
        Delays {
            backoff: self,
            cursor: Cursor::new(Rand::Thread),
        }
    }

    /// The delays in order, randomised by a generator seeded with `seed`:
    /// the same seed gives the same sequence.
    pub fn iter_seeded(&self, seed: u64) -> Delays<'_> {
        Delays {
            backoff: self,
            cursor: Cursor::new(Rand::seeded(seed)),
        }
    }

    /// The serde form of this backoff.
    pub fn to_config(&self) -> BackoffConfig {
        match &self.shape {
            Shape::Exponential { base, factor, max } => BackoffConfig::Exponential {
                base: *base,
                factor: *factor,
                max_delay: *max,
                jitter: self.jitter,
            },
            Shape::Schedule(delays) => BackoffConfig::Schedule {
                delays: delays.to_vec(),
                jitter: self.jitter,
            },
        }
    }

    /// The next delay for `cursor`, advancing it.
    pub(crate) fn advance(&self, cursor: &mut Cursor) -> Option<Duration> {
        // Jitter spreads the capped delay: spread over an uncapped one
        // (100 ms × 2³⁰ say), nearly every draw would clamp to the cap, and
        // callers that failed together would come back together.
        let nominal = self
            .nominal_nanos(cursor.retry)?
            .min(nanos_f64(self.max_delay()));
        let nanos = match self.jitter {
            Jitter::None => nominal,
            Jitter::Proportional(p) => nominal * (1.0 - p + 2.0 * p * cursor.rand.unit()),
            Jitter::Full => nominal * cursor.rand.unit(),
            Jitter::Equal => nominal * (0.5 + 0.5 * cursor.rand.unit()),
            Jitter::Decorrelated => self.decorrelated(cursor),
        };
        let delay = self.to_duration(nanos);
        cursor.retry = cursor.retry.saturating_add(1);
        cursor.prev = Some(delay);
        Some(delay)
    }

    fn decorrelated(&self, cursor: &mut Cursor) -> f64 {
        let base = match &self.shape {
            Shape::Exponential { base, .. } => nanos_f64(*base),
            Shape::Schedule(delays) => delays.first().map_or(0.0, |d| nanos_f64(*d)),
        };
        let prev = cursor.prev.map_or(base, nanos_f64);
        let high = (prev * 3.0).max(base);
        base + (high - base) * cursor.rand.unit()
    }

    fn nominal_nanos(&self, attempt: u32) -> Option<f64> {
        match &self.shape {
            Shape::Exponential { base, factor, .. } => {
                let exponent = i32::try_from(attempt).unwrap_or(i32::MAX);
                Some(nanos_f64(*base) * factor.powi(exponent))
            }
            Shape::Schedule(delays) => {
                let index = usize::try_from(attempt).ok()?;
                delays.get(index).map(|d| nanos_f64(*d))
            }
        }
    }

    /// Converts nanoseconds to a delay, clamped to `[0, max_delay]` (which
    /// also absorbs overflow to infinity and NaN).
    fn to_duration(&self, nanos: f64) -> Duration {
        let max = self.max_delay();
        if nanos >= nanos_f64(max) {
            return max;
        }
        // `as` saturates, and NaN becomes 0.
        Duration::from_nanos(nanos.max(0.0) as u64)
    }
}

/// Nanoseconds as a float, without the slow `u128` conversion of `as_nanos`.
fn nanos_f64(d: Duration) -> f64 {
    d.as_secs() as f64 * 1e9 + f64::from(d.subsec_nanos())
}

/// Where a sequence of delays stands: the next retry number, the delay used
/// last (for decorrelated jitter) and the random source.
#[derive(Debug, Clone)]
pub(crate) struct Cursor {
    retry: u32,
    prev: Option<Duration>,
    pub(crate) rand: Rand,
}

impl Cursor {
    pub(crate) fn new(rand: Rand) -> Self {
        Self {
            retry: 0,
            prev: None,
            rand,
        }
    }
}

/// The delays of a [`Backoff`], in order: endless for exponential backoff,
/// as many as listed for a schedule.
#[derive(Debug, Clone)]
pub struct Delays<'a> {
    backoff: &'a Backoff,
    cursor: Cursor,
}

impl Iterator for Delays<'_> {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        self.backoff.advance(&mut self.cursor)
    }
}

/// The serde form of a [`Backoff`], tagged by `kind`:
///
/// ```
/// use keel_policy::retry::BackoffConfig;
/// let exp: BackoffConfig = serde_json::from_str(
///     r#"{"kind": "exponential", "base": "1s", "factor": 2.0, "max_delay": "60s", "jitter": {"proportional": 0.25}}"#,
/// ).unwrap();
/// assert!(exp.build().is_ok());
/// let webhook: BackoffConfig = serde_json::from_str(
///     r#"{"kind": "schedule", "delays": ["5s", "5m", "30m", "2h", "5h", "10h", "10h"]}"#,
/// ).unwrap();
/// assert_eq!(webhook.build().unwrap().max_retries(), Some(7));
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum BackoffConfig {
    /// `base × factorⁿ`, capped at `max_delay`.
    Exponential {
        /// The first delay (default 200 ms).
        #[serde(with = "humantime_serde", default = "default_base")]
        base: Duration,
        /// The growth per retry, at least 1 (default 2).
        #[serde(default = "default_factor")]
        factor: f64,
        /// The longest delay (default 10 s).
        #[serde(with = "humantime_serde", default = "default_max")]
        max_delay: Duration,
        /// The randomisation (default full).
        #[serde(default)]
        jitter: Jitter,
    },
    /// An explicit list of delays, one per retry.
    Schedule {
        /// The delays, in order.
        #[serde(with = "durations")]
        delays: Vec<Duration>,
        /// The randomisation (default none).
        #[serde(default = "no_jitter")]
        jitter: Jitter,
    },
}

impl Default for BackoffConfig {
    fn default() -> Self {
        Backoff::default().to_config()
    }
}

impl BackoffConfig {
    /// Validates and builds the backoff.
    pub fn build(self) -> Result<Backoff, ConfigError> {
        let backoff = match self {
            Self::Exponential {
                base,
                factor,
                max_delay,
                jitter,
            } => Backoff {
                shape: Shape::Exponential {
                    base,
                    factor,
                    max: max_delay,
                },
                jitter,
                max: max_delay,
            },
            Self::Schedule { delays, jitter } => Backoff {
                max: delays.iter().copied().max().unwrap_or_default(),
                shape: Shape::Schedule(delays.into()),
                jitter,
            },
        };
        backoff.validate()?;
        Ok(backoff)
    }
}

fn default_base() -> Duration {
    DEFAULT_BASE
}

fn default_factor() -> f64 {
    DEFAULT_FACTOR
}

fn default_max() -> Duration {
    DEFAULT_MAX
}

fn no_jitter() -> Jitter {
    Jitter::None
}

/// A list of durations in humantime form (`["5s", "5m"]`).
mod durations {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    pub(super) fn serialize<S: Serializer>(delays: &[Duration], s: S) -> Result<S::Ok, S::Error> {
        let texts: Vec<humantime_serde::Serde<&Duration>> = delays.iter().map(Into::into).collect();
        texts.serialize(s)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Duration>, D::Error> {
        let texts = Vec::<humantime_serde::Serde<Duration>>::deserialize(d)?;
        Ok(texts
            .into_iter()
            .map(humantime_serde::Serde::into_inner)
            .collect())
    }
}
