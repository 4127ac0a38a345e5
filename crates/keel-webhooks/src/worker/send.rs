//! One delivery attempt: sign, send, judge the answer.

use std::sync::Arc;

use axum::http::{HeaderMap, header};
use keel_store::{
    ClaimedDelivery, DeliveryAttempt, DeliveryOutcome, DeliveryStatus, WebhookDeliveryStore,
    WebhookEndpointStore,
};

use tracing::Instrument as _;

use crate::attempt::{self, AttemptResult};
use crate::signing::{Secret, signature_headers};
use crate::wire;

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
    let mut permanent = false;
    let rendered = if delivery.payload.len() > opts.max_payload {
        Err(format!(
            "payload is {} bytes; the limit is {}",
            delivery.payload.len(),
            opts.max_payload
        ))
    } else {
        wire::render(endpoint.format, &delivery.payload).map_err(|e| e.to_string())
    };
    let result = match rendered {
        Err(why) => {
            permanent = true;
            AttemptResult::failed(&endpoint.url, why)
        }
        Ok(wire) => {
            headers.extend(wire.headers.into_iter().map(|(k, v)| (Some(k), v)));
            let secrets: Vec<Secret> = endpoint
                .active_secrets(started)
                .filter_map(|s| match opts.sealer.open(&s.secret) {
                    Ok(secret) => Secret::parse(&secret).ok(),
                    Err(err) => {
                        tracing::error!(endpoint = %endpoint.id, error = %err, "cannot open an endpoint secret");
                        None
                    }
                })
                .collect();
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
                        &headers,
                        wire.body,
                        inner.limits,
                        opts.clock.unix_millis(),
                    )
                    .await
                }
                Err(err) => AttemptResult::failed(&endpoint.url, err.to_string()),
            }
        }
    };

    let finished_at = opts.clock.now();
    let success = result.status.is_some_and(|s| (200..300).contains(&s));
    let gone = result.status == Some(410);
    let mut exhausted = false;
    let (status, next_attempt_at) = if success {
        (DeliveryStatus::Succeeded, None)
    } else if gone {
        (DeliveryStatus::Disabled, None)
    } else if permanent {
        (DeliveryStatus::Failed, None)
    } else {
        match opts.backoff.delay(number - 1) {
            Some(delay) => {
                let asked = result
                    .retry_after
                    .map(|r| r.min(opts.max_retry_after))
                    .unwrap_or_default();
                let wait = delay.max(asked);
                let wait = chrono::Duration::from_std(wait).unwrap_or(chrono::Duration::MAX);
                (DeliveryStatus::Pending, Some(finished_at + wait))
            }
            None => {
                exhausted = true;
                (DeliveryStatus::Failed, None)
            }
        }
    };
    if result.refused {
        tracing::warn!(endpoint = %endpoint.id, error = ?result.error, "webhook attempt refused by the SSRF guard");
    }
    let request_headers = headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
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
            status,
            next_attempt_at,
        },
        endpoint_id: endpoint.id,
        url: endpoint.url,
        exhausted,
    }
}
