//! Where the shop keeps its data and carries its events: the backends
//! behind `--database-url` and `--broker`, parsed, opened, and handed to
//! code that is generic over the store.
//!
//! The embedded defaults (`sqlite:PATH` and the SQLite broker next to it)
//! need nothing installed and run one process. The scale-out backends,
//! `postgres://...` ([`keel_postgres::PgStore`]) and `nats://...`
//! ([`keel_nats::NatsBroker`]), let several processes share the work: their
//! relays claim outbox rows with `SKIP LOCKED`, their consumers pull from
//! one durable JetStream consumer per group, and `LISTEN/NOTIFY`
//! ([`spawn_wakeups`]) wakes every process when any of them commits.
//!
//! Combinations: `sqlite` + `embedded` (the default), `postgres` + `nats`
//! (several processes), `postgres` + `embedded` (one process only: the
//! embedded broker is a SQLite file that other processes cannot see), and
//! `sqlite` + `nats` (one process only: the SQLite file is local).
//!
//! The store's type differs per backend while the shop is generic over it,
//! so [`Backend::run`] takes an [`OnStore`]: one generic method, called
//! with whichever store was opened.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use keel_sqlite::{SqliteBroker, SqliteStore};
use keel_store::StoreError;
use keel_store::broker::{Broker, BrokerError};

use crate::shop::{ShopStore, SystemHandle};

/// The default `--database-url`.
pub const DEFAULT_DATABASE_URL: &str = "sqlite:keel.db";
/// The default `--broker`.
pub const DEFAULT_BROKER: &str = "embedded";
/// The default PostgreSQL schema holding Keel's and the shop's tables.
pub const DEFAULT_PG_SCHEMA: &str = "keel";
/// The default prefix of the NATS JetStream streams.
pub const DEFAULT_STREAM_PREFIX: &str = "KEEL";
/// Where the embedded broker lives when the store is PostgreSQL (there is
/// no database file to put it next to): this file in the working directory.
pub const EMBEDDED_BROKER_FILE: &str = "keel.broker.db";

/// Where the data lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Database {
    /// A SQLite file.
    Sqlite(PathBuf),
    /// A PostgreSQL server (`postgres://...`), feature `postgres`.
    Postgres(String),
}

/// Which broker carries events.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BrokerKind {
    /// The embedded SQLite broker, in this file.
    Embedded(PathBuf),
    /// NATS JetStream (`nats://...`), feature `nats`.
    Nats(String),
    /// RabbitMQ (`amqp://...` or `amqps://...`), feature `rabbitmq`.
    RabbitMq(String),
    /// Kafka (`kafka://host:port[,host:port...]`), feature `kafka`.
    Kafka(String),
}

/// Where leases are taken (`--leases`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum LeaseBackend {
    /// The database.
    #[default]
    Store,
    /// Redis (`redis://...`), feature `redis`.
    Redis(String),
    /// etcd's election API (`etcd://host:port[,host:port...]`), feature
    /// `etcd`: the endpoints, as `http://host:port`.
    Etcd(Vec<String>),
}

/// Parses `--leases`: `store`, a `redis://` URL when built with the
/// `redis` feature, or `etcd://host:port[,host:port...]` with `etcd`.
pub fn parse_leases(leases: &str) -> Result<LeaseBackend, InvalidBackend> {
    match leases {
        "store" => Ok(LeaseBackend::Store),
        url if url.starts_with("redis://") => built_with(
            ("leases", "redis", cfg!(feature = "redis")),
            "--leases store",
            LeaseBackend::Redis(url.to_owned()),
        ),
        url if url.starts_with("etcd://") => {
            let endpoints = etcd_endpoints(url)?;
            built_with(
                ("leases", "etcd", cfg!(feature = "etcd")),
                "--leases store",
                LeaseBackend::Etcd(endpoints),
            )
        }
        other => Err(invalid(
            "leases",
            format!("`{other}` is not `store`, a redis:// URL or an etcd:// one"),
        )),
    }
}

