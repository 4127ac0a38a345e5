//! A group member: one Kafka consumer per group and process, shared by the
//! process's subscriptions of that group.
//!
//! Sharing is what lets several subscriptions of one group in one process
//! split the work without a rebalance per subscription: they lease from
//! the member's [`Held`] records, as competing consumers of a queue would.
//! Across processes, Kafka's group protocol (the cooperative-sticky
//! assignor) splits the partitions.

use std::collections::HashSet;
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use futures_util::FutureExt;
use keel_core::clock;
use keel_store::broker::{BrokerError, Delivery, DeliveryControl, Message, Subscription};
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance, StreamConsumer};
use rdkafka::message::BorrowedMessage;
use rdkafka::{ClientContext, Offset, TopicPartitionList};
use tokio::sync::{oneshot, watch};

use crate::broker::{GroupName, Inner, client_config, millis};
use crate::envelope;
use crate::error::broker_error;
use crate::held::{Held, Place};
use crate::names;
use crate::recent::RecentPlaces;

/// Header naming the group that dead-lettered a message.
const DEAD_LETTER_GROUP: &str = "keel-dead-letter-group";
/// Header with how many times the group was handed the message.
const DEAD_LETTER_DELIVERIES: &str = "keel-delivery-count";

pub(crate) type MemberConsumer = StreamConsumer<MemberContext>;

/// One Kafka consumer of a group, and what it holds.
pub(crate) struct Member {
    inner: Arc<Inner>,
    name: GroupName,
    /// The fetch task owns the consumer: when it stops, the consumer
    /// closes, whoever else holds a [`Member`]. librdkafka keeps fetching
    /// in its own threads while a consumer lives, polled or not.
    consumer: Weak<MemberConsumer>,
    held: Arc<Held>,
    stop: parking_lot::Mutex<Option<oneshot::Sender<()>>>,
    /// Turns true once the consumer left the group.
    gone: watch::Receiver<bool>,
}

/// Serves the consumer's rebalance callbacks.
pub(crate) struct MemberContext {
    held: Arc<Held>,
    topic: String,
}

impl ClientContext for MemberContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, facility: &str, line: &str) {
        crate::log::emit(level, facility, line);
    }
}

impl ConsumerContext for MemberContext {
    /// Before partitions go: their settled offsets are stored (librdkafka
    /// commits them as it lets go), and what is unsettled is abandoned to
    /// the next owner.
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(revoked) = rebalance {
            store_advanced(consumer, &self.held, &self.topic);
            let partitions: HashSet<i32> =
                revoked.elements().iter().map(|e| e.partition()).collect();
            self.held.revoke(&partitions);
        }
    }

    fn post_rebalance(&self, _: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Assign(_) = rebalance {
            self.held.mark_assigned();
        }
    }
}

/// Stores every partition's advanced commit point for the next commit.
fn store_advanced<K: Consumer<C>, C: ConsumerContext>(consumer: &K, held: &Held, topic: &str) {
    let advanced = held.advanced();
    if advanced.is_empty() {
        return;
    }
    let mut offsets = TopicPartitionList::new();
    for (partition, offset) in advanced {
        if offsets
            .add_partition_offset(topic, partition, Offset::Offset(offset))
            .is_err()
        {
            return;
        }
    }
    if let Err(error) = consumer.store_offsets(&offsets) {
        tracing::debug!(%topic, %error, "storing settled offsets failed; the next round retries");
    }
}

impl Member {
    /// Joins `name`'s Kafka group and waits (within the request timeout)
    /// for the first assignment, so that a subscription returns reading.
    pub(crate) async fn join(
        inner: Arc<Inner>,
        name: &GroupName,
    ) -> Result<Arc<Self>, BrokerError> {
        let options = &inner.options;
        let held = Arc::new(Held::new(RecentPlaces::new(
            options.dedupe_window,
            options.dedupe_capacity,
        )));
        let kafka_topic = inner.kafka(&name.0);
        let context = MemberContext {
            held: held.clone(),
            topic: kafka_topic.clone(),
        };
        let consumer: MemberConsumer = consumer_config(&inner, name)
            .create_with_context(context)
            .map_err(broker_error)?;
        consumer.subscribe(&[&kafka_topic]).map_err(broker_error)?;
        let consumer = Arc::new(consumer);
        let weak_consumer = Arc::downgrade(&consumer);
        let (stop, stopped) = oneshot::channel();
        let (left, gone) = watch::channel(false);
        tokio::spawn(fetch(
            consumer,
            held.clone(),
            (kafka_topic, name.0.clone()),
            options.clone(),
            (stopped, left),
        ));
        let deadline = clock::now() + options.request_timeout;
        loop {
            let changed = held.changed.notified();
            if held.is_assigned() || clock::now() >= deadline {
                break;
            }
            let _ = tokio::time::timeout_at(deadline, changed).await;
        }
        Ok(Arc::new(Self {
            inner,
            name: name.clone(),
            consumer: weak_consumer,
            held,
            stop: parking_lot::Mutex::new(Some(stop)),
            gone,
        }))
    }

