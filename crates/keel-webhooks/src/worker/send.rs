//! One delivery attempt: sign, send, judge the answer.

use std::sync::Arc;

use axum::http::{HeaderMap, header};
use chrono::{DateTime, Utc};
use keel_store::{
    ClaimedDelivery, DeliveryAttempt, DeliveryOutcome, DeliveryStatus, WebhookDelivery,
    WebhookDeliveryStore, WebhookEndpoint, WebhookEndpointStore,
};

use tracing::Instrument as _;

use crate::attempt::{self, AttemptResult};
use crate::options::WorkerOptions;
use crate::signing::{Secret, signature_headers};
use crate::wire::{self, Wire};

use super::{Finished, Inner};

/// Signs, sends and judges one delivery, in a span of its own: a child of
/// the trace the delivery was queued in.
pub(super) async fn attempt_one<S: WebhookDeliveryStore + WebhookEndpointStore>(
    inner: Arc<Inner<S>>,
    claimed: ClaimedDelivery,
) -> Finished {
    let span = delivery_span(&claimed);
    let finished = attempt(inner, claimed).instrument(span.clone()).await;
    let outcome = &finished.outcome;
    if let Some(status) = outcome.attempt.response_status {
        span.record("http.response.status_code", i64::from(status));
    }
    span.record("keel.webhook.outcome", outcome.status.as_str());
    if outcome.status != DeliveryStatus::Succeeded {
        span.record("otel.status_code", "ERROR");
    }
    finished
}

fn delivery_span(claimed: &ClaimedDelivery) -> tracing::Span {
    let ClaimedDelivery { delivery, endpoint } = claimed;
    let host = reqwest::Url::parse(&endpoint.url)
        .ok()
        .and_then(|u| u.host_str().map(str::to_owned));
    let span = tracing::info_span!(
        "webhook.deliver",
        otel.name = %format_args!("webhook {}", delivery.event_type),
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        "http.request.method" = "POST",
        "server.address" = host,
        "http.response.status_code" = tracing::field::Empty,
        "keel.webhook.endpoint" = %endpoint.id,
        "keel.webhook.event_id" = %delivery.event_id,
        "keel.webhook.attempt" = i64::from(delivery.attempts.saturating_add(1)),
        "keel.webhook.outcome" = tracing::field::Empty,
    );
    let queued_in = delivery.traceparent.as_deref().and_then(|t| t.parse().ok());
    keel_core::trace::span::child(&span, queued_in.as_ref(), None);
    span
}

async fn attempt<S: WebhookDeliveryStore + WebhookEndpointStore>(
    inner: Arc<Inner<S>>,
    claimed: ClaimedDelivery,
) -> Finished {
    let ClaimedDelivery { delivery, endpoint } = claimed;
    let opts = &inner.options;
    let started = opts.clock.now();
    let number = delivery.attempts.saturating_add(1);

    let mut headers = HeaderMap::with_capacity(12);
    headers.insert(header::USER_AGENT, inner.user_agent.clone());
    // A payload too large or unrenderable fails alike on every try, so it
    // is not retried.
    let (result, permanent) = match render_payload(opts, &delivery, &endpoint) {
        Err(why) => (AttemptResult::failed(&endpoint.url, why), true),
        Ok(wire) => (
            sign_and_post(&inner, &delivery, &endpoint, started, &mut headers, wire).await,
            false,
        ),
    };

    let finished_at = opts.clock.now();
    let verdict = judge(opts, &result, permanent, number, finished_at);
    if result.refused {
        tracing::warn!(endpoint = %endpoint.id, error = ?result.error, "webhook attempt refused by the SSRF guard");
    }
    let request_headers = logged_headers(&headers);
    Finished {
        outcome: DeliveryOutcome {
            attempt: DeliveryAttempt {
                delivery_id: delivery.id,
                attempt: number,
                at: started,
                url: result.url,
                request_headers,
                response_status: result.status,
                response_body: result.body,
                latency: result.latency,
                error: result.error,
            },
            status: verdict.status,
            next_attempt_at: verdict.next_attempt_at,
        },
        endpoint_id: endpoint.id,
        url: endpoint.url,
        exhausted: verdict.exhausted,
    }
}

