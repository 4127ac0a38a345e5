//! [`RabbitBroker`]: the [`Broker`] contract over RabbitMQ.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use async_trait::async_trait;
use futures_util::future::try_join_all;
use keel_store::broker::{
    Backlog, Broker, BrokerError, GroupStart, Message, MessageRetention, SubscribeOptions,
    Subscription, header,
};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, ExchangeDeleteOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};
use parking_lot::Mutex;

use crate::envelope;
use crate::error::{Within, bounded, broker_error, is_not_found};
use crate::link::Link;
use crate::names::{Names, shard_of};
use crate::options::RabbitBrokerOptions;
use crate::reply::DIRECT_REPLY_TO;
use crate::subscription::{Held, RabbitSubscription};

/// The exchange argument recording a topic's shard count, so a process
/// configured otherwise is refused instead of scattering keys.
const SHARDS_ARGUMENT: &str = "x-keel-shards";

/// A topic and a group.
type GroupName = (String, String);

/// Keel's [`Broker`] on RabbitMQ; see the crate docs for the mapping.
#[derive(Debug, Clone)]
pub struct RabbitBroker {
    inner: Arc<Inner>,
}

#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) options: RabbitBrokerOptions,
    pub(crate) names: Names,
    pub(crate) link: Link,
    publisher: tokio::sync::Mutex<Option<Channel>>,
    declared_topics: Mutex<HashSet<String>>,
    expiring_topics: Mutex<HashSet<String>>,
    pub(crate) counts: Mutex<HashMap<GroupName, Vec<std::sync::Weak<Held>>>>,
}

impl RabbitBroker {
    /// Connects to the server `options` names.
    pub async fn connect(options: RabbitBrokerOptions) -> Result<Self, BrokerError> {
        let broker = Self {
            inner: Arc::new(Inner {
                names: Names::new(&options.prefix),
                link: Link::new(options.url.clone()),
                options,
                publisher: tokio::sync::Mutex::new(None),
                declared_topics: Mutex::new(HashSet::new()),
                expiring_topics: Mutex::new(HashSet::new()),
                counts: Mutex::new(HashMap::new()),
            }),
        };
        broker.inner.link.connection().await?;
        Ok(broker)
    }

    /// What a [`RabbitRequester`](crate::RabbitRequester) shares with its broker.
    pub(crate) fn inner(&self) -> Arc<Inner> {
        self.inner.clone()
    }
}

impl Inner {
    /// Declares `topic`'s exchange on `channel` unless this process did
    /// since its publisher channel last opened: publishes and requests
    /// share what they declared.
    pub(crate) async fn ensure_topic(
        &self,
        channel: &Channel,
        topic: &str,
    ) -> Result<(), BrokerError> {
        if !self.declared_topics.lock().contains(topic) {
            self.declare_topic(channel, topic).await?;
            self.declared_topics.lock().insert(topic.to_owned());
        }
        Ok(())
    }

    async fn declare_topic(&self, channel: &Channel, topic: &str) -> Result<(), BrokerError> {
        let mut arguments = FieldTable::default();
        arguments.insert(
            SHARDS_ARGUMENT.into(),
            AMQPValue::LongInt(i32::from(self.options.shards)),
        );
        declare_exchange(channel, &self.names.exchange(topic), arguments).await
    }

