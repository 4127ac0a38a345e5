//! What `keel serve` is told (flags, `KEEL_*`, TOML) and the checked
//! configuration it runs with.

use std::net::SocketAddr;
use std::num::NonZeroU64;
use std::path::PathBuf;
use std::time::Duration;

use keel_admin::AdminToken;
use keel_http::access::{AllowedHosts, ApiKeys};
use keel_http::health::ConnectionLimits;
use keel_http::tls::{ClientAuth, TlsFiles};
use keel_webhooks::sealing::SecretSealer;
use keel_webhooks::signing::Secret;

use crate::api::webhooks::{self};
use crate::backend::{self, BackendOptions, InvalidBackend};
use crate::shop::retention::Retention;

use super::DEFAULT_LISTEN;

mod settings;
mod sources;
mod telemetry;

pub use settings::{ServeArgs, ServeFile};

pub use telemetry::SERVICE_NAME;

use sources::{ConnectionSettings, api_keys, connection_limits, secret};

pub use crate::backend::{BrokerKind, Database, LeaseBackend};

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
    /// The stand-in dependencies' own PostgreSQL database, if not the
    /// system's (`--dependencies-database-url`).
    pub dependencies_database: Option<String>,
    /// The broker.
    pub broker: BrokerKind,
    /// Where leases are taken.
    pub leases: LeaseBackend,
    /// Whether the relay streams the outbox from a replication slot
    /// (`--outbox-relay wal`, PostgreSQL) rather than polling the table.
    pub outbox_relay_wal: bool,
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
    /// How often the console's history samples.
    pub history_interval: Duration,
    /// Serving on with readiness failing after SIGTERM.
    pub lb_notice: Duration,
    /// What in-flight work gets once the listener closes.
    pub drain_timeout: Duration,
    /// HTTPS: the certificate chain and key files, and the client CA for
    /// mTLS.
    pub tls: Option<TlsFiles>,
    /// The client certificate names the admin API and console admit (none:
    /// no certificate needed).
    pub admin_peers: Vec<String>,
    /// Where reports are kept.
    pub blobs: crate::blobs::BlobsAt,
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
    /// Seconds of payments outage from its first capture (demos, tests).
    pub demo_payments_outage: Option<Duration>,
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
            .field("leases", &self.leases)
            .field(
                "dependencies_database",
                &self.dependencies_database.as_ref().map(|_| "<set>"),
            )
            .field("outbox_relay_wal", &self.outbox_relay_wal)
            .field("admin_token", &set(&self.admin_token))
            .field("shipping_grpc_token", &set(&self.shipping_grpc_token))
            .field("allowed_hosts", &self.allowed_hosts.describe())
            .field("api_keys", &self.api_keys)
            .field("secrets", &self.secrets)
            .field("public_metrics", &self.public_metrics)
            .field("tls", &self.tls)
            .field("admin_peers", &self.admin_peers)
            .field("blobs", &self.blobs)
            .field("connection_limits", &self.connection_limits)
            .field("retention", &self.retention)
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
        self.over(&file)?.check()
    }

    /// Validates settings already layered, and fills in the defaults.
    fn check(&self) -> Result<ServeConfig, ConfigError> {
        let retention = self.retention()?;
        let idempotency_ttl = at_least_one_sec(
            "idempotency-key-ttl-secs",
            self.idempotency_key_ttl_secs,
            keel_http::idempotency::DEFAULT_TTL,
        )?;
        let job_ttl = at_least_one_sec(
            "job-ttl-secs",
            self.job_ttl_secs,
            keel_http::jobs::DEFAULT_TTL,
        )?;
        let listen = address("listen", self.listen.as_deref().unwrap_or(DEFAULT_LISTEN))?;
        let shipping_grpc_listen = address(
            "shipping-grpc-listen",
            self.shipping_grpc_listen
                .as_deref()
                .unwrap_or("127.0.0.1:0"),
        )?;
        let database = parse_database(self.database_url.as_deref().unwrap_or("sqlite:keel.db"))?;
        let dependencies_database =
            dependencies_database(self.dependencies_database_url.as_deref(), &database)?;
        let blobs = self.blobs(&database)?;
        let broker = parse_broker(self.broker.as_deref().unwrap_or("embedded"), &database)?;
        let leases = backend::parse_leases(self.leases.as_deref().unwrap_or("store"))?;
        let outbox_relay_wal = outbox_relay_wal(self.outbox_relay.as_deref(), &database)?;
        let nats_replicas = usize::from(self.nats_replicas.unwrap_or(1));
        if !(1..=5).contains(&nats_replicas) {
            return Err(invalid("nats-replicas", "must be 1 to 5".to_owned()));
        }
        let (admin_token, shipping_grpc_token) = self.tokens(listen, shipping_grpc_listen)?;
        let allowed_hosts = AllowedHosts::loopback()
            .with(self.allowed_hosts.clone())
            .map_err(|e| invalid("allowed-hosts", e.to_string()))?;
        let api_keys = api_keys(self.api_keys.clone(), self.api_keys_file.clone())?;
        let secrets = self.secrets()?;
        let connection_limits = connection_limits(ConnectionSettings {
            max_connections: self.max_connections,
            max_connections_per_address: self.max_connections_per_address,
            header_read_secs: self.header_read_timeout_secs,
            body_read_secs: self.body_read_timeout_secs,
            idle_secs: self.idle_timeout_secs,
        })?;
        let max_streams_per_client = self.max_streams_per_client()?;
        let (inbound_webhook_secret, cursor_key) = self.signing_keys()?;
        let history_interval = at_least_one_sec(
            "history-interval-secs",
            self.history_interval_secs,
            keel_admin::history::DEFAULT_INTERVAL,
        )?;
        let gauge_interval = at_least_one_sec(
            "gauge-interval-secs",
            self.gauge_interval_secs,
            keel_admin::history::DEFAULT_INTERVAL,
        )?;
        let (lb_notice, drain_timeout) = self.shutdown_timing()?;
        Ok(ServeConfig {
            listen,
            shipping_grpc_listen,
            shipping_grpc_token,
            database,
            dependencies_database,
            broker,
            leases,
            outbox_relay_wal,
            pg_schema: (self.pg_schema.clone())
                .unwrap_or_else(|| backend::DEFAULT_PG_SCHEMA.to_owned()),
            stream_prefix: (self.stream_prefix.clone())
                .unwrap_or_else(|| backend::DEFAULT_STREAM_PREFIX.to_owned()),
            nats_replicas,
            admin_token,
            allowed_hosts,
            api_keys,
            max_endpoints_per_tenant: (self.max_endpoints_per_tenant)
                .unwrap_or(webhooks::DEFAULT_MAX_ENDPOINTS_PER_TENANT),
            secrets,
            public_metrics: self.public_metrics,
            gauge_interval,
            history_interval,
            lb_notice,
            drain_timeout,
            tls: self.tls()?,
            admin_peers: self.admin_peers.clone(),
            blobs,
            connection_limits,
            max_streams_per_client,
            ws_allowed_origins: self.ws_allowed_origins.clone(),
            retention,
            idempotency_ttl,
            job_ttl,
            demo_faults: self.demo_faults,
            demo_payments_outage: self.demo_payments_outage_secs.map(Duration::from_secs),
            chaos_experiments: self.chaos_experiments,
            allow_loopback_webhooks: self.allow_loopback_webhooks,
            inbound_webhook_secret,
            cursor_key,
        })
    }

    /// `--blobs`, or its default beside a SQLite `database`.
    fn blobs(&self, database: &Database) -> Result<crate::blobs::BlobsAt, ConfigError> {
        match &self.blobs {
            Some(value) => crate::blobs::BlobsAt::parse(value).map_err(|e| invalid("blobs", e)),
            None => Ok(crate::blobs::BlobsAt::default_for(match database {
                Database::Sqlite(path) => Some(path.as_path()),
                #[allow(unreachable_patterns, reason = "without the postgres feature")]
                _ => None,
            })),
        }
    }

    /// The load balancers' notice (default 1 s) and the drain's timeout
    /// (default 10 s, at least 1 s).
    fn shutdown_timing(&self) -> Result<(Duration, Duration), ConfigError> {
        let lb_notice = Duration::from_secs(self.lb_notice_secs.unwrap_or(1));
        let drain_timeout = at_least_one_sec(
            "drain-timeout-secs",
            self.drain_timeout_secs,
            Duration::from_secs(10),
        )?;
        Ok((lb_notice, drain_timeout))
    }

    /// The admin token, and the shipping port's (the admin token unless
    /// given), each long enough, and required off loopback.
    fn tokens(
        &self,
        listen: SocketAddr,
        shipping_grpc_listen: SocketAddr,
    ) -> Result<(Option<String>, Option<String>), ConfigError> {
        let admin_token = secret(
            self.admin_token.clone(),
            self.admin_token_file.clone(),
            "admin-token-file",
        )?;
        AdminToken::require_for(listen, admin_token.clone())
            .map_err(|e| invalid("admin-token", e.to_string()))?;
        let shipping_grpc_token =
            (self.shipping_grpc_token.clone()).or_else(|| admin_token.clone());
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
        Ok((admin_token, shipping_grpc_token))
    }

    /// How webhook secrets are sealed at rest: with the key given, else not.
    fn secrets(&self) -> Result<SecretSealer, ConfigError> {
        let key = secret(
            self.secrets_key.clone(),
            self.secrets_key_file.clone(),
            "secrets-key-file",
        )?;
        match key {
            Some(key) => {
                SecretSealer::parse(&key).map_err(|e| invalid("secrets-key", e.to_string()))
            }
            None => Ok(SecretSealer::plaintext()),
        }
    }

    /// The realtime streams one client may hold, with the origins a
    /// WebSocket may come from checked on the way.
    fn max_streams_per_client(&self) -> Result<usize, ConfigError> {
        let max = (self.max_streams_per_client).unwrap_or(keel_realtime::DEFAULT_MAX_PER_CLIENT);
        if max == 0 {
            return Err(invalid("max-streams-per-client", "must be at least 1"));
        }
        keel_realtime::RealtimeOptions::new()
            .allowed_origins(self.ws_allowed_origins.iter().cloned())
            .validate()
            .map_err(|e| invalid("ws-allowed-origins", e.to_string()))?;
        Ok(max)
    }

    /// The inbound webhooks' secret and the cursors' key, each checked.
    fn signing_keys(&self) -> Result<(Option<String>, Option<String>), ConfigError> {
        if let Some(secret) = &self.inbound_webhook_secret {
            Secret::parse(secret).map_err(|e| invalid("inbound-webhook-secret", e.to_string()))?;
        }
        if self.cursor_key.as_ref().is_some_and(|k| k.len() < 32) {
            return Err(invalid("cursor-key", "must be at least 32 bytes"));
        }
        Ok((self.inbound_webhook_secret.clone(), self.cursor_key.clone()))
    }

    /// The certificate and key, both or neither, readable and matching;
    /// the client CA and the admin peers only with them.
    fn tls(&self) -> Result<Option<TlsFiles>, ConfigError> {
        let tls = match (self.tls_cert.clone(), self.tls_key.clone()) {
            (Some(cert), Some(key)) => Some(TlsFiles::new(cert, key)),
            (None, None) => None,
            _ => {
                return Err(invalid(
                    "tls-cert",
                    "needs tls-key, and the other way round",
                ));
            }
        };
        let tls = match (tls, self.tls_client_ca.clone()) {
            (Some(files), Some(ca)) => Some(files.client_ca(
                ca,
                if self.tls_require_client_cert {
                    ClientAuth::Required
                } else {
                    ClientAuth::Optional
                },
            )),
            (None, Some(_)) => return Err(invalid("tls-client-ca", "needs tls-cert and tls-key")),
            (tls, None) => tls,
        };
        if self.tls_require_client_cert && self.tls_client_ca.is_none() {
            return Err(invalid("tls-require-client-cert", "needs tls-client-ca"));
        }
        if !self.admin_peers.is_empty() && self.tls_client_ca.is_none() {
            return Err(invalid(
                "admin-peers",
                "needs tls-client-ca: without client certificates no peer has a name",
            ));
        }
        if let Some(files) = &tls {
            files
                .load()
                .map_err(|e| invalid("tls-cert", e.to_string()))?;
        }
        Ok(tls)
    }
}

