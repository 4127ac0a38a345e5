//! The demo's report and the invariant check behind its verdict.
//!
//! The check reads the facts back from the database (orders, outbox rows,
//! the inbox effects, every dependency effect in commit order, sagas, dead
//! letters) and feeds them to keel-testkit's [`Ledger`], which judges lost,
//! duplicated, leaked and out-of-order events and half-done sagas. Money is
//! checked on top: what payments captured minus what it refunded must equal
//! the totals of the completed orders, and no order is captured twice.

use std::collections::{BTreeMap, HashMap, HashSet};

use keel_ledger::Ledger;
use keel_store::{DeadLetterFilter, SagaStatus};
use serde::Serialize;

use super::workload::WorkloadResult;
use crate::api::orders::placed_event_id_for;
use crate::shop::ShopStore;
use crate::shop::db::Audit;
use crate::shop::fulfilment::GROUP;
use crate::shop::model::OrderStatus;
use crate::shop::saga::STEPS;

/// Money, in cents.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Money {
    /// Captured by payments.
    pub captured_cents: i64,
    /// Refunded by payments.
    pub refunded_cents: i64,
    /// The totals of completed orders.
    pub completed_orders_cents: i64,
    /// Orders captured more than once (must be 0).
    pub double_captures: u64,
    /// Captures whose amount differs from the order total (must be 0).
    pub wrong_amounts: u64,
}

impl Money {
    /// Whether `captured − refunded == completed totals`, with no double
    /// capture and no wrong amount.
    pub fn conserved(&self) -> bool {
        self.captured_cents - self.refunded_cents == self.completed_orders_cents
            && self.double_captures == 0
            && self.wrong_amounts == 0
    }
}

/// The invariants' verdict.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Invariants {
    /// Accepted orders or events that never took effect (must be 0).
    pub lost: u64,
    /// Orders, events or effects that happened twice (must be 0).
    pub duplicated: u64,
    /// Orders in the database that no client call could have placed (must
    /// be 0).
    pub unexpected: u64,
    /// Orders whose calls were not all known to succeed (a lost answer, a
    /// `5xx`, a restart) and that exist once: what retries under the same
    /// key resolved. Not a violation; a measure of how much was at stake.
    pub recovered: u64,
    /// Every client call, as ok, failed or unknown.
    pub calls: crate::demo::history::OutcomeCounts,
    /// Whether money is conserved.
    pub money_conserved: bool,
    /// Every violation, one line each, with ids.
    pub violations: Vec<String>,
    /// Whether everything holds.
    pub ok: bool,
}

/// The demo's summary, printed as a table or one JSON object.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Report {
    /// Distinct orders (keys) sent.
    pub orders_sent: u64,
    /// Orders accepted (201).
    pub orders_accepted: u64,
    /// Submissions refused with a 4xx (must be 0: the workload is valid).
    pub orders_rejected: u64,
    /// Duplicate submissions sent on purpose.
    pub duplicates_sent: u64,
    /// Duplicates answered with the first response by the idempotency layer.
    pub duplicates_absorbed: u64,
    /// `409` answers to concurrent duplicates (retried by the client).
    pub duplicate_in_flight_conflicts: u64,
    /// Events published by the relay.
    pub events_published: u64,
    /// Events applied by the consumer (inbox effects).
    pub effects_applied: u64,
    /// Effects applied by the dependencies (captures, reservations, ...).
    pub dependency_effects: u64,
    /// Redeliveries the consumer's inbox turned into no-ops.
    pub duplicates_deduped_by_inbox: u64,
    /// Sagas completed.
    pub sagas_completed: u64,
    /// Sagas compensated.
    pub sagas_compensated: u64,
    /// Sagas stuck (waiting for an operator).
    pub sagas_stuck: u64,
    /// Sagas in any other state at the end (running, compensating, cancelled).
    pub sagas_other: u64,
    /// Each saga neither completed nor compensated: its record and last
    /// error.
    pub unsettled_sagas: Vec<String>,
    /// Dead letters.
    pub dead_letters: u64,
    /// Circuit breaker state changes, all dependencies.
    pub breaker_transitions: u64,
    /// Calls a breaker refused.
    pub breaker_rejections: u64,
    /// Retries made by the dependency policies.
    pub retries: u64,
    /// Retries the retry budget refused.
    pub retry_budget_exhausted: u64,
    /// Webhook deliveries received by the demo's endpoint.
    pub webhooks_received: u64,
    /// What the chaos experiment (shipping down, marked requests only) showed.
    pub experiment: String,
    /// What the shipping quotes (scatter-gather over three carriers, one
    /// too slow) showed.
    pub shipping_quotes: String,
    /// Quote answers that said they were partial.
    pub quotes_partial: u64,
    /// What the gRPC watch of a shipment (dropped, then resumed) showed.
    pub shipment_watch: String,
    /// Request latency, median, in milliseconds.
    pub latency_p50_ms: f64,
    /// Request latency, 99th percentile, in milliseconds.
    pub latency_p99_ms: f64,
    /// The whole run, in seconds.
    pub elapsed_s: f64,
    /// Whether every accepted order settled within the wait.
    pub quiescent: bool,
    /// Money.
    pub money: Money,
    /// The verdict.
    pub invariants: Invariants,
}

