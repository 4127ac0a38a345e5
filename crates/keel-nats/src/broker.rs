//! [`NatsBroker`]: connecting, publishing with dedupe, opening group
//! subscriptions.

use std::collections::{HashMap, HashSet};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use async_nats::jetstream::context::{
    ConsumerInfoErrorKind, PublishAckFuture, PublishError, PublishErrorKind,
};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use async_nats::jetstream::stream::{self, DiscardPolicy, RetentionPolicy, StorageType};
use async_nats::jetstream::{self, kv};
use async_nats::{HeaderMap, HeaderName, HeaderValue, Subject};
use async_trait::async_trait;
use keel_store::broker::{
    Backlog, Broker, BrokerError, Message, MessageRetention, SubscribeOptions, Subscription,
};
use parking_lot::Mutex;
use tokio::sync::OnceCell;

use crate::cursor::Cursors;
use crate::delivery::HeldKeys;
use crate::error::{publish_ack, publish_send, unavailable};
use crate::expiry::EXPIRES_AFTER_MS;
use crate::names::{TopicNames, check_prefix, checked_token};
use crate::options::NatsBrokerOptions;
use crate::predecessor::LastSequences;
use crate::subscription::NatsSubscription;
use crate::{KEY_HEADER, MESSAGE_ID_HEADER};

/// Keel's [`Broker`] on NATS JetStream.
///
/// Cheap to clone; clones share one connection. See the [crate docs](crate)
/// for how topics, groups and keys map onto JetStream.
#[derive(Clone)]
pub struct NatsBroker {
    inner: Arc<Inner>,
}

struct Inner {
    client: async_nats::Client,
    context: jetstream::Context,
    options: NatsBrokerOptions,
    streams: Mutex<HashMap<String, stream::Stream>>,
    cursors: OnceCell<kv::Store>,
    last_sequences: LastSequences,
}

impl std::fmt::Debug for NatsBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsBroker")
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

impl NatsBroker {
    /// Opens the broker on the NATS server at `url` (e.g.
    /// `nats://127.0.0.1:4222`, or a cluster's servers separated by commas)
    /// with the default [`NatsBrokerOptions`]. The client reconnects on its
    /// own after a server restart, to another server of a cluster if its
    /// own is gone.
    pub async fn open(url: &str) -> Result<Self, BrokerError> {
        NatsBrokerOptions::new().open(url).await
    }

    /// See [`NatsBrokerOptions::open`].
    pub(crate) async fn connect(
        url: &str,
        options: NatsBrokerOptions,
    ) -> Result<Self, BrokerError> {
        check_prefix(&options.stream_prefix)?;
        // A cluster's seeds, comma-separated: the client fails over between
        // them (and whatever servers they announce).
        let servers = url
            .split(',')
            .map(|one| one.trim().parse::<async_nats::ServerAddr>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| BrokerError::Invalid(format!("NATS URL {url:?}: {e}")))?;
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(options.request_timeout)
            .max_reconnects(None)
            .connect(servers)
            .await
            .map_err(|e| unavailable(&format!("connecting to NATS at {url}"), e))?;
        Self::with_client(client, options)
    }

    /// A broker over an existing connection.
    pub fn with_client(
        client: async_nats::Client,
        options: NatsBrokerOptions,
    ) -> Result<Self, BrokerError> {
        check_prefix(&options.stream_prefix)?;
        let mut context = jetstream::new(client.clone());
        context.set_timeout(options.request_timeout);
        Ok(Self {
            inner: Arc::new(Inner {
                client,
                context,
                options,
                streams: Mutex::new(HashMap::new()),
                cursors: OnceCell::new(),
                last_sequences: LastSequences::default(),
            }),
        })
    }

    /// The underlying connection (for request-reply, say).
    pub fn client(&self) -> &async_nats::Client {
        &self.inner.client
    }

    /// The settings this broker runs with.
    pub fn options(&self) -> &NatsBrokerOptions {
        &self.inner.options
    }

