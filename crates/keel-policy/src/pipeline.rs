//! One value that applies several policies to a call, in the order that works.
//!
//! Policies compose, but not in any order. A [`Pipeline`] nests the ones you
//! give it like this, outermost first:
//!
//! ```text
//! fallback → total timeout → retry (+ budget) → circuit breaker → attempt timeout → bulkhead → rate limit → call
//! ```
//!
//! Why this order:
//!
//! - **Fallback outermost**: it answers for *everything* below, including a
//!   total timeout or an open breaker, and is the only thing that turns a
//!   failure into a degraded success.
//! - **Total timeout outside retry**: it bounds the whole call, retries and
//!   their sleeps included, and sets the [`Deadline`](keel_core::Deadline) the
//!   retry reads so it never sleeps past it. (A timeout inside the retry would
//!   restart with every attempt and bound nothing.)
//! - **Retry outside the breaker**: each attempt asks the breaker; once it
//!   opens, the refusal (`Rejected`) is not retryable, so retries stop at once
//!   instead of hammering a dependency that is down. The retry budget stops
//!   them during wide outages the breaker has not seen yet.
//! - **Attempt timeout inside the breaker**: a hung attempt is cut off and
//!   *counted by the breaker as a failure* (its outcome is unknown), so a
//!   dependency that hangs trips the breaker like one that errors.
//! - **Bulkhead and rate limit innermost**: they guard the scarce resource
//!   itself, so only attempts that will really be made take a slot or a
//!   token; a refused slot is a refusal, which the breaker does not count
//!   against the dependency.
//!
//! The mesh rule "2 × 700 ms + overhead MUST fit in 2 s" is checked when the
//! pipeline is built: with a total timeout, an attempt timeout and a retry,
//! `max_attempts × attempt_timeout` must not exceed the total timeout.
//!
//! ```
//! use std::time::Duration;
//! use keel_core::Classified;
//! use keel_policy::pipeline::Pipeline;
//! use keel_policy::{breaker::CircuitBreaker, retry::Retry, timeout::Timeout};
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap().block_on(async {
//! let payments = Pipeline::builder("payments")
//!     .total_timeout(Timeout::builder("payments.total").timeout(Duration::from_secs(2)).build()?)
//!     .retry(Retry::builder("payments").max_attempts(2).build()?)
//!     .breaker(CircuitBreaker::builder("payments").build()?)
//!     .attempt_timeout(Timeout::builder("payments.attempt").timeout(Duration::from_millis(700)).build()?)
//!     .build()?;
//!
//! let receipt = payments.call(|| async { Ok::<_, Classified>("charged") }).await;
//! assert_eq!(receipt.unwrap(), "charged");
//! # Ok::<_, Box<dyn std::error::Error>>(())
//! # }).unwrap();
//! ```

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use futures_util::TryFutureExt;
use futures_util::future::MapErr;
use keel_core::clock::{self, Instant};
use keel_core::{BoxError, Classify, Name, PolicyError};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use tower::ServiceBuilder;
use tower::layer::util::{Identity, Stack};
use tower::util::{Either, option_layer};
use tower_layer::Layer;
use tower_service::Service;

use crate::ConfigError;
use crate::breaker::{Answered, CircuitBreaker, CircuitBreakerConfig, CircuitBreakerLayer};
use crate::bulkhead::{Bulkhead, BulkheadConfig, BulkheadLayer};
use crate::fallback::{Fallback, FallbackConfig};
use crate::rate_limit::{RateLimitConfig, RateLimitLayer, RateLimiter};
use crate::retry::{Retry, RetryConfig, RetryLayer};
use crate::timeout::{Timeout, TimeoutConfig, TimeoutLayer};

type Optional<L> = Either<L, Identity>;

/// Maps the wrapped service's error into a [`BoxError`], so that a present
/// and an absent policy (tower's `Either`) have the same error type.
#[derive(Debug, Clone, Copy, Default)]
pub struct BoxErrorLayer;

/// The service of [`BoxErrorLayer`].
#[derive(Debug, Clone)]
pub struct BoxErrorService<S>(S);

impl<S> Layer<S> for BoxErrorLayer {
    type Service = BoxErrorService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        BoxErrorService(inner)
    }
}

impl<S, Req> Service<Req> for BoxErrorService<S>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = MapErr<S::Future, fn(S::Error) -> BoxError>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.0.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        self.0.call(req).map_err(Into::into)
    }
}