    pub(crate) async fn declare_group(
        &self,
        options: &SubscribeOptions,
    ) -> Result<(), BrokerError> {
        let (topic, group) = (&options.topic, &options.group);
        self.names.check(topic, group)?;
        let channel = self.link.channel().await?;
        self.declare_topic(&channel, topic).await?;
        let expires = options.expire_after_idle;
        if expires.is_some() {
            self.expiring_topics.lock().insert(topic.clone());
        } else {
            self.declare_dead_letters(&channel, topic, group).await?;
        }
        for shard in 0..self.options.shards {
            let queue = self.names.queue(topic, group, shard);
            let mut arguments = FieldTable::default();
            arguments.insert("x-queue-type".into(), text("quorum"));
            arguments.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
            match expires {
                Some(idle) => {
                    let millis = idle.as_millis().clamp(1, i32::MAX as u128) as i32;
                    arguments.insert("x-expires".into(), AMQPValue::LongInt(millis));
                }
                None => {
                    let limit = self.options.delivery_limit.min(i32::MAX as u32) as i32;
                    arguments.insert("x-delivery-limit".into(), AMQPValue::LongInt(limit));
                    arguments.insert(
                        "x-dead-letter-exchange".into(),
                        text(&self.names.dead_exchange()),
                    );
                    arguments.insert(
                        "x-dead-letter-routing-key".into(),
                        text(&self.names.dead_queue(topic, group)),
                    );
                    arguments.insert("x-dead-letter-strategy".into(), text("at-least-once"));
                    arguments.insert("x-overflow".into(), text("reject-publish"));
                }
            }
            let exchange = self.names.exchange(topic);
            declare_bound_queue(&channel, &queue, arguments, &exchange, &shard.to_string()).await?;
        }
        let _ = channel.close(200, "declared").await;
        Ok(())
    }

    async fn declare_dead_letters(
        &self,
        channel: &Channel,
        topic: &str,
        group: &str,
    ) -> Result<(), BrokerError> {
        let exchange = self.names.dead_exchange();
        let queue = self.names.dead_queue(topic, group);
        declare_exchange(channel, &exchange, FieldTable::default()).await?;
        let mut arguments = FieldTable::default();
        arguments.insert("x-queue-type".into(), text("quorum"));
        let ttl = self
            .options
            .dead_letter_ttl
            .as_millis()
            .clamp(1, i32::MAX as u128) as i32;
        arguments.insert("x-message-ttl".into(), AMQPValue::LongInt(ttl));
        declare_bound_queue(channel, &queue, arguments, &exchange, &queue).await
    }

