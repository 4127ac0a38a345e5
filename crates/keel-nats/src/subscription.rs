//! A group's subscription: pulls from the group's durable consumer and
//! hands out only the head message of each key.
//!
//! A pulled message whose key has an earlier unfinished message in the
//! group (see [`crate::cursor`]) is *parked*: kept by this subscription,
//! its lease renewed with in-progress acks while `receive` is being called,
//! and handed out once the earlier message is finished. Parked messages
//! count against the consumer's `max_ack_pending`; a parked message whose
//! lease ran out (the application stopped calling `receive`) is forgotten
//! and redelivered by the server. Dropping the subscription naks the parked
//! messages, so other members get them at once.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::stream::{DirectGetErrorKind, LastRawMessageErrorKind, Stream};
use async_nats::jetstream::{self, AckKind};
use async_nats::{Client, Subject};
use async_trait::async_trait;
use futures_util::StreamExt;
use futures_util::future::join_all;
use keel_core::clock::{self, Instant};
use keel_store::broker::{BrokerError, Delivery, Headers, Message, Subscription};

use crate::cursor::Cursors;
use crate::delivery::{HeldKeys, Lease, NatsDeliveryControl, margin};
use crate::error::unavailable;
use crate::names::{TopicNames, untoken};
use crate::predecessor;
use crate::{KEY_HEADER, MESSAGE_ID_HEADER};

/// The longest a waiting receive goes without re-checking parked messages.
const RECHECK: Duration = Duration::from_millis(100);

/// A message pulled but held back behind an earlier one of its key.
pub(crate) struct Parked {
    message: jetstream::Message,
    sequence: u64,
    delivered: u32,
    key_token: String,
    /// The key's previous message, as the server checked it at publish.
    predecessor: Option<u64>,
    deadline: Instant,
    /// When the stream stored it.
    stored_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// A pulled message, sorted into what happens to it.
enum Admission {
    Release(Parked),
    Park(Parked),
    AlreadyFinished(Parked),
    /// The head check failed: kept parked and checked again on the next
    /// receive, rather than left to come back after a whole ack wait.
    Unchecked(Parked, BrokerError),
}

/// Where a message stands in its key, by the head check.
enum Verdict {
    Head,
    Behind,
    Finished,
}

/// The subscription the NATS broker hands out.
pub(crate) struct NatsSubscription {
    pub(crate) client: Client,
    pub(crate) consumer: PullConsumer,
    pub(crate) stream: Stream,
    pub(crate) names: TopicNames,
    pub(crate) topic: String,
    pub(crate) group_token: String,
    pub(crate) cursors: Arc<Cursors>,
    pub(crate) ack_wait: Duration,
    pub(crate) request_timeout: Duration,
    pub(crate) held: Arc<HeldKeys>,
    pub(crate) parked: Vec<Parked>,
}

#[async_trait]
impl Subscription for NatsSubscription {
    async fn receive(&mut self, max: usize, wait: Duration) -> Result<Vec<Delivery>, BrokerError> {
        if max == 0 {
            return Ok(Vec::new());
        }
        let deadline = clock::now() + wait;
        self.held.purge();
        loop {
            let mut out = self.release_parked(max).await?;
            if !out.is_empty() {
                return Ok(out);
            }
            let started = clock::now();
            let remaining = deadline.saturating_duration_since(started);
            let recheck = RECHECK.min(self.ack_wait / 4);
            let slice = if self.parked.is_empty() {
                remaining
            } else {
                remaining.min(recheck)
            };
            let pulled = self.pull(max, slice).await?;
            let nothing = pulled.is_empty();
            self.admit_all(pulled, &mut out).await?;
            let now = clock::now();
            if !out.is_empty() || now >= deadline {
                return Ok(out);
            }
            if nothing && now + Duration::from_millis(5) < started + slice {
                // The server answered early with nothing (another member's
                // request was first in line): don't spin.
                tokio::time::sleep(Duration::from_millis(20).min(deadline - now)).await;
            }
        }
    }
}

impl NatsSubscription {
    /// One pull of up to `max` messages, waiting up to `wait` for the first.
    async fn pull(
        &self,
        max: usize,
        wait: Duration,
    ) -> Result<Vec<(jetstream::Message, Instant)>, BrokerError> {
        let mut request = self.consumer.fetch().max_messages(max);
        if wait >= Duration::from_millis(1) {
            request = request.expires(wait);
        }
        let mut batch = request
            .messages()
            .await
            .map_err(|e| unavailable("pulling from JetStream", e))?;
        // The server ends a pull when it expires; a pull it lost (a restart)
        // would never end, so the client gives up a request timeout later.
        let give_up = clock::now() + wait + self.request_timeout;
        let mut got = Vec::new();
        loop {
            let Ok(next) = tokio::time::timeout_at(give_up, batch.next()).await else {
                tracing::debug!("a pull outlived its expiry; the server lost it");
                break;
            };
            let Some(message) = next else { break };
            match message {
                Ok(message) => got.push((message, clock::now())),
                Err(error) if got.is_empty() => {
                    return Err(unavailable("pulling from JetStream", error));
                }
                Err(error) => {
                    tracing::debug!(%error, "a pull ended early");
                    break;
                }
            }
        }
        Ok(got)
    }

