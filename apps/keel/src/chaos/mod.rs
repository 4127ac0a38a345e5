//! `keel chaos`: the demo's workload while the system is crashed and
//! restarted on a seeded schedule, judged by the demo's invariant check.
//!
//! A crash is modelled as in keel-sqlite's crash matrix: at a scheduled
//! point of the workload a keel-messaging failpoint is armed (`1*return`);
//! when it fires, the component stops dead right after a durable step,
//! exactly as if the process had died there. The run then restarts the
//! whole system: it shuts it down, closes the store and the embedded
//! broker, and starts a new incarnation on the same two files and the same
//! port, as a supervisor restarts a dead process. Meanwhile the payments
//! service fails and slows down on its own schedule, and the workload keeps
//! sending, retrying every submission the restart interrupts with the same
//! Idempotency-Key. At the end nothing may be lost or duplicated, money must
//! be conserved, and every saga must be completed or fully compensated.
//!
//! The schedule is a pure function of the seed ([`schedule::Schedule`]):
//! the same `--seed` replays the same faults at the same points of the
//! workload (thread timing is not reproducible, so the interleavings
//! around them differ).

pub mod broker;
pub mod kill;
pub mod report;
pub mod schedule;
mod system;
pub mod watch;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use serde::Serialize;

use crate::demo::quiescent;
use crate::demo::workload::{self, Accepted, Progress, WorkloadConfig};
use broker::BrokerFaults;
use schedule::{
    BROKER_ABORT_PERCENT, BROKER_DELAY, BROKER_DELAY_PERCENT, BrokerOutage, COMPENSATION_FAILPOINT,
    Crash, DEAD_LETTER_FAILPOINT, Schedule,
};
use system::{Incarnation, submit_poison, submit_refused, submit_tail};

pub use report::{ChaosReport, CrashOutcome};
pub use watch::init_tracing;

/// How long an armed failpoint may take to fire before the run gives up on
/// it (and reports it as not fired).
const FIRE_TIMEOUT: Duration = Duration::from_secs(30);

/// Orders sent after the workload ended, at most, for failpoints armed
/// when nothing was left to trip over.
const TAIL_ORDERS: usize = 48;

/// Where the system's state lives; `keel chaos` restarts it there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// A SQLite store and the SQLite broker, each in a file of the run's
    /// directory (the broker is closed and reopened at every restart).
    #[default]
    Embedded,
}

/// `keel chaos`'s arguments.
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct ChaosArgs {
    /// Seeds the fault schedule and the workload (random when omitted; the
    /// seed is printed, so a run can be replayed).
    #[arg(long)]
    pub seed: Option<u64>,
    /// How many distinct orders to submit.
    #[arg(long, default_value_t = 500)]
    pub orders: u64,
    /// How many crashes (each followed by a restart of the whole system).
    #[arg(long, default_value_t = 6)]
    pub crashes: u32,
    /// Crash at these failpoints, in this order (comma-separated), instead
    /// of a seeded pick.
    #[arg(long, value_delimiter = ',')]
    pub failpoints: Vec<String>,
    /// Requests in flight at most.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// The longest wait, in seconds, for every order to settle at the end.
    #[arg(long, default_value_t = 120)]
    pub settle_timeout: u64,
    /// Where the state lives.
    #[arg(long, value_enum, default_value_t = Backend::Embedded)]
    pub backend: Backend,
    /// Keep the run's directory (the SQLite files) and print its path.
    #[arg(long)]
    pub keep_dir: bool,
    /// Print the report as one JSON object on the last line of stdout.
    #[arg(long)]
    pub json: bool,
}

impl Default for ChaosArgs {
    fn default() -> Self {
        Self {
            seed: None,
            orders: 500,
            crashes: 6,
            failpoints: Vec::new(),
            concurrency: 16,
            settle_timeout: 120,
            backend: Backend::Embedded,
            keep_dir: false,
            json: false,
        }
    }
}

/// Removes every failpoint the run armed, however it ends.
struct Disarm(Vec<String>);