/// `etcd://h1:2379,h2:2379` as `["http://h1:2379", "http://h2:2379"]`.
fn etcd_endpoints(url: &str) -> Result<Vec<String>, InvalidBackend> {
    let hosts = url.trim_start_matches("etcd://").trim_end_matches('/');
    let endpoints: Vec<String> = hosts
        .split(',')
        .map(str::trim)
        .filter(|host| !host.is_empty())
        .map(|host| format!("http://{host}"))
        .collect();
    let well_formed = endpoints
        .iter()
        .all(|e| reqwest::Url::parse(e).is_ok_and(|u| u.host().is_some() && u.path() == "/"));
    if endpoints.is_empty() || !well_formed {
        return Err(invalid(
            "leases",
            format!("`{url}` is not etcd://host:port[,host:port...]"),
        ));
    }
    Ok(endpoints)
}

/// `value` when this keel was built with the cargo feature that `setting`
/// needs (`(setting, feature, built)`), else the error saying how to
/// rebuild, or what to use (`instead`).
fn built_with<T>(
    (setting, feature, built): (&'static str, &str, bool),
    instead: &str,
    value: T,
) -> Result<T, InvalidBackend> {
    if built {
        return Ok(value);
    }
    Err(invalid(
        setting,
        format!(
            "this keel was built without the `{feature}` feature; rebuild with \
             `--features {feature}`, or use {instead}"
        ),
    ))
}

/// A backend setting that cannot work, and what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{setting}: {reason}")]
pub struct InvalidBackend {
    /// The setting (`database-url`, `broker`, `backend`).
    pub setting: &'static str,
    /// Why, and what to do.
    pub reason: String,
}

fn invalid(setting: &'static str, reason: impl Into<String>) -> InvalidBackend {
    InvalidBackend {
        setting,
        reason: reason.into(),
    }
}

/// Parses `--database-url`: `sqlite:PATH` or `postgres://...`.
pub fn parse_database(url: &str) -> Result<Database, InvalidBackend> {
    if let Some(rest) = url.strip_prefix("sqlite:") {
        let path = rest.trim_start_matches("//");
        if path.is_empty() || path == ":memory:" {
            return Err(invalid(
                "database-url",
                "give a file: sqlite:PATH (the shop needs a file the broker can share)",
            ));
        }
        return Ok(Database::Sqlite(PathBuf::from(path)));
    }
    if url.starts_with("postgres:") || url.starts_with("postgresql:") {
        return built_with(
            ("database-url", "postgres", cfg!(feature = "postgres")),
            "sqlite:PATH",
            Database::Postgres(url.to_owned()),
        );
    }
    Err(invalid(
        "database-url",
        format!("`{url}` is neither sqlite:PATH nor postgres://..."),
    ))
}

/// Parses `--broker`: `embedded` (next to a SQLite `database`, else
/// [`EMBEDDED_BROKER_FILE`]), `nats://...`, `amqp://...` or `kafka://...`.
pub fn parse_broker(broker: &str, database: &Database) -> Result<BrokerKind, InvalidBackend> {
    match broker {
        "embedded" => Ok(BrokerKind::Embedded(match database {
            Database::Sqlite(db) => {
                let mut path = db.clone().into_os_string();
                path.push(".broker");
                PathBuf::from(path)
            }
            Database::Postgres(_) => PathBuf::from(EMBEDDED_BROKER_FILE),
        })),
        url if url.starts_with("nats://") || url.starts_with("tls://") => built_with(
            ("broker", "nats", cfg!(feature = "nats")),
            "--broker embedded",
            BrokerKind::Nats(url.to_owned()),
        ),
        url if url.starts_with("amqp://") || url.starts_with("amqps://") => built_with(
            ("broker", "rabbitmq", cfg!(feature = "rabbitmq")),
            "--broker embedded",
            BrokerKind::RabbitMq(url.to_owned()),
        ),
        url if url.starts_with("kafka://") => built_with(
            ("broker", "kafka", cfg!(feature = "kafka")),
            "--broker embedded",
            BrokerKind::Kafka(url.to_owned()),
        ),
        other => Err(invalid(
            "broker",
            format!("`{other}` is none of `embedded`, nats://..., amqp://... and kafka://..."),
        )),
    }
}

/// Parses `keel demo --backend`: `sqlite` (the embedded defaults) or
/// `postgres+nats`; `true` for the scale-out pair.
pub fn parse_backend_name(name: &str) -> Result<bool, InvalidBackend> {
    match name {
        "sqlite" | "embedded" => Ok(false),
        "postgres+nats" => Ok(true),
        other => Err(invalid(
            "backend",
            format!("`{other}` is neither `sqlite` nor `postgres+nats`"),
        )),
    }
}

/// The backends of `keel demo --backend NAME`: `None` for `sqlite` (the
/// embedded defaults), the parsed URLs for `postgres+nats`, which needs a
/// `postgres://...` database URL and a `nats://...` broker.
pub fn demo_backend(
    name: &str,
    database_url: Option<&str>,
    broker: Option<&str>,
) -> Result<Option<BackendOptions>, InvalidBackend> {
    if !parse_backend_name(name)? {
        return Ok(None);
    }
    let needs = "keel demo --backend postgres+nats needs --database-url postgres://... and \
                 --broker nats://... (or KEEL_DATABASE_URL and KEEL_BROKER)";
    let (Some(database_url), Some(broker)) = (database_url, broker) else {
        return Err(invalid("backend", needs));
    };
    let options = BackendOptions::parse(database_url, broker)?;
    if !options.shareable() {
        return Err(invalid(
            "backend",
            format!("{needs}, not {}", options.describe()),
        ));
    }
    Ok(Some(options))
}

/// How to open the backends, with documented defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendOptions {
    /// The database.
    pub database: Database,
    /// The broker.
    pub broker: BrokerKind,
    /// PostgreSQL: the schema holding every table (default `keel`).
    /// Processes sharing work must use the same one.
    pub pg_schema: String,
    /// PostgreSQL: the pool's size (default 20).
    pub pg_max_connections: u32,
    /// NATS: the stream prefix; RabbitMQ: the exchanges' and queues';
    /// Kafka: the topics' (default `KEEL`). Processes sharing work must use the same one.
    pub stream_prefix: String,
    /// NATS: how many servers keep each stream (default 1; 3 on a cluster,
    /// see `NatsBrokerOptions::replicas`).
    pub nats_replicas: usize,
}

