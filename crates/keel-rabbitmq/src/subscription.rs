//! [`RabbitSubscription`]: one member of a group, reading every shard.
//!
//! RabbitMQ hands each shard's deliveries to the group's one active member
//! (single active consumer), in queue order. Delayed nacks and per-key
//! holds are kept here, by the member holding the deliveries: a nacked
//! delivery becomes available again *in this member*, so a later message
//! of its key can never overtake it. A lease that runs out means the member
//! is stuck or gone, so it hands its shards over: it closes its channel,
//! RabbitMQ returns every delivery it held to the front of its queue (with
//! `x-delivery-count` one higher) and makes the next member active, and
//! this member joins again at the back. A member whose process died hands
//! over the same way when its connection closes.

use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::stream::{SelectAll, select_all};
use futures_util::{FutureExt, StreamExt};
use keel_store::broker::held::{HeldDeliveries, Settling};
use keel_store::broker::{
    Backlog, BrokerError, Delivery, DeliveryControl, SubscribeOptions, Subscription,
};
use lapin::acker::Acker;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions, BasicRejectOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Consumer};
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::broker::Inner;
use crate::envelope;
use crate::error::Within;
use crate::recent::RecentIds;

/// A group member's view of its topic; see the module docs.
pub(crate) struct RabbitSubscription {
    inner: Arc<Inner>,
    options: SubscribeOptions,
    held: Arc<Held>,
    channel: Option<Channel>,
    forwarder: Option<JoinHandle<()>>,
}

/// Why a member hands its shards over when a lease runs out.
const LEASE_RAN_OUT: &str = "a lease ran out: handing the shards over";

/// The deliveries a member holds, shared with its settle handles, the
/// task that takes them from RabbitMQ, and the broker's backlog count.
pub(crate) struct Held {
    state: Mutex<HeldState>,
    arrived: Notify,
    leases_changed: Notify,
}

struct HeldState {
    entries: HeldDeliveries<u64, Acker>,
    next_seq: u64,
    recent: RecentIds,
    /// Why the channel stopped delivering, if it did.
    broken: Option<String>,
    /// When the forwarder's lease timer fires: a lease ending before it
    /// must wake the forwarder, one ending after it need not.
    lease_timer: Instant,
}

impl Held {
    fn new(recent: RecentIds) -> Self {
        Self {
            state: Mutex::new(HeldState {
                entries: HeldDeliveries::default(),
                next_seq: 0,
                recent,
                broken: None,
                lease_timer: lease_timer(None),
            }),
            arrived: Notify::new(),
            leases_changed: Notify::new(),
        }
    }

    /// When the forwarder's lease timer should fire next (when the earliest
    /// lease runs out), recorded so that only an earlier lease wakes it.
    fn next_lease_timer(&self) -> Instant {
        let mut state = self.state.lock();
        let end = state.entries.next_lease_end();
        state.lease_timer = lease_timer(end);
        state.lease_timer
    }

    /// Whether a delivery is leased past its lease's end at `now`.
    fn a_lease_ran_out(&self, now: Instant) -> bool {
        self.state.lock().entries.a_lease_ran_out(now)
    }

    /// Held deliveries: leased ones in flight, the rest waiting.
    pub(crate) fn backlog(&self) -> Backlog {
        let state = self.state.lock();
        let in_flight = state.entries.in_flight(Instant::now());
        Backlog {
            waiting: state.entries.len() as u64 - in_flight,
            in_flight,
        }
    }

    /// Takes a delivery from RabbitMQ; a repeated id is acked and dropped.
    /// The caller wakes the receiver.
    async fn take(&self, delivery: lapin::message::Delivery) {
        let arrived = envelope::arrived(&delivery.properties, delivery.data);
        let duplicate = {
            let mut state = self.state.lock();
            let first = state
                .recent
                .first_sight(&arrived.message.id, Instant::now());
            // A delivery RabbitMQ returned to the queue comes back with the
            // same id; only a repeated publish is a duplicate.
            if first || delivery.redelivered {
                let seq = state.next_seq;
                state.next_seq += 1;
                let acker = delivery.acker.clone();
                let (message, published_at) = (arrived.message, arrived.published_at);
                let now = Instant::now();
                state
                    .entries
                    .insert(seq, message, published_at, arrived.returns, acker, now);
                false
            } else {
                true
            }
        };
        if duplicate {
            let _ = delivery.acker.ack(BasicAckOptions::default()).await;
        }
    }

    fn break_with(&self, why: String) {
        let mut state = self.state.lock();
        state.broken = Some(why);
        // The channel's deliveries are back in their queues.
        state.entries.clear();
        drop(state);
        self.arrived.notify_one();
    }

