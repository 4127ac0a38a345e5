//! [`KafkaBrokerOptions`]: how topics and groups map onto Kafka.

use std::time::Duration;

/// Options of a [`KafkaBroker`](crate::KafkaBroker), with the defaults
/// [`new`](Self::new) documents.
#[derive(Debug, Clone)]
pub struct KafkaBrokerOptions {
    pub(crate) bootstrap: String,
    pub(crate) prefix: String,
    pub(crate) partitions: i32,
    pub(crate) replication: i32,
    pub(crate) retention: Duration,
    pub(crate) dedupe_window: Duration,
    pub(crate) dedupe_capacity: usize,
    pub(crate) publish_timeout: Duration,
    pub(crate) request_timeout: Duration,
    pub(crate) max_message_bytes: usize,
    pub(crate) max_held: usize,
    pub(crate) commit_interval: Duration,
    pub(crate) fetch_wait: Duration,
    pub(crate) delete_topics: bool,
    pub(crate) extra: Vec<(String, String)>,
}

impl KafkaBrokerOptions {
    /// Options for the cluster reached through `bootstrap`
    /// (`host:port[,host:port…]`), with these defaults:
    ///
    /// - no topic prefix: a Keel topic is the Kafka topic of its name;
    /// - 12 partitions and a replication factor of 1 for the topics it
    ///   creates (see [`partitions`](Self::partitions));
    /// - messages kept 7 days (`retention.ms`);
    /// - a dedupe window of 2 minutes and 100,000 ids per group member;
    /// - publishes acknowledged within 10 s, or their outcome is unknown;
    /// - metadata and offset requests answered within 10 s;
    /// - messages up to 1 MiB (Kafka's own default `message.max.bytes`);
    /// - at most 1,024 messages held per group member before it pauses its
    ///   partitions (backpressure);
    /// - settled offsets committed every 200 ms;
    /// - fetches waiting up to 100 ms for records (see
    ///   [`fetch_wait`](Self::fetch_wait));
    /// - the topic of an expiring group deleted with its last group (see
    ///   [`delete_topics`](Self::delete_topics)).
    pub fn new(bootstrap: impl Into<String>) -> Self {
        Self {
            bootstrap: bootstrap.into(),
            prefix: String::new(),
            partitions: 12,
            replication: 1,
            retention: Duration::from_secs(7 * 24 * 3600),
            dedupe_window: Duration::from_secs(120),
            dedupe_capacity: 100_000,
            publish_timeout: Duration::from_secs(10),
            request_timeout: Duration::from_secs(10),
            max_message_bytes: 1 << 20,
            max_held: 1024,
            commit_interval: Duration::from_millis(200),
            fetch_wait: Duration::from_millis(100),
            delete_topics: true,
            extra: Vec::new(),
        }
    }

    /// Options from a `kafka://host:port[,host:port…]` URL.
    pub fn from_url(url: &str) -> Option<Self> {
        let hosts = url.strip_prefix("kafka://")?.trim_end_matches('/');
        (!hosts.is_empty()).then(|| Self::new(hosts))
    }

    /// Puts every Kafka topic this broker uses under `prefix`
    /// (`<prefix>.<topic>`, dead letters included), so several deployments
    /// share a cluster apart. Processes sharing work must use the same
    /// one. Empty (the default): no prefix.
    pub fn prefix(mut self, prefix: impl Into<String>) -> Self {
        self.prefix = prefix.into();
        self
    }

    /// How many partitions a topic this broker creates has. A key always
    /// lands on the same partition (murmur2 of the key, as Java clients
    /// hash it), and each partition has one reader per group at a time, so
    /// this bounds how many members of a group work at once. Topics that
    /// already exist keep their count. At least 1.
    pub fn partitions(mut self, partitions: i32) -> Self {
        self.partitions = partitions.max(1);
        self
    }

    /// The replication factor of the topics this broker creates (use 3 on
    /// a production cluster, with `min.insync.replicas` 2 on the broker:
    /// `acks=all` then means two copies).
    pub fn replication(mut self, replication: i32) -> Self {
        self.replication = replication.max(1);
        self
    }

