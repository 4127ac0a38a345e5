//! `keel dlq`, `keel outbox`, `keel saga` and `keel webhooks`: the operator
//! console's
//! actions as commands, talking to a running server's admin API.
//!
//! Every console button has a command here, so an incident can be handled
//! from a terminal or a script. Output is a table for humans by default and
//! the API's JSON with `--json`; a refusal from the server (an unknown id,
//! a saga that is not stuck, a missing token) is printed from its
//! problem+json body and the command exits non-zero.

use std::fmt::Write as _;

use anyhow::Context as _;
use keel_admin::{ActionJson, DeadLetterJson, DeliveryJson, Listing, ParkedJson, SagaJson};
use serde::de::DeserializeOwned;
use serde_json::Value;

/// Where the admin API is and how to authenticate to it.
#[derive(Debug, Clone, clap::Args)]
pub struct AdminClientArgs {
    /// The server's base URL.
    #[arg(long, env = "KEEL_SERVER", default_value = "http://127.0.0.1:8080")]
    pub server: String,
    /// The admin token (sent as `Authorization: Bearer`).
    #[arg(long, env = "KEEL_ADMIN_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// `keel dlq`: dead letters.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum DlqCommand {
    /// List dead letters (pending ones by default).
    List {
        /// Only this topic.
        #[arg(long)]
        topic: Option<String>,
        /// Only this error kind (permanent, too_many_attempts, malformed, ...).
        #[arg(long)]
        kind: Option<String>,
        /// pending (default), replayed, discarded or any.
        #[arg(long)]
        status: Option<String>,
        /// At most this many (1-1000, default 100).
        #[arg(long)]
        limit: Option<usize>,
        /// Print the API's JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show one dead letter with its error history and payload.
    Show {
        /// The dead letter's id.
        id: String,
        /// Print the API's JSON.
        #[arg(long)]
        json: bool,
    },
    /// Send a pending dead letter back to its topic (through the outbox).
    Replay {
        /// The dead letter's id.
        id: String,
    },
    /// Throw a pending dead letter away.
    Discard {
        /// The dead letter's id.
        id: String,
    },
}

/// `keel outbox`: parked outbox rows, events the broker refused for good.
/// Each holds back the later events of its key until it is replayed or
/// discarded.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum OutboxCommand {
    /// List parked outbox rows, oldest first.
    Parked {
        /// Only this topic.
        #[arg(long)]
        topic: Option<String>,
        /// At most this many (1-1000, default 100).
        #[arg(long)]
        limit: Option<usize>,
        /// Print the API's JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show one parked row with the broker's refusal and its payload.
    Show {
        /// The outbox row id.
        id: String,
        /// Print the API's JSON.
        #[arg(long)]
        json: bool,
    },
    /// Publish a parked row again (after fixing what the broker refused),
    /// before the later events of its key.
    Replay {
        /// The outbox row id.
        id: String,
    },
    /// Throw a parked row away for good; its key's later events flow.
    Discard {
        /// The outbox row id.
        id: String,
    },
}

/// `keel saga`: sagas.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum SagaCommand {
    /// List sagas, oldest update first.
    List {
        /// running, compensating, completed, compensated, stuck or cancelled.
        #[arg(long)]
        status: Option<String>,
        /// At most this many (1-1000, default 100).
        #[arg(long)]
        limit: Option<usize>,
        /// Print the API's JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show one saga with its data.
    Show {
        /// The saga's id.
        id: String,
        /// Print the API's JSON.
        #[arg(long)]
        json: bool,
    },
    /// Retry a stuck saga now.
    Retry {
        /// The saga's id.
        id: String,
    },
    /// Cancel a saga before its pivot: its steps are undone.
    Cancel {
        /// The saga's id.
        id: String,
    },
    /// Tell a stuck saga its step's action did not take effect (checked at
    /// the dependency under the step's idempotency key): it runs again, and
    /// a refused pivot then compensates.
    ConfirmNotApplied {
        /// The saga's id.
        id: String,
    },
}

/// `keel webhooks`: webhook deliveries.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum WebhooksCommand {
    /// List webhook deliveries, newest first.
    Deliveries {
        /// Only this endpoint's.
        #[arg(long)]
        endpoint: Option<String>,
        /// pending, succeeded, failed or disabled.
        #[arg(long)]
        status: Option<String>,
        /// At most this many (1-1000, default 100).
        #[arg(long)]
        limit: Option<usize>,
        /// Print the API's JSON.
        #[arg(long)]
        json: bool,
    },
    /// Queue a delivery again from a fresh retry schedule.
    Resend {
        /// The delivery's id.
        id: String,
    },
}