/// `text` as an `IP:PORT`, or what is wrong with it.
fn address(setting: &'static str, text: &str) -> Result<SocketAddr, ConfigError> {
    text.parse()
        .map_err(|e| invalid(setting, format!("`{text}` is not IP:PORT ({e})")))
}

/// A duration given in seconds (`default` when not given); zero refused.
fn at_least_one_sec(
    setting: &'static str,
    secs: Option<u64>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    let duration = secs.map_or(default, Duration::from_secs);
    if duration.is_zero() {
        return Err(invalid(setting, "must be at least 1"));
    }
    Ok(duration)
}

impl ServeArgs {
    /// The retention settings over the defaults.
    fn retention(&self) -> Result<Retention, ConfigError> {
        let defaults = Retention::default();
        let secs = |given: Option<u64>| given.map(Duration::from_secs);
        let interval = secs(self.retention_interval_secs).unwrap_or(defaults.interval);
        if interval.is_zero() {
            return Err(invalid("retention-interval-secs", "must be at least 1"));
        }
        Ok(Retention {
            interval,
            event_log_max_age: match secs(self.event_log_max_age_secs) {
                Some(age) if age.is_zero() => None,
                Some(age) => Some(age),
                None => defaults.event_log_max_age,
            },
            event_log_keep_last: match self.event_log_keep_last {
                Some(keep) => NonZeroU64::new(keep),
                None => defaults.event_log_keep_last,
            },
            jobs_grace: secs(self.jobs_grace_secs).unwrap_or(defaults.jobs_grace),
            webhook_deliveries: secs(self.webhook_deliveries_max_age_secs)
                .unwrap_or(defaults.webhook_deliveries),
            outbox: secs(self.outbox_retention_secs).unwrap_or(defaults.outbox),
            inbox: secs(self.inbox_retention_secs).unwrap_or(defaults.inbox),
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

/// `--dependencies-database-url`: another PostgreSQL database, beside a
/// PostgreSQL system's.
fn dependencies_database(
    url: Option<&str>,
    database: &Database,
) -> Result<Option<String>, ConfigError> {
    let Some(url) = url else {
        return Ok(None);
    };
    let parsed =
        backend::parse_database(url).map_err(|e| invalid("dependencies-database-url", e.reason))?;
    match (parsed, database) {
        (Database::Postgres(url), Database::Postgres(_)) => Ok(Some(url)),
        _ => Err(invalid(
            "dependencies-database-url",
            "give postgres://... beside a postgres:// --database-url (a SQLite \
             system keeps its dependencies in a file beside its own)"
                .to_owned(),
        )),
    }
}

/// `--outbox-relay`: `table` (the default) or `wal`, which needs PostgreSQL.
fn outbox_relay_wal(setting: Option<&str>, database: &Database) -> Result<bool, ConfigError> {
    match (setting.unwrap_or("table"), database) {
        ("table", _) => Ok(false),
        ("wal", Database::Postgres(_)) => Ok(true),
        ("wal", _) => Err(invalid(
            "outbox-relay",
            "`wal` streams PostgreSQL's write-ahead log: use a postgres:// --database-url, \
             or `table`"
                .to_owned(),
        )),
        (other, _) => Err(invalid(
            "outbox-relay",
            format!("`{other}` is neither `table` nor `wal`"),
        )),
    }
}