    /// The confirm-mode channel publishes go through, opened on first use
    /// and again after it broke.
    async fn publisher(&self, slot: &mut Option<Channel>) -> Result<Channel, BrokerError> {
        if let Some(channel) = slot.as_ref()
            && channel.status().connected()
        {
            return Ok(channel.clone());
        }
        *slot = None;
        self.declared_topics.lock().clear();
        let channel = self.link.channel().await?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .within()
            .await?;
        *slot = Some(channel.clone());
        Ok(channel)
    }

    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        for message in messages {
            self.validate(message)?;
        }
        let mut slot = self.publisher.lock().await;
        let channel = self.publisher(&mut slot).await?;
        let topics = messages.iter().map(|m| &m.topic);
        for topic in topics
            .filter(|t| !is_direct_reply(t))
            .collect::<HashSet<_>>()
        {
            self.ensure_topic(&channel, topic).await?;
        }
        let mut confirms = Vec::with_capacity(messages.len());
        for message in messages {
            let (exchange, routing_key) = self.route(message);
            let sent = channel
                .basic_publish(
                    &exchange,
                    &routing_key,
                    BasicPublishOptions::default(),
                    &message.payload,
                    envelope::properties(message, keel_core::clock::utc_now()),
                )
                .await;
            match sent {
                Ok(confirm) => confirms.push(confirm),
                Err(error) if confirms.is_empty() => return Err(broker_error(error)),
                Err(error) => return Err(BrokerError::OutcomeUnknown(Box::new(error))),
            }
        }
        drop(slot);
        let confirmed = tokio::time::timeout(self.options.publish_timeout, try_join_all(confirms))
            .await
            .map_err(|elapsed| BrokerError::OutcomeUnknown(Box::new(elapsed)))
            .and_then(|confirmed| {
                confirmed.map_err(|error| BrokerError::OutcomeUnknown(Box::new(error)))
            });
        let confirmed = match confirmed {
            Ok(confirmed) => confirmed,
            Err(error) => {
                // Its confirms are in doubt: the next publish starts afresh.
                *self.publisher.lock().await = None;
                return Err(error);
            }
        };
        if confirmed.iter().any(|confirmation| confirmation.is_nack()) {
            return Err(BrokerError::Unavailable(
                "RabbitMQ refused to store a message (nack); publish again".into(),
            ));
        }
        Ok(())
    }

    /// The exchange and routing key `message` is published with: its
    /// topic's exchange and its key's shard, or, for a reply to a direct
    /// reply-to address, the default exchange and the address.
    pub(crate) fn route(&self, message: &Message) -> (String, String) {
        if is_direct_reply(&message.topic) {
            return (String::new(), message.topic.clone());
        }
        (
            self.names.exchange(&message.topic),
            shard_of(&message.key, self.options.shards).to_string(),
        )
    }

    pub(crate) fn validate(&self, message: &Message) -> Result<(), BrokerError> {
        if !is_direct_reply(&message.topic) {
            self.names.check_topic(&message.topic)?;
        }
        if message.payload.len() > self.options.max_message_bytes {
            return Err(BrokerError::Invalid(format!(
                "a payload of {} bytes is over the limit of {}",
                message.payload.len(),
                self.options.max_message_bytes
            )));
        }
        if message.id.len() > 255 {
            return Err(BrokerError::Invalid(
                "a message id is at most 255 bytes".into(),
            ));
        }
        for property in [header::REPLY_TO, header::CORRELATION_ID] {
            if message
                .header(property)
                .is_some_and(|value| value.len() > 255)
            {
                return Err(BrokerError::Invalid(format!(
                    "a {property} of over 255 bytes (an AMQP property) cannot be carried"
                )));
            }
        }
        if let Some(name) = message.headers.keys().find(|name| name.len() > 200) {
            return Err(BrokerError::Invalid(format!(
                "header name {name:?} is over 200 bytes"
            )));
        }
        Ok(())
    }

    /// Ready messages of each of the group's queues, `None` when it has none.
    async fn ready(&self, topic: &str, group: &str) -> Result<Option<u64>, BrokerError> {
        // A passive declare of a missing queue closes its channel; the
        // group's queues are declared together, so the first is enough.
        let channel = self.link.channel().await?;
        let mut ready = 0;
        for shard in 0..self.options.shards {
            let queue = self.names.queue(topic, group, shard);
            let passive = QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            };
            match bounded(channel.queue_declare(&queue, passive, FieldTable::default())).await? {
                Ok(queue) => ready += u64::from(queue.message_count()),
                Err(error) if is_not_found(&error) => return Ok(None),
                Err(error) => return Err(broker_error(error)),
            }
        }
        let _ = channel.close(200, "counted").await;
        Ok(Some(ready))
    }

    async fn remove_group(&self, topic: &str, group: &str) -> Result<(), BrokerError> {
        self.names.check(topic, group)?;
        let channel = self.link.channel().await?;
        for shard in 0..self.options.shards {
            channel
                .queue_delete(
                    &self.names.queue(topic, group, shard),
                    QueueDeleteOptions::default(),
                )
                .within()
                .await?;
        }
        channel
            .queue_delete(
                &self.names.dead_queue(topic, group),
                QueueDeleteOptions::default(),
            )
            .within()
            .await?;
        let _ = channel.close(200, "removed").await;
        self.delete_unused_topic(topic).await?;
        Ok(())
    }

    /// Deletes the topic's exchange if no queue is bound to it any more;
    /// true when it is gone.
    async fn delete_unused_topic(&self, topic: &str) -> Result<bool, BrokerError> {
        // Refusing to delete a used exchange closes the channel.
        let channel = self.link.channel().await?;
        let exchange = self.names.exchange(topic);
        let deleted = channel.exchange_delete(
            &exchange,
            ExchangeDeleteOptions {
                if_unused: true,
                ..ExchangeDeleteOptions::default()
            },
        );
        match bounded(deleted).await? {
            Ok(()) => {
                let _ = channel.close(200, "deleted").await;
                self.declared_topics.lock().remove(topic);
                Ok(true)
            }
            Err(error) if crate::error::soft_error(&error).is_some() => Ok(false),
            Err(error) => Err(broker_error(error)),
        }
    }

    fn local_counts(&self, topic: &str, group: &str) -> Backlog {
        let mut counts = self.counts.lock();
        let key = (topic.to_owned(), group.to_owned());
        let Some(members) = counts.get_mut(&key) else {
            return Backlog::default();
        };
        members.retain(|member| member.strong_count() > 0);
        let total = members.iter().filter_map(std::sync::Weak::upgrade).fold(
            Backlog::default(),
            |sum, member| {
                let local = member.backlog();
                Backlog {
                    waiting: sum.waiting + local.waiting,
                    in_flight: sum.in_flight + local.in_flight,
                }
            },
        );
        if members.is_empty() {
            counts.remove(&key);
        }
        total
    }
}

