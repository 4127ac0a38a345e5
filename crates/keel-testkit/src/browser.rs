//! Headless Chromium for browser tests: a chromedriver on a free loopback
//! port, started by the test and killed with it.
//!
//! Both the console's own browser test (keel-http) and the one against
//! `keel serve` need the same driver, the same Chromium flags and the same
//! rule about a missing driver, so they live here. The flags keep Chromium
//! off the network (this machine has none beyond loopback, and Chromium's
//! background connections would fail noisily): no background networking,
//! component updates, sync or QUIC, and a fresh profile per test. As with
//! [`services`](crate::services), a missing chromedriver skips the test on
//! a developer's machine and fails it in CI.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::process::{Child, Command};

/// Where chromedriver is, unless `KEEL_TEST_CHROMEDRIVER` says otherwise
/// (Debian's `chromium-driver`, which `scripts/browser.sh` installs).
pub const DEFAULT_CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// A running chromedriver and the profile directory its Chromium uses.
#[derive(Debug)]
pub struct ChromeDriver {
    port: u16,
    profile: tempfile::TempDir,
    _process: Child,
}

impl ChromeDriver {
    /// Starts chromedriver on a free loopback port and waits until it
    /// listens; `None` (after saying why) when it is not installed.
    ///
    /// # Panics
    /// When chromedriver is missing and `CI` is set, or it does not start.
    pub async fn start() -> Option<Self> {
        let driver = std::env::var("KEEL_TEST_CHROMEDRIVER")
            .unwrap_or_else(|_| DEFAULT_CHROMEDRIVER.to_owned());
        if !Path::new(&driver).exists() {
            let why = format!(
                "chromedriver not found at {driver}: run scripts/browser.sh (or set KEEL_TEST_CHROMEDRIVER)"
            );
            assert!(
                std::env::var_os("CI").is_none(),
                "{why}; in CI this is an error"
            );
            eprintln!("skipping the browser test: {why}");
            return None;
        }
        let port = crate::services::free_port();
        let process = Command::new(&driver)
            .arg(format!("--port={port}"))
            .arg("--allowed-ips=127.0.0.1")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("could not start {driver}: {e}"));
        wait_listening(port).await;
        let profile = tempfile::tempdir().unwrap_or_else(|e| panic!("a profile dir: {e}"));
        Some(Self {
            port,
            profile,
            _process: process,
        })
    }

    /// The WebDriver endpoint, `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `goog:chromeOptions` for a headless Chromium that stays off the
    /// network and uses this driver's fresh profile (`KEEL_TEST_CHROMIUM`
    /// names another binary).
    pub fn chrome_options(&self) -> Value {
        let mut options = json!({
            "args": [
                "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-dev-shm-usage",
                format!("--user-data-dir={}", self.profile.path().display()),
            ]
        });
        if let Ok(binary) = std::env::var("KEEL_TEST_CHROMIUM") {
            options["binary"] = binary.into();
        }
        options
    }
}

async fn wait_listening(port: u16) {
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("chromedriver did not listen on port {port} within 10 s");
}
