//! `keel serve`: the reference shop as a server, configured by flags,
//! environment (`KEEL_*`) and a TOML file, in that order of precedence.
//!
//! Configuration is validated before anything starts, and each refusal
//! says what to change: a backend that is not compiled in, a malformed
//! address, an admin API on a public address without a token.

mod config;
#[cfg(test)]
mod tests;

use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::routing::{MethodRouter, delete, get, post};
use keel_admin::console::Console;
use keel_admin::{Admin, AdminToken, BrokerLag};
use keel_http::access::{AllowedHosts, ApiKeyLayer, FailureThrottle};
use keel_http::health::{DEFAULT_POOL_EXHAUSTION_GRACE, Health, HealthRoutes};
use keel_http::jobs::{JobRequested, Jobs, JobsOptions};
use keel_messaging::Outbox;
use keel_messaging::consumer::{Consumer, Group};
use keel_store::broker::Broker;
use keel_webhooks::WebhookReceiver;
use keel_webhooks::signing::Secret;

use crate::api::openapi;
use crate::api::reports::{ReportWorker, Reports};
use crate::api::webhooks::{self, WebhookApi};
use crate::backend::{self, Backend, OnStore, OpenedStore};
use crate::shop::leases::Leases;
use crate::shop::services::PaymentsFaults;
use crate::shop::{Components, ShopStore, StartError, System, SystemConfig, fulfilment};

pub use config::*;

/// The default listen address.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";

/// The consumer group that runs report jobs.
pub const REPORTS_GROUP: &str = "reports";

/// The admin API and the console, behind the admin token and answering
/// only `hosts` (`over_tls`: the server terminates TLS, so session cookies
/// are always `Secure`). Mounted by `keel serve`; the chaos run and tests can mount
/// it too.
pub fn admin_routes<S: ShopStore>(
    c: &Components<S>,
    token: AdminToken,
    hosts: AllowedHosts,
    over_tls: bool,
) -> (Admin<S>, Router) {
    let lag = BrokerLag::new(Arc::clone(&c.broker))
        .group(fulfilment::TOPIC, fulfilment::GROUP)
        .group(keel_http::jobs::DEFAULT_TOPIC, REPORTS_GROUP);
    let admin = Admin::builder(c.store.clone());
    let admin = match crate::metrics_report::history() {
        Some(history) => admin.history(history),
        None => admin,
    };
    let admin = admin
        .token(token)
        .allowed_hosts(hosts)
        .served_over_tls(over_tls)
        .outbox(Outbox::new(c.store.clone()))
        .sagas(c.orchestrator.clone())
        .breakers(c.breakers.clone())
        .gauges(lag)
        .build();
    let router = admin.router().merge(Console::new(admin.clone()).router());
    (admin, router)
}

/// The webhook management API (behind the tenants' API keys) and the
/// inbound webhook receiver.
fn webhook_routes<S: ShopStore>(
    c: &Components<S>,
    config: &ServeConfig,
) -> Result<Router, StartError> {
    let secret = match &config.inbound_webhook_secret {
        Some(s) => Secret::parse(s),
        None => Secret::generate(),
    }
    .map_err(|e| StartError::Config(e.to_string()))?;
    let webhook_api = WebhookApi {
        endpoints: c.endpoints.clone(),
        store: c.store.clone(),
        receiver: WebhookReceiver::new([secret]),
        max_per_tenant: config.max_endpoints_per_tenant,
        creating: Arc::default(),
    };
    // Each method router gets the key check of its own, so a method a
    // route lacks answers 405 with `Allow`, not 401.
    let management = ApiKeyLayer::new(config.api_keys.clone(), FailureThrottle::default());
    let managed = |route: MethodRouter<WebhookApi<S>>| route.route_layer(management.clone());
    Ok(Router::new()
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
        .with_state(webhook_api))
}

/// The probes and the deep check: the drain, the store and its pool, and
/// each dependency answering within a second.
fn health<S: ShopStore>(c: &Components<S>) -> Result<Health, StartError> {
    let http = reqwest::Client::new();
    let pool = c.store.clone();
    let mut health = Health::builder()
        .drain(&c.drain)
        .store(c.store.clone())
        .pool_exhaustion("db_pool", DEFAULT_POOL_EXHAUSTION_GRACE, move || {
            pool.connections_free()
        });
    health = c.leases.ping_from(health);
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
    health
        .build()
        .map_err(|e| StartError::Config(e.to_string()))
}

