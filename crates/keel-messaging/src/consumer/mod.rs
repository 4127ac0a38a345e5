//! The consumer runtime: each event applied once, acked last, retried with
//! backoff, and dead-lettered with its story when it cannot be applied.
//!
//! Delivery is at-least-once, so every handler sees duplicates: after a relay
//! republish, a lost ack, a rebalance. The runtime makes them harmless the way
//! an idempotent consumer does: for each delivery it begins a
//! transaction, records `(event id, group)` in the inbox, runs the handler in
//! that transaction and commits. "The dedupe row and the effect commit
//! TOGETHER or not at all." Only then does it ack ("Ack LAST. Acking first
//! would be at-most-once"); a crash before the ack redelivers the message and
//! the inbox row turns the redelivery into a no-op. The inbox is scoped by
//! group ("scope by handler"): two groups each legitimately apply the event.
//!
//! Around that core:
//!
//! - **Bad input never blocks a partition.** An undecodable envelope is
//!   dead-lettered at once as `malformed`, an event type with no handler as
//!   `unknown_type`, a handler's permanent error as `permanent`.
//! - **Retries.** A retryable failure rolls back, is recorded in the failure
//!   history, and the message is nacked with exponential backoff and jitter;
//!   after `max_deliveries` (default 5) it is dead-lettered as
//!   `too_many_attempts` with every attempt (number, error, time).
//! - **Leases.** While a handler runs its lease is extended every third of
//!   the lease, so a slow handler keeps its message and a dead process
//!   loses it quickly.
//! - **Deadlines.** A message whose `x-request-deadline-unix-ms` has passed
//!   is acked unprocessed and counted (`keel_consumer_expired_total`): nobody
//!   waits for the answer any more. Otherwise the handler runs under that
//!   [`Deadline`](keel_core::Deadline) and the message's trace context.
//! - **Backpressure.** At most `max_in_flight` handlers run at once (default
//!   16), and the consumer receives only as many messages as it has free
//!   slots. Messages with the same key in one batch run one after another.
//! - **Graceful shutdown.** When the shutdown future completes the consumer
//!   stops receiving, lets running handlers finish within the drain timeout,
//!   then cancels the rest (rolling back) and nacks them with no delay:
//!   nothing is lost, and nothing is applied twice.
//!
//! ## One delivery
//!
//! ```text
//! replay for another group? ──────────────────────────── ack (skipped)
//! deadline passed? ───────────────────────────────────── ack (expired)
//! decode envelope ── fails ───────────────────────────── dead-letter `malformed`
//! find handler ───── none ────────────────────────────── dead-letter `unknown_type`
//! delivered > N times already? ───────────────────────── dead-letter `too_many_attempts`
//! begin ─ inbox_record ─ seen ─ rollback ─────────────── ack (duplicate)
//!                      └ new ── handler ─ commit ─────── ack LAST (applied)
//!                                  └ error ─ rollback ── retryable and < N: nack(backoff)
//!                                                      └ otherwise: dead-letter with history
//! ```
//!
//! The "delivered > N times already" check catches a message whose handler
//! kills the process (or always loses its lease): no failure was ever
//! recorded for it, but the broker's delivery count still climbs.
//!
//! ## Failpoints
//!
//! With the `failpoints` feature, a test can make a delivery stop dead (as
//! if the process died) between any two durable steps, with
//! `fail::cfg(name, "1*return")`: `consumer-after-inbox`,
//! `consumer-after-handler` (both before the commit: rolled back),
//! `consumer-after-commit` (before the ack: redelivered, then deduped),
//! `consumer-after-ack`, and `consumer-after-dead-letter` (stored, not yet
//! terminated: redelivered, then stored once).
//!
//! ## Example
//!
//! ```
//! use std::future::Future;
//! use std::sync::Arc;
//! use keel_messaging::broker::Broker;
//! use keel_messaging::consumer::{Consumer, ConsumerStore, Group, HandlerError};
//!
//! async fn run_billing<S, B>(store: S, broker: Arc<B>, shutdown: impl Future<Output = ()>)
//! where
//!     S: ConsumerStore,
//!     S::Tx: 'static,
//!     B: Broker + ?Sized,
//! {
//!     let billing = Group::new("orders", "billing").on_fn("shop.order.placed.v1", |_tx, env| {
//!         Box::pin(async move {
//!             let _order = env.data_as::<serde_json::Value>()?;
//!             // ... charge the order, writing the ledger row in `_tx` ...
//!             Ok::<(), HandlerError>(())
//!         })
//!     });
//!     let consumer = Consumer::builder(store, broker).group(billing).build().unwrap();
//!     // Runs until `shutdown` completes, then drains.
//!     let report = consumer.run(shutdown).await;
//!     println!("drained: {}, released: {}", report.drained, report.released);
//! }
//! ```