    /// The topic that the stream named `stream` holds, if it is one of this
    /// broker's (its prefix) - for listing what a server holds.
    pub fn topic_of_stream(&self, stream: &str) -> Option<String> {
        let token = stream
            .strip_prefix(self.inner.options.stream_prefix.as_str())?
            .strip_prefix('_')?;
        crate::names::untoken(token)
    }

    pub(crate) fn context(&self) -> &jetstream::Context {
        &self.inner.context
    }

    /// Drops a deleted stream from the cache.
    pub(crate) fn forget_stream(&self, name: &str) {
        self.inner.streams.lock().remove(name);
    }

    /// What this broker's settings leave exposed to losing a message it
    /// acknowledged ([`NatsBrokerOptions::durability_warnings`]); `keel
    /// serve` logs them at start.
    pub fn durability_warnings(&self) -> Vec<String> {
        self.inner.options.durability_warnings()
    }

    /// The JetStream stream holding `topic`, created if missing: marked as
    /// created for expiring groups when `expiring` says so (see
    /// the `expiry` module).
    async fn stream(
        &self,
        names: &TopicNames,
        expiring: Option<Duration>,
    ) -> Result<stream::Stream, BrokerError> {
        if let Some(stream) = self.inner.streams.lock().get(&names.stream) {
            return Ok(stream.clone());
        }
        let options = &self.inner.options;
        let config = stream::Config {
            name: names.stream.clone(),
            subjects: vec![names.stream_subjects()],
            retention: RetentionPolicy::Limits,
            discard: DiscardPolicy::Old,
            storage: storage(options.file_storage),
            num_replicas: options.replicas,
            max_age: options.retention,
            duplicate_window: options.duplicate_window,
            allow_direct: true,
            metadata: expiring
                .map(|idle| {
                    let ms = idle.as_millis().to_string();
                    HashMap::from([(EXPIRES_AFTER_MS.to_owned(), ms)])
                })
                .unwrap_or_default(),
            ..stream::Config::default()
        };
        let stream = self
            .inner
            .context
            .get_or_create_stream(config)
            .await
            .map_err(|e| unavailable(&format!("opening stream {}", names.stream), e))?;
        self.inner
            .streams
            .lock()
            .insert(names.stream.clone(), stream.clone());
        Ok(stream)
    }

    /// Checks every message before any is sent, so a refused one never has
    /// a later one stored after it; opens the streams; returns each
    /// message's subject.
    async fn prepare(&self, messages: &[Message]) -> Result<Vec<Subject>, BrokerError> {
        let prefix = &self.inner.options.stream_prefix;
        let mut subjects = Vec::with_capacity(messages.len());
        let mut streams = HashSet::new();
        for message in messages {
            self.validate(message)?;
            let names = TopicNames::new(prefix, &message.topic)?;
            subjects.push(Subject::from(names.subject(&message.key)));
            if streams.insert(names.stream.clone()) {
                self.stream(&names, None).await?;
            }
        }
        Ok(subjects)
    }

    /// Publishes one round (no subject twice), each message stating its
    /// key's last stored sequence, all in flight at once; then, without the
    /// statement, those whose guess the server refused.
    async fn publish_round(&self, round: &[(&Subject, &Message)]) -> Result<(), BrokerError> {
        let last_sequences = &self.inner.last_sequences;
        let mut acks = Vec::with_capacity(round.len());
        for (subject, message) in round {
            let publish = to_publish(message, Some(last_sequences.guess(subject)))?;
            acks.push(self.send((*subject).clone(), publish).await?);
        }
        let mut refused = Vec::new();
        for (ack, (subject, message)) in acks.into_iter().zip(round) {
            match ack.await {
                Err(error) if error.kind() == PublishErrorKind::WrongLastSequence => {
                    refused.push((*subject, *message));
                }
                outcome => self.stored(subject, outcome)?,
            }
        }
        for (subject, message) in refused {
            metrics::counter!("keel_broker_publish_wrong_predecessor_total").increment(1);
            let ack = self
                .send(subject.clone(), to_publish(message, None)?)
                .await?;
            self.stored(subject, ack.await)?;
        }
        Ok(())
    }

