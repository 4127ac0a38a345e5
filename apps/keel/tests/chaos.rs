//! `keel chaos` end to end, in process: the shop crashed at failpoints of
//! the relay, the consumer and the saga orchestrator, restarted on the same
//! files each time, under a flaky payments service, must still lose
//! nothing, duplicate nothing and conserve money.
//!
//! Failpoints are process-global: nextest runs each test in its own
//! process, so the tests here never see each other's failpoints.

#![cfg(feature = "chaos")]

use keel::chaos::schedule::Schedule;
use keel::chaos::{self, ChaosArgs, ChaosReport};

fn failpoints(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| (*n).to_owned()).collect()
}

async fn run(args: ChaosArgs) -> ChaosReport {
    assert!(
        chaos::init_tracing("off"),
        "the failpoint watch must be installed"
    );
    let report = chaos::run(args).await.expect("chaos run");
    println!("{}", report.table());
    report
}

fn assert_invariants(report: &ChaosReport) {
    let demo = &report.demo;
    assert_eq!(demo.invariants.lost, 0, "{:?}", demo.invariants.violations);
    assert_eq!(
        demo.invariants.duplicated, 0,
        "{:?}",
        demo.invariants.violations
    );
    assert_eq!(
        demo.invariants.unexpected, 0,
        "{:?}",
        demo.invariants.violations
    );
    assert!(demo.invariants.money_conserved, "{:?}", demo.money);
    assert!(demo.quiescent, "every accepted order settled");
    assert!(demo.invariants.ok, "{:?}", demo.invariants.violations);
    assert_eq!(
        demo.sagas_stuck + demo.sagas_other,
        0,
        "every saga completed or compensated: {:#?}",
        demo.unsettled_sagas
    );
    assert!(demo.sagas_completed > 0);
    assert!(report.ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashes_in_relay_consumer_and_saga_lose_and_duplicate_nothing() {
    let armed = failpoints(&[
        "relay-after-publish",
        "consumer-after-commit",
        "keel-saga-after-step",
        "consumer-after-dead-letter",
        "relay-after-claim",
    ]);
    let report = run(ChaosArgs {
        seed: Some(7),
        orders: 120,
        crashes: 5,
        failpoints: armed.clone(),
        settle_timeout: 60,
        ..ChaosArgs::default()
    })
    .await;

    // Each armed failpoint fired once, and each firing restarted the system.
    let fired: Vec<&str> = report
        .crashes
        .iter()
        .filter(|c| c.fired)
        .map(|c| c.crash.failpoint.as_str())
        .collect();
    assert_eq!(fired, armed.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(report.crashes_fired, 5);
    assert_eq!(report.restarts, 5);
    // The schedule it ran is the seed's: a rerun with seed 7 replays it.
    let replay = Schedule::new(7, 120, 5, &armed).expect("schedule");
    assert_eq!(report.schedule, replay.lines());
    // `--json` prints this object: the demo's report inside, the faults around it.
    let json = serde_json::to_value(&report).expect("json");
    assert_eq!(json["crashes_fired"], 5);
    assert_eq!(json["demo"]["invariants"]["lost"], 0);
    assert_eq!(json["demo"]["invariants"]["ok"], true);
    assert_eq!(json["crashes"][0]["failpoint"], "relay-after-publish");
    // The broker outages happened: publishes and receives were refused.
    assert!(report.broker_faults_injected > 0);
    for name in &armed {
        assert!(chaos::watch::fired(name) >= 1, "{name} reported its crash");
    }

    assert_invariants(&report);
    let demo = &report.demo;
    // Every order accepted across the restarts: the workload retried the
    // interrupted submissions with the same keys. A failpoint armed after
    // the system settled gets orders of its own to fire on (tail orders):
    // how many depends on timing, not on the seed.
    assert_eq!(
        demo.orders_accepted,
        120 + report.poison_orders + report.tail_orders
    );
    // The poison order is the only dead letter, on purpose.
    assert_eq!(report.poison_orders, 1);
    assert_eq!(demo.dead_letters, 1);
    assert_eq!(demo.events_published, demo.orders_accepted);
    // The consumer crashed after its commit but before its ack: the
    // redelivery (after the lease) was turned into a no-op by the inbox.
    assert!(
        demo.duplicates_deduped_by_inbox >= 1,
        "the redelivery was deduped"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_remaining_failpoints_are_survived_too() {
    let armed = failpoints(&[
        "consumer-after-inbox",
        "relay-after-mark",
        "consumer-after-handler",
        "keel-saga-after-claim",
        "consumer-after-ack",
    ]);
    let report = run(ChaosArgs {
        seed: Some(11),
        orders: 120,
        crashes: 5,
        failpoints: armed,
        settle_timeout: 60,
        ..ChaosArgs::default()
    })
    .await;
    assert_eq!(report.crashes_fired, 5, "{:?}", report.crashes);
    assert_eq!(report.restarts, 5);
    assert_invariants(&report);
}

/// A seeded schedule, failpoints picked by the seed: each seed is another
/// set of crash points, broker outages and payment faults. No retries: one
/// failure is a bug, and its seed replays the schedule. One test per seed,
/// so each has the whole time limit.
async fn seeded(seed: u64) {
    let report = run(ChaosArgs {
        seed: Some(seed),
        orders: 200,
        crashes: 3,
        settle_timeout: 60,
        ..ChaosArgs::default()
    })
    .await;
    eprintln!(
        "seed {seed}: calls ok/failed/unknown {:?}, recovered {}",
        report.demo.invariants.calls, report.demo.invariants.recovered
    );
    assert_invariants(&report);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_3_loses_duplicates_and_strands_nothing() {
    seeded(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_5_loses_duplicates_and_strands_nothing() {
    seeded(5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seed_13_loses_duplicates_and_strands_nothing() {
    seeded(13).await;
}

/// `keel chaos --seed 42` as the binary runs it (500 orders, 6 crashes at
/// seeded failpoints): `cargo nextest run -p keel --no-default-features
/// --test chaos --run-ignored only --no-capture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the full-size run: a minute or more in a debug build"]
async fn seed_42_full_run() {
    let report = run(ChaosArgs {
        seed: Some(42),
        ..ChaosArgs::default()
    })
    .await;
    println!("{}", serde_json::to_string(&report).unwrap_or_default());
    assert_invariants(&report);
}

/// The flags as `keel chaos` parses them (the binary flattens
/// [`ChaosArgs`] into its `chaos` subcommand, as here).
#[test]
fn chaos_args_parse_as_a_subcommand() {
    use clap::{Parser, Subcommand};

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(subcommand)]
        command: Command,
    }

    #[derive(Debug, Subcommand)]
    enum Command {
        Chaos(ChaosArgs),
    }

    let Command::Chaos(defaults) = Cli::try_parse_from(["keel", "chaos"])
        .expect("parse")
        .command;
    assert_eq!(defaults, ChaosArgs::default());
    let Command::Chaos(args) = Cli::try_parse_from([
        "keel",
        "chaos",
        "--seed",
        "42",
        "--orders",
        "150",
        "--crashes",
        "3",
        "--failpoints",
        "relay-after-publish,consumer-after-ack",
        "--backend",
        "embedded",
        "--keep-dir",
        "--json",
    ])
    .expect("parse")
    .command;
    assert_eq!(args.seed, Some(42));
    assert_eq!((args.orders, args.crashes), (150, 3));
    assert_eq!(
        args.failpoints,
        failpoints(&["relay-after-publish", "consumer-after-ack"])
    );
    assert!(args.keep_dir && args.json);
}
