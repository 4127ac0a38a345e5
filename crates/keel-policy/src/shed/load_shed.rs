//! Load shedding for request paths that cannot push back.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use keel_core::{Deadline, Name, PolicyError, Rejected, clock};
use tokio::time::Instant;

use super::{LoadShedBuilder, LoadShedConfig, Telemetry};
use crate::slots::gate::{Gate, Shut};
use crate::slots::{Admit, Gated, Slot};

/// Caps calls in flight, queues a latency target's worth behind them, and
/// sheds the rest at once; see the [module docs](super).
///
/// Clones share the same limits.
#[derive(Debug, Clone)]
pub struct LoadShed {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    gate: Gate,
    max_in_flight: usize,
    max_queued: usize,
    latency_target: Duration,
    retry_after: Duration,
    telemetry: Telemetry,
}

/// A snapshot of a [`LoadShed`] policy's counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LoadShedStats {
    /// Calls running now.
    pub in_flight: usize,
    /// The most calls that may run at once.
    pub max_in_flight: usize,
    /// Calls queued now.
    pub queued: usize,
    /// The queue bound (derived from the latency target or set).
    pub max_queued: usize,
    /// Calls shed: refused with [`Rejected::Overloaded`].
    pub shed: u64,
    /// Queued calls dropped because their deadline passed.
    pub expired: u64,
}

impl LoadShed {
    /// Starts building a policy named `name`.
    pub fn builder(name: impl Into<Name>) -> LoadShedBuilder {
        LoadShedBuilder::new(name.into())
    }

    pub(super) fn new(name: Name, config: &LoadShedConfig, max_queued: usize) -> Self {
        let shared = Shared {
            gate: Gate::new(config.max_in_flight, max_queued),
            max_in_flight: config.max_in_flight,
            max_queued,
            latency_target: config.latency_target,
            retry_after: config.retry_after,
            telemetry: Telemetry::new(name),
        };
        Self {
            shared: Arc::new(shared),
        }
    }

    /// Runs `f` in a slot, queueing for one if the queue has room; sheds
    /// with [`Rejected::Overloaded`] when it has none or the wait exceeds
    /// the latency target, and refuses with [`Rejected::DeadlineExceeded`]
    /// when the current deadline passes while queued.
    pub async fn call<T, E, F, Fut>(&self, f: F) -> Result<T, PolicyError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let _slot = self.enter().await?;
        f().await.map_err(PolicyError::Inner)
    }

    /// The current counts.
    pub fn stats(&self) -> LoadShedStats {
        let shared = &*self.shared;
        LoadShedStats {
            in_flight: shared.gate.active(),
            max_in_flight: shared.max_in_flight,
            queued: shared.gate.waiting(),
            max_queued: shared.max_queued,
            shed: shared.telemetry.shed_count(),
            expired: shared.telemetry.expired_count(),
        }
    }

    /// The policy's name.
    pub fn name(&self) -> &Name {
        &self.shared.telemetry.name
    }

    async fn enter(&self) -> Result<Permit<'_>, Rejected> {
        if self.shared.gate.try_enter() {
            return Ok(Permit(&self.shared.gate));
        }
        if !self.shared.gate.can_wait() {
            return Err(self.refuse());
        }
        let (until, bound) = self.wait_bound();
        match self.shared.gate.wait(until).await {
            Ok(()) => Ok(Permit(&self.shared.gate)),
            Err(Shut::TimedOut) if bound == Bound::Deadline => Err(self.expire()),
            Err(Shut::QueueFull | Shut::TimedOut) => Err(self.refuse()),
        }
    }

    /// Waits no longer than the latency target, nor past the deadline.
    fn wait_bound(&self) -> (Instant, Bound) {
        let now = clock::now();
        let own = now
            .checked_add(self.shared.latency_target)
            .unwrap_or_else(|| now + Duration::from_secs(86_400 * 365));
        match Deadline::current() {
            Some(deadline) if deadline.instant() <= own => (deadline.instant(), Bound::Deadline),
            _ => (own, Bound::LatencyTarget),
        }
    }

    fn expire(&self) -> Rejected {
        self.shared.telemetry.expire();
        Rejected::DeadlineExceeded
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bound {
    LatencyTarget,
    Deadline,
}

/// A slot borrowed from the policy, freed when dropped.
struct Permit<'a>(&'a Gate);

impl Drop for Permit<'_> {
    fn drop(&mut self) {
        self.0.leave();
    }
}

impl Gated for Shared {
    fn gate(&self) -> &Gate {
        &self.gate
    }
}

impl Admit for LoadShed {
    fn try_enter_owned(&self) -> Option<Slot> {
        self.shared
            .gate
            .try_enter()
            .then(|| Slot::entered(Arc::clone(&self.shared) as Arc<dyn Gated>))
    }

    fn can_queue(&self) -> bool {
        self.shared.gate.can_wait()
    }

    async fn enter_owned(self) -> Result<Slot, Rejected> {
        std::mem::forget(self.enter().await?);
        Ok(Slot::entered(self.shared))
    }

    fn refuse(&self) -> Rejected {
        self.shared.telemetry.shed(self.shared.retry_after)
    }
}
