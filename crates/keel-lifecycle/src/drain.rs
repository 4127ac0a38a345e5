//! [`Drain`]: graceful shutdown in the order that loses no request.
//!
//! On SIGTERM (or ctrl-c, or [`Drain::trigger`]) the drain moves through
//! its [`Phase`]s, each later than the last:
//!
//! 1. **readiness fails first** ([`Health::readiness`](crate::Health::readiness)
//!    answers `draining`) while the server keeps serving everything;
//! 2. it waits [`lb_notice`](DrainBuilder::lb_notice) (default 10 s) for
//!    load balancers to notice and stop sending traffic;
//! 3. the server **stops accepting** connections and lets in-flight
//!    requests finish, and [`Drain::signal`] fires, which SSE, WebSocket,
//!    long-poll and gRPC streaming handlers watch to end their streams;
//! 4. after [`drain_timeout`](DrainBuilder::drain_timeout) (default 30 s)
//!    every [`DrainStream`](crate::DrainStream) still open fails its next
//!    read or write, so the process exits before the orchestrator's
//!    SIGKILL.

use std::future::Future;
use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use keel_core::clock::{self, Instant};
use keel_policy::ConfigError;
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// How long to keep serving, with readiness failing, before closing the
/// listener, by default: 10 s, a readiness probe's `periodSeconds: 5` ×
/// `failureThreshold: 2`.
pub const DEFAULT_LB_NOTICE: Duration = Duration::from_secs(10);

/// How long in-flight requests and long-lived connections get to finish
/// once the listener is closed, by default: 30 s. `lb_notice +
/// drain_timeout` must stay below the orchestrator's grace period (for
/// example a Kubernetes `terminationGracePeriodSeconds` of 45 s).
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// Where a [`Drain`] is; phases only move forward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
#[non_exhaustive]
pub enum Phase {
    /// Serving normally; ready.
    Serving,
    /// Readiness fails; still serving everything while load balancers
    /// notice (`lb_notice`).
    Draining,
    /// No new connections; in-flight requests finish; long-lived
    /// connections were told to close ([`Drain::signal`]).
    Closing,
    /// The drain timeout passed: connections still open are aborted.
    Aborting,
}

/// Builds a [`Drain`].
#[derive(Debug, Clone)]
#[must_use]
pub struct DrainBuilder {
    lb_notice: Duration,
    drain_timeout: Duration,
}

impl DrainBuilder {
    /// How long to keep serving with readiness failing before closing the
    /// listener (default [`DEFAULT_LB_NOTICE`], 10 s; zero without a load
    /// balancer).
    pub fn lb_notice(mut self, delay: Duration) -> Self {
        self.lb_notice = delay;
        self
    }

    /// How long connections get to finish after the listener closes before
    /// they are aborted (default [`DEFAULT_DRAIN_TIMEOUT`], 30 s).
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.drain_timeout = timeout;
        self
    }

    /// Checks the settings and builds the coordinator.
    pub fn build(self) -> Result<Drain, ConfigError> {
        if self.drain_timeout.is_zero() {
            return Err(ConfigError::new(
                "drain_timeout",
                "must be more than zero: in-flight requests need time to finish",
            ));
        }
        let (phase, _) = watch::channel(Phase::Serving);
        let (close, _) = watch::channel(false);
        Ok(Drain {
            inner: Arc::new(Inner {
                lb_notice: self.lb_notice,
                drain_timeout: self.drain_timeout,
                phase,
                close,
                open: AtomicUsize::new(0),
                closing_at: Mutex::new(None),
            }),
        })
    }
}

/// Coordinates a graceful shutdown; see the [module docs](super). Cheap to
/// clone; clones share the state.
///
/// ```
/// use std::time::Duration;
/// use keel_lifecycle::{Drain, Phase};
///
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let drain = Drain::builder().lb_notice(Duration::from_secs(10)).build().unwrap();
/// let mut close = drain.signal(); // an SSE handler keeps this
/// drain.trigger();
/// assert!(drain.is_draining());           // readiness fails at once...
/// assert!(!*close.borrow());              // ...streams keep going...
/// close.changed().await.unwrap();         // ...until the LB had time to notice
/// assert!(*close.borrow());
/// assert_eq!(drain.phase(), Phase::Closing);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Drain {
    inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    lb_notice: Duration,
    drain_timeout: Duration,
    phase: watch::Sender<Phase>,
    close: watch::Sender<bool>,
    open: AtomicUsize,
    closing_at: Mutex<Option<Instant>>,
}

