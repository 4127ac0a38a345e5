//! How a delivery goes on the wire, in the endpoint's [`WebhookFormat`].
//!
//! A delivery is queued once, as the Standard Webhooks body, and rendered
//! per endpoint when it is sent, so endpoints of one event may each speak
//! their own format. CloudEvents receivers get a CloudEvents 1.0 event in
//! structured or binary mode, which the CloudEvents SDKs read as is:
//!
//! | Standard Webhooks | CloudEvents |
//! |---|---|
//! | `id` | `id` |
//! | `type` | `type` |
//! | `timestamp` | `time` |
//! | `source` (or [`DEFAULT_SOURCE`]) | `source` |
//! | `sequence` | `sequence` extension, a decimal string |
//! | `data` | `data`, `datacontenttype: application/json` |
//!
//! `standard-webhooks-thin` is the Standard Webhooks body with `data`
//! cut down to its identifiers, for endpoints that must not receive the
//! resource itself ("fetch, don't trust": the receiver calls the sender's
//! authenticated API for it, and so also gets its current state, not a
//! possibly stale copy).
//!
//! Every format is signed alike: the Standard Webhooks signature covers
//! the exact body sent.

use axum::http::{HeaderName, HeaderValue, header};
use bytes::Bytes;
use chrono::{DateTime, Utc};
use keel_store::WebhookFormat;
use keel_store::envelope::{Envelope, STRUCTURED_CONTENT_TYPE};
use serde::Deserialize;

use super::error::WebhookError;

/// The CloudEvents `source` of a webhook queued without one.
pub const DEFAULT_SOURCE: &str = "/keel/webhooks";

/// The queued body, as [`WebhookEvent::to_body`](super::WebhookEvent::to_body)
/// writes it.
#[derive(Deserialize)]
struct Queued {
    id: String,
    #[serde(rename = "type")]
    event_type: String,
    timestamp: DateTime<Utc>,
    #[serde(default)]
    sequence: Option<i64>,
    #[serde(default)]
    source: Option<String>,
    #[serde(default)]
    data: serde_json::Value,
}

/// The headers and body one delivery is sent with (before signing).
#[derive(Debug)]
pub(crate) struct Wire {
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
    pub(crate) body: Bytes,
}

/// Renders a queued `payload` in `format`.
pub(crate) fn render(format: WebhookFormat, payload: &Bytes) -> Result<Wire, WebhookError> {
    let json = |value: &'static str| vec![(header::CONTENT_TYPE, HeaderValue::from_static(value))];
    match format {
        WebhookFormat::StandardWebhooks => Ok(Wire {
            headers: json("application/json"),
            body: payload.clone(),
        }),
        WebhookFormat::StandardWebhooksThin => Ok(Wire {
            headers: json("application/json"),
            body: thin(payload)?,
        }),
        WebhookFormat::CloudeventsStructured => {
            let body = cloudevent(payload)?
                .to_json_limited(usize::MAX)
                .map_err(|e| WebhookError::invalid("payload", e.to_string()))?;
            Ok(Wire {
                headers: json(STRUCTURED_CONTENT_TYPE),
                body: Bytes::from(body),
            })
        }
        WebhookFormat::CloudeventsBinary => {
            let (attributes, body) = cloudevent(payload)?
                .to_binary()
                .map_err(|e| WebhookError::invalid("payload", e.to_string()))?;
            let headers = attributes
                .into_iter()
                .map(|(name, value)| {
                    let name = HeaderName::try_from(name)
                        .map_err(|e| WebhookError::invalid("payload", e.to_string()))?;
                    let value = HeaderValue::try_from(value)
                        .map_err(|e| WebhookError::invalid("payload", e.to_string()))?;
                    Ok((name, value))
                })
                .collect::<Result<_, WebhookError>>()?;
            Ok(Wire {
                headers,
                body: Bytes::from(body),
            })
        }
    }
}

/// The queued body with `data` cut down to its identifiers.
fn thin(payload: &Bytes) -> Result<Bytes, WebhookError> {
    let mut body: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(payload)
        .map_err(|e| WebhookError::invalid("payload", format!("not a queued webhook: {e}")))?;
    let identifier = |(name, value): &(&String, &serde_json::Value)| {
        (name.as_str() == "id" || name.ends_with("Id") || name.ends_with("_id"))
            && (value.is_string() || value.is_number())
    };
    let ids: serde_json::Map<String, serde_json::Value> = match body.get("data") {
        Some(serde_json::Value::Object(data)) => data
            .iter()
            .filter(identifier)
            .map(|(name, value)| (name.clone(), value.clone()))
            .collect(),
        _ => serde_json::Map::new(),
    };
    body.insert("data".to_owned(), serde_json::Value::Object(ids));
    serde_json::to_vec(&body)
        .map(Bytes::from)
        .map_err(|e| WebhookError::invalid("payload", e.to_string()))
}

