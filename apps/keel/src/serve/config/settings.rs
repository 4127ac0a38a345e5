//! `keel serve`'s settings as given: one struct that is the flags, the
//! `KEEL_*` variables and the TOML file's keys at once, and how the sources
//! layer.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{ConfigError, invalid};

/// `keel serve`'s settings: each is a flag, reads `KEEL_<NAME>`, and is a
/// key of the TOML file `--config` names (the flag's name with `_` for
/// `-`). One struct serves all three, so a setting cannot exist in one
/// source and be missing from another; [`resolve`](Self::resolve) layers
/// flags and environment over the file over the defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq, clap::Args, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ServeArgs {
    /// A TOML file with the same settings (flags and environment win).
    #[arg(long, env = "KEEL_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Where to listen [default: 127.0.0.1:8080].
    #[arg(long, env = "KEEL_LISTEN")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    /// Where the shop's shipping service answers gRPC
    /// (`shipping.v1.Shipping`, health, reflection) [default: 127.0.0.1:0,
    /// a free port, printed at start].
    #[arg(long, env = "KEEL_SHIPPING_GRPC_LISTEN")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shipping_grpc_listen: Option<String>,
    /// The token every call on the shipping gRPC port (but health) must
    /// carry as `authorization: Bearer` [default: the admin token]; a
    /// non-loopback --shipping-grpc-listen needs one.
    #[arg(long, env = "KEEL_SHIPPING_GRPC_TOKEN", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shipping_grpc_token: Option<String>,
    /// `sqlite:PATH` (default `sqlite:keel.db`), or `postgres://...` with the
    /// `postgres` feature.
    #[arg(long, env = "KEEL_DATABASE_URL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub database_url: Option<String>,
    /// `postgres://...`: a database of their own for the reference shop's
    /// stand-in dependencies (payments, inventory), as other services have
    /// theirs; with a postgres:// --database-url only [default: a file
    /// beside a SQLite database; the system's own PostgreSQL database].
    #[arg(long, env = "KEEL_DEPENDENCIES_DATABASE_URL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dependencies_database_url: Option<String>,
    /// `embedded` (a SQLite broker next to the database), or `nats://...`
    /// with the `nats` feature.
    #[arg(long, env = "KEEL_BROKER")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub broker: Option<String>,
    /// Where the leases that pick one process to prune and run retention
    /// are taken: `store` (the database) or `redis://...` with the `redis`
    /// feature [default: store]. A Redis lease is a lease, not a lock:
    /// those jobs are safe to run twice.
    #[arg(long, env = "KEEL_LEASES")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub leases: Option<String>,
    /// How the outbox relay finds new rows: `table` (it polls the outbox
    /// table, woken by commits) or, on PostgreSQL, `wal` (it streams them
    /// from a logical replication slot as they commit; the server needs
    /// `wal_level = logical`) [default: table].
    #[arg(long, env = "KEEL_OUTBOX_RELAY")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outbox_relay: Option<String>,
    /// PostgreSQL: the schema holding every table [default: keel].
    /// Processes sharing the work must use the same one.
    #[arg(long, env = "KEEL_PG_SCHEMA")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pg_schema: Option<String>,
    /// NATS: the prefix of the JetStream streams; RabbitMQ: of the
    /// exchanges and queues; Kafka: of the topics [default: KEEL].
    /// Processes sharing the work must use the same one.
    #[arg(long, env = "KEEL_STREAM_PREFIX")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stream_prefix: Option<String>,
    /// NATS: how many servers of the JetStream cluster keep each stream
    /// [default: 1]. Use 3 on a cluster: with 1, a crash of the server's
    /// machine can lose acknowledged messages (warned at start).
    #[arg(long, env = "KEEL_NATS_REPLICAS", value_parser = clap::value_parser!(u8).range(1..=5))]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub nats_replicas: Option<u8>,
    /// The admin API and console token (at least 16 characters); required
    /// unless listening on loopback. Prefer KEEL_ADMIN_TOKEN or
    /// --admin-token-file: a flag's value is visible in `ps`.
    #[arg(long, env = "KEEL_ADMIN_TOKEN", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_token: Option<String>,
    /// A file holding the admin token (its first line).
    #[arg(long, env = "KEEL_ADMIN_TOKEN_FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admin_token_file: Option<PathBuf>,
    /// More `Host` names the admin API and console answer to (`name` or
    /// `name:port`, comma-separated; `*` for any), besides localhost,
    /// 127.0.0.1 and `[::1]`.
    #[arg(long, env = "KEEL_ALLOWED_HOSTS", value_delimiter = ',')]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub allowed_hosts: Vec<String>,
    /// A tenant's API key for webhook management, `tenant:key` (repeat the
    /// flag, or comma-separate in KEEL_API_KEYS).
    #[arg(
        long = "api-key",
        env = "KEEL_API_KEYS",
        value_delimiter = ',',
        hide_env_values = true
    )]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub api_keys: Vec<String>,
    /// A file of API keys, one `tenant:key` per line.
    #[arg(long, env = "KEEL_API_KEYS_FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_keys_file: Option<PathBuf>,
    /// Webhook endpoints one tenant may register [default: 10].
    #[arg(long, env = "KEEL_MAX_ENDPOINTS_PER_TENANT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_endpoints_per_tenant: Option<usize>,
    /// The key webhook secrets are sealed with at rest: 32 bytes as base64
    /// or hex (without it they are stored in plain text).
    #[arg(long, env = "KEEL_SECRETS_KEY", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secrets_key: Option<String>,
    /// A file holding the secrets key (its first line).
    #[arg(long, env = "KEEL_SECRETS_KEY_FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub secrets_key_file: Option<PathBuf>,
    /// Serve /metrics and /debug/deep to anyone (default: behind the admin
    /// credentials, like the admin API).
    #[arg(long, env = "KEEL_PUBLIC_METRICS")]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub public_metrics: bool,
    /// Seconds to keep serving, with /readyz failing, after SIGTERM, so
    /// load balancers stop sending before the listener closes [default: 1].
    #[arg(long, env = "KEEL_LB_NOTICE_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lb_notice_secs: Option<u64>,
    /// Seconds in-flight requests and long-lived connections get once the
    /// listener closes, before they are aborted [default: 10]. Keep
    /// `lb-notice + drain-timeout` under the orchestrator's grace period.
    #[arg(long, env = "KEEL_DRAIN_TIMEOUT_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drain_timeout_secs: Option<u64>,
    /// A PEM certificate chain: serve HTTPS (with --tls-key).
    #[arg(long, env = "KEEL_TLS_CERT", requires = "tls_key")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = "KEEL_TLS_KEY", requires = "tls_cert")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    /// Where reports are kept: a directory, or `s3://bucket[/folder]` so
    /// that every process of a scaled-out system serves them (AWS settings
    /// from the environment) [default: the SQLite file's name and .blobs,
    /// keel-blobs on PostgreSQL].
    #[arg(long, env = "KEEL_BLOBS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub blobs: Option<String>,
    /// A PEM file of the CAs client certificates are checked against
    /// (mTLS): a client that presents a certificate must chain to one, and
    /// its names become its identity. Re-read when it changes, like
    /// --tls-cert and --tls-key.
    #[arg(long, env = "KEEL_TLS_CLIENT_CA", requires = "tls_cert")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_client_ca: Option<PathBuf>,
    /// Refuse, at the handshake, every client without a certificate of
    /// --tls-client-ca (default: such clients reach the public routes).
    #[arg(long, env = "KEEL_TLS_REQUIRE_CLIENT_CERT", requires = "tls_client_ca")]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub tls_require_client_cert: bool,
    /// The client certificate names (DNS names, or URIs such as SPIFFE
    /// IDs; comma-separated) the admin API and the console admit, besides
    /// their token: any other caller gets 403. Needs --tls-client-ca.
    #[arg(
        long,
        env = "KEEL_ADMIN_PEERS",
        value_delimiter = ',',
        requires = "tls_client_ca"
    )]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub admin_peers: Vec<String>,
    /// Seconds between reads of the gauges kept in storage (dead letters,
    /// sagas, outbox and consumer lag, webhook endpoints) [default: 5, the
    /// history's interval: the console's lag graph is only as fine as
    /// these reads].
    #[arg(long, env = "KEEL_GAUGE_INTERVAL_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gauge_interval_secs: Option<u64>,
    /// Seconds between the samples of the console's history (the graphs of
    /// throughput, lag, latency and breaker state per consumer group and
    /// dependency): the newest 180 samples are kept, and 1,440 points
    /// merging 12 samples each [default: 5, so 15 minutes and 24 hours].
    #[arg(long, env = "KEEL_HISTORY_INTERVAL_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub history_interval_secs: Option<u64>,
    /// The most connections open at once [default: 1024]; past it a new
    /// one gets 503.
    #[arg(long, env = "KEEL_MAX_CONNECTIONS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<usize>,
    /// Seconds a request head may take to arrive (also bounds an idle
    /// keep-alive connection) [default: 10].
    #[arg(long, env = "KEEL_HEADER_READ_TIMEOUT_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub header_read_timeout_secs: Option<u64>,
    /// One client address's share of the connections [default: 256]; past
    /// it, its new connections get 503.
    #[arg(long, env = "KEEL_MAX_CONNECTIONS_PER_ADDRESS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections_per_address: Option<usize>,
    /// Seconds a request body may take to arrive whole, counted from its
    /// head, on every route [default: 10]; past it, 408.
    #[arg(long, env = "KEEL_BODY_READ_TIMEOUT_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub body_read_timeout_secs: Option<u64>,
    /// Seconds a connection may move no byte before it is closed
    /// [default: 60].
    #[arg(long, env = "KEEL_IDLE_TIMEOUT_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idle_timeout_secs: Option<u64>,
    /// SSE streams, WebSockets and waiting long polls one client address
    /// may hold [default: 16].
    #[arg(long, env = "KEEL_MAX_STREAMS_PER_CLIENT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_streams_per_client: Option<usize>,
    /// Seconds an Idempotency-Key is remembered: a retry after that is a
    /// new request [default: 86400].
    #[arg(long, env = "KEEL_IDEMPOTENCY_KEY_TTL_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub idempotency_key_ttl_secs: Option<u64>,
    /// Seconds between retention passes, which delete expired
    /// Idempotency-Keys, old event-log events, expired jobs and finished
    /// webhook deliveries [default: 600].
    #[arg(long, env = "KEEL_RETENTION_INTERVAL_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retention_interval_secs: Option<u64>,
    /// Seconds the event log keeps an event [default: 604800, 7 days]; 0
    /// for no age limit.
    #[arg(long, env = "KEEL_EVENT_LOG_MAX_AGE_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_log_max_age_secs: Option<u64>,
    /// Events the event log keeps per stream, newest first [default:
    /// 10000]; 0 for no count limit.
    #[arg(long, env = "KEEL_EVENT_LOG_KEEP_LAST")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_log_keep_last: Option<u64>,
    /// Seconds a report job lives after its last change [default: 86400];
    /// then it answers 410 until it is pruned.
    #[arg(long, env = "KEEL_JOB_TTL_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job_ttl_secs: Option<u64>,
    /// Seconds a job is kept after it expired (it answers 410 meanwhile)
    /// [default: 86400].
    #[arg(long, env = "KEEL_JOBS_GRACE_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jobs_grace_secs: Option<u64>,
    /// Seconds a finished webhook delivery, with its attempts, is kept
    /// [default: 604800, 7 days].
    #[arg(long, env = "KEEL_WEBHOOK_DELIVERIES_MAX_AGE_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub webhook_deliveries_max_age_secs: Option<u64>,
    /// Seconds a published outbox row is kept [default: 604800, 7 days].
    #[arg(long, env = "KEEL_OUTBOX_RETENTION_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub outbox_retention_secs: Option<u64>,
    /// Seconds an inbox row (a processed message's id) is kept, which must
    /// outlast any redelivery [default: 604800, 7 days].
    #[arg(long, env = "KEEL_INBOX_RETENTION_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inbox_retention_secs: Option<u64>,
    /// Origins (`scheme://host[:port]`, comma-separated) whose pages may
    /// open `/ws`, besides the server's own.
    #[arg(long, env = "KEEL_WS_ALLOWED_ORIGINS", value_delimiter = ',')]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ws_allowed_origins: Vec<String>,
    /// Export spans over OTLP to this collector (`http://host:4318`, or
    /// `:4317` with `--otlp-protocol grpc`); without it the standard
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` decides, and unset nothing is exported.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp_endpoint: Option<String>,
    /// `http/protobuf` or `grpc` [default: `OTEL_EXPORTER_OTLP_PROTOCOL`,
    /// else `http/protobuf`].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub otlp_protocol: Option<String>,
    /// `text` or `json` (one object per line, with `trace_id` and
    /// `span_id`) [default: text].
    #[arg(long, env = "KEEL_LOG_FORMAT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_format: Option<String>,
    /// Honour `X-Keel-Demo-Fault` on `POST /orders` (for demos and tests).
    #[arg(long, env = "KEEL_DEMO_FAULTS")]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub demo_faults: bool,
    /// The stand-in payments service answers `503` for this many seconds
    /// from its first capture, then recovers (for demos and tests: the
    /// payments breaker opens, probes, and closes again).
    #[arg(long, env = "KEEL_DEMO_PAYMENTS_OUTAGE_SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub demo_payments_outage_secs: Option<u64>,
    /// Honour `x-chaos-experiment` from loopback clients: the request runs
    /// in that experiment, and the mark goes on to the dependencies.
    #[arg(long, env = "KEEL_CHAOS_EXPERIMENTS")]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub chaos_experiments: bool,
    /// Allow webhook endpoints on loopback addresses (the SSRF guard
    /// refuses them otherwise).
    #[arg(long, env = "KEEL_ALLOW_LOOPBACK_WEBHOOKS")]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub allow_loopback_webhooks: bool,
    /// The secret inbound webhooks are signed with (`whsec_...`).
    #[arg(long, env = "KEEL_INBOUND_WEBHOOK_SECRET", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub inbound_webhook_secret: Option<String>,
    /// The key pagination cursors are signed with (at least 32 bytes);
    /// random per start when unset, so cursors do not survive a restart.
    #[arg(long, env = "KEEL_CURSOR_KEY", hide_env_values = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cursor_key: Option<String>,
}

/// The TOML file's settings: the same as the flags' (every one optional,
/// unknown keys refused).
pub type ServeFile = ServeArgs;

impl ServeArgs {
    /// Reads a settings file's text: TOML, every setting optional, unknown
    /// ones refused.
    pub fn from_toml(text: &str) -> Result<Self, toml::de::Error> {
        toml::from_str(text)
    }

    /// These settings over `file`'s: a setting given here (a flag, or its
    /// `KEEL_*` variable) wins, one left out keeps the file's. The settings
    /// are one flat table, so layering is one table over the other.
    pub fn over(&self, file: &ServeFile) -> Result<ServeArgs, ConfigError> {
        let table = |settings: &ServeArgs| {
            toml::Table::try_from(settings).map_err(|e| invalid("settings", e.to_string()))
        };
        let mut layered = table(file)?;
        layered.extend(table(self)?);
        let mut settings: ServeArgs = layered
            .try_into()
            .map_err(|e: toml::de::Error| invalid("settings", e.to_string()))?;
        settings.config.clone_from(&self.config);
        Ok(settings)
    }
}
