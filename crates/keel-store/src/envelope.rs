//! The event envelope: CloudEvents 1.0, read tolerantly, re-emitted losslessly.
//!
//! Every event Keel moves is wrapped in an [`Envelope`] whose fields each earn
//! their place:
//!
//! | field | why |
//! |---|---|
//! | `id` | the dedupe key: delivery is at-least-once |
//! | `type` | carries a version (`shop.order.placed.v1`) so v2 can coexist |
//! | `subject` | the entity id, and also the partition key that keeps its order |
//! | `time` | when the broker got it: the producer's envelope says when it was made, and a consumer sees the broker's receipt time (the delivery's [`received_at`](crate::broker::Delivery::received_at)) |
//! | `data.occurredAt` | when the fact happened (business logic uses this one) |
//! | `data.version` | monotonic per entity: consumers can drop stale updates |
//! | `traceparent` | carries the trace across the broker |
//!
//! A *tolerant reader* ignores fields it does not know, so producers can add
//! fields without breaking consumers; a middleman that re-emits an envelope
//! keeps them all ([`Envelope::extensions`] and `data` are kept verbatim), so it
//! never silently strips fields its neighbours depend on.
//!
//! ```
//! use keel_store::envelope::{Envelope, Event, EventMeta};
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Serialize, Deserialize)]
//! #[serde(rename_all = "camelCase")]
//! struct OrderPlaced { order_id: String, total_minor: i64 }
//!
//! impl Event for OrderPlaced {
//!     const TYPE: &'static str = "shop.order.placed.v1";
//!     fn subject(&self) -> String { self.order_id.clone() }
//! }
//!
//! let event = OrderPlaced { order_id: "A-4471".into(), total_minor: 8210 };
//! let env = Envelope::from_event("/services/orders", &event, EventMeta::new(3)).unwrap();
//! assert_eq!(env.subject.as_deref(), Some("A-4471"));
//! let bytes = env.to_json().unwrap();
//! let back = Envelope::from_json(&bytes).unwrap();
//! let placed: OrderPlaced = back.data_as().unwrap();
//! assert_eq!(placed.total_minor, 8210);
//! assert_eq!(back.version(), Some(3));
//! ```

use std::collections::BTreeMap;

use chrono::{DateTime, SecondsFormat, SubsecRound, Utc};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use keel_core::TraceParent;

/// The CloudEvents specification version Keel speaks.
pub const SPEC_VERSION: &str = "1.0";

/// The default largest encoded envelope, 100 KiB: keep messages under
/// ~100 KB. Brokers take more (NATS 1 MiB), but every consumer, log line
/// and retry carries the whole message; bigger payloads belong in an
/// object store, with a claim check on the message
/// (the `claim_check` module, feature `claim-check`).
pub const DEFAULT_MAX_SIZE: usize = 100 * 1024;

/// Binary-mode message parts: the headers and the body.
pub type BinaryParts = (Vec<(String, String)>, Vec<u8>);

/// The content type of structured-mode CloudEvents.
pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json";

/// A typed domain event: a fact that already happened, named in the past
/// tense, with a versioned type.
pub trait Event: Serialize + DeserializeOwned {
    /// The CloudEvents `type`, ending in a version: `shop.order.placed.v1`.
    const TYPE: &'static str;

    /// The entity the event is about; also the partition key.
    fn subject(&self) -> String;
}

/// The per-event facts Keel adds to `data`: when it happened and the entity's
/// version after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventMeta {
    /// When the fact happened in the domain.
    pub occurred_at: DateTime<Utc>,
    /// The entity's version after this event; monotonic per entity.
    pub version: u64,
}

impl EventMeta {
    /// Metadata for an event that happened now, leaving the entity at `version`.
    pub fn new(version: u64) -> Self {
        Self {
            occurred_at: keel_core::clock::utc_now(),
            version,
        }
    }
}