/// Counts from the metrics recorder that the report shows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PolicyCounts {
    /// `keel_breaker_transitions_total`.
    pub breaker_transitions: u64,
    /// `keel_breaker_rejected_total`.
    pub breaker_rejections: u64,
    /// `keel_retry_attempts_total`.
    pub retries: u64,
    /// `keel_retry_budget_exhausted_total`.
    pub retry_budget_exhausted: u64,
    /// `keel_consumer_duplicates_total`.
    pub inbox_duplicates: u64,
}

impl PolicyCounts {
    /// Reads them from the process's recorder.
    pub fn now() -> Self {
        let t = crate::metrics_report::Totals::now();
        Self {
            breaker_transitions: t.get("keel_breaker_transitions_total"),
            breaker_rejections: t.get("keel_breaker_rejected_total"),
            retries: t.get("keel_retry_attempts_total"),
            retry_budget_exhausted: t.get("keel_retry_budget_exhausted_total"),
            inbox_duplicates: t.get("keel_consumer_duplicates_total"),
        }
    }
}

/// The report of a finished workload: checks the invariants on `store`,
/// reads the policies' counters, and fails the verdict when the system did
/// not settle (`settled` false) within the wait.
pub async fn assemble<S: ShopStore>(
    store: &S,
    workload: &WorkloadResult,
    orders_sent: u64,
    elapsed: std::time::Duration,
    settled: bool,
) -> Result<Report, keel_store::StoreError> {
    let (audit, dead, money, invariants) = check(store, workload).await?;
    let counts = PolicyCounts::now();
    let ms = |q: f64| workload.latency_us.value_at_quantile(q) as f64 / 1000.0;
    let mut report = Report {
        orders_sent,
        orders_accepted: workload.accepted.len() as u64,
        orders_rejected: workload.rejected,
        duplicates_sent: workload.duplicates_sent,
        duplicates_absorbed: workload.duplicates_absorbed,
        duplicate_in_flight_conflicts: workload.in_flight_conflicts,
        events_published: audit.published.len() as u64,
        effects_applied: audit.applied.len() as u64,
        dependency_effects: audit.effects.len() as u64,
        duplicates_deduped_by_inbox: counts.inbox_duplicates,
        dead_letters: dead.len() as u64,
        breaker_transitions: counts.breaker_transitions,
        breaker_rejections: counts.breaker_rejections,
        retries: counts.retries,
        retry_budget_exhausted: counts.retry_budget_exhausted,
        latency_p50_ms: ms(0.5),
        latency_p99_ms: ms(0.99),
        elapsed_s: elapsed.as_secs_f64(),
        quiescent: settled,
        money,
        invariants,
        ..Report::default()
    };
    count_sagas(&mut report, &audit);
    report.unsettled_sagas = unsettled_sagas(store, &audit).await?;
    if !settled {
        report.invariants.ok = false;
    }
    Ok(report)
}

