//! The shop's moving parts, built from its configuration and started:
//! the outbox relay, the order consumer, the public router, and the tasks
//! that run them until the stop signal.

use std::net::SocketAddr;
use std::num::{NonZeroU32, NonZeroUsize};
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use keel_http::health::{Drain, DrainServe};
use keel_http::tls::TlsListener;
use keel_messaging::consumer::{Backoff, Consumer, Group, Jitter};
use keel_messaging::saga::{SagaDefinition, SagaOrchestrator};
use keel_messaging::{Outbox, OutboxRelay};
use keel_policy::breaker::BreakerRegistry;
use keel_realtime::EventLog;
use keel_store::broker::Broker;
use keel_webhooks::ssrf::{IpNetwork, SsrfGuard};
use keel_webhooks::{DeliveryWorker, Endpoints, WebhookOutbox, WorkerOptions};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use super::projection::OrderSettlement;
use super::saga::{Dependencies, FulfilmentData};
use super::{
    DELIVERIES_IN_FLIGHT, SAGAS_AT_ONCE, ShopStore, StartError, SystemConfig, config_err,
    fulfilment, retention, services,
};
use crate::api::{self, AppState};
use crate::shop::model::OrderPlaced;

/// Migrates the shop's tables, in `own` too when the dependencies have a
/// store of their own, and seeds the dependencies' stock; returns the
/// dependencies' store.
pub(super) async fn migrate<S: ShopStore>(
    store: &S,
    own: Option<S>,
    config: &SystemConfig,
) -> Result<S, StartError> {
    store.migrate_shop().await?;
    let dependencies_store = match own {
        Some(own) => {
            own.migrate_shop().await?;
            own
        }
        None => store.clone(),
    };
    dependencies_store.seed_stock(&config.stock).await?;
    Ok(dependencies_store)
}

/// Starts the stand-in dependencies on `store` (they stop when `stopped`
/// turns true) and the clients that call them, each behind its breaker.
pub(super) async fn dependencies<S: ShopStore>(
    store: &S,
    config: &SystemConfig,
    breakers: &BreakerRegistry,
    stopped: watch::Receiver<bool>,
) -> Result<Dependencies, StartError> {
    let urls = services::start_dependencies(store.clone(), config, stopped).await?;
    Dependencies::new(
        urls,
        breakers,
        &config.tuning,
        config.shipping_grpc_token.as_deref(),
    )
    .map_err(config_err)
}

/// The saga orchestrator, running the fulfilment saga with `settlement`
/// projecting each saga's end.
pub(super) fn orchestrator<S: ShopStore>(
    store: &S,
    saga: &SagaDefinition<FulfilmentData>,
    settlement: OrderSettlement<S>,
    config: &SystemConfig,
) -> Result<SagaOrchestrator<S>, StartError> {
    SagaOrchestrator::builder(store.clone())
        .saga(saga)
        .hook(settlement)
        .poll_interval(config.poll_interval)
        .concurrency(SAGAS_AT_ONCE)
        .build()
        .map_err(config_err)
}

/// The drain: readiness, the load balancer's notice, and how long
/// requests in flight get.
pub(super) fn drain(config: &SystemConfig) -> Result<Drain, StartError> {
    Drain::builder()
        .lb_notice(config.lb_notice)
        .drain_timeout(config.drain_timeout)
        .build()
        .map_err(config_err)
}

/// The relay the configuration asks for: polling `outbox`'s table, or
/// (PostgreSQL, [`SystemConfig::wal_relay`]) streaming its inserts from a
/// replication slot named after the schema.
pub(super) async fn relay_for<S: ShopStore>(
    store: &S,
    outbox: &Outbox<S>,
    broker: &Arc<dyn Broker>,
    config: &SystemConfig,
) -> Result<Relay<S>, StartError> {
    let Some(url) = &config.wal_relay else {
        return relay(store, outbox, broker, config).map(Relay::Table);
    };
    wal_relay(store, url, broker, config).await
}

#[cfg(feature = "postgres")]
async fn wal_relay<S: ShopStore>(
    store: &S,
    url: &str,
    broker: &Arc<dyn Broker>,
    config: &SystemConfig,
) -> Result<Relay<S>, StartError> {
    use keel_postgres::{PgStore, WalOutbox, WalRelayOptions};
    let Some(pg) = (store as &dyn std::any::Any).downcast_ref::<PgStore>() else {
        return Err(config_err("the WAL relay needs PostgreSQL"));
    };
    let options = WalRelayOptions::default().named(&format!("{}_outbox", pg.schema()));
    let wal = WalOutbox::start(pg.clone(), url, options)
        .await
        .map_err(config_err)?;
    let outbox = Outbox::new(wal.clone());
    wal.wake_with(outbox.waker());
    Ok(Relay::Wal(relay(store, &outbox, broker, config)?))
}

