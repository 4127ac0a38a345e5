//! A [`Message`] as AMQP properties and back.
//!
//! Keel's headers travel as AMQP headers, except the CloudEvents
//! attributes (`ce-*`), which take the `cloudEvents:` prefix of the
//! CloudEvents AMQP binding, so other AMQP clients read them as such. The
//! id is the AMQP `message-id`; the key and the publish time (the time the
//! contract calls "received") are Keel's own headers.

use std::collections::BTreeMap;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use keel_store::broker::{Headers, Message};
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
    let mut headers = BTreeMap::new();
    for (name, value) in &message.headers {
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
    BasicProperties::default()
        .with_message_id(message.id.as_str().into())
        .with_delivery_mode(PERSISTENT)
        .with_timestamp(now.timestamp().max(0) as u64)
        .with_headers(FieldTable::from(headers))
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
}