    async fn send(
        &self,
        subject: Subject,
        publish: PublishMessage,
    ) -> Result<PublishAckFuture, BrokerError> {
        self.inner
            .context
            .send_publish(subject, publish)
            .await
            .map_err(publish_send)
    }

    /// Turns a PubAck into the publish's outcome, remembering where the
    /// message was stored.
    fn stored(
        &self,
        subject: &str,
        outcome: Result<PublishAck, PublishError>,
    ) -> Result<(), BrokerError> {
        let ack = outcome.map_err(|error| {
            if error.kind() == PublishErrorKind::StreamNotFound {
                // Deleted behind our back: recreate it on the next try.
                self.inner.streams.lock().clear();
            }
            publish_ack(error)
        })?;
        if ack.duplicate {
            metrics::counter!("keel_broker_publish_duplicates_total").increment(1);
        }
        self.inner.last_sequences.stored(subject, ack.sequence);
        Ok(())
    }

    pub(crate) async fn cursor_store(&self) -> Result<kv::Store, BrokerError> {
        let options = &self.inner.options;
        let bucket = format!("{}_cursors", options.stream_prefix);
        self.inner
            .cursors
            .get_or_try_init(|| {
                Cursors::open(
                    &self.inner.context,
                    &bucket,
                    options.retention,
                    options.file_storage,
                    options.replicas,
                )
            })
            .await
            .cloned()
    }
}

/// `messages` in rounds that hold each subject at most once: the first
/// round has every key's first message, the next each key's second, and so
/// on. A round is sent only once the one before it is stored, so a key's
/// later message is never in flight beside an earlier one: if the
/// connection dropped the earlier one on its way, the later one could be
/// stored first. Waiting for it also tells the later message its
/// predecessor's sequence, which the server then checks.
fn rounds<'a>(
    subjects: &'a [Subject],
    messages: &'a [Message],
) -> Vec<Vec<(&'a Subject, &'a Message)>> {
    let mut rounds: Vec<Vec<(&Subject, &Message)>> = Vec::new();
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (subject, message) in subjects.iter().zip(messages) {
        let nth = seen.entry(subject.as_str()).or_default();
        if rounds.len() <= *nth {
            rounds.push(Vec::new());
        }
        rounds[*nth].push((subject, message));
        *nth += 1;
    }
    rounds
}

fn storage(file: bool) -> StorageType {
    if file {
        StorageType::File
    } else {
        StorageType::Memory
    }
}

/// A Keel message as a JetStream publish: its headers, plus the message id
/// (`Nats-Msg-Id`, JetStream's dedupe key) and the key.
/// `expected`, when given, is the key's last stored sequence the message
/// states (see the `predecessor` module).
fn to_publish(message: &Message, expected: Option<u64>) -> Result<PublishMessage, BrokerError> {
    let mut headers = HeaderMap::new();
    for (name, value) in &message.headers {
        if name.starts_with("Nats-") || name == KEY_HEADER {
            return Err(BrokerError::Invalid(format!(
                "header {name:?} is reserved for the broker"
            )));
        }
        headers.insert(header_name(name)?, header_value(name, value)?);
    }
    headers.insert(
        header_name(MESSAGE_ID_HEADER)?,
        header_value("message id", &message.id)?,
    );
    headers.insert(header_name(KEY_HEADER)?, header_value("key", &message.key)?);
    if let Some(sequence) = expected {
        headers.insert(
            NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
            HeaderValue::from(sequence),
        );
    }
    Ok(PublishMessage::build()
        .payload(message.payload.clone())
        .headers(headers))
}