    /// Sorts freshly pulled messages: the first of each key not held back
    /// locally gets its head check (concurrently, keys are independent);
    /// later ones of a key wait for the next round.
    async fn admit_all(
        &mut self,
        pulled: Vec<(jetstream::Message, Instant)>,
        out: &mut Vec<Delivery>,
    ) -> Result<(), BrokerError> {
        let mut keys = HashSet::new();
        let (mut to_check, mut to_park) = (Vec::new(), Vec::new());
        for (message, at) in pulled {
            let parked = self.parse(message, at)?;
            let behind_parked = self
                .parked
                .iter()
                .any(|p| p.key_token == parked.key_token && p.sequence < parked.sequence);
            if !keys.insert(parked.key_token.clone())
                || behind_parked
                || self.held.blocks(&parked.key_token, parked.sequence)
            {
                to_park.push(parked);
            } else {
                to_check.push(parked);
            }
        }
        let verdicts = join_all(to_check.into_iter().map(|p| self.admit(p))).await;
        let mut first_error = None;
        for verdict in verdicts {
            match verdict {
                Admission::Release(p) => out.push(self.hand_out(p)),
                Admission::Park(p) => self.park(p),
                Admission::AlreadyFinished(p) => self.forget(p).await,
                Admission::Unchecked(p, error) => {
                    tracing::debug!(%error, sequence = p.sequence,
                        "a head check failed; the message stays parked");
                    self.park(p);
                    first_error = first_error.or(Some(error));
                }
            }
        }
        for parked in to_park {
            self.park(parked);
        }
        match first_error {
            Some(error) if out.is_empty() => Err(error),
            _ => Ok(()),
        }
    }

    /// The parts of a pulled message the admission needs.
    fn parse(
        &self,
        message: jetstream::Message,
        received_at: Instant,
    ) -> Result<Parked, BrokerError> {
        let info = message.info().map_err(|e| {
            BrokerError::Other(format!("a JetStream message without metadata: {e}").into())
        })?;
        let (sequence, delivered) = (info.stream_sequence, info.delivered);
        let stored_at = chrono::DateTime::from_timestamp(
            info.published.unix_timestamp(),
            info.published.nanosecond(),
        );
        let predecessor = predecessor::verified(message.headers.as_ref());
        let key_token = self
            .names
            .key_token(message.subject.as_str())
            .unwrap_or("_")
            .to_owned();
        Ok(Parked {
            message,
            sequence,
            delivered: u32::try_from(delivered).unwrap_or(u32::MAX),
            key_token,
            predecessor,
            deadline: received_at + self.ack_wait - margin(self.ack_wait),
            stored_at,
        })
    }

