//! `keel serve`: the reference shop as a server, configured by flags,
//! environment (`KEEL_*`) and a TOML file, in that order of precedence.
//!
//! Configuration is validated before anything starts, and each refusal
//! says what to change: a backend that is not compiled in, a malformed
//! address, an admin API on a public address without a token.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::{MethodRouter, delete, get, post};
use keel_admin::console::Console;
use keel_admin::{Admin, AdminToken, BrokerLag};
use keel_http::access::{AllowedHosts, ApiKeyLayer, ApiKeys, FailureThrottle};
use keel_http::health::{
    ConnectionLimits, DEFAULT_HEADER_READ_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_CONNECTIONS,
    DEFAULT_POOL_EXHAUSTION_GRACE, Health,
};
use keel_http::jobs::{JobRequested, Jobs, JobsOptions};
use keel_messaging::Outbox;
use keel_messaging::broker::Broker;
use keel_messaging::consumer::{Consumer, Group};
use keel_webhooks::WebhookReceiver;
use keel_webhooks::sealing::SecretSealer;
use keel_webhooks::signing::Secret;
use serde::Deserialize;

use crate::api::openapi;
use crate::api::reports::{ReportWorker, Reports};
use crate::api::webhooks::{self, WebhookApi};
use crate::backend::{self, Backend, BackendOptions, InvalidBackend, OnStore};
use crate::shop::{Components, ShopStore, StartError, System, SystemConfig, fulfilment};

/// The default listen address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

/// The consumer group that runs report jobs.
pub const REPORTS_GROUP: &str = "reports";

/// `keel serve`'s flags; each also reads `KEEL_<NAME>`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServeArgs {
    /// A TOML file with the same settings (flags and environment win).
    #[arg(long, env = "KEEL_CONFIG")]
    pub config: Option<PathBuf>,
    /// Where to listen [default: 127.0.0.1:8080].
    #[arg(long, env = "KEEL_LISTEN")]
    pub listen: Option<String>,
    /// `sqlite:PATH` (default `sqlite:keel.db`), or `postgres://...` with the
    /// `postgres` feature.
    #[arg(long, env = "KEEL_DATABASE_URL")]
    pub database_url: Option<String>,
    /// `embedded` (a SQLite broker next to the database), or `nats://...`
    /// with the `nats` feature.
    #[arg(long, env = "KEEL_BROKER")]
    pub broker: Option<String>,
    /// PostgreSQL: the schema holding every table [default: keel].
    /// Processes sharing the work must use the same one.
    #[arg(long, env = "KEEL_PG_SCHEMA")]
    pub pg_schema: Option<String>,
    /// NATS: the prefix of the JetStream streams [default: KEEL].
    /// Processes sharing the work must use the same one.
    #[arg(long, env = "KEEL_STREAM_PREFIX")]
    pub stream_prefix: Option<String>,
    /// The admin API and console token (at least 16 characters); required
    /// unless listening on loopback. Prefer KEEL_ADMIN_TOKEN or
    /// --admin-token-file: a flag's value is visible in `ps`.
    #[arg(long, env = "KEEL_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// A file holding the admin token (its first line).
    #[arg(long, env = "KEEL_ADMIN_TOKEN_FILE")]
    pub admin_token_file: Option<PathBuf>,
    /// More `Host` names the admin API and console answer to (`name` or
    /// `name:port`, comma-separated; `*` for any), besides localhost,
    /// 127.0.0.1 and `[::1]`.
    #[arg(long, env = "KEEL_ALLOWED_HOSTS", value_delimiter = ',')]
    pub allowed_hosts: Vec<String>,
    /// A tenant's API key for webhook management, `tenant:key` (repeat the
    /// flag, or comma-separate in KEEL_API_KEYS).
    #[arg(
        long = "api-key",
        env = "KEEL_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    pub api_keys: Vec<String>,
    /// A file of API keys, one `tenant:key` per line.
    #[arg(long, env = "KEEL_API_KEYS_FILE")]
    pub api_keys_file: Option<PathBuf>,
    /// Webhook endpoints one tenant may register [default: 10].
    #[arg(long, env = "KEEL_MAX_ENDPOINTS_PER_TENANT")]
    pub max_endpoints_per_tenant: Option<usize>,
    /// The key webhook secrets are sealed with at rest: 32 bytes as base64
    /// or hex (without it they are stored in plain text).
    #[arg(long, env = "KEEL_SECRETS_KEY", hide_env_values = true)]
    pub secrets_key: Option<String>,
    /// A file holding the secrets key (its first line).
    #[arg(long, env = "KEEL_SECRETS_KEY_FILE")]
    pub secrets_key_file: Option<PathBuf>,
    /// Serve /metrics and /debug/deep to anyone (default: behind the admin
    /// credentials, like the admin API).
    #[arg(long, env = "KEEL_PUBLIC_METRICS")]
    pub public_metrics: bool,
    /// The most connections open at once [default: 1024]; past it a new
    /// one gets 503.
    #[arg(long, env = "KEEL_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Seconds a request head may take to arrive (also bounds an idle
    /// keep-alive connection) [default: 10].
    #[arg(long, env = "KEEL_HEADER_READ_TIMEOUT_SECS")]
    pub header_read_timeout_secs: Option<u64>,
    /// Seconds a connection may move no byte before it is closed
    /// [default: 60].
    #[arg(long, env = "KEEL_IDLE_TIMEOUT_SECS")]
    pub idle_timeout_secs: Option<u64>,
    /// SSE streams, WebSockets and waiting long polls one client address
    /// may hold [default: 16].
    #[arg(long, env = "KEEL_MAX_STREAMS_PER_CLIENT")]
    pub max_streams_per_client: Option<usize>,
    /// Origins (`scheme://host[:port]`, comma-separated) whose pages may
    /// open `/ws`, besides the server's own.
    #[arg(long, env = "KEEL_WS_ALLOWED_ORIGINS", value_delimiter = ',')]
    pub ws_allowed_origins: Vec<String>,
    /// Honour `X-Keel-Demo-Fault` on `POST /orders` (for demos and tests).
    #[arg(long, env = "KEEL_DEMO_FAULTS")]
    pub demo_faults: bool,
    /// Allow webhook endpoints on loopback addresses (the SSRF guard
    /// refuses them otherwise).
    #[arg(long, env = "KEEL_ALLOW_LOOPBACK_WEBHOOKS")]
    pub allow_loopback_webhooks: bool,
    /// The secret inbound webhooks are signed with (`whsec_...`).
    #[arg(long, env = "KEEL_INBOUND_WEBHOOK_SECRET", hide_env_values = true)]
    pub inbound_webhook_secret: Option<String>,
    /// The key pagination cursors are signed with (at least 32 bytes);
    /// random per start when unset, so cursors do not survive a restart.
    #[arg(long, env = "KEEL_CURSOR_KEY", hide_env_values = true)]
    pub cursor_key: Option<String>,
}

