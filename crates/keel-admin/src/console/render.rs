//! The console's sections, rendered to HTML fragments from the admin
//! API's own JSON types: the page shows them, and the SSE stream pushes a
//! section again whenever its fragment changes.
//!
//! Times are rendered absolute (`data-since`) and turned into ages by the
//! page's script, so a fragment changes only when its data does and a
//! button an operator is about to press is not swapped out under them.

use std::collections::BTreeMap;
use std::fmt::Write as _;

#[cfg(feature = "webhooks")]
use keel_store::DeliveryStatus;
use keel_store::{DeadLetterStatus, SagaStatus};

use super::graph;
use super::html::{action_button, encode_segment, escape};
use super::trends;
#[cfg(feature = "webhooks")]
use crate::DeliveryJson;
use crate::history::{History, Measure, SubjectKind};
use crate::{AdminError, BreakerJson, DeadLetterJson, LagJson, ParkedJson, SagaJson, SummaryJson};

/// The section ids, in page order (webhook deliveries with the
/// `webhooks` feature).
pub(crate) const SECTIONS: &[&str] = &[
    "summary",
    "consumers",
    "dependencies",
    "sagas",
    "dead-letters",
    "parked-outbox",
    #[cfg(feature = "webhooks")]
    "webhook-deliveries",
    "breakers",
    "lag",
];

fn since(at: &chrono::DateTime<chrono::Utc>) -> String {
    let at = at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    format!("<span class=\"age\" data-since=\"{at}\" title=\"{at}\">{at}</span>")
}

fn error_note(err: &AdminError) -> String {
    format!(
        "<p class=\"error\" data-section-error>could not load: {}</p>",
        escape(&err.to_string())
    )
}

/// A section's fragment, or the error that kept it from loading.
pub(crate) fn or_error<T>(
    result: Result<T, AdminError>,
    render: impl FnOnce(T) -> String,
) -> String {
    match result {
        Ok(value) => render(value),
        Err(err) => error_note(&err),
    }
}

pub(crate) fn summary(s: &SummaryJson, history: Option<&History>) -> String {
    let dead: u64 = s.dead_letters_pending.values().sum();
    let stuck = s
        .sagas
        .get(SagaStatus::Stuck.as_str())
        .copied()
        .unwrap_or(0);
    let running = ["running", "compensating"]
        .iter()
        .filter_map(|k| s.sagas.get(*k))
        .sum::<u64>();
    let mut out = String::from("<dl class=\"tiles\">");
    let tile = |out: &mut String, key: &str, label: &str, value: String, alert: bool| {
        let class = if alert { " class=\"alert\"" } else { "" };
        let _ = write!(
            out,
            "<div{class}><dt>{label}</dt><dd data-summary=\"{key}\">{value}</dd></div>"
        );
    };
    tile(
        &mut out,
        "dead-letters",
        "pending dead letters",
        dead.to_string(),
        dead > 0,
    );
    tile(
        &mut out,
        "parked-outbox",
        "parked outbox rows",
        s.outbox.parked.to_string(),
        s.outbox.parked > 0,
    );
    tile(
        &mut out,
        "stuck-sagas",
        "stuck sagas",
        stuck.to_string(),
        stuck > 0,
    );
    tile(
        &mut out,
        "active-sagas",
        "active sagas",
        running.to_string(),
        false,
    );
    tile(
        &mut out,
        "open-breakers",
        "breakers not closed",
        s.breakers_not_closed.len().to_string(),
        !s.breakers_not_closed.is_empty(),
    );
    let outbox = trends::inline(history, SubjectKind::Outbox, "outbox", Measure::Unpublished);
    tile(
        &mut out,
        "outbox",
        "outbox backlog",
        format!("{}{outbox}", s.outbox.unpublished),
        false,
    );
    let critical = history
        .map(|h| h.series(SubjectKind::Order, "orders", Measure::CriticalP99))
        .unwrap_or_default();
    if !critical.is_empty() {
        let svg = graph::sparkline(
            &critical,
            Measure::CriticalP99.as_str(),
            Measure::CriticalP99.label(),
            graph::SPARK,
        );
        tile(
            &mut out,
            "critical-time",
            "order intake→settled p99 (s)",
            format!("{}{svg}", graph::short(graph::last(&critical))),
            false,
        );
    }
    out.push_str("</dl>");
    out
}