/// Reads the facts back and checks every invariant against what the
/// workload saw accepted.
pub async fn check<S: ShopStore>(
    store: &S,
    workload: &WorkloadResult,
) -> Result<(Audit, Vec<String>, Money, Invariants), keel_store::StoreError> {
    let audit = store.audit().await?;
    check_audit(store, audit, workload).await
}

/// [`check`] on an `audit` gathered elsewhere (the shop's effects from the
/// dependencies' own store, say); `store` holds the dead letters.
pub async fn check_audit<S: ShopStore>(
    store: &S,
    audit: Audit,
    workload: &WorkloadResult,
) -> Result<(Audit, Vec<String>, Money, Invariants), keel_store::StoreError> {
    let dead = store
        .dead_letter_list(&DeadLetterFilter {
            limit: Some(100_000),
            ..DeadLetterFilter::default()
        })
        .await?;
    let dead_events: Vec<String> = dead
        .iter()
        .map(|d| {
            d.message
                .headers
                .get("event-id")
                .cloned()
                .unwrap_or_else(|| d.message.id.clone())
        })
        .collect();
    let ledger = Ledger::with_handlers([GROUP]);
    for order in &audit.orders {
        ledger.committed(&order.event_id, &order.id, 1);
    }
    for event in &audit.published {
        ledger.published(event);
    }
    for (event, handler) in &audit.applied {
        ledger.applied(event, handler);
    }
    for event in &dead_events {
        ledger.dead_lettered(event, GROUP);
    }
    for (id, _) in &audit.sagas {
        ledger.saga_started(id, STEPS);
    }
    for e in &audit.effects {
        if e.compensation {
            ledger.saga_compensation(&e.order_id, &e.step);
        } else {
            ledger.saga_action(&e.order_id, &e.step);
        }
    }
    for (id, status) in &audit.sagas {
        if let Some(status) = SagaStatus::parse(status) {
            ledger.saga_ended(id, status);
        }
    }
    let report = ledger.report();
    let mut violations = report.violations();

    let in_db: HashSet<&str> = audit.orders.iter().map(|o| o.id.as_str()).collect();
    let mut lost = (report.lost.len() + report.sagas_unsettled.len()) as u64;
    for a in &workload.accepted {
        if !in_db.contains(a.order_id.as_str()) {
            lost += 1;
            violations.push(format!(
                "accepted order {} (key {}) is not in the database",
                a.order_id, a.key
            ));
        }
    }
    for key in &workload.failed {
        lost += 1;
        violations.push(format!("key {key} was never accepted after every retry"));
    }
    let mut duplicated = (report.duplicated.len() + report.leaked.len()) as u64;
    for key in &workload.conflicting_keys {
        duplicated += 1;
        violations.push(format!("key {key} placed more than one order"));
    }
    let judged = judge_orders(&audit, workload, &mut violations);
    duplicated += judged.duplicated;
    let (unexpected, recovered) = (judged.unexpected, judged.recovered);

    let money = money(&audit, &mut violations);
    if !money.conserved() {
        violations.push(format!(
            "money not conserved: captured {} − refunded {} ≠ completed {}",
            money.captured_cents, money.refunded_cents, money.completed_orders_cents
        ));
    }
    let ok = violations.is_empty()
        && lost == 0
        && duplicated == 0
        && unexpected == 0
        && money.conserved();
    let invariants = Invariants {
        lost,
        duplicated,
        unexpected,
        recovered,
        calls: workload.calls,
        money_conserved: money.conserved(),
        violations,
        ok,
    };
    Ok((audit, dead_events, money, invariants))
}

/// What [`judge_orders`] found.
#[derive(Debug, Default)]
struct Judged {
    duplicated: u64,
    unexpected: u64,
    recovered: u64,
}

