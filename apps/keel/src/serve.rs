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
use axum::routing::{get, post};
use keel_http::admin::{Admin, AdminToken, BrokerLag};
use keel_http::console::Console;
use keel_http::health::{DEFAULT_POOL_EXHAUSTION_GRACE, Health};
use keel_http::jobs::{JobRequested, Jobs, JobsOptions};
use keel_http::webhooks::WebhookReceiver;
use keel_http::webhooks::signing::Secret;
use keel_messaging::Outbox;
use keel_messaging::broker::Broker;
use keel_messaging::consumer::{Consumer, Group};
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
    /// unless listening on loopback.
    #[arg(long, env = "KEEL_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
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

/// The validated configuration.
#[derive(Debug, Clone)]
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
    /// Demo faults on.
    pub demo_faults: bool,
    /// Loopback webhooks allowed.
    pub allow_loopback_webhooks: bool,
    /// Inbound webhook secret.
    pub inbound_webhook_secret: Option<String>,
    /// Cursor key.
    pub cursor_key: Option<String>,
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
        let admin_token = self.admin_token.clone().or(file.admin_token);
        AdminToken::require_for(listen, admin_token.clone())
            .map_err(|e| invalid("admin-token", e.to_string()))?;
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
            demo_faults: self.demo_faults || file.demo_faults.unwrap_or(false),
            allow_loopback_webhooks: self.allow_loopback_webhooks
                || file.allow_loopback_webhooks.unwrap_or(false),
            inbound_webhook_secret,
            cursor_key,
        })
    }
}

/// The admin API and the console, behind the admin token. Mounted by
/// `keel serve`; the chaos run and tests can mount it too.
pub fn admin_routes<S: ShopStore>(c: &Components<S>, token: AdminToken) -> Router {
    let lag = BrokerLag::new(Arc::clone(&c.broker))
        .group(fulfilment::TOPIC, fulfilment::GROUP)
        .group(keel_http::jobs::DEFAULT_TOPIC, REPORTS_GROUP);
    let admin = Admin::builder(c.store.clone())
        .token(token)
        .outbox(Outbox::new(c.store.clone()))
        .sagas(c.orchestrator.clone())
        .breakers(c.breakers.clone())
        .gauges(lag)
        .build();
    admin.router().merge(Console::new(admin).router())
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
    };
    let webhook_routes = Router::new()
        .route(
            "/webhook-endpoints",
            post(webhooks::create_endpoint::<S>).get(webhooks::list_endpoints::<S>),
        )
        .route(
            "/webhook-endpoints/{id}/deliveries",
            get(webhooks::list_deliveries::<S>),
        )
        .route("/deliveries/{id}/resend", post(webhooks::resend::<S>))
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
    Ok(Router::new()
        .route("/reports", jobs.create_route())
        .merge(jobs.routes())
        .route(
            "/reports/{id}",
            get(crate::api::reports::get_report).with_state(reports),
        )
        .merge(webhook_routes)
        .merge(health.router())
        .route(
            "/metrics",
            get(|| async { crate::metrics_report::render() }),
        )
        .route(
            "/openapi.json",
            get(|| async {
                (
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    openapi::json(),
                )
            }),
        )
        .merge(admin_routes(c, token)))
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

async fn serve_on<S: ShopStore>(
    config: ServeConfig,
    store: S,
    broker: Arc<dyn Broker>,
) -> anyhow::Result<()> {
    let system = SystemConfig {
        listen: config.listen,
        demo_faults: config.demo_faults,
        allow_loopback_webhooks: config.allow_loopback_webhooks,
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
    let reports: Reports = Arc::default();
    let jobs = Jobs::new(Outbox::new(store.clone()), JobsOptions::new("report"))
        .map_err(|e| anyhow::anyhow!("jobs: {e}"))?;
    let worker = Consumer::builder(store.clone(), Arc::clone(&broker))
        .group(
            Group::new(keel_http::jobs::DEFAULT_TOPIC, REPORTS_GROUP).on(
                <JobRequested as keel_messaging::Event>::TYPE,
                ReportWorker {
                    jobs: jobs.clone(),
                    reports: Arc::clone(&reports),
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
}