#[cfg(not(feature = "postgres"))]
async fn wal_relay<S: ShopStore>(
    _: &S,
    _: &str,
    _: &Arc<dyn Broker>,
    _: &SystemConfig,
) -> Result<Relay<S>, StartError> {
    Err(config_err("the WAL relay needs the `postgres` feature"))
}

/// The outbox relay of one process.
pub(super) enum Relay<S: ShopStore> {
    /// Claims rows from the outbox table.
    Table(OutboxRelay<S, dyn Broker>),
    /// Claims rows from a replication slot (and sweeps the table).
    #[cfg(feature = "postgres")]
    Wal(OutboxRelay<keel_postgres::WalOutbox, dyn Broker>),
}

impl<S: ShopStore> Relay<S> {
    async fn run(self, stopped: impl std::future::Future<Output = ()>) {
        match self {
            Self::Table(relay) => relay.run(stopped).await,
            #[cfg(feature = "postgres")]
            Self::Wal(relay) => relay.run(stopped).await,
        }
    }
}

/// The relay: every process relays; one at a time prunes (processes
/// sharing a PostgreSQL database would otherwise all delete the same rows).
fn relay<S: ShopStore, T: keel_store::OutboxStore>(
    store: &S,
    outbox: &Outbox<T>,
    broker: &Arc<dyn Broker>,
    config: &SystemConfig,
) -> Result<OutboxRelay<T, dyn Broker>, StartError> {
    let prune_gate = config.leases.gate(
        store,
        "outbox-prune",
        &config.relay_name,
        3 * config.retention.interval,
    );
    OutboxRelay::builder(outbox, Arc::clone(broker))
        .name(config.relay_name.clone())
        .retention(config.retention.outbox)
        .prune_interval(config.retention.interval)
        .prune_under(prune_gate)
        .poll_interval(config.poll_interval)
        .batch_size(NonZeroUsize::new(200).unwrap_or(NonZeroUsize::MIN))
        .build()
        .map_err(config_err)
}

/// The consumer of placed orders, which starts each one's fulfilment saga.
pub(super) fn consumer<S: ShopStore>(
    store: &S,
    broker: &Arc<dyn Broker>,
    fulfilment: fulfilment::StartFulfilment<S>,
    config: &SystemConfig,
) -> Result<Consumer<S, dyn Broker>, StartError> {
    let backoff = Backoff::exponential(Duration::from_millis(50), 2.0, Duration::from_millis(500))
        .and_then(|b| b.with_jitter(Jitter::Full))
        .map_err(config_err)?;
    Consumer::builder(store.clone(), Arc::clone(broker))
        .group(
            Group::new(fulfilment::TOPIC, fulfilment::GROUP)
                .on(<OrderPlaced as keel_store::Event>::TYPE, fulfilment),
        )
        .max_in_flight(DELIVERIES_IN_FLIGHT)
        .max_deliveries(NonZeroU32::new(config.max_deliveries.max(1)).unwrap_or(NonZeroU32::MIN))
        .inbox_retention(Some(config.retention.inbox))
        .inbox_prune_interval(config.retention.interval)
        .receive_wait(Duration::from_millis(200))
        .drain_timeout(Duration::from_secs(5))
        .backoff(backoff)
        .build()
        .map_err(config_err)
}

/// The public API with the edge's limits, and `extra` beside it, all with
/// request metrics, and HSTS when the server terminates TLS itself.
/// `origins` are the server's own pages' (a WebSocket from them is always
/// allowed).
pub(super) fn router<S: ShopStore>(
    state: AppState<S>,
    drain: &Drain,
    config: &SystemConfig,
    origins: &[String],
    extra: Router,
) -> Result<Router, StartError> {
    let limits = api::EdgeLimits {
        idempotency_ttl: config.idempotency_ttl,
        streams_per_client: config.streams_per_client,
        ws_origins: origins.iter().chain(&config.ws_origins).cloned().collect(),
    };
    let router = api::public_router(state, drain.signal(), &limits)
        .map_err(config_err)?
        .merge(extra)
        .layer(keel_http::request_metrics::RequestMetricsLayer::new());
    Ok(if config.tls.is_some() {
        router.layer(axum::middleware::map_response(strict_transport_security))
    } else {
        router
    })
}

/// The loops that move work along, each run until the stop signal.
pub(super) struct Workers<S: ShopStore> {
    pub(super) relay: Relay<S>,
    pub(super) consumer: Consumer<S, dyn Broker>,
    pub(super) orchestrator: SagaOrchestrator<S>,
    pub(super) webhooks: DeliveryWorker<S>,
}

