//! The demo's report as the table `keel demo` prints: the counts, then
//! the invariants' verdicts.

use std::fmt::Write as _;

use super::report::Report;

impl Report {
    /// The summary table.
    pub fn table(&self) -> String {
        let rows = self.counts();
        let checks = self.checks();
        let width = rows
            .iter()
            .chain(&checks)
            .map(|(k, _)| k.chars().count())
            .max()
            .unwrap_or(0);
        let mut out = String::new();
        let line = "─".repeat(width + 24);
        let _ = writeln!(out, "{line}");
        for (k, v) in &rows {
            let _ = writeln!(out, "{k:<width$}  {v}");
        }
        let _ = writeln!(out, "{line}");
        for (k, v) in &checks {
            let _ = writeln!(out, "{k:<width$}  {v}");
        }
        let _ = writeln!(out, "{line}");
        self.write_verdict(&mut out);
        out
    }

    /// What happened, one row a count.
    fn counts(&self) -> Vec<(&'static str, String)> {
        vec![
            ("orders sent", self.orders_sent.to_string()),
            ("orders accepted", self.orders_accepted.to_string()),
            ("orders rejected (4xx)", self.orders_rejected.to_string()),
            (
                "duplicates sent on purpose",
                self.duplicates_sent.to_string(),
            ),
            (
                "duplicates absorbed by idempotency keys",
                self.duplicates_absorbed.to_string(),
            ),
            (
                "  of which 409 in flight, then replayed",
                self.duplicate_in_flight_conflicts.to_string(),
            ),
            (
                "events published (outbox relay)",
                self.events_published.to_string(),
            ),
            ("effects applied (inbox)", self.effects_applied.to_string()),
            (
                "redeliveries deduped by the inbox",
                self.duplicates_deduped_by_inbox.to_string(),
            ),
            (
                "dependency effects (captures, refunds, ...)",
                self.dependency_effects.to_string(),
            ),
            ("sagas completed", self.sagas_completed.to_string()),
            ("sagas compensated", self.sagas_compensated.to_string()),
            ("sagas stuck", self.sagas_stuck.to_string()),
            ("sagas in another state", self.sagas_other.to_string()),
            ("dead letters", self.dead_letters.to_string()),
            ("breaker transitions", self.breaker_transitions.to_string()),
            (
                "calls refused by open breakers",
                self.breaker_rejections.to_string(),
            ),
            ("retries", self.retries.to_string()),
            (
                "retries refused by the budget",
                self.retry_budget_exhausted.to_string(),
            ),
            ("webhooks delivered", self.webhooks_received.to_string()),
            ("chaos experiment", self.experiment.clone()),
            ("shipping quotes", self.shipping_quotes.clone()),
            ("shipment watch (gRPC)", self.shipment_watch.clone()),
            (
                "latency p50 / p99",
                format!(
                    "{:.1} ms / {:.1} ms",
                    self.latency_p50_ms, self.latency_p99_ms
                ),
            ),
            ("elapsed", format!("{:.1} s", self.elapsed_s)),
            (
                "client calls ok / failed / unknown",
                format!(
                    "{} / {} / {}",
                    self.invariants.calls.ok,
                    self.invariants.calls.failed,
                    self.invariants.calls.unknown
                ),
            ),
            (
                "unknown outcomes recovered by a retry",
                self.invariants.recovered.to_string(),
            ),
            (
                "money captured − refunded",
                format!(
                    "{} − {} = {} cents",
                    self.money.captured_cents,
                    self.money.refunded_cents,
                    self.money.captured_cents - self.money.refunded_cents
                ),
            ),
            (
                "completed orders total",
                format!("{} cents", self.money.completed_orders_cents),
            ),
        ]
    }

    /// Each invariant's verdict, one row each.
    fn checks(&self) -> Vec<(&'static str, String)> {
        let verdict = |ok: bool| if ok { "ok" } else { "VIOLATED" };
        vec![
            (
                "lost = 0",
                format!(
                    "{} ({})",
                    verdict(self.invariants.lost == 0),
                    self.invariants.lost
                ),
            ),
            (
                "duplicated = 0",
                format!(
                    "{} ({})",
                    verdict(self.invariants.duplicated == 0),
                    self.invariants.duplicated
                ),
            ),
            (
                "unexpected = 0",
                format!(
                    "{} ({})",
                    verdict(self.invariants.unexpected == 0),
                    self.invariants.unexpected
                ),
            ),
            (
                "money conserved",
                verdict(self.invariants.money_conserved).to_owned(),
            ),
            (
                "every accepted order settled",
                verdict(self.quiescent).to_owned(),
            ),
        ]
    }

    /// The verdict line, then what was violated and which sagas did not
    /// settle.
    fn write_verdict(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "verdict: {}",
            if self.invariants.ok {
                "every invariant holds"
            } else {
                "INVARIANTS VIOLATED"
            }
        );
        for v in self.invariants.violations.iter().take(20) {
            let _ = writeln!(out, "  - {v}");
        }
        for saga in &self.unsettled_sagas {
            let _ = writeln!(out, "  - {saga}");
        }
    }
}
