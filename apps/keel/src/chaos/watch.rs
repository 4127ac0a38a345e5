//! Seeing a failpoint fire: a tracing layer that listens to keel-messaging's
//! components and counts the simulated crashes they report.
//!
//! The `fail` crate cannot say whether an armed failpoint has fired (asking
//! would fire it), but every component reports its simulated crash: the
//! relay's failed round names the failpoint in its error, the consumer's
//! `Crashed` outcome is traced, the orchestrator warns with a `failpoint`
//! field. Watching those lets the run restart the system right after the
//! crash, as a supervisor restarts a dead process. The layer has its own
//! filter, so it sees every level of keel-messaging whatever `KEEL_LOG`
//! says for the log output.

use std::collections::BTreeMap;
use std::sync::LazyLock;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::Mutex;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::Layer;
use tracing_subscriber::filter::{EnvFilter, filter_fn};
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::util::SubscriberInitExt as _;

use super::schedule::FAILPOINTS;

static FIRED: LazyLock<Mutex<BTreeMap<&'static str, u64>>> = LazyLock::new(Default::default);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// The watch is not installed, so failpoints cannot be seen firing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "another tracing subscriber is already the global default, so keel chaos cannot see \
     failpoints fire; call keel::chaos::init_tracing instead of installing one"
)]
pub struct WatchUnavailable;

impl keel_core::Classify for WatchUnavailable {
    fn class(&self) -> keel_core::ErrorClass {
        keel_core::ErrorClass::Permanent
    }
}

/// The layer that counts simulated crashes by failpoint.
#[derive(Debug, Clone, Copy, Default)]
pub struct FailpointWatch;

impl<S: Subscriber> Layer<S> for FailpointWatch {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let mut finder = FailpointFinder(None);
        event.record(&mut finder);
        if let Some(failpoint) = finder.0 {
            *FIRED.lock().entry(failpoint).or_default() += 1;
        }
    }
}

struct FailpointFinder(Option<&'static str>);

impl Visit for FailpointFinder {
    fn record_str(&mut self, _: &Field, value: &str) {
        self.find(value);
    }

    fn record_debug(&mut self, _: &Field, value: &dyn std::fmt::Debug) {
        self.find(&format!("{value:?}"));
    }
}

impl FailpointFinder {
    fn find(&mut self, text: &str) {
        if self.0.is_none() {
            self.0 = FAILPOINTS.iter().copied().find(|fp| text.contains(fp));
        }
    }
}

/// Installs the global tracing subscriber for `keel chaos`: log lines on
/// stderr filtered by `KEEL_LOG` (else `default_filter`), plus the
/// [`FailpointWatch`]. Returns whether it is installed (now or before).
pub fn init_tracing(default_filter: &str) -> bool {
    if INSTALLED.load(Ordering::SeqCst) {
        return true;
    }
    let filter =
        EnvFilter::try_from_env("KEEL_LOG").unwrap_or_else(|_| EnvFilter::new(default_filter));
    let log = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(filter);
    let watch = FailpointWatch.with_filter(filter_fn(|meta| {
        meta.target().starts_with("keel_messaging")
    }));
    let installed = tracing_subscriber::registry()
        .with(log)
        .with(watch)
        .try_init()
        .is_ok();
    if installed {
        INSTALLED.store(true, Ordering::SeqCst);
    }
    INSTALLED.load(Ordering::SeqCst)
}

/// Fails unless the watch is installed (installing it if no other global
/// subscriber is).
pub fn ensure_installed() -> Result<(), WatchUnavailable> {
    if init_tracing("off") {
        Ok(())
    } else {
        Err(WatchUnavailable)
    }
}

/// How many simulated crashes `failpoint` has reported in this process.
pub fn fired(failpoint: &str) -> u64 {
    FIRED.lock().get(failpoint).copied().unwrap_or(0)
}

/// Waits until `failpoint` has reported more than `before` crashes, at most
/// `timeout`, giving up early once `give_up()` says it cannot happen any
/// more; whether it fired.
pub async fn wait_fired(
    failpoint: &str,
    before: u64,
    timeout: Duration,
    mut give_up: impl AsyncFnMut() -> bool,
) -> bool {
    let until = keel_core::clock::now() + timeout;
    let mut checks = 0u32;
    loop {
        if fired(failpoint) > before {
            return true;
        }
        if keel_core::clock::now() >= until {
            return false;
        }
        checks = checks.wrapping_add(1);
        // The give-up test reads the database: every half second is enough.
        if checks.is_multiple_of(50) && give_up().await {
            return fired(failpoint) > before;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_failpoint_in_a_crash_report() {
        let mut finder = FailpointFinder(None);
        finder.find("simulated crash at failpoint `relay-after-publish`");
        assert_eq!(finder.0, Some("relay-after-publish"));
        let mut finder = FailpointFinder(None);
        finder.find("Crashed(\"consumer-after-dead-letter\")");
        assert_eq!(finder.0, Some("consumer-after-dead-letter"));
        let mut finder = FailpointFinder(None);
        finder.find("outbox batch published");
        assert_eq!(finder.0, None);
    }
}