/// The tower layer of a [`Pipeline`] (see [`Pipeline::layer`]): the same
/// policies, outermost first, each present only if the pipeline has it. `C`
/// is how the breaker judges responses ([`Pipeline::layer_classifying`]).
pub type PipelineLayer<C = Answered> = Stack<
    BoxErrorLayer,
    Stack<
        Optional<RateLimitLayer>,
        Stack<
            Optional<BulkheadLayer>,
            Stack<
                Optional<TimeoutLayer>,
                Stack<
                    Optional<CircuitBreakerLayer<C>>,
                    Stack<Optional<RetryLayer>, Stack<Optional<TimeoutLayer>, Identity>>,
                >,
            >,
        >,
    >,
>;

/// The rule "2 × 700 ms + overhead MUST fit in 2 s": `attempts` tries of
/// at most `per_attempt` each, plus `overhead` (the waits between them),
/// must fit in `total`, or the later attempts could never finish. The
/// pipeline checks it when built, with no overhead (its retry's back-off
/// is jittered and configurable, and a wait the deadline cannot cover ends
/// the call instead), and `keel-mesh` applies it to a service mesh's
/// retries with Envoy's back-off as the overhead: one rule, in one place.
pub fn attempts_fit(
    attempts: u32,
    per_attempt: Duration,
    overhead: Duration,
    total: Duration,
) -> Result<(), AttemptsDoNotFit> {
    let needed = per_attempt
        .saturating_mul(attempts)
        .saturating_add(overhead);
    if needed > total {
        return Err(AttemptsDoNotFit {
            attempts,
            per_attempt,
            overhead,
            needed,
            total,
        });
    }
    Ok(())
}

/// Attempts that cannot all finish within the total timeout (see
/// [`attempts_fit`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{attempts} attempts of {per_attempt:?}{} need {needed:?}, more than the total timeout of \
     {total:?}: later attempts could never finish; lower the attempt timeout or the attempts, or \
     raise the total",
    overhead_text(*overhead)
)]
pub struct AttemptsDoNotFit {
    /// Attempts in total, the first included.
    pub attempts: u32,
    /// The limit on each.
    pub per_attempt: Duration,
    /// The waits between them, at their longest.
    pub overhead: Duration,
    /// What all of them may take.
    pub needed: Duration,
    /// The limit on the whole call.
    pub total: Duration,
}

impl AttemptsDoNotFit {
    /// The longest attempt timeout that would fit with the same attempts
    /// and overhead (zero if the overhead alone is too much).
    pub fn longest_fitting_attempt(&self) -> Duration {
        self.total.saturating_sub(self.overhead) / self.attempts.max(1)
    }
}

fn overhead_text(overhead: Duration) -> String {
    if overhead.is_zero() {
        String::new()
    } else {
        format!(" plus up to {overhead:?} between them")
    }
}

/// The caller's operation, shared by its attempts, which never overlap.
struct Operation<F> {
    /// Each attempt locks `f` only for the instant it calls it, so the lock
    /// is never contended; a Mutex rather than a RefCell keeps the call's
    /// future `Send`.
    f: Mutex<F>,
    /// When the call started, if the clock was read then.
    started: Option<Instant>,
    first_attempt: AtomicBool,
}

impl<F> Operation<F> {
    fn new(f: F, started: Option<Instant>) -> Self {
        Self {
            f: Mutex::new(f),
            started,
            first_attempt: AtomicBool::new(true),
        }
    }

    /// When the attempt about to start starts: the first one counts from the
    /// call's start, which spares a clock read (a clock read costs about as
    /// much as a policy); a later one reads the clock afresh. A plain load
    /// and store suffice: attempts run one after the other in one task.
    fn attempt_start(&self) -> Instant {
        if self.first_attempt.load(Ordering::Relaxed) {
            self.first_attempt.store(false, Ordering::Relaxed);
            if let Some(started) = self.started {
                return started;
            }
        }
        clock::now()
    }
}

/// Policies applied to one dependency, in the recommended order.
///
/// Build one per dependency and share it (clones share every policy's state).
#[derive(Debug, Clone)]
pub struct Pipeline {
    name: Name,
    fallback: Option<Fallback>,
    total_timeout: Option<Timeout>,
    retry: Option<Retry>,
    breaker: Option<CircuitBreaker>,
    attempt_timeout: Option<Timeout>,
    bulkhead: Option<Bulkhead>,
    rate_limit: Option<RateLimiter>,
}

/// Builds a [`Pipeline`]; every policy is optional.
#[derive(Debug)]
#[must_use]
pub struct PipelineBuilder {
    pipeline: Pipeline,
}