/// Runs a `keel dlq` command.
pub async fn run_dlq(args: &AdminClientArgs, cmd: DlqCommand) -> anyhow::Result<()> {
    let client = AdminClient::new(args)?;
    match cmd {
        DlqCommand::List {
            topic,
            kind,
            status,
            limit,
            json,
        } => {
            let query = [
                ("topic", topic),
                ("kind", kind),
                ("status", status),
                ("limit", limit.map(|n| n.to_string())),
            ];
            let body = client.get(&["dead-letters"], &query).await?;
            print(json, body, |l: Listing<DeadLetterJson>| {
                dead_letter_table(&l.items)
            })
        }
        DlqCommand::Show { id, json } => {
            let body = client.get(&["dead-letters", &id], &[]).await?;
            print(json, body, |l: DeadLetterJson| dead_letter_detail(&l))
        }
        DlqCommand::Replay { id } => {
            let body = client.post(&["dead-letters", &id, "replay"]).await?;
            print(false, body, |a: ActionJson| action_line(&a, "dead letter"))
        }
        DlqCommand::Discard { id } => {
            let body = client.post(&["dead-letters", &id, "discard"]).await?;
            print(false, body, |a: ActionJson| action_line(&a, "dead letter"))
        }
    }
}

/// Runs a `keel outbox` command.
pub async fn run_outbox(args: &AdminClientArgs, cmd: OutboxCommand) -> anyhow::Result<()> {
    let client = AdminClient::new(args)?;
    match cmd {
        OutboxCommand::Parked { topic, limit, json } => {
            let query = [("topic", topic), ("limit", limit.map(|n| n.to_string()))];
            let body = client.get(&["outbox", "parked"], &query).await?;
            print(json, body, |l: Listing<ParkedJson>| parked_table(&l.items))
        }
        OutboxCommand::Show { id, json } => {
            let body = client.get(&["outbox", "parked", &id], &[]).await?;
            print(json, body, |p: ParkedJson| parked_detail(&p))
        }
        OutboxCommand::Replay { id } => {
            let body = client.post(&["outbox", "parked", &id, "replay"]).await?;
            print(false, body, |a: ActionJson| {
                action_line(&a, "parked outbox row")
            })
        }
        OutboxCommand::Discard { id } => {
            let body = client.post(&["outbox", "parked", &id, "discard"]).await?;
            print(false, body, |a: ActionJson| {
                action_line(&a, "parked outbox row")
            })
        }
    }
}

/// Runs a `keel saga` command.
pub async fn run_saga(args: &AdminClientArgs, cmd: SagaCommand) -> anyhow::Result<()> {
    let client = AdminClient::new(args)?;
    match cmd {
        SagaCommand::List {
            status,
            limit,
            json,
        } => {
            let query = [("status", status), ("limit", limit.map(|n| n.to_string()))];
            let body = client.get(&["sagas"], &query).await?;
            print(json, body, |l: Listing<SagaJson>| saga_table(&l.items))
        }
        SagaCommand::Show { id, json } => {
            let body = client.get(&["sagas", &id], &[]).await?;
            print(json, body, |s: SagaJson| saga_detail(&s))
        }
        SagaCommand::Retry { id } => {
            let body = client.post(&["sagas", &id, "retry"]).await?;
            print(false, body, |s: SagaJson| saga_changed("Retried", &s))
        }
        SagaCommand::Cancel { id } => {
            let body = client.post(&["sagas", &id, "cancel"]).await?;
            print(false, body, |s: SagaJson| saga_changed("Cancelled", &s))
        }
        SagaCommand::ConfirmNotApplied { id } => {
            let body = client.post(&["sagas", &id, "confirm-not-applied"]).await?;
            print(false, body, |s: SagaJson| {
                saga_changed("Confirmed not applied", &s)
            })
        }
    }
}