    /// Leases up to `max` deliverable entries, oldest first, skipping every
    /// key with an earlier unsettled message; or, with none, the next
    /// instant one may become deliverable. [`Leased::Expired`] when a lease
    /// ran out: the member must hand its shards over.
    fn lease(self: &Arc<Self>, max: usize, lease: Duration) -> Leased {
        let mut state = self.state.lock();
        let now = Instant::now();
        if state.entries.a_lease_ran_out(now) {
            return Leased::Expired;
        }
        let sooner = now + lease < state.lease_timer;
        let (deliveries, next_wake) = state.entries.lease(max, lease, now, |seq, id| {
            Box::new(Settle {
                held: Arc::downgrade(self),
                seq,
                lease: id,
            })
        });
        drop(state);
        if sooner && !deliveries.is_empty() {
            self.leases_changed.notify_one();
        }
        Leased::Some(deliveries, next_wake)
    }
}

/// What [`Held::lease`] found.
enum Leased {
    /// These deliveries (maybe none), and when to look again.
    Some(Vec<Delivery>, Option<Instant>),
    /// A lease ran out.
    Expired,
}

impl RabbitSubscription {
    pub(crate) async fn open(
        inner: Arc<Inner>,
        options: SubscribeOptions,
    ) -> Result<Self, BrokerError> {
        let held = Arc::new(Held::new(RecentIds::new(
            inner.options.dedupe_window,
            inner.options.dedupe_capacity,
        )));
        inner
            .counts
            .lock()
            .entry((options.topic.clone(), options.group.clone()))
            .or_default()
            .push(Arc::downgrade(&held));
        let mut subscription = Self {
            inner,
            options,
            held,
            channel: None,
            forwarder: None,
        };
        subscription.consume().await?;
        Ok(subscription)
    }

    /// Opens a channel and consumes every shard of the group on it.
    async fn consume(&mut self) -> Result<(), BrokerError> {
        self.close();
        let channel = self.inner.link.channel().await?;
        channel
            .basic_qos(self.inner.options.prefetch, BasicQosOptions::default())
            .within()
            .await?;
        let mut consumers: Vec<Consumer> = Vec::new();
        for shard in 0..self.inner.options.shards {
            let queue = self
                .inner
                .names
                .queue(&self.options.topic, &self.options.group, shard);
            let consumer = channel
                .basic_consume(
                    &queue,
                    "",
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .within()
                .await?;
            consumers.push(consumer);
        }
        self.held.state.lock().broken = None;
        self.forwarder = Some(tokio::spawn(forward(
            consumers,
            self.held.clone(),
            channel.clone(),
        )));
        self.channel = Some(channel);
        Ok(())
    }

    /// Stops reading: RabbitMQ returns what this member held to the queues.
    fn close(&mut self) {
        if let Some(forwarder) = self.forwarder.take() {
            forwarder.abort();
        }
        if let Some(channel) = self.channel.take()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            runtime.spawn(async move {
                let _ = channel.close(200, "member left").await;
            });
        }
        self.held.state.lock().entries.clear();
    }
}

/// Moves every delivery of the member's consumers into what it holds, and
/// hands the shards over when a lease runs out, until the channel closes.
///
/// The earliest lease end is looked up again only when a lease ending
/// before the timer was handed out or extended ([`Held::leases_changed`])
/// and when the timer fires: an ack, nack or terminate only removes a
/// lease end, so the timer may fire early, never late, and then finds
/// nothing ran out.
async fn forward(consumers: Vec<Consumer>, held: Arc<Held>, channel: Channel) {
    let mut deliveries = select_all(consumers);
    let expiry = tokio::time::sleep_until(held.next_lease_timer());
    tokio::pin!(expiry);
    let why = loop {
        let changed = held.leases_changed.notified();
        tokio::select! {
            next = deliveries.next() => {
                if let Err(why) = take_arrived(&held, next, &mut deliveries).await {
                    break why;
                }
            }
            () = &mut expiry => {
                if held.a_lease_ran_out(Instant::now()) {
                    break LEASE_RAN_OUT.to_owned();
                }
                expiry.as_mut().reset(held.next_lease_timer());
            }
            () = changed => expiry.as_mut().reset(held.next_lease_timer()),
        }
    };
    held.break_with(why);
    let _ = channel.close(200, "handing over").await;
}

impl Drop for RabbitSubscription {
    fn drop(&mut self) {
        self.close();
    }
}