/// The queued body as a CloudEvent.
fn cloudevent(payload: &Bytes) -> Result<Envelope, WebhookError> {
    let queued: Queued = serde_json::from_slice(payload)
        .map_err(|e| WebhookError::invalid("payload", format!("not a queued webhook: {e}")))?;
    let mut event = Envelope::new(
        queued.source.unwrap_or_else(|| DEFAULT_SOURCE.to_owned()),
        queued.event_type,
    );
    event.id = queued.id;
    event.time = Some(queued.timestamp);
    event.traceparent = None;
    event.data = Some(queued.data);
    if let Some(sequence) = queued.sequence {
        event
            .extensions
            .insert("sequence".to_owned(), sequence.to_string().into());
    }
    Ok(event)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queued() -> Bytes {
        Bytes::from_static(
            br#"{"id":"evt_1","type":"order.paid","timestamp":"2026-11-29T10:00:00.000Z","sequence":7,"source":"/shop","data":{"orderId":"A-1"}}"#,
        )
    }

    fn header<'a>(wire: &'a Wire, name: &str) -> Option<&'a str> {
        wire.headers
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.to_str().ok())
    }

    #[test]
    fn standard_webhooks_is_the_queued_body() {
        let wire = render(WebhookFormat::StandardWebhooks, &queued()).expect("renders");
        assert_eq!(wire.body, queued());
        assert_eq!(header(&wire, "content-type"), Some("application/json"));
    }

    #[test]
    fn the_thin_format_keeps_the_envelope_and_only_the_identifiers_of_data() {
        let queued = Bytes::from_static(
            br#"{"id":"evt_1","type":"order.paid","timestamp":"2026-11-29T10:00:00.000Z","sequence":7,"data":{"orderId":"A-1","customer_id":"c-9","id":42,"email":"a@example.com","totalCents":1999,"cardId":{"last4":"4242"}}}"#,
        );
        let wire = render(WebhookFormat::StandardWebhooksThin, &queued).expect("renders");
        assert_eq!(header(&wire, "content-type"), Some("application/json"));
        let body: serde_json::Value = serde_json::from_slice(&wire.body).expect("json");
        assert_eq!(body["id"], "evt_1");
        assert_eq!(body["type"], "order.paid");
        assert_eq!(body["sequence"], 7);
        assert_eq!(
            body["data"],
            serde_json::json!({"orderId": "A-1", "customer_id": "c-9", "id": 42}),
            "no email, no amount, no nested object"
        );
    }

    #[test]
    fn structured_mode_holds_every_attribute_in_the_body() {
        let wire = render(WebhookFormat::CloudeventsStructured, &queued()).expect("renders");
        assert_eq!(header(&wire, "content-type"), Some(STRUCTURED_CONTENT_TYPE));
        let event: serde_json::Value = serde_json::from_slice(&wire.body).expect("json");
        assert_eq!(event["specversion"], "1.0");
        assert_eq!(event["id"], "evt_1");
        assert_eq!(event["source"], "/shop");
        assert_eq!(event["type"], "order.paid");
        assert_eq!(event["time"], "2026-11-29T10:00:00Z");
        assert_eq!(event["sequence"], "7");
        assert_eq!(event["data"]["orderId"], "A-1");
    }

    #[test]
    fn binary_mode_moves_the_attributes_to_headers() {
        let wire = render(WebhookFormat::CloudeventsBinary, &queued()).expect("renders");
        assert_eq!(header(&wire, "ce-id"), Some("evt_1"));
        assert_eq!(header(&wire, "ce-type"), Some("order.paid"));
        assert_eq!(header(&wire, "ce-source"), Some("/shop"));
        assert_eq!(header(&wire, "ce-time"), Some("2026-11-29T10:00:00.000Z"));
        assert_eq!(header(&wire, "ce-sequence"), Some("7"));
        assert_eq!(header(&wire, "content-type"), Some("application/json"));
        let data: serde_json::Value = serde_json::from_slice(&wire.body).expect("json");
        assert_eq!(data, serde_json::json!({"orderId": "A-1"}));
    }

    #[test]
    fn a_payload_queued_without_a_source_gets_the_default() {
        let bare = Bytes::from_static(
            br#"{"id":"evt_2","type":"t","timestamp":"2026-11-29T10:00:00Z","data":null}"#,
        );
        let wire = render(WebhookFormat::CloudeventsBinary, &bare).expect("renders");
        assert_eq!(header(&wire, "ce-source"), Some(DEFAULT_SOURCE));
        assert!(header(&wire, "ce-sequence").is_none());
    }
}