/// The size NATS counts against `max_payload`: the payload and the header
/// block (`NATS/1.0\r\n`, a `name: value\r\n` line per header, `\r\n`),
/// with the message id, key and predecessor headers this crate adds.
fn wire_size(message: &Message) -> usize {
    let line = |name: &str, value: &str| name.len() + 2 + value.len() + 2;
    let headers: usize = message
        .headers
        .iter()
        .map(|(name, value)| line(name, value))
        .sum();
    message.payload.len()
        + 10
        + headers
        + line(MESSAGE_ID_HEADER, &message.id)
        + line(KEY_HEADER, &message.key)
        + line(
            NATS_EXPECTED_LAST_SUBJECT_SEQUENCE.as_ref(),
            LONGEST_SEQUENCE,
        )
        + 2
}

/// `u64::MAX` in decimal: the widest predecessor a message can state.
const LONGEST_SEQUENCE: &str = "18446744073709551615";

fn header_name(name: &str) -> Result<HeaderName, BrokerError> {
    HeaderName::from_str(name)
        .map_err(|e| BrokerError::Invalid(format!("header name {name:?}: {e}")))
}

fn header_value(name: &str, value: &str) -> Result<HeaderValue, BrokerError> {
    if value.contains(['\r', '\n']) {
        return Err(BrokerError::Invalid(format!(
            "{name} {value:?} contains a line break"
        )));
    }
    HeaderValue::from_str(value).map_err(|e| BrokerError::Invalid(format!("{name} {value:?}: {e}")))
}

#[async_trait]
impl Broker for NatsBroker {
    /// Sends every message, then waits for every PubAck: a message is
    /// published once JetStream stored it. An ack that does not arrive is
    /// [`BrokerError::OutcomeUnknown`]; republishing is safe because the
    /// message id dedupes it within the duplicate window.
    ///
    /// A message whose key occurs once in `messages` states its key's last
    /// stored message (see the `predecessor` module); if JetStream refuses
    /// that guess, the message is sent again without it.
    async fn publish(&self, messages: &[Message]) -> Result<(), BrokerError> {
        let subjects = self.prepare(messages).await?;
        for round in rounds(&subjects, messages) {
            self.publish_round(&round).await?;
        }
        Ok(())
    }

    /// What JetStream can never take: an empty message id, a topic that
    /// does not fit a stream name, a header name it cannot carry (or one
    /// reserved for the broker), a line break in a header value or the key
    /// (both travel as headers), and a message (headers included) over the
    /// server's `max_payload`.
    fn validate(&self, message: &Message) -> Result<(), BrokerError> {
        if message.id.is_empty() {
            return Err(BrokerError::Invalid("a message id is empty".into()));
        }
        TopicNames::new(&self.inner.options.stream_prefix, &message.topic)?;
        to_publish(message, None)?;
        let max_payload = self.inner.client.max_payload();
        let size = wire_size(message);
        if max_payload > 0 && size > max_payload {
            return Err(BrokerError::Invalid(format!(
                "message {} is {size} bytes with its headers, over the NATS server's \
                 max_payload of {max_payload}; put the payload in a claim check",
                message.id
            )));
        }
        Ok(())
    }

    fn retention(&self) -> MessageRetention {
        match self.inner.options.retention {
            zero if zero.is_zero() => MessageRetention::Forever,
            age => MessageRetention::For(age),
        }
    }