/// Whether `topic` is a direct reply-to address (`amq.rabbitmq.reply-to.…`,
/// RabbitMQ's rewrite of a request's `reply-to`), which a responder's reply
/// is published to instead of a topic.
pub(crate) fn is_direct_reply(topic: &str) -> bool {
    topic
        .strip_prefix(DIRECT_REPLY_TO)
        .is_some_and(|rest| rest.starts_with('.'))
}

/// Declares a durable direct exchange.
async fn declare_exchange(
    channel: &Channel,
    name: &str,
    arguments: FieldTable,
) -> Result<(), BrokerError> {
    let options = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    channel
        .exchange_declare(name, ExchangeKind::Direct, options, arguments)
        .within()
        .await
}

/// Declares a durable queue and binds it to `exchange` under `routing_key`.
async fn declare_bound_queue(
    channel: &Channel,
    queue: &str,
    arguments: FieldTable,
    exchange: &str,
    routing_key: &str,
) -> Result<(), BrokerError> {
    channel
        .queue_declare(queue, durable(), arguments)
        .within()
        .await?;
    channel
        .queue_bind(
            queue,
            exchange,
            routing_key,
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .within()
        .await
}

fn durable() -> QueueDeclareOptions {
    QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    }
}

fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(value.into())
}

#[async_trait]
impl Broker for RabbitBroker {
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        self.inner.publish(messages).await
    }

    fn validate(&self, message: &Message) -> Result<(), BrokerError> {
        self.inner.validate(message)
    }

    /// A message stays in each group's queue until that group settles it,
    /// however long that takes: nothing ages it out.
    fn retention(&self) -> MessageRetention {
        MessageRetention::Forever
    }

    fn group_start(&self) -> GroupStart {
        GroupStart::Creation
    }

    /// Creates the group's shard queues (and its dead-letter queue), bound
    /// to the topic's exchange.
    async fn declare_group(&self, options: &SubscribeOptions) -> Result<(), BrokerError> {
        self.inner.declare_group(options).await
    }

    async fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        self.inner.declare_group(&options).await?;
        let subscription = RabbitSubscription::open(self.inner.clone(), options).await?;
        Ok(Box::new(subscription))
    }

    async fn ping(&self) -> Result<(), BrokerError> {
        let channel = self.inner.link.channel().await?;
        channel.close(200, "ping").within().await
    }

    /// RabbitMQ deletes an idle expiring group's queues itself
    /// (`x-expires`); this deletes the exchanges of topics this process
    /// created for expiring groups once no queue is bound to them.
    async fn sweep_expired(&self) -> Result<u64, BrokerError> {
        let topics: Vec<String> = self.inner.expiring_topics.lock().iter().cloned().collect();
        let mut deleted = 0;
        for topic in topics {
            if self.inner.delete_unused_topic(&topic).await? {
                self.inner.expiring_topics.lock().remove(&topic);
                deleted += 1;
            }
        }
        Ok(deleted)
    }

    async fn remove_group(&self, topic: &str, group: &str) -> Result<(), BrokerError> {
        self.inner.remove_group(topic, group).await
    }

    /// Ready messages as RabbitMQ counts them, plus what this process's
    /// members hold: RabbitMQ does not tell an AMQP client how many
    /// deliveries other processes hold unsettled.
    async fn backlog(&self, topic: &str, group: &str) -> Result<Option<Backlog>, BrokerError> {
        let Some(ready) = self.inner.ready(topic, group).await? else {
            return Ok(None);
        };
        let local = self.inner.local_counts(topic, group);
        Ok(Some(Backlog {
            waiting: ready + local.waiting,
            in_flight: local.in_flight,
        }))
    }
}
