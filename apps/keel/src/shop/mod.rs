//! The reference shop: orders, payments, inventory, shipping, customers,
//! with every Keel component where it belongs, over real HTTP on loopback.
//!
//! [`System::start`] wires it on a store and a broker and returns a
//! [`SystemHandle`]: the orders API (one transaction writes the order and
//! its outbox event), the outbox relay, the `orders.placed` consumer (inbox
//! dedupe in the effect's transaction) that starts the fulfilment saga, the
//! saga orchestrator calling the four dependencies through their policy
//! pipelines (with [`projection::OrderSettlement`] as its hook, which
//! settles the order and fans it out to the event log and webhooks in the
//! saga's own transaction), and the webhook delivery worker. `keel demo`, `keel serve`
//! and `keel chaos` all start it this way.

#[cfg(test)]
mod behaviours;
pub mod db;
pub mod fulfilment;
pub mod leases;
pub mod model;
#[cfg(feature = "postgres")]
pub mod pg;
mod pipeline;
pub mod projection;
pub mod quotes;
pub mod retention;
pub mod saga;
pub mod services;
pub mod shipping;
pub mod sql;

use std::net::SocketAddr;
use std::num::NonZeroUsize;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use axum::Router;
use keel_http::health::{ConnectionLimits, Drain};
use keel_http::pagination::{CursorCodec, Pagination};
use keel_messaging::saga::SagaOrchestrator;
use keel_messaging::{DeadLetters, MessagingStore, Outbox};
use keel_policy::breaker::{BreakerRegistry, CircuitBreakerConfig, SlidingWindow};
use keel_realtime::EventLog;
use keel_store::broker::Broker;
use keel_store::{EventLogStore, IdempotencyStore, JobStore, WebhookStore};
use keel_webhooks::sealing::SecretSealer;
use keel_webhooks::{DeliveryWorker, Endpoints};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::api::AppState;
use db::ShopDb;
use pipeline::{fan_out, own_origins, spawn_retention};
use saga::{Dependencies, DependencyTuning};
use services::PaymentsFaults;

/// Every store capability the shop needs, in one bound.
pub trait ShopStore:
    ShopDb<Tx: Send + 'static>
    + MessagingStore
    + IdempotencyStore
    + JobStore
    + EventLogStore
    + WebhookStore
{
}

impl<S> ShopStore for S where
    S: ShopDb<Tx: Send + 'static>
        + MessagingStore
        + IdempotencyStore
        + JobStore
        + EventLogStore
        + WebhookStore
{
}

/// How the system is started.
#[derive(Debug, Clone)]
pub struct SystemConfig {
    /// Where the public API listens (port 0 picks one).
    pub listen: SocketAddr,
    /// Whether `X-Keel-Demo-Fault` is honoured.
    pub demo_faults: bool,
    /// The payments service's scheduled faults.
    pub payments_faults: PaymentsFaults,
    /// The dependencies' policies.
    pub tuning: DependencyTuning,
    /// The breakers' configuration (one breaker per dependency).
    pub breaker: CircuitBreakerConfig,
    /// Initial stock levels.
    pub stock: Vec<(String, i64)>,
    /// Allow webhook endpoints on loopback (the SSRF guard blocks them
    /// otherwise). The demo's receiver is on loopback, so the demo turns it
    /// on, and says so.
    pub allow_loopback_webhooks: bool,
    /// The key cursors are signed with (at least 32 bytes).
    pub cursor_key: Vec<u8>,
    /// Seals webhook secrets at rest (default: plain text).
    pub secrets: SecretSealer,
    /// Timeouts and the cap of every connection to the public server.
    pub connection_limits: ConnectionLimits,
    /// SSE streams, WebSockets and waiting long polls per client address.
    pub streams_per_client: usize,
    /// Origins whose pages may open `/ws`, besides the server's own
    /// (`http://ADDR`, and `http://localhost:PORT` on loopback).
    pub ws_origins: Vec<String>,
    /// Deliveries of a failing message before it is dead-lettered.
    pub max_deliveries: u32,
    /// How long shutdown waits for load balancers to notice.
    pub lb_notice: Duration,
    /// How long in-flight requests get at shutdown.
    pub drain_timeout: Duration,
    /// Honour `x-chaos-experiment` from loopback clients (default: no).
    pub chaos_experiments: bool,
    /// HTTPS instead of HTTP (default: none).
    pub tls: Option<keel_http::tls::ServerTls>,
    /// How often the background workers poll when idle.
    pub poll_interval: Duration,
    /// The outbox relay's name. A relay takes back claims made under its
    /// own name at once (so a restarted process resumes its batch), which
    /// is right for one process on its own database and wrong for several
    /// sharing one: each of those needs a name of its own (default
    /// `shop-relay`).
    pub relay_name: String,
    /// PostgreSQL: the relay claims outbox rows from a logical replication
    /// slot of the database at this URL instead of polling the table
    /// (`keel serve --outbox-relay wal`); `None` (the default) polls.
    pub wal_relay: Option<String>,
    /// Where the shipping service's gRPC server listens (port 0 picks one).
    pub shipping_grpc: SocketAddr,
    /// The token its calls must carry (`None`: none; loopback only). The
    /// saga's own client sends it.
    pub shipping_grpc_token: Option<String>,
    /// How fast shipping's courier moves a shipment to delivered.
    pub courier_pace: shipping::CourierPace,
    /// What is pruned, and when (default: [`retention::Retention`]'s).
    pub retention: retention::Retention,
    /// How long an Idempotency-Key is remembered (default 24 hours).
    pub idempotency_ttl: Duration,
    /// Where the pruning and retention leases are taken (default: the
    /// database).
    pub leases: leases::Leases,
}