/// Runs a `keel webhooks` command.
pub async fn run_webhooks(args: &AdminClientArgs, cmd: WebhooksCommand) -> anyhow::Result<()> {
    let client = AdminClient::new(args)?;
    match cmd {
        WebhooksCommand::Deliveries {
            endpoint,
            status,
            limit,
            json,
        } => {
            let query = [
                ("endpoint", endpoint),
                ("status", status),
                ("limit", limit.map(|n| n.to_string())),
            ];
            let body = client.get(&["webhook-deliveries"], &query).await?;
            print(json, body, |l: Listing<DeliveryJson>| {
                delivery_table(&l.items)
            })
        }
        WebhooksCommand::Resend { id } => {
            let body = client.post(&["webhook-deliveries", &id, "resend"]).await?;
            print(false, body, |a: ActionJson| {
                action_line(&a, "webhook delivery")
            })
        }
    }
}

/// Prints `body` as JSON, or as `render` makes it.
fn print<T: DeserializeOwned>(
    json: bool,
    body: Value,
    render: impl FnOnce(T) -> String,
) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(&body)?);
        return Ok(());
    }
    let parsed: T = serde_json::from_value(body)
        .context("the server's answer does not look like Keel's admin API (version mismatch?)")?;
    print!("{}", render(parsed));
    Ok(())
}

/// A problem+json refusal from the server.
#[derive(Debug, thiserror::Error)]
#[error("{}", problem_message(*.status, .body))]
pub struct AdminApiError {
    /// The HTTP status.
    pub status: u16,
    /// The response body (problem+json, or whatever came).
    pub body: String,
}

/// How a refusal reads in a terminal: `error 409 Conflict: <detail>`.
pub fn problem_message(status: u16, body: &str) -> String {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let field = |name: &str| {
        parsed
            .as_ref()
            .and_then(|p| p.get(name))
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    let title = field("title").unwrap_or_else(|| {
        reqwest::StatusCode::from_u16(status)
            .ok()
            .and_then(|s| s.canonical_reason())
            .unwrap_or("Error")
            .to_owned()
    });
    let detail = field("detail").unwrap_or_else(|| body.trim().chars().take(500).collect());
    let hint = match status {
        401 => "\n  hint: pass the admin token with --token or KEEL_ADMIN_TOKEN",
        _ => "",
    };
    if detail.is_empty() {
        format!("error {status} {title}{hint}")
    } else {
        format!("error {status} {title}: {detail}{hint}")
    }
}

struct AdminClient {
    http: reqwest::Client,
    base: reqwest::Url,
    token: Option<String>,
}

impl AdminClient {
    fn new(args: &AdminClientArgs) -> anyhow::Result<Self> {
        let base = reqwest::Url::parse(&args.server)
            .with_context(|| format!("--server `{}` is not a URL", args.server))?;
        if base.cannot_be_a_base() {
            anyhow::bail!("--server `{}` is not an http(s) base URL", args.server);
        }
        let http = reqwest::Client::builder()
            .timeout(std::time::Duration::from_secs(30))
            .build()?;
        Ok(Self {
            http,
            base,
            token: args.token.clone().filter(|t| !t.is_empty()),
        })
    }

    /// `/admin/api/<segments...>`, each segment percent-encoded.
    fn url(&self, segments: &[&str]) -> reqwest::Url {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty()
                .extend(["admin", "api"])
                .extend(segments);
        }
        url
    }

    async fn get(
        &self,
        segments: &[&str],
        query: &[(&str, Option<String>)],
    ) -> anyhow::Result<Value> {
        let mut url = self.url(segments);
        for (key, value) in query {
            if let Some(value) = value {
                url.query_pairs_mut().append_pair(key, value);
            }
        }
        self.send(self.http.get(url)).await
    }

    async fn post(&self, segments: &[&str]) -> anyhow::Result<Value> {
        let mut request = self.http.post(self.url(segments));
        if self.token.is_none() {
            // Without a token, a state-changing request needs a session and
            // its CSRF token (a loopback server without an admin token).
            let (cookie, csrf) = self.session().await?;
            request = request
                .header(reqwest::header::COOKIE, cookie)
                .header(keel_admin::CSRF_HEADER, csrf);
        }
        self.send(request).await
    }

    /// A session from `POST /admin/api/login`: its cookie and CSRF token.
    async fn session(&self) -> anyhow::Result<(String, String)> {
        let (headers, body) = self.exchange(self.http.post(self.url(&["login"]))).await?;
        let cookie = headers
            .get(reqwest::header::SET_COOKIE)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.split(';').next());
        match (cookie, body["csrf"].as_str()) {
            (Some(cookie), Some(csrf)) => Ok((cookie.to_owned(), csrf.to_owned())),
            _ => anyhow::bail!("the server's login answer carried no session"),
        }
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> anyhow::Result<Value> {
        Ok(self.exchange(request).await?.1)
    }

    /// Sends `request` (with the token, if any): the answer's headers and
    /// JSON body, or the problem it carried.
    async fn exchange(
        &self,
        mut request: reqwest::RequestBuilder,
    ) -> anyhow::Result<(reqwest::header::HeaderMap, Value)> {
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        let response = request
            .send()
            .await
            .with_context(|| format!("could not reach the Keel server at {}", self.base))?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = response.text().await?;
        if !status.is_success() {
            return Err(AdminApiError {
                status: status.as_u16(),
                body,
            }
            .into());
        }
        let body = serde_json::from_str(&body)
            .context("the server answered with something that is not JSON")?;
        Ok((headers, body))
    }
}

