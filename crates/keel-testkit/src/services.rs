//! The servers that scale-out tests run against: PostgreSQL, NATS, Redis,
//! etcd, RabbitMQ, a Kafka-protocol broker (tansu) and an S3-compatible
//! object store.
//!
//! `scripts/services.sh run CMD` (which the README's test command uses)
//! starts them on free loopback ports and exports their URLs. A test asks for
//! a URL here rather than reading the environment itself so that the rule is
//! the same everywhere: on a developer's machine without the servers the test
//! is skipped with a message, and in CI (`CI` set) it fails loudly, because a
//! suite that silently skips there proves nothing.
//!
//! ```no_run
//! # async fn demo() {
//! let Some(url) = keel_testkit::services::postgres_url() else { return };
//! // connect to `url`...
//! # let _ = url;
//! # }
//! ```

use std::process::Command;

/// The environment variable holding the PostgreSQL URL.
pub const POSTGRES_URL: &str = "KEEL_TEST_POSTGRES_URL";
/// The environment variable holding the NATS URL.
pub const NATS_URL: &str = "KEEL_TEST_NATS_URL";
/// The environment variable holding the Redis URL.
pub const REDIS_URL: &str = "KEEL_TEST_REDIS_URL";
/// The environment variable holding the S3 endpoint (bucket `keel-test`).
pub const S3_URL: &str = "KEEL_TEST_S3_URL";
/// The environment variable holding the etcd endpoint.
pub const ETCD_URL: &str = "KEEL_TEST_ETCD_URL";
/// The environment variable holding the RabbitMQ URL.
pub const RABBITMQ_URL: &str = "KEEL_TEST_RABBITMQ_URL";
/// The environment variable holding the Kafka URL (`kafka://host:port`).
pub const KAFKA_URL: &str = "KEEL_TEST_KAFKA_URL";
/// The environment variable holding the path of `scripts/services.sh`.
pub const SERVICES: &str = "KEEL_TEST_SERVICES";

/// A server that `scripts/services.sh` manages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Service {
    /// PostgreSQL.
    Postgres,
    /// nats-server with JetStream.
    Nats,
    /// redis-server, without persistence.
    Redis,
    /// moto's S3 server, with the bucket `keel-test`.
    S3,
    /// etcd, one member.
    Etcd,
    /// rabbitmq-server, one node.
    RabbitMq,
    /// tansu, a Kafka-protocol broker, one node with its log in SQLite.
    Kafka,
}

impl Service {
    fn name(self) -> &'static str {
        match self {
            Self::Postgres => "postgres",
            Self::Nats => "nats",
            Self::Redis => "redis",
            Self::S3 => "s3",
            Self::Etcd => "etcd",
            Self::RabbitMq => "rabbitmq",
            Self::Kafka => "kafka",
        }
    }

    fn url_var(self) -> &'static str {
        match self {
            Self::Postgres => POSTGRES_URL,
            Self::Nats => NATS_URL,
            Self::Redis => REDIS_URL,
            Self::S3 => S3_URL,
            Self::Etcd => ETCD_URL,
            Self::RabbitMq => RABBITMQ_URL,
            Self::Kafka => KAFKA_URL,
        }
    }
}

/// The PostgreSQL URL, or `None` (after printing why) when the test should
/// be skipped. Panics in CI when the server is missing.
pub fn postgres_url() -> Option<String> {
    url(Service::Postgres)
}

/// The NATS URL, or `None` (after printing why) when the test should be
/// skipped. Panics in CI when the server is missing.
pub fn nats_url() -> Option<String> {
    url(Service::Nats)
}

/// The Redis URL, or `None` (after printing why) when the test should be
/// skipped. Panics in CI when the server is missing.
pub fn redis_url() -> Option<String> {
    url(Service::Redis)
}

/// The S3 endpoint (`http://127.0.0.1:PORT`, bucket `keel-test`, any
/// credentials), or `None` (after printing why) when the test should be
/// skipped. Panics in CI when the server is missing.
pub fn s3_url() -> Option<String> {
    url(Service::S3)
}

/// The etcd endpoint (`http://127.0.0.1:PORT`), or `None` (after
/// printing why) when the test should be skipped. Panics in CI when the
/// server is missing.
pub fn etcd_url() -> Option<String> {
    url(Service::Etcd)
}

/// The RabbitMQ URL (`amqp://guest:guest@127.0.0.1:PORT/%2f`), or `None`
/// (after printing why) when the test should be skipped. Panics in CI when
/// the server is missing.
pub fn rabbitmq_url() -> Option<String> {
    url(Service::RabbitMq)
}

/// The Kafka URL (`kafka://127.0.0.1:PORT`), or `None` (after printing
/// why) when the test should be skipped. Panics in CI when the server is
/// missing.
pub fn kafka_url() -> Option<String> {
    url(Service::Kafka)
}

/// A loopback port free right now, for a server a test starts itself (the
/// port is released before the server binds it, so another may take it in
/// between: rare enough on loopback).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|probe| probe.local_addr())
        .map(|addr| addr.port())
        .unwrap_or_else(|e| panic!("no free loopback port: {e}"))
}

