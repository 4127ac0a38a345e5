//! [`Dependency`]: one downstream service behind its own policies.

use std::sync::Arc;
use std::time::Duration;

use keel_core::{Name, clock};
use keel_policy::ConfigError;
use keel_policy::balance::{BalanceConfig, Balancer};
use keel_policy::breaker::{BreakerRegistry, CircuitBreaker, CircuitBreakerConfig};
use keel_policy::bulkhead::{Bulkhead, BulkheadConfig};
use keel_policy::pipeline::Pipeline;
use keel_policy::retry::{Retry, RetryConfig};
use keel_policy::timeout::TimeoutConfig;
use serde::{Deserialize, Serialize};
use tracing::Instrument;

use crate::client::PropagatingClient;
use crate::error::HttpCallError;
use crate::routing::{Endpoint, Routes, SubsetConfig};

/// Attempts by default, the first included: 2 (× 700 ms fits in 2 s).
const DEFAULT_ATTEMPTS: std::num::NonZeroU32 = std::num::NonZeroU32::MIN.saturating_add(1);

/// The whole-call timeout by default: 2 s.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(2);
/// The per-attempt timeout by default: 700 ms (two attempts and their
/// backoff fit in 2 s).
const DEFAULT_ATTEMPT_TIMEOUT: Duration = Duration::from_millis(700);

/// The policies of one [`Dependency`], as read from a file. Every field has
/// a default.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DependencyConfig {
    /// The whole call, retries and their delays included (default 2 s).
    pub timeout: TimeoutConfig,
    /// Each attempt (default 700 ms); no longer than `timeout`.
    pub attempt_timeout: TimeoutConfig,
    /// Retries, with their budget (default: 2 attempts, 10% budget;
    /// errors of unknown outcome are not retried unless
    /// `retry_outcome_unknown` marks the dependency's calls idempotent).
    pub retry: RetryConfig,
    /// The dependency's own circuit breaker (default: 50% of at least 20
    /// calls, open 30 s).
    pub breaker: CircuitBreakerConfig,
    /// The most calls in flight to the dependency (default 10, no queue).
    pub bulkhead: BulkheadConfig,
    /// Its endpoints, in weighted subsets, for
    /// [`send_routed`](Dependency::send_routed) (default none: requests
    /// carry their own URLs).
    pub subsets: Vec<SubsetConfig>,
    /// How each subset balances its endpoints (default peak-EWMA, ejecting
    /// after 5 failures in a row, at most half the subset at once).
    pub balance: BalanceConfig,
}

impl Default for DependencyConfig {
    fn default() -> Self {
        Self {
            timeout: TimeoutConfig {
                timeout: DEFAULT_TIMEOUT,
                ..TimeoutConfig::default()
            },
            attempt_timeout: TimeoutConfig {
                timeout: DEFAULT_ATTEMPT_TIMEOUT,
                ..TimeoutConfig::default()
            },
            retry: RetryConfig {
                // The mesh's rule: 2 attempts of 700 ms fit in the 2 s total.
                max_attempts: DEFAULT_ATTEMPTS,
                ..RetryConfig::default()
            },
            breaker: CircuitBreakerConfig::default(),
            bulkhead: BulkheadConfig::default(),
            subsets: Vec::new(),
            balance: BalanceConfig::default(),
        }
    }
}

/// Builds a [`Dependency`]; made by [`PropagatingClient::dependency`].
#[derive(Debug)]
#[must_use]
pub struct DependencyBuilder {
    name: Name,
    client: PropagatingClient,
    config: DependencyConfig,
    breaker: Option<CircuitBreaker>,
}

impl DependencyBuilder {
    pub(super) fn new(name: &str, client: PropagatingClient) -> Self {
        Self {
            name: Name::from(name),
            client,
            config: DependencyConfig::default(),
            breaker: None,
        }
    }

    /// Replaces the whole configuration.
    pub fn config(mut self, config: DependencyConfig) -> Self {
        self.config = config;
        self
    }