/// The delivery's payload in its endpoint's format, or why it cannot be
/// sent at all.
fn render_payload(
    opts: &WorkerOptions,
    delivery: &WebhookDelivery,
    endpoint: &WebhookEndpoint,
) -> Result<Wire, String> {
    if delivery.payload.len() > opts.max_payload {
        Err(format!(
            "payload is {} bytes; the limit is {}",
            delivery.payload.len(),
            opts.max_payload
        ))
    } else {
        wire::render(endpoint.format, &delivery.payload).map_err(|e| e.to_string())
    }
}

/// Adds the wire and signature headers to `headers` and POSTs the body;
/// `headers` is left holding what was (or would have been) sent, for the
/// delivery log.
async fn sign_and_post<S>(
    inner: &Inner<S>,
    delivery: &WebhookDelivery,
    endpoint: &WebhookEndpoint,
    started: DateTime<Utc>,
    headers: &mut HeaderMap,
    wire: Wire,
) -> AttemptResult {
    let opts = &inner.options;
    headers.extend(wire.headers.into_iter().map(|(k, v)| (Some(k), v)));
    let secrets = open_secrets(opts, endpoint, started);
    match signature_headers(
        &opts.scheme,
        &secrets,
        &delivery.event_id,
        started.timestamp(),
        &wire.body,
    ) {
        Ok(signature) => {
            headers.extend(signature.into_iter().map(|(k, v)| (Some(k), v)));
            attempt::post(
                &inner.client,
                &opts.guard,
                &endpoint.url,
                headers,
                wire.body,
                inner.limits,
                opts.clock.unix_millis(),
            )
            .await
        }
        Err(err) => AttemptResult::failed(&endpoint.url, err.to_string()),
    }
}

/// The endpoint's secrets active at `at`, unsealed. A secret that cannot
/// be opened is logged and skipped, so the others still sign.
fn open_secrets(
    opts: &WorkerOptions,
    endpoint: &WebhookEndpoint,
    at: DateTime<Utc>,
) -> Vec<Secret> {
    endpoint
        .active_secrets(at)
        .filter_map(|s| match opts.sealer.open(&s.secret) {
            Ok(secret) => Secret::parse(&secret).ok(),
            Err(err) => {
                tracing::error!(endpoint = %endpoint.id, error = %err, "cannot open an endpoint secret");
                None
            }
        })
        .collect()
}

/// Where a delivery goes after one attempt.
struct Verdict {
    status: DeliveryStatus,
    next_attempt_at: Option<DateTime<Utc>>,
    /// Failed because the retry schedule is used up.
    exhausted: bool,
}

/// Judges attempt `number`'s `result`: succeeded, gone, failed for good, or
/// pending until the later of the backoff delay and the (bounded)
/// `Retry-After`.
fn judge(
    opts: &WorkerOptions,
    result: &AttemptResult,
    permanent: bool,
    number: u32,
    finished_at: DateTime<Utc>,
) -> Verdict {
    let settled = |status| Verdict {
        status,
        next_attempt_at: None,
        exhausted: false,
    };
    if result.status.is_some_and(|s| (200..300).contains(&s)) {
        return settled(DeliveryStatus::Succeeded);
    }
    if result.status == Some(410) {
        return settled(DeliveryStatus::Disabled);
    }
    if permanent {
        return settled(DeliveryStatus::Failed);
    }
    match opts.backoff.delay(number - 1) {
        Some(delay) => {
            let asked = result
                .retry_after
                .map(|r| r.min(opts.max_retry_after))
                .unwrap_or_default();
            let wait = delay.max(asked);
            let wait = chrono::Duration::from_std(wait).unwrap_or(chrono::Duration::MAX);
            Verdict {
                status: DeliveryStatus::Pending,
                next_attempt_at: Some(finished_at + wait),
                exhausted: false,
            }
        }
        None => Verdict {
            status: DeliveryStatus::Failed,
            next_attempt_at: None,
            exhausted: true,
        },
    }
}

/// The request headers as the delivery log stores them.
fn logged_headers(headers: &HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect()
}
