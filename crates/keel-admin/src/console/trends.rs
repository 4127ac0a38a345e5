//! The console's view of the [`History`]: a row per consumer group and per
//! dependency with its sparklines, and a detail page per subject with a
//! larger graph of every measure over the last 15 minutes and 24 hours.

use std::fmt::Write as _;

use super::graph::{self, CHART, SPARK, Size};
use super::html::{encode_segment, escape};
use crate::history::{History, HistoryQuery, Measure, Resolution, SubjectJson, SubjectKind};

const NO_HISTORY: &str = "<p class=\"empty\">This server keeps no history.</p>";

/// `d` in words, rounded down: `90 s`, `15 minutes`, `24 hours`, `7 days`.
pub(crate) fn human(d: std::time::Duration) -> String {
    match d.as_secs() {
        secs @ 0..120 => format!("{secs} s"),
        secs @ 120..7200 => format!("{} minutes", secs / 60),
        secs @ 7200..172_800 => format!("{} hours", secs / 3600),
        secs => format!("{} days", secs / 86_400),
    }
}

/// The detail page of a subject.
pub(crate) fn detail_path(kind: SubjectKind, name: &str) -> String {
    format!(
        "/console/history/{}/{}",
        kind.as_str(),
        encode_segment(name)
    )
}

fn values(subject: &SubjectJson, measure: Measure) -> Vec<f64> {
    subject
        .values(measure)
        .iter()
        .map(|v| v.unwrap_or(f64::NAN))
        .collect()
}

fn spark(subject: &SubjectJson, measure: Measure) -> String {
    let values = values(subject, measure);
    format!(
        "<td>{}<span class=\"now\">{}</span></td>",
        graph::sparkline(&values, measure.as_str(), measure.label(), SPARK),
        graph::short(graph::last(&values)),
    )
}

fn total(subject: &SubjectJson, measure: Measure) -> u64 {
    subject.values(measure).iter().flatten().sum::<f64>() as u64
}

fn subjects(history: &History, kind: SubjectKind) -> Vec<SubjectJson> {
    let query = HistoryQuery {
        kind: Some(kind),
        ..HistoryQuery::all(Resolution::Fine)
    };
    history.snapshot(&query).subjects
}

fn link(kind: SubjectKind, name: &str) -> String {
    format!(
        "<a href=\"{}\" data-detail=\"{}\">{}</a>",
        escape(&detail_path(kind, name)),
        kind.as_str(),
        escape(name)
    )
}

/// A row per consumer group: throughput, lag, in flight, processing p99,
/// and the window's retries and dead letters.
pub(crate) fn consumers(history: Option<&History>) -> String {
    let table = Table {
        kind: SubjectKind::ConsumerGroup,
        row: "group",
        empty: "No consumer has handled a message yet.",
        headers: &[
            "group",
            "handled/s",
            "lag",
            "in flight",
            "processing p99 (s)",
            "retries",
            "dead letters",
        ],
    };
    table.render(history, |g| {
        format!(
            "{}{}{}{}<td>{}</td><td>{}</td>",
            spark(g, Measure::Throughput),
            spark(g, Measure::Lag),
            spark(g, Measure::InFlight),
            spark(g, Measure::ProcessingP99),
            total(g, Measure::Retries),
            total(g, Measure::DeadLetters),
        )
    })
}

/// A section with a row per subject of one kind: its name links to its
/// detail page, `cells` draws the rest.
struct Table {
    kind: SubjectKind,
    /// The row's `data-` attribute naming the subject.
    row: &'static str,
    empty: &'static str,
    headers: &'static [&'static str],
}

impl Table {
    fn render(&self, history: Option<&History>, cells: impl Fn(&SubjectJson) -> String) -> String {
        let Some(history) = history else {
            return NO_HISTORY.to_owned();
        };
        let subjects = subjects(history, self.kind);
        if subjects.is_empty() {
            return format!("<p class=\"empty\">{}</p>", self.empty);
        }
        let mut out = format!(
            "<p class=\"span\">The last {}, a point every {}.</p><table><thead><tr>",
            human(history.span(Resolution::Fine)),
            human(history.interval()),
        );
        for header in self.headers {
            let _ = write!(out, "<th>{header}</th>");
        }
        out.push_str("</tr></thead><tbody>");
        for s in &subjects {
            let _ = write!(
                out,
                "<tr data-{row}=\"{name}\"><td>{link}</td>{cells}</tr>",
                row = self.row,
                name = escape(&s.name),
                link = link(self.kind, &s.name),
                cells = cells(s),
            );
        }
        out.push_str("</tbody></table>");
        out
    }
}