impl SystemConfig {
    /// `https` when the server terminates TLS itself, else `http`.
    fn scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }
}

impl Default for SystemConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            demo_faults: false,
            payments_faults: PaymentsFaults::none(),
            tuning: DependencyTuning::default(),
            breaker: CircuitBreakerConfig {
                sliding_window: SlidingWindow::Count { size: 20 },
                minimum_calls: 10,
                open_duration: Duration::from_millis(300),
                max_open_duration: Duration::from_secs(1),
                ..CircuitBreakerConfig::default()
            },
            stock: default_stock(),
            allow_loopback_webhooks: false,
            cursor_key: keel_core::id::new_id().simple().to_string().into_bytes(),
            secrets: SecretSealer::plaintext(),
            connection_limits: ConnectionLimits::default(),
            streams_per_client: keel_realtime::DEFAULT_MAX_PER_CLIENT,
            ws_origins: Vec::new(),
            max_deliveries: 5,
            lb_notice: Duration::ZERO,
            drain_timeout: Duration::from_secs(10),
            tls: None,
            chaos_experiments: false,
            poll_interval: Duration::from_millis(50),
            relay_name: "shop-relay".to_owned(),
            wal_relay: None,
            shipping_grpc: SocketAddr::from(([127, 0, 0, 1], 0)),
            shipping_grpc_token: None,
            courier_pace: shipping::CourierPace::default(),
            retention: retention::Retention::default(),
            idempotency_ttl: keel_http::idempotency::DEFAULT_TTL,
            leases: leases::Leases::default(),
        }
    }
}

/// Sagas the orchestrator drives at once. The pipeline behind `POST /orders`
/// must keep pace with it: with 32, a 32-connection load was accepted at
/// 452 (SQLite) and 499 (PostgreSQL + NATS) orders/s while only 77 and 101
/// a second settled, and the backlog of unsettled orders grew without bound.
/// With 256 and [`DELIVERIES_IN_FLIGHT`] at 128, the sagas take their share
/// of the store, intake slows to what the pipeline settles, and the backlog
/// stays at about this many (BENCHMARKS.md, the reference system).
const SAGAS_AT_ONCE: usize = 256;

/// Deliveries of `OrderPlaced` the consumer holds at once (see
/// [`SAGAS_AT_ONCE`]).
const DELIVERIES_IN_FLIGHT: NonZeroUsize = NonZeroUsize::new(128).expect("positive");

/// The catalogue: plenty of most things, and `rare-*` skus that run out.
pub fn default_stock() -> Vec<(String, i64)> {
    let mut stock: Vec<(String, i64)> = ["tea", "coffee", "mug", "kettle", "filter", "grinder"]
        .iter()
        .map(|s| ((*s).to_owned(), 1_000_000))
        .collect();
    stock.push(("rare-teapot".to_owned(), 5));
    stock.push(("rare-vinyl".to_owned(), 0));
    stock
}