impl BackendOptions {
    /// `database` and `broker` with the defaults for the rest.
    pub fn new(database: Database, broker: BrokerKind) -> Self {
        Self {
            database,
            broker,
            pg_schema: DEFAULT_PG_SCHEMA.to_owned(),
            pg_max_connections: 20,
            stream_prefix: DEFAULT_STREAM_PREFIX.to_owned(),
            nats_replicas: 1,
        }
    }

    /// Parses `database_url` and `broker` (see [`parse_database`] and
    /// [`parse_broker`]).
    pub fn parse(database_url: &str, broker: &str) -> Result<Self, InvalidBackend> {
        let database = parse_database(database_url)?;
        let broker = parse_broker(broker, &database)?;
        Ok(Self::new(database, broker))
    }

    /// Whether several processes can share these backends.
    pub fn shareable(&self) -> bool {
        matches!(
            (&self.database, &self.broker),
            (
                Database::Postgres(_),
                BrokerKind::Nats(_) | BrokerKind::RabbitMq(_) | BrokerKind::Kafka(_)
            )
        )
    }

    /// One line for logs: which backends, without credentials.
    pub fn describe(&self) -> String {
        format!(
            "{} and {}",
            self.describe_database(),
            self.describe_broker()
        )
    }

    /// The database, without credentials.
    pub fn describe_database(&self) -> String {
        match &self.database {
            Database::Sqlite(path) => format!("SQLite {}", path.display()),
            Database::Postgres(url) => format!(
                "PostgreSQL {} (schema {})",
                without_credentials(url),
                self.pg_schema
            ),
        }
    }

    /// The broker, without credentials.
    pub fn describe_broker(&self) -> String {
        match &self.broker {
            BrokerKind::Embedded(path) => format!("the embedded broker {}", path.display()),
            BrokerKind::Nats(url) => format!(
                "NATS JetStream {} (stream prefix {})",
                without_credentials(url),
                self.stream_prefix
            ),
            BrokerKind::RabbitMq(url) => format!(
                "RabbitMQ {} (name prefix {})",
                without_credentials(url),
                self.stream_prefix
            ),
            BrokerKind::Kafka(url) => format!(
                "Kafka {} (topic prefix {})",
                without_credentials(url),
                self.stream_prefix
            ),
        }
    }
}

/// `scheme://host/...` without a `user:password@` part.
fn without_credentials(url: &str) -> String {
    match (url.split_once("://"), url.rfind('@')) {
        (Some((scheme, _)), Some(at)) => format!("{scheme}://{}", &url[at + 1..]),
        _ => url.to_owned(),
    }
}

