//! Bounded queues and load shedding: when work arrives faster than it can
//! be done, push back on the producer, or refuse the excess explicitly and
//! count it.
//!
//! # Why bounds come from latency
//!
//! A queue's bound is chosen from a latency target, not from available
//! memory: 64 items × 10 ms each is about 640 ms of queueing, and that is
//! the budget. A longer queue does not serve more work, it only makes every
//! item later, until callers time out and the work done is wasted. So
//! [`QueueConfig`] and [`LoadShedConfig`] derive their bounds from
//! `latency_target`, `service_time` and the parallelism (Little's law).
//!
//! # Push back if you can, shed if you must
//!
//! - [`BoundedQueue::put`] *waits* while the queue is full. That is the
//!   backpressure: the producer stops reading its source, and the pressure
//!   travels back to the sender.
//! - When a producer cannot wait (an HTTP handler, a fire-and-forget
//!   producer), [`BoundedQueue::try_put`] and [`LoadShed`] refuse at once
//!   with [`Rejected::Overloaded`] and a `retry_after`, and count it in
//!   `keel_shed_total`. Silence here is how overload becomes invisible.
//! - Work whose deadline passed while queued is dropped and counted in
//!   `keel_shed_expired_total`, never handed to a consumer: do not do dead
//!   work.
//!
//! ```
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! use keel_policy::{shed::BoundedQueue, Rejected};
//!
//! let queue: BoundedQueue<u32> = BoundedQueue::builder("ingest").capacity(2).build().unwrap();
//! queue.try_put(1).unwrap();
//! queue.put(2).await.unwrap();
//! let refused = queue.try_put(3).unwrap_err();
//! assert!(matches!(refused.rejected, Rejected::Overloaded { .. }));
//! assert_eq!(refused.item, 3, "the caller gets the item back to answer for it");
//! assert_eq!(queue.get().await, 1);
//! assert_eq!(queue.stats().shed, 1);
//! # });
//! ```

mod config;
mod layer;
mod load_shed;
mod queue;

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use keel_core::{Name, Rejected};

pub use crate::slots::ResponseFuture;
pub use config::{LoadShedBuilder, LoadShedConfig, QueueBuilder, QueueConfig};
pub use layer::{LoadShedLayer, LoadShedService};
pub use load_shed::{LoadShed, LoadShedStats};
pub use queue::{BoundedQueue, QueueStats, Refused};

/// Counts shed and expired work, as metrics and as stats, and reports it.
#[derive(Debug)]
struct Telemetry {
    name: Name,
    shed_total: metrics::Counter,
    expired_total: metrics::Counter,
    shed: AtomicU64,
    expired: AtomicU64,
}

impl Telemetry {
    fn new(name: Name) -> Self {
        Self {
            shed_total: metrics::counter!("keel_shed_total", "name" => name.as_str()),
            expired_total: metrics::counter!("keel_shed_expired_total", "name" => name.as_str()),
            name,
            shed: AtomicU64::new(0),
            expired: AtomicU64::new(0),
        }
    }

    fn shed(&self, retry_after: Duration) -> Rejected {
        self.shed.fetch_add(1, Relaxed);
        self.shed_total.increment(1);
        tracing::debug!(shed = %self.name, "overloaded: work shed");
        Rejected::Overloaded {
            name: self.name,
            retry_after,
        }
    }

    fn expire(&self) {
        self.expired.fetch_add(1, Relaxed);
        self.expired_total.increment(1);
        tracing::debug!(shed = %self.name, "deadline passed while queued: work dropped");
    }

    fn shed_count(&self) -> u64 {
        self.shed.load(Relaxed)
    }

    fn expired_count(&self) -> u64 {
        self.expired.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seed_example_gives_64_items() {
        assert_eq!(QueueConfig::default().capacity(), Ok(64));
        let two_consumers = QueueConfig {
            consumers: 2,
            ..QueueConfig::default()
        };
        assert_eq!(two_consumers.capacity(), Ok(128));
        let set = QueueConfig {
            capacity: Some(5),
            ..QueueConfig::default()
        };
        assert_eq!(set.capacity(), Ok(5));
        assert_eq!(LoadShedConfig::default().max_queued(), Ok(640));
    }

    #[test]
    fn invalid_queue_settings_are_refused() {
        let field = |config: QueueConfig| config.capacity().unwrap_err().field;
        let base = QueueConfig::default;
        assert_eq!(
            field(QueueConfig {
                latency_target: Duration::ZERO,
                ..base()
            }),
            "latency_target"
        );
        assert_eq!(
            field(QueueConfig {
                service_time: Duration::ZERO,
                ..base()
            }),
            "service_time"
        );
        assert_eq!(
            field(QueueConfig {
                consumers: 0,
                ..base()
            }),
            "consumers"
        );
        assert_eq!(
            field(QueueConfig {
                capacity: Some(0),
                ..base()
            }),
            "capacity"
        );
        assert_eq!(
            field(QueueConfig {
                capacity: Some(usize::MAX),
                ..base()
            }),
            "capacity"
        );
        let too_short = QueueConfig {
            latency_target: Duration::from_millis(5),
            ..base()
        };
        assert_eq!(field(too_short), "capacity");
        assert_eq!(
            field(QueueConfig {
                retry_after: Duration::ZERO,
                ..base()
            }),
            "retry_after"
        );
    }

    #[test]
    fn invalid_load_shed_settings_are_refused() {
        let field = |config: LoadShedConfig| config.build("s").unwrap_err().field;
        let base = LoadShedConfig::default;
        assert_eq!(
            field(LoadShedConfig {
                max_in_flight: 0,
                ..base()
            }),
            "max_in_flight"
        );
        assert_eq!(
            field(LoadShedConfig {
                max_in_flight: usize::MAX,
                ..base()
            }),
            "max_in_flight"
        );
        assert_eq!(
            field(LoadShedConfig {
                latency_target: Duration::ZERO,
                ..base()
            }),
            "latency_target"
        );
        assert_eq!(
            field(LoadShedConfig {
                service_time: Duration::ZERO,
                ..base()
            }),
            "service_time"
        );
        assert_eq!(
            field(LoadShedConfig {
                retry_after: Duration::ZERO,
                ..base()
            }),
            "retry_after"
        );
    }

    #[test]
    fn configs_round_trip_and_refuse_unknown_fields() {
        let queue = QueueConfig::default();
        let json = serde_json::to_string(&queue).unwrap();
        assert_eq!(serde_json::from_str::<QueueConfig>(&json).unwrap(), queue);
        let shed = LoadShedConfig::default();
        let json = serde_json::to_string(&shed).unwrap();
        assert_eq!(serde_json::from_str::<LoadShedConfig>(&json).unwrap(), shed);
        assert!(serde_json::from_str::<LoadShedConfig>(r#"{"max_inflight": 3}"#).is_err());
        assert!(serde_json::from_str::<QueueConfig>(r#"{"size": 3}"#).is_err());
    }
}