/// The TOML file: every field optional.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeFile {
    /// See [`ServeArgs::listen`].
    pub listen: Option<String>,
    /// See [`ServeArgs::database_url`].
    pub database_url: Option<String>,
    /// See [`ServeArgs::broker`].
    pub broker: Option<String>,
    /// See [`ServeArgs::pg_schema`].
    pub pg_schema: Option<String>,
    /// See [`ServeArgs::stream_prefix`].
    pub stream_prefix: Option<String>,
    /// See [`ServeArgs::admin_token`].
    pub admin_token: Option<String>,
    /// See [`ServeArgs::admin_token_file`].
    pub admin_token_file: Option<PathBuf>,
    /// See [`ServeArgs::allowed_hosts`].
    pub allowed_hosts: Option<Vec<String>>,
    /// See [`ServeArgs::api_keys`].
    pub api_keys: Option<Vec<String>>,
    /// See [`ServeArgs::api_keys_file`].
    pub api_keys_file: Option<PathBuf>,
    /// See [`ServeArgs::max_endpoints_per_tenant`].
    pub max_endpoints_per_tenant: Option<usize>,
    /// See [`ServeArgs::secrets_key`].
    pub secrets_key: Option<String>,
    /// See [`ServeArgs::secrets_key_file`].
    pub secrets_key_file: Option<PathBuf>,
    /// See [`ServeArgs::public_metrics`].
    pub public_metrics: Option<bool>,
    /// See [`ServeArgs::max_connections`].
    pub max_connections: Option<usize>,
    /// See [`ServeArgs::header_read_timeout_secs`].
    pub header_read_timeout_secs: Option<u64>,
    /// See [`ServeArgs::idle_timeout_secs`].
    pub idle_timeout_secs: Option<u64>,
    /// See [`ServeArgs::max_streams_per_client`].
    pub max_streams_per_client: Option<usize>,
    /// See [`ServeArgs::ws_allowed_origins`].
    pub ws_allowed_origins: Option<Vec<String>>,
    /// See [`ServeArgs::demo_faults`].
    pub demo_faults: Option<bool>,
    /// See [`ServeArgs::allow_loopback_webhooks`].
    pub allow_loopback_webhooks: Option<bool>,
    /// See [`ServeArgs::inbound_webhook_secret`].
    pub inbound_webhook_secret: Option<String>,
    /// See [`ServeArgs::cursor_key`].
    pub cursor_key: Option<String>,
}

