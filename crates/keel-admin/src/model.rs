//! The admin API's JSON bodies: what operators (and the `keel` CLI, which
//! deserializes these same types) see of dead letters, sagas, deliveries,
//! breakers and lag.
//!
//! Durations are milliseconds and times RFC 3339 in UTC, so the bodies read
//! the same from `curl`, a script or the console.

use std::collections::BTreeMap;
use std::time::Duration;

use chrono::{DateTime, Utc};
use keel_messaging::saga::SagaView;
use keel_policy::breaker::BreakerSnapshot;
use keel_store::{
    AttemptError, DeadLetter, DeadLetterStatus, OutboxStats, ParkedOutbox, SagaStatus,
};
#[cfg(feature = "webhooks")]
use keel_store::{DeliveryAttempt, DeliveryStatus, WebhookDelivery};
use serde::{Deserialize, Serialize};

use super::gauges::Gauge;

/// The longest payload preview in a dead-letter or delivery listing, in
/// bytes; `GET` of one item returns the whole payload.
pub const PAYLOAD_PREVIEW: usize = 512;

/// A list, with how many items it holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Listing<T> {
    /// The items.
    pub items: Vec<T>,
    /// How many.
    pub count: usize,
}

impl<T> From<Vec<T>> for Listing<T> {
    fn from(items: Vec<T>) -> Self {
        Self {
            count: items.len(),
            items,
        }
    }
}

/// One failed attempt at handling a dead letter's message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttemptJson {
    /// The delivery count of the attempt.
    pub attempt: u32,
    /// What went wrong.
    pub error: String,
    /// When.
    pub at: DateTime<Utc>,
}

impl From<&AttemptError> for AttemptJson {
    fn from(a: &AttemptError) -> Self {
        Self {
            attempt: a.attempt,
            error: a.error.clone(),
            at: a.at,
        }
    }
}

/// A dead letter as the admin API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeadLetterJson {
    /// The letter's id (`group:message-id`).
    pub id: String,
    /// `pending`, `replayed` or `discarded`.
    pub status: DeadLetterStatus,
    /// The topic it came from (and goes back to on replay).
    pub topic: String,
    /// Its partition key.
    pub key: String,
    /// The consumer group that gave up on it.
    pub group: String,
    /// Why (`permanent`, `too_many_attempts`, `malformed`, ...).
    pub error_kind: String,
    /// The original message id.
    pub message_id: String,
    /// When it was dead-lettered.
    pub dead_at: DateTime<Utc>,
    /// The last error, for listings.
    pub last_error: Option<String>,
    /// Every failed attempt, oldest first.
    pub history: Vec<AttemptJson>,
    /// Failures recorded for the original message after it was
    /// dead-lettered (e.g. a redelivery), oldest first; usually empty.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub later_failures: Vec<AttemptJson>,
    /// The message headers.
    pub headers: BTreeMap<String, String>,
    /// The payload as text (lossy UTF-8); cut to [`PAYLOAD_PREVIEW`] bytes
    /// in listings (see `payload_truncated`).
    pub payload: String,
    /// Whether `payload` was cut.
    #[serde(default)]
    pub payload_truncated: bool,
}

impl DeadLetterJson {
    /// The view of `letter`; with `preview`, the payload is cut.
    pub fn new(letter: &DeadLetter, preview: bool) -> Self {
        let (payload, payload_truncated) = payload_text(&letter.message.payload, preview);
        Self {
            id: letter.id.clone(),
            status: letter.status,
            topic: letter.message.topic.clone(),
            key: letter.message.key.clone(),
            group: letter.group.clone(),
            error_kind: letter.error_kind.clone(),
            message_id: letter.message.id.clone(),
            dead_at: letter.dead_at,
            last_error: letter.attempts.last().map(|a| a.error.clone()),
            history: letter.attempts.iter().map(AttemptJson::from).collect(),
            later_failures: Vec::new(),
            headers: letter
                .message
                .headers
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            payload,
            payload_truncated,
        }
    }
}

fn payload_text(payload: &[u8], preview: bool) -> (String, bool) {
    if preview && payload.len() > PAYLOAD_PREVIEW {
        let cut = &payload[..PAYLOAD_PREVIEW];
        (String::from_utf8_lossy(cut).into_owned(), true)
    } else {
        (String::from_utf8_lossy(payload).into_owned(), false)
    }
}