/// Deletes the reports whose jobs retention has pruned (written longer
/// ago than a job lives plus its grace), on every retention interval until
/// the drain starts: idempotent, so every process may run it.
fn spawn_report_sweep<S: ShopStore>(c: &Components<S>, config: &ServeConfig, reports: Reports) {
    let kept = config.job_ttl + config.retention.jobs_grace;
    let kept = chrono::Duration::from_std(kept).unwrap_or(chrono::Duration::MAX);
    let interval = config.retention.interval;
    let drain = c.drain.clone();
    let stop = async move { drain.wait_for(keel_http::health::Phase::Draining).await };
    tokio::spawn(async move {
        keel_core::clock::every(interval, stop, || async {
            let Some(cut_off) = keel_core::clock::utc_now().checked_sub_signed(kept) else {
                return;
            };
            match reports.sweep(cut_off).await {
                Ok(0) => {}
                Ok(swept) => tracing::info!(swept, "reports of pruned jobs deleted"),
                Err(error) => tracing::warn!(%error, "the report sweep failed"),
            }
        })
        .await;
    });
}

/// The routes `keel serve` adds to the public API: reports and jobs,
/// webhooks, health, metrics, OpenAPI, admin and console.
pub fn serve_routes<S: ShopStore>(
    c: &Components<S>,
    config: &ServeConfig,
    reports: Reports,
    jobs: &Jobs<S>,
) -> Result<Router, StartError> {
    let webhook_routes = webhook_routes(c, config)?;
    let health = health(c)?;
    let token = AdminToken::require_for(config.listen, config.admin_token.clone())
        .map_err(|e| StartError::Config(e.to_string()))?;
    let (admin, admin_routes) =
        admin_routes(c, token, config.allowed_hosts.clone(), config.tls.is_some());
    let admin_routes = if config.admin_peers.is_empty() {
        admin_routes
    } else {
        admin_routes.layer(keel_http::tls::RequirePeerLayer::new(
            config.admin_peers.iter().cloned(),
        ))
    };
    // Dead letters, sagas and lag reach /metrics whether or not anyone
    // opens the console, so the shipped alert rules can fire.
    let drain = c.drain.clone();
    tokio::spawn(
        admin
            .gauge_export()
            .every(config.gauge_interval)
            .run(async move {
                drain.wait_for(keel_http::health::Phase::Draining).await;
            }),
    );
    spawn_report_sweep(c, config, reports.clone());
    if let Some(history) = admin.history() {
        let drain = c.drain.clone();
        tokio::spawn(history.clone().run(async move {
            drain.wait_for(keel_http::health::Phase::Draining).await;
        }));
    }
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

/// Opens the configured store and broker.
pub async fn open(config: &ServeConfig) -> anyhow::Result<Backend> {
    Ok(Backend::open(&config.backend_options()).await?)
}

/// Runs the server until SIGTERM/ctrl-c, printing exactly one line to
/// stdout once listening: `keel: listening on http://ADDR`.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let config = args.resolve()?;
    crate::metrics_report::install_with_history(config.history_interval);
    let options = config.backend_options();
    tracing::info!(backends = %options.describe(), "opening the backends");
    let backend = Backend::open(&options).await?;
    let dependencies = match &config.dependencies_database {
        Some(url) => {
            let database = Database::Postgres(url.clone());
            Some(Backend::open_beside(&options, database).await?)
        }
        None => None,
    };
    backend
        .run(Serve {
            config,
            dependencies,
        })
        .await
}

/// The server, on whichever store was opened.
struct Serve {
    config: ServeConfig,
    /// The dependencies' own database, if they have one.
    dependencies: Option<OpenedStore>,
}

impl OnStore for Serve {
    type Output = anyhow::Result<()>;

