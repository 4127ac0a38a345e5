//! Metric handles, created once per breaker, and the transition events.

use keel_core::clock::Instant;
use keel_core::{Name, Rejected};
use metrics::{Counter, Gauge};
use tokio::sync::broadcast;

use super::{State, StateTransition};

/// How many transitions a slow subscriber may fall behind before it misses
/// some (it is then told how many with `RecvError::Lagged`).
const EVENT_CAPACITY: usize = 64;

pub(super) struct Telemetry {
    name: Name,
    state: Gauge,
    rejected: Counter,
    failures: Counter,
    ignored: Counter,
    transitions: [[Counter; 5]; 5],
    events: broadcast::Sender<StateTransition>,
}

impl Telemetry {
    pub(super) fn new(name: Name) -> Self {
        let label = name.to_string();
        let calls = |outcome: &'static str| metrics::counter!("keel_breaker_calls_total", "name" => label.clone(), "outcome" => outcome);
        let transitions = std::array::from_fn(|from| {
            std::array::from_fn(|to| {
                metrics::counter!(
                    "keel_breaker_transitions_total",
                    "name" => label.clone(),
                    "from" => State::ALL[from].as_str(),
                    "to" => State::ALL[to].as_str()
                )
            })
        });
        let state = metrics::gauge!("keel_breaker_state", "name" => label.clone());
        state.set(State::Closed.gauge_value());
        Self {
            rejected: metrics::counter!("keel_breaker_rejected_total", "name" => label.clone()),
            failures: calls("failure"),
            ignored: calls("ignored"),
            transitions,
            state,
            events: broadcast::channel(EVENT_CAPACITY).0,
            name,
        }
    }

    pub(super) fn name(&self) -> &Name {
        &self.name
    }

    pub(super) fn subscribe(&self) -> broadcast::Receiver<StateTransition> {
        self.events.subscribe()
    }

    /// Counts and builds a refusal; the log line, off unless asked for,
    /// stays out of the refusal's own code.
    #[inline]
    pub(super) fn rejected(&self, retry_at: Instant) -> Rejected {
        self.rejected.increment(1);
        if tracing::enabled!(tracing::Level::DEBUG) {
            self.log_refusal(retry_at);
        }
        Rejected::CircuitOpen {
            name: self.name,
            retry_at,
        }
    }

    #[cold]
    fn log_refusal(&self, retry_at: Instant) {
        tracing::debug!(
            breaker = %self.name,
            retry_after = ?retry_at.saturating_duration_since(keel_core::clock::now()),
            "circuit breaker refused a call"
        );
    }

    pub(super) fn failure(&self) {
        self.failures.increment(1);
    }

    pub(super) fn ignored(&self) {
        self.ignored.increment(1);
    }

    pub(super) fn transition(
        &self,
        from: State,
        to: State,
        at: Instant,
        why: &dyn std::fmt::Display,
    ) {
        self.state.set(to.gauge_value());
        self.transitions[usize::from(from.index())][usize::from(to.index())].increment(1);
        if matches!(to, State::Open | State::ForcedOpen) {
            tracing::warn!(breaker = %self.name, %from, %to, %why, "circuit breaker opened");
        } else {
            tracing::info!(breaker = %self.name, %from, %to, %why, "circuit breaker changed state");
        }
        // No subscriber is not an error: events are for whoever listens.
        let _ = self.events.send(StateTransition {
            name: self.name,
            from,
            to,
            at,
        });
    }
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}