    /// How long the topics this broker creates keep a message
    /// (`retention.ms`), settled or not.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// How long, and for how many ids per group member, a repeated message
    /// id is dropped on arrival.
    pub fn dedupe_window(mut self, window: Duration, capacity: usize) -> Self {
        self.dedupe_window = window;
        self.dedupe_capacity = capacity;
        self
    }

    /// How long a publish waits for the brokers' acknowledgement before its
    /// outcome counts as unknown.
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.publish_timeout = timeout;
        self
    }

    /// How long a metadata, offset or admin request may take.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// The largest message `publish` accepts (payload, key and headers).
    /// Keep it at or below the brokers' `message.max.bytes`.
    pub fn max_message_bytes(mut self, bytes: usize) -> Self {
        self.max_message_bytes = bytes;
        self
    }

    /// How many fetched, unsettled messages a group member holds before it
    /// pauses its partitions: the consumer's backpressure.
    pub fn max_held(mut self, max: usize) -> Self {
        self.max_held = max.max(1);
        self
    }

    /// How often settled offsets are committed. A crash redelivers what
    /// was settled within the last interval (the inbox drops it).
    pub fn commit_interval(mut self, interval: Duration) -> Self {
        self.commit_interval = interval.max(Duration::from_millis(10));
        self
    }

    /// How long a fetch may wait at the broker for records to arrive
    /// (librdkafka's `fetch.wait.max.ms`). Kafka answers as soon as a
    /// record arrives, so this only bounds idle polling; tansu 0.6.0
    /// answers every fetch only after this long, records or not, so there
    /// it is the floor of every delivery's latency. At least 1 ms.
    pub fn fetch_wait(mut self, wait: Duration) -> Self {
        self.fetch_wait = wait.max(Duration::from_millis(1));
        self
    }

    /// Whether the topic created for expiring groups (request-reply's
    /// reply topics) is deleted with its last group. Turn it off on a
    /// broker whose topic deletion is unsafe: tansu 0.6.0 deletes *every*
    /// topic of its cluster when asked to delete one. Without it, such
    /// topics stay, emptied only by their retention.
    pub fn delete_topics(mut self, delete: bool) -> Self {
        self.delete_topics = delete;
        self
    }

    /// A librdkafka setting for every client this broker opens (TLS,
    /// SASL, client id…). Keel's own settings (acks, idempotence, offset
    /// handling, the assignor) win over these.
    pub fn client_setting(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        self.extra.push((name.into(), value.into()));
        self
    }
}

impl KafkaBrokerOptions {
    /// What in these options breaks Keel's durability guarantees (a
    /// publish acknowledged is never lost), one sentence each: `keel
    /// serve` logs them at start. With fewer than 3 replicas, `acks=all`
    /// is one or two brokers' page cache, and a machine crash can lose
    /// what Kafka acknowledged.
    pub fn durability_warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if self.replication < 3 {
            warnings.push(format!(
                "the topics this broker creates get {} replica(s): a machine crash can lose \
                 messages Kafka acknowledged; use 3 (KafkaBrokerOptions::replication), with \
                 min.insync.replicas = 2 on the brokers, or create the topics beforehand",
                self.replication
            ));
        }
        warnings
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fewer_than_three_replicas_is_a_durability_warning() {
        let options = KafkaBrokerOptions::new("k:9092");
        assert_eq!(options.durability_warnings().len(), 1);
        assert!(options.durability_warnings()[0].contains("1 replica"));
        assert!(options.replication(3).durability_warnings().is_empty());
    }

    #[test]
    fn a_kafka_url_names_the_bootstrap_servers() {
        let options = KafkaBrokerOptions::from_url("kafka://a:9092,b:9092/").expect("a url");
        assert_eq!(options.bootstrap, "a:9092,b:9092");
        assert!(KafkaBrokerOptions::from_url("kafka://").is_none());
        assert!(KafkaBrokerOptions::from_url("amqp://x").is_none());
    }
}
