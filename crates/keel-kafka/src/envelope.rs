//! A [`Message`] as a Kafka record and back.
//!
//! The key is the record key (what partitions it), and every header a
//! record header. CloudEvents attributes (`ce-*` in Keel) travel as `ce_*`
//! headers, the CloudEvents Kafka protocol binding's binary mode, so other
//! Kafka clients read them as such; `traceparent`, `tracestate` and the
//! deadline travel under their own names. The record's timestamp is the
//! publish time (what the contract calls "received"), in milliseconds.

use bytes::Bytes;
use chrono::{DateTime, Utc};
use keel_store::broker::{Headers, Message, header};
use rdkafka::message::{BorrowedMessage, Header, Headers as _, OwnedHeaders};

const KEEL_CLOUDEVENTS_PREFIX: &str = "ce-";
const KAFKA_CLOUDEVENTS_PREFIX: &str = "ce_";

/// The record headers `message` is published with. The message id always
/// travels as `event-id`, whatever the headers say.
pub(crate) fn headers(message: &Message) -> OwnedHeaders {
    let mut headers = OwnedHeaders::new_with_capacity(message.headers.len() + 1);
    headers = headers.insert(Header {
        key: header::EVENT_ID,
        value: Some(message.id.as_str()),
    });
    for (name, value) in &message.headers {
        if name == header::EVENT_ID {
            continue;
        }
        let name = kafka_header_name(name);
        headers = headers.insert(Header {
            key: &name,
            value: Some(value.as_str()),
        });
    }
    headers
}

/// How many bytes `message` takes on the wire, near enough to hold it to a
/// size limit before sending anything.
pub(crate) fn size(message: &Message) -> usize {
    let headers: usize = message
        .headers
        .iter()
        .map(|(name, value)| name.len() + value.len() + 8)
        .sum();
    message.payload.len() + message.key.len() + message.id.len() + headers + 64
}

fn kafka_header_name(name: &str) -> String {
    match name.strip_prefix(KEEL_CLOUDEVENTS_PREFIX) {
        Some(attribute) => format!("{KAFKA_CLOUDEVENTS_PREFIX}{attribute}"),
        None => name.to_owned(),
    }
}

fn keel_header_name(name: &str) -> String {
    match name.strip_prefix(KAFKA_CLOUDEVENTS_PREFIX) {
        Some(attribute) => format!("{KEEL_CLOUDEVENTS_PREFIX}{attribute}"),
        None => name.to_owned(),
    }
}

/// A message read from Kafka, with when it was published.
pub(crate) struct Arrived {
    pub(crate) message: Message,
    pub(crate) published_at: Option<DateTime<Utc>>,
}

/// The Keel message a record carries. A record without an `event-id`
/// (another client wrote it) is known by its place in the log.
pub(crate) fn arrived(record: &BorrowedMessage<'_>) -> Arrived {
    use rdkafka::Message as _;
    let mut headers = Headers::new();
    if let Some(kafka) = record.headers() {
        for entry in kafka.iter() {
            let value = entry
                .value
                .map(|v| String::from_utf8_lossy(v).into_owned())
                .unwrap_or_default();
            headers.insert(keel_header_name(entry.key), value);
        }
    }
    let id = headers.get(header::EVENT_ID).cloned().unwrap_or_else(|| {
        format!(
            "{}-{}-{}",
            record.topic(),
            record.partition(),
            record.offset()
        )
    });
    let key = record
        .key()
        .map(|k| String::from_utf8_lossy(k).into_owned())
        .unwrap_or_default();
    let published_at = record
        .timestamp()
        .to_millis()
        .and_then(DateTime::from_timestamp_millis);
    Arrived {
        message: Message {
            id,
            topic: record.topic().to_owned(),
            key,
            headers,
            payload: Bytes::copy_from_slice(record.payload().unwrap_or_default()),
        },
        published_at,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cloudevents_attributes_take_the_kafka_bindings_prefix_and_back() {
        assert_eq!(kafka_header_name("ce-type"), "ce_type");
        assert_eq!(kafka_header_name("traceparent"), "traceparent");
        assert_eq!(keel_header_name("ce_type"), "ce-type");
        assert_eq!(keel_header_name("x-tenant"), "x-tenant");
    }

    #[test]
    fn the_id_travels_whatever_the_headers_say() {
        let mut message = Message::new("m-1", "t", "k", "x");
        message
            .headers
            .insert(header::EVENT_ID.into(), "other".into());
        let headers = headers(&message);
        let ids: Vec<_> = headers
            .iter()
            .filter(|h| h.key == header::EVENT_ID)
            .map(|h| h.value.map(<[u8]>::to_vec))
            .collect();
        assert_eq!(ids, [Some(b"m-1".to_vec())]);
    }
}