mod handler;
mod options;
mod process;
mod runtime;
mod trace;

#[cfg(test)]
pub(crate) mod testing;
#[cfg(test)]
mod tests;

pub use handler::{
    DeliveryInfo, Disposition, EventFn, Handler, HandlerError, HandlerFn, HandlerFuture, event_fn,
    handler_fn,
};
/// The redelivery backoff types, re-exported so configuring a consumer needs
/// no direct dependency on `keel-policy`.
pub use keel_policy::retry::{Backoff, Jitter};
pub use options::{
    ConsumerOptions, DEFAULT_DRAIN_TIMEOUT, DEFAULT_INBOX_PRUNE_INTERVAL, DEFAULT_INBOX_RETENTION,
    DEFAULT_LEASE, DEFAULT_MAX_DELIVERIES, DEFAULT_MAX_IN_FLIGHT, DEFAULT_RECEIVE_WAIT,
};
pub use process::ConsumerStore;

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use keel_policy::ConfigError;
use tokio::sync::{Semaphore, watch};

use crate::broker::{Broker, BrokerError};
use crate::envelope::{Envelope, Event};
use process::{Processor, Route};
use runtime::{Shared, prune_inbox_loop, receive_loop};

/// One consumer group on one topic, with its handlers by event type. The
/// group name is also the inbox scope.
pub struct Group<Tx> {
    topic: String,
    name: String,
    handlers: HashMap<String, Arc<dyn Handler<Tx>>>,
}

impl<Tx> fmt::Debug for Group<Tx> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut types: Vec<_> = self.handlers.keys().collect();
        types.sort();
        f.debug_struct("Group")
            .field("topic", &self.topic)
            .field("name", &self.name)
            .field("event_types", &types)
            .finish()
    }
}

impl<Tx: Send + 'static> Group<Tx> {
    /// The group `name` reading `topic`, with no handlers yet.
    pub fn new(topic: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            topic: topic.into(),
            name: name.into(),
            handlers: HashMap::new(),
        }
    }

    /// Handles events of `event_type` (the full versioned CloudEvents type,
    /// `shop.order.placed.v1`) with `handler`, replacing any earlier one.
    pub fn on(mut self, event_type: impl Into<String>, handler: impl Handler<Tx>) -> Self {
        self.handlers.insert(event_type.into(), Arc::new(handler));
        self
    }

    /// Handles `event_type` with a closure over the raw envelope.
    pub fn on_fn<F>(self, event_type: impl Into<String>, f: F) -> Self
    where
        F: for<'a> Fn(&'a mut Tx, &'a Envelope) -> HandlerFuture<'a> + Send + Sync + 'static,
    {
        self.on(event_type, handler_fn(f))
    }

    /// Handles `E::TYPE` with a closure over the decoded event.
    pub fn on_event<E, F>(self, f: F) -> Self
    where
        E: Event + Send + 'static,
        F: for<'a> Fn(&'a mut Tx, E, &'a Envelope) -> HandlerFuture<'a> + Send + Sync + 'static,
    {
        self.on(E::TYPE, event_fn(f))
    }

    /// The topic.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The group name.
    pub fn name(&self) -> &str {
        &self.name
    }
}