pub use crate::backend::{BrokerKind, Database};

/// The validated configuration. Its `Debug` output shows no secret.
#[derive(Clone)]
pub struct ServeConfig {
    /// The listen address.
    pub listen: SocketAddr,
    /// The database.
    pub database: Database,
    /// The broker.
    pub broker: BrokerKind,
    /// The PostgreSQL schema.
    pub pg_schema: String,
    /// The NATS stream prefix.
    pub stream_prefix: String,
    /// The admin token (none: loopback only).
    pub admin_token: Option<String>,
    /// The `Host` names the admin answers to.
    pub allowed_hosts: AllowedHosts,
    /// The tenants allowed to manage webhooks.
    pub api_keys: ApiKeys,
    /// Webhook endpoints per tenant.
    pub max_endpoints_per_tenant: usize,
    /// Seals webhook secrets at rest.
    pub secrets: SecretSealer,
    /// Metrics and `/debug/deep` without credentials.
    pub public_metrics: bool,
    /// Timeouts and the cap of every connection.
    pub connection_limits: ConnectionLimits,
    /// Long-lived connections per client address.
    pub max_streams_per_client: usize,
    /// Origins allowed to open `/ws`, besides the server's own.
    pub ws_allowed_origins: Vec<String>,
    /// Demo faults on.
    pub demo_faults: bool,
    /// Loopback webhooks allowed.
    pub allow_loopback_webhooks: bool,
    /// Inbound webhook secret.
    pub inbound_webhook_secret: Option<String>,
    /// Cursor key.
    pub cursor_key: Option<String>,
}

impl std::fmt::Debug for ServeConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = |secret: &Option<String>| if secret.is_some() { "<set>" } else { "<none>" };
        f.debug_struct("ServeConfig")
            .field("listen", &self.listen)
            .field("database", &self.database)
            .field("broker", &self.broker)
            .field("admin_token", &set(&self.admin_token))
            .field("allowed_hosts", &self.allowed_hosts.describe())
            .field("api_keys", &self.api_keys)
            .field("secrets", &self.secrets)
            .field("public_metrics", &self.public_metrics)
            .field("connection_limits", &self.connection_limits)
            .field("inbound_webhook_secret", &set(&self.inbound_webhook_secret))
            .field("cursor_key", &set(&self.cursor_key))
            .finish_non_exhaustive()
    }
}

/// A configuration that cannot work, and what to change.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read or parsed.
    #[error("config file {path}: {reason}")]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A setting is invalid.
    #[error("{setting}: {reason}")]
    Invalid {
        /// The setting.
        setting: &'static str,
        /// Why, and what to do.
        reason: String,
    },
}

fn invalid(setting: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        setting,
        reason: reason.into(),
    }
}

impl From<InvalidBackend> for ConfigError {
    fn from(e: InvalidBackend) -> Self {
        ConfigError::Invalid {
            setting: e.setting,
            reason: e.reason,
        }
    }
}

/// Parses `--database-url` (see [`backend::parse_database`]).
pub fn parse_database(url: &str) -> Result<Database, ConfigError> {
    Ok(backend::parse_database(url)?)
}

/// Parses `--broker` (see [`backend::parse_broker`]).
pub fn parse_broker(broker: &str, database: &Database) -> Result<BrokerKind, ConfigError> {
    Ok(backend::parse_broker(broker, database)?)
}

