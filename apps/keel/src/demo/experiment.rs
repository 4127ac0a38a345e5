//! The demo's chaos experiment, run through the edge as a mesh would:
//! requests marked `x-chaos-experiment: shipping-outage` reach the shop,
//! which forwards the mark to shipping, whose estimates then fail. The
//! order page must still answer, with shipping's last good estimate marked
//! stale, while unmarked requests keep getting fresh ones.

use keel_policy::chaos::EXPERIMENT_HEADER;
use serde_json::Value;

use crate::shop::services::SHIPPING_OUTAGE;

/// What the order page showed before, during and beside the experiment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExperimentOutcome {
    /// The one-line summary for the report.
    pub summary: String,
    /// What went wrong, if anything.
    pub violations: Vec<String>,
}

/// `(days, stale_seconds)` of the order page's estimate, if it has one.
async fn estimate(
    http: &reqwest::Client,
    url: &str,
    experiment: Option<&str>,
) -> anyhow::Result<Option<(u64, Option<u64>)>> {
    let mut request = http.get(url);
    if let Some(name) = experiment {
        request = request.header(EXPERIMENT_HEADER, name);
    }
    let order: Value = request.send().await?.error_for_status()?.json().await?;
    let estimate = &order["deliveryEstimate"];
    Ok(estimate["days"]
        .as_u64()
        .map(|days| (days, estimate["staleSeconds"].as_u64())))
}

/// Reads `order_id`'s page plainly, inside the experiment, and plainly
/// again, and judges what each showed.
pub async fn run(base_url: &str, order_id: &str) -> anyhow::Result<ExperimentOutcome> {
    let http = reqwest::Client::new();
    let url = format!("{base_url}/orders/{order_id}");
    let before = estimate(&http, &url, None).await?;
    let during = estimate(&http, &url, Some(SHIPPING_OUTAGE)).await?;
    let unmarked = estimate(&http, &url, None).await?;
    let mut violations = Vec::new();
    if !matches!(before, Some((_, None))) {
        violations.push(format!(
            "before the experiment the estimate was not fresh: {before:?}"
        ));
    }
    match (before, during) {
        (Some((days, _)), Some((stale_days, Some(_)))) if days == stale_days => {}
        _ => violations.push(format!(
            "in the experiment the last good estimate was not served stale: {during:?}"
        )),
    }
    if !matches!(unmarked, Some((_, None))) {
        violations.push(format!("unmarked traffic saw the experiment: {unmarked:?}"));
    }
    let summary = match during {
        Some((days, Some(age))) => format!(
            "shipping down for marked requests: last good estimate ({days} days, {age} s old) served; unmarked requests fresh"
        ),
        _ => "the fallback was not served".to_owned(),
    };
    Ok(ExperimentOutcome {
        summary,
        violations,
    })
}
