//! `keel chaos`'s report and verdict: the demo's report, built by the
//! demo's invariant check once the last incarnation has settled, plus what
//! was injected and what became of it.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use keel_sqlite::{SqliteBroker, SqliteStore};
use serde::Serialize;

use super::schedule::{Crash, DEAD_LETTER_FAILPOINT, Schedule};
use crate::demo::report::{self, Report};
use crate::demo::wait_quiescent;
use crate::demo::workload::WorkloadResult;
use crate::shop::SystemHandle;

/// What happened to one scheduled crash.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CrashOutcome {
    /// The scheduled crash.
    #[serde(flatten)]
    pub crash: Crash,
    /// Orders actually accepted when the failpoint was armed.
    pub armed_at_orders: u64,
    /// Whether the failpoint fired.
    pub fired: bool,
    /// Milliseconds from the failpoint firing to the new incarnation
    /// answering (shutdown, close, reopen, start).
    pub restart_ms: Option<f64>,
    /// Orders sent after the workload ended because the failpoint had not
    /// fired by the time everything settled (it needed more work).
    pub tail_orders: u64,
}

/// `keel chaos`'s report: the demo's report plus what was injected.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChaosReport {
    /// The seed (pass it as `--seed` to replay the schedule).
    pub seed: u64,
    /// The schedule, one line per fault.
    pub schedule: Vec<String>,
    /// Every scheduled crash and what became of it.
    pub crashes: Vec<CrashOutcome>,
    /// Failpoints that fired (each a simulated process crash).
    pub crashes_fired: u64,
    /// Restarts of the whole system (store, broker, API, workers).
    pub restarts: u64,
    /// Broker calls failed or delayed during the broker outages.
    pub broker_faults_injected: u64,
    /// Poison orders sent so that the dead-letter failpoint has something
    /// to fire on (each ends as a dead letter, on purpose).
    pub poison_orders: u64,
    /// Orders sent after the workload for failpoints that needed more work
    /// to fire on (see [`CrashOutcome::tail_orders`]).
    pub tail_orders: u64,
    /// Where the files are, when kept.
    pub kept_dir: Option<PathBuf>,
    /// The demo's report: counts and the invariants' verdict.
    pub demo: Report,
    /// What went wrong beyond the demo's invariants: failpoints that never
    /// fired, sagas neither completed nor compensated.
    pub problems: Vec<String>,
    /// The invariants hold, every armed failpoint fired, and every saga
    /// completed or was fully compensated.
    pub ok: bool,
}

impl ChaosReport {
    /// The summary: the schedule, each crash's outcome, then the demo's
    /// table and verdict.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "fault schedule (seed {}):", self.seed);
        for line in &self.schedule {
            let _ = writeln!(out, "  {line}");
        }
        let _ = writeln!(
            out,
            "crashes fired: {} of {}, restarts: {}, broker faults injected: {}, poison orders: {}",
            self.crashes_fired,
            self.crashes.len(),
            self.restarts,
            self.broker_faults_injected,
            self.poison_orders
        );
        for c in &self.crashes {
            let outcome = match (c.fired, c.restart_ms) {
                (true, Some(ms)) => format!("fired, restarted in {ms:.0} ms"),
                (true, None) => "fired".to_owned(),
                (false, _) => "NEVER FIRED".to_owned(),
            };
            let _ = writeln!(
                out,
                "  {:<30} armed at order {:>5}: {outcome}",
                c.crash.failpoint, c.armed_at_orders
            );
        }
        out.push_str(&self.demo.table());
        for problem in &self.problems {
            let _ = writeln!(out, "  - {problem}");
        }
        let _ = writeln!(
            out,
            "chaos verdict: {}",
            if self.ok {
                "every invariant holds under the faults"
            } else {
                "FAILED"
            }
        );
        out
    }
}

impl ChaosReport {
    pub(super) fn new(
        schedule: &Schedule,
        crashes: Vec<CrashOutcome>,
        broker_faults_injected: u64,
        kept_dir: Option<PathBuf>,
        demo: Report,
    ) -> Self {
        let fired = |c: &&CrashOutcome| c.fired;
        let mut problems: Vec<String> = crashes
            .iter()
            .filter(|c| !c.fired)
            .map(|c| format!("failpoint {} was armed but never fired", c.crash.failpoint))
            .collect();
        if demo.sagas_stuck + demo.sagas_other > 0 {
            problems.push(format!(
                "{} sagas stuck and {} in another state: every saga must complete or be compensated",
                demo.sagas_stuck, demo.sagas_other
            ));
        }
        let ok = demo.invariants.ok && problems.is_empty();
        Self {
            seed: schedule.seed,
            schedule: schedule.lines(),
            crashes_fired: crashes.iter().filter(fired).count() as u64,
            restarts: crashes.iter().filter(|c| c.restart_ms.is_some()).count() as u64,
            broker_faults_injected,
            poison_orders: crashes
                .iter()
                .filter(|c| c.crash.failpoint == DEAD_LETTER_FAILPOINT)
                .count() as u64,
            tail_orders: crashes.iter().map(|c| c.tail_orders).sum(),
            crashes,
            kept_dir,
            demo,
            problems,
            ok,
        }
    }
}

/// Waits (until `until`) for the broker to hold no unsettled message: a
/// delivery a crash left leased is redelivered when its lease runs out, and
/// the verdict must include what the consumer made of that redelivery.
async fn broker_settled(broker: &SqliteBroker, until: keel_core::clock::Instant) -> bool {
    loop {
        let pending: Result<i64, _> =
            sqlx::query_scalar("SELECT COUNT(*) FROM keel_broker_pending")
                .fetch_one(broker.pool())
                .await;
        if matches!(pending, Ok(0)) {
            return true;
        }
        if keel_core::clock::now() >= until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits for the last incarnation to settle every order, then builds the
/// demo's report from the database and what the workload saw.
pub(super) async fn settle_and_check(
    handle: &SystemHandle<SqliteStore>,
    broker: &SqliteBroker,
    args: &super::ChaosArgs,
    result: &WorkloadResult,
    started: keel_core::clock::Instant,
) -> anyhow::Result<Report> {
    let until = keel_core::clock::now() + Duration::from_secs(args.settle_timeout);
    let quiet = wait_quiescent(
        &handle.store,
        Duration::from_secs(args.settle_timeout),
        || {},
    )
    .await
        && broker_settled(broker, until).await;
    let mut report =
        report::assemble(&handle.store, result, args.orders, started.elapsed(), quiet).await?;
    if !quiet {
        report.invariants.violations.push(
            "not every accepted order (and every message in the broker) settled within the wait"
                .into(),
        );
    }
    Ok(report)
}