pub(crate) fn sagas(counts: &BTreeMap<String, u64>, sagas: &[SagaJson]) -> String {
    let mut out = String::from("<p class=\"counts\">");
    for (status, n) in counts {
        let _ = write!(
            out,
            "<span class=\"pill {0}\" data-saga-count=\"{0}\">{0}: {n}</span> ",
            escape(status)
        );
    }
    out.push_str("</p>");
    if sagas.is_empty() {
        out.push_str("<p class=\"empty\">No saga is running, compensating or stuck.</p>");
        return out;
    }
    out.push_str(
        "<table><thead><tr><th>saga</th><th>kind</th><th>state</th><th>step</th>\
         <th>attempts</th><th>last error</th><th>age</th><th>idle</th><th></th></tr></thead><tbody>",
    );
    for s in sagas {
        let id = escape(&s.id);
        let path = format!("/console/sagas/{}", encode_segment(&s.id));
        let step = s
            .step_name
            .as_deref()
            .map(escape)
            .unwrap_or_else(|| s.step.to_string());
        let mut actions = String::new();
        if s.status == SagaStatus::Stuck {
            actions.push_str(&action_button(
                &format!("{path}/retry"),
                "retry",
                "Retry",
                &[("saga-id", &s.id)],
                None,
            ));
        }
        if !s.status.is_terminal() {
            actions.push_str(&action_button(
                &format!("{path}/cancel"),
                "cancel",
                "Cancel",
                &[("saga-id", &s.id)],
                Some("Cancel this saga and undo its steps?"),
            ));
        }
        let _ = write!(
            out,
            "<tr data-saga-id=\"{id}\" data-status=\"{status}\"><td><code>{id}</code></td>\
             <td>{kind}</td><td><span class=\"pill {status}\">{status}</span></td><td>{step}</td>\
             <td>{attempts}</td><td class=\"err\">{error}</td><td>{age}</td><td>{idle}</td>\
             <td class=\"actions\">{actions}</td></tr>",
            status = s.status.as_str(),
            kind = escape(&s.kind),
            attempts = s.attempts,
            error = escape(s.last_error.as_deref().unwrap_or("")),
            age = since(&s.created_at),
            idle = since(&s.updated_at),
        );
    }
    out.push_str("</tbody></table>");
    out
}

pub(crate) fn dead_letters(letters: &[DeadLetterJson]) -> String {
    if letters.is_empty() {
        return "<p class=\"empty\">No pending dead letters.</p>".to_owned();
    }
    let mut out = String::from(
        "<table><thead><tr><th>letter</th><th>topic / key</th><th>group</th><th>kind</th>\
         <th>error history</th><th>dead since</th><th></th></tr></thead><tbody>",
    );
    for l in letters {
        let id = escape(&l.id);
        let path = format!("/console/dead-letters/{}", encode_segment(&l.id));
        let mut history = String::new();
        for a in &l.history {
            let _ = write!(
                history,
                "<li data-attempt=\"{}\">#{} {} — {}</li>",
                a.attempt,
                a.attempt,
                since(&a.at),
                escape(&a.error)
            );
        }
        let last = escape(l.last_error.as_deref().unwrap_or("(no error recorded)"));
        let mut actions = String::new();
        if l.status == DeadLetterStatus::Pending {
            actions.push_str(&action_button(
                &format!("{path}/replay"),
                "replay",
                "Replay",
                &[("dead-letter-id", &l.id)],
                None,
            ));
            actions.push_str(&action_button(
                &format!("{path}/discard"),
                "discard",
                "Discard",
                &[("dead-letter-id", &l.id)],
                Some("Throw this message away for good?"),
            ));
        }
        let _ = write!(
            out,
            "<tr data-dead-letter-id=\"{id}\" data-status=\"{status}\"><td><code>{id}</code></td>\
             <td>{topic} / <code>{key}</code></td><td>{group}</td><td>{kind}</td>\
             <td><details><summary>{n} attempt(s): {last}</summary><ol class=\"history\">{history}</ol>\
             <pre class=\"payload\">{payload}</pre></details></td><td>{dead}</td>\
             <td class=\"actions\">{actions}</td></tr>",
            status = l.status.as_str(),
            topic = escape(&l.topic),
            key = escape(&l.key),
            group = escape(&l.group),
            kind = escape(&l.error_kind),
            n = l.history.len(),
            payload = escape(&l.payload),
            dead = since(&l.dead_at),
        );
    }
    out.push_str("</tbody></table>");
    out
}

