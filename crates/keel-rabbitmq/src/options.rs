//! [`RabbitBrokerOptions`]: how topics and groups map onto RabbitMQ.

use std::time::Duration;

/// Options of a [`RabbitBroker`](crate::RabbitBroker), with the defaults
/// [`new`](Self::new) documents.
#[derive(Debug, Clone)]
pub struct RabbitBrokerOptions {
    pub(crate) url: String,
    pub(crate) prefix: String,
    pub(crate) shards: u16,
    pub(crate) prefetch: u16,
    pub(crate) delivery_limit: u32,
    pub(crate) dedupe_window: Duration,
    pub(crate) dedupe_capacity: usize,
    pub(crate) dead_letter_ttl: Duration,
    pub(crate) publish_timeout: Duration,
    pub(crate) max_message_bytes: usize,
}

impl RabbitBrokerOptions {
    /// Options for the server at `url` (`amqp://user:pass@host:port/vhost`),
    /// with these defaults:
    ///
    /// - prefix `keel`: every exchange and queue name starts with it;
    /// - 8 shards per topic (see [`shards`](Self::shards));
    /// - a prefetch of 256 deliveries per shard and member;
    /// - a delivery limit of 20 returns (see [`delivery_limit`](Self::delivery_limit));
    /// - a dedupe window of 2 minutes and 100,000 ids per subscription;
    /// - dead letters kept 14 days;
    /// - publishes confirmed within 10 s, or their outcome is unknown;
    /// - messages up to 8 MiB.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            prefix: "keel".to_owned(),
            shards: 8,
            prefetch: 256,
            delivery_limit: 20,
            dedupe_window: Duration::from_secs(120),
            dedupe_capacity: 100_000,
            dead_letter_ttl: Duration::from_secs(14 * 24 * 3600),
            publish_timeout: Duration::from_secs(10),
            max_message_bytes: 8 << 20,
        }
    }

    /// The prefix of every exchange and queue this broker declares, so
    /// several deployments (or test runs) share a virtual host apart.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How many queues each group has per topic. A key always lands in the
    /// same shard (a CRC-32 of the key), and each shard has one active
    /// member at a time, so this bounds how many members of a group work at
    /// once. Every process must agree: a topic declared with another count
    /// is refused. At least 1.
    pub fn shards(mut self, shards: u16) -> Self {
        self.shards = shards.max(1);
        self
    }

    /// How many unsettled deliveries RabbitMQ hands one member per shard
    /// before it waits for acks: the consumer's backpressure. Messages held
    /// behind a busy key count against it.
    pub fn prefetch(mut self, prefetch: u16) -> Self {
        self.prefetch = prefetch.max(1);
        self
    }

    /// How many times a message may go back to its queue (its member's
    /// connection died holding it) before RabbitMQ dead-letters it: the
    /// backstop for a message that crashes every process that reads it.
    /// Keel's consumer runtime dead-letters failing messages itself long
    /// before; local redeliveries (nacks, lease expiries) do not count.
    pub fn delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = limit.max(1);
        self
    }

    /// How long, and for how many ids per subscription, a repeated message
    /// id is dropped on arrival.
    pub fn dedupe_window(mut self, window: Duration, capacity: usize) -> Self {
        self.dedupe_window = window;
        self.dedupe_capacity = capacity;
        self
    }

    /// How long the dead-letter queues keep a message.
    pub fn dead_letter_ttl(mut self, ttl: Duration) -> Self {
        self.dead_letter_ttl = ttl;
        self
    }

    /// How long a publish waits for RabbitMQ's confirms before its outcome
    /// counts as unknown.
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.publish_timeout = timeout;
        self
    }

    /// The largest payload `publish` accepts (RabbitMQ's own limit is
    /// `max_message_size`, 128 MiB by default).
    pub fn max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = bytes;
        self
    }
}