    /// The whole call's time limit, retries included (default 2 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.config.timeout.timeout = timeout;
        self
    }

    /// Each attempt's time limit (default 700 ms).
    pub fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.config.attempt_timeout.timeout = timeout;
        self
    }

    /// The retry policy and its budget.
    pub fn retry(mut self, retry: RetryConfig) -> Self {
        self.config.retry = retry;
        self
    }

    /// The configuration of the dependency's own breaker.
    pub fn breaker_config(mut self, breaker: CircuitBreakerConfig) -> Self {
        self.config.breaker = breaker;
        self.breaker = None;
        self
    }

    /// Uses the registry's breaker for this dependency (made on first use
    /// from the registry's configuration), so operators see it with all the
    /// others.
    pub fn breaker_from(mut self, registry: &BreakerRegistry) -> Self {
        self.breaker = Some(registry.get(&self.name));
        self
    }

    /// The bulkhead's limits.
    pub fn bulkhead(mut self, bulkhead: BulkheadConfig) -> Self {
        self.config.bulkhead = bulkhead;
        self
    }

    /// One subset, `default`, over `endpoints` (base URLs), balanced by
    /// load, for [`send_routed`](Dependency::send_routed).
    pub fn endpoints<S: Into<String>>(mut self, endpoints: impl IntoIterator<Item = S>) -> Self {
        self.config.subsets = vec![SubsetConfig::new("default", 1, endpoints)];
        self
    }

    /// Weighted subsets of endpoints (a baseline and a canary, say), for
    /// [`send_routed`](Dependency::send_routed); see
    /// [`routing`](crate::routing).
    pub fn subsets(mut self, subsets: Vec<SubsetConfig>) -> Self {
        self.config.subsets = subsets;
        self
    }

    /// How each subset balances its endpoints.
    pub fn balance(mut self, balance: BalanceConfig) -> Self {
        self.config.balance = balance;
        self
    }

    /// Validates the configuration and builds the dependency's policies.
    pub fn build(self) -> Result<Dependency, ConfigError> {
        let Self {
            name,
            client,
            config,
            breaker,
        } = self;
        if config.attempt_timeout.timeout > config.timeout.timeout {
            return Err(ConfigError::new(
                "attempt_timeout",
                "must not exceed `timeout`: an attempt cannot outlive the whole call",
            ));
        }
        let breaker = match breaker {
            Some(breaker) => breaker,
            None => config.breaker.build(name)?,
        };
        let routes = match config.subsets.as_slice() {
            [] => None,
            subsets => Some(Routes::build(name, subsets, &config.balance)?),
        };
        let retry = config.retry.build(name)?;
        let bulkhead = config.bulkhead.build(name)?;
        let pipeline = Pipeline::builder(name)
            .total_timeout(config.timeout.build(name)?)
            .retry(retry.clone())
            .breaker(breaker.clone())
            .attempt_timeout(
                config
                    .attempt_timeout
                    .build(Name::from(format!("{name}/attempt")))?,
            )
            .bulkhead(bulkhead.clone())
            .build()?;
        let inner = Inner {
            name,
            client,
            pipeline,
            retry,
            breaker,
            bulkhead,
            routes,
        };
        Ok(Dependency {
            inner: Arc::new(inner),
        })
    }
}

/// One downstream service, called through its own policies. Cheap to clone;
/// clones share the policies.
///
/// Each call goes, outermost first, through:
///
/// 1. the **total timeout** (2 s): refuses to start with 50 ms or less
///    left, and becomes the deadline of everything inside, so retries never
///    sleep past it;
/// 2. **retry** with a budget: only `Retryable` failures (connect errors,
///    5xx, 429 honouring `Retry-After`), and `OutcomeUnknown` ones if the
///    calls are idempotent; the budget stops retries in a widespread outage;
/// 3. the dependency's **own circuit breaker**: one per dependency, so a
///    sick dependency is cut off without touching healthy ones; refusals
///    from inside it (a full bulkhead) are not held against the dependency;
/// 4. the **attempt timeout** (700 ms), inside the breaker so that a hung
///    attempt counts as a failure;
/// 5. a **bulkhead**: caps the calls in flight to it;
/// 6. the [`PropagatingClient`], sending the deadline and `traceparent`.
///
/// That is keel-policy's [`Pipeline`], whose docs explain the order.
///
/// ```no_run
/// use keel_client::PropagatingClient;
///
/// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
/// let client = PropagatingClient::new(reqwest::Client::new());
/// let payments = client.dependency("payments").build()?;
/// let stock = client.dependency("stock").build()?;
/// let paid = payments
///     .send(|http| http.post("http://127.0.0.1:8081/charges").body("{}"))
///     .await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct Dependency {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    name: Name,
    client: PropagatingClient,
    pipeline: Pipeline,
    // Clones of the pipeline's own policies (they share its state), for the
    // accessors.
    retry: Retry,
    breaker: CircuitBreaker,
    bulkhead: Bulkhead,
    routes: Option<Routes>,
}