/// Judges every order in the database against the calls that could have
/// placed it (its event id names the key it was placed under), as Jepsen's
/// total-queue checker does: an order no call could have placed is
/// unexpected; a second order for a key whose client was told about
/// another is duplicated; one whose key had a call of unknown outcome is
/// recovered.
fn judge_orders(audit: &Audit, workload: &WorkloadResult, violations: &mut Vec<String>) -> Judged {
    let key_of: HashMap<String, &str> = workload
        .sent_keys
        .iter()
        .map(|k| (placed_event_id_for(b"", k.as_bytes()), k.as_str()))
        .collect();
    let told: HashMap<&str, &str> = workload
        .accepted
        .iter()
        .map(|a| (a.key.as_str(), a.order_id.as_str()))
        .collect();
    let unknown: HashSet<&str> = workload.unknown_keys.iter().map(String::as_str).collect();
    let mut judged = Judged::default();
    for order in &audit.orders {
        let Some(key) = key_of.get(&order.event_id) else {
            judged.unexpected += 1;
            violations.push(format!(
                "unexpected: order {} (event {}) was placed by no call of this workload",
                order.id, order.event_id
            ));
            continue;
        };
        match told.get(key) {
            Some(id) if *id != order.id => {
                judged.duplicated += 1;
                violations.push(format!(
                    "duplicated: key {key} placed order {} besides {id}, the one it was told about",
                    order.id
                ));
            }
            _ if unknown.contains(key) => judged.recovered += 1,
            _ => {}
        }
    }
    judged
}

fn money(audit: &Audit, violations: &mut Vec<String>) -> Money {
    let totals: HashMap<&str, i64> = audit
        .orders
        .iter()
        .map(|o| (o.id.as_str(), o.total_cents))
        .collect();
    let mut m = Money::default();
    let mut captures: BTreeMap<&str, u64> = BTreeMap::new();
    for e in audit.effects.iter().filter(|e| e.step == "capture_payment") {
        if e.compensation {
            m.refunded_cents -= e.amount_cents;
        } else {
            m.captured_cents += e.amount_cents;
            *captures.entry(e.order_id.as_str()).or_default() += 1;
            if totals.get(e.order_id.as_str()) != Some(&e.amount_cents) {
                m.wrong_amounts += 1;
                violations.push(format!(
                    "order {} captured {} cents, not its total",
                    e.order_id, e.amount_cents
                ));
            }
        }
    }
    for (order, n) in captures {
        if n > 1 {
            m.double_captures += 1;
            violations.push(format!("order {order} captured {n} times"));
        }
    }
    m.completed_orders_cents = audit
        .orders
        .iter()
        .filter(|o| o.status == OrderStatus::Completed)
        .map(|o| o.total_cents)
        .sum();
    m
}

/// Every saga that is neither completed nor compensated, with its record
/// and last error, one line each: what an operator (or a failed verdict)
/// needs to see first.
pub async fn unsettled_sagas<S: ShopStore>(
    store: &S,
    audit: &Audit,
) -> Result<Vec<String>, keel_store::StoreError> {
    let mut lines = Vec::new();
    for (id, status) in &audit.sagas {
        if matches!(
            SagaStatus::parse(status),
            Some(SagaStatus::Completed | SagaStatus::Compensated)
        ) {
            continue;
        }
        let line = match store.saga_get(id).await? {
            Some(r) => format!(
                "saga {id}: {status} at step {} after {} attempts (version {}), last error: {}",
                r.step,
                r.attempts,
                r.version,
                r.last_error.as_deref().unwrap_or("none")
            ),
            None => format!("saga {id}: {status}, record gone"),
        };
        lines.push(line);
    }
    Ok(lines)
}

/// Fills the saga counts of `report` from the audit.
pub fn count_sagas(report: &mut Report, audit: &Audit) {
    for (_, status) in &audit.sagas {
        match SagaStatus::parse(status) {
            Some(SagaStatus::Completed) => report.sagas_completed += 1,
            Some(SagaStatus::Compensated) => report.sagas_compensated += 1,
            Some(SagaStatus::Stuck) => report.sagas_stuck += 1,
            _ => report.sagas_other += 1,
        }
    }
}