impl Drop for Disarm {
    fn drop(&mut self) {
        for failpoint in &self.0 {
            fail::remove(failpoint);
        }
    }
}

/// What the crash loop and the outage driver share.
struct Harness {
    dir: tempfile::TempDir,
    listen: SocketAddr,
    base_url: String,
    schedule: Schedule,
    broker_faults: BrokerFaults,
    progress: Arc<Progress>,
}

impl Harness {
    fn accepted(&self) -> u64 {
        self.progress.accepted.load(Ordering::Relaxed)
    }

    /// Waits until `orders` orders are accepted or the workload ended.
    async fn reach(&self, orders: u64, load: &tokio::task::JoinHandle<impl Send>) {
        while self.accepted() < orders && !load.is_finished() {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Arms the crash's failpoint, waits for it to fire, and restarts the
    /// system as incarnation `i + 1`.
    async fn crash(
        &self,
        i: usize,
        crash: &Crash,
        system: &mut Option<Incarnation>,
        load: &tokio::task::JoinHandle<impl Send>,
        extra: &mut Vec<(String, tokio::task::JoinHandle<Option<Accepted>>)>,
    ) -> anyhow::Result<CrashOutcome> {
        self.reach(crash.after_orders, load).await;
        let armed_at_orders = self.accepted();
        let before = watch::fired(&crash.failpoint);
        fail::cfg(crash.failpoint.as_str(), "1*return").map_err(anyhow::Error::msg)?;
        if crash.failpoint == DEAD_LETTER_FAILPOINT {
            let key = format!("chaos-{}-poison-{i}", self.schedule.seed);
            let submitted = tokio::spawn(submit_poison(self.base_url.clone(), key.clone()));
            extra.push((key, submitted));
        } else if crash.failpoint == COMPENSATION_FAILPOINT {
            let key = format!("chaos-{}-refused-{i}", self.schedule.seed);
            let submitted = tokio::spawn(submit_refused(self.base_url.clone(), key.clone()));
            extra.push((key, submitted));
        }
        let store = system.as_ref().map(|s| s.handle.store.clone());
        let mut tail = 0;
        let fired = watch::wait_fired(&crash.failpoint, before, FIRE_TIMEOUT, async || {
            let settled = match &store {
                Some(store) => matches!(quiescent(store).await, Ok(true)),
                None => true,
            };
            if !(load.is_finished() && settled) {
                return false;
            }
            // The workload outran the schedule (a dead letter takes its
            // redeliveries): give the failpoint more of the work it fires on
            // instead of reporting it never fired.
            if tail >= TAIL_ORDERS {
                return true;
            }
            for _ in 0..4 {
                let key = format!("chaos-{}-tail-{i}-{tail}", self.schedule.seed);
                let n = tail as u64;
                let submitted = tokio::spawn(submit_tail(self.base_url.clone(), key.clone(), n));
                extra.push((key, submitted));
                tail += 1;
            }
            false
        })
        .await;
        fail::remove(&crash.failpoint);
        let mut outcome = CrashOutcome {
            crash: crash.clone(),
            armed_at_orders,
            fired,
            restart_ms: None,
            tail_orders: tail as u64,
        };
        if !fired {
            eprintln!(
                "  {} armed at order {armed_at_orders} never fired",
                crash.failpoint
            );
            return Ok(outcome);
        }
        let down = keel_core::clock::now();
        if let Some(old) = system.take() {
            old.stop().await;
        }
        let incarnation = u32::try_from(i + 1).unwrap_or(u32::MAX);
        *system = Some(self.start(incarnation).await?);
        let ms = down.elapsed().as_secs_f64() * 1000.0;
        eprintln!(
            "  crash #{} at {} (order {armed_at_orders}): restarted in {ms:.0} ms",
            i + 1,
            crash.failpoint
        );
        outcome.restart_ms = Some(ms);
        Ok(outcome)
    }

    async fn start(&self, incarnation: u32) -> anyhow::Result<Incarnation> {
        Incarnation::start(
            self.dir.path(),
            self.listen,
            self.schedule.payments_faults(incarnation),
            &self.broker_faults,
            incarnation == 0,
        )
        .await
    }

    /// Switches the broker outages on and off as the workload reaches them.
    async fn broker_outages(&self, load: &tokio::task::JoinHandle<impl Send>) {
        for BrokerOutage {
            after_orders,
            for_ms,
        } in &self.schedule.broker
        {
            self.reach(*after_orders, load).await;
            self.broker_faults.set_enabled(true);
            tokio::time::sleep(Duration::from_millis(*for_ms)).await;
            self.broker_faults.set_enabled(false);
        }
    }
}

/// `keel chaos`: runs the workload under the seeded schedule of crashes,
/// restarts and dependency faults; then checks the invariants.
pub async fn run(args: ChaosArgs) -> anyhow::Result<ChaosReport> {
    watch::ensure_installed()?;
    crate::metrics_report::install();
    let seed = args.seed.unwrap_or_else(|| fastrand::u64(..));
    let schedule = Schedule::new(seed, args.orders, args.crashes, &args.failpoints)?;
    let Backend::Embedded = args.backend;
    let broker_faults = BrokerFaults::new(
        seed,
        BROKER_ABORT_PERCENT,
        BROKER_DELAY_PERCENT,
        BROKER_DELAY,
    )?;
    let mut harness = Harness {
        dir: tempfile::tempdir()?,
        listen: SocketAddr::from(([127, 0, 0, 1], 0)),
        base_url: String::new(),
        schedule,
        broker_faults,
        progress: Arc::new(Progress::default()),
    };
    eprintln!(
        "keel chaos: {} orders, {} crashes, SQLite files in {}\n{}",
        args.orders,
        harness.schedule.crashes.len(),
        harness.dir.path().display(),
        harness.schedule
    );
    let faults_before = crate::metrics_report::Totals::now().get("keel_fault_injected_total");
    let started = keel_core::clock::now();
    let first = harness.start(0).await?;
    harness.listen = first.handle.addr;
    harness.base_url.clone_from(&first.handle.base_url);
    let mut system = Some(first);

    let config = WorkloadConfig {
        orders: args.orders,
        concurrency: args.concurrency.max(1),
        seed,
        ..WorkloadConfig::default()
    };
    let load = {
        let (url, progress) = (harness.base_url.clone(), Arc::clone(&harness.progress));
        tokio::spawn(async move { workload::run(&url, &config, progress).await })
    };
    let _disarm = Disarm(
        harness
            .schedule
            .crashes
            .iter()
            .map(|c| c.failpoint.clone())
            .collect(),
    );
    let mut extra = Vec::new();
    let crashes = async {
        let mut outcomes = Vec::new();
        for (i, crash) in harness.schedule.crashes.iter().enumerate() {
            outcomes.push(
                harness
                    .crash(i, crash, &mut system, &load, &mut extra)
                    .await?,
            );
        }
        anyhow::Ok(outcomes)
    };
    let (outcomes, ()) = tokio::join!(crashes, harness.broker_outages(&load));
    let outcomes = outcomes?;

    let mut result = load.await??;
    for (key, submitted) in extra {
        result.sent_keys.push(key.clone());
        match submitted.await? {
            Some(accepted) => result.accepted.push(accepted),
            None => result.failed.push(key),
        }
    }
    let system = system.ok_or_else(|| anyhow::anyhow!("the system is not running"))?;
    let demo =
        report::settle_and_check(&system.handle, &system.broker, &args, &result, started).await?;
    system.stop().await;
    let kept_dir = args.keep_dir.then(|| {
        let path = harness.dir.keep();
        eprintln!("keel chaos: the files are kept in {}", path.display());
        path
    });
    Ok(ChaosReport::new(
        &harness.schedule,
        outcomes,
        crate::metrics_report::Totals::now()
            .get("keel_fault_injected_total")
            .saturating_sub(faults_before),
        kept_dir,
        demo,
    ))
}
