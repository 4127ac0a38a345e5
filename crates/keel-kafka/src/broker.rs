//! [`KafkaBroker`]: the [`Broker`] contract over Kafka.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Weak};
use std::time::Duration;

use async_trait::async_trait;
use keel_core::clock::{self, Instant};
use keel_store::broker::{
    Backlog, Broker, BrokerError, GroupStart, Message, MessageRetention, SubscribeOptions,
    Subscription,
};
use parking_lot::Mutex;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::error::RDKafkaErrorCode;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer as _};

use crate::envelope;
use crate::error::{broker_error, task_failed};
use crate::log::ClientLog;
use crate::member::{Member, MemberSubscription};
use crate::names::{self, check_group, check_topic};
use crate::offsets;
use crate::options::KafkaBrokerOptions;

/// A topic and a group.
pub(crate) type GroupName = (String, String);

/// Keel's [`Broker`] on Kafka; see the crate docs for the mapping.
#[derive(Clone)]
pub struct KafkaBroker {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for KafkaBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaBroker")
            .field("bootstrap", &self.inner.options.bootstrap)
            .finish_non_exhaustive()
    }
}

pub(crate) struct Inner {
    pub(crate) options: KafkaBrokerOptions,
    pub(crate) producer: FutureProducer<ClientLog>,
    admin: AdminClient<ClientLog>,
    created_topics: Mutex<HashSet<String>>,
    members: Mutex<HashMap<GroupName, Weak<Member>>>,
    /// Per group, held while its member joins, so that two subscriptions
    /// of one group at once share one member (and other groups' joins go
    /// on meanwhile).
    joining: Mutex<HashMap<GroupName, Arc<tokio::sync::Mutex<()>>>>,
    /// Groups this process subscribed and did not remove: they exist even
    /// before they committed an offset.
    known_groups: Mutex<HashSet<GroupName>>,
    expiring: Mutex<HashMap<GroupName, Expiring>>,
    expiring_topics: Mutex<HashSet<String>>,
}

/// An expiring group's expiry and last read.
struct Expiring {
    idle: Duration,
    last_read: Instant,
}

impl KafkaBroker {
    /// Connects to the cluster `options` names: fails unless a broker
    /// answers a metadata request within the request timeout.
    pub async fn connect(options: KafkaBrokerOptions) -> Result<Self, BrokerError> {
        let producer = producer_config(&options)
            .create_with_context(ClientLog)
            .map_err(broker_error)?;
        let admin = client_config(&options)
            .create_with_context(ClientLog)
            .map_err(broker_error)?;
        let broker = Self {
            inner: Arc::new(Inner {
                options,
                producer,
                admin,
                created_topics: Mutex::new(HashSet::new()),
                members: Mutex::new(HashMap::new()),
                joining: Mutex::new(HashMap::new()),
                known_groups: Mutex::new(HashSet::new()),
                expiring: Mutex::new(HashMap::new()),
                expiring_topics: Mutex::new(HashSet::new()),
            }),
        };
        broker.ping().await?;
        Ok(broker)
    }
}

/// The settings every client shares: the servers and the user's own.
pub(crate) fn client_config(options: &KafkaBrokerOptions) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &options.bootstrap);
    for (name, value) in &options.extra {
        config.set(name, value);
    }
    config.set(
        "socket.timeout.ms",
        millis(options.request_timeout).to_string(),
    );
    config
}

/// An idempotent producer answering only once every in-sync replica has a
/// message, partitioning keys as Java clients do.
fn producer_config(options: &KafkaBrokerOptions) -> ClientConfig {
    let mut config = client_config(options);
    config
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("partitioner", "murmur2_random")
        .set("linger.ms", "1")
        .set(
            "message.timeout.ms",
            millis(options.publish_timeout).to_string(),
        )
        .set(
            "message.max.bytes",
            (options.max_message_bytes + (64 << 10)).to_string(),
        );
    config
}

pub(crate) fn millis(duration: Duration) -> u128 {
    duration.as_millis().max(1)
}

impl Inner {
    /// The Kafka topic of Keel's `topic`: itself, or under the prefix.
    pub(crate) fn kafka(&self, topic: &str) -> String {
        match self.options.prefix.as_str() {
            "" => topic.to_owned(),
            prefix => format!("{prefix}.{topic}"),
        }
    }

