//! The delivery worker's options, with their defaults, and the event it
//! emits when it disables an endpoint.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use keel_policy::retry::{Backoff, Jitter};

use super::WallClock;
use super::error::WebhookError;
use super::sender::DEFAULT_MAX_PAYLOAD;
use super::signing::SignatureScheme;
use super::ssrf::SsrfGuard;

/// The default retry schedule after the first attempt: 5 s, 5 min, 30 min,
/// 2 h, 5 h, 10 h, 10 h (eight attempts over about 28 hours), as Svix uses:
/// receivers are down for deploys and outages, not for 200 ms.
pub const DEFAULT_SCHEDULE: [Duration; 7] = [
    Duration::from_secs(5),
    Duration::from_secs(5 * 60),
    Duration::from_secs(30 * 60),
    Duration::from_secs(2 * 3600),
    Duration::from_secs(5 * 3600),
    Duration::from_secs(10 * 3600),
    Duration::from_secs(10 * 3600),
];
/// The default jitter on the schedule: ±20%, so endpoints that failed
/// together are not all retried at the same instant.
pub const DEFAULT_JITTER: Jitter = Jitter::Proportional(0.2);
/// The default per-attempt timeout (redirects and the response included):
/// 10 s. A slow receiver must answer fast and work later.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// The default most redirects followed per attempt.
pub const DEFAULT_MAX_REDIRECTS: usize = 5;
/// The default response body bytes kept in the delivery log: 4 KiB.
pub const DEFAULT_MAX_RESPONSE_BODY: usize = 4 * 1024;
/// The default longest `Retry-After` honoured: 24 h.
pub const DEFAULT_MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 3600);
/// The default failure window: an endpoint whose every attempt failed for
/// 5 days is disabled.
pub const DEFAULT_FAILURE_WINDOW: Duration = Duration::from_secs(5 * 24 * 3600);
/// The default deliveries claimed per claim.
pub const DEFAULT_BATCH: usize = 128;
/// The default most attempts in flight per worker.
pub const DEFAULT_MAX_IN_FLIGHT: usize = 256;
/// The default most attempts in flight per endpoint (across workers).
pub const DEFAULT_PER_ENDPOINT: usize = 16;
/// The default wait between claims when nothing was due.
pub const DEFAULT_POLL_INTERVAL: Duration = Duration::from_millis(500);
/// The default time in-flight attempts get to finish at shutdown.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(15);
/// How much longer than the timeout a lease lasts by default, to cover
/// recording the outcome.
pub const LEASE_MARGIN: Duration = Duration::from_secs(30);

/// Why the worker disabled an endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum DisableReason {
    /// The endpoint answered `410 Gone`: its owner removed it.
    Gone,
    /// Every attempt to the endpoint failed for the whole failure window.
    FailureWindow {
        /// Since when.
        failing_since: DateTime<Utc>,
        /// The window.
        window: Duration,
    },
    /// A delivery used up its retry schedule (only with
    /// [`WorkerOptions::disable_when_exhausted`]).
    ScheduleExhausted {
        /// The delivery.
        delivery_id: i64,
    },
}

impl DisableReason {
    /// A short stable name for metrics labels.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Gone => "gone",
            Self::FailureWindow { .. } => "failure_window",
            Self::ScheduleExhausted { .. } => "schedule_exhausted",
        }
    }
}

impl fmt::Display for DisableReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Gone => f.write_str("the endpoint answered 410 Gone"),
            Self::FailureWindow {
                failing_since,
                window,
            } => write!(
                f,
                "every attempt failed since {} (failure window {}s)",
                failing_since.to_rfc3339(),
                window.as_secs()
            ),
            Self::ScheduleExhausted { delivery_id } => {
                write!(f, "delivery {delivery_id} exhausted its retry schedule")
            }
        }
    }
}

/// An endpoint was disabled automatically: tell its owner (email, a
/// notification) and offer a replay once they fixed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointDisabled {
    /// The endpoint.
    pub endpoint_id: String,
    /// Its URL.
    pub url: String,
    /// Why.
    pub reason: DisableReason,
    /// When.
    pub at: DateTime<Utc>,
}

/// A callback for [`EndpointDisabled`] events.
pub type DisabledCallback = Arc<dyn Fn(&EndpointDisabled) + Send + Sync>;

