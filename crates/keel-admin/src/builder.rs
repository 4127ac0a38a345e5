//! How an [`Admin`] is put together: its token, hosts, sessions and the
//! optional parts (a relay's outbox, the orchestrator, breakers, gauges).

use std::sync::Arc;

use crate::history::History;
use std::time::Duration;

use crate::AdminStore;
use keel_http::access::{AllowedHosts, FailureThrottle};
use keel_messaging::dead_letter::DeadLetters;
use keel_messaging::outbox::Outbox;
use keel_messaging::saga::SagaOrchestrator;
use keel_policy::breaker::BreakerRegistry;
#[cfg(feature = "webhooks")]
use keel_webhooks::Endpoints;
#[cfg(feature = "webhooks")]
use keel_webhooks::ssrf::SsrfGuard;

use crate::{
    Admin, AdminAccess, AdminToken, DEFAULT_SESSION_TTL, FnGauges, Gauge, GaugeSource, Inner,
};

/// Builds an [`Admin`]. Defaults: no token (loopback only — set one with
/// [`token`](Self::token)), dead-letter replays through a plain outbox (no
/// relay woken; set [`outbox`](Self::outbox) when a relay runs in this
/// process), no saga orchestrator (saga routes list from the store and
/// answer `501` to actions), no breakers, no gauges.
pub struct AdminBuilder<S> {
    store: S,
    token: AdminToken,
    hosts: AllowedHosts,
    session_ttl: Duration,
    throttle: FailureThrottle,
    over_tls: bool,
    outbox: Option<Outbox<S>>,
    sagas: Option<SagaOrchestrator<S>>,
    breakers: Option<BreakerRegistry>,
    gauges: Vec<Arc<dyn GaugeSource>>,
    history: Option<History>,
}

impl<S> std::fmt::Debug for AdminBuilder<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminBuilder")
            .field("token", &self.token)
            .field("sagas", &self.sagas.is_some())
            .field("breakers", &self.breakers.is_some())
            .field("gauges", &self.gauges.len())
            .finish_non_exhaustive()
    }
}

impl<S> AdminBuilder<S>
where
    S: AdminStore,
{
    pub(crate) fn new(store: S) -> Self {
        Self {
            store,
            token: AdminToken::none(),
            hosts: AllowedHosts::loopback(),
            session_ttl: DEFAULT_SESSION_TTL,
            throttle: FailureThrottle::default(),
            over_tls: false,
            outbox: None,
            sagas: None,
            breakers: None,
            gauges: Vec::new(),
            history: None,
        }
    }

    /// The token requests must carry (default: none, which only
    /// [`AdminToken::require_for`] a loopback address should produce).
    pub fn token(mut self, token: AdminToken) -> Self {
        self.token = token;
        self
    }

    /// The `Host` names the admin answers to (default
    /// [`AllowedHosts::loopback`]); any other is refused with `403`.
    pub fn allowed_hosts(mut self, hosts: AllowedHosts) -> Self {
        self.hosts = hosts;
        self
    }

    /// How long a console or CLI session lives (default
    /// [`DEFAULT_SESSION_TTL`], 8 hours).
    pub fn session_ttl(mut self, ttl: Duration) -> Self {
        self.session_ttl = ttl;
        self
    }

    /// The throttle of failed logins and bearer tokens (default
    /// [`FailureThrottle::default`]: 10 per address per minute).
    pub fn throttle(mut self, throttle: FailureThrottle) -> Self {
        self.throttle = throttle;
        self
    }

    /// The server terminates TLS itself (default: no): session cookies are
    /// then always `Secure`.
    pub fn served_over_tls(mut self, over_tls: bool) -> Self {
        self.over_tls = over_tls;
        self
    }

    /// Replays go through `outbox`, waking its relay on commit.
    pub fn outbox(mut self, outbox: Outbox<S>) -> Self {
        self.outbox = Some(outbox);
        self
    }

    /// The orchestrator whose sagas are listed, retried and cancelled.
    pub fn sagas(mut self, orchestrator: SagaOrchestrator<S>) -> Self {
        self.sagas = Some(orchestrator);
        self
    }

    /// The breakers shown by `/admin/api/breakers`.
    pub fn breakers(mut self, registry: BreakerRegistry) -> Self {
        self.breakers = Some(registry);
        self
    }

    /// Adds a source of gauges (consumer lag, ...) for `/admin/api/lag`.
    pub fn gauges(mut self, source: impl GaugeSource) -> Self {
        self.gauges.push(Arc::new(source));
        self
    }

    /// The short history shown by the console's graphs and
    /// `/admin/api/history` (without one, the console shows no graphs and
    /// the route answers `501`).
    pub fn history(mut self, history: History) -> Self {
        self.history = Some(history);
        self
    }

    /// Adds a synchronous gauge source.
    pub fn gauges_fn<F>(self, f: F) -> Self
    where
        F: Fn() -> Vec<Gauge> + Send + Sync + 'static,
    {
        self.gauges(FnGauges(f))
    }

    /// The admin.
    pub fn build(self) -> Admin<S> {
        let outbox = self
            .outbox
            .unwrap_or_else(|| Outbox::new(self.store.clone()));
        Admin {
            inner: Arc::new(Inner {
                dead_letters: DeadLetters::with_outbox(outbox.clone()),
                outbox,
                #[cfg(feature = "webhooks")]
                endpoints: Endpoints::new(self.store.clone(), SsrfGuard::default()),
                store: self.store,
                access: AdminAccess::with(self.token, self.hosts, self.session_ttl, self.throttle)
                    .served_over_tls(self.over_tls),
                sagas: self.sagas,
                breakers: self.breakers,
                gauges: self.gauges,
                history: self.history,
            }),
        }
    }
}
