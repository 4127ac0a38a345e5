//! The `keel` binary: `keel demo` runs the reference shop on the embedded
//! defaults and checks its invariants; `keel serve` runs it as a server;
//! `keel chaos` (feature `chaos`) runs the demo under seeded faults;
//! `keel dlq`, `keel outbox`, `keel saga`, `keel webhooks` and `keel status`
//! are the operator commands against a running server; `keel mesh` checks a
//! service mesh's resources against Keel's rules.

use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
#[cfg(feature = "chaos")]
use keel::chaos::{self, ChaosArgs};
use keel::demo::workload::WorkloadConfig;
use keel::demo::{self, DemoConfig};
use keel::serve::{self, ServeArgs};

#[cfg(feature = "mimalloc")]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

// The operator commands: a client of the admin API. Its items are `pub` so
// the module reads like the library's; in a binary that is unreachable.
#[allow(unreachable_pub)]
mod ops;

#[allow(unreachable_pub)]
mod mesh;

/// Keel: services that survive the network.
#[derive(Debug, Parser)]
#[command(name = "keel", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the reference shop with a workload of orders and check the invariants.
    Demo(DemoArgs),
    /// Run the reference shop as a server (API, console, admin API).
    Serve(Box<ServeArgs>),
    /// Run the demo's workload while crashing and restarting the system on
    /// a seeded schedule of faults, then check the invariants.
    #[cfg(feature = "chaos")]
    Chaos(ChaosArgs),
    /// Dead letters on a running server: list, replay, discard.
    Dlq {
        #[command(flatten)]
        client: ops::AdminClientArgs,
        #[command(subcommand)]
        command: ops::DlqCommand,
    },
    /// Parked outbox rows (events the broker refused) on a running server:
    /// list, show, replay, discard.
    Outbox {
        #[command(flatten)]
        client: ops::AdminClientArgs,
        #[command(subcommand)]
        command: ops::OutboxCommand,
    },
    /// Sagas on a running server: list, retry, cancel.
    Saga {
        #[command(flatten)]
        client: ops::AdminClientArgs,
        #[command(subcommand)]
        command: ops::SagaCommand,
    },
    /// What changed on a running server: throughput, lag, latency and
    /// breaker state per consumer group and dependency, as sparklines.
    Status(ops::StatusArgs),
    /// One set of numbers for the app and the service mesh: check Istio
    /// resources against Keel's rules, or export Keel's policy as them.
    Mesh {
        #[command(subcommand)]
        command: mesh::MeshCommand,
    },
    /// Webhook deliveries on a running server: list, resend.
    Webhooks {
        #[command(flatten)]
        client: ops::AdminClientArgs,
        #[command(subcommand)]
        command: ops::WebhooksCommand,
    },
}

#[derive(Debug, Args)]
struct DemoArgs {
    /// How many distinct orders to submit.
    #[arg(long, default_value_t = 1000)]
    orders: u64,
    /// Requests in flight at most.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// Seeds the workload's choice of customers and skus.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// The longest wait, in seconds, for every order to settle.
    #[arg(long, default_value_t = 60)]
    settle_timeout: u64,
    /// Print the report as one JSON object on the last line of stdout.
    #[arg(long)]
    json: bool,
    /// `sqlite` (the embedded defaults in a temporary directory) or
    /// `postgres+nats` (the servers of --database-url and --broker).
    #[arg(long, default_value = "sqlite")]
    backend: String,
    /// With `--backend postgres+nats`: the PostgreSQL URL.
    #[arg(long, env = "KEEL_DATABASE_URL")]
    database_url: Option<String>,
    /// With `--backend postgres+nats`: the NATS URL.
    #[arg(long, env = "KEEL_BROKER")]
    broker: Option<String>,
}

fn init_tracing(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("KEEL_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// `keel serve`'s logs and span export, as its settings ask.
fn serve_telemetry(args: &serve::ServeArgs) -> anyhow::Result<keel_otel::Telemetry> {
    Ok(args.telemetry()?.install()?)
}

async fn demo_command(args: DemoArgs) -> anyhow::Result<bool> {
    let backend = keel::backend::demo_backend(
        &args.backend,
        args.database_url.as_deref(),
        args.broker.as_deref(),
    )?;
    let config = DemoConfig {
        workload: WorkloadConfig {
            orders: args.orders,
            concurrency: args.concurrency.max(1),
            seed: args.seed,
            ..WorkloadConfig::default()
        },
        settle_timeout: Duration::from_secs(args.settle_timeout),
        progress: true,
        backend,
    };
    let report = demo::run(config).await?;
    print!("{}", report.table());
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    }
    Ok(report.invariants.ok)
}

async fn serve_command(args: ServeArgs) -> anyhow::Result<bool> {
    // A test build's failpoints that kill the process (the fault harness's).
    #[cfg(feature = "chaos")]
    if chaos::kill::arm_from_env()? > 0 {
        tracing::warn!(
            "{} is set: this process kills itself at failpoints",
            chaos::kill::KILL_AT_ENV
        );
    }
    serve::run(args).await.map(|()| true)
}

#[cfg(feature = "chaos")]
async fn chaos_command(args: ChaosArgs) -> anyhow::Result<bool> {
    let json = args.json;
    let report = chaos::run(args).await?;
    print!("{}", report.table());
    if json {
        println!("{}", serde_json::to_string(&report)?);
    }
    Ok(report.ok)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut telemetry = None;
    // The demo's table is the output; logs only when asked for (KEEL_LOG).
    match &cli.command {
        // Chaos installs its own subscriber: it watches keel-messaging's
        // events to see its failpoints fire.
        #[cfg(feature = "chaos")]
        Command::Chaos(_) => {
            chaos::init_tracing("off");
        }
        Command::Demo(_) => init_tracing("off"),
        Command::Serve(args) => match serve_telemetry(args) {
            Ok(installed) => telemetry = Some(installed),
            Err(e) => {
                eprintln!("keel: {e:#}");
                return ExitCode::FAILURE;
            }
        },
        _ => init_tracing("warn"),
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("keel: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = runtime.block_on(async {
        match cli.command {
            Command::Demo(args) => demo_command(args).await,
            Command::Serve(args) => serve_command(*args).await,
            #[cfg(feature = "chaos")]
            Command::Chaos(args) => chaos_command(args).await,
            Command::Dlq { client, command } => ops::run_dlq(&client, command).await.map(|()| true),
            Command::Outbox { client, command } => {
                ops::run_outbox(&client, command).await.map(|()| true)
            }
            Command::Saga { client, command } => {
                ops::run_saga(&client, command).await.map(|()| true)
            }
            Command::Webhooks { client, command } => {
                ops::run_webhooks(&client, command).await.map(|()| true)
            }
            Command::Status(args) => ops::run_status(&args).await.map(|()| true),
            Command::Mesh { command } => mesh::run_mesh(command),
        }
    });
    // Outside the runtime: the last spans are exported, or dropped after
    // the export timeout.
    if let Some(telemetry) = telemetry {
        telemetry.shutdown();
    }
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(2),
        Err(e) => {
            eprintln!("keel: {e:#}");
            ExitCode::FAILURE
        }
    }
}