pub(crate) fn parked_outbox(rows: &[ParkedJson]) -> String {
    if rows.is_empty() {
        return "<p class=\"empty\">No parked outbox rows: the broker accepted every event.</p>"
            .to_owned();
    }
    let mut out = String::from(
        "<table><thead><tr><th>row</th><th>topic / key</th><th>event</th><th>attempts</th>\
         <th>broker's refusal</th><th>waiting behind it</th><th>parked since</th><th></th>\
         </tr></thead><tbody>",
    );
    for r in rows {
        let id = r.id.to_string();
        let path = format!("/console/outbox/parked/{id}");
        let mut actions = action_button(
            &format!("{path}/replay"),
            "replay",
            "Replay",
            &[("parked-id", &id)],
            None,
        );
        actions.push_str(&action_button(
            &format!("{path}/discard"),
            "discard",
            "Discard",
            &[("parked-id", &id)],
            Some("Throw this event away for good? It will never be published."),
        ));
        let _ = write!(
            out,
            "<tr data-parked-id=\"{id}\"><td>{id}</td>\
             <td>{topic} / <code>{key}</code></td><td><code>{event}</code></td>\
             <td>{attempts}</td><td class=\"err\"><details><summary>{error}</summary>\
             <pre class=\"payload\">{payload}</pre></details></td><td>{held}</td><td>{parked}</td>\
             <td class=\"actions\">{actions}</td></tr>",
            topic = escape(&r.topic),
            key = escape(&r.key),
            event = escape(&r.event_id),
            attempts = r.attempts,
            error = escape(&r.last_error),
            payload = escape(&r.payload),
            held = r.held_back,
            parked = since(&r.parked_at),
        );
    }
    out.push_str("</tbody></table>");
    out
}

#[cfg(feature = "webhooks")]
pub(crate) fn deliveries(deliveries: &[DeliveryJson]) -> String {
    if deliveries.is_empty() {
        return "<p class=\"empty\">No webhook deliveries yet.</p>".to_owned();
    }
    let mut out = String::from(
        "<table><thead><tr><th>#</th><th>endpoint</th><th>event</th><th>state</th>\
         <th>attempts</th><th>queued</th><th></th></tr></thead><tbody>",
    );
    for d in deliveries {
        let mut log = String::new();
        for a in &d.attempt_log {
            let outcome = match (a.response_status, &a.error) {
                (Some(status), _) => format!("HTTP {status}"),
                (None, Some(err)) => escape(err),
                (None, None) => "no answer".to_owned(),
            };
            let _ = write!(
                log,
                "<li>#{} {} {} ms — {}</li>",
                a.attempt,
                since(&a.at),
                a.latency_ms,
                outcome
            );
        }
        let resend = if d.status == DeliveryStatus::Pending {
            String::new()
        } else {
            action_button(
                &format!("/console/webhook-deliveries/{}/resend", d.id),
                "resend",
                "Resend",
                &[("delivery-id", &d.id.to_string())],
                None,
            )
        };
        let _ = write!(
            out,
            "<tr data-delivery-id=\"{id}\" data-status=\"{status}\"><td>{id}</td>\
             <td><code>{endpoint}</code></td><td>{event_type}<br><code>{event}</code></td>\
             <td><span class=\"pill {status}\">{status}</span></td>\
             <td><details><summary>{n}</summary><ol class=\"history\">{log}</ol></details></td>\
             <td>{queued}</td><td class=\"actions\">{resend}</td></tr>",
            id = d.id,
            status = d.status.as_str(),
            endpoint = escape(&d.endpoint_id),
            event_type = escape(&d.event_type),
            event = escape(&d.event_id),
            n = d.attempts,
            queued = since(&d.created_at),
        );
    }
    out.push_str("</tbody></table>");
    out
}

