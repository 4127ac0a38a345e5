//! Tables and details for humans: what the commands print without `--json`.

use std::fmt::Write as _;

use keel_admin::{ActionJson, DeadLetterJson, DeliveryJson, ParkedJson, SagaJson};

/// The longest cell in a table; longer text is cut with `…`.
pub(super) const MAX_CELL: usize = 60;

fn cut(text: &str) -> String {
    let one_line = text.replace(['\n', '\r'], " ");
    if one_line.chars().count() > MAX_CELL {
        let mut short: String = one_line.chars().take(MAX_CELL - 1).collect();
        short.push('…');
        short
    } else {
        one_line
    }
}

/// Columns padded to their widest cell, two spaces apart.
pub(super) fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i + 1 == cells.len() {
                out.push_str(cell);
            } else {
                let pad = w - cell.chars().count();
                let _ = write!(out, "{cell}{}  ", " ".repeat(pad));
            }
        }
        out.trim_end().to_owned() + "\n"
    };
    let mut out = line(headers.to_vec());
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

fn ago(ms: u64) -> String {
    let s = ms / 1000;
    match s {
        0..120 => format!("{s}s"),
        120..7200 => format!("{}m", s / 60),
        7200..172_800 => format!("{}h", s / 3600),
        _ => format!("{}d", s / 86_400),
    }
}

fn time(at: &chrono::DateTime<chrono::Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%S").to_string()
}

/// `keel dlq list`.
pub fn dead_letter_table(letters: &[DeadLetterJson]) -> String {
    if letters.is_empty() {
        return "no dead letters\n".to_owned();
    }
    let rows: Vec<Vec<String>> = letters
        .iter()
        .map(|l| {
            vec![
                l.id.clone(),
                l.status.as_str().to_owned(),
                l.topic.clone(),
                l.error_kind.clone(),
                l.history.len().to_string(),
                time(&l.dead_at),
                cut(l.last_error.as_deref().unwrap_or("")),
            ]
        })
        .collect();
    table(
        &[
            "ID",
            "STATUS",
            "TOPIC",
            "KIND",
            "ATTEMPTS",
            "DEAD AT",
            "LAST ERROR",
        ],
        &rows,
    )
}

/// `keel dlq show`.
pub fn dead_letter_detail(l: &DeadLetterJson) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "dead letter {} ({})", l.id, l.status.as_str());
    let _ = writeln!(out, "  topic:    {} (key {})", l.topic, l.key);
    let _ = writeln!(out, "  group:    {}", l.group);
    let _ = writeln!(out, "  kind:     {}", l.error_kind);
    let _ = writeln!(out, "  message:  {}", l.message_id);
    let _ = writeln!(out, "  dead at:  {}", time(&l.dead_at));
    let _ = writeln!(out, "  history:");
    for a in l.history.iter().chain(&l.later_failures) {
        let _ = writeln!(out, "    #{} {}  {}", a.attempt, time(&a.at), a.error);
    }
    let _ = writeln!(out, "  payload:\n    {}", l.payload);
    out
}

/// `keel outbox parked`.
pub fn parked_table(rows: &[ParkedJson]) -> String {
    if rows.is_empty() {
        return "no parked outbox rows\n".to_owned();
    }
    let rows: Vec<Vec<String>> = rows
        .iter()
        .map(|p| {
            vec![
                p.id.to_string(),
                p.topic.clone(),
                cut(&p.key),
                p.attempts.to_string(),
                p.held_back.to_string(),
                time(&p.parked_at),
                cut(&p.last_error),
            ]
        })
        .collect();
    table(
        &[
            "ID",
            "TOPIC",
            "KEY",
            "ATTEMPTS",
            "HELD BACK",
            "PARKED AT",
            "REFUSAL",
        ],
        &rows,
    )
}

/// `keel outbox show`.
pub fn parked_detail(p: &ParkedJson) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "parked outbox row {}", p.id);
    let _ = writeln!(out, "  topic:     {} (key {:?})", p.topic, p.key);
    let _ = writeln!(out, "  event:     {}", p.event_id);
    let _ = writeln!(out, "  written:   {}", time(&p.created_at));
    let _ = writeln!(out, "  parked:    {}", time(&p.parked_at));
    let _ = writeln!(out, "  attempts:  {}", p.attempts);
    let _ = writeln!(
        out,
        "  held back: {} later event(s) of its key",
        p.held_back
    );
    let _ = writeln!(out, "  refusal:   {}", p.last_error);
    let _ = writeln!(out, "  payload:\n    {}", p.payload);
    out
}

/// `keel saga list`.
pub fn saga_table(sagas: &[SagaJson]) -> String {
    if sagas.is_empty() {
        return "no sagas\n".to_owned();
    }
    let rows: Vec<Vec<String>> = sagas
        .iter()
        .map(|s| {
            vec![
                s.id.clone(),
                s.kind.clone(),
                s.status.as_str().to_owned(),
                s.step_name.clone().unwrap_or_else(|| s.step.to_string()),
                s.attempts.to_string(),
                ago(s.age_ms),
                ago(s.idle_ms),
                cut(s.last_error.as_deref().unwrap_or("")),
            ]
        })
        .collect();
    table(
        &[
            "ID",
            "KIND",
            "STATUS",
            "STEP",
            "ATTEMPTS",
            "AGE",
            "IDLE",
            "LAST ERROR",
        ],
        &rows,
    )
}

/// `keel saga show`.
pub fn saga_detail(s: &SagaJson) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "saga {} ({}, {})", s.id, s.kind, s.status.as_str());
    let step = s.step_name.clone().unwrap_or_else(|| s.step.to_string());
    let _ = writeln!(out, "  step:       {step} (attempts {})", s.attempts);
    let _ = writeln!(
        out,
        "  started:    {} ({} ago)",
        time(&s.created_at),
        ago(s.age_ms)
    );
    let _ = writeln!(
        out,
        "  updated:    {} ({} ago)",
        time(&s.updated_at),
        ago(s.idle_ms)
    );
    if let Some(err) = &s.last_error {
        let _ = writeln!(out, "  last error: {err}");
    }
    let data = serde_json::to_string(&s.data).unwrap_or_default();
    let _ = writeln!(out, "  data:       {data}");
    out
}

pub(super) fn saga_changed(verb: &str, s: &SagaJson) -> String {
    format!("{verb} saga {}: now {}\n", s.id, s.status.as_str())
}

/// `keel webhooks deliveries`.
pub fn delivery_table(deliveries: &[DeliveryJson]) -> String {
    if deliveries.is_empty() {
        return "no webhook deliveries\n".to_owned();
    }
    let rows: Vec<Vec<String>> = deliveries
        .iter()
        .map(|d| {
            vec![
                d.id.to_string(),
                d.endpoint_id.clone(),
                d.event_type.clone(),
                d.status.as_str().to_owned(),
                d.attempts.to_string(),
                time(&d.created_at),
                time(&d.next_attempt_at),
            ]
        })
        .collect();
    table(
        &[
            "ID", "ENDPOINT", "EVENT", "STATUS", "ATTEMPTS", "QUEUED", "NEXT",
        ],
        &rows,
    )
}

pub(super) fn action_line(a: &ActionJson, what: &str) -> String {
    let mut verb = a.action.clone();
    if let Some(first) = verb.get_mut(..1) {
        first.make_ascii_uppercase();
    }
    format!("{verb} {what} {}\n", a.id)
}
