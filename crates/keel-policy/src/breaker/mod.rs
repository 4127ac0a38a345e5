//! A circuit breaker stops calling a dependency that keeps failing, gives it
//! time to recover, and probes it carefully before trusting it again.
//!
//! # How it decides
//!
//! - **Closed**: calls go through and land in a sliding window, either the
//!   last N calls ([`SlidingWindow::Count`], default 100) or the last N
//!   seconds ([`SlidingWindow::Time`]). Once the window holds
//!   `minimum_calls` (20), the breaker opens when the failure rate reaches
//!   `failure_rate_threshold` (50%) or the slow-call rate reaches
//!   `slow_call_rate_threshold`. Without a minimum, one failure out of one
//!   call opens the breaker on a quiet endpoint at 3 a.m. It can also open
//!   after `consecutive_failures` failures in a row, with or without rates.
//! - **Open**: calls are refused with
//!   [`Rejected::CircuitOpen`](keel_core::Rejected::CircuitOpen), whose
//!   `retry_at` says when a probe will be let through. A refusal does not
//!   read the clock: a timer on tokio's time driver tells the breaker when
//!   its cool-down is nearly over. Serve a fallback
//!   ([`CircuitBreaker::call_or_fallback`]): a breaker without one just moves
//!   the error around.
//! - **Half-open**: after the open duration, `permitted_calls_in_half_open`
//!   probes (1) go through; more are refused. One failed probe reopens the
//!   breaker; it closes only once every probe succeeded. Never average here.
//! - **Forced open** and **disabled** are for operators
//!   ([`force_open`](CircuitBreaker::force_open),
//!   [`disable`](CircuitBreaker::disable), [`reset`](CircuitBreaker::reset)).
//!
//! # What counts
//!
//! By the error's [class](keel_core::ErrorClass) ([`Outcome::from_class`]):
//!
//! | result | outcome |
//! |---|---|
//! | `Retryable` error (connection refused, `503`) | failure |
//! | `OutcomeUnknown` error (a timeout, a reset mid-response) | failure |
//! | `Unclassified` error: nobody said what it is | **failure** |
//! | `Permanent` error: marked as the caller's own fault (`4xx`, validation) | success: the dependency answered, the request was wrong |
//! | `Rejected`: an inner policy refused (bulkhead full) | not recorded: the dependency was never asked |
//! | `Ok` response | success, unless the layer's [`ClassifyResponse`] says otherwise |
//!
//! An error nobody classified counts as a failure, as Resilience4j and Polly
//! count every exception: a dependency failing in a way nobody foresaw must
//! still trip the breaker, and only the caller can know that an error is its
//! own fault (say so with [`Classified::permanent`](keel_core::Classified::permanent)).
//!
//! A tower service answering HTTP returns a `500` as `Ok(response)`, which
//! no error class sees: give the layer a [`ClassifyResponse`] with
//! [`CircuitBreakerLayer::classify_response`]. `HttpStatus` (feature `http`,
//! or `CircuitBreaker::http_layer`) counts `5xx` and `429` as failures and
//! every other status, `404` and `422` included, as a success; `GrpcStatus`
//! judges a gRPC call's status by its code; a closure
//! `Fn(&Response) -> Outcome` decides anything else. [`CircuitBreaker::call_with`]
//! decides per result in the plain async API.
//!
//! # Why the open duration doubles, with jitter
//!
//! The breaker stays open 30 s at first, and twice as long each time a probe
//! fails again, up to 5 min; a successful close resets it. Each duration is
//! spread by ±10%. A fixed short cool-down turns a fleet of breakers into a
//! synchronised traffic generator against a service trying to boot. Set the
//! jitter to 0 for deterministic tests.
//!
//! # Cancelled probes
//!
//! A probe whose future is dropped records nothing and gives its slot back,
//! so the next caller probes instead: a dropped call says nothing about the
//! dependency, and keeping the slot would leave the breaker half-open for
//! ever. Slowness is caught by a timeout placed *inside* the breaker, whose
//! [`Rejected::Timeout`](keel_core::Rejected::Timeout) counts as a failure, or
//! by `max_wait_in_half_open`, after which unanswered probes count as failed.
//!
//! # Cost
//!
//! Deciding whether a call may go is one atomic load while closed, and two
//! while open; no lock and no clock read. An open breaker learns that its
//! cool-down is nearly over from one timer on tokio's time driver, so a
//! breaker that opens inside a runtime needs that runtime's timers
//! (`enable_time`, which `#[tokio::main]` and `#[tokio::test]` turn on); one
//! that opens outside a runtime reads the clock on each refusal instead. A
//! refusal carries the breaker's [`Name`](keel_core::Name), which is copied,
//! not reference-counted, so threads refusing at once share no write. Recording takes no lock with a count-based
//! window: a success into a window already full of successes writes nothing
//! at all, so a healthy dependency's calls only read shared memory and many
//! threads do not contend; otherwise one `fetch_add`, and a write only when a
//! slot changes. The time-based window takes a short lock. Nothing allocates
//! per call. Transitions, which are rare, take a lock so that their effects
//! happen once and in order, and are reported by [`CircuitBreaker::subscribe`],
//! `tracing`, and the metrics `keel_breaker_state` (0 closed, 1 open,
//! 2 half-open, 3 forced open, 4 disabled),
//! `keel_breaker_transitions_total{from,to}`, `keel_breaker_rejected_total`
//! and `keel_breaker_calls_total{outcome}` (failures and ignored results only,
//! so that successes touch no shared counter), each labelled with the
//! breaker's `name`.
//!
//! # One breaker per dependency
//!
//! [`BreakerRegistry`] makes one breaker per dependency, and per endpoint
//! where their failure modes differ, so a sick dependency never cuts off a
//! healthy one.
//!
//! ```
//! use std::time::Duration;
//! use keel_core::{Classified, PolicyError};
//! use keel_policy::breaker::{CircuitBreaker, State};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let breaker = CircuitBreaker::builder("prices")
//!     .minimum_calls(5)
//!     .open_duration(Duration::from_secs(10))
//!     .build()
//!     .unwrap();
//!
//! for _ in 0..5 {
//!     let down = breaker.call(|| async { Err::<u32, _>(Classified::retryable("connection refused")) });
//!     assert!(matches!(down.await, Err(PolicyError::Inner(_))));
//! }
//! assert_eq!(breaker.state(), State::Open);
//!
//! // The dependency is no longer called: the fallback answers.
//! let price = breaker
//!     .call_or_fallback(|| async { Ok::<u32, Classified>(42) }, |_open| async { Ok(40) })
//!     .await;
//! assert_eq!(price.unwrap(), 40);
//! # });
//! ```

mod classify;
mod config;
mod cool_down;
mod future;
mod handle;
mod layer;
mod machine;
mod permit;
mod reason;
mod registry;
mod state;
mod telemetry;
mod window;

#[cfg(test)]
mod tests;

pub use classify::{Answered, ClassifyResponse};
#[cfg(feature = "http")]
pub use classify::{GrpcStatus, HttpStatus};
pub use config::{
    CircuitBreakerBuilder, CircuitBreakerConfig, MAX_WINDOW_CALLS, MAX_WINDOW_SECONDS,
    SlidingWindow,
};
pub use future::ResponseFuture;
pub use handle::{BreakerMetrics, CircuitBreaker};
pub use layer::{CircuitBreakerLayer, CircuitBreakerService};
pub use permit::{Outcome, OwnedPermit, Permit};
pub use registry::{BreakerRegistry, BreakerRegistryConfig, BreakerSnapshot};
pub use state::{State, StateTransition};