/// How a server's drain ended ([`Drain::report`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrainReport {
    /// Whether the drain timeout passed with connections still open, which
    /// were then aborted.
    pub forced: bool,
    /// How many connections were aborted.
    pub aborted_connections: usize,
    /// From closing the listener to returning.
    pub drain_time: Duration,
}

impl Default for Drain {
    fn default() -> Self {
        Self::new()
    }
}

impl Drain {
    /// A coordinator with the defaults: 10 s LB notice, 30 s drain timeout.
    pub fn new() -> Self {
        Self::builder()
            .build()
            .unwrap_or_else(|_| unreachable!("the defaults are valid"))
    }

    /// Starts building a coordinator.
    pub fn builder() -> DrainBuilder {
        DrainBuilder {
            lb_notice: DEFAULT_LB_NOTICE,
            drain_timeout: DEFAULT_DRAIN_TIMEOUT,
        }
    }

    /// Starts the shutdown (once; later calls do nothing): readiness fails
    /// now, the listener closes and [`signal`](Self::signal) fires after
    /// `lb_notice`, and connections are aborted `drain_timeout` later.
    ///
    /// Outside a tokio runtime the timers cannot run, so it closes at once.
    pub fn trigger(&self) {
        if !self.advance(Phase::Draining) {
            return;
        }
        let inner = &*self.inner;
        metrics::gauge!("keel_http_draining").set(1.0);
        tracing::info!(
            lb_notice = ?inner.lb_notice,
            drain_timeout = ?inner.drain_timeout,
            "drain started: readiness now fails; serving on while load balancers notice"
        );
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let drain = self.clone();
                runtime.spawn(async move {
                    tokio::time::sleep(drain.inner.lb_notice).await;
                    drain.close();
                    tokio::time::sleep(drain.inner.drain_timeout).await;
                    drain.abort();
                });
            }
            Err(_) => {
                tracing::warn!("drain triggered outside a tokio runtime: closing at once");
                self.close();
            }
        }
    }

    /// Skips the remaining waits: closes the listener, signals long-lived
    /// connections and aborts every open connection now (a second
    /// shutdown signal does this).
    pub fn abort_now(&self) {
        self.advance(Phase::Draining);
        self.close();
        self.abort();
    }

    /// Whether the shutdown has started (readiness fails from then on).
    pub fn is_draining(&self) -> bool {
        self.phase() != Phase::Serving
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        *self.inner.phase.borrow()
    }

    /// Every phase change from now on.
    pub fn subscribe(&self) -> watch::Receiver<Phase> {
        self.inner.phase.subscribe()
    }

    /// The signal for long-lived connections (SSE, WebSocket, long poll):
    /// `true` once they should end, when the listener closes. Handlers
    /// select on `changed()` next to their own work and close cleanly
    /// (a last SSE event, WebSocket close 1001, a `204` long-poll answer);
    /// a graceful shutdown waits for them, it does not close them.
    pub fn signal(&self) -> watch::Receiver<bool> {
        self.inner.close.subscribe()
    }

    /// Resolves once the drain has reached `phase` (at once if it has).
    pub async fn wait_for(&self, phase: Phase) {
        let mut phases = self.inner.phase.subscribe();
        // The sender lives in `self`, so this cannot fail.
        let _ = phases.wait_for(|current| *current >= phase).await;
    }

    /// A future that resolves when the listener should close: pass it to
    /// a server's graceful shutdown (`axum::serve(..).with_graceful_shutdown`,
    /// tonic's `serve_with_incoming_shutdown`).
    pub fn closing(&self) -> impl Future<Output = ()> + Send + 'static {
        let drain = self.clone();
        async move { drain.wait_for(Phase::Closing).await }
    }

    /// Connections open now through [`DrainStream`](crate::DrainStream)s of this drain.
    pub fn open_connections(&self) -> usize {
        self.inner.open.load(Ordering::Relaxed)
    }

    /// Triggers the drain on SIGTERM or SIGINT (ctrl-c); a second signal
    /// aborts at once. The handlers are installed before this returns, so
    /// a signal sent right after is not missed. Needs a tokio runtime.
    pub fn trigger_on_signal(&self) -> io::Result<JoinHandle<()>> {
        if tokio::runtime::Handle::try_current().is_err() {
            return Err(io::Error::other(
                "Drain::trigger_on_signal must be called inside a tokio runtime",
            ));
        }
        let mut signals = Signals::install()?;
        let drain = self.clone();
        Ok(tokio::spawn(async move {
            let first = signals.next().await;
            tracing::info!(signal = first, "shutdown signal received: draining");
            drain.trigger();
            let second = signals.next().await;
            tracing::warn!(
                signal = second,
                "second shutdown signal: aborting connections now"
            );
            drain.abort_now();
        }))
    }

    pub(crate) fn inner(&self) -> &Arc<Inner> {
        &self.inner
    }

    /// How the drain went for a server that saw `aborted_connections` of
    /// its connections aborted: servers return this when they end.
    pub fn report(&self, aborted_connections: usize) -> DrainReport {
        let closing_at = *self.inner.closing_at.lock();
        DrainReport {
            forced: aborted_connections > 0,
            aborted_connections,
            drain_time: closing_at.map_or(Duration::ZERO, |at| {
                clock::now().saturating_duration_since(at)
            }),
        }
    }

    /// Moves to `phase` if it is later than the current one.
    fn advance(&self, phase: Phase) -> bool {
        self.inner.phase.send_if_modified(|current| {
            if *current < phase {
                *current = phase;
                true
            } else {
                false
            }
        })
    }

    fn close(&self) {
        if !self.advance(Phase::Closing) {
            return;
        }
        *self.inner.closing_at.lock() = Some(clock::now());
        self.inner.close.send_replace(true);
        tracing::info!(
            open_connections = self.open_connections(),
            drain_timeout = ?self.inner.drain_timeout,
            "drain: listener closed, long-lived connections signalled; waiting for in-flight work"
        );
    }

    fn abort(&self) {
        if !self.advance(Phase::Aborting) {
            return;
        }
        let open = self.open_connections();
        if open > 0 {
            metrics::counter!("keel_http_drain_aborted_connections_total").increment(open as u64);
            tracing::warn!(
                open_connections = open,
                "drain timeout passed: aborting open connections"
            );
        }
    }
}