pub(crate) fn breakers(breakers: &[BreakerJson], history: Option<&History>) -> String {
    if breakers.is_empty() {
        return "<p class=\"empty\">No circuit breaker has been used yet.</p>".to_owned();
    }
    let mut out = String::from(
        "<table><thead><tr><th>dependency</th><th>state</th><th>failure rate</th>\
         <th>slow rate</th><th>calls (failed)</th><th>failures in a row</th><th>last 15 min</th></tr></thead><tbody>",
    );
    let rate = |r: Option<f64>| r.map(|r| format!("{r:.1}%")).unwrap_or_else(|| "—".into());
    for b in breakers {
        let name = match &b.endpoint {
            Some(endpoint) => format!("{}/{endpoint}", b.dependency),
            None => b.dependency.clone(),
        };
        let _ = write!(
            out,
            "<tr data-breaker=\"{name}\" data-state=\"{state}\"><td>{name}</td>\
             <td><span class=\"pill {state}\">{state}</span></td><td>{failure}</td><td>{slow}</td>\
             <td>{calls} ({failed})</td><td>{row}</td><td>{timeline}</td></tr>",
            name = escape(&name),
            state = escape(&b.state),
            failure = rate(b.failure_rate),
            slow = rate(b.slow_call_rate),
            calls = b.buffered_calls,
            failed = b.failed_calls,
            row = b.consecutive_failures,
            timeline = trends::breaker_timeline(history, &name),
        );
    }
    out.push_str("</tbody></table>");
    out
}

pub(crate) fn lag(lag: &LagJson, history: Option<&History>) -> String {
    let oldest = lag
        .outbox
        .oldest_unpublished_age_ms
        .map(|ms| format!("{ms} ms"))
        .unwrap_or_else(|| "—".into());
    let outbox = trends::inline(history, SubjectKind::Outbox, "outbox", Measure::Unpublished);
    let mut out = format!(
        "<table><thead><tr><th>gauge</th><th>labels</th><th>value</th><th>last 15 min</th></tr></thead><tbody>\
         <tr data-gauge=\"outbox_unpublished\"><td>outbox unpublished</td><td></td><td>{}</td><td>{outbox}</td></tr>\
         <tr data-gauge=\"outbox_oldest_age\"><td>outbox oldest unpublished</td><td></td><td>{oldest}</td></tr>\
         <tr data-gauge=\"outbox_parked\"><td>outbox parked</td><td></td><td>{}</td></tr>",
        lag.outbox.unpublished, lag.outbox.parked
    );
    for g in &lag.gauges {
        let labels: Vec<String> = g
            .labels
            .iter()
            .map(|(k, v)| format!("{}={}", escape(k), escape(v)))
            .collect();
        let unit = g.unit.as_deref().map(escape).unwrap_or_default();
        let _ = write!(
            out,
            "<tr data-gauge=\"{name}\"><td>{name}</td><td>{labels}</td><td>{value} {unit}</td><td>{spark}</td></tr>",
            spark = gauge_spark(g, history),
            name = escape(&g.name),
            labels = labels.join(", "),
            value = g.value,
        );
    }
    out.push_str("</tbody></table>");
    out
}

/// A consumer-lag gauge's group's lag over the window (the history sums
/// the group's topics).
fn gauge_spark(gauge: &crate::Gauge, history: Option<&History>) -> String {
    match (gauge.name.as_str(), gauge.labels.get("group")) {
        ("consumer_lag", Some(group)) => {
            trends::inline(history, SubjectKind::ConsumerGroup, group, Measure::Lag)
        }
        _ => String::new(),
    }
}