/// Why the system could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The store refused a setup step.
    #[error("store: {0}")]
    Store(#[from] keel_store::StoreError),
    /// A component's configuration is invalid.
    #[error("configuration: {0}")]
    Config(String),
    /// A listener could not be bound.
    #[error("listen: {0}")]
    Io(#[from] std::io::Error),
    /// The broker refused to declare a consumer group.
    #[error("broker: {0}")]
    Broker(#[from] keel_store::broker::BrokerError),
}

fn config_err(e: impl std::fmt::Display) -> StartError {
    StartError::Config(e.to_string())
}

/// Starts the shop.
#[derive(Debug)]
pub struct System;

/// A running shop. Drop it only after [`shutdown`](Self::shutdown).
pub struct SystemHandle<S: ShopStore> {
    /// `http://127.0.0.1:PORT` of the public API.
    pub base_url: String,
    /// The bound address.
    pub addr: SocketAddr,
    /// The store.
    pub store: S,
    /// The broker.
    pub broker: Arc<dyn Broker>,
    /// The outbox whose relay this system runs (`notify` wakes it).
    pub outbox: Outbox<S>,
    /// The event log settled orders are appended to (its notifier wakes
    /// long-poll, SSE and WebSocket readers).
    pub log: EventLog<S>,
    /// Sagas: list, counts, retry, cancel.
    pub orchestrator: SagaOrchestrator<S>,
    /// Dead letters: list, replay, discard.
    pub dead_letters: DeadLetters<S>,
    /// Every dependency's breaker.
    pub breakers: BreakerRegistry,
    /// Webhook endpoints.
    pub endpoints: Endpoints<S>,
    /// The webhook delivery worker (`notify` wakes it).
    pub webhook_worker: DeliveryWorker<S>,
    /// The dependencies (their URLs and policies).
    pub dependencies: Dependencies,
    /// The graceful drain of the public server.
    pub drain: Drain,
    /// Orders settled so far (by this process's orchestrator).
    pub settled: Arc<AtomicU64>,
    stop: watch::Sender<bool>,
    /// Stops the dependencies, after the workers that call them.
    stop_dependencies: watch::Sender<bool>,
    tasks: JoinSet<()>,
}

impl<S: ShopStore> std::fmt::Debug for SystemHandle<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SystemHandle")
            .field("base_url", &self.base_url)
            .finish_non_exhaustive()
    }
}

impl System {
    /// Starts everything on `store` and `broker`; `extra` is merged into
    /// the public router (serve's admin, jobs, webhooks and metrics
    /// routes).
    pub async fn start<S: ShopStore>(
        store: S,
        broker: Arc<dyn Broker>,
        config: SystemConfig,
        extra: impl FnOnce(&Components<S>) -> Result<Router, StartError>,
    ) -> Result<SystemHandle<S>, StartError> {
        Self::start_with_dependencies(store, None, broker, config, extra).await
    }