    /// Leaves the group now and waits until the consumer is closed: what
    /// must happen before the group or its topic is deleted (librdkafka
    /// must never fetch from a topic that is gone). Its subscriptions
    /// receive nothing more.
    pub(crate) async fn leave(&self) {
        if let Some(stop) = self.stop.lock().take() {
            let _ = stop.send(());
        }
        let mut gone = self.gone.clone();
        let _ = gone.wait_for(|gone| *gone).await;
        self.held.forget_all();
    }

    /// The consumer, while the member reads.
    pub(crate) fn consumer(&self) -> Option<Arc<MemberConsumer>> {
        self.consumer.upgrade()
    }

    pub(crate) fn in_flight(&self) -> u64 {
        self.held.in_flight()
    }
}

/// A member that stores offsets by hand (only past settled records) and
/// lets librdkafka commit them on a timer, on revocation and on close.
fn consumer_config(inner: &Inner, name: &GroupName) -> rdkafka::ClientConfig {
    let options = &inner.options;
    let mut config = client_config(options);
    config
        .set("group.id", names::group_id(&inner.kafka(&name.0), &name.1))
        .set("enable.auto.commit", "true")
        .set(
            "auto.commit.interval.ms",
            millis(options.commit_interval).to_string(),
        )
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("partition.assignment.strategy", "cooperative-sticky")
        .set("session.timeout.ms", "10000")
        .set("heartbeat.interval.ms", "1000")
        .set("fetch.wait.max.ms", millis(options.fetch_wait).to_string())
        .set("enable.partition.eof", "false");
    config
}

impl Drop for Member {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.lock().take() {
            let _ = stop.send(());
        }
    }
}

impl Member {
    /// Writes `message` to the group's dead-letter topic.
    async fn dead_letter(&self, message: Message, deliveries: u32) -> Result<(), BrokerError> {
        let topic = names::dead_letter_topic(&self.name.0, &self.name.1);
        let mut letter = message.with_header(DEAD_LETTER_GROUP, self.name.1.clone());
        letter = letter.with_header(DEAD_LETTER_DELIVERIES, deliveries.to_string());
        self.inner.ensure_topic(&self.inner.kafka(&topic)).await?;
        letter.topic = topic;
        self.inner.send(std::slice::from_ref(&letter)).await
    }
}