impl ServeArgs {
    /// Merges flags/environment over the file over the defaults, and
    /// validates the result.
    pub fn resolve(&self) -> Result<ServeConfig, ConfigError> {
        let file = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| ConfigError::File {
                    path: path.clone(),
                    reason: e.to_string(),
                })?;
                toml::from_str::<ServeFile>(&text).map_err(|e| ConfigError::File {
                    path: path.clone(),
                    reason: e.to_string(),
                })?
            }
            None => ServeFile::default(),
        };
        let listen = self
            .listen
            .clone()
            .or(file.listen)
            .unwrap_or_else(|| DEFAULT_LISTEN.to_owned());
        let listen: SocketAddr = listen
            .parse()
            .map_err(|e| invalid("listen", format!("`{listen}` is not IP:PORT ({e})")))?;
        let database = parse_database(
            &self
                .database_url
                .clone()
                .or(file.database_url)
                .unwrap_or_else(|| "sqlite:keel.db".to_owned()),
        )?;
        let broker = parse_broker(
            &self
                .broker
                .clone()
                .or(file.broker)
                .unwrap_or_else(|| "embedded".to_owned()),
            &database,
        )?;
        let pg_schema = self
            .pg_schema
            .clone()
            .or(file.pg_schema)
            .unwrap_or_else(|| backend::DEFAULT_PG_SCHEMA.to_owned());
        let stream_prefix = self
            .stream_prefix
            .clone()
            .or(file.stream_prefix)
            .unwrap_or_else(|| backend::DEFAULT_STREAM_PREFIX.to_owned());
        let admin_token = secret(
            self.admin_token.clone().or(file.admin_token),
            self.admin_token_file.clone().or(file.admin_token_file),
            "admin-token-file",
        )?;
        AdminToken::require_for(listen, admin_token.clone())
            .map_err(|e| invalid("admin-token", e.to_string()))?;
        let allowed_hosts = AllowedHosts::loopback()
            .with(pick(self.allowed_hosts.clone(), file.allowed_hosts))
            .map_err(|e| invalid("allowed-hosts", e.to_string()))?;
        let api_keys = api_keys(
            pick(self.api_keys.clone(), file.api_keys),
            self.api_keys_file.clone().or(file.api_keys_file),
        )?;
        let secrets = match secret(
            self.secrets_key.clone().or(file.secrets_key),
            self.secrets_key_file.clone().or(file.secrets_key_file),
            "secrets-key-file",
        )? {
            Some(key) => {
                SecretSealer::parse(&key).map_err(|e| invalid("secrets-key", e.to_string()))?
            }
            None => SecretSealer::plaintext(),
        };
        let connection_limits = connection_limits(
            self.max_connections.or(file.max_connections),
            self.header_read_timeout_secs
                .or(file.header_read_timeout_secs),
            self.idle_timeout_secs.or(file.idle_timeout_secs),
        )?;
        let max_streams_per_client = self
            .max_streams_per_client
            .or(file.max_streams_per_client)
            .unwrap_or(keel_realtime::DEFAULT_MAX_PER_CLIENT);
        if max_streams_per_client == 0 {
            return Err(invalid("max-streams-per-client", "must be at least 1"));
        }
        let ws_allowed_origins = pick(self.ws_allowed_origins.clone(), file.ws_allowed_origins);
        keel_realtime::RealtimeOptions::new()
            .allowed_origins(ws_allowed_origins.iter().cloned())
            .validate()
            .map_err(|e| invalid("ws-allowed-origins", e.to_string()))?;
        let max_endpoints_per_tenant = self
            .max_endpoints_per_tenant
            .or(file.max_endpoints_per_tenant)
            .unwrap_or(webhooks::DEFAULT_MAX_ENDPOINTS_PER_TENANT);
        let inbound_webhook_secret = self
            .inbound_webhook_secret
            .clone()
            .or(file.inbound_webhook_secret);
        if let Some(secret) = &inbound_webhook_secret {
            Secret::parse(secret).map_err(|e| invalid("inbound-webhook-secret", e.to_string()))?;
        }
        let cursor_key = self.cursor_key.clone().or(file.cursor_key);
        if cursor_key.as_ref().is_some_and(|k| k.len() < 32) {
            return Err(invalid("cursor-key", "must be at least 32 bytes"));
        }
        Ok(ServeConfig {
            listen,
            database,
            broker,
            pg_schema,
            stream_prefix,
            admin_token,
            allowed_hosts,
            api_keys,
            max_endpoints_per_tenant,
            secrets,
            public_metrics: self.public_metrics || file.public_metrics.unwrap_or(false),
            connection_limits,
            max_streams_per_client,
            ws_allowed_origins,
            demo_faults: self.demo_faults || file.demo_faults.unwrap_or(false),
            allow_loopback_webhooks: self.allow_loopback_webhooks
                || file.allow_loopback_webhooks.unwrap_or(false),
            inbound_webhook_secret,
            cursor_key,
        })
    }
}

