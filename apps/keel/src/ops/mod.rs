//! `keel dlq`, `keel outbox`, `keel saga`, `keel webhooks` and `keel
//! status`: the operator console's actions and graphs as commands, talking
//! to a running server's admin API.
//!
//! Every console button has a command here, so an incident can be handled
//! from a terminal or a script. Output is a table for humans by default and
//! the API's JSON with `--json`; a refusal from the server (an unknown id,
//! a saga that is not stuck, a missing token) is printed from its
//! problem+json body and the command exits non-zero.

mod format;
mod status;
#[cfg(test)]
mod tests;

use anyhow::Context as _;
use keel_admin::{ActionJson, DeadLetterJson, DeliveryJson, Listing, ParkedJson, SagaJson};
use serde::de::DeserializeOwned;
use serde_json::Value;

use format::{action_line, saga_changed};
pub use format::{
    dead_letter_detail, dead_letter_table, delivery_table, parked_detail, parked_table,
    saga_detail, saga_table,
};
pub use status::{StatusArgs, run_status};

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