/// How a [`DeliveryWorker`](super::DeliveryWorker) works; every limit has a
/// documented default.
///
/// # Concurrency, and why not one-at-a-time per endpoint
///
/// A worker has at most `max_in_flight` attempts running (default 256),
/// and no endpoint has more than `per_endpoint` in flight (default 16),
/// counted in the store across every worker. The per-endpoint bound
/// protects a customer's small server from a burst and keeps one slow
/// endpoint from occupying every slot; the global bound protects us.
///
/// Strict per-endpoint order (`per_endpoint = 1`) is available but is not
/// the default: it caps an endpoint at one request per round trip, and it
/// does not buy order anyway, because a failed delivery waits hours for its
/// retry while later events go through (holding them back would let one bad
/// event block an endpoint for a day). Receivers get the tools to order
/// themselves instead: the event's `timestamp` (when it occurred) and
/// optional `sequence` in every body, as the checklist asks ("tolerate
/// out-of-order arrival; use occurredAt, not receipt order").
#[derive(Clone)]
pub struct WorkerOptions {
    pub(crate) name: String,
    pub(crate) batch: usize,
    pub(crate) max_in_flight: usize,
    pub(crate) per_endpoint: usize,
    pub(crate) poll_interval: Duration,
    pub(crate) timeout: Duration,
    pub(crate) lease: Option<Duration>,
    pub(crate) max_redirects: usize,
    pub(crate) max_payload: usize,
    pub(crate) max_response_body: usize,
    pub(crate) backoff: Backoff,
    pub(crate) max_retry_after: Duration,
    pub(crate) failure_window: Duration,
    pub(crate) disable_when_exhausted: bool,
    pub(crate) scheme: SignatureScheme,
    pub(crate) guard: SsrfGuard,
    pub(crate) sealer: super::sealing::SecretSealer,
    pub(crate) clock: WallClock,
    pub(crate) drain_timeout: Duration,
    pub(crate) user_agent: String,
    pub(crate) on_disabled: Vec<DisabledCallback>,
}

impl fmt::Debug for WorkerOptions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkerOptions")
            .field("name", &self.name)
            .field("batch", &self.batch)
            .field("max_in_flight", &self.max_in_flight)
            .field("per_endpoint", &self.per_endpoint)
            .field("poll_interval", &self.poll_interval)
            .field("timeout", &self.timeout)
            .field("lease", &self.lease_duration())
            .field("max_redirects", &self.max_redirects)
            .field("max_payload", &self.max_payload)
            .field("max_response_body", &self.max_response_body)
            .field("backoff", &self.backoff)
            .field("max_retry_after", &self.max_retry_after)
            .field("failure_window", &self.failure_window)
            .field("disable_when_exhausted", &self.disable_when_exhausted)
            .field("scheme", &self.scheme)
            .field("guard", &self.guard)
            .field("drain_timeout", &self.drain_timeout)
            .field("on_disabled", &self.on_disabled.len())
            .finish_non_exhaustive()
    }
}

impl Default for WorkerOptions {
    fn default() -> Self {
        Self::new()
    }
}

impl WorkerOptions {
    /// The defaults (see the `DEFAULT_*` constants), with a worker name
    /// unique to this process and a guard that allows no internal address.
    pub fn new() -> Self {
        let backoff = Backoff::schedule(DEFAULT_SCHEDULE)
            .and_then(|b| b.with_jitter(DEFAULT_JITTER))
            .unwrap_or_default();
        Self {
            name: format!("webhook-worker-{}", keel_core::id::new_id().simple()),
            batch: DEFAULT_BATCH,
            max_in_flight: DEFAULT_MAX_IN_FLIGHT,
            per_endpoint: DEFAULT_PER_ENDPOINT,
            poll_interval: DEFAULT_POLL_INTERVAL,
            timeout: DEFAULT_TIMEOUT,
            lease: None,
            max_redirects: DEFAULT_MAX_REDIRECTS,
            max_payload: DEFAULT_MAX_PAYLOAD,
            max_response_body: DEFAULT_MAX_RESPONSE_BODY,
            backoff,
            max_retry_after: DEFAULT_MAX_RETRY_AFTER,
            failure_window: DEFAULT_FAILURE_WINDOW,
            disable_when_exhausted: false,
            scheme: SignatureScheme::StandardWebhooks,
            guard: SsrfGuard::new(),
            sealer: super::sealing::SecretSealer::plaintext(),
            clock: WallClock::system(),
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
            user_agent: format!("keel-webhooks/{}", env!("CARGO_PKG_VERSION")),
            on_disabled: Vec::new(),
        }
    }

    /// The worker's name in leases (unique per process by default; give a
    /// stable one per replica to resume its leases after a restart).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Deliveries claimed at once (default 128).
    pub fn batch(mut self, batch: usize) -> Self {
        self.batch = batch;
        self
    }