/// Why a backend could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The store could not be opened or migrated.
    #[error("cannot open the store ({backend}): {source}")]
    Store {
        /// Which store, without credentials.
        backend: String,
        /// Why.
        source: StoreError,
    },
    /// The broker could not be reached.
    #[error("cannot open the broker ({backend}): {source}")]
    Broker {
        /// Which broker, without credentials.
        backend: String,
        /// Why.
        source: BrokerError,
    },
}

/// An opened store, one variant per store type.
#[derive(Debug, Clone)]
pub enum OpenedStore {
    /// SQLite.
    Sqlite(SqliteStore),
    /// PostgreSQL.
    #[cfg(feature = "postgres")]
    Postgres(keel_postgres::PgStore),
}

impl OpenedStore {
    /// The store as `S`, if it is one (code generic over the store, given
    /// a second store opened beside the first).
    pub fn downcast<S: ShopStore>(self) -> Option<S> {
        let store: Box<dyn std::any::Any> = match self {
            Self::Sqlite(store) => Box::new(store),
            #[cfg(feature = "postgres")]
            Self::Postgres(store) => Box::new(store),
        };
        store.downcast::<S>().ok().map(|store| *store)
    }
}

/// Code generic over the shop's store, run by [`Backend::run`] with
/// whichever store was opened.
pub trait OnStore {
    /// What it returns.
    type Output;
    /// Runs on `store` and `broker`.
    fn run<S: ShopStore>(
        self,
        store: S,
        broker: Arc<dyn Broker>,
    ) -> impl Future<Output = Self::Output>;
}

/// The opened store and broker.
#[derive(Clone)]
pub struct Backend {
    /// The store.
    pub store: OpenedStore,
    /// The broker.
    pub broker: Arc<dyn Broker>,
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend")
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

impl Backend {
    /// Opens the store (migrating it) and connects the broker.
    pub async fn open(options: &BackendOptions) -> Result<Self, OpenError> {
        let store = open_store(options)
            .await
            .map_err(|source| OpenError::Store {
                backend: options.describe_database(),
                source,
            })?;
        let broker = open_broker(options)
            .await
            .map_err(|source| OpenError::Broker {
                backend: options.describe_broker(),
                source,
            })?;
        Ok(Self { store, broker })
    }

    /// Opens (and migrates) another database with `options`' other
    /// settings: the reference shop's dependencies', when they have one of
    /// their own.
    pub async fn open_beside(
        options: &BackendOptions,
        database: Database,
    ) -> Result<OpenedStore, OpenError> {
        let options = BackendOptions {
            database,
            ..options.clone()
        };
        open_store(&options)
            .await
            .map_err(|source| OpenError::Store {
                backend: options.describe_database(),
                source,
            })
    }