/// A secret given as a value (flag, environment or file setting), else
/// read from the file at `path`.
fn secret(
    value: Option<String>,
    path: Option<PathBuf>,
    setting: &'static str,
) -> Result<Option<String>, ConfigError> {
    match value {
        Some(value) => Ok(Some(value)),
        None => path.map(|path| first_line(setting, &path)).transpose(),
    }
}

/// The tenants' keys: `given`, then one `tenant:key` per line of `path`
/// (blank lines and `#` comments skipped).
fn api_keys(mut given: Vec<String>, path: Option<PathBuf>) -> Result<ApiKeys, ConfigError> {
    if let Some(path) = path {
        let text = std::fs::read_to_string(&path)
            .map_err(|e| invalid("api-keys-file", format!("{}: {e}", path.display())))?;
        given.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(str::to_owned),
        );
    }
    ApiKeys::parse(&given).map_err(|e| invalid("api-key", e.to_string()))
}

/// The edge's limits, each defaulted; the idle timeout must outlast a
/// quiet long poll.
fn connection_limits(
    max_connections: Option<usize>,
    header_read_secs: Option<u64>,
    idle_secs: Option<u64>,
) -> Result<ConnectionLimits, ConfigError> {
    let limits = ConnectionLimits::new()
        .max_connections(max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS))
        .header_read_timeout(
            header_read_secs.map_or(DEFAULT_HEADER_READ_TIMEOUT, Duration::from_secs),
        )
        .idle_timeout(idle_secs.map_or(DEFAULT_IDLE_TIMEOUT, Duration::from_secs))
        .validate()
        .map_err(|e| invalid("connection limits", e.to_string()))?;
    let poll = keel_realtime::DEFAULT_POLL_TIMEOUT;
    if limits.idle() <= poll {
        return Err(invalid(
            "idle-timeout-secs",
            format!(
                "must be more than the long poll's {} s wait, or every quiet poll is cut off",
                poll.as_secs()
            ),
        ));
    }
    Ok(limits)
}

/// The flag's values if any were given, else the file's.
fn pick(flags: Vec<String>, file: Option<Vec<String>>) -> Vec<String> {
    if flags.is_empty() {
        file.unwrap_or_default()
    } else {
        flags
    }
}

/// The first line of a secret's file, trimmed.
fn first_line(setting: &'static str, path: &std::path::Path) -> Result<String, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| invalid(setting, format!("{}: {e}", path.display())))?;
    let line = text.lines().next().unwrap_or_default().trim().to_owned();
    if line.is_empty() {
        return Err(invalid(setting, format!("{} is empty", path.display())));
    }
    Ok(line)
}

/// The admin API and the console, behind the admin token and answering
/// only `hosts`. Mounted by `keel serve`; the chaos run and tests can mount
/// it too.
pub fn admin_routes<S: ShopStore>(
    c: &Components<S>,
    token: AdminToken,
    hosts: AllowedHosts,
) -> (Admin<S>, Router) {
    let lag = BrokerLag::new(Arc::clone(&c.broker))
        .group(fulfilment::TOPIC, fulfilment::GROUP)
        .group(keel_http::jobs::DEFAULT_TOPIC, REPORTS_GROUP);
    let admin = Admin::builder(c.store.clone())
        .token(token)
        .allowed_hosts(hosts)
        .outbox(Outbox::new(c.store.clone()))
        .sagas(c.orchestrator.clone())
        .breakers(c.breakers.clone())
        .gauges(lag)
        .build();
    let router = admin.router().merge(Console::new(admin.clone()).router());
    (admin, router)
}