    /// Attempts in flight in this worker (default 256).
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n;
        self
    }

    /// Attempts in flight per endpoint, across workers (default 16; see the
    /// type docs on ordering).
    pub fn per_endpoint(mut self, n: usize) -> Self {
        self.per_endpoint = n;
        self
    }

    /// The wait between claims when nothing was due (default 500 ms).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// The per-attempt timeout, redirects and response included (default 10 s).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// How long a claimed delivery is leased (default: the timeout plus 30 s).
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = Some(lease);
        self
    }

    /// Redirects followed per attempt, each re-checked (default 5).
    pub fn max_redirects(mut self, n: usize) -> Self {
        self.max_redirects = n;
        self
    }

    /// The largest body sent (default 256 KiB); a larger one fails at once.
    pub fn max_payload(mut self, bytes: usize) -> Self {
        self.max_payload = bytes;
        self
    }

    /// Response body bytes kept in the log (default 4 KiB).
    pub fn max_response_body(mut self, bytes: usize) -> Self {
        self.max_response_body = bytes;
        self
    }

    /// The retry delays after each failed attempt (default
    /// [`DEFAULT_SCHEDULE`] with [`DEFAULT_JITTER`]); a schedule's end is
    /// where a delivery fails for good.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// The longest `Retry-After` honoured (default 24 h). A receiver's
    /// `Retry-After` postpones the next attempt to at least the time it
    /// asks, within this bound, and never brings it forward: the schedule
    /// is the least the sender waits.
    pub fn max_retry_after(mut self, max: Duration) -> Self {
        self.max_retry_after = max;
        self
    }

    /// How long every attempt to an endpoint must have failed before it is
    /// disabled (default 5 days).
    pub fn failure_window(mut self, window: Duration) -> Self {
        self.failure_window = window;
        self
    }

    /// Also disable an endpoint as soon as one of its deliveries used up
    /// the schedule. Off by default, and the failure window decides: one
    /// delivery the receiver keeps refusing (a `400` for one odd payload)
    /// says little about an endpoint that accepts everything else, while a
    /// window in which *every* attempt failed does.
    pub fn disable_when_exhausted(mut self, on: bool) -> Self {
        self.disable_when_exhausted = on;
        self
    }

    /// The signature format (default Standard Webhooks).
    pub fn scheme(mut self, scheme: SignatureScheme) -> Self {
        self.scheme = scheme;
        self
    }

    /// The SSRF guard (default: no internal address allowed).
    pub fn guard(mut self, guard: SsrfGuard) -> Self {
        self.guard = guard;
        self
    }

    /// Opens sealed endpoint secrets (default: stored as given); the same
    /// sealer as the [`Endpoints`](super::Endpoints) that stored them.
    pub fn sealer(mut self, sealer: super::sealing::SecretSealer) -> Self {
        self.sealer = sealer;
        self
    }

    /// The wall clock for signing and scheduling (default: the system's).
    pub fn clock(mut self, clock: WallClock) -> Self {
        self.clock = clock;
        self
    }

    /// How long in-flight attempts may finish at shutdown (default 15 s).
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.drain_timeout = timeout;
        self
    }

    /// The `User-Agent` sent.
    pub fn user_agent(mut self, agent: impl Into<String>) -> Self {
        self.user_agent = agent.into();
        self
    }

    /// Calls `callback` whenever the worker disables an endpoint.
    pub fn on_disabled(
        mut self,
        callback: impl Fn(&EndpointDisabled) + Send + Sync + 'static,
    ) -> Self {
        self.on_disabled.push(Arc::new(callback));
        self
    }

    /// Sends every [`EndpointDisabled`] event into `channel` (dropped if the
    /// receiver is gone).
    pub fn notify_disabled(
        self,
        channel: tokio::sync::mpsc::UnboundedSender<EndpointDisabled>,
    ) -> Self {
        self.on_disabled(move |event| {
            let _ = channel.send(event.clone());
        })
    }

    /// The lease in effect: set, or the timeout plus [`LEASE_MARGIN`].
    pub fn lease_duration(&self) -> Duration {
        self.lease
            .unwrap_or(self.timeout.saturating_add(LEASE_MARGIN))
    }

    pub(crate) fn validate(&self) -> Result<(), WebhookError> {
        let checks = [
            (self.batch > 0, "batch must be at least 1"),
            (self.max_in_flight > 0, "max_in_flight must be at least 1"),
            (self.per_endpoint > 0, "per_endpoint must be at least 1"),
            (!self.timeout.is_zero(), "timeout must be greater than zero"),
            (
                !self.poll_interval.is_zero(),
                "poll_interval must be greater than zero",
            ),
            (
                self.lease_duration() > self.timeout,
                "the lease must be longer than the timeout",
            ),
            (self.max_payload > 0, "max_payload must be at least 1 byte"),
            (!self.name.is_empty(), "the worker name must not be empty"),
            (
                !self.failure_window.is_zero(),
                "failure_window must be greater than zero",
            ),
        ];
        for (ok, what) in checks {
            if !ok {
                return Err(WebhookError::Config(what.to_owned()));
            }
        }
        Ok(())
    }
}