impl Dependency {
    /// The dependency's name.
    pub fn name(&self) -> &Name {
        &self.inner.name
    }

    /// Its circuit breaker.
    pub fn breaker(&self) -> &CircuitBreaker {
        &self.inner.breaker
    }

    /// Its bulkhead.
    pub fn bulkhead(&self) -> &Bulkhead {
        &self.inner.bulkhead
    }

    /// Its retry policy (and, through it, the retry budget).
    pub fn retry(&self) -> &Retry {
        &self.inner.retry
    }

    /// The client it calls through.
    pub fn client(&self) -> &PropagatingClient {
        &self.inner.client
    }

    /// Each subset's balancer (empty without [`subsets`](DependencyBuilder::subsets)),
    /// to see its endpoints' load and ejections.
    pub fn balancers(&self) -> Vec<Balancer<Endpoint>> {
        self.inner
            .routes
            .iter()
            .flat_map(Routes::balancers)
            .cloned()
            .collect()
    }

    /// Sends the request `build` makes, through the policies. `build` runs
    /// once per attempt, so each retry sends a fresh request.
    ///
    /// Each attempt's time to the response's headers is recorded in
    /// `keel_client_attempt_duration_seconds` and the whole call's, retries
    /// and waits included, in `keel_client_call_duration_seconds`, both by
    /// `dependency` and `outcome`: the p99 of an attempt is what its timeout
    /// should be sized from, and the call's is what the caller's deadline
    /// must cover.
    pub async fn send<F>(&self, build: F) -> Result<reqwest::Response, HttpCallError>
    where
        F: Fn(&reqwest::Client) -> reqwest::RequestBuilder,
    {
        self.call(|http| Ok((build(http), None))).await
    }

    /// Sends the request `build` makes for an endpoint of the dependency's
    /// [`subsets`](DependencyBuilder::subsets), through the policies: each
    /// attempt draws a subset by weight and an endpoint in it by load (see
    /// [`routing`](crate::routing)), and its outcome feeds that endpoint's
    /// latency estimate and outlier ejection. Besides
    /// [`send`](Self::send)'s metrics, each attempt is recorded in
    /// `keel_client_subset_attempt_duration_seconds` by `dependency`,
    /// `subset`, `track` and `outcome`.
    ///
    /// Without subsets every attempt is refused with
    /// [`Rejected::NoEndpoint`](keel_core::Rejected::NoEndpoint).
    ///
    /// ```no_run
    /// use keel_client::{PropagatingClient, SubsetConfig};
    ///
    /// # async fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let client = PropagatingClient::new(reqwest::Client::new());
    /// let payments = client
    ///     .dependency("payments")
    ///     .subsets(vec![
    ///         SubsetConfig::new("stable", 95, ["http://10.0.0.1:8081", "http://10.0.0.2:8081"]),
    ///         SubsetConfig::new("v2", 5, ["http://10.0.0.3:8081"]).canary(),
    ///     ])
    ///     .build()?;
    /// let paid = payments
    ///     .send_routed(|http, endpoint| http.post(endpoint.url("/charges")).body("{}"))
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn send_routed<F>(&self, build: F) -> Result<reqwest::Response, HttpCallError>
    where
        F: Fn(&reqwest::Client, &Endpoint) -> reqwest::RequestBuilder,
    {
        let inner = &*self.inner;
        self.call(|http| {
            let routes = inner
                .routes
                .as_ref()
                .ok_or(keel_core::Rejected::NoEndpoint { name: inner.name })?;
            let picked = routes.pick()?;
            let request = build(http, picked.endpoint());
            Ok((request, Some(picked)))
        })
        .await
    }