    /// Sorts `parked` by its head check.
    async fn admit(&self, parked: Parked) -> Admission {
        match self.check_head(&parked).await {
            Ok(Verdict::Head) => Admission::Release(parked),
            Ok(Verdict::Behind) => Admission::Park(parked),
            Ok(Verdict::Finished) => Admission::AlreadyFinished(parked),
            Err(error) => Admission::Unchecked(parked, error),
        }
    }

    /// Whether `parked` is its key's first unfinished message. A first
    /// delivery cannot be finished yet, so the cached cursor is enough when
    /// it already proves the head: by the message's verified predecessor
    /// (see [`crate::predecessor`]) or, without one, by the stream. Anything
    /// else reads the cursor bucket, and the stream when the predecessor
    /// does not settle it.
    async fn check_head(&self, parked: &Parked) -> Result<Verdict, BrokerError> {
        fail::fail_point!("keel-nats-head-check", |_| Err(unavailable(
            "reading a key's head",
            "failpoint keel-nats-head-check"
        )));
        let cursor_key = self.cursor_key(&parked.key_token);
        let follows = |cursor: u64| parked.predecessor.is_some_and(|p| p <= cursor);
        if parked.delivered == 1 {
            let cursor = self.cursors.cached(&cursor_key);
            if follows(cursor) {
                return Ok(Verdict::Head);
            }
            if parked.predecessor.is_none() && self.is_head_after(parked, cursor).await? {
                return Ok(Verdict::Head);
            }
        }
        let cursor = self.cursors.fresh(&cursor_key).await?;
        if parked.sequence <= cursor {
            Ok(Verdict::Finished)
        } else if follows(cursor) || self.is_head_after(parked, cursor).await? {
            Ok(Verdict::Head)
        } else {
            Ok(Verdict::Behind)
        }
    }

    /// Whether `parked` is the first message on its subject after `cursor`.
    async fn is_head_after(&self, parked: &Parked, cursor: u64) -> Result<bool, BrokerError> {
        let head = self.head_after(&parked.message.subject, cursor).await?;
        Ok(head >= parked.sequence)
    }

    /// The sequence of the first message on `subject` after `cursor`.
    ///
    /// A replicated stream is asked through its leader: a direct get may be
    /// answered by a replica that has not caught up, whose "nothing there"
    /// would let a later message of the key overtake one it has not stored
    /// yet. A single-replica stream has only its leader to ask, and the
    /// direct get is one hop shorter.
    async fn head_after(&self, subject: &Subject, cursor: u64) -> Result<u64, BrokerError> {
        fail::fail_point!("keel-nats-direct-get", |_| Err(unavailable(
            "reading a key's head",
            "failpoint keel-nats-direct-get"
        )));
        if self.stream.cached_info().config.num_replicas > 1 {
            return match self
                .stream
                .get_first_raw_message_by_subject(subject.as_str(), cursor + 1)
                .await
            {
                Ok(message) => Ok(message.sequence),
                Err(error) if error.kind() == LastRawMessageErrorKind::NoMessageFound => {
                    Ok(u64::MAX)
                }
                Err(error) => Err(unavailable("reading a key's head", error)),
            };
        }
        match self
            .stream
            .direct_get_next_for_subject(subject.as_str(), Some(cursor + 1))
            .await
        {
            Ok(message) => Ok(message.sequence),
            // Nothing there (retention removed it): nothing blocks.
            Err(error) if error.kind() == DirectGetErrorKind::NotFound => Ok(u64::MAX),
            Err(error) => Err(unavailable("reading a key's head", error)),
        }
    }

    fn cursor_key(&self, key_token: &str) -> String {
        self.names.cursor_key(&self.group_token, key_token)
    }

    fn park(&mut self, parked: Parked) {
        let at = self
            .parked
            .partition_point(|p| p.sequence < parked.sequence);
        self.parked.insert(at, parked);
    }

    /// Acks a redelivery of a message the group already finished.
    async fn forget(&self, parked: Parked) {
        if let Some(reply) = parked.message.reply.clone() {
            let payload: bytes::Bytes = AckKind::Ack.into();
            if let Err(error) = self.client.publish(reply, payload).await {
                tracing::debug!(%error, "acking a finished message's redelivery failed");
            }
        }
    }

