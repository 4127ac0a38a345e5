//! A [`Message`] as AMQP properties and back.
//!
//! Keel's headers travel as AMQP headers, except the CloudEvents
//! attributes (`ce-*`), which take the `cloudEvents:` prefix of the
//! CloudEvents AMQP binding, so other AMQP clients read them as such. The
//! id is the AMQP `message-id`, and request-reply's `reply-to` and
//! `correlation-id` are the AMQP properties of those names, so that AMQP
//! clients' RPC (and RabbitMQ's direct reply-to, which rewrites the
//! `reply-to` property) meets Keel's. A request's deadline is also its
//! AMQP `expiration`: RabbitMQ drops a request nobody took before its
//! caller stopped waiting. The key and the publish time (the time the
//! contract calls "received") are Keel's own headers.

use std::collections::BTreeMap;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use keel_core::Deadline;
use keel_store::broker::{Headers, Message, header};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

const KEY: &str = "keel-key";
const TOPIC: &str = "keel-topic";
const PUBLISHED_AT: &str = "keel-published-at";
/// Set by quorum queues on a message returned to its queue.
const DELIVERY_COUNT: &str = "x-delivery-count";
const CLOUDEVENTS_AMQP_PREFIX: &str = "cloudEvents:";
const CLOUDEVENTS_HEADER_PREFIX: &str = "ce-";
/// Persistent: written to disk before the confirm.
const PERSISTENT: u8 = 2;

/// The properties `message` is published with at `now`.
pub(crate) fn properties(message: &Message, now: DateTime<Utc>) -> BasicProperties {
    let mut properties = BasicProperties::default();
    let mut headers = BTreeMap::new();
    for (name, value) in &message.headers {
        match name.as_str() {
            header::REPLY_TO => {
                properties = properties.with_reply_to(value.as_str().into());
                continue;
            }
            header::CORRELATION_ID => {
                properties = properties.with_correlation_id(value.as_str().into());
                continue;
            }
            _ => {}
        }
        let name = match name.strip_prefix(CLOUDEVENTS_HEADER_PREFIX) {
            Some(attribute) => format!("{CLOUDEVENTS_AMQP_PREFIX}{attribute}"),
            None => name.clone(),
        };
        headers.insert(ShortString::from(name), string(value));
    }
    headers.insert(KEY.into(), string(&message.key));
    headers.insert(TOPIC.into(), string(&message.topic));
    headers.insert(
        PUBLISHED_AT.into(),
        AMQPValue::LongLongInt(now.timestamp_micros()),
    );
    if let Some(ttl) = request_ttl(message, now) {
        properties = properties.with_expiration(ttl.to_string().into());
    }
    properties
        .with_message_id(message.id.as_str().into())
        .with_delivery_mode(PERSISTENT)
        .with_timestamp(now.timestamp().max(0) as u64)
        .with_headers(FieldTable::from(headers))
}

/// The milliseconds a request has left before its deadline (at least 1:
/// RabbitMQ reads 0 as "deliver now or never"). Only requests, messages
/// with a `reply-to`: an event that carries its producer's deadline must
/// outlive it.
fn request_ttl(message: &Message, now: DateTime<Utc>) -> Option<u64> {
    message.header(header::REPLY_TO)?;
    let deadline = message.header(header::DEADLINE)?;
    Deadline::parse_header(deadline).ok()?;
    // The header's own milliseconds: a round trip through a clock instant
    // may round one away.
    let deadline: u64 = deadline.trim().parse().ok()?;
    let now = u64::try_from(now.timestamp_millis()).unwrap_or(0);
    Some(deadline.saturating_sub(now).max(1))
}

/// What a delivery carries: the message, when it was published, and how
/// many times RabbitMQ returned it to its queue before.
pub(crate) struct Arrived {
    pub(crate) message: Message,
    pub(crate) published_at: Option<DateTime<Utc>>,
    pub(crate) returns: u32,
}