impl<S: ShopStore> Workers<S> {
    /// Spawns every loop on `tasks`; each stops when `stopped` turns true.
    pub(super) fn spawn(self, tasks: &mut JoinSet<()>, stopped: &watch::Receiver<bool>) {
        let wait = |rx: &watch::Receiver<bool>| {
            let mut rx = rx.clone();
            async move {
                let _ = rx.wait_for(|s| *s).await;
            }
        };
        let Self {
            relay,
            consumer,
            orchestrator,
            webhooks,
        } = self;
        let on_stop = wait(stopped);
        tasks.spawn(async move { relay.run(on_stop).await });
        let on_stop = wait(stopped);
        tasks.spawn(async move {
            let report = consumer.run(on_stop).await;
            tracing::info!(?report, "consumer stopped");
        });
        let on_stop = wait(stopped);
        tasks.spawn(async move { orchestrator.run(on_stop).await });
        let on_stop = wait(stopped);
        tasks.spawn(async move {
            webhooks.run(on_stop).await;
        });
    }
}

/// Serves `router` on `listener` (over TLS when configured) until the
/// drain closes it.
pub(super) fn spawn_server(
    tasks: &mut JoinSet<()>,
    listener: TcpListener,
    router: Router,
    drain: &Drain,
    config: &SystemConfig,
) {
    let drain = drain.clone();
    let limits = config.connection_limits.clone();
    let tls = config.tls.clone();
    tasks.spawn(async move {
        let served = match tls {
            Some(tls) => {
                let listener = TlsListener::new(listener, tls);
                drain.serve_with(listener, router, limits).await
            }
            None => drain.serve_with(listener, router, limits).await,
        };
        if let Err(err) = served {
            tracing::error!(error = %err, "public server failed");
        }
    });
}

/// HSTS on every answer of a server that terminates TLS itself: a browser
/// that reached it over HTTPS never tries plain HTTP on it for a year (no
/// `includeSubDomains`: other hosts under the name are not ours to bind).
async fn strict_transport_security(
    mut response: axum::response::Response,
) -> axum::response::Response {
    response.headers_mut().insert(
        axum::http::header::STRICT_TRANSPORT_SECURITY,
        axum::http::HeaderValue::from_static("max-age=31536000"),
    );
    response
}

/// Starts the pruners ([`retention::run`]) under a lease, so that of the
/// processes sharing a database one at a time prunes.
pub(super) fn spawn_retention<S: ShopStore>(
    tasks: &mut JoinSet<()>,
    store: &S,
    log: &EventLog<S>,
    config: &SystemConfig,
    stop: watch::Receiver<bool>,
) {
    let gate = config.leases.gate(
        store,
        "retention",
        &config.relay_name,
        3 * config.retention.interval,
    );
    tasks.spawn(retention::run(
        store.clone(),
        log.clone(),
        config.retention.clone(),
        gate,
        stop,
    ));
}

/// Where settled orders fan out to: the event log, the webhook outbox,
/// the endpoints it sends to, and the worker that delivers.
#[allow(clippy::type_complexity)]
pub(super) fn fan_out<S: ShopStore>(
    store: &S,
    own: &[SocketAddr],
    config: &SystemConfig,
) -> Result<
    (
        EventLog<S>,
        WebhookOutbox<S>,
        Endpoints<S>,
        DeliveryWorker<S>,
    ),
    StartError,
> {
    let mut guard = own
        .iter()
        .fold(SsrfGuard::new(), |guard, addr| guard.deny(*addr));
    if config.allow_loopback_webhooks {
        tracing::warn!("webhook endpoints on loopback are allowed (demo/serve configuration)");
        for net in [
            IpNetwork::new([127, 0, 0, 0].into(), 8),
            IpNetwork::new(std::net::Ipv6Addr::LOCALHOST.into(), 128),
        ] {
            guard = guard.allow(net.map_err(config_err)?);
        }
    }
    let endpoints = Endpoints::new(store.clone(), guard.clone()).sealer(config.secrets.clone());
    let worker = DeliveryWorker::new(
        store.clone(),
        WorkerOptions::new()
            .guard(guard)
            .sealer(config.secrets.clone())
            .poll_interval(Duration::from_millis(100))
            .timeout(Duration::from_secs(5)),
    )
    .map_err(config_err)?;
    Ok((
        EventLog::new(store.clone()),
        WebhookOutbox::new(store.clone()),
        endpoints,
        worker,
    ))
}

/// The origins of the server's own pages: `http://ADDR`, and on loopback
/// `http://localhost:PORT` too.
pub(super) fn own_origins(scheme: &str, addr: SocketAddr) -> Vec<String> {
    let mut origins = vec![format!("{scheme}://{addr}")];
    if addr.ip().is_loopback() {
        origins.push(format!("{scheme}://localhost:{}", addr.port()));
    }
    origins
}