/// Builds a [`Consumer`].
pub struct ConsumerBuilder<S: ConsumerStore, B: ?Sized> {
    store: S,
    broker: Arc<B>,
    groups: Vec<Group<S::Tx>>,
    options: ConsumerOptions,
}

impl<S: ConsumerStore, B: ?Sized> fmt::Debug for ConsumerBuilder<S, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("groups", &self.groups)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<S, B> ConsumerBuilder<S, B>
where
    S: ConsumerStore,
    S::Tx: 'static,
    B: Broker + ?Sized,
{
    /// Adds a consumer group.
    pub fn group(mut self, group: Group<S::Tx>) -> Self {
        self.groups.push(group);
        self
    }

    /// Replaces all options at once.
    pub fn options(mut self, options: ConsumerOptions) -> Self {
        self.options = options;
        self
    }

    /// Sets the most handlers running at once.
    pub fn max_in_flight(mut self, n: NonZeroUsize) -> Self {
        self.options.max_in_flight = n;
        self
    }

    /// Sets the deliveries before a failing message is dead-lettered.
    pub fn max_deliveries(mut self, n: NonZeroU32) -> Self {
        self.options.max_deliveries = n;
        self
    }

    /// Sets the broker lease per delivery.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.options.lease = lease;
        self
    }

    /// Sets how often a running handler's lease is extended.
    pub fn lease_extend_every(mut self, every: Duration) -> Self {
        self.options.lease_extend_every = Some(every);
        self
    }

    /// Sets the longest wait of one receive call.
    pub fn receive_wait(mut self, wait: Duration) -> Self {
        self.options.receive_wait = wait;
        self
    }

    /// Sets how long running handlers may finish at shutdown.
    pub fn drain_timeout(mut self, timeout: Duration) -> Self {
        self.options.drain_timeout = timeout;
        self
    }

    /// Sets the redelivery delays after retryable failures.
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.options.backoff = backoff;
        self
    }

    /// Sets how long inbox rows are kept (`None`: never prune).
    pub fn inbox_retention(mut self, retention: Option<Duration>) -> Self {
        self.options.inbox_retention = retention;
        self
    }

    /// Sets the time between inbox prunes (default one hour).
    pub fn inbox_prune_interval(mut self, interval: Duration) -> Self {
        self.options.inbox_prune_interval = interval;
        self
    }

    /// Builds the consumer. Refuses no groups, a group without handlers, the
    /// same (topic, group) twice, and inconsistent lease settings.
    pub fn build(self) -> Result<Consumer<S, B>, ConfigError> {
        self.options.validate()?;
        if self.groups.is_empty() {
            return Err(ConfigError::new("groups", "add at least one group"));
        }
        let mut routes = Vec::with_capacity(self.groups.len());
        let mut seen = std::collections::HashSet::new();
        for group in self.groups {
            if group.topic.is_empty() || group.name.is_empty() {
                return Err(ConfigError::new(
                    "groups",
                    "topic and group names must not be empty",
                ));
            }
            if group.handlers.is_empty() {
                return Err(ConfigError::new(
                    "groups",
                    format!(
                        "group `{}` on `{}` has no handlers",
                        group.name, group.topic
                    ),
                ));
            }
            if !seen.insert((group.topic.clone(), group.name.clone())) {
                return Err(ConfigError::new(
                    "groups",
                    format!("group `{}` on `{}` is added twice", group.name, group.topic),
                ));
            }
            routes.push(Arc::new(Route::new(
                group.topic.into(),
                group.name.into(),
                group.handlers,
            )));
        }
        Ok(Consumer {
            processor: Arc::new(Processor {
                store: self.store,
                options: self.options,
            }),
            broker: self.broker,
            routes,
        })
    }
}