    /// Binds (creating if needed) the group's durable pull consumer: deliver
    /// all retained messages, explicit acks, `ack_wait` = the lease,
    /// unlimited deliveries (Keel's consumer dead-letters by delivery
    /// count, into the Store's dead-letter table, not NATS's).
    async fn subscribe(
        &self,
        options: SubscribeOptions,
    ) -> Result<Box<dyn Subscription>, BrokerError> {
        if options.lease < Duration::from_millis(10) {
            return Err(BrokerError::Invalid(format!(
                "a lease of {:?} is too short for JetStream (at least 10 ms)",
                options.lease
            )));
        }
        let settings = &self.inner.options;
        let names = TopicNames::new(&settings.stream_prefix, &options.topic)?;
        let group_token = checked_token("group", &options.group)?;
        let stream = self.stream(&names, options.expire_after_idle).await?;
        let cursors = Arc::new(Cursors::new(self.cursor_store().await?));
        let config = pull::Config {
            durable_name: Some(group_token.clone()),
            description: Some(format!("Keel consumer group {}", options.group)),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::Explicit,
            ack_wait: options.lease,
            max_deliver: -1,
            max_ack_pending: settings.max_ack_pending,
            filter_subject: names.stream_subjects(),
            // The server deletes an expiring group nobody pulls from.
            inactive_threshold: options.expire_after_idle.unwrap_or_default(),
            ..pull::Config::default()
        };
        let mut consumer = stream
            .get_or_create_consumer(&group_token, config.clone())
            .await
            .map_err(|e| unavailable(&format!("opening consumer group {}", options.group), e))?;
        let current = &consumer.cached_info().config;
        if current.ack_wait != config.ack_wait
            || current.inactive_threshold != config.inactive_threshold
        {
            // The lease and expiry belong to the group: the latest
            // subscriber's win.
            stream
                .update_consumer(config)
                .await
                .map_err(|e| unavailable("updating the consumer group's lease", e))?;
            consumer = stream
                .get_consumer(&group_token)
                .await
                .map_err(|e| unavailable("reopening the consumer group", e))?;
        }
        let ack_wait = consumer.cached_info().config.ack_wait;
        Ok(Box::new(NatsSubscription {
            client: self.inner.client.clone(),
            consumer,
            stream,
            names,
            topic: options.topic,
            group_token,
            cursors,
            ack_wait,
            request_timeout: settings.request_timeout,
            held: Arc::new(HeldKeys::default()),
            parked: Vec::new(),
        }))
    }

    /// The group's durable consumer, as JetStream counts it: messages not
    /// yet delivered to the group are waiting (`num_pending`); delivered and
    /// unacked ones are in flight (`num_ack_pending`), including those this
    /// process holds back behind an earlier message of their key.
    async fn backlog(&self, topic: &str, group: &str) -> Result<Option<Backlog>, BrokerError> {
        let names = TopicNames::new(&self.inner.options.stream_prefix, topic)?;
        let group_token = checked_token("group", group)?;
        let stream = self
            .inner
            .context
            .get_stream_no_info(&names.stream)
            .await
            .map_err(|e| unavailable(&format!("opening stream {}", names.stream), e))?;
        match stream.consumer_info(&group_token).await {
            Ok(info) => Ok(Some(Backlog {
                waiting: info.num_pending,
                in_flight: u64::try_from(info.num_ack_pending).unwrap_or(u64::MAX),
            })),
            Err(error)
                if matches!(
                    error.kind(),
                    ConsumerInfoErrorKind::NotFound | ConsumerInfoErrorKind::StreamNotFound
                ) =>
            {
                Ok(None)
            }
            Err(error) => Err(unavailable("reading a consumer group's backlog", error)),
        }
    }

    /// The server deletes idle expiring groups itself
    /// (`inactive_threshold`); this deletes the streams created for them
    /// that have no consumer left and had no publish within their expiry,
    /// with their key cursors.
    async fn sweep_expired(&self) -> Result<u64, BrokerError> {
        self.sweep_streams().await
    }

    /// Deletes the group's durable consumer and key cursors, and the stream
    /// when it was created for expiring groups and has no consumer left.
    async fn remove_group(&self, topic: &str, group: &str) -> Result<(), BrokerError> {
        let names = TopicNames::new(&self.inner.options.stream_prefix, topic)?;
        let group_token = checked_token("group", group)?;
        self.delete_group(&names.stream, &names.topic_token, &group_token)
            .await
    }

    /// Asks JetStream for the account's usage: a round trip through the
    /// server's JetStream API.
    async fn ping(&self) -> Result<(), BrokerError> {
        self.inner
            .context
            .query_account()
            .await
            .map(drop)
            .map_err(|e| unavailable("pinging JetStream", e))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_longest_sequence_is_u64_max() {
        assert_eq!(super::LONGEST_SEQUENCE, u64::MAX.to_string());
    }
}