/// The routes `keel serve` adds to the public API: reports and jobs,
/// webhooks, health, metrics, OpenAPI, admin and console.
pub fn serve_routes<S: ShopStore>(
    c: &Components<S>,
    config: &ServeConfig,
    reports: Reports,
    jobs: &Jobs<S>,
) -> Result<Router, StartError> {
    let secret = match &config.inbound_webhook_secret {
        Some(s) => Secret::parse(s),
        None => Secret::generate(),
    }
    .map_err(|e| StartError::Config(e.to_string()))?;
    let webhook_api = WebhookApi {
        endpoints: c.endpoints.clone(),
        receiver: WebhookReceiver::new([secret]),
        max_per_tenant: config.max_endpoints_per_tenant,
        creating: Arc::default(),
    };
    // Each method router gets the key check of its own, so a method a
    // route lacks answers 405 with `Allow`, not 401.
    let management = ApiKeyLayer::new(config.api_keys.clone(), FailureThrottle::default());
    let managed = |route: MethodRouter<WebhookApi<S>>| route.route_layer(management.clone());
    let webhook_routes = Router::new()
        .route(
            "/webhook-endpoints",
            managed(post(webhooks::create_endpoint::<S>).get(webhooks::list_endpoints::<S>)),
        )
        .route(
            "/webhook-endpoints/{id}",
            managed(delete(webhooks::delete_endpoint::<S>)),
        )
        .route(
            "/webhook-endpoints/{id}/deliveries",
            managed(get(webhooks::list_deliveries::<S>)),
        )
        .route(
            "/deliveries/{id}/resend",
            managed(post(webhooks::resend::<S>)),
        )
        .route("/webhooks/inbound/{source}", post(webhooks::inbound::<S>))
        .with_state(webhook_api);
    let http = reqwest::Client::new();
    let pool = c.store.clone();
    let mut health = Health::builder()
        .drain(&c.drain)
        .store(c.store.clone())
        .pool_exhaustion("db_pool", DEFAULT_POOL_EXHAUSTION_GRACE, move || {
            pool.connections_free()
        });
    let urls = &c.dependency_urls;
    for (name, url) in [
        ("payments", urls.payments.clone()),
        ("inventory", urls.inventory.clone()),
        ("shipping", urls.shipping.clone()),
        ("notifications", urls.notifications.clone()),
    ] {
        let http = http.clone();
        health = health.dependency(name, Duration::from_secs(1), move || {
            let request = http.get(url.clone());
            async move { request.send().await.map(drop) }
        });
    }
    let health = health
        .build()
        .map_err(|e| StartError::Config(e.to_string()))?;
    let token = AdminToken::require_for(config.listen, config.admin_token.clone())
        .map_err(|e| StartError::Config(e.to_string()))?;
    let (admin, admin_routes) = admin_routes(c, token, config.allowed_hosts.clone());
    let auth = (!config.public_metrics).then(|| admin.auth_layer());
    let guarded = |route: MethodRouter| match &auth {
        Some(auth) => route.route_layer(auth.clone()),
        None => route,
    };
    let operations = Router::new()
        .route("/debug/deep", guarded(health.deep_route()))
        .route(
            "/metrics",
            guarded(get(|| async { crate::metrics_report::render() })),
        );
    Ok(Router::new()
        .route("/reports", jobs.create_route())
        .merge(jobs.routes())
        .route(
            "/reports/{id}",
            get(crate::api::reports::get_report).with_state(reports),
        )
        .merge(webhook_routes)
        .merge(health.probes_router())
        .merge(operations)
        .route(
            "/openapi.json",
            get(|| async {
                (
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    openapi::json(),
                )
            }),
        )
        .merge(admin_routes))
}

impl ServeConfig {
    /// The backends to open.
    pub fn backend_options(&self) -> BackendOptions {
        BackendOptions {
            pg_schema: self.pg_schema.clone(),
            stream_prefix: self.stream_prefix.clone(),
            ..BackendOptions::new(self.database.clone(), self.broker.clone())
        }
    }
}

/// Opens the configured store and broker.
pub async fn open(config: &ServeConfig) -> anyhow::Result<Backend> {
    Ok(Backend::open(&config.backend_options()).await?)
}

/// Runs the server until SIGTERM/ctrl-c, printing exactly one line to
/// stdout once listening: `keel: listening on http://ADDR`.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    crate::metrics_report::install();
    let config = args.resolve()?;
    let options = config.backend_options();
    tracing::info!(backends = %options.describe(), "opening the backends");
    let backend = Backend::open(&options).await?;
    backend.run(Serve { config }).await
}

/// The server, on whichever store was opened.
struct Serve {
    config: ServeConfig,
}

impl OnStore for Serve {
    type Output = anyhow::Result<()>;

    async fn run<S: ShopStore>(self, store: S, broker: Arc<dyn Broker>) -> anyhow::Result<()> {
        serve_on(self.config, store, broker).await
    }
}