/// A saga as the admin API shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SagaJson {
    /// The saga id.
    pub id: String,
    /// The saga definition's name.
    pub kind: String,
    /// Where it is.
    pub status: SagaStatus,
    /// The step index (see `SagaRecord::step`).
    pub step: u32,
    /// The step it is at, in words, if known.
    pub step_name: Option<String>,
    /// Failed attempts at the current step.
    pub attempts: u32,
    /// Whether an attempt at the current step may have taken effect (it
    /// timed out or lost its reply): check the dependency under the step's
    /// key before telling the saga otherwise.
    #[serde(default)]
    pub outcome_unknown: bool,
    /// The last error.
    pub last_error: Option<String>,
    /// When it was started.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// Milliseconds since it started.
    pub age_ms: u64,
    /// Milliseconds since it last changed.
    pub idle_ms: u64,
    /// Its optimistic-concurrency version.
    pub version: i64,
    /// The saga's data.
    pub data: serde_json::Value,
}

impl From<SagaView> for SagaJson {
    fn from(view: SagaView) -> Self {
        let r = view.record;
        Self {
            id: r.id,
            kind: r.kind,
            status: r.status,
            step: r.step,
            step_name: view.step_name,
            attempts: r.attempts,
            outcome_unknown: r.outcome_unknown,
            last_error: r.last_error,
            created_at: r.created_at,
            updated_at: r.updated_at,
            age_ms: millis(view.age),
            idle_ms: millis(view.idle),
            version: r.version,
            data: r.data,
        }
    }
}

#[cfg(feature = "webhooks")]
/// One attempt at a webhook delivery.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeliveryAttemptJson {
    /// The attempt's number since the delivery was (re)queued.
    pub attempt: u32,
    /// When it started.
    pub at: DateTime<Utc>,
    /// The URL requested.
    pub url: String,
    /// The response status, if a response came.
    pub response_status: Option<u16>,
    /// The start of the response body.
    pub response_body: Option<String>,
    /// How long it took, in milliseconds.
    pub latency_ms: u64,
    /// What went wrong, if anything.
    pub error: Option<String>,
}

#[cfg(feature = "webhooks")]
impl From<&DeliveryAttempt> for DeliveryAttemptJson {
    fn from(a: &DeliveryAttempt) -> Self {
        Self {
            attempt: a.attempt,
            at: a.at,
            url: a.url.clone(),
            response_status: a.response_status,
            response_body: a.response_body.clone(),
            latency_ms: millis(a.latency),
            error: a.error.clone(),
        }
    }
}

#[cfg(feature = "webhooks")]
/// A webhook delivery as the admin API shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeliveryJson {
    /// The delivery id.
    pub id: i64,
    /// The endpoint it goes to.
    pub endpoint_id: String,
    /// The event id (`webhook-id`).
    pub event_id: String,
    /// The event type.
    pub event_type: String,
    /// Where it is.
    pub status: DeliveryStatus,
    /// Attempts since it was (re)queued.
    pub attempts: u32,
    /// Not attempted before this time.
    pub next_attempt_at: DateTime<Utc>,
    /// When it was queued.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
    /// The attempt log, oldest first (with `GET` of one delivery and in
    /// the console; empty in listings).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub attempt_log: Vec<DeliveryAttemptJson>,
}

#[cfg(feature = "webhooks")]
impl From<&WebhookDelivery> for DeliveryJson {
    fn from(d: &WebhookDelivery) -> Self {
        Self {
            id: d.id,
            endpoint_id: d.endpoint_id.clone(),
            event_id: d.event_id.clone(),
            event_type: d.event_type.clone(),
            status: d.status,
            attempts: d.attempts,
            next_attempt_at: d.next_attempt_at,
            created_at: d.created_at,
            updated_at: d.updated_at,
            attempt_log: Vec::new(),
        }
    }
}

/// A circuit breaker's state.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BreakerJson {
    /// The dependency.
    pub dependency: String,
    /// The endpoint, for an endpoint's own breaker.
    pub endpoint: Option<String>,
    /// `closed`, `open`, `half_open`, `forced_open` or `disabled`.
    pub state: String,
    /// Percentage of the window's calls that failed, once it is full enough.
    pub failure_rate: Option<f64>,
    /// Percentage of the window's calls that were slow.
    pub slow_call_rate: Option<f64>,
    /// Calls in the window.
    pub buffered_calls: u64,
    /// Failed calls in the window.
    pub failed_calls: u64,
    /// Failures in a row.
    pub consecutive_failures: u32,
    /// While open, milliseconds until a probe is let through.
    pub retry_after_ms: Option<u64>,
}