impl Inner {
    pub(crate) fn phase(&self) -> &watch::Sender<Phase> {
        &self.phase
    }

    pub(crate) fn open(&self) -> &AtomicUsize {
        &self.open
    }
}

/// The shutdown signals, installed up front.
struct Signals {
    #[cfg(unix)]
    term: tokio::signal::unix::Signal,
    #[cfg(unix)]
    interrupt: tokio::signal::unix::Signal,
}

impl Signals {
    fn install() -> io::Result<Self> {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Ok(Self {
                term: signal(SignalKind::terminate())?,
                interrupt: signal(SignalKind::interrupt())?,
            })
        }
        #[cfg(not(unix))]
        {
            Ok(Self {})
        }
    }

    /// The next signal's name; never resolves if signals cannot be received.
    async fn next(&mut self) -> &'static str {
        #[cfg(unix)]
        {
            tokio::select! {
                Some(()) = self.term.recv() => "SIGTERM",
                Some(()) = self.interrupt.recv() => "SIGINT",
                else => std::future::pending().await,
            }
        }
        #[cfg(not(unix))]
        {
            match tokio::signal::ctrl_c().await {
                Ok(()) => "ctrl-c",
                Err(_) => std::future::pending().await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn phases_move_forward_on_their_timers() {
        let drain = Drain::builder()
            .lb_notice(Duration::from_secs(10))
            .drain_timeout(Duration::from_secs(30))
            .build()
            .unwrap();
        assert_eq!(drain.phase(), Phase::Serving);
        let started = clock::now();
        drain.trigger();
        drain.trigger();
        assert_eq!(drain.phase(), Phase::Draining);
        drain.wait_for(Phase::Closing).await;
        assert_eq!(started.elapsed(), Duration::from_secs(10));
        assert!(*drain.signal().borrow());
        drain.wait_for(Phase::Aborting).await;
        assert_eq!(started.elapsed(), Duration::from_secs(40));
    }

    #[tokio::test(start_paused = true)]
    async fn abort_now_skips_the_waits() {
        let drain = Drain::new();
        drain.abort_now();
        assert_eq!(drain.phase(), Phase::Aborting);
        assert!(*drain.signal().borrow());
    }

    #[test]
    fn a_zero_drain_timeout_is_refused() {
        let err = Drain::builder()
            .drain_timeout(Duration::ZERO)
            .build()
            .unwrap_err();
        assert_eq!(err.field, "drain_timeout");
        // Outside a runtime, a trigger closes at once.
        let drain = Drain::new();
        drain.trigger();
        assert_eq!(drain.phase(), Phase::Closing);
    }
}