    /// Runs `f` with the store and the broker.
    pub async fn run<F: OnStore>(self, f: F) -> F::Output {
        match self.store {
            OpenedStore::Sqlite(store) => f.run(store, self.broker).await,
            #[cfg(feature = "postgres")]
            OpenedStore::Postgres(store) => f.run(store, self.broker).await,
        }
    }
}

async fn open_store(options: &BackendOptions) -> Result<OpenedStore, StoreError> {
    match &options.database {
        Database::Sqlite(path) => Ok(OpenedStore::Sqlite(SqliteStore::open(path).await?)),
        #[cfg(feature = "postgres")]
        Database::Postgres(url) => {
            let store = keel_postgres::PgStore::options()
                .schema(options.pg_schema.clone())
                .max_connections(options.pg_max_connections)
                .open(url)
                .await?;
            for warning in store.durability_warnings().await? {
                tracing::warn!("PostgreSQL durability: {warning}");
            }
            Ok(OpenedStore::Postgres(store))
        }
        #[cfg(not(feature = "postgres"))]
        Database::Postgres(url) => {
            Err(StoreError::other(parse_database(url).err().unwrap_or_else(
                || invalid("database-url", "the `postgres` feature is not built"),
            )))
        }
    }
}

async fn open_broker(options: &BackendOptions) -> Result<Arc<dyn Broker>, BrokerError> {
    match &options.broker {
        BrokerKind::Embedded(path) => Ok(Arc::new(open_embedded_broker(path).await?)),
        #[cfg(feature = "nats")]
        BrokerKind::Nats(url) => {
            let broker = keel_nats::NatsBrokerOptions::new()
                .stream_prefix(options.stream_prefix.clone())
                .replicas(options.nats_replicas)
                .open(url)
                .await?;
            for warning in broker.durability_warnings() {
                tracing::warn!("NATS durability: {warning}");
            }
            Ok(Arc::new(broker))
        }
        #[cfg(not(feature = "nats"))]
        BrokerKind::Nats(url) => Err(BrokerError::Other(
            parse_broker(url, &options.database)
                .err()
                .unwrap_or_else(|| invalid("broker", "the `nats` feature is not built"))
                .into(),
        )),
        #[cfg(feature = "rabbitmq")]
        BrokerKind::RabbitMq(url) => Ok(Arc::new(
            keel_rabbitmq::RabbitBroker::connect(
                keel_rabbitmq::RabbitBrokerOptions::new(url).prefix(options.stream_prefix.clone()),
            )
            .await?,
        )),
        #[cfg(not(feature = "rabbitmq"))]
        BrokerKind::RabbitMq(url) => Err(BrokerError::Other(
            parse_broker(url, &options.database)
                .err()
                .unwrap_or_else(|| invalid("broker", "the `rabbitmq` feature is not built"))
                .into(),
        )),
        #[cfg(feature = "kafka")]
        BrokerKind::Kafka(url) => {
            let kafka = keel_kafka::KafkaBrokerOptions::from_url(url)
                .ok_or_else(|| BrokerError::Invalid(format!("`{url}` names no Kafka server")))?;
            for warning in kafka.durability_warnings() {
                tracing::warn!("Kafka durability: {warning}");
            }
            Ok(Arc::new(
                keel_kafka::KafkaBroker::connect(kafka.prefix(options.stream_prefix.clone()))
                    .await?,
            ))
        }
        #[cfg(not(feature = "kafka"))]
        BrokerKind::Kafka(url) => Err(BrokerError::Other(
            parse_broker(url, &options.database)
                .err()
                .unwrap_or_else(|| invalid("broker", "the `kafka` feature is not built"))
                .into(),
        )),
    }
}

async fn open_embedded_broker(path: &Path) -> Result<SqliteBroker, BrokerError> {
    SqliteBroker::open(path).await
}

/// What a commit in another process should wake in this one.
#[derive(Default)]
pub struct WakeTargets {
    /// The outbox relay (`Outbox::notify`).
    pub outbox: Vec<Box<dyn Fn() + Send + Sync>>,
    /// The saga orchestrator (`SagaOrchestrator::notify`).
    pub sagas: Vec<Box<dyn Fn() + Send + Sync>>,
    /// The webhook delivery worker.
    pub webhooks: Vec<Box<dyn Fn() + Send + Sync>>,
    /// Event-log readers: the log's notifier.
    pub event_log: Option<Arc<dyn keel_realtime::Notifier>>,
}

impl std::fmt::Debug for WakeTargets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WakeTargets")
            .field("outbox", &self.outbox.len())
            .field("sagas", &self.sagas.len())
            .field("webhooks", &self.webhooks.len())
            .field("event_log", &self.event_log.is_some())
            .finish()
    }
}

/// What `LISTEN/NOTIFY` wakes in a running shop: its relay, its saga
/// orchestrator, its webhook delivery worker and its event-log readers.
pub fn wake_targets<S: ShopStore>(handle: &SystemHandle<S>) -> WakeTargets {
    let outbox = handle.outbox.clone();
    let orchestrator = handle.orchestrator.clone();
    let worker = handle.webhook_worker.clone();
    WakeTargets {
        outbox: vec![Box::new(move || outbox.notify())],
        sagas: vec![Box::new(move || orchestrator.notify())],
        webhooks: vec![Box::new(move || worker.notify())],
        event_log: Some(Arc::clone(handle.log.notifier())),
    }
}

/// Listens for other processes' commits while alive (PostgreSQL only).
#[derive(Debug)]
pub struct Wakeups {
    #[cfg(feature = "postgres")]
    _listener: keel_postgres::PgWakeups,
}