/// The `keel` binary a test runs: `KEEL_TEST_KEEL_BIN` when set (a copy
/// that a build running meanwhile cannot replace, as `scripts/reliability.sh`
/// takes), else `built`, the one cargo built with the test
/// (`env!("CARGO_BIN_EXE_keel")`).
pub fn keel_binary(built: &str) -> std::path::PathBuf {
    std::env::var_os("KEEL_TEST_KEEL_BIN").map_or_else(|| built.into(), Into::into)
}

/// The nats-server binary `scripts/services.sh` installed, for a test that
/// runs servers of its own (a cluster), or `None` (after printing why) when
/// the test should be skipped. Panics in CI when it is missing.
pub fn nats_server_binary() -> Option<std::path::PathBuf> {
    if let Some(path) = std::env::var_os("KEEL_TEST_NATS_SERVER") {
        return Some(path.into());
    }
    let why = "KEEL_TEST_NATS_SERVER is not set: run the tests through scripts/services.sh";
    assert!(
        std::env::var_os("CI").is_none(),
        "{why}; in CI this is an error"
    );
    eprintln!("skipped: {why}");
    None
}

/// The tansu binary `scripts/services.sh` built, for tests that run a
/// Kafka-protocol broker of their own (`KEEL_TEST_TANSU`), or `None` when
/// the test should be skipped. Panics in CI when it is missing.
pub fn tansu_binary() -> Option<std::path::PathBuf> {
    if let Some(path) = std::env::var_os("KEEL_TEST_TANSU") {
        return Some(path.into());
    }
    let why = "KEEL_TEST_TANSU is not set: run the tests through scripts/services.sh";
    assert!(
        std::env::var_os("CI").is_none(),
        "{why}; in CI this is an error"
    );
    eprintln!("skipped: {why}");
    None
}

/// `service`'s URL, or `None` when the test should be skipped.
///
/// # Panics
/// When the URL is missing and `CI` is set: in CI every suite must run.
pub fn url(service: Service) -> Option<String> {
    if let Ok(url) = std::env::var(service.url_var()) {
        return Some(url);
    }
    let why = format!(
        "{} is not set: run the tests through scripts/services.sh (scripts/test.sh does)",
        service.url_var()
    );
    assert!(
        std::env::var_os("CI").is_none(),
        "{why}; in CI this is an error"
    );
    eprintln!("skipped: {why}");
    None
}

/// A lock that keeps server restarts away from tests that did not ask for
/// one: tests run in parallel processes against one server, so a test that
/// restarts or stops `service` holds [`ServerLock::exclusive`], and every
/// other test using `service` holds [`ServerLock::shared`] while it runs.
///
/// It is a file lock in the services directory, so it works across test
/// binaries and crates; outside `scripts/services.sh` it locks nothing.
#[derive(Debug)]
pub struct ServerLock {
    // Held only for its lock; closing the file releases it.
    _file: Option<std::fs::File>,
}

impl ServerLock {
    /// Held by a test that only needs `service` up. Blocks while a restart
    /// test runs.
    pub fn shared(service: Service) -> Self {
        Self::take(service, false)
    }

    /// Held by a test that restarts or stops `service`. Blocks until no
    /// other test uses it.
    pub fn exclusive(service: Service) -> Self {
        Self::take(service, true)
    }

    fn take(service: Service, exclusive: bool) -> Self {
        let Some(dir) = std::env::var_os("KEEL_TEST_SERVICES_DIR") else {
            return Self { _file: None };
        };
        let path = std::path::Path::new(&dir).join(format!("{}.lock", service.name()));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path);
        let file = match file {
            Ok(file) => file,
            Err(err) => panic!("opening the server lock {}: {err}", path.display()),
        };
        let locked = if exclusive {
            file.lock()
        } else {
            file.lock_shared()
        };
        if let Err(err) = locked {
            panic!("locking {}: {err}", path.display());
        }
        Self { _file: Some(file) }
    }
}

/// What went wrong driving `scripts/services.sh`.
#[derive(Debug)]
pub struct ServiceError(String);

impl std::fmt::Display for ServiceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ServiceError {}

/// Restarts `service` (same port, same data), for outage tests.
pub fn restart(service: Service) -> Result<(), ServiceError> {
    control("restart", service)
}

/// Kills `service` the way a crash would (PostgreSQL: an immediate
/// shutdown, recovered from its WAL at start; nats-server and
/// redis-server: `SIGKILL`, Redis losing every key) and starts it again.
pub fn crash(service: Service) -> Result<(), ServiceError> {
    control("crash", service)
}

/// Stops `service` until [`start`] brings it back.
pub fn stop(service: Service) -> Result<(), ServiceError> {
    control("stop", service)
}

/// Starts `service` again after [`stop`].
pub fn start(service: Service) -> Result<(), ServiceError> {
    control("start", service)
}

fn control(verb: &str, service: Service) -> Result<(), ServiceError> {
    let script = std::env::var(SERVICES)
        .map_err(|_| ServiceError(format!("{SERVICES} is not set: not run by services.sh")))?;
    let status = Command::new("bash")
        .arg(&script)
        .arg(verb)
        .arg(service.name())
        .status()
        .map_err(|e| ServiceError(format!("running {script}: {e}")))?;
    if status.success() {
        Ok(())
    } else {
        Err(ServiceError(format!(
            "{script} {verb} {} failed: {status}",
            service.name()
        )))
    }
}