#[async_trait]
impl Subscription for RabbitSubscription {
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>, BrokerError> {
        let deadline = Instant::now() + wait;
        loop {
            let broken = self.held.state.lock().broken.clone();
            if let Some(why) = broken {
                tracing::warn!(topic = %self.options.topic, group = %self.options.group, %why, "RabbitMQ stopped delivering; reconsuming");
                self.consume().await?;
            }
            let notified = self.held.arrived.notified();
            let (deliveries, next_wake) = match self.held.lease(max, self.options.lease) {
                Leased::Some(deliveries, next_wake) => (deliveries, next_wake),
                Leased::Expired => {
                    self.held.break_with(LEASE_RAN_OUT.to_owned());
                    continue;
                }
            };
            if !deliveries.is_empty() {
                return Ok(deliveries);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(Vec::new());
            }
            let until = next_wake.map_or(deadline, |wake| wake.min(deadline));
            let _ = tokio::time::timeout_at(until, notified).await;
        }
    }
}

/// Takes `next` and every delivery that has arrived behind it, then wakes
/// the receiver once: a burst becomes one batch, not a wake-up per
/// delivery. `Err` says why the channel stopped delivering.
async fn take_arrived(
    held: &Held,
    mut next: Option<Result<lapin::message::Delivery, lapin::Error>>,
    deliveries: &mut SelectAll<Consumer>,
) -> Result<(), String> {
    let outcome = loop {
        match next {
            Some(Ok(delivery)) => held.take(delivery).await,
            Some(Err(error)) => break Err(error.to_string()),
            None => break Err("the channel closed".to_owned()),
        }
        match deliveries.next().now_or_never() {
            Some(arrived) => next = arrived,
            None => break Ok(()),
        }
    };
    held.arrived.notify_one();
    outcome
}

/// When the forwarder's lease timer should fire: at `end`, or, with no
/// delivery leased, a year from now (the timer is reset before then).
fn lease_timer(end: Option<Instant>) -> Instant {
    end.unwrap_or_else(|| Instant::now() + Duration::from_secs(365 * 24 * 3600))
}

/// Settles one leased delivery.
struct Settle {
    held: Weak<Held>,
    seq: u64,
    lease: u64,
}

impl Settle {
    /// Runs `settle` on the delivery while this lease holds it; `LeaseLost`
    /// once it expired, was handed out again or the channel closed.
    fn with_entry<T>(
        &self,
        settle: impl FnOnce(Settling<'_, u64, Acker>) -> T,
    ) -> Result<T, BrokerError> {
        self.settle(settle, None)
    }

    /// [`with_entry`](Self::with_entry) for a settle that leaves the lease
    /// ending at `lease_end`: the forwarder is woken when that is before its
    /// timer.
    fn settle<T>(
        &self,
        settle: impl FnOnce(Settling<'_, u64, Acker>) -> T,
        lease_end: Option<Instant>,
    ) -> Result<T, BrokerError> {
        let held = self.held.upgrade().ok_or(BrokerError::LeaseLost)?;
        let mut state = held.state.lock();
        let lease_timer = state.lease_timer;
        let outcome = settle(state.entries.settle(self.seq, self.lease, Instant::now())?);
        let sooner = lease_end.is_some_and(|end| end < lease_timer);
        drop(state);
        held.arrived.notify_one();
        if sooner {
            held.leases_changed.notify_one();
        }
        Ok(outcome)
    }
}

#[async_trait]
impl DeliveryControl for Settle {
    async fn ack(&self) -> Result<(), BrokerError> {
        let acker = self.with_entry(|entry| entry.done().map(|entry| entry.extra))?;
        if let Some(acker) = acker {
            acker
                .ack(BasicAckOptions::default())
                .await
                .map_err(|_| BrokerError::LeaseLost)?;
        }
        Ok(())
    }

    async fn nack(&self, delay: Duration) -> Result<(), BrokerError> {
        self.with_entry(|entry| entry.release(Instant::now() + delay))
    }

    async fn extend(&self, lease: Duration) -> Result<(), BrokerError> {
        let until = Instant::now() + lease;
        // A lease extended by less than it had left may now end before the
        // forwarder's timer.
        self.settle(|entry| entry.extend(until), Some(until))
    }

    /// Rejected without requeue: RabbitMQ moves it to the group's
    /// dead-letter queue, with the `x-death` history.
    async fn terminate(&self) -> Result<(), BrokerError> {
        let acker = self.with_entry(|entry| entry.done().map(|entry| entry.extra))?;
        if let Some(acker) = acker {
            acker
                .reject(BasicRejectOptions { requeue: false })
                .await
                .map_err(|_| BrokerError::LeaseLost)?;
        }
        Ok(())
    }
}
