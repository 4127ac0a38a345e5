//! Fault injection: added latency and injected failures, for test traffic
//! only, to prove the other policies work before a real outage does.
//!
//! A [`FaultInjection`] answers the questions a resilience setup has to face:
//! *does the caller's timeout fire? does the breaker open? is the fallback
//! served?* It injects, like a service mesh's fault filter:
//!
//! - a **delay**: a percentage of calls wait a fixed time before running;
//! - an **abort**: a percentage of calls fail at once with
//!   [`Rejected::InjectedFault`], which classifies as
//!   [`Retryable`](keel_core::ErrorClass::Retryable) — it stands in for a
//!   dependency failure, so retries, breakers and fallbacks treat it as one.
//!
//! A call may be both delayed and then aborted, in that order.
//!
//! # Safe by default
//!
//! - **Off by default.** Faults only happen once the injector is
//!   [enabled](FaultInjectionBuilder::enabled), and
//!   [`set_enabled`](FaultInjection::set_enabled) is a kill switch at run time.
//!   A disabled injector costs one relaxed atomic load per call.
//! - **Scoped to test traffic.** Only calls marked as part of an experiment
//!   see faults. In the plain API the mark is [`ChaosExperiment::scope`], a
//!   task-local that an HTTP edge sets from the [`EXPERIMENT_HEADER`]
//!   (`x-chaos-experiment: pricing-latency`) so that only your test client's
//!   requests are affected; an injector built with
//!   [`experiment`](FaultInjectionBuilder::experiment) only acts on that one
//!   experiment. In the tower layer a matcher `Fn(&Req) -> bool` decides (this
//!   crate does not depend on `http`; match the header there). Unmarked
//!   traffic never sees a fault, even at 100%.
//!
//! Every injected fault is counted in `keel_fault_injected_total{name, kind}`
//! (`kind` = `delay` or `abort`).
//!
//! ```
//! use std::time::Duration;
//! use keel_policy::chaos::{ChaosExperiment, FaultInjection};
//! use keel_policy::{PolicyError, Rejected};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
//! let chaos = FaultInjection::builder("pricing")
//!     .experiment("pricing-latency")
//!     .abort(100.0)
//!     .enabled(true)
//!     .build()?;
//! let op = || async { Ok::<_, std::io::Error>(2500) };
//!
//! // Ordinary traffic is never touched.
//! assert_eq!(chaos.call(op).await.unwrap(), 2500);
//! // Traffic in the experiment gets the fault.
//! let hit = ChaosExperiment::scope("pricing-latency", chaos.call(op)).await;
//! assert!(matches!(hit, Err(PolicyError::Rejected(Rejected::InjectedFault { .. }))));
//! # Ok::<_, keel_policy::ConfigError>(())
//! # }).unwrap();
//! ```

mod config;
mod layer;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use keel_core::{Name, PolicyError, Rejected};
use parking_lot::Mutex;
use tokio::task::futures::TaskLocalFuture;

pub use config::{AbortFault, DelayFault, FaultInjectionBuilder, FaultInjectionConfig};
pub use layer::{FaultInjectionLayer, FaultInjectionService, ResponseFuture};

/// The header an HTTP edge reads to mark a request as part of an experiment,
/// as in a mesh's `match: headers: x-chaos-experiment: {exact: ...}`.
pub const EXPERIMENT_HEADER: &str = "x-chaos-experiment";

tokio::task_local! {
    static EXPERIMENT: Name;
}

/// The chaos experiment the current task's request belongs to, if any.
#[derive(Debug, Clone, Copy)]
pub struct ChaosExperiment;

impl ChaosExperiment {
    /// Runs `fut` as part of the experiment `name`: fault injectors for that
    /// experiment act on the calls it makes. Set it where a request enters,
    /// from [`EXPERIMENT_HEADER`].
    pub fn scope<F: Future>(name: impl Into<Name>, fut: F) -> TaskLocalFuture<Name, F> {
        EXPERIMENT.scope(name.into(), fut)
    }

    /// The experiment of the running task, if it is in one.
    pub fn current() -> Option<Name> {
        EXPERIMENT.try_with(Name::clone).ok()
    }
}

/// Injects delays and failures into calls of test traffic. Clones share one
/// injector; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct FaultInjection {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    name: Name,
    enabled: AtomicBool,
    experiment: Option<Box<str>>,
    delay: Option<DelayFault>,
    abort_percentage: f64,
    rng: Option<Mutex<fastrand::Rng>>,
    delays_total: metrics::Counter,
    aborts_total: metrics::Counter,
}