/// The message a delivery of `properties` and `payload` carries.
pub(crate) fn arrived(properties: &BasicProperties, payload: Vec<u8>) -> Arrived {
    let mut headers = Headers::new();
    let (mut key, mut topic, mut published_at, mut returns) =
        (String::new(), String::new(), None, 0);
    for (name, value) in properties.headers().iter().flat_map(|table| table.inner()) {
        match name.as_str() {
            KEY => key = text(value).unwrap_or_default(),
            TOPIC => topic = text(value).unwrap_or_default(),
            PUBLISHED_AT => published_at = integer(value).and_then(DateTime::from_timestamp_micros),
            DELIVERY_COUNT => {
                returns = integer(value).map_or(0, |n| n.clamp(0, i64::from(u32::MAX)) as u32)
            }
            other => {
                if let Some(value) = text(value) {
                    let name = match other.strip_prefix(CLOUDEVENTS_AMQP_PREFIX) {
                        Some(attribute) => format!("{CLOUDEVENTS_HEADER_PREFIX}{attribute}"),
                        None => other.to_owned(),
                    };
                    headers.insert(name, value);
                }
            }
        }
    }
    if let Some(reply_to) = properties.reply_to() {
        headers.insert(header::REPLY_TO.to_owned(), reply_to.as_str().to_owned());
    }
    if let Some(correlation_id) = properties.correlation_id() {
        headers.insert(
            header::CORRELATION_ID.to_owned(),
            correlation_id.as_str().to_owned(),
        );
    }
    let id = properties
        .message_id()
        .as_ref()
        .map(|id| id.as_str().to_owned())
        .unwrap_or_default();
    Arrived {
        message: Message {
            id,
            topic,
            key,
            headers,
            payload: Bytes::from(payload),
        },
        published_at,
        returns,
    }
}

fn string(value: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(value))
}

fn text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

fn integer(value: &AMQPValue) -> Option<i64> {
    match value {
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(i64::from(*n)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_survives_the_trip() {
        let message = Message::new("m-1", "orders", "order-7", &b"{}"[..])
            .with_header("ce-type", "order.placed")
            .with_header(
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            );
        let now = keel_core::clock::utc_now();
        let props = properties(&message, now);
        let names: Vec<String> = props
            .headers()
            .iter()
            .flat_map(|t| t.inner().keys())
            .map(|k| k.as_str().to_owned())
            .collect();
        assert!(names.contains(&"cloudEvents:type".to_owned()), "{names:?}");
        let back = arrived(&props, b"{}".to_vec());
        assert_eq!(back.message, message);
        assert_eq!(
            back.published_at.map(|t| t.timestamp_micros()),
            Some(now.timestamp_micros())
        );
        assert_eq!(back.returns, 0);
    }

    #[test]
    fn a_request_carries_its_return_address_as_properties_and_its_deadline_as_ttl() {
        let now = keel_core::clock::utc_now();
        let deadline = u64::try_from(now.timestamp_millis()).unwrap() + 1_500;
        let request = Message::new("m-2", "pricing", "sku-1", &b"?"[..])
            .with_header(header::REPLY_TO, "amq.rabbitmq.reply-to")
            .with_header(header::CORRELATION_ID, "c-9")
            .with_header(header::DEADLINE, deadline.to_string());
        let props = properties(&request, now);
        assert_eq!(
            props.reply_to().as_ref().map(|r| r.as_str()),
            Some("amq.rabbitmq.reply-to")
        );
        assert_eq!(
            props.correlation_id().as_ref().map(|c| c.as_str()),
            Some("c-9")
        );
        assert_eq!(
            props.expiration().as_ref().map(|e| e.as_str()),
            Some("1500")
        );
        assert_eq!(arrived(&props, b"?".to_vec()).message, request);

        // An event that only carries its producer's deadline keeps no TTL.
        let event = Message::new("m-3", "orders", "o-1", &b"{}"[..])
            .with_header(header::DEADLINE, deadline.to_string());
        assert_eq!(properties(&event, now).expiration(), &None);
        // A deadline already passed still leaves the request 1 ms.
        let late = request.with_header(header::DEADLINE, "5");
        assert_eq!(
            properties(&late, now)
                .expiration()
                .as_ref()
                .map(|e| e.as_str()),
            Some("1")
        );
    }
}