    /// [`System::start`], with the dependencies' tables (stock levels and
    /// the ledger of their effects) in a store of their own if `own` is one
    /// (see [`db::ShopDb::dependencies_store`]), else in `store`.
    pub async fn start_with_dependencies<S: ShopStore>(
        store: S,
        own: Option<S>,
        broker: Arc<dyn Broker>,
        config: SystemConfig,
        extra: impl FnOnce(&Components<S>) -> Result<Router, StartError>,
    ) -> Result<SystemHandle<S>, StartError> {
        let dependencies_store = pipeline::migrate(&store, own, &config).await?;
        let listener = tokio::net::TcpListener::bind(config.listen).await?;
        let addr = listener.local_addr()?;
        let scheme = config.scheme();
        let (stop, stopped) = watch::channel(false);
        // The dependencies stop on a signal of their own, sent only once
        // the orchestrator has stopped: its calls in flight (and their
        // retries) must still find them, or a saga records failures that
        // are only our own shutdown.
        let (stop_dependencies, dependencies_stopped) = watch::channel(false);
        let mut tasks = JoinSet::new();

        let breakers = BreakerRegistry::new(config.breaker.clone()).map_err(config_err)?;
        let dependencies = pipeline::dependencies(
            &dependencies_store,
            &config,
            &breakers,
            dependencies_stopped,
        )
        .await?;
        // Webhooks may never be aimed at any of this process's listeners.
        let own: Vec<SocketAddr> = std::iter::once(addr)
            .chain(dependencies.urls().sockets())
            .collect();
        let (log, webhooks, endpoints, worker) = fan_out(&store, &own, &config)?;
        let settlement =
            projection::OrderSettlement::new(store.clone(), log.clone(), webhooks, worker.clone());
        let settled = settlement.counter();
        let saga = saga::definition(&dependencies).map_err(config_err)?;
        let orchestrator = pipeline::orchestrator(&store, &saga, settlement, &config)?;

        // The broker's rules at append: an event it could never take is
        // refused in the request, not parked by the relay later.
        let outbox = Outbox::new(store.clone()).with_broker(Arc::clone(&broker));
        let fulfilment =
            fulfilment::StartFulfilment::new(store.clone(), orchestrator.clone(), saga);
        let workers = pipeline::Workers {
            relay: pipeline::relay_for(&store, &outbox, &broker, &config).await?,
            consumer: pipeline::consumer(&store, &broker, fulfilment, &config)?,
            orchestrator: orchestrator.clone(),
            webhooks: worker.clone(),
        };
        let drain = pipeline::drain(&config)?;
        let codec = CursorCodec::new(config.cursor_key.clone()).map_err(config_err)?;
        let state = AppState {
            store: store.clone(),
            inventory: dependencies_store,
            outbox: outbox.clone(),
            log: log.clone(),
            pagination: Pagination::new(codec),
            demo_faults: config.demo_faults,
            estimates: dependencies.estimates(),
            quotes: dependencies.quotes(),
            experiments: config.chaos_experiments,
        };
        let components = Components {
            store: store.clone(),
            orchestrator: orchestrator.clone(),
            dead_letters: DeadLetters::with_outbox(outbox.clone()),
            breakers: breakers.clone(),
            endpoints: endpoints.clone(),
            drain: drain.clone(),
            dependency_urls: dependencies.urls().clone(),
            broker: Arc::clone(&broker),
            leases: config.leases.clone(),
        };
        let origins = own_origins(scheme, addr);
        let router = pipeline::router(state, &drain, &config, &origins, extra(&components)?)?;
        // Before the relay publishes: on a broker whose groups start at
        // their creation, an event sent before its group exists is lost.
        workers.consumer.declare_groups().await?;
        workers.spawn(&mut tasks, &stopped);
        spawn_retention(&mut tasks, &store, &log, &config, stopped.clone());
        pipeline::spawn_server(&mut tasks, listener, router, &drain, &config);

        Ok(SystemHandle {
            base_url: format!("{scheme}://{addr}"),
            addr,
            store,
            broker,
            outbox,
            log,
            orchestrator,
            dead_letters: components.dead_letters,
            breakers,
            endpoints,
            webhook_worker: worker,
            dependencies,
            drain,
            settled,
            stop,
            stop_dependencies,
            tasks,
        })
    }
}

/// The pieces extra routes (admin, console, jobs, webhooks) are built from.
pub struct Components<S: ShopStore> {
    /// The store.
    pub store: S,
    /// Sagas.
    pub orchestrator: SagaOrchestrator<S>,
    /// Dead letters.
    pub dead_letters: DeadLetters<S>,
    /// Breakers.
    pub breakers: BreakerRegistry,
    /// Webhook endpoints.
    pub endpoints: Endpoints<S>,
    /// The drain (readiness).
    pub drain: Drain,
    /// The dependencies' URLs (for `/debug/deep`).
    pub dependency_urls: services::DependencyUrls,
    /// The broker (consumer lag for the admin API).
    pub broker: Arc<dyn Broker>,
    /// The lease backend (for `/debug/deep`).
    pub leases: leases::Leases,
}

impl<S: ShopStore> SystemHandle<S> {
    /// Stops gracefully: the server drains (in-flight requests finish),
    /// then the relay, consumer, orchestrator and webhook worker finish their current round and stop, and only then the
    /// dependencies the orchestrator calls.
    pub async fn shutdown(mut self) {
        self.drain.trigger();
        self.drain.wait_for(keel_http::health::Phase::Closing).await;
        let _ = self.stop.send(true);
        let deadline = tokio::time::sleep(Duration::from_secs(15));
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                next = self.tasks.join_next() => if next.is_none() { break },
                () = &mut deadline => {
                    tracing::warn!("workers did not stop in time; aborting them");
                    self.tasks.abort_all();
                    break;
                }
            }
        }
        let _ = self.stop_dependencies.send(true);
    }
}
