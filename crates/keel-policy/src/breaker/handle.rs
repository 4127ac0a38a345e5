//! The breaker handle and its plain async API.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use keel_core::{Classify, Name, PolicyError, Rejected};
use serde::Serialize;
use tokio::sync::broadcast;

use super::machine::Inner;
use super::{
    CircuitBreakerBuilder, CircuitBreakerConfig, CircuitBreakerLayer, Outcome, OwnedPermit, Permit,
    State, StateTransition,
};

/// A circuit breaker for one dependency. Clones share the same state.
#[derive(Debug, Clone)]
pub struct CircuitBreaker {
    inner: Arc<Inner>,
}

/// A point-in-time view of a breaker, for dashboards and operator consoles.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BreakerMetrics {
    /// The current state.
    pub state: State,
    /// Percentage of the window's calls that failed; `None` until the window
    /// holds `minimum_calls` calls.
    pub failure_rate: Option<f64>,
    /// Percentage of the window's calls that were slow; `None` until the
    /// window holds `minimum_calls` calls.
    pub slow_call_rate: Option<f64>,
    /// Calls in the window.
    pub buffered_calls: u64,
    /// Failed calls in the window.
    pub failed_calls: u64,
    /// Slow calls in the window.
    pub slow_calls: u64,
    /// Failures in a row, as of the last recorded call.
    pub consecutive_failures: u32,
    /// Half-open probes let through and not yet answered.
    pub probes_in_flight: u16,
    /// While open, the time until a probe is let through.
    #[serde(with = "humantime_serde")]
    pub retry_after: Option<Duration>,
}

impl CircuitBreaker {
    /// Starts building a breaker named `name` (usually the dependency's).
    pub fn builder(name: impl Into<Name>) -> CircuitBreakerBuilder {
        CircuitBreakerBuilder::new(name.into())
    }

    pub(super) fn from_valid(config: CircuitBreakerConfig, name: Name) -> Self {
        Self {
            inner: Arc::new_cyclic(|this| Inner::new(config, name, this.clone())),
        }
    }

    /// The breaker's name.
    pub fn name(&self) -> &Name {
        self.inner.name()
    }

    /// The configuration the breaker was built from.
    pub fn config(&self) -> &CircuitBreakerConfig {
        self.inner.config()
    }

    /// The current state. An open breaker whose open duration has passed
    /// still reads `Open` until a call arrives to probe.
    pub fn state(&self) -> State {
        self.inner.state()
    }

    /// Whether an open breaker's cool-down timer has yet to fire.
    #[cfg(test)]
    pub(super) fn cooling(&self) -> bool {
        self.inner.cooling()
    }

    #[cfg(test)]
    pub(super) fn inner(&self) -> &Inner {
        &self.inner
    }

    /// Rates, counts and state, as of now.
    pub fn metrics(&self) -> BreakerMetrics {
        self.inner.metrics()
    }

    /// Receives every state transition from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<StateTransition> {
        self.inner.subscribe()
    }

    /// Asks to make one call; record its outcome on the permit.
    pub fn try_acquire(&self) -> Result<Permit<'_>, Rejected> {
        match self.inner.acquire() {
            Ok(ticket) => Ok(Permit::new(&self.inner, ticket)),
            Err(probe_at) => Err(self.inner.refuse(probe_at)),
        }
    }

    /// Like [`try_acquire`](Self::try_acquire), with a permit that can move
    /// into another task.
    pub fn try_acquire_owned(&self) -> Result<OwnedPermit, Rejected> {
        match self.inner.acquire() {
            Ok(ticket) => Ok(OwnedPermit::new(self.inner.clone(), ticket)),
            Err(probe_at) => Err(self.inner.refuse(probe_at)),
        }
    }

    /// Runs `f` if the breaker allows, and records its result: dependency
    /// failures ([`ErrorClass::is_dependency_failure`](keel_core::ErrorClass::is_dependency_failure):
    /// retryable, of unknown outcome, or unclassified) count against the
    /// dependency, permanent errors count as answers, and refusals from inner
    /// policies are not recorded.
    pub async fn call<T, E, F, Fut>(&self, f: F) -> Result<T, PolicyError<E>>
    where
        E: Classify,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.call_with(f, Outcome::of).await
    }

    /// Like [`call`](Self::call), deciding the outcome with `classify`, for
    /// results whose health is not in the error type (an HTTP 503 returned
    /// as `Ok`, a slow-but-successful answer to ignore).
    pub async fn call_with<T, E, F, Fut, C>(&self, f: F, classify: C) -> Result<T, PolicyError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        C: FnOnce(&Result<T, E>) -> Outcome,
    {
        let mut permit = match self.inner.acquire() {
            Ok(ticket) => Permit::new(&self.inner, ticket),
            Err(probe_at) => return Err(PolicyError::Rejected(self.inner.refuse(probe_at))),
        };
        let result = f().await;
        permit.settle(classify(&result));
        result.map_err(PolicyError::Inner)
    }

    /// Runs `f` if the breaker allows; otherwise serves `fallback`, given the
    /// refusal. A breaker without a fallback just moves the error around.
    pub async fn call_or_fallback<T, E, F, Fut, G, GFut>(&self, f: F, fallback: G) -> Result<T, E>
    where
        E: Classify,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        G: FnOnce(Rejected) -> GFut,
        GFut: Future<Output = Result<T, E>>,
    {
        match self.try_acquire() {
            Ok(mut permit) => {
                let result = f().await;
                permit.settle(Outcome::of(&result));
                result
            }
            Err(rejected) => fallback(rejected).await,
        }
    }

    /// Refuses every call until [`reset`](Self::reset) (for maintenance, or
    /// to shed a dependency by hand).
    pub fn force_open(&self) {
        self.inner.force(State::ForcedOpen, "forced open");
    }

    /// Lets every call through and keeps recording, but never opens, until
    /// [`reset`](Self::reset).
    pub fn disable(&self) {
        self.inner.force(State::Disabled, "disabled");
    }

    /// Closes the breaker, clears its window and its open-duration backoff.
    pub fn reset(&self) {
        self.inner.force(State::Closed, "reset");
    }

    /// A tower layer that puts this breaker in front of a service. Errors
    /// count by their class; every response counts as a success (judge
    /// responses with [`CircuitBreakerLayer::classify_response`]).
    pub fn layer(&self) -> CircuitBreakerLayer {
        CircuitBreakerLayer::new(self.clone())
    }

    /// A tower layer for an HTTP client service (`http::Response`): errors
    /// count by their class, and `5xx` and `429` responses count as
    /// failures ([`HttpStatus`](super::HttpStatus)).
    #[cfg(feature = "http")]
    pub fn http_layer(&self) -> CircuitBreakerLayer<super::HttpStatus> {
        self.layer().classify_response(super::HttpStatus)
    }

    /// A tower layer for a gRPC client service (a tonic `Channel`):
    /// errors count by their class, and calls the server ended with a
    /// failing status count as failures ([`GrpcStatus`](super::GrpcStatus)).
    #[cfg(feature = "http")]
    pub fn grpc_layer(&self) -> CircuitBreakerLayer<super::GrpcStatus> {
        self.layer().classify_response(super::GrpcStatus)
    }
}