/// On PostgreSQL, starts `LISTEN`ing on the store's channels and wakes
/// `targets` whenever any process commits an outbox row, a saga, a webhook
/// delivery or an event-log event; `None` on other stores (one process:
/// local wake-ups suffice). Keep the returned value alive as long as the
/// system runs.
pub fn spawn_wakeups<S: ShopStore>(store: &S, targets: WakeTargets) -> Option<Wakeups> {
    #[cfg(feature = "postgres")]
    {
        let store = (store as &dyn std::any::Any).downcast_ref::<keel_postgres::PgStore>()?;
        let mut builder = keel_postgres::PgWakeups::builder(store);
        for wake in targets.outbox {
            builder = builder.on_outbox(wake);
        }
        for wake in targets.sagas {
            builder = builder.on_sagas(wake);
        }
        for wake in targets.webhooks {
            builder = builder.on_webhooks(wake);
        }
        if let Some(notifier) = targets.event_log {
            builder = builder.on_event_log(move |wake| {
                // A reconnect (`None`) cannot name its streams: readers
                // find missed events at their next poll.
                let Some(wake) = wake else { return };
                if let Ok(stream) = keel_realtime::StreamId::new(wake.stream) {
                    notifier.notify(&stream, wake.seq);
                }
            });
        }
        Some(Wakeups {
            _listener: builder.spawn(),
        })
    }
    #[cfg(not(feature = "postgres"))]
    {
        let _ = (store, targets);
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_into_backends() {
        let options = BackendOptions::parse(DEFAULT_DATABASE_URL, DEFAULT_BROKER).unwrap();
        assert_eq!(options.database, Database::Sqlite("keel.db".into()));
        assert_eq!(
            options.broker,
            BrokerKind::Embedded("keel.db.broker".into())
        );
        assert!(!options.shareable());
        let options = BackendOptions::parse(
            "postgres://keel:secret@127.0.0.1:5432/keel",
            "nats://127.0.0.1:4222",
        );
        if cfg!(all(feature = "postgres", feature = "nats")) {
            let options = options.unwrap();
            assert!(options.shareable());
            let line = options.describe();
            assert!(line.contains("127.0.0.1:5432/keel"), "{line}");
            assert!(!line.contains("secret"), "{line}");
            assert_eq!(
                parse_broker("embedded", &options.database).unwrap(),
                BrokerKind::Embedded(EMBEDDED_BROKER_FILE.into())
            );
        } else {
            assert!(options.unwrap_err().reason.contains("feature"));
        }
    }

    #[test]
    fn unusable_urls_say_what_to_change() {
        for (url, broker, setting) in [
            ("mysql://x", "embedded", "database-url"),
            ("sqlite:", "embedded", "database-url"),
            ("sqlite::memory:", "embedded", "database-url"),
            ("sqlite:k.db", "pulsar://x", "broker"),
        ] {
            let err = BackendOptions::parse(url, broker).unwrap_err();
            assert_eq!(err.setting, setting, "{url} {broker}");
        }
        assert!(parse_backend_name("postgres+nats").unwrap());
        assert!(!parse_backend_name("sqlite").unwrap());
        assert!(parse_backend_name("mongo").is_err());
        assert_eq!(demo_backend("sqlite", Some("postgres://x"), None), Ok(None));
        let err = demo_backend("postgres+nats", None, Some("nats://127.0.0.1:4222")).unwrap_err();
        assert!(err.reason.contains("--database-url"), "{err}");
        let err = demo_backend("postgres+nats", Some("sqlite:k.db"), Some("embedded")).unwrap_err();
        assert_eq!(err.setting, "backend");
        if cfg!(all(feature = "postgres", feature = "nats")) {
            let options = demo_backend(
                "postgres+nats",
                Some("postgres://h/db"),
                Some("nats://h:4222"),
            );
            assert!(options.unwrap().unwrap().shareable());
        }
    }

    #[tokio::test]
    async fn sqlite_opens_and_runs_generic_code() {
        struct Migrate;
        impl OnStore for Migrate {
            type Output = Result<(), StoreError>;
            async fn run<S: ShopStore>(self, store: S, _broker: Arc<dyn Broker>) -> Self::Output {
                store.migrate_shop().await?;
                store.order_counts().await.map(drop)
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let url = format!("sqlite:{}", dir.path().join("k.db").display());
        let options = BackendOptions::parse(&url, DEFAULT_BROKER).unwrap();
        let backend = Backend::open(&options).await.unwrap();
        assert!(spawn_wakeups_for(&backend).is_none());
        backend.run(Migrate).await.unwrap();
    }

    fn spawn_wakeups_for(backend: &Backend) -> Option<Wakeups> {
        match &backend.store {
            OpenedStore::Sqlite(store) => spawn_wakeups(store, WakeTargets::default()),
            #[cfg(feature = "postgres")]
            OpenedStore::Postgres(store) => spawn_wakeups(store, WakeTargets::default()),
        }
    }
}