impl From<&BreakerSnapshot> for BreakerJson {
    fn from(s: &BreakerSnapshot) -> Self {
        let m = &s.metrics;
        Self {
            dependency: s.dependency.clone(),
            endpoint: s.endpoint.clone(),
            state: m.state.as_str().to_owned(),
            failure_rate: m.failure_rate,
            slow_call_rate: m.slow_call_rate,
            buffered_calls: m.buffered_calls,
            failed_calls: m.failed_calls,
            consecutive_failures: m.consecutive_failures,
            retry_after_ms: m.retry_after.map(millis),
        }
    }
}

/// The outbox's backlog.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutboxLagJson {
    /// Rows waiting to be published (parked rows not included).
    pub unpublished: u64,
    /// Age of the oldest of those rows, in milliseconds.
    pub oldest_unpublished_age_ms: Option<u64>,
    /// Rows parked because the broker refused them for good.
    #[serde(default)]
    pub parked: u64,
}

impl From<OutboxStats> for OutboxLagJson {
    fn from(s: OutboxStats) -> Self {
        Self {
            unpublished: s.unpublished,
            oldest_unpublished_age_ms: s.oldest_unpublished_age.map(millis),
            parked: s.parked,
        }
    }
}

/// A parked outbox row as the admin API shows it: an event the broker
/// refused for good, holding back the later events of its key until it is
/// replayed or discarded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParkedJson {
    /// The outbox row id (what replay and discard take).
    pub id: i64,
    /// The event id (the message id).
    pub event_id: String,
    /// The topic it is for.
    pub topic: String,
    /// Its partition key.
    pub key: String,
    /// Failed publish attempts, the refusal included.
    pub attempts: u32,
    /// Why the broker refused it.
    pub last_error: String,
    /// When the business transaction wrote it.
    pub created_at: DateTime<Utc>,
    /// When the relay parked it.
    pub parked_at: DateTime<Utc>,
    /// Later events of its key waiting behind it.
    pub held_back: u64,
    /// The message headers.
    pub headers: BTreeMap<String, String>,
    /// The payload as text (lossy UTF-8); cut to [`PAYLOAD_PREVIEW`] bytes
    /// in listings (see `payload_truncated`).
    pub payload: String,
    /// Whether `payload` was cut.
    #[serde(default)]
    pub payload_truncated: bool,
}

impl ParkedJson {
    /// The view of `row`; with `preview`, the payload is cut.
    pub fn new(row: &ParkedOutbox, preview: bool) -> Self {
        let (payload, payload_truncated) = payload_text(&row.record.payload, preview);
        Self {
            id: row.id,
            event_id: row.record.event_id.clone(),
            topic: row.record.topic.clone(),
            key: row.record.partition_key.clone(),
            attempts: row.attempts,
            last_error: row.last_error.clone(),
            created_at: row.created_at,
            parked_at: row.parked_at,
            held_back: row.held_back,
            headers: row.record.headers.clone(),
            payload,
            payload_truncated,
        }
    }
}

/// Outbox lag and the registered gauges (consumer lag, queue depths).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LagJson {
    /// The outbox's backlog.
    pub outbox: OutboxLagJson,
    /// Every gauge of every registered source.
    pub gauges: Vec<Gauge>,
}

/// Everything at a glance, for dashboards and the console's header.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SummaryJson {
    /// Pending dead letters by error kind, most frequent first.
    pub dead_letters_pending: BTreeMap<String, u64>,
    /// Sagas by status (empty without an orchestrator).
    pub sagas: BTreeMap<String, u64>,
    /// Breakers that are not closed, by `dependency[/endpoint]`.
    pub breakers_not_closed: BTreeMap<String, String>,
    /// The outbox's backlog.
    pub outbox: OutboxLagJson,
}

/// What an action did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActionJson {
    /// The action (`replayed`, `discarded`, `retried`, `cancelled`,
    /// `resent`).
    pub action: String,
    /// The id acted on (or the filter, for bulk replays).
    pub id: String,
    /// How many things it changed.
    pub affected: u64,
}

pub(crate) fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