/// Says loudly what is open to whom, once, at start.
fn warn_about_exposure(config: &ServeConfig) {
    if config.admin_token.is_none() {
        tracing::warn!(
            "THE ADMIN API AND CONSOLE HAVE NO TOKEN: anyone who can open a connection to {} \
             from this machine can read them; state-changing requests still need a session \
             and its CSRF token. Set KEEL_ADMIN_TOKEN (or --admin-token-file) before \
             exposing this server to other users",
            config.listen
        );
    }
    tracing::info!(hosts = %config.allowed_hosts.describe(), "the admin API answers these Host names");
    if config.api_keys.is_empty() {
        tracing::warn!(
            "no API key is configured (--api-key tenant:key): webhook endpoints cannot be managed"
        );
    }
    if !config.secrets.is_sealing() {
        tracing::warn!(
            "webhook secrets are stored in plain text: set KEEL_SECRETS_KEY to seal them at rest"
        );
    }
    if config.public_metrics {
        tracing::warn!("/metrics and /debug/deep are served to anyone (--public-metrics)");
    }
}

async fn serve_on<S: ShopStore>(
    config: ServeConfig,
    store: S,
    broker: Arc<dyn Broker>,
) -> anyhow::Result<()> {
    warn_about_exposure(&config);
    let system = SystemConfig {
        listen: config.listen,
        demo_faults: config.demo_faults,
        allow_loopback_webhooks: config.allow_loopback_webhooks,
        secrets: config.secrets.clone(),
        connection_limits: config.connection_limits.clone(),
        streams_per_client: config.max_streams_per_client,
        ws_origins: config.ws_allowed_origins.clone(),
        cursor_key: config
            .cursor_key
            .clone()
            .map(String::into_bytes)
            .unwrap_or_else(|| SystemConfig::default().cursor_key),
        lb_notice: Duration::from_secs(1),
        // Processes sharing a database must not take each other's claims.
        relay_name: if matches!(config.database, Database::Sqlite(_)) {
            "shop-relay".to_owned()
        } else {
            format!("shop-relay-{}", keel_core::id::new_id().simple())
        },
        ..SystemConfig::default()
    };
    let reports = Reports::default();
    let jobs = Jobs::new(Outbox::new(store.clone()), JobsOptions::new("report"))
        .map_err(|e| anyhow::anyhow!("jobs: {e}"))?;
    let worker = Consumer::builder(store.clone(), Arc::clone(&broker))
        .group(
            Group::new(keel_http::jobs::DEFAULT_TOPIC, REPORTS_GROUP).on(
                <JobRequested as keel_messaging::Event>::TYPE,
                ReportWorker {
                    jobs: jobs.clone(),
                    reports: reports.clone(),
                },
            ),
        )
        .build()?;
    let cfg = config.clone();
    let jobs_for_routes = jobs.clone();
    let handle = System::start(store, broker, system, move |c| {
        serve_routes(c, &cfg, reports, &jobs_for_routes)
    })
    .await?;
    // Other processes' commits wake this one's relay, orchestrator and
    // event-log readers (PostgreSQL; a no-op on SQLite).
    let _wakeups = backend::spawn_wakeups(&handle.store, backend::wake_targets(&handle));
    let (stop_worker, worker_stopped) = tokio::sync::watch::channel(false);
    let worker_task = tokio::spawn(async move {
        let mut rx = worker_stopped;
        worker
            .run(async move {
                let _ = rx.wait_for(|s| *s).await;
            })
            .await
    });
    println!("keel: listening on {}", handle.base_url);
    let _ = std::io::Write::flush(&mut std::io::stdout());
    let urls = handle.dependencies.urls().clone();
    tracing::info!(?urls, "dependencies on loopback");
    handle.drain.trigger_on_signal()?;
    handle
        .drain
        .wait_for(keel_http::health::Phase::Draining)
        .await;
    let _ = stop_worker.send(true);
    handle.shutdown().await;
    let _ = worker_task.await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> ServeArgs {
        ServeArgs::default()
    }

    #[test]
    fn defaults_are_loopback_sqlite_and_the_embedded_broker() {
        let config = args().resolve().unwrap();
        assert_eq!(config.listen, DEFAULT_LISTEN.parse().unwrap());
        assert_eq!(config.database, Database::Sqlite("keel.db".into()));
        assert_eq!(config.broker, BrokerKind::Embedded("keel.db.broker".into()));
        assert!(!config.demo_faults);
    }

    #[test]
    fn flags_win_over_the_file_which_wins_over_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("keel.toml");
        std::fs::write(
            &path,
            "listen = \"127.0.0.1:9999\"\ndatabase_url = \"sqlite:/tmp/from-file.db\"\ndemo_faults = true\n",
        )
        .unwrap();
        let mut a = args();
        a.config = Some(path);
        let config = a.resolve().unwrap();
        assert_eq!(config.listen, "127.0.0.1:9999".parse().unwrap());
        assert_eq!(
            config.database,
            Database::Sqlite("/tmp/from-file.db".into())
        );
        assert!(config.demo_faults);
        a.listen = Some("127.0.0.1:7777".into());
        assert_eq!(
            a.resolve().unwrap().listen,
            "127.0.0.1:7777".parse().unwrap()
        );
    }

    #[test]
    fn scale_out_backends_resolve_with_their_schema_and_prefix() {
        let mut a = args();
        a.database_url = Some("postgres://keel@127.0.0.1/keel".into());
        a.broker = Some("nats://127.0.0.1:4222".into());
        a.pg_schema = Some("shop".into());
        a.stream_prefix = Some("SHOP".into());
        let resolved = a.resolve();
        if cfg!(all(feature = "postgres", feature = "nats")) {
            let options = resolved.unwrap().backend_options();
            assert!(options.shareable());
            assert_eq!(options.pg_schema, "shop");
            assert_eq!(options.stream_prefix, "SHOP");
        } else {
            assert!(resolved.unwrap_err().to_string().contains("feature"));
        }
        let options = args().resolve().unwrap().backend_options();
        assert_eq!(options.pg_schema, backend::DEFAULT_PG_SCHEMA);
        assert_eq!(options.stream_prefix, backend::DEFAULT_STREAM_PREFIX);
    }

    #[test]
    fn unusable_settings_say_what_to_change() {
        let mut a = args();
        a.listen = Some("localhost".into());
        assert!(a.resolve().unwrap_err().to_string().contains("IP:PORT"));
        let mut a = args();
        a.database_url = Some("mysql://x".into());
        assert!(a.resolve().is_err());
        let mut a = args();
        a.broker = Some("kafka://127.0.0.1:9092".into());
        assert!(a.resolve().unwrap_err().to_string().contains("nats://"));
        let mut a = args();
        a.listen = Some("192.0.2.1:8080".into());
        assert!(a.resolve().unwrap_err().to_string().contains("admin-token"));
        a.admin_token = Some("a-long-enough-admin-token".into());
        assert!(a.resolve().is_ok());
        let mut a = args();
        a.cursor_key = Some("short".into());
        assert!(a.resolve().is_err());
    }

    #[test]
    fn security_settings_are_checked_and_secrets_come_from_files() {
        let dir = tempfile::tempdir().unwrap();
        let token_file = dir.path().join("token");
        std::fs::write(&token_file, "a-token-from-a-file-0123\n").unwrap();
        let mut a = args();
        a.listen = Some("192.0.2.1:8080".into());
        a.admin_token_file = Some(token_file);
        let config = a.resolve().unwrap();
        assert_eq!(
            config.admin_token.as_deref(),
            Some("a-token-from-a-file-0123")
        );
        let refused = |change: fn(&mut ServeArgs), setting: &str| {
            let mut a = args();
            change(&mut a);
            let err = a.resolve().unwrap_err().to_string();
            assert!(err.contains(setting), "{setting}: {err}");
        };
        refused(|a| a.api_keys = vec!["acme".into()], "api-key");
        refused(|a| a.api_keys = vec!["acme:short".into()], "api-key");
        refused(|a| a.secrets_key = Some("not-a-key".into()), "secrets-key");
        refused(
            |a| a.allowed_hosts = vec!["bad host".into()],
            "allowed-hosts",
        );
        refused(|a| a.max_connections = Some(0), "max_connections");
        refused(
            |a| a.max_streams_per_client = Some(0),
            "max-streams-per-client",
        );
        refused(
            |a| a.admin_token_file = Some("/nonexistent/token".into()),
            "admin-token-file",
        );
        let mut a = args();
        a.api_keys = vec!["acme:acme-key-0123456789".into()];
        a.allowed_hosts = vec!["shop.example:8443".into()];
        let config = a.resolve().unwrap();
        assert_eq!(config.api_keys.tenants().count(), 1);
        assert!(config.allowed_hosts.allows("shop.example:8443"));
        assert!(!config.secrets.is_sealing());
        assert!(!config.public_metrics);
        a.admin_token = Some("a-secret-admin-token-0123".into());
        let shown = format!("{:?}", a.resolve().unwrap());
        assert!(
            !shown.contains("a-secret-admin-token") && !shown.contains("acme-key"),
            "{shown}"
        );
    }
}
