//! The in-memory broker: per-group queues, redelivery, refusals on demand.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use keel_core::clock::{self, Instant};
use parking_lot::Mutex;

use crate::broker::{
    Backlog, Broker, BrokerError, Delivery, DeliveryControl, Message, SubscribeOptions,
    Subscription,
};

#[derive(Debug, Clone)]
struct Entry {
    visible_at: Instant,
    lease: Option<(u64, Instant)>,
    count: u32,
    done: bool,
}

/// A consumer group: its lease, where it is in the topic's log, and (for
/// an expiring group) when a member last read.
#[derive(Debug)]
struct Group {
    lease: Duration,
    entries: Vec<Entry>,
    expire_after_idle: Option<Duration>,
    last_read: Instant,
}

impl Group {
    fn idle_too_long(&self, now: Instant) -> bool {
        self.expire_after_idle
            .is_some_and(|idle| now.saturating_duration_since(self.last_read) >= idle)
    }
}

#[derive(Debug, Default)]
struct BrokerState {
    logs: HashMap<String, Vec<Message>>,
    seen: HashSet<(String, String)>,
    /// When each (topic, message id) was first stored.
    received_at: HashMap<(String, String), chrono::DateTime<chrono::Utc>>,
    groups: HashMap<(String, String), Group>,
    /// Topics first made by an expiring group's subscription: they go when
    /// their last group goes.
    expiring_topics: HashSet<String>,
    publish_calls: HashMap<String, u32>,
    batches: u32,
    next_token: u64,
    extensions: u32,
}

/// A broker with per-key order, leases and redelivery, on tokio's clock.
#[derive(Debug, Clone, Default)]
pub(crate) struct MemBroker {
    state: Arc<Mutex<BrokerState>>,
    fail_publishes: Arc<AtomicU32>,
    refuse: Arc<Mutex<Refusals>>,
}

/// What a [`MemBroker`] refuses for good.
#[derive(Debug, Default)]
struct Refusals {
    /// In `publish`: a batch holding one of these keys is refused whole
    /// (nothing after the refused message is stored).
    keys_on_publish: HashSet<String>,
    /// In `validate` (and so in `publish` too).
    keys_on_validate: HashSet<String>,
}

impl MemBroker {
    /// Lease extensions granted so far.
    pub(crate) fn extensions(&self) -> u32 {
        self.state.lock().extensions
    }

    /// Every lease held now is lost, as if it had expired unnoticed: its
    /// holder's next ack, nack or extension fails with `LeaseLost`.
    pub(crate) fn lose_leases(&self) {
        for group in self.state.lock().groups.values_mut() {
            for entry in &mut group.entries {
                entry.lease = None;
            }
        }
    }

    /// Every message with `key` is refused by `publish` (not by
    /// `validate`) with `Invalid`, like a broker that finds out only when
    /// it tries; the messages before it in the batch are stored.
    pub(crate) fn refuse_key_on_publish(&self, key: &str) {
        self.refuse.lock().keys_on_publish.insert(key.to_owned());
    }

    /// Every message with `key` is refused by `validate` with `Invalid`.
    pub(crate) fn refuse_key_on_validate(&self, key: &str) {
        self.refuse.lock().keys_on_validate.insert(key.to_owned());
    }

    /// Refuses nothing any more.
    pub(crate) fn allow_all(&self) {
        let mut refuse = self.refuse.lock();
        refuse.keys_on_publish.clear();
        refuse.keys_on_validate.clear();
    }

    /// How many publish calls were made, batches and single rows alike.
    pub(crate) fn publish_batches(&self) -> u32 {
        self.state.lock().batches
    }

    /// The next `n` publish calls fail with `Unavailable`.
    pub(crate) fn fail_next_publishes(&self, n: u32) {
        self.fail_publishes.store(n, Ordering::SeqCst);
    }

    /// How many times a message id was passed to `publish` (dupes included).
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    pub(crate) fn publish_calls(&self, id: &str) -> u32 {
        self.state
            .lock()
            .publish_calls
            .get(id)
            .copied()
            .unwrap_or(0)
    }

    /// The messages stored on `topic`, in order.
    pub(crate) fn log(&self, topic: &str) -> Vec<Message> {
        self.state
            .lock()
            .logs
            .get(topic)
            .cloned()
            .unwrap_or_default()
    }