    /// Renews, expires and releases parked messages: up to `max` heads.
    async fn release_parked(&mut self, max: usize) -> Result<Vec<Delivery>, BrokerError> {
        if self.parked.is_empty() {
            return Ok(Vec::new());
        }
        self.renew_parked().await;
        let mut checked = HashSet::new();
        let mut verdicts = Vec::new();
        for (index, parked) in self.parked.iter().enumerate() {
            if verdicts.len() >= max {
                break;
            }
            // Only the earliest parked message of a key can be its head.
            if !checked.insert(parked.key_token.clone())
                || self.held.blocks(&parked.key_token, parked.sequence)
            {
                continue;
            }
            match self.check_head(parked).await? {
                Verdict::Head => verdicts.push((index, true)),
                Verdict::Finished => verdicts.push((index, false)),
                Verdict::Behind => {}
            }
        }
        let mut out = Vec::new();
        for (index, release) in verdicts.into_iter().rev() {
            let parked = self.parked.remove(index);
            if release {
                out.push(self.hand_out(parked));
            } else {
                self.forget(parked).await;
            }
        }
        out.reverse();
        Ok(out)
    }

    /// Drops parked messages whose lease ran out and sends in-progress acks
    /// for those with less than half the ack wait left.
    async fn renew_parked(&mut self) {
        let now = clock::now();
        self.parked.retain(|p| p.deadline > now);
        let half = self.ack_wait / 2;
        for parked in &mut self.parked {
            if parked.deadline.saturating_duration_since(now) >= half {
                continue;
            }
            let Some(reply) = parked.message.reply.clone() else {
                continue;
            };
            let payload: bytes::Bytes = AckKind::Progress.into();
            if self.client.publish(reply, payload).await.is_ok() {
                parked.deadline = now + self.ack_wait - margin(self.ack_wait);
            }
        }
    }

    /// Turns an admitted message into a [`Delivery`].
    fn hand_out(&self, parked: Parked) -> Delivery {
        let lease = Lease::new(parked.deadline);
        self.held
            .insert(&parked.key_token, parked.sequence, lease.clone());
        let message = parked.message.message;
        let reply = message.reply.clone().unwrap_or_else(|| Subject::from(""));
        let mut headers = Headers::new();
        let (mut id, mut key) = (String::new(), None);
        if let Some(map) = &message.headers {
            for (name, values) in map.iter() {
                let Some(value) = values.first() else {
                    continue;
                };
                match name.as_ref() {
                    MESSAGE_ID_HEADER => id = value.as_str().to_owned(),
                    KEY_HEADER => key = Some(value.as_str().to_owned()),
                    n if n.starts_with("Nats-") => {}
                    n => {
                        headers.insert(n.to_owned(), value.as_str().to_owned());
                    }
                }
            }
        }
        let key = key
            .or_else(|| untoken(&parked.key_token))
            .unwrap_or_default();
        let control = NatsDeliveryControl {
            client: self.client.clone(),
            reply,
            lease,
            cursors: self.cursors.clone(),
            cursor_key: self.cursor_key(&parked.key_token),
            sequence: parked.sequence,
            ack_wait: self.ack_wait,
            request_timeout: self.request_timeout,
        };
        let message = Message {
            id,
            topic: self.topic.clone(),
            key,
            headers,
            payload: message.payload,
        };
        let delivery = Delivery::new(message, parked.delivered, Box::new(control));
        match parked.stored_at {
            Some(at) => delivery.with_received_at(at),
            None => delivery,
        }
    }
}

impl Drop for NatsSubscription {
    fn drop(&mut self) {
        let replies: Vec<Subject> = self
            .parked
            .drain(..)
            .filter_map(|p| p.message.message.reply)
            .collect();
        if replies.is_empty() {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let client = self.client.clone();
        runtime.spawn(async move {
            for reply in replies {
                let payload: bytes::Bytes = AckKind::Nak(None).into();
                let _ = client.publish(reply, payload).await;
            }
            let _ = client.flush().await;
        });
    }
}
