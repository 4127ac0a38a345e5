//! `keel status`: the server's history in a terminal, drawn with the same
//! data as the console's graphs (`GET /admin/api/history`), so a person at
//! a terminal sees the same picture as one at a browser.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{IsTerminal as _, Write as _};
use std::time::Duration;

use keel_admin::history::{Measure, SubjectKind};
use serde::Deserialize;

use super::{AdminClient, AdminClientArgs};

/// `keel status`'s arguments.
#[derive(Debug, Clone, clap::Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub client: AdminClientArgs,
    /// Redraw every `--every` seconds until interrupted (in place on a
    /// terminal, one block after another otherwise).
    #[arg(long)]
    pub watch: bool,
    /// Seconds between redraws with --watch.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub every: u64,
    /// `fine` (the last 15 minutes) or `coarse` (the last 24 hours).
    #[arg(long, default_value = "fine", value_parser = ["fine", "coarse"])]
    pub resolution: String,
    /// Print the API's JSON.
    #[arg(long)]
    pub json: bool,
}

/// The points a terminal line shows at most (the newest).
const WIDTH: usize = 48;

const LEVELS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];

#[derive(Debug, Deserialize)]
struct History {
    interval_seconds: f64,
    subjects: Vec<Subject>,
}

#[derive(Debug, Deserialize)]
struct Subject {
    kind: String,
    name: String,
    series: BTreeMap<String, Vec<Option<f64>>>,
}

/// Runs `keel status`.
pub async fn run_status(args: &StatusArgs) -> anyhow::Result<()> {
    let client = AdminClient::new(&args.client)?;
    let query = [("resolution", Some(args.resolution.clone()))];
    let in_place = std::io::stdout().is_terminal();
    loop {
        let body = client.get(&["history"], &query).await?;
        let text = if args.json {
            serde_json::to_string_pretty(&body)? + "\n"
        } else {
            render(&serde_json::from_value(body)?)
        };
        let mut out = std::io::stdout().lock();
        if args.watch && in_place {
            write!(out, "\x1b[H\x1b[2J")?;
        } else if args.watch {
            writeln!(
                out,
                "--- {}",
                keel_core::clock::utc_now().format("%H:%M:%S")
            )?;
        }
        out.write_all(text.as_bytes())?;
        out.flush()?;
        if !args.watch {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_secs(args.every)).await;
    }
}

/// `values` (oldest first, `None` unknown) as a line of block characters
/// scaled from 0 to their peak, a space where unknown.
pub fn sparkline(values: &[Option<f64>]) -> String {
    let shown = &values[values.len().saturating_sub(WIDTH)..];
    let peak = shown.iter().flatten().copied().fold(0.0f64, f64::max);
    shown
        .iter()
        .map(|v| match v {
            None => ' ',
            Some(_) if peak <= 0.0 => LEVELS[0],
            Some(v) => {
                let level = (v / peak * (LEVELS.len() - 1) as f64).round() as usize;
                LEVELS[level.min(LEVELS.len() - 1)]
            }
        })
        .collect()
}

/// A breaker's levels (0 closed, 1 half-open, 2 open) as `·` `▒` `█`.
pub fn breaker_line(values: &[Option<f64>]) -> String {
    let shown = &values[values.len().saturating_sub(WIDTH)..];
    shown
        .iter()
        .map(|v| match v {
            None => ' ',
            Some(l) if *l >= 2.0 => '█',
            Some(l) if *l >= 1.0 => '▒',
            Some(_) => '·',
        })
        .collect()
}

fn short(value: Option<f64>) -> String {
    match value {
        None => "—".to_owned(),
        Some(v) if v == 0.0 || v.abs() >= 100.0 => format!("{v:.0}"),
        Some(v) if v.abs() >= 1.0 => format!("{v:.1}"),
        Some(v) => format!("{v:.3}"),
    }
}

fn render(history: &History) -> String {
    let mut out = format!(
        "keel status: one point every {} s, newest on the right\n",
        history.interval_seconds
    );
    if history.subjects.is_empty() {
        out.push_str("nothing recorded yet\n");
    }
    for subject in &history.subjects {
        let Some(kind) = SubjectKind::parse(&subject.kind) else {
            continue;
        };
        let _ = writeln!(
            out,
            "\n{} {}",
            kind.as_str().replace('_', " "),
            subject.name
        );
        for measure in kind.measures() {
            let values = subject
                .series
                .get(measure.as_str())
                .map(Vec::as_slice)
                .unwrap_or_default();
            let line = if *measure == Measure::BreakerState {
                breaker_line(values)
            } else {
                sparkline(values)
            };
            let now = values.iter().rev().flatten().next().copied();
            let _ = writeln!(
                out,
                "  {:<24} {:<width$} {}",
                measure.label(),
                line,
                short(now),
                width = WIDTH
            );
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sparkline_scales_to_its_peak_and_leaves_gaps() {
        assert_eq!(sparkline(&[Some(0.0), Some(4.0), None, Some(2.0)]), "▁█ ▅");
        assert_eq!(sparkline(&[Some(0.0), Some(0.0)]), "▁▁");
        let long: Vec<Option<f64>> = (0..100).map(|i| Some(f64::from(i))).collect();
        assert_eq!(sparkline(&long).chars().count(), WIDTH, "the newest only");
    }

    #[test]
    fn a_breaker_line_shows_its_open_band() {
        let levels = [Some(0.0), Some(2.0), Some(1.0), Some(0.0)];
        assert_eq!(breaker_line(&levels), "·█▒·");
    }

    #[test]
    fn the_status_lists_every_subjects_measures() {
        let history: History = serde_json::from_value(serde_json::json!({
            "interval_seconds": 5.0,
            "subjects": [{
                "kind": "dependency", "name": "payments",
                "series": { "calls": [1.0, 3.0], "breaker_state": [0.0, 2.0] }
            }]
        }))
        .unwrap();
        let text = render(&history);
        assert!(text.contains("dependency payments"), "{text}");
        assert!(text.contains("calls/s"));
        assert!(text.contains("·█"));
        assert!(text.contains("latency p99 (s)"), "every measure has a line");
    }
}