    /// Delivery counts of `topic`'s messages for `group`, in log order.
    pub(crate) fn delivery_counts(&self, topic: &str, group: &str) -> Vec<u32> {
        self.state
            .lock()
            .groups
            .get(&(topic.to_owned(), group.to_owned()))
            .map(|g| g.entries.iter().map(|e| e.count).collect())
            .unwrap_or_default()
    }

    /// Whether every message on `topic` is settled for `group`.
    pub(crate) fn all_done(&self, topic: &str, group: &str) -> bool {
        let s = self.state.lock();
        let len = s.logs.get(topic).map_or(0, Vec::len);
        s.groups
            .get(&(topic.to_owned(), group.to_owned()))
            .is_some_and(|g| g.entries.len() == len && g.entries.iter().all(|e| e.done))
    }
}

#[async_trait]
impl Broker for MemBroker {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        let failing = self
            .fail_publishes
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if failing {
            return Err(BrokerError::Unavailable("injected publish failure".into()));
        }
        let mut s = self.state.lock();
        s.batches += 1;
        for m in messages {
            self.validate(m)?;
            if self.refuse.lock().keys_on_publish.contains(&m.key) {
                return Err(BrokerError::Invalid(format!("key {:?} refused", m.key)));
            }
            *s.publish_calls.entry(m.id.clone()).or_default() += 1;
            if s.seen.insert((m.topic.clone(), m.id.clone())) {
                s.logs.entry(m.topic.clone()).or_default().push(m.clone());
                s.received_at
                    .insert((m.topic.clone(), m.id.clone()), keel_core::clock::utc_now());
            }
        }
        Ok(())
    }

    fn validate(&self, message: &Message) -> Result<(), BrokerError> {
        if self.refuse.lock().keys_on_validate.contains(&message.key) {
            return Err(BrokerError::Invalid(format!(
                "key {:?} can never be published",
                message.key
            )));
        }
        Ok(())
    }

    /// The log is kept until its topic goes.
    fn retention(&self) -> crate::broker::MessageRetention {
        crate::broker::MessageRetention::Forever
    }

    async fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        let mut s = self.state.lock();
        let new_topic = !s.logs.contains_key(&options.topic)
            && !s.groups.keys().any(|(topic, _)| *topic == options.topic);
        if new_topic && options.expire_after_idle.is_some() {
            s.expiring_topics.insert(options.topic.clone());
        }
        s.groups
            .entry((options.topic.clone(), options.group.clone()))
            .or_insert_with(|| Group {
                lease: options.lease,
                entries: Vec::new(),
                expire_after_idle: options.expire_after_idle,
                last_read: clock::now(),
            });
        drop(s);
        Ok(Box::new(MemSubscription {
            state: Arc::clone(&self.state),
            topic: options.topic,
            group: options.group,
        }))
    }

    async fn backlog(&self, topic: &str, group: &str) -> Result<Option<Backlog>, BrokerError> {
        let s = self.state.lock();
        let Some(group) = s.groups.get(&(topic.to_owned(), group.to_owned())) else {
            return Ok(None);
        };
        let now = clock::now();
        let logged = s.logs.get(topic).map_or(0, Vec::len);
        let undelivered = logged.saturating_sub(group.entries.len()) as u64;
        let unfinished = group.entries.iter().filter(|e| !e.done);
        let in_flight = unfinished
            .clone()
            .filter(|e| e.lease.is_some_and(|(_, until)| until > now))
            .count() as u64;
        let waiting = unfinished.count() as u64 - in_flight + undelivered;
        Ok(Some(Backlog { waiting, in_flight }))
    }

    async fn remove_group(&self, topic: &str, group: &str) -> Result<(), BrokerError> {
        let mut s = self.state.lock();
        s.groups.remove(&(topic.to_owned(), group.to_owned()));
        s.drop_topic_if_abandoned(topic);
        Ok(())
    }

    async fn sweep_expired(&self) -> Result<u64, BrokerError> {
        let now = clock::now();
        let mut s = self.state.lock();
        let idle: Vec<(String, String)> = s
            .groups
            .iter()
            .filter(|(_, group)| group.idle_too_long(now))
            .map(|(key, _)| key.clone())
            .collect();
        for key in &idle {
            s.groups.remove(key);
        }
        let topics: Vec<String> = s.expiring_topics.iter().cloned().collect();
        let dropped = topics
            .iter()
            .filter(|topic| s.drop_topic_if_abandoned(topic))
            .count();
        Ok((idle.len() + dropped) as u64)
    }
}