/// Runs handlers for consumer groups. See the [module docs](self).
pub struct Consumer<S: ConsumerStore, B: ?Sized> {
    processor: Arc<Processor<S>>,
    broker: Arc<B>,
    routes: Vec<Arc<Route<S::Tx>>>,
}

impl<S: ConsumerStore, B: ?Sized> fmt::Debug for Consumer<S, B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let routes: Vec<_> = self
            .routes
            .iter()
            .map(|r| format!("{}/{}", r.topic, r.group))
            .collect();
        f.debug_struct("Consumer")
            .field("routes", &routes)
            .field("options", &self.processor.options)
            .finish_non_exhaustive()
    }
}

/// How a consumer's shutdown went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Whether every running handler finished within the drain timeout.
    pub drained: bool,
    /// Deliveries given back to the broker unprocessed (nacked with no
    /// delay): received but not started, or cancelled at the drain timeout.
    pub released: usize,
}

impl<S, B> Consumer<S, B>
where
    S: ConsumerStore,
    S::Tx: 'static,
    B: Broker + ?Sized,
{
    /// A consumer reading from `broker`, with its inbox and dead letters in
    /// `store`.
    pub fn builder(store: S, broker: Arc<B>) -> ConsumerBuilder<S, B> {
        ConsumerBuilder {
            store,
            broker,
            groups: Vec::new(),
            options: ConsumerOptions::default(),
        }
    }

    /// The options in effect.
    pub fn options(&self) -> &ConsumerOptions {
        &self.processor.options
    }

    /// Declares every group of this consumer on the broker
    /// ([`Broker::declare_group`]), so that events published before
    /// [`run`](Self::run) subscribes wait for them. Call it before the
    /// producers (the outbox relay) start: on a broker whose groups start
    /// at their creation (RabbitMQ) an event published to a topic before
    /// its group exists never reaches the group.
    pub async fn declare_groups(&self) -> Result<(), BrokerError> {
        for route in &self.routes {
            let options = route.subscribe_options(&self.processor.options);
            self.broker.declare_group(&options).await?;
        }
        Ok(())
    }

    /// Consumes until `shutdown` completes, then drains: stops receiving,
    /// waits up to the drain timeout for running handlers, cancels the rest
    /// and gives their messages back.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> ShutdownReport {
        let options = &self.processor.options;
        let max = options.max_in_flight.get();
        let (stop_tx, stop) = watch::channel(false);
        let (abort_tx, abort) = watch::channel(false);
        let shared = Shared {
            processor: Arc::clone(&self.processor),
            slots: Arc::new(Semaphore::new(max)),
            stop,
            abort,
            released: Arc::new(AtomicUsize::new(0)),
        };
        let mut loops = tokio::task::JoinSet::new();
        for route in &self.routes {
            loops.spawn(receive_loop(
                Arc::clone(&self.broker),
                Arc::clone(route),
                shared.clone(),
            ));
        }
        if let Some(retention) = options.inbox_retention {
            loops.spawn(prune_inbox_loop(shared.clone(), retention));
        }
        tracing::info!(
            groups = self.routes.len(),
            max_in_flight = max,
            "consumer started"
        );
        shutdown.await;
        tracing::info!("consumer stopping: no more receives, draining in-flight handlers");
        let _ = stop_tx.send(true);
        while loops.join_next().await.is_some() {}
        let all = u32::try_from(max).unwrap_or(u32::MAX);
        let drained = tokio::time::timeout(options.drain_timeout, shared.slots.acquire_many(all))
            .await
            .is_ok();
        if !drained {
            tracing::warn!(timeout = ?options.drain_timeout,
                "drain timeout: cancelling running handlers and releasing their messages");
            let _ = abort_tx.send(true);
            let _ = shared.slots.acquire_many(all).await;
        }
        let released = shared.released.load(Ordering::Relaxed);
        tracing::info!(drained, released, "consumer stopped");
        ShutdownReport { drained, released }
    }
}
