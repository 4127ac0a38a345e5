//! Long polling: `GET ?after=<seq>` answers at once when the stream has
//! events after the cursor, otherwise waits for one, up to the poll timeout.
//!
//! # Subscribe first, then read
//!
//! Reading first and subscribing second leaves a window: an event committed
//! after the read but before the subscription wakes nobody, and the request
//! sleeps for the whole timeout with news sitting in the log. So the handler
//! subscribes, *then* reads; an event committed at any point after the
//! subscription wakes it, and one committed before is found by the read.
//!
//! # Answers
//!
//! - `200` with `{"events": [{"seq", "type", "data", "at"}...], "cursor": <seq>}`
//!   (at most one read batch; poll again with `after=<cursor>`), plus
//!   `"truncated": true` when retention removed events the client had not
//!   seen yet (its cursor fell behind the retained window);
//! - `204` when nothing arrived within the poll timeout (25 s by default,
//!   below every proxy's idle timeout) or, when the request runs under a
//!   shorter deadline (a `DeadlineLayer` cap, the caller's
//!   `X-Request-Deadline-Unix-Ms`), half a second before that deadline, so
//!   a quiet poll is answered `204`, never `504`; or when the server began
//!   draining during the wait: the client polls again (reaching another
//!   instance);
//! - `400` for a malformed cursor, `401` when unauthenticated, `503` +
//!   `Retry-After` when the server is draining or the log is busy.
//!
//! Every answer carries `Cache-Control: no-store`: a cached poll would hide
//! events.

use axum::Json;
use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use std::time::Duration;

use keel_core::{Deadline, clock};
use keel_store::{EventLogStore, LoggedEvent};
use serde::Serialize;

use super::cloudevents;
use super::reject::{RealtimeRejection, after_param, refuse, store_failure};
use super::stream::StreamId;
use super::{Gauge, Realtime, wait_drain};

const TRANSPORT: &str = "long_poll";

/// One event in a long-poll answer.
#[derive(Debug, Serialize)]
struct EventBody<'a> {
    seq: i64,
    #[serde(rename = "type")]
    event_type: &'a str,
    data: &'a serde_json::Value,
    at: DateTime<Utc>,
}

#[derive(Debug, Serialize)]
struct PollBody<'a> {
    events: Vec<EventBody<'a>>,
    cursor: i64,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    truncated: bool,
}

/// The long-poll handler.
pub(crate) async fn handler<S: EventLogStore>(
    State(realtime): State<Realtime<S>>,
    request: Request,
) -> Response {
    let (parts, _body) = request.into_parts();
    if realtime.is_draining() {
        return refuse(TRANSPORT, RealtimeRejection::Draining);
    }
    let Some(stream) = realtime.authenticate(&parts) else {
        return refuse(TRANSPORT, RealtimeRejection::Unauthenticated);
    };
    let after = match after_param(&parts) {
        Ok(after) => after.unwrap_or(0),
        Err(rejection) => return refuse(TRANSPORT, rejection),
    };
    let Some(_slot) = realtime.claim_slot(&parts) else {
        return refuse(TRANSPORT, RealtimeRejection::TooManyConnections);
    };
    let options = realtime.options();
    let log = realtime.log();

    // Subscribe FIRST, then read: see the module docs.
    let mut subscription = log.subscribe(&stream);
    let deadline = wait_until(options.poll_timeout);
    let mut drain = realtime.drain_signal();
    let mut announced = after;
    let mut waiting = None;
    loop {
        let events = match log
            .read_after(&stream, after, options.read_batch.get())
            .await
        {
            Ok(events) => events,
            Err(err) => return store_failure(TRANSPORT, &err),
        };
        if !events.is_empty() {
            metrics::counter!("keel_long_poll_total", "outcome" => "events").increment(1);
            if cloudevents::wanted(&parts) {
                return cloudevents_response(after, &stream, &events, &options.source);
            }
            return events_response(after, &events);
        }
        waiting.get_or_insert_with(|| realtime.open(Gauge::LongPollWaiting));
        tokio::select! {
            biased;
            () = wait_drain(&mut drain) => return no_content("drained"),
            () = tokio::time::sleep_until(deadline) => return no_content("timeout"),
            latest = subscription.wait_beyond(announced) => announced = latest,
        }
    }
}

/// How long before the request's own deadline a quiet poll answers, so
/// that its `204` leaves in time.
pub const DEADLINE_MARGIN: Duration = Duration::from_millis(500);

/// When a quiet poll stops waiting: after `timeout`, or [`DEADLINE_MARGIN`]
/// before the deadline the request runs under, whichever comes first.
fn wait_until(timeout: Duration) -> clock::Instant {
    let now = clock::now();
    let until = now + timeout;
    match Deadline::current() {
        Some(deadline) => until.min(
            deadline
                .instant()
                .checked_sub(DEADLINE_MARGIN)
                .unwrap_or(now)
                .max(now),
        ),
        None => until,
    }
}

fn events_response(after: i64, events: &[LoggedEvent]) -> Response {
    let truncated = after > 0 && events.first().is_some_and(|e| e.seq > after + 1);
    if truncated {
        metrics::counter!("keel_realtime_truncated_total").increment(1);
    }
    let body = PollBody {
        events: events
            .iter()
            .map(|e| EventBody {
                seq: e.seq,
                event_type: &e.event_type,
                data: &e.data,
                at: e.at,
            })
            .collect(),
        cursor: events.last().map_or(after, |e| e.seq),
        truncated,
    };
    let mut response = Json(body).into_response();
    no_store(&mut response);
    response
}

/// The events as a CloudEvents batch; the cursor and truncation, which a
/// batch has no place for, go in headers.
fn cloudevents_response(
    after: i64,
    stream: &StreamId,
    events: &[LoggedEvent],
    source: &str,
) -> Response {
    let batch: Vec<serde_json::Value> = events
        .iter()
        .map(|e| cloudevents::event(stream, e, source))
        .collect();
    let mut response = Json(batch).into_response();
    let headers = response.headers_mut();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static(cloudevents::BATCH_CONTENT_TYPE),
    );
    let cursor = events.last().map_or(after, |e| e.seq);
    headers.insert(CURSOR_HEADER, HeaderValue::from(cursor));
    if after > 0 && events.first().is_some_and(|e| e.seq > after + 1) {
        metrics::counter!("keel_realtime_truncated_total").increment(1);
        headers.insert(TRUNCATED_HEADER, HeaderValue::from_static("true"));
    }
    no_store(&mut response);
    response
}

/// The cursor of a CloudEvents batch: send it back as `after`.
pub const CURSOR_HEADER: header::HeaderName = header::HeaderName::from_static("keel-cursor");

/// Set on a CloudEvents batch when events after `after` were trimmed.
pub const TRUNCATED_HEADER: header::HeaderName = header::HeaderName::from_static("keel-truncated");

fn no_content(outcome: &'static str) -> Response {
    metrics::counter!("keel_long_poll_total", "outcome" => outcome).increment(1);
    let mut response = StatusCode::NO_CONTENT.into_response();
    no_store(&mut response);
    response
}

fn no_store(response: &mut Response) {
    response
        .headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
}