    /// Creates the Kafka topic `topic` unless this process knows it exists.
    pub(crate) async fn ensure_topic(&self, topic: &str) -> Result<(), BrokerError> {
        if self.created_topics.lock().contains(topic) {
            return Ok(());
        }
        let partitions = self.options.partitions;
        let retention = millis(self.options.retention).to_string();
        let new = NewTopic::new(
            topic,
            partitions,
            TopicReplication::Fixed(self.options.replication),
        )
        .set("retention.ms", &retention);
        let admin_options =
            AdminOptions::new().operation_timeout(Some(self.options.request_timeout));
        let results = self
            .admin
            .create_topics([&new], &admin_options)
            .await
            .map_err(broker_error)?;
        for result in results {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
                Err((name, code)) => {
                    return Err(BrokerError::Unavailable(
                        format!("creating topic {name}: {code}").into(),
                    ));
                }
            }
        }
        self.created_topics.lock().insert(topic.to_owned());
        Ok(())
    }

    /// Deletes `topic` (a topic already gone is not an error).
    async fn delete_topic(&self, topic: &str) -> Result<(), BrokerError> {
        self.created_topics.lock().remove(topic);
        let admin_options =
            AdminOptions::new().operation_timeout(Some(self.options.request_timeout));
        let results = self
            .admin
            .delete_topics(&[topic], &admin_options)
            .await
            .map_err(broker_error)?;
        for result in results {
            match result {
                Ok(_) | Err((_, RDKafkaErrorCode::UnknownTopicOrPartition)) => {}
                Err((name, code)) => {
                    return Err(BrokerError::Unavailable(
                        format!("deleting topic {name}: {code}").into(),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Deletes a Kafka consumer group, waiting (within the request
    /// timeout) for members still leaving it.
    async fn delete_group(&self, group_id: &str) -> Result<(), BrokerError> {
        let admin_options =
            AdminOptions::new().operation_timeout(Some(self.options.request_timeout));
        let deadline = clock::now() + self.options.request_timeout;
        loop {
            let results = self
                .admin
                .delete_groups(&[group_id], &admin_options)
                .await
                .map_err(broker_error)?;
            match results.into_iter().next() {
                None | Some(Ok(_)) | Some(Err((_, RDKafkaErrorCode::GroupIdNotFound))) => {
                    return Ok(());
                }
                Some(Err((_, RDKafkaErrorCode::NonEmptyGroup))) if clock::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Some(Err((name, code))) => {
                    return Err(BrokerError::Unavailable(
                        format!("deleting consumer group {name}: {code}").into(),
                    ));
                }
            }
        }
    }

    /// The live member of `name` in this process, if any.
    fn member(&self, name: &GroupName) -> Option<Arc<Member>> {
        self.members.lock().get(name).and_then(Weak::upgrade)
    }

    /// Records a read of an expiring group.
    pub(crate) fn read(&self, name: &GroupName) {
        if let Some(expiring) = self.expiring.lock().get_mut(name) {
            expiring.last_read = clock::now();
        }
    }

    /// Publishes `messages` in order: every one is handed to the producer
    /// before the first acknowledgement is awaited, so a batch costs one
    /// round trip per partition, not one per message.
    pub(crate) async fn send(&self, messages: &[Message]) -> Result<(), BrokerError> {
        let now = clock::utc_now().timestamp_millis();
        let mut acks = Vec::with_capacity(messages.len());
        for message in messages {
            let topic = self.kafka(&message.topic);
            let record = FutureRecord::to(&topic)
                .key(message.key.as_bytes())
                .payload(message.payload.as_ref())
                .headers(envelope::headers(message))
                .timestamp(now);
            match self.producer.send_result(record) {
                Ok(ack) => acks.push(ack),
                Err((error, _)) => {
                    // What was handed over may still be stored.
                    for ack in acks {
                        let _ = ack.await;
                    }
                    return Err(broker_error(error));
                }
            }
        }
        let mut outcome = Ok(());
        for ack in acks {
            let result = match ack.await {
                Ok(Ok(_)) => Ok(()),
                Ok(Err((error, _))) => Err(broker_error(error)),
                Err(canceled) => Err(BrokerError::OutcomeUnknown(Box::new(canceled))),
            };
            if outcome.is_ok() {
                outcome = result;
            }
        }
        outcome
    }
}

#[async_trait]
impl Broker for KafkaBroker {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        for message in messages {
            self.validate(message)?;
        }
        let topics: HashSet<&str> = messages.iter().map(|m| m.topic.as_str()).collect();
        for topic in topics {
            self.inner.ensure_topic(&self.inner.kafka(topic)).await?;
        }
        self.inner.send(messages).await
    }

    fn validate(&self, message: &Message) -> Result<(), BrokerError> {
        check_topic(&self.inner.kafka(&message.topic))?;
        let size = envelope::size(message);
        if size > self.inner.options.max_message_bytes {
            return Err(BrokerError::Invalid(format!(
                "message {} is {size} bytes; the limit is {}",
                message.id, self.inner.options.max_message_bytes
            )));
        }
        Ok(())
    }

    fn retention(&self) -> MessageRetention {
        MessageRetention::For(self.inner.options.retention)
    }

    fn group_start(&self) -> GroupStart {
        GroupStart::OldestRetained
    }

    async fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        let kafka_topic = self.inner.kafka(&options.topic);
        check_group(&kafka_topic, &options.group)?;
        let name: GroupName = (options.topic.clone(), options.group.clone());
        self.inner.ensure_topic(&kafka_topic).await?;
        if let Some(idle) = options.expire_after_idle {
            self.inner
                .expiring_topics
                .lock()
                .insert(options.topic.clone());
            self.inner.expiring.lock().insert(
                name.clone(),
                Expiring {
                    idle,
                    last_read: clock::now(),
                },
            );
        }
        self.inner.known_groups.lock().insert(name.clone());
        let joining = self
            .inner
            .joining
            .lock()
            .entry(name.clone())
            .or_default()
            .clone();
        let _joining = joining.lock().await;
        let member = match self.inner.member(&name) {
            Some(member) => member,
            None => {
                let member = Member::join(self.inner.clone(), &name).await?;
                self.inner
                    .members
                    .lock()
                    .insert(name.clone(), Arc::downgrade(&member));
                member
            }
        };
        Ok(Box::new(MemberSubscription::new(
            member,
            self.inner.clone(),
            name,
            options.lease,
        )))
    }

    async fn ping(&self) -> Result<(), BrokerError> {
        let client = self.inner.producer.clone();
        let timeout = self.inner.options.request_timeout;
        tokio::task::spawn_blocking(move || {
            client
                .client()
                .fetch_metadata(None, timeout)
                .map(drop)
                .map_err(broker_error)
        })
        .await
        .map_err(task_failed)?
    }

    async fn sweep_expired(&self) -> Result<u64, BrokerError> {
        let idle: Vec<GroupName> = {
            let expiring = self.inner.expiring.lock();
            expiring
                .iter()
                .filter(|(_, e)| e.last_read.elapsed() >= e.idle)
                .map(|(name, _)| name.clone())
                .collect()
        };
        let mut deleted = 0;
        for name in idle {
            if self.inner.member(&name).is_some() {
                continue;
            }
            deleted += self.remove(&name.0, &name.1).await?;
        }
        Ok(deleted)
    }

    async fn remove_group(&self, topic: &str, group: &str) -> Result<(), BrokerError> {
        self.remove(topic, group).await.map(drop)
    }

    async fn backlog(&self, topic: &str, group: &str) -> Result<Option<Backlog>, BrokerError> {
        let kafka_topic = self.inner.kafka(topic);
        check_group(&kafka_topic, group)?;
        let name: GroupName = (topic.to_owned(), group.to_owned());
        let known = self.inner.known_groups.lock().contains(&name);
        let member = self.inner.member(&name);
        let lag = offsets::lag(&self.inner, &kafka_topic, group, member.clone()).await?;
        let total = match lag {
            Some(lag) if lag.committed || known => lag.total,
            _ if known => 0,
            _ => return Ok(None),
        };
        let in_flight = member.map_or(0, |m| m.in_flight()).min(total);
        Ok(Some(Backlog {
            waiting: total - in_flight,
            in_flight,
        }))
    }
}

impl KafkaBroker {
    /// Deletes a group (and its expiring topic once no group of this
    /// process is left on it); how many groups and topics went.
    async fn remove(&self, topic: &str, group: &str) -> Result<u64, BrokerError> {
        let name: GroupName = (topic.to_owned(), group.to_owned());
        let member = self
            .inner
            .members
            .lock()
            .remove(&name)
            .and_then(|member| member.upgrade());
        if let Some(member) = member {
            member.leave().await;
        }
        self.inner
            .delete_group(&names::group_id(&self.inner.kafka(topic), group))
            .await?;
        self.inner.known_groups.lock().remove(&name);
        self.inner.expiring.lock().remove(&name);
        self.inner.joining.lock().remove(&name);
        let mut deleted = 1;
        let last_on_topic = !self
            .inner
            .known_groups
            .lock()
            .iter()
            .any(|(t, _)| t == topic);
        if last_on_topic
            && self.inner.expiring_topics.lock().remove(topic)
            && self.inner.options.delete_topics
        {
            self.inner.delete_topic(&self.inner.kafka(topic)).await?;
            deleted += 1;
        }
        Ok(deleted)
    }
}
