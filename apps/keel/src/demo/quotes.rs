//! The demo's scatter-gather: the order page's shipping quotes, asked of
//! three carriers of which one (`slowboat`) is always too slow. Every
//! answer must come back with the healthy carriers' quotes and say it is
//! partial; after the slow carrier ran out the budget often enough for its
//! breaker to open, it must stop being asked at all.

use std::time::Duration;

use crate::shop::model::ShippingQuotes;
use crate::shop::quotes::{CARRIERS, QUOTE_BUDGET, SLOW_CARRIER};

/// How many order pages ask for quotes: more than the shop's breakers'
/// minimum of 10 calls, so the slow carrier's breaker has opened by the
/// end.
pub const ASKS: usize = 16;

/// What the quotes showed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuotesOutcome {
    /// Answers received.
    pub asked: u64,
    /// Answers that said they were partial.
    pub partial: u64,
    /// Times the slow carrier was cut off at the budget.
    pub too_slow: u64,
    /// Times it was not asked because its breaker was open.
    pub not_asked: u64,
    /// What went wrong, if anything.
    pub violations: Vec<String>,
}

impl QuotesOutcome {
    /// The one-line summary for the report.
    pub fn summary(&self) -> String {
        format!(
            "{} asked, {} partial ({SLOW_CARRIER}: {} cut off at the {} ms budget, then {} not asked: its breaker was open)",
            self.asked,
            self.partial,
            self.too_slow,
            QUOTE_BUDGET.as_millis(),
            self.not_asked
        )
    }

    fn judge(&mut self, order_id: &str, answer: &ShippingQuotes, took: Duration) {
        self.asked += 1;
        self.partial += u64::from(answer.partial);
        let quoted: Vec<&str> = answer.quotes.iter().map(|q| q.carrier.as_str()).collect();
        let healthy: Vec<&str> = CARRIERS
            .into_iter()
            .filter(|c| *c != SLOW_CARRIER)
            .collect();
        if quoted != healthy {
            self.violations.push(format!(
                "quotes for {order_id}: {quoted:?}, expected the healthy carriers {healthy:?}"
            ));
        }
        match answer.missing.as_slice() {
            [m] if m.carrier == SLOW_CARRIER && m.reason == "too_slow" => self.too_slow += 1,
            [m] if m.carrier == SLOW_CARRIER && m.reason == "circuit_open" => self.not_asked += 1,
            other => self.violations.push(format!(
                "quotes for {order_id} did not say {SLOW_CARRIER} was missing: {other:?}"
            )),
        }
        if !answer.partial {
            self.violations
                .push(format!("quotes for {order_id} pretended to be complete"));
        }
        // The budget, plus room for the page's own work on a loaded machine.
        if took > QUOTE_BUDGET + Duration::from_secs(2) {
            self.violations.push(format!(
                "quotes for {order_id} took {took:?}: the budget did not hold"
            ));
        }
    }
}

/// Asks for the quotes of up to [`ASKS`] of `order_ids`, one after another.
pub async fn run(base_url: &str, order_ids: &[String]) -> anyhow::Result<QuotesOutcome> {
    let http = reqwest::Client::new();
    let mut outcome = QuotesOutcome::default();
    for order_id in order_ids.iter().cycle().take(ASKS) {
        let started = keel_core::clock::now();
        let answer: ShippingQuotes = http
            .get(format!("{base_url}/orders/{order_id}/shipping-quotes"))
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        outcome.judge(order_id, &answer, started.elapsed());
    }
    if order_ids.is_empty() {
        return Ok(outcome);
    }
    if outcome.not_asked == 0 {
        outcome.violations.push(format!(
            "{SLOW_CARRIER} was asked {} times: its breaker never spared it",
            outcome.too_slow
        ));
    }
    Ok(outcome)
}