    async fn run<S: ShopStore>(self, store: S, broker: Arc<dyn Broker>) -> anyhow::Result<()> {
        let dependencies = match self.dependencies {
            Some(own) => Some(own.downcast::<S>().ok_or_else(|| {
                anyhow::anyhow!("the dependencies' database is not of the system's kind")
            })?),
            None => None,
        };
        serve_on(self.config, store, broker, dependencies).await
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

/// The stand-in payments' faults: an outage from the first capture with
/// `--demo-payments-outage-secs`, none otherwise.
fn payments_faults(config: &ServeConfig) -> PaymentsFaults {
    match config.demo_payments_outage {
        Some(fail_for) => PaymentsFaults {
            start_after: Some(0),
            fail_for,
            ..PaymentsFaults::none()
        },
        None => PaymentsFaults::none(),
    }
}

/// The shop's configuration from `keel serve`'s.
fn system_config(config: &ServeConfig) -> anyhow::Result<SystemConfig> {
    Ok(SystemConfig {
        listen: config.listen,
        shipping_grpc: config.shipping_grpc_listen,
        shipping_grpc_token: config.shipping_grpc_token.clone(),
        demo_faults: config.demo_faults,
        payments_faults: payments_faults(config),
        chaos_experiments: config.chaos_experiments,
        allow_loopback_webhooks: config.allow_loopback_webhooks,
        secrets: config.secrets.clone(),
        connection_limits: config.connection_limits.clone(),
        retention: config.retention.clone(),
        idempotency_ttl: config.idempotency_ttl,
        streams_per_client: config.max_streams_per_client,
        ws_origins: config.ws_allowed_origins.clone(),
        cursor_key: config
            .cursor_key
            .clone()
            .map(String::into_bytes)
            .unwrap_or_else(|| SystemConfig::default().cursor_key),
        lb_notice: config.lb_notice,
        drain_timeout: config.drain_timeout,
        // Re-read when the files change: certificates rotate.
        tls: match &config.tls {
            Some(files) => Some(keel_http::tls::ServerTls::watching(
                files.clone(),
                keel_http::tls::RELOAD_CHECK_INTERVAL,
            )?),
            None => None,
        },
        // Processes sharing a database must not take each other's claims.
        relay_name: if matches!(config.database, Database::Sqlite(_)) {
            "shop-relay".to_owned()
        } else {
            format!("shop-relay-{}", keel_core::id::new_id().simple())
        },
        leases: Leases::open(&config.leases).map_err(anyhow::Error::msg)?,
        wal_relay: match &config.database {
            Database::Postgres(url) if config.outbox_relay_wal => Some(url.clone()),
            _ => None,
        },
        ..SystemConfig::default()
    })
}

async fn serve_on<S: ShopStore>(
    config: ServeConfig,
    store: S,
    broker: Arc<dyn Broker>,
    dependencies: Option<S>,
) -> anyhow::Result<()> {
    warn_about_exposure(&config);
    let system = system_config(&config)?;
    let reports = Reports::new(config.blobs.open().map_err(anyhow::Error::msg)?);
    let jobs = Jobs::new(
        Outbox::new(store.clone()),
        JobsOptions::new("report").ttl(config.job_ttl),
    )
    .map_err(|e| anyhow::anyhow!("jobs: {e}"))?;
    let worker = Consumer::builder(store.clone(), Arc::clone(&broker))
        .group(
            Group::new(keel_http::jobs::DEFAULT_TOPIC, REPORTS_GROUP).on(
                <JobRequested as keel_store::Event>::TYPE,
                ReportWorker {
                    jobs: jobs.clone(),
                    reports: reports.clone(),
                },
            ),
        )
        .build()?;
    worker.declare_groups().await?;
    let cfg = config.clone();
    let jobs_for_routes = jobs.clone();
    // The shop's dependencies stand in for other services: on a SQLite
    // file they get a file of their own, not a turn at the system's writer.
    let dependencies = match dependencies {
        Some(own) => Some(own),
        None => store.dependencies_store().await?,
    };
    let handle = System::start_with_dependencies(store, dependencies, broker, system, move |c| {
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
    // A reader may stop after the first line (a supervisor, a test); a
    // closed pipe must not end the server, so this line's error is ignored.
    let _ = writeln!(
        std::io::stdout(),
        "keel: shipping gRPC (shipping.v1.Shipping) on {}",
        handle.dependencies.urls().shipping_grpc
    );
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
