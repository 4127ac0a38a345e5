//! `keel mesh check` and `keel mesh export`: one set of numbers for the
//! app and the service mesh (keel-mesh).

use std::path::PathBuf;

use anyhow::Context as _;
use keel_mesh::{Policies, Report};

/// `keel mesh`.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum MeshCommand {
    /// Check Istio VirtualServices and DestinationRules against the rules
    /// Keel's pipeline enforces, and against Keel's own policy: retries
    /// that cannot fit their timeout, ejection of every endpoint, retries
    /// of writes, tries that multiply across Keel and the sidecar. Exits 2
    /// if any finding is an error.
    Check {
        /// YAML files of Istio resources (documents separated by `---`).
        #[arg(required = true)]
        files: Vec<PathBuf>,
        /// Keel's policies per dependency (TOML: `[dependencies.NAME]` with
        /// `host`, `pipeline` and `balance`).
        #[arg(long)]
        policy: Option<PathBuf>,
    },
    /// Write the Istio resources equivalent to Keel's policy for a
    /// dependency (every dependency without --dependency), then check them.
    Export {
        /// Keel's policies per dependency (TOML).
        #[arg(long)]
        policy: PathBuf,
        /// Only this dependency.
        #[arg(long)]
        dependency: Option<String>,
    },
}

fn read_policies(path: &PathBuf) -> anyhow::Result<Policies> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the policy file {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("{} is not a Keel policy file", path.display()))
}

fn print_report(report: &Report) {
    for finding in &report.findings {
        println!("{finding}");
    }
    if report.findings.is_empty() {
        println!("ok: nothing to report");
    }
}

/// Runs `keel mesh`; `Ok(false)` when a check found an error.
pub fn run_mesh(command: MeshCommand) -> anyhow::Result<bool> {
    match command {
        MeshCommand::Check { files, policy } => {
            let policies = match &policy {
                Some(path) => read_policies(path)?,
                None => Policies::default(),
            };
            let mut resources = Vec::new();
            for file in &files {
                let text = std::fs::read_to_string(file)
                    .with_context(|| format!("cannot read {}", file.display()))?;
                resources.extend(
                    keel_mesh::parse(&text).with_context(|| format!("in {}", file.display()))?,
                );
            }
            let report = keel_mesh::check(&resources, &policies);
            print_report(&report);
            Ok(!report.has_errors())
        }
        MeshCommand::Export { policy, dependency } => {
            let policies = read_policies(&policy)?;
            let names: Vec<String> = match dependency {
                Some(name) => vec![name],
                None => policies.dependencies.keys().cloned().collect(),
            };
            let mut resources = Vec::new();
            for name in &names {
                resources.extend(keel_mesh::export(&policies, name)?);
            }
            print!("{}", keel_mesh::to_yaml(&resources)?);
            // The exported retries replace Keel's: check them as the mesh
            // would run them, with Keel's own retry turned off.
            let mut moved = policies.clone();
            for p in moved.dependencies.values_mut() {
                p.pipeline.retry = None;
            }
            let report = keel_mesh::check(&resources, &moved);
            for finding in &report.findings {
                eprintln!("{finding}");
            }
            eprintln!(
                "keel mesh export: turn off Keel's own retry for {} (`retry` removed from its \
                 pipeline), or the tries multiply",
                names.join(", ")
            );
            Ok(!report.has_errors())
        }
    }
}