/// The serde form of a [`Pipeline`]: each policy's own configuration, absent
/// where the policy is not wanted.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PipelineConfig {
    /// Which refusals and failures the fallback answers (the fallback value
    /// itself is given per call).
    pub fallback: Option<FallbackConfig>,
    /// The limit on the whole call, retries included.
    pub total_timeout: Option<TimeoutConfig>,
    /// Retries with backoff and budget.
    pub retry: Option<RetryConfig>,
    /// The dependency's circuit breaker.
    pub breaker: Option<CircuitBreakerConfig>,
    /// The limit on each attempt.
    pub attempt_timeout: Option<TimeoutConfig>,
    /// Concurrent-call limit.
    pub bulkhead: Option<BulkheadConfig>,
    /// Call-rate limit.
    pub rate_limit: Option<RateLimitConfig>,
}

impl PipelineConfig {
    /// Builds every configured policy, named `name` (timeouts get `.total`
    /// and `.attempt` suffixes), and the pipeline around them.
    pub fn build(self, name: impl Into<Name>) -> Result<Pipeline, ConfigError> {
        let name: Name = name.into();
        let suffixed = |suffix: &str| -> Name { format!("{name}.{suffix}").into() };
        let mut builder = Pipeline::builder(name);
        builder.pipeline.fallback = self.fallback.map(|c| c.build(name)).transpose()?;
        builder.pipeline.total_timeout = self
            .total_timeout
            .map(|c| c.build(suffixed("total")))
            .transpose()?;
        builder.pipeline.retry = self.retry.map(|c| c.build(name)).transpose()?;
        builder.pipeline.breaker = self.breaker.map(|c| c.build(name)).transpose()?;
        builder.pipeline.attempt_timeout = self
            .attempt_timeout
            .map(|c| c.build(suffixed("attempt")))
            .transpose()?;
        builder.pipeline.bulkhead = self.bulkhead.map(|c| c.build(name)).transpose()?;
        builder.pipeline.rate_limit = self.rate_limit.map(|c| c.build(name)).transpose()?;
        builder.build()
    }
}

impl PipelineBuilder {
    /// Serves a fallback (given per call) for the failures `fallback` handles.
    pub fn fallback(mut self, fallback: Fallback) -> Self {
        self.pipeline.fallback = Some(fallback);
        self
    }

    /// Bounds the whole call, retries and their delays included.
    pub fn total_timeout(mut self, timeout: Timeout) -> Self {
        self.pipeline.total_timeout = Some(timeout);
        self
    }

    /// Retries failed attempts.
    pub fn retry(mut self, retry: Retry) -> Self {
        self.pipeline.retry = Some(retry);
        self
    }

    /// Stops calling a dependency that keeps failing.
    pub fn breaker(mut self, breaker: CircuitBreaker) -> Self {
        self.pipeline.breaker = Some(breaker);
        self
    }

    /// Bounds each attempt.
    pub fn attempt_timeout(mut self, timeout: Timeout) -> Self {
        self.pipeline.attempt_timeout = Some(timeout);
        self
    }

    /// Limits concurrent attempts.
    pub fn bulkhead(mut self, bulkhead: Bulkhead) -> Self {
        self.pipeline.bulkhead = Some(bulkhead);
        self
    }

    /// Limits the rate of attempts.
    pub fn rate_limit(mut self, limiter: RateLimiter) -> Self {
        self.pipeline.rate_limit = Some(limiter);
        self
    }

    /// Checks that the attempts fit in the total timeout and builds.
    pub fn build(self) -> Result<Pipeline, ConfigError> {
        let p = &self.pipeline;
        if let (Some(total), Some(attempt), Some(retry)) =
            (&p.total_timeout, &p.attempt_timeout, &p.retry)
        {
            let attempts = retry.config().max_attempts.get();
            attempts_fit(attempts, attempt.limit(), Duration::ZERO, total.limit())
                .map_err(|e| ConfigError::new("attempt_timeout", e.to_string()))?;
        }
        Ok(self.pipeline)
    }
}

impl Pipeline {
    /// An empty pipeline named after its dependency; add policies to it.
    pub fn builder(name: impl Into<Name>) -> PipelineBuilder {
        PipelineBuilder {
            pipeline: Pipeline {
                name: name.into(),
                fallback: None,
                total_timeout: None,
                retry: None,
                breaker: None,
                attempt_timeout: None,
                bulkhead: None,
                rate_limit: None,
            },
        }
    }

    /// The dependency's name.
    pub fn name(&self) -> &Name {
        &self.name
    }

    /// The circuit breaker, for state and metrics.
    pub fn breaker(&self) -> Option<&CircuitBreaker> {
        self.breaker.as_ref()
    }

    /// The retry policy.
    pub fn retry(&self) -> Option<&Retry> {
        self.retry.as_ref()
    }

    /// The bulkhead, for its stats.
    pub fn bulkhead(&self) -> Option<&Bulkhead> {
        self.bulkhead.as_ref()
    }