impl BrokerState {
    /// Deletes `topic` with its messages if an expiring group made it and
    /// no group is left; whether it did.
    fn drop_topic_if_abandoned(&mut self, topic: &str) -> bool {
        let abandoned =
            self.expiring_topics.contains(topic) && !self.groups.keys().any(|(t, _)| t == topic);
        if abandoned {
            self.expiring_topics.remove(topic);
            self.logs.remove(topic);
            self.seen.retain(|(t, _)| t != topic);
        }
        abandoned
    }
}

struct MemSubscription {
    state: Arc<Mutex<BrokerState>>,
    topic: String,
    group: String,
}

impl MemSubscription {
    fn take(&self, max: usize) -> Vec<Delivery> {
        let now = clock::now();
        let mut s = self.state.lock();
        let log = s.logs.get(&self.topic).cloned().unwrap_or_default();
        let received: Vec<_> = log
            .iter()
            .map(|m| {
                s.received_at
                    .get(&(self.topic.clone(), m.id.clone()))
                    .copied()
            })
            .collect();
        let mut token = s.next_token;
        let Some(group) = s.groups.get_mut(&(self.topic.clone(), self.group.clone())) else {
            return Vec::new();
        };
        group.last_read = now;
        let (lease, entries) = (group.lease, &mut group.entries);
        while entries.len() < log.len() {
            entries.push(Entry {
                visible_at: now,
                lease: None,
                count: 0,
                done: false,
            });
        }
        let mut blocked = HashSet::new();
        let mut out = Vec::new();
        for (index, (entry, msg)) in entries.iter_mut().zip(&log).enumerate() {
            if entry.done || !blocked.insert(msg.key.clone()) {
                continue;
            }
            let free = entry.lease.is_none_or(|(_, until)| until <= now);
            if out.len() < max && free && entry.visible_at <= now {
                token += 1;
                entry.lease = Some((token, now + lease));
                entry.count += 1;
                let control = MemControl {
                    state: Arc::clone(&self.state),
                    key: (self.topic.clone(), self.group.clone()),
                    index,
                    token,
                };
                let delivery = Delivery::new(msg.clone(), entry.count, Box::new(control));
                out.push(match received.get(index).copied().flatten() {
                    Some(at) => delivery.with_received_at(at),
                    None => delivery,
                });
            }
        }
        s.next_token = token;
        out
    }
}

#[async_trait]
impl Subscription for MemSubscription {
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>, BrokerError> {
        let until = clock::now() + wait;
        loop {
            let batch = self.take(max);
            if !batch.is_empty() || clock::now() >= until {
                return Ok(batch);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

struct MemControl {
    state: Arc<Mutex<BrokerState>>,
    key: (String, String),
    index: usize,
    token: u64,
}

impl MemControl {
    fn with_entry(&self, f: impl FnOnce(&mut Entry, Duration, Instant)) -> Result<(), BrokerError> {
        let mut s = self.state.lock();
        let group = s.groups.get_mut(&self.key).ok_or(BrokerError::LeaseLost)?;
        let lease = group.lease;
        let entry = group
            .entries
            .get_mut(self.index)
            .ok_or(BrokerError::LeaseLost)?;
        if entry.done || entry.lease.map(|(t, _)| t) != Some(self.token) {
            return Err(BrokerError::LeaseLost);
        }
        f(entry, lease, clock::now());
        Ok(())
    }
}

#[async_trait]
impl DeliveryControl for MemControl {
    async fn ack(&self) -> Result<(), BrokerError> {
        self.with_entry(|e, _, _| e.done = true)
    }

    async fn nack(&self, delay: Duration) -> Result<(), BrokerError> {
        self.with_entry(|e, _, now| {
            e.lease = None;
            e.visible_at = now + delay;
        })
    }

    async fn extend(&self, lease: Duration) -> Result<(), BrokerError> {
        self.with_entry(|e, _, now| {
            if let Some((token, _)) = e.lease {
                e.lease = Some((token, now + lease));
            }
        })?;
        self.state.lock().extensions += 1;
        Ok(())
    }

    async fn terminate(&self) -> Result<(), BrokerError> {
        self.with_entry(|e, _, _| e.done = true)
    }
}

// Checked by the same suite as the SQLite and NATS brokers.
keel_testkit::broker_conformance_tests!(async { MemBroker::default() });