// ---------------------------------------------------------- formatting --

/// The longest cell in a table; longer text is cut with `…`.
const MAX_CELL: usize = 60;

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
fn table(headers: &[&str], rows: &[Vec<String>]) -> String {
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

fn saga_changed(verb: &str, s: &SagaJson) -> String {
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

fn action_line(a: &ActionJson, what: &str) -> String {
    let mut verb = a.action.clone();
    if let Some(first) = verb.get_mut(..1) {
        first.make_ascii_uppercase();
    }
    format!("{verb} {what} {}\n", a.id)
}

#[cfg(test)]
mod tests {
    use chrono::{TimeZone, Utc};
    use keel_admin::AttemptJson;
    use keel_messaging::store::{DeadLetterStatus, DeliveryStatus, SagaStatus};

    use super::*;

    fn at() -> chrono::DateTime<Utc> {
        Utc.with_ymd_and_hms(2026, 11, 29, 12, 0, 0).unwrap()
    }

    fn letter() -> DeadLetterJson {
        DeadLetterJson {
            id: "billing:evt-1".into(),
            status: DeadLetterStatus::Pending,
            topic: "orders".into(),
            key: "order-1".into(),
            group: "billing".into(),
            error_kind: "too_many_attempts".into(),
            message_id: "evt-1".into(),
            dead_at: at(),
            last_error: Some("ledger timeout\nafter 5 s".into()),
            history: vec![AttemptJson {
                attempt: 1,
                error: "ledger timeout".into(),
                at: at(),
            }],
            later_failures: Vec::new(),
            headers: Default::default(),
            payload: "{}".into(),
            payload_truncated: false,
        }
    }

    fn saga() -> SagaJson {
        SagaJson {
            id: "order-7".into(),
            kind: "order".into(),
            status: SagaStatus::Stuck,
            step: 0,
            step_name: Some("capture_payment".into()),
            attempts: 2,
            outcome_unknown: false,
            last_error: Some("x".repeat(100)),
            created_at: at(),
            updated_at: at(),
            age_ms: 10_800_000,
            idle_ms: 5_000,
            version: 7,
            data: serde_json::json!({"order_id": "order-7"}),
        }
    }

    #[test]
    fn dead_letters_print_as_an_aligned_table_on_one_line_each() {
        let out = dead_letter_table(&[letter()]);
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2);
        assert!(lines[0].starts_with("ID             STATUS   TOPIC"));
        assert_eq!(
            lines[1],
            "billing:evt-1  pending  orders  too_many_attempts  1         2026-11-29 12:00:00  ledger timeout after 5 s"
        );
        assert_eq!(dead_letter_table(&[]), "no dead letters\n");
        let detail = dead_letter_detail(&letter());
        assert!(detail.contains("#1 2026-11-29 12:00:00  ledger timeout"));
    }

    #[test]
    fn sagas_show_step_names_ages_and_cut_errors() {
        let out = saga_table(&[saga()]);
        let row = out.lines().nth(1).unwrap();
        assert!(row.contains("stuck"));
        assert!(row.contains("capture_payment"));
        assert!(row.contains("3h") && row.contains("5s"));
        assert!(row.ends_with('…'), "{row}");
        let error = row.rsplit("  ").next().unwrap();
        assert_eq!(error.chars().count(), MAX_CELL, "long errors are cut");
        assert!(saga_detail(&saga()).contains("data:       {\"order_id\":\"order-7\"}"));
        assert_eq!(
            saga_changed("Retried", &saga()),
            "Retried saga order-7: now stuck\n"
        );
    }

    #[test]
    fn deliveries_and_actions_read_plainly() {
        let d = DeliveryJson {
            id: 42,
            endpoint_id: "ep_partner".into(),
            event_id: "evt_1".into(),
            event_type: "order.placed".into(),
            status: DeliveryStatus::Failed,
            attempts: 7,
            next_attempt_at: at(),
            created_at: at(),
            updated_at: at(),
            attempt_log: Vec::new(),
        };
        let out = delivery_table(&[d]);
        assert!(
            out.lines()
                .nth(1)
                .unwrap()
                .starts_with("42  ep_partner  order.placed  failed  7")
        );
        let a = ActionJson {
            action: "replayed".into(),
            id: "billing:evt-1".into(),
            affected: 1,
        };
        assert_eq!(
            action_line(&a, "dead letter"),
            "Replayed dead letter billing:evt-1\n"
        );
    }

    #[test]
    fn parked_rows_print_their_key_refusal_and_what_waits_behind_them() {
        let p = ParkedJson {
            id: 42,
            event_id: "evt-7".into(),
            topic: "orders".into(),
            key: "order\n7".into(),
            attempts: 1,
            last_error: "broker refused the request: key contains a line break".into(),
            created_at: at(),
            parked_at: at(),
            held_back: 2,
            headers: Default::default(),
            payload: "{}".into(),
            payload_truncated: false,
        };
        let out = parked_table(std::slice::from_ref(&p));
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2, "a key with a line break stays on one line");
        assert!(lines[0].starts_with("ID  TOPIC   KEY"), "{}", lines[0]);
        assert!(
            lines[1].starts_with("42  orders  order 7  1         2          2026-11-29 12:00:00"),
            "{}",
            lines[1]
        );
        assert_eq!(parked_table(&[]), "no parked outbox rows\n");
        let detail = parked_detail(&p);
        assert!(detail.contains("(key \"order\\n7\")"), "{detail}");
        assert!(detail.contains("held back: 2 later event(s)"));
        let a = ActionJson {
            action: "replayed".into(),
            id: "42".into(),
            affected: 1,
        };
        assert_eq!(
            action_line(&a, "parked outbox row"),
            "Replayed parked outbox row 42\n"
        );
        let client = AdminClient::new(&AdminClientArgs {
            server: "http://127.0.0.1:8080".into(),
            token: None,
        })
        .unwrap();
        assert_eq!(
            client.url(&["outbox", "parked", "42", "discard"]).as_str(),
            "http://127.0.0.1:8080/admin/api/outbox/parked/42/discard"
        );
    }

    #[test]
    fn problems_print_status_title_and_detail() {
        let body = r#"{"type":"about:blank","title":"Conflict","status":409,"detail":"saga `order-7` is Completed, not stuck"}"#;
        assert_eq!(
            problem_message(409, body),
            "error 409 Conflict: saga `order-7` is Completed, not stuck"
        );
        let unauthorized = problem_message(401, "");
        assert!(unauthorized.starts_with("error 401 Unauthorized"));
        assert!(unauthorized.contains("--token"));
        assert_eq!(
            problem_message(502, "bad gateway from proxy"),
            "error 502 Bad Gateway: bad gateway from proxy"
        );
    }

    #[test]
    fn ids_are_percent_encoded_into_the_path() {
        let client = AdminClient::new(&AdminClientArgs {
            server: "http://127.0.0.1:8080/".into(),
            token: None,
        })
        .unwrap();
        let url = client.url(&["dead-letters", "billing:a/b?c", "replay"]);
        assert_eq!(
            url.as_str(),
            "http://127.0.0.1:8080/admin/api/dead-letters/billing:a%2Fb%3Fc/replay"
        );
    }
}