    async fn call<F>(&self, attempt: F) -> Result<reqwest::Response, HttpCallError>
    where
        F: Fn(
            &reqwest::Client,
        ) -> Result<(reqwest::RequestBuilder, Option<Routed>), keel_core::Rejected>,
    {
        let inner = &*self.inner;
        let started = clock::now();
        let result = inner
            .pipeline
            .call(|| {
                let prepared = attempt(&inner.client.inner());
                let name = inner.name;
                async move {
                    let (request, routed) = prepared?;
                    let attempt_started = clock::now();
                    let answered = inner.client.send(request).await;
                    // A status the client turned into an error (a 503, say)
                    // is still an answer: it counts by its class.
                    let outcome = match &answered {
                        Ok(response) => status_class(response.status()),
                        Err(err) => err.status().map_or("error", status_class),
                    };
                    let seconds = seconds_since(attempt_started);
                    record(
                        "keel_client_attempt_duration_seconds",
                        &name,
                        outcome,
                        seconds,
                    );
                    if let Some(picked) = routed {
                        record_subset(&name, picked.endpoint(), outcome, seconds);
                        picked.record(&answered);
                    }
                    answered
                }
            })
            .instrument(tracing::debug_span!("dependency", name = %inner.name))
            .await
            .map_err(HttpCallError::from);
        let outcome = if result.is_ok() { "ok" } else { "error" };
        record(
            "keel_client_call_duration_seconds",
            &inner.name,
            outcome,
            seconds_since(started),
        );
        if let Err(err) = &result {
            tracing::debug!(dependency = %inner.name, error = %err, "dependency call failed");
        }
        result
    }
}

/// The endpoint an attempt was routed to, in flight until it finishes.
type Routed = keel_policy::balance::Picked<Endpoint>;

/// Records an attempt routed to `endpoint` by its subset and track.
fn record_subset(dependency: &Name, endpoint: &Endpoint, outcome: &'static str, seconds: f64) {
    metrics::histogram!(
        "keel_client_subset_attempt_duration_seconds",
        "dependency" => dependency.to_string(),
        "subset" => endpoint.subset().to_string(),
        "track" => endpoint.track(),
        "outcome" => outcome,
    )
    .record(seconds);
}

/// Seconds from `started` to now.
fn seconds_since(started: clock::Instant) -> f64 {
    clock::now()
        .saturating_duration_since(started)
        .as_secs_f64()
}

/// Records `seconds` in histogram `metric`.
fn record(metric: &'static str, dependency: &Name, outcome: &'static str, seconds: f64) {
    metrics::histogram!(metric, "dependency" => dependency.to_string(), "outcome" => outcome)
        .record(seconds);
}

/// `2xx`, `3xx`, `4xx` or `5xx`: few enough values for a label.
fn status_class(status: reqwest::StatusCode) -> &'static str {
    match status.as_u16() {
        200..=299 => "2xx",
        300..=399 => "3xx",
        400..=499 => "4xx",
        500..=599 => "5xx",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_attempt_longer_than_the_call_is_refused() {
        let client = PropagatingClient::new(reqwest::Client::new());
        let err = client
            .dependency("payments")
            .timeout(Duration::from_millis(500))
            .attempt_timeout(Duration::from_secs(1))
            .build()
            .unwrap_err();
        assert_eq!(err.field, "attempt_timeout");
        assert!(client.dependency("payments").build().is_ok());
    }

    #[test]
    fn config_round_trips() {
        let config = DependencyConfig::default();
        let json = serde_json::to_string(&config).unwrap();
        assert_eq!(
            serde_json::from_str::<DependencyConfig>(&json).unwrap(),
            config
        );
        assert!(serde_json::from_str::<DependencyConfig>(r#"{"retries": 3}"#).is_err());
    }
}