/// A CloudEvents 1.0 event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope {
    /// Always `"1.0"`.
    pub specversion: String,
    /// Unique per event; consumers dedupe on it.
    pub id: String,
    /// The producing service, e.g. `/services/orders`.
    pub source: String,
    /// The versioned event type.
    #[serde(rename = "type")]
    pub ty: String,
    /// The entity id (and partition key).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<String>,
    /// When the event was published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time: Option<DateTime<Utc>>,
    /// The media type of `data`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub datacontenttype: Option<String>,
    /// W3C trace context of the producer (distributed tracing extension).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub traceparent: Option<String>,
    /// The vendors' trace state that rides with `traceparent` (distributed
    /// tracing extension), carried across the broker unchanged.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tracestate: Option<String>,
    /// The event payload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<Value>,
    /// Every other attribute, kept verbatim so re-emitting loses nothing.
    #[serde(flatten)]
    pub extensions: BTreeMap<String, Value>,
}

/// Why an envelope could not be built or read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EnvelopeError {
    /// The bytes are not a JSON object of the CloudEvents shape.
    #[error("malformed CloudEvents envelope: {0}")]
    Malformed(String),
    /// A required attribute is missing or empty, or has the wrong value.
    #[error("invalid CloudEvents attribute `{attribute}`: {reason}")]
    Invalid {
        /// The attribute.
        attribute: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The encoded envelope is over the size limit.
    #[error(
        "event is {size} bytes, over the {limit}-byte limit: put the payload in an object store \
         and send a claim check (keel_messaging::claim_check) instead"
    )]
    TooLarge {
        /// The encoded size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// `data` does not match the type the consumer expected.
    #[error("event data does not match the expected type: {0}")]
    Data(#[source] serde_json::Error),
}

impl Envelope {
    /// A new envelope with a fresh UUIDv7 id, `time` now (to the
    /// millisecond, as the binary mode's `ce-time` carries it) and the
    /// current trace context.
    pub fn new(source: impl Into<String>, ty: impl Into<String>) -> Self {
        Self {
            specversion: SPEC_VERSION.to_owned(),
            id: keel_core::id::new_id().to_string(),
            source: source.into(),
            ty: ty.into(),
            subject: None,
            time: Some(keel_core::clock::utc_now().trunc_subsecs(3)),
            datacontenttype: Some("application/json".to_owned()),
            traceparent: TraceParent::current().map(|t| t.to_string()),
            tracestate: keel_core::trace::TraceState::current().map(|t| t.to_string()),
            data: None,
            extensions: BTreeMap::new(),
        }
    }

    /// An envelope for a typed event: `data` is the event's fields plus
    /// `occurredAt` and `version`; `subject` is the event's subject.
    pub fn from_event<E: Event>(
        source: impl Into<String>,
        event: &E,
        meta: EventMeta,
    ) -> Result<Self, EnvelopeError> {
        let mut data = match serde_json::to_value(event).map_err(EnvelopeError::Data)? {
            Value::Object(map) => map,
            _ => {
                return Err(EnvelopeError::Invalid {
                    attribute: "data",
                    reason: "a typed event must serialize to a JSON object",
                });
            }
        };
        data.insert(
            "occurredAt".into(),
            Value::String(
                meta.occurred_at
                    .to_rfc3339_opts(SecondsFormat::Millis, true),
            ),
        );
        data.insert("version".into(), Value::from(meta.version));
        // `time` stays when the envelope was made, not `occurredAt`: the
        // two answer different questions (when the fact happened, for
        // business logic; when the message moved, for operations).
        let mut env = Self::new(source, E::TYPE);
        env.subject = Some(event.subject());
        env.data = Some(Value::Object(data));
        env.validate()?;
        Ok(env)
    }

    /// Checks the required attributes and that `type` ends in a version.
    pub fn validate(&self) -> Result<(), EnvelopeError> {
        let invalid = |attribute, reason| Err(EnvelopeError::Invalid { attribute, reason });
        if self.specversion != SPEC_VERSION {
            return invalid("specversion", "must be \"1.0\"");
        }
        if self.id.is_empty() {
            return invalid("id", "must not be empty");
        }
        if self.source.is_empty() {
            return invalid("source", "must not be empty");
        }
        if !has_version_suffix(&self.ty) {
            return invalid("type", "must end in a version, like `shop.order.placed.v1`");
        }
        self.check_extension_names()
    }

    /// CloudEvents attribute names are lowercase ASCII letters and digits.
    /// Any other name could not cross binary mode, whose header names are
    /// case-insensitive, without changing the event.
    fn check_extension_names(&self) -> Result<(), EnvelopeError> {
        let valid = |name: &str| {
            !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        };
        match self.extensions.keys().all(|name| valid(name)) {
            true => Ok(()),
            false => Err(EnvelopeError::Invalid {
                attribute: "extensions",
                reason: "attribute names must be lowercase ASCII letters and digits (CloudEvents)",
            }),
        }
    }

    /// The event type without its version: `shop.order.placed`.
    pub fn type_name(&self) -> &str {
        self.ty.rsplit_once(".v").map_or(&self.ty, |(name, _)| name)
    }

    /// The version in the event type: `1` for `shop.order.placed.v1`.
    pub fn type_version(&self) -> Option<u32> {
        self.ty.rsplit_once(".v").and_then(|(_, v)| v.parse().ok())
    }

    /// The partition key: the subject, or the id for events without one.
    pub fn partition_key(&self) -> &str {
        self.subject.as_deref().unwrap_or(&self.id)
    }

    /// Reads `data` as `T`, ignoring fields `T` does not know (tolerant reader).
    pub fn data_as<T: DeserializeOwned>(&self) -> Result<T, EnvelopeError> {
        T::deserialize(self.data.as_ref().unwrap_or(&Value::Null)).map_err(EnvelopeError::Data)
    }

    /// The entity version in `data.version`, if present.
    pub fn version(&self) -> Option<u64> {
        self.data.as_ref()?.get("version")?.as_u64()
    }

    /// When the fact happened, from `data.occurredAt`.
    pub fn occurred_at(&self) -> Option<DateTime<Utc>> {
        let raw = self.data.as_ref()?.get("occurredAt")?.as_str()?;
        DateTime::parse_from_rfc3339(raw)
            .ok()
            .map(|t| t.with_timezone(&Utc))
    }

    /// The trace context carried by the event, if valid.
    pub fn trace_parent(&self) -> Option<TraceParent> {
        self.traceparent.as_deref()?.parse().ok()
    }

    /// The trace state carried by the event, if valid (an invalid one is
    /// dropped, as the W3C specification asks).
    pub fn trace_state(&self) -> Option<keel_core::trace::TraceState> {
        keel_core::trace::TraceState::from_raw([self.tracestate.as_deref()])
    }

    /// Encodes in structured mode (`application/cloudevents+json`), refusing
    /// envelopes over [`DEFAULT_MAX_SIZE`].
    pub fn to_json(&self) -> Result<Vec<u8>, EnvelopeError> {
        self.to_json_limited(DEFAULT_MAX_SIZE)
    }

    /// Encodes in structured mode, refusing envelopes over `limit` bytes.
    pub fn to_json_limited(&self, limit: usize) -> Result<Vec<u8>, EnvelopeError> {
        let bytes =
            serde_json::to_vec(self).map_err(|e| EnvelopeError::Malformed(e.to_string()))?;
        if bytes.len() > limit {
            return Err(EnvelopeError::TooLarge {
                size: bytes.len(),
                limit,
            });
        }
        Ok(bytes)
    }

    /// Decodes a structured-mode envelope, checking the required attributes.
    pub fn from_json(bytes: &[u8]) -> Result<Self, EnvelopeError> {
        let env: Self =
            serde_json::from_slice(bytes).map_err(|e| EnvelopeError::Malformed(e.to_string()))?;
        env.validate_received()?;
        Ok(env)
    }

    fn validate_received(&self) -> Result<(), EnvelopeError> {
        let invalid = |attribute, reason| Err(EnvelopeError::Invalid { attribute, reason });
        if self.specversion != SPEC_VERSION {
            return invalid("specversion", "must be \"1.0\"");
        }
        if self.id.is_empty() {
            return invalid("id", "must not be empty");
        }
        if self.source.is_empty() {
            return invalid("source", "must not be empty");
        }
        if self.ty.is_empty() {
            return invalid("type", "must not be empty");
        }
        Ok(())
    }

    /// Binary mode: the attributes as message headers (`ce-id`, `ce-type`,
    /// ..., `content-type`, `traceparent`), with `data` as the body.
    /// An extension whose name is not lowercase letters and digits is
    /// refused: header names are case-insensitive, so it would not come
    /// back the same. Extension values travel as text (a number `2` comes
    /// back as the string `"2"`), as CloudEvents' HTTP binding has it.
    pub fn to_binary(&self) -> Result<BinaryParts, EnvelopeError> {
        self.check_extension_names()?;
        let mut headers = vec![
            ("ce-specversion".to_owned(), self.specversion.clone()),
            ("ce-id".to_owned(), self.id.clone()),
            ("ce-source".to_owned(), self.source.clone()),
            ("ce-type".to_owned(), self.ty.clone()),
        ];
        let optional = [
            ("ce-subject", self.subject.clone()),
            ("ce-time", self.time.map(|t| binary_time(&t))),
            ("content-type", self.datacontenttype.clone()),
            ("traceparent", self.traceparent.clone()),
            ("tracestate", self.tracestate.clone()),
        ];
        headers.extend(
            optional
                .into_iter()
                .filter_map(|(k, v)| Some((k.to_owned(), v?))),
        );
        for (name, value) in &self.extensions {
            let text = match value {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            headers.push((format!("ce-{name}"), text));
        }
        let body = match &self.data {
            Some(data) => serde_json::to_vec(data).map_err(EnvelopeError::Data)?,
            None => Vec::new(),
        };
        Ok((headers, body))
    }

    /// Reads a binary-mode message back into an envelope. Header names are
    /// matched case-insensitively; unknown `ce-` headers become extensions.
    pub fn from_binary<'a, I>(headers: I, body: &[u8]) -> Result<Self, EnvelopeError>
    where
        I: IntoIterator<Item = (&'a str, &'a str)>,
    {
        let mut attrs = Map::new();
        let mut extensions = BTreeMap::new();
        for (name, value) in headers {
            let lower = name.to_ascii_lowercase();
            match lower.as_str() {
                "content-type" => {
                    attrs.insert("datacontenttype".into(), value.into());
                }
                "traceparent" | "tracestate" => {
                    attrs.insert(lower.clone(), value.into());
                }
                _ => {
                    let Some(attr) = lower.strip_prefix("ce-") else {
                        continue;
                    };
                    match attr {
                        "specversion" | "id" | "source" | "type" | "subject" | "time" => {
                            attrs.insert(attr.into(), value.into());
                        }
                        _ => {
                            extensions.insert(attr.to_owned(), Value::String(value.to_owned()));
                        }
                    }
                }
            }
        }
        if !body.is_empty() {
            let data: Value = serde_json::from_slice(body)
                .map_err(|e| EnvelopeError::Malformed(format!("binary-mode body: {e}")))?;
            attrs.insert("data".into(), data);
        }
        let mut env: Self = serde_json::from_value(Value::Object(attrs))
            .map_err(|e| EnvelopeError::Malformed(e.to_string()))?;
        env.extensions = extensions;
        env.validate_received()?;
        Ok(env)
    }
}

/// `ce-time`: milliseconds, as Keel's own events carry them, or the finer
/// precision a received event had, so binary mode never rounds it away.
fn binary_time(t: &DateTime<Utc>) -> String {
    let format = match t.timestamp_subsec_nanos() % 1_000_000 {
        0 => SecondsFormat::Millis,
        _ => SecondsFormat::AutoSi,
    };
    t.to_rfc3339_opts(format, true)
}

fn has_version_suffix(ty: &str) -> bool {
    match ty.rsplit_once(".v") {
        Some((name, v)) => {
            !name.is_empty() && !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit())
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    #[serde(rename_all = "camelCase")]
    struct OrderV1 {
        id: String,
        amount_minor: i64,
    }

    #[derive(Debug, Serialize, Deserialize, PartialEq)]
    #[serde(rename_all = "camelCase")]
    struct OrderV2 {
        id: String,
        amount_minor: i64,
        #[serde(default = "gbp")]
        currency: String,
    }

    fn gbp() -> String {
        "GBP".into()
    }

    fn sample() -> Value {
        json!({
            "specversion": "1.0",
            "id": "9f21b4c8",
            "type": "com.acme.orders.placed.v1",
            "source": "/services/orders",
            "subject": "A-4471",
            "time": "2026-09-16T10:31:02.441Z",
            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "tracestate": "rojo=00f067aa0ba902b7",
            "partitionhint": 7,
            "data": {"id": "A-4471", "amountMinor": 8210, "giftWrap": true, "version": 3,
                     "occurredAt": "2026-09-16T10:31:02.180Z"}
        })
    }

    #[test]
    fn tolerant_reader_ignores_unknown_and_defaults_missing() {
        let env = Envelope::from_json(&serde_json::to_vec(&sample()).unwrap()).unwrap();
        let v1: OrderV1 = env.data_as().unwrap();
        assert_eq!(
            v1,
            OrderV1 {
                id: "A-4471".into(),
                amount_minor: 8210
            }
        );
        let v2: OrderV2 = env.data_as().unwrap();
        assert_eq!(v2.currency, "GBP");
        assert_eq!(env.version(), Some(3));
        assert_eq!(env.type_name(), "com.acme.orders.placed");
        assert_eq!(env.type_version(), Some(1));
        assert!(env.occurred_at().unwrap() < env.time.unwrap());
        assert!(env.trace_parent().is_some());
    }

    #[test]
    fn relaying_is_lossless() {
        let original = sample();
        let env = Envelope::from_json(&serde_json::to_vec(&original).unwrap()).unwrap();
        let reemitted: Value = serde_json::from_slice(&env.to_json().unwrap()).unwrap();
        assert_eq!(reemitted, original);
    }

    #[test]
    fn binary_mode_round_trip() {
        let env = Envelope::from_json(&serde_json::to_vec(&sample()).unwrap()).unwrap();
        let (headers, body) = env.to_binary().unwrap();
        assert!(headers.iter().any(|(k, v)| k == "ce-id" && v == "9f21b4c8"));
        let back =
            Envelope::from_binary(headers.iter().map(|(k, v)| (k.as_str(), v.as_str())), &body)
                .unwrap();
        assert_eq!(back.id, env.id);
        assert_eq!(back.data, env.data);
        assert_eq!(back.time, env.time);
        assert_eq!(
            back.extensions.get("partitionhint"),
            Some(&Value::String("7".into()))
        );
        assert_eq!(back.tracestate, env.tracestate);
        assert_eq!(back.traceparent, env.traceparent);
    }

    #[test]
    fn oversized_points_to_the_claim_check() {
        let mut env = Envelope::new("/s", "a.b.v1");
        env.data = Some(Value::String("x".repeat(DEFAULT_MAX_SIZE)));
        let err = env.to_json().unwrap_err();
        assert!(matches!(err, EnvelopeError::TooLarge { .. }));
        assert!(err.to_string().contains("claim check"));
    }

    #[test]
    fn malformed_input_is_an_error_not_a_panic() {
        for bad in [
            &b"not json"[..],
            b"[]",
            b"{}",
            br#"{"specversion":"0.3","id":"1","source":"s","type":"t"}"#,
        ] {
            assert!(Envelope::from_json(bad).is_err());
        }
        assert!(Envelope::from_binary([("ce-id", "1")], b"").is_err());
    }

    #[test]
    fn types_must_carry_a_version() {
        for (ty, ok) in [
            ("a.placed.v1", true),
            ("a.placed.v12", true),
            ("a.placed", false),
            (".v1", false),
            ("a.vx", false),
        ] {
            let env = Envelope::new("/s", ty);
            assert_eq!(env.validate().is_ok(), ok, "{ty}");
        }
    }
}