impl Inner {
    fn new(name: Name, config: FaultInjectionConfig, seed: Option<u64>) -> Self {
        let counter = |kind: &'static str| metrics::counter!("keel_fault_injected_total", "name" => name.to_string(), "kind" => kind);
        Self {
            delays_total: counter("delay"),
            aborts_total: counter("abort"),
            enabled: AtomicBool::new(config.enabled),
            experiment: config.experiment.map(String::into_boxed_str),
            delay: config.delay,
            abort_percentage: config.abort.map_or(0.0, |a| a.percentage),
            rng: seed.map(|s| Mutex::new(fastrand::Rng::with_seed(s))),
            name,
        }
    }
}

/// The faults chosen for one call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Faults {
    pub(crate) delay: Option<Duration>,
    pub(crate) abort: bool,
}

impl FaultInjection {
    /// A builder named after the dependency whose failures it simulates.
    pub fn builder(name: impl Into<Name>) -> FaultInjectionBuilder {
        FaultInjectionBuilder::new(name.into())
    }

    /// The injector's name.
    pub fn name(&self) -> &Name {
        &self.inner.name
    }

    /// Whether faults are injected at all.
    #[inline]
    pub fn is_enabled(&self) -> bool {
        self.inner.enabled.load(Ordering::Relaxed)
    }

    /// Turns injection on or off for every clone, at once: the kill switch.
    pub fn set_enabled(&self, enabled: bool) {
        self.inner.enabled.store(enabled, Ordering::Relaxed);
        tracing::info!(fault_injection = %self.inner.name, enabled, "fault injection switched");
    }

    /// Whether the running task is in an experiment this injector acts on.
    #[inline]
    pub fn in_experiment(&self) -> bool {
        EXPERIMENT
            .try_with(|current| {
                self.inner
                    .experiment
                    .as_deref()
                    .is_none_or(|wanted| **current == *wanted)
            })
            .unwrap_or(false)
    }

    /// A tower layer injecting faults into requests for which `matcher`
    /// returns true.
    pub fn layer<M>(&self, matcher: M) -> FaultInjectionLayer<M> {
        FaultInjectionLayer::new(self.clone(), matcher)
    }

    /// Runs `f`, first delaying or failing it if the running task is in this
    /// injector's experiment and the dice say so. A failed call is never
    /// started.
    pub async fn call<T, E, F, Fut>(&self, f: F) -> Result<T, PolicyError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        if self.is_enabled() && self.in_experiment() {
            let faults = self.roll();
            if let Some(delay) = faults.delay {
                // Boxed so that the future every call carries stays small:
                // only test traffic ever waits here.
                Box::pin(tokio::time::sleep(delay)).await;
            }
            if faults.abort {
                return Err(self.aborted().into());
            }
        }
        f().await.map_err(PolicyError::Inner)
    }

    /// Chooses the faults for one call of test traffic, and counts them.
    pub(crate) fn roll(&self) -> Faults {
        let inner = &*self.inner;
        let delay = inner
            .delay
            .filter(|d| self.hit(d.percentage))
            .map(|d| d.fixed_delay);
        if let Some(delay) = delay {
            inner.delays_total.increment(1);
            tracing::debug!(fault_injection = %inner.name, ?delay, "injecting a delay");
        }
        let abort = self.hit(inner.abort_percentage);
        Faults { delay, abort }
    }

    /// The injected failure, counted.
    pub(crate) fn aborted(&self) -> Rejected {
        let inner = &*self.inner;
        inner.aborts_total.increment(1);
        tracing::debug!(fault_injection = %inner.name, "injecting a failure");
        Rejected::InjectedFault { name: inner.name }
    }

    fn hit(&self, percentage: f64) -> bool {
        if percentage <= 0.0 {
            return false;
        }
        if percentage >= 100.0 {
            return true;
        }
        let draw = match &self.inner.rng {
            Some(rng) => rng.lock().f64(),
            None => fastrand::f64(),
        };
        draw * 100.0 < percentage
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_injects_nothing_and_is_off() {
        let chaos = FaultInjectionConfig::default().build("c").unwrap();
        assert!(!chaos.is_enabled());
        assert_eq!(chaos.roll(), Faults::default());
    }

    #[test]
    fn zero_and_hundred_percent_need_no_dice() {
        let chaos = FaultInjection::builder("c")
            .delay(100.0, Duration::from_secs(1))
            .abort(0.0)
            .build()
            .unwrap();
        for _ in 0..100 {
            assert_eq!(
                chaos.roll(),
                Faults {
                    delay: Some(Duration::from_secs(1)),
                    abort: false
                }
            );
        }
    }

    #[tokio::test]
    async fn the_experiment_is_task_local() {
        assert_eq!(ChaosExperiment::current(), None);
        let inside = ChaosExperiment::scope("x", async { ChaosExperiment::current() }).await;
        assert_eq!(inside.as_deref(), Some("x"));
    }
}
