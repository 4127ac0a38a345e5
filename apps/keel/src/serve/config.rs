//! What `keel serve` is told (flags, `KEEL_*`, TOML) and the checked
//! configuration it runs with.

use std::net::SocketAddr;
use std::num::NonZeroU64;
use std::path::PathBuf;
use std::time::Duration;

use keel_admin::AdminToken;
use keel_http::access::{AllowedHosts, ApiKeys};
use keel_http::health::ConnectionLimits;
use keel_webhooks::sealing::SecretSealer;
use keel_webhooks::signing::Secret;
use serde::Deserialize;

use crate::api::webhooks::{self};
use crate::backend::{self, BackendOptions, InvalidBackend};
use crate::shop::retention::Retention;

use super::DEFAULT_LISTEN;

mod sources;
mod telemetry;

pub use telemetry::SERVICE_NAME;

use sources::{ConnectionSettings, api_keys, connection_limits, pick, secret};

/// `keel serve`'s flags; each also reads `KEEL_<NAME>`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ServeArgs {
    /// A TOML file with the same settings (flags and environment win).
    #[arg(long, env = "KEEL_CONFIG")]
    pub config: Option<PathBuf>,
    /// Where to listen [default: 127.0.0.1:8080].
    #[arg(long, env = "KEEL_LISTEN")]
    pub listen: Option<String>,
    /// Where the shop's shipping service answers gRPC
    /// (`shipping.v1.Shipping`, health, reflection) [default: 127.0.0.1:0,
    /// a free port, printed at start].
    #[arg(long, env = "KEEL_SHIPPING_GRPC_LISTEN")]
    pub shipping_grpc_listen: Option<String>,
    /// The token every call on the shipping gRPC port (but health) must
    /// carry as `authorization: Bearer` [default: the admin token]; a
    /// non-loopback --shipping-grpc-listen needs one.
    #[arg(long, env = "KEEL_SHIPPING_GRPC_TOKEN", hide_env_values = true)]
    pub shipping_grpc_token: Option<String>,
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
    /// NATS: how many servers of the JetStream cluster keep each stream
    /// [default: 1]. Use 3 on a cluster: with 1, a crash of the server's
    /// machine can lose acknowledged messages (warned at start).
    #[arg(long, env = "KEEL_NATS_REPLICAS", value_parser = clap::value_parser!(u8).range(1..=5))]
    pub nats_replicas: Option<u8>,
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
    /// Seconds to keep serving, with /readyz failing, after SIGTERM, so
    /// load balancers stop sending before the listener closes [default: 1].
    #[arg(long, env = "KEEL_LB_NOTICE_SECS")]
    pub lb_notice_secs: Option<u64>,
    /// Seconds in-flight requests and long-lived connections get once the
    /// listener closes, before they are aborted [default: 10]. Keep
    /// `lb-notice + drain-timeout` under the orchestrator's grace period.
    #[arg(long, env = "KEEL_DRAIN_TIMEOUT_SECS")]
    pub drain_timeout_secs: Option<u64>,
    /// A PEM certificate chain: serve HTTPS (with --tls-key).
    #[arg(long, env = "KEEL_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = "KEEL_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Seconds between reads of the gauges kept in storage (dead letters,
    /// sagas, outbox and consumer lag, webhook endpoints) [default: 15].
    #[arg(long, env = "KEEL_GAUGE_INTERVAL_SECS")]
    pub gauge_interval_secs: Option<u64>,
    /// The most connections open at once [default: 1024]; past it a new
    /// one gets 503.
    #[arg(long, env = "KEEL_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// Seconds a request head may take to arrive (also bounds an idle
    /// keep-alive connection) [default: 10].
    #[arg(long, env = "KEEL_HEADER_READ_TIMEOUT_SECS")]
    pub header_read_timeout_secs: Option<u64>,
    /// One client address's share of the connections [default: 256]; past
    /// it, its new connections get 503.
    #[arg(long, env = "KEEL_MAX_CONNECTIONS_PER_ADDRESS")]
    pub max_connections_per_address: Option<usize>,
    /// Seconds a request body may take to arrive whole, counted from its
    /// head, on every route [default: 10]; past it, 408.
    #[arg(long, env = "KEEL_BODY_READ_TIMEOUT_SECS")]
    pub body_read_timeout_secs: Option<u64>,
    /// Seconds a connection may move no byte before it is closed
    /// [default: 60].
    #[arg(long, env = "KEEL_IDLE_TIMEOUT_SECS")]
    pub idle_timeout_secs: Option<u64>,
    /// SSE streams, WebSockets and waiting long polls one client address
    /// may hold [default: 16].
    #[arg(long, env = "KEEL_MAX_STREAMS_PER_CLIENT")]
    pub max_streams_per_client: Option<usize>,
    /// Seconds an Idempotency-Key is remembered: a retry after that is a
    /// new request [default: 86400].
    #[arg(long, env = "KEEL_IDEMPOTENCY_KEY_TTL_SECS")]
    pub idempotency_key_ttl_secs: Option<u64>,
    /// Seconds between retention passes, which delete expired
    /// Idempotency-Keys, old event-log events, expired jobs and finished
    /// webhook deliveries [default: 600].
    #[arg(long, env = "KEEL_RETENTION_INTERVAL_SECS")]
    pub retention_interval_secs: Option<u64>,
    /// Seconds the event log keeps an event [default: 604800, 7 days]; 0
    /// for no age limit.
    #[arg(long, env = "KEEL_EVENT_LOG_MAX_AGE_SECS")]
    pub event_log_max_age_secs: Option<u64>,
    /// Events the event log keeps per stream, newest first [default:
    /// 10000]; 0 for no count limit.
    #[arg(long, env = "KEEL_EVENT_LOG_KEEP_LAST")]
    pub event_log_keep_last: Option<u64>,
    /// Seconds a report job lives after its last change [default: 86400];
    /// then it answers 410 until it is pruned.
    #[arg(long, env = "KEEL_JOB_TTL_SECS")]
    pub job_ttl_secs: Option<u64>,
    /// Seconds a job is kept after it expired (it answers 410 meanwhile)
    /// [default: 86400].
    #[arg(long, env = "KEEL_JOBS_GRACE_SECS")]
    pub jobs_grace_secs: Option<u64>,
    /// Seconds a finished webhook delivery, with its attempts, is kept
    /// [default: 604800, 7 days].
    #[arg(long, env = "KEEL_WEBHOOK_DELIVERIES_MAX_AGE_SECS")]
    pub webhook_deliveries_max_age_secs: Option<u64>,
    /// Seconds a published outbox row is kept [default: 604800, 7 days].
    #[arg(long, env = "KEEL_OUTBOX_RETENTION_SECS")]
    pub outbox_retention_secs: Option<u64>,
    /// Seconds an inbox row (a processed message's id) is kept, which must
    /// outlast any redelivery [default: 604800, 7 days].
    #[arg(long, env = "KEEL_INBOX_RETENTION_SECS")]
    pub inbox_retention_secs: Option<u64>,
    /// Origins (`scheme://host[:port]`, comma-separated) whose pages may
    /// open `/ws`, besides the server's own.
    #[arg(long, env = "KEEL_WS_ALLOWED_ORIGINS", value_delimiter = ',')]
    pub ws_allowed_origins: Vec<String>,
    /// Export spans over OTLP to this collector (`http://host:4318`, or
    /// `:4317` with `--otlp-protocol grpc`); without it the standard
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` decides, and unset nothing is exported.
    #[arg(long)]
    pub otlp_endpoint: Option<String>,
    /// `http/protobuf` or `grpc` [default: `OTEL_EXPORTER_OTLP_PROTOCOL`,
    /// else `http/protobuf`].
    #[arg(long)]
    pub otlp_protocol: Option<String>,
    /// `text` or `json` (one object per line, with `trace_id` and
    /// `span_id`) [default: text].
    #[arg(long, env = "KEEL_LOG_FORMAT")]
    pub log_format: Option<String>,
    /// Honour `X-Keel-Demo-Fault` on `POST /orders` (for demos and tests).
    #[arg(long, env = "KEEL_DEMO_FAULTS")]
    pub demo_faults: bool,
    /// Honour `x-chaos-experiment` from loopback clients: the request runs
    /// in that experiment, and the mark goes on to the dependencies.
    #[arg(long, env = "KEEL_CHAOS_EXPERIMENTS")]
    pub chaos_experiments: bool,
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
    /// See [`ServeArgs::shipping_grpc_listen`].
    pub shipping_grpc_listen: Option<String>,
    /// See [`ServeArgs::shipping_grpc_token`].
    pub shipping_grpc_token: Option<String>,
    /// See [`ServeArgs::database_url`].
    pub database_url: Option<String>,
    /// See [`ServeArgs::broker`].
    pub broker: Option<String>,
    /// See [`ServeArgs::pg_schema`].
    pub pg_schema: Option<String>,
    /// See [`ServeArgs::stream_prefix`].
    pub stream_prefix: Option<String>,
    /// See [`ServeArgs::nats_replicas`].
    pub nats_replicas: Option<u8>,
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
    /// See [`ServeArgs::gauge_interval_secs`].
    pub gauge_interval_secs: Option<u64>,
    /// See [`ServeArgs::lb_notice_secs`].
    pub lb_notice_secs: Option<u64>,
    /// See [`ServeArgs::drain_timeout_secs`].
    pub drain_timeout_secs: Option<u64>,
    /// See [`ServeArgs::tls_cert`].
    pub tls_cert: Option<PathBuf>,
    /// See [`ServeArgs::tls_key`].
    pub tls_key: Option<PathBuf>,
    /// See [`ServeArgs::max_connections`].
    pub max_connections: Option<usize>,
    /// See [`ServeArgs::header_read_timeout_secs`].
    pub header_read_timeout_secs: Option<u64>,
    /// See [`ServeArgs::max_connections_per_address`].
    pub max_connections_per_address: Option<usize>,
    /// See [`ServeArgs::body_read_timeout_secs`].
    pub body_read_timeout_secs: Option<u64>,
    /// See [`ServeArgs::idle_timeout_secs`].
    pub idle_timeout_secs: Option<u64>,
    /// See [`ServeArgs::max_streams_per_client`].
    pub max_streams_per_client: Option<usize>,
    /// See [`ServeArgs::idempotency_key_ttl_secs`].
    pub idempotency_key_ttl_secs: Option<u64>,
    /// See [`ServeArgs::retention_interval_secs`].
    pub retention_interval_secs: Option<u64>,
    /// See [`ServeArgs::event_log_max_age_secs`].
    pub event_log_max_age_secs: Option<u64>,
    /// See [`ServeArgs::event_log_keep_last`].
    pub event_log_keep_last: Option<u64>,
    /// See [`ServeArgs::job_ttl_secs`].
    pub job_ttl_secs: Option<u64>,
    /// See [`ServeArgs::jobs_grace_secs`].
    pub jobs_grace_secs: Option<u64>,
    /// See [`ServeArgs::webhook_deliveries_max_age_secs`].
    pub webhook_deliveries_max_age_secs: Option<u64>,
    /// See [`ServeArgs::outbox_retention_secs`].
    pub outbox_retention_secs: Option<u64>,
    /// See [`ServeArgs::inbox_retention_secs`].
    pub inbox_retention_secs: Option<u64>,
    /// See [`ServeArgs::ws_allowed_origins`].
    pub ws_allowed_origins: Option<Vec<String>>,
    /// See [`ServeArgs::otlp_endpoint`].
    pub otlp_endpoint: Option<String>,
    /// See [`ServeArgs::otlp_protocol`].
    pub otlp_protocol: Option<String>,
    /// See [`ServeArgs::log_format`].
    pub log_format: Option<String>,
    /// See [`ServeArgs::demo_faults`].
    pub demo_faults: Option<bool>,
    /// See [`ServeArgs::chaos_experiments`].
    pub chaos_experiments: Option<bool>,
    /// See [`ServeArgs::allow_loopback_webhooks`].
    pub allow_loopback_webhooks: Option<bool>,
    /// See [`ServeArgs::inbound_webhook_secret`].
    pub inbound_webhook_secret: Option<String>,
    /// See [`ServeArgs::cursor_key`].
    pub cursor_key: Option<String>,
}

impl ServeFile {
    /// Reads the file's text: TOML, every setting optional, unknown ones
    /// refused.
    pub fn from_toml(text: &str) -> Result<Self, toml::de::Error> {
        toml::from_str(text)
    }
}

pub use crate::backend::{BrokerKind, Database};

/// The shortest shipping gRPC token taken, as for the admin token.
const MIN_GRPC_TOKEN_CHARS: usize = 16;

/// The validated configuration. Its `Debug` output shows no secret.
#[derive(Clone)]
pub struct ServeConfig {
    /// The listen address.
    pub listen: SocketAddr,
    /// The shipping service's gRPC address.
    pub shipping_grpc_listen: SocketAddr,
    /// The token the shipping gRPC port asks for (none: loopback only).
    pub shipping_grpc_token: Option<String>,
    /// The database.
    pub database: Database,
    /// The broker.
    pub broker: BrokerKind,
    /// The PostgreSQL schema.
    pub pg_schema: String,
    /// The NATS stream prefix.
    pub stream_prefix: String,
    /// The NATS streams' replicas.
    pub nats_replicas: usize,
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
    /// How often the storage-backed gauges are read.
    pub gauge_interval: Duration,
    /// Serving on with readiness failing after SIGTERM.
    pub lb_notice: Duration,
    /// What in-flight work gets once the listener closes.
    pub drain_timeout: Duration,
    /// HTTPS: the certificate chain and key files.
    pub tls: Option<TlsFiles>,
    /// Timeouts and the cap of every connection.
    pub connection_limits: ConnectionLimits,
    /// Long-lived connections per client address.
    pub max_streams_per_client: usize,
    /// Origins allowed to open `/ws`, besides the server's own.
    pub ws_allowed_origins: Vec<String>,
    /// What is pruned, and when.
    pub retention: Retention,
    /// How long an Idempotency-Key is remembered.
    pub idempotency_ttl: Duration,
    /// How long a report job lives after its last change.
    pub job_ttl: Duration,
    /// Demo faults on.
    pub demo_faults: bool,
    /// Chaos experiments honoured (from loopback clients).
    pub chaos_experiments: bool,
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
            .field("shipping_grpc_listen", &self.shipping_grpc_listen)
            .field("database", &self.database)
            .field("broker", &self.broker)
            .field("admin_token", &set(&self.admin_token))
            .field("shipping_grpc_token", &set(&self.shipping_grpc_token))
            .field("allowed_hosts", &self.allowed_hosts.describe())
            .field("api_keys", &self.api_keys)
            .field("secrets", &self.secrets)
            .field("public_metrics", &self.public_metrics)
            .field("connection_limits", &self.connection_limits)
            .field("retention", &self.retention)
            .field("inbound_webhook_secret", &set(&self.inbound_webhook_secret))
            .field("cursor_key", &set(&self.cursor_key))
            .finish_non_exhaustive()
    }
}

/// The certificate chain and private key `keel serve` answers HTTPS with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
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
    /// The TOML file's settings, or none without a file.
    fn file(&self) -> Result<ServeFile, ConfigError> {
        let Some(path) = &self.config else {
            return Ok(ServeFile::default());
        };
        let file_error = |reason: String| ConfigError::File {
            path: path.clone(),
            reason,
        };
        let text = sources::read_bounded(path).map_err(file_error)?;
        ServeFile::from_toml(&text).map_err(|e| file_error(e.to_string()))
    }

    /// Merges flags/environment over the file over the defaults, and
    /// validates the result.
    pub fn resolve(&self) -> Result<ServeConfig, ConfigError> {
        self.resolve_with(self.file()?)
    }

    /// Like [`resolve`](Self::resolve), with `file` in place of the file
    /// `--config` names.
    pub fn resolve_with(&self, file: ServeFile) -> Result<ServeConfig, ConfigError> {
        let retention = self.retention(&file)?;
        let idempotency_ttl = self
            .idempotency_key_ttl_secs
            .or(file.idempotency_key_ttl_secs)
            .map_or(keel_http::idempotency::DEFAULT_TTL, Duration::from_secs);
        if idempotency_ttl.is_zero() {
            return Err(invalid("idempotency-key-ttl-secs", "must be at least 1"));
        }
        let job_ttl = self
            .job_ttl_secs
            .or(file.job_ttl_secs)
            .map_or(keel_http::jobs::DEFAULT_TTL, Duration::from_secs);
        if job_ttl.is_zero() {
            return Err(invalid("job-ttl-secs", "must be at least 1"));
        }
        let listen = self
            .listen
            .clone()
            .or(file.listen)
            .unwrap_or_else(|| DEFAULT_LISTEN.to_owned());
        let listen: SocketAddr = listen
            .parse()
            .map_err(|e| invalid("listen", format!("`{listen}` is not IP:PORT ({e})")))?;
        let grpc = self
            .shipping_grpc_listen
            .clone()
            .or(file.shipping_grpc_listen)
            .unwrap_or_else(|| "127.0.0.1:0".to_owned());
        let shipping_grpc_listen: SocketAddr = grpc.parse().map_err(|e| {
            invalid(
                "shipping-grpc-listen",
                format!("`{grpc}` is not IP:PORT ({e})"),
            )
        })?;
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
        let nats_replicas = usize::from(self.nats_replicas.or(file.nats_replicas).unwrap_or(1));
        if !(1..=5).contains(&nats_replicas) {
            return Err(invalid("nats-replicas", "must be 1 to 5".to_owned()));
        }
        let admin_token = secret(
            self.admin_token.clone().or(file.admin_token),
            self.admin_token_file.clone().or(file.admin_token_file),
            "admin-token-file",
        )?;
        AdminToken::require_for(listen, admin_token.clone())
            .map_err(|e| invalid("admin-token", e.to_string()))?;
        let shipping_grpc_token = self
            .shipping_grpc_token
            .clone()
            .or(file.shipping_grpc_token)
            .or_else(|| admin_token.clone());
        if shipping_grpc_token
            .as_ref()
            .is_some_and(|token| token.chars().count() < MIN_GRPC_TOKEN_CHARS)
        {
            return Err(invalid(
                "shipping-grpc-token",
                format!("must be at least {MIN_GRPC_TOKEN_CHARS} characters"),
            ));
        }
        if shipping_grpc_token.is_none() && !shipping_grpc_listen.ip().is_loopback() {
            return Err(invalid(
                "shipping-grpc-listen",
                format!(
                    "{shipping_grpc_listen} is not a loopback address: give the port a \
                     credential (--shipping-grpc-token, or --admin-token)"
                ),
            ));
        }
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
        let connection_limits = connection_limits(ConnectionSettings {
            max_connections: self.max_connections.or(file.max_connections),
            max_connections_per_address: self
                .max_connections_per_address
                .or(file.max_connections_per_address),
            header_read_secs: self
                .header_read_timeout_secs
                .or(file.header_read_timeout_secs),
            body_read_secs: self.body_read_timeout_secs.or(file.body_read_timeout_secs),
            idle_secs: self.idle_timeout_secs.or(file.idle_timeout_secs),
        })?;
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
        let gauge_interval_secs = self
            .gauge_interval_secs
            .or(file.gauge_interval_secs)
            .unwrap_or(keel_admin::DEFAULT_EXPORT_INTERVAL.as_secs());
        if gauge_interval_secs == 0 {
            return Err(invalid("gauge-interval-secs", "must be at least 1"));
        }
        let lb_notice =
            Duration::from_secs(self.lb_notice_secs.or(file.lb_notice_secs).unwrap_or(1));
        let drain_timeout_secs = self
            .drain_timeout_secs
            .or(file.drain_timeout_secs)
            .unwrap_or(10);
        if drain_timeout_secs == 0 {
            return Err(invalid("drain-timeout-secs", "must be at least 1"));
        }
        let tls = match (
            self.tls_cert.clone().or(file.tls_cert),
            self.tls_key.clone().or(file.tls_key),
        ) {
            (Some(cert), Some(key)) => Some(TlsFiles { cert, key }),
            (None, None) => None,
            _ => {
                return Err(invalid(
                    "tls-cert",
                    "needs tls-key, and the other way round",
                ));
            }
        };
        if let Some(files) = &tls {
            keel_http::tls::server_config(&files.cert, &files.key)
                .map_err(|e| invalid("tls-cert", e.to_string()))?;
        }
        if cursor_key.as_ref().is_some_and(|k| k.len() < 32) {
            return Err(invalid("cursor-key", "must be at least 32 bytes"));
        }
        Ok(ServeConfig {
            listen,
            shipping_grpc_listen,
            shipping_grpc_token,
            database,
            broker,
            pg_schema,
            stream_prefix,
            nats_replicas,
            admin_token,
            allowed_hosts,
            api_keys,
            max_endpoints_per_tenant,
            secrets,
            public_metrics: self.public_metrics || file.public_metrics.unwrap_or(false),
            gauge_interval: Duration::from_secs(gauge_interval_secs),
            lb_notice,
            drain_timeout: Duration::from_secs(drain_timeout_secs),
            tls,
            connection_limits,
            max_streams_per_client,
            ws_allowed_origins,
            retention,
            idempotency_ttl,
            job_ttl,
            demo_faults: self.demo_faults || file.demo_faults.unwrap_or(false),
            chaos_experiments: self.chaos_experiments || file.chaos_experiments.unwrap_or(false),
            allow_loopback_webhooks: self.allow_loopback_webhooks
                || file.allow_loopback_webhooks.unwrap_or(false),
            inbound_webhook_secret,
            cursor_key,
        })
    }
}

impl ServeArgs {
    /// The retention settings, flags over the file over the defaults.
    fn retention(&self, file: &ServeFile) -> Result<Retention, ConfigError> {
        let defaults = Retention::default();
        let secs =
            |flag: Option<u64>, in_file: Option<u64>| flag.or(in_file).map(Duration::from_secs);
        let interval = secs(self.retention_interval_secs, file.retention_interval_secs)
            .unwrap_or(defaults.interval);
        if interval.is_zero() {
            return Err(invalid("retention-interval-secs", "must be at least 1"));
        }
        Ok(Retention {
            interval,
            event_log_max_age: match secs(self.event_log_max_age_secs, file.event_log_max_age_secs)
            {
                Some(age) if age.is_zero() => None,
                Some(age) => Some(age),
                None => defaults.event_log_max_age,
            },
            event_log_keep_last: match self.event_log_keep_last.or(file.event_log_keep_last) {
                Some(keep) => NonZeroU64::new(keep),
                None => defaults.event_log_keep_last,
            },
            jobs_grace: secs(self.jobs_grace_secs, file.jobs_grace_secs)
                .unwrap_or(defaults.jobs_grace),
            webhook_deliveries: secs(
                self.webhook_deliveries_max_age_secs,
                file.webhook_deliveries_max_age_secs,
            )
            .unwrap_or(defaults.webhook_deliveries),
            outbox: secs(self.outbox_retention_secs, file.outbox_retention_secs)
                .unwrap_or(defaults.outbox),
            inbox: secs(self.inbox_retention_secs, file.inbox_retention_secs)
                .unwrap_or(defaults.inbox),
        })
        .and_then(|retention| {
            // Zero would delete at once what must outlive redeliveries and
            // audits: say what is meant instead.
            for (setting, age) in [
                ("outbox-retention-secs", retention.outbox),
                ("inbox-retention-secs", retention.inbox),
                (
                    "webhook-deliveries-max-age-secs",
                    retention.webhook_deliveries,
                ),
            ] {
                if age.is_zero() {
                    return Err(invalid(setting, "must be at least 1"));
                }
            }
            Ok(retention)
        })
    }
}

impl ServeConfig {
    /// The backends to open.
    pub fn backend_options(&self) -> BackendOptions {
        BackendOptions {
            pg_schema: self.pg_schema.clone(),
            stream_prefix: self.stream_prefix.clone(),
            nats_replicas: self.nats_replicas,
            ..BackendOptions::new(self.database.clone(), self.broker.clone())
        }
    }
}
