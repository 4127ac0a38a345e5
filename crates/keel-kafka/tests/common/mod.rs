//! Brokers for the tests: on the shared test server, or on a tansu of the
//! test's own.
//!
//! tansu 0.6.0 deletes every topic of its cluster when asked to delete one
//! (its `topic_delete_by.sql` matches the cluster, not the topic), so on
//! the shared server topic deletion is off, and the scenarios that delete
//! topics run on a private tansu, where the only topics are theirs.

#![allow(dead_code, unreachable_pub)]

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use keel_kafka::{KafkaBroker, KafkaBrokerOptions};
use keel_testkit::services::{self, Service};

/// Held for the whole test process (nextest runs each test in a process of
/// its own).
static SHARED: std::sync::OnceLock<services::ServerLock> = std::sync::OnceLock::new();

/// Options for a test server: three partitions (enough to spread keys,
/// few enough for a single-node broker).
pub fn test_options(url: &str) -> KafkaBrokerOptions {
    KafkaBrokerOptions::from_url(url)
        .expect("a kafka:// URL")
        .partitions(3)
}

/// A broker on the shared test server (topic deletion off), or `None`
/// without one.
pub async fn fresh_broker() -> Option<KafkaBroker> {
    let url = services::kafka_url()?;
    if SHARED.get().is_none() {
        let lock = tokio::task::spawn_blocking(|| services::ServerLock::shared(Service::Kafka))
            .await
            .expect("the lock task panicked");
        let _ = SHARED.set(lock);
    }
    Some(
        KafkaBroker::connect(test_options(&url).delete_topics(false))
            .await
            .expect("connect to the test Kafka broker"),
    )
}

/// A tansu of the test's own, killed when dropped.
pub struct PrivateTansu {
    binary: std::path::PathBuf,
    child: Child,
    dir: tempfile::TempDir,
    port: u16,
    pub url: String,
}

impl Drop for PrivateTansu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl PrivateTansu {
    /// Kills the server as a crash would (`SIGKILL`: nothing flushed,
    /// nothing said to clients) and starts it again on the same port and
    /// log.
    pub fn crash(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.child = start(&self.binary, self.dir.path(), self.port);
    }
}

/// Starts tansu on `port` with its log in `dir`, once it listens.
fn start(binary: &std::path::Path, dir: &std::path::Path, port: u16) -> Child {
    let listener = format!("tcp://127.0.0.1:{port}");
    let mut child = Command::new(binary)
        .args(["broker", "--listener-url", &listener])
        .args(["--advertised-listener-url", &listener])
        .args(["--storage-engine", "sqlite://tansu.db"])
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start tansu");
    for _ in 0..100 {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return child;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    panic!("tansu did not listen on {port} within 5 s");
}

/// Starts a tansu on a free loopback port with its log in a temporary
/// directory, or `None` without the binary.
pub fn private_tansu() -> Option<PrivateTansu> {
    let binary = services::tansu_binary()?;
    let dir = tempfile::tempdir().expect("a temporary directory");
    let port = services::free_port();
    let child = start(&binary, dir.path(), port);
    Some(PrivateTansu {
        binary,
        child,
        dir,
        port,
        url: format!("kafka://127.0.0.1:{port}"),
    })
}

/// A broker on a private tansu (topic deletion on), with the server.
pub async fn private_broker() -> Option<(KafkaBroker, PrivateTansu)> {
    let tansu = private_tansu()?;
    let broker = KafkaBroker::connect(test_options(&tansu.url))
        .await
        .expect("connect to the private tansu");
    Some((broker, tansu))
}
