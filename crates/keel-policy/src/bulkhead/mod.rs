//! A bulkhead caps how many calls to a dependency run at once, so one slow
//! dependency cannot take every task, connection or thread with it.
//!
//! Like the watertight compartments of a ship, each dependency (or tenant,
//! with [`KeyedBulkhead`]) gets its own slots. When they are all taken, a
//! call is refused with [`Rejected::BulkheadFull`] and never reaches the
//! dependency.
//!
//! # Defaults, and why
//!
//! - `max_concurrent = 10`: a small, explicit budget; size it from the
//!   dependency's capacity (connections, threads), not the caller's load.
//! - `max_waiting = 0`: a full bulkhead refuses at once. Waiting hides
//!   overload behind latency; if a queue is what you want, bound it by a
//!   latency target with the `shed` module's `LoadShed`.
//! - `max_wait = 100 ms`: when waiting is enabled, how long a caller may
//!   wait; never longer than the current [`Deadline`](keel_core::Deadline),
//!   which answers [`Rejected::DeadlineExceeded`] instead.
//!
//! A slot is given back when the call ends, however it ends: a cancelled
//! call frees its slot, a cancelled waiter frees its place in the queue.
//! Taking and freeing a slot is one atomic operation each, with no lock.
//! Waiters are woken in arrival order, but a call that finds a slot free
//! takes it at once, even if others wait; `max_wait` bounds how long a
//! waiter can lose out that way.
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! use keel_policy::{bulkhead::Bulkhead, PolicyError, Rejected};
//!
//! let bulkhead = Bulkhead::builder("payments").max_concurrent(1).build().unwrap();
//! let busy = bulkhead.clone();
//! let refused = bulkhead
//!     .call(|| async move {
//!         // While this call holds the only slot, another one is refused.
//!         let second = busy.call(|| async { Ok::<_, std::io::Error>(2) }).await;
//!         assert!(matches!(second, Err(PolicyError::Rejected(Rejected::BulkheadFull { .. }))));
//!         Ok::<_, std::io::Error>(1)
//!     })
//!     .await;
//! assert_eq!(refused.unwrap(), 1);
//! let stats = bulkhead.stats();
//! assert_eq!((stats.accepted, stats.rejected, stats.active), (1, 1, 0));
//! # });
//! ```

mod compartment;
mod config;
mod keyed;
mod layer;

use std::future::Future;
use std::sync::Arc;

use keel_core::{Name, PolicyError, Rejected};

pub use crate::slots::ResponseFuture;
use crate::slots::{Admit, Slot};
use compartment::{Compartment, Rules};
pub use config::{BulkheadBuilder, BulkheadConfig};
pub use keyed::KeyedBulkhead;
pub use layer::{BulkheadLayer, BulkheadService, KeyedBulkheadLayer, KeyedBulkheadService};

/// Caps the number of concurrent calls; see the [module docs](self).
///
/// Clones share the same slots.
#[derive(Debug, Clone)]
pub struct Bulkhead {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    rules: Rules,
    compartment: Arc<Compartment>,
}

/// A snapshot of a bulkhead's counts. Read under concurrency, the fields
/// are each exact but may be a moment apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BulkheadStats {
    /// Calls seen: `accepted + rejected + waiting`.
    pub total: u64,
    /// Calls that got a slot.
    pub accepted: u64,
    /// Calls refused (full, waited too long, or past their deadline).
    pub rejected: u64,
    /// Slots taken now.
    pub active: usize,
    /// Slots free now: `max_concurrent - active`.
    pub available: usize,
    /// Calls waiting for a slot now.
    pub waiting: usize,
}

impl Bulkhead {
    /// Starts building a bulkhead named `name` (usually the dependency's).
    pub fn builder(name: impl Into<Name>) -> BulkheadBuilder {
        BulkheadBuilder::new(name.into())
    }

    fn from_config(name: Name, config: &BulkheadConfig) -> Self {
        let rules = Rules::new(name, config);
        let compartment = Arc::new(Compartment::new(&rules));
        let shared = Shared { rules, compartment };
        Self {
            shared: Arc::new(shared),
        }
    }

    /// Runs `f` in a slot, or refuses with [`Rejected::BulkheadFull`] (or
    /// [`Rejected::DeadlineExceeded`] if the deadline passes while waiting).
    /// The slot is freed when `f`'s future completes or is dropped.
    pub async fn call<T, E, F, Fut>(&self, f: F) -> Result<T, PolicyError<E>>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        let _slot = self.shared.compartment.enter(&self.shared.rules).await?;
        f().await.map_err(PolicyError::Inner)
    }

    /// The bulkhead's name.
    pub fn name(&self) -> &Name {
        &self.shared.rules.name
    }

    /// The current counts.
    pub fn stats(&self) -> BulkheadStats {
        self.shared
            .compartment
            .stats(self.shared.rules.max_concurrent)
    }
}

impl Admit for Bulkhead {
    fn try_enter_owned(&self) -> Option<Slot> {
        self.shared.compartment.try_enter_owned()
    }

    fn can_queue(&self) -> bool {
        self.shared.compartment.can_queue()
    }

    fn refuse(&self) -> Rejected {
        self.shared.compartment.refuse_full(&self.shared.rules)
    }

    async fn enter_owned(self) -> Result<Slot, Rejected> {
        let compartment = Arc::clone(&self.shared.compartment);
        compartment.enter_owned(&self.shared.rules).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn invalid_settings_are_refused() {
        let err = Bulkhead::builder("b")
            .max_concurrent(0)
            .build()
            .unwrap_err();
        assert_eq!(err.field, "max_concurrent");
        let err = Bulkhead::builder("b")
            .max_wait(Duration::ZERO)
            .build()
            .unwrap_err();
        assert_eq!(err.field, "max_wait");
        let err = Bulkhead::builder("b")
            .max_keys(0)
            .build_keyed::<u32>()
            .unwrap_err();
        assert_eq!(err.field, "max_keys");
    }

    #[test]
    fn defaults_are_documented_values() {
        let config = BulkheadConfig::default();
        assert_eq!(config.max_concurrent, 10);
        assert_eq!(config.max_waiting, 0);
        assert_eq!(config.max_wait, Duration::from_millis(100));
        let json = serde_json::to_string(&config).unwrap();
        assert_eq!(
            serde_json::from_str::<BulkheadConfig>(&json).unwrap(),
            config
        );
        assert!(serde_json::from_str::<BulkheadConfig>(r#"{"max_concurent": 1}"#).is_err());
    }
}