/// Moves fetched records into `held`, stores settled offsets, and pauses
/// the partitions while the member holds too much, until told to stop;
/// then closes the consumer (which commits and leaves the group) off the
/// runtime, as closing blocks.
async fn fetch(
    consumer: Arc<MemberConsumer>,
    held: Arc<Held>,
    (topic, keel_topic): (String, String),
    options: crate::KafkaBrokerOptions,
    (mut stopped, left): (oneshot::Receiver<()>, watch::Sender<bool>),
) {
    let mut tick =
        tokio::time::interval((options.commit_interval / 2).max(Duration::from_millis(5)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut paused = false;
    loop {
        tokio::select! {
            _ = &mut stopped => break,
            record = consumer.recv() => match record {
                Ok(record) => take_arrived(&consumer, &held, record, &keel_topic),
                Err(error) => {
                    tracing::warn!(%topic, %error, "fetching from Kafka failed; retrying");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            _ = tick.tick() => store_advanced(consumer.as_ref(), &held, &topic),
        }
        paused = backpressure(&consumer, held.len(), options.max_held, paused);
    }
    store_advanced(consumer.as_ref(), &held, &topic);
    let _ = tokio::task::spawn_blocking(move || drop(consumer)).await;
    let _ = left.send(true);
}

/// The most records taken in one burst before the receivers are woken.
const BURST: usize = 256;

/// Takes `first` and the records already fetched behind it (up to
/// [`BURST`]), then wakes the receivers once: a burst becomes one batch,
/// not a wake-up per record.
fn take_arrived(
    consumer: &MemberConsumer,
    held: &Held,
    first: BorrowedMessage<'_>,
    keel_topic: &str,
) {
    use rdkafka::Message as _;
    let mut next = Some(first);
    let mut taken = 0;
    while let Some(record) = next.take() {
        let mut arrived = envelope::arrived(&record);
        arrived.message.topic = keel_topic.to_owned();
        held.take((record.partition(), record.offset()), arrived);
        taken += 1;
        if taken < BURST {
            next = consumer.recv().now_or_never().and_then(Result::ok);
        }
    }
    held.changed.notify_waiters();
}

/// Pauses the assignment once `held` reaches `max`, resumes it below half.
fn backpressure(consumer: &MemberConsumer, held: usize, max: usize, paused: bool) -> bool {
    let wanted = if paused { held >= max / 2 } else { held >= max };
    if wanted == paused {
        return paused;
    }
    let Ok(assignment) = consumer.assignment() else {
        return paused;
    };
    let outcome = if wanted {
        consumer.pause(&assignment)
    } else {
        consumer.resume(&assignment)
    };
    match outcome {
        Ok(()) => wanted,
        Err(_) => paused,
    }
}

/// A subscription: a handle on its group's member.
pub(crate) struct MemberSubscription {
    member: Arc<Member>,
    inner: Arc<Inner>,
    name: GroupName,
    lease: Duration,
}

impl MemberSubscription {
    pub(crate) fn new(
        member: Arc<Member>,
        inner: Arc<Inner>,
        name: GroupName,
        lease: Duration,
    ) -> Self {
        Self {
            member,
            inner,
            name,
            lease,
        }
    }
}

#[async_trait]
impl Subscription for MemberSubscription {
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>, BrokerError> {
        let deadline = clock::now() + wait;
        let member = Arc::downgrade(&self.member);
        loop {
            self.inner.read(&self.name);
            let changed = self.member.held.changed.notified();
            let (deliveries, next_wake) =
                self.member.held.lease(max, self.lease, |place, lease| {
                    Box::new(Settle {
                        member: member.clone(),
                        place,
                        lease,
                    })
                });
            if !deliveries.is_empty() {
                return Ok(deliveries);
            }
            if clock::now() >= deadline {
                return Ok(Vec::new());
            }
            let until = next_wake.map_or(deadline, |wake| wake.min(deadline));
            let _ = tokio::time::timeout_at(until, changed).await;
        }
    }
}

/// Settles one leased delivery through its member.
struct Settle {
    member: Weak<Member>,
    place: Place,
    lease: u64,
}

impl Settle {
    fn member(&self) -> Result<Arc<Member>, BrokerError> {
        self.member.upgrade().ok_or(BrokerError::LeaseLost)
    }
}

#[async_trait]
impl DeliveryControl for Settle {
    async fn ack(&self) -> Result<(), BrokerError> {
        let held = &self.member()?.held;
        held.settle(self.place, self.lease, |entry, _| drop(entry.done()))
    }

    async fn nack(&self, delay: Duration) -> Result<(), BrokerError> {
        let held = &self.member()?.held;
        held.settle(self.place, self.lease, |entry, now| {
            entry.release(now + delay)
        })
    }

    async fn extend(&self, lease: Duration) -> Result<(), BrokerError> {
        let held = &self.member()?.held;
        held.settle(self.place, self.lease, |entry, now| {
            entry.extend(now + lease)
        })
    }

    /// Written to the group's dead-letter topic, then settled: a record
    /// whose dead letter was not acknowledged stays held.
    async fn terminate(&self) -> Result<(), BrokerError> {
        let member = self.member()?;
        let (message, deliveries) = member.held.message(self.place, self.lease)?;
        member.dead_letter(message, deliveries).await?;
        member
            .held
            .settle(self.place, self.lease, |entry, _| drop(entry.done()))
    }
}
