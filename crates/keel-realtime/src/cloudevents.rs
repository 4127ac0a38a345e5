//! The event log as CloudEvents, for clients that read them with a
//! CloudEvents SDK.
//!
//! A client asks with `?format=cloudevents` (SSE, long poll), or, on a long
//! poll, with `Accept: application/cloudevents-batch+json`. Each event is
//! then a CloudEvents 1.0 event in structured mode: a long poll answers a
//! JSON batch (`application/cloudevents-batch+json`, with the cursor in
//! `Keel-Cursor`), and an SSE `data:` line holds one event. Binary mode
//! carries one event per message, so it has no place in a batch or a
//! stream.
//!
//! | log | CloudEvents |
//! |---|---|
//! | the stream and seq | `id` (`<stream>/<seq>`), `subject` (the stream) |
//! | the seq | `sequence` extension, a decimal string |
//! | the event type | `type` |
//! | when it was appended | `time` |
//! | the data | `data`, `datacontenttype: application/json` |
//! | [`RealtimeOptions::source`](super::RealtimeOptions::source) | `source` |

use axum::http::header;
use axum::http::request::Parts;
use keel_store::LoggedEvent;
use keel_store::envelope::Envelope;

use super::stream::StreamId;

/// The content type of a batch of structured CloudEvents.
pub const BATCH_CONTENT_TYPE: &str = "application/cloudevents-batch+json";

/// The `format` query value that asks for CloudEvents.
pub const FORMAT_PARAM: &str = "cloudevents";

/// The `source` of the log's events unless
/// [`RealtimeOptions::source`](super::RealtimeOptions::source) says
/// otherwise.
pub const DEFAULT_SOURCE: &str = "/keel/event-log";

/// Whether the request asks for CloudEvents (see the module docs).
pub(crate) fn wanted(parts: &Parts) -> bool {
    let by_query = parts.uri.query().is_some_and(|query| {
        query
            .split('&')
            .any(|pair| pair.strip_prefix("format=") == Some(FORMAT_PARAM))
    });
    let by_accept = parts
        .headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|media| {
            media
                .split(';')
                .next()
                .is_some_and(|m| m.trim().eq_ignore_ascii_case(BATCH_CONTENT_TYPE))
        });
    by_query || by_accept
}

/// One logged event of `stream` as a structured CloudEvent.
pub(crate) fn event(stream: &StreamId, event: &LoggedEvent, source: &str) -> serde_json::Value {
    let mut cloud = Envelope::new(source, event.event_type.as_str());
    cloud.id = format!("{stream}/{}", event.seq);
    cloud.subject = Some(stream.to_string());
    cloud.time = Some(event.at);
    cloud.traceparent = None;
    cloud.data = Some(event.data.clone());
    cloud
        .extensions
        .insert("sequence".to_owned(), event.seq.to_string().into());
    serde_json::to_value(&cloud).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::Request;

    fn parts(uri: &str, accept: Option<&str>) -> Parts {
        let mut request = Request::get(uri);
        if let Some(accept) = accept {
            request = request.header(header::ACCEPT, accept);
        }
        request.body(()).expect("request").into_parts().0
    }

    #[test]
    fn clients_ask_by_query_or_by_accept() {
        assert!(wanted(&parts(
            "/updates?customerId=c&format=cloudevents",
            None
        )));
        assert!(wanted(&parts(
            "/updates",
            Some("text/plain, application/cloudevents-batch+json; q=0.9")
        )));
        assert!(!wanted(&parts("/updates?format=cloudeventsX", None)));
        assert!(!wanted(&parts("/updates", Some("application/json"))));
    }

    #[test]
    fn a_logged_event_becomes_a_structured_cloudevent() {
        let stream = StreamId::new("customer:c-1").expect("stream");
        let logged = LoggedEvent {
            seq: 7,
            event_type: "order.completed".into(),
            data: serde_json::json!({"orderId": "o-1"}),
            at: chrono::DateTime::from_timestamp_millis(1_764_000_000_000).expect("time"),
        };
        let cloud = event(&stream, &logged, DEFAULT_SOURCE);
        assert_eq!(cloud["specversion"], "1.0");
        assert_eq!(cloud["id"], "customer:c-1/7");
        assert_eq!(cloud["source"], DEFAULT_SOURCE);
        assert_eq!(cloud["type"], "order.completed");
        assert_eq!(cloud["subject"], "customer:c-1");
        assert_eq!(cloud["sequence"], "7");
        assert_eq!(cloud["datacontenttype"], "application/json");
        assert_eq!(cloud["data"]["orderId"], "o-1");
        assert!(cloud["time"].as_str().is_some());
    }
}