/// A row per dependency: the breaker's timeline, calls, failures, latency
/// p99, and the window's refusals.
pub(crate) fn dependencies(history: Option<&History>) -> String {
    let table = Table {
        kind: SubjectKind::Dependency,
        row: "dependency",
        empty: "No dependency has been called yet.",
        headers: &[
            "dependency",
            "breaker",
            "calls/s",
            "failures/s",
            "latency p99 (s)",
            "refused",
        ],
    };
    table.render(history, |d| {
        format!(
            "<td>{}</td>{}{}{}<td>{}</td>",
            timeline(d, SPARK),
            spark(d, Measure::Calls),
            spark(d, Measure::Failures),
            spark(d, Measure::LatencyP99),
            total(d, Measure::Refused),
        )
    })
}

fn timeline(subject: &SubjectJson, size: Size) -> String {
    let levels = values(subject, Measure::BreakerState);
    graph::timeline(&levels, total(subject, Measure::Transitions), size)
}

/// A breaker's timeline for its row in the breakers section (empty
/// without a history of it).
pub(crate) fn breaker_timeline(history: Option<&History>, name: &str) -> String {
    let query = HistoryQuery::subject(SubjectKind::Dependency, name);
    history
        .and_then(|h| h.snapshot(&query).subjects.pop())
        .map(|subject| timeline(&subject, SPARK))
        .unwrap_or_default()
}

/// A sparkline of one measure of one subject, with its latest value
/// (empty without a history of it).
pub(crate) fn inline(
    history: Option<&History>,
    kind: SubjectKind,
    name: &str,
    measure: Measure,
) -> String {
    let Some(history) = history else {
        return String::new();
    };
    let values = history.series(kind, name, measure);
    if values.is_empty() {
        return String::new();
    }
    graph::sparkline(&values, measure.as_str(), measure.label(), SPARK)
}

/// Every measure of one subject, large, over the last 15 minutes and the
/// last 24 hours.
pub(crate) fn detail(history: Option<&History>, kind: SubjectKind, name: &str) -> String {
    let Some(history) = history else {
        return NO_HISTORY.to_owned();
    };
    let mut out = format!(
        "<h3 data-subject=\"{}\">{} <code>{}</code></h3><p><a href=\"/console\">← console</a></p>",
        kind.as_str(),
        kind.as_str().replace('_', " "),
        escape(name)
    );
    for resolution in [Resolution::Fine, Resolution::Coarse] {
        let query = HistoryQuery {
            resolution,
            ..HistoryQuery::subject(kind, name)
        };
        let Some(subject) = history.snapshot(&query).subjects.pop() else {
            out.push_str("<p class=\"empty\">Nothing recorded for it yet.</p>");
            return out;
        };
        let span = format!("last {}", human(history.span(resolution)));
        let _ = write!(
            out,
            "<h4>{span}</h4><div class=\"charts\" data-resolution=\"{}\">",
            resolution.as_str()
        );
        for measure in kind.measures() {
            let graph = if *measure == Measure::BreakerState {
                timeline(&subject, CHART)
            } else {
                graph::sparkline(
                    &values(&subject, *measure),
                    measure.as_str(),
                    measure.label(),
                    CHART,
                )
            };
            let _ = write!(
                out,
                "<figure>{graph}<figcaption>{}</figcaption></figure>",
                measure.label()
            );
        }
        out.push_str("</div>");
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    #[test]
    fn spans_read_as_words() {
        let human = |secs| super::human(Duration::from_secs(secs));
        assert_eq!(human(5), "5 s");
        assert_eq!(human(90), "90 s");
        assert_eq!(human(180), "3 minutes");
        assert_eq!(human(900), "15 minutes");
        assert_eq!(human(3600), "60 minutes");
        assert_eq!(human(86_400), "24 hours");
        assert_eq!(human(7 * 86_400), "7 days");
    }
}
