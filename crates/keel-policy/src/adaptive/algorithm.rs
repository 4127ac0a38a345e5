//! The limit algorithms: what one completed call says about the limit.

use std::time::Duration;

use tokio::time::Instant;

use super::{AimdConfig, GradientConfig};

/// How a call ended, as far as the limit is concerned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The dependency answered in time.
    Success,
    /// The call timed out, was cancelled, was refused for overload or failed
    /// in a way that says the dependency is struggling: a congestion signal.
    Dropped,
}

/// One completed call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    /// How long the call took.
    pub rtt: Duration,
    /// Calls in flight when it completed, itself included.
    pub in_flight: usize,
    /// How it ended.
    pub outcome: Outcome,
    /// When it completed.
    pub at: Instant,
}

/// An algorithm that adjusts a concurrency limit from completed calls.
///
/// The policy keeps the limit as a real number, calls `update` under a lock
/// after every sampled call, and clamps the result to its
/// `[min_limit, max_limit]`.
pub trait LimitAlgorithm: Send + 'static {
    /// The new limit, given the current one and a completed call.
    fn update(&mut self, limit: f64, sample: &Sample) -> f64;
}

/// Additive increase, multiplicative decrease, as TCP does it.
///
/// A drop multiplies the limit by `backoff_ratio` (0.9). A success while the
/// limit is being used (at least half of it in flight) adds `1 / limit`, so
/// the limit grows by one per limit's worth of successes: one per round
/// trip at full use. Successes while mostly idle change nothing, so a quiet
/// period cannot inflate the limit.
#[derive(Debug, Clone)]
pub struct Aimd {
    backoff_ratio: f64,
}

impl Aimd {
    /// An AIMD algorithm with these (validated) settings.
    pub fn new(config: &AimdConfig) -> Self {
        Self {
            backoff_ratio: config.backoff_ratio,
        }
    }
}

impl LimitAlgorithm for Aimd {
    fn update(&mut self, limit: f64, sample: &Sample) -> f64 {
        match sample.outcome {
            Outcome::Dropped => limit * self.backoff_ratio,
            Outcome::Success if is_used(limit, sample) => limit + 1.0 / limit.max(1.0),
            Outcome::Success => limit,
        }
    }
}

/// Netflix's gradient algorithm: compares each call's round trip with the
/// shortest one recently seen.
///
/// `new = limit × gradient + queue`, where `gradient = tolerance × min_rtt /
/// rtt`, kept within `[0.5, 1]`, and `queue = √limit` is the headroom
/// probed for. Every change is smoothed: `limit + smoothing × (new -
/// limit)`. While round trips stay near `min_rtt`, the limit grows by about
/// `smoothing × √limit` per call; when they stretch beyond `tolerance ×
/// min_rtt`, queueing has begun and the limit shrinks. A drop multiplies by
/// `backoff_ratio` (smoothed too).
///
/// `min_rtt` is forgotten every `min_rtt_window` so a lasting change in the
/// dependency is learned. Dropped calls never feed `min_rtt`, so steady
/// timeouts cannot become the new normal and let the limit run away.
#[derive(Debug, Clone)]
pub struct Gradient {
    config: GradientConfig,
    min_rtt: Option<Duration>,
    window_start: Option<Instant>,
}

impl Gradient {
    /// A gradient algorithm with these (validated) settings.
    pub fn new(config: &GradientConfig) -> Self {
        Self {
            config: config.clone(),
            min_rtt: None,
            window_start: None,
        }
    }

    fn observe(&mut self, sample: &Sample) -> Duration {
        let window_over = self.window_start.is_none_or(|start| {
            sample.at.saturating_duration_since(start) >= self.config.min_rtt_window
        });
        let min_rtt = match self.min_rtt {
            Some(min_rtt) if !window_over => min_rtt.min(sample.rtt),
            _ => {
                self.window_start = Some(sample.at);
                sample.rtt
            }
        };
        self.min_rtt = Some(min_rtt);
        min_rtt
    }

    fn smooth(&self, limit: f64, target: f64) -> f64 {
        limit + self.config.smoothing * (target - limit)
    }
}

impl LimitAlgorithm for Gradient {
    fn update(&mut self, limit: f64, sample: &Sample) -> f64 {
        if sample.outcome == Outcome::Dropped {
            return self.smooth(limit, limit * self.config.backoff_ratio);
        }
        let min_rtt = self.observe(sample);
        if !is_used(limit, sample) {
            return limit;
        }
        let ratio = nanos(min_rtt) / nanos(sample.rtt);
        let gradient = (self.config.tolerance * ratio).clamp(0.5, 1.0);
        let queue = limit.sqrt().max(1.0);
        self.smooth(limit, limit * gradient + queue)
    }
}

/// Whether at least half the limit was in use: only then does a success
/// say anything about whether the limit could be higher.
fn is_used(limit: f64, sample: &Sample) -> bool {
    sample.in_flight as f64 * 2.0 >= limit
}

/// A round trip in nanoseconds, at least one so ratios stay finite.
fn nanos(rtt: Duration) -> f64 {
    rtt.as_nanos().max(1) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(rtt_ms: u64, in_flight: usize, outcome: Outcome, at: Instant) -> Sample {
        Sample {
            rtt: Duration::from_millis(rtt_ms),
            in_flight,
            outcome,
            at,
        }
    }

    #[test]
    fn aimd_adds_one_per_window_and_backs_off_by_the_ratio() {
        let now = Instant::now();
        let mut aimd = Aimd::new(&AimdConfig::default());
        let mut limit = 10.0;
        for _ in 0..10 {
            limit = aimd.update(limit, &sample(5, 10, Outcome::Success, now));
        }
        assert!((limit - 11.0).abs() < 0.05, "{limit}");
        assert_eq!(
            aimd.update(10.0, &sample(5, 10, Outcome::Dropped, now)),
            9.0
        );
        assert_eq!(
            aimd.update(10.0, &sample(5, 2, Outcome::Success, now)),
            10.0,
            "idle: unchanged"
        );
    }

    #[test]
    fn gradient_grows_at_min_rtt_and_shrinks_when_rtt_stretches() {
        let now = Instant::now();
        let mut gradient = Gradient::new(&GradientConfig::default());
        let grown = gradient.update(16.0, &sample(10, 16, Outcome::Success, now));
        assert!((grown - (16.0 + 0.2 * 4.0)).abs() < 1e-9, "{grown}");
        let shrunk = gradient.update(16.0, &sample(40, 16, Outcome::Success, now));
        assert!(
            (shrunk - (16.0 + 0.2 * (8.0 + 4.0 - 16.0))).abs() < 1e-9,
            "{shrunk}"
        );
    }

    #[test]
    fn gradient_survives_zero_round_trips() {
        let now = Instant::now();
        let mut gradient = Gradient::new(&GradientConfig::default());
        let limit = gradient.update(4.0, &sample(0, 4, Outcome::Success, now));
        assert!(limit.is_finite());
    }
}