    /// Runs `f` through every policy. `f` is called once per attempt, and
    /// only once every policy admitted the attempt.
    pub async fn call<T, E, F, Fut>(&self, f: F) -> Result<T, PolicyError<E>>
    where
        E: Classify,
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        match &self.total_timeout {
            Some(total) => {
                let now = clock::now();
                let operation = Operation::new(f, Some(now));
                total
                    .call_from(now, || self.retrying(&operation))
                    .await
                    .map_err(PolicyError::flatten)
            }
            None => self.retrying(&Operation::new(f, None)).await,
        }
    }

    /// Runs `f` through every policy, and answers with `fallback` when the
    /// pipeline's [`Fallback`] handles the failure (without one configured,
    /// the same as [`call`](Self::call)).
    pub async fn call_or_else<T, E, F, Fut, H, HFut>(
        &self,
        f: F,
        fallback: H,
    ) -> Result<T, PolicyError<E>>
    where
        E: Classify,
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        H: FnOnce(PolicyError<E>) -> HFut,
        HFut: Future<Output = Result<T, PolicyError<E>>>,
    {
        match &self.fallback {
            Some(policy) => policy.call(|| self.call(f), fallback).await,
            None => self.call(f).await,
        }
    }

    async fn retrying<T, E, F, Fut>(&self, operation: &Operation<F>) -> Result<T, PolicyError<E>>
    where
        E: Classify,
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        match &self.retry {
            Some(retry) => retry
                .call(|| self.attempt(operation))
                .await
                .map_err(PolicyError::flatten),
            None => self.attempt(operation).await,
        }
    }

    async fn attempt<T, E, F, Fut>(&self, operation: &Operation<F>) -> Result<T, PolicyError<E>>
    where
        E: Classify,
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        match &self.breaker {
            Some(breaker) => breaker
                .call(|| self.timed(operation))
                .await
                .map_err(PolicyError::flatten),
            None => self.timed(operation).await,
        }
    }

    async fn timed<T, E, F, Fut>(&self, operation: &Operation<F>) -> Result<T, PolicyError<E>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        match &self.attempt_timeout {
            Some(timeout) => timeout
                .call_from(operation.attempt_start(), || self.guarded(operation))
                .await
                .map_err(PolicyError::flatten),
            None => self.guarded(operation).await,
        }
    }

    async fn guarded<T, E, F, Fut>(&self, operation: &Operation<F>) -> Result<T, PolicyError<E>>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        if let Some(limiter) = &self.rate_limit {
            limiter.check()?;
        }
        let call = || (operation.f.lock())();
        match &self.bulkhead {
            Some(bulkhead) => bulkhead.call(call).await,
            None => call().await.map_err(PolicyError::Inner),
        }
    }

    /// The same policies as a tower layer, in the same order (the fallback
    /// excepted: add a [`FallbackLayer`](crate::fallback::FallbackLayer)
    /// outside it, since its response is service-specific). Requests must be
    /// `Clone` for retries.
    ///
    /// Errors are judged by their class; every response counts as a success.
    /// For a service that answers failures as responses (HTTP's `5xx`), use
    /// [`layer_classifying`](Self::layer_classifying).
    pub fn layer(&self) -> PipelineLayer {
        self.layer_classifying(Answered)
    }

    /// Like [`layer`](Self::layer), with the breaker judging responses by
    /// `classify` (a [`ClassifyResponse`](crate::breaker::ClassifyResponse):
    /// `HttpStatus` with feature `http`, or a closure), so that a dependency
    /// answering `500` trips it. Such responses are not retried: the retry
    /// decides by errors only.
    pub fn layer_classifying<C: Clone>(&self, classify: C) -> PipelineLayer<C> {
        ServiceBuilder::new()
            .layer(option_layer(
                self.total_timeout.as_ref().map(Timeout::layer),
            ))
            .layer(option_layer(self.retry.as_ref().map(Retry::layer)))
            .layer(option_layer(
                self.breaker
                    .as_ref()
                    .map(|b| b.layer().classify_response(classify)),
            ))
            .layer(option_layer(
                self.attempt_timeout.as_ref().map(Timeout::layer),
            ))
            .layer(option_layer(self.bulkhead.clone().map(BulkheadLayer::new)))
            .layer(option_layer(
                self.rate_limit.clone().map(RateLimitLayer::new),
            ))
            .layer(BoxErrorLayer)
            .into_inner()
    }

    /// The total timeout's limit, if one is set.
    pub fn total_limit(&self) -> Option<Duration> {
        self.total_timeout.as_ref().map(Timeout::limit)
    }
}
