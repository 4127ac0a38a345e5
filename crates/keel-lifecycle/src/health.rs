//! [`Health`]: is this instance alive, should it get traffic, and how are
//! its dependencies.
//!
//! - **Liveness** is not asked here: if a server's handler runs, the
//!   process is alive, and it must **never touch a dependency** (a liveness
//!   probe that checks the database restarts the whole fleet when the
//!   database blips).
//! - **Readiness** ([`Health::readiness`]) checks only what *this
//!   instance* owns and is useless without: migrations applied at start
//!   ([`HealthBuilder::store`]), not draining ([`HealthBuilder::drain`]),
//!   its connection pool not saturated or exhausted, and any
//!   [`ready_check`](HealthBuilder::ready_check) you add. It never reads
//!   the shared database on a probe: every instance shares it, so a
//!   database blip would make them all unready at once. Each check has a
//!   time limit (default 1 s): a probe with no timeout is not a probe.
//! - **The deep report** ([`Health::deep`]) pings every
//!   [`dependency`](HealthBuilder::dependency) concurrently, each within
//!   its own timeout, for humans and dashboards. **Never wire it to a
//!   probe**: a dependency blip must never restart or eject the fleet.

use std::collections::HashSet;
use std::fmt::Display;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::{BoxFuture, join_all};
use keel_core::{Deadline, Name, clock};
use keel_policy::ConfigError;
use keel_store::Store;
use serde::Serialize;

use crate::drain::Drain;

/// The time limit of each readiness check by default: 1 s, below a probe's
/// usual 2 s `timeoutSeconds`.
pub const DEFAULT_CHECK_TIMEOUT: Duration = Duration::from_secs(1);

/// The waiters a pool may have with no connection free before readiness
/// fails, by default: 50.
pub const DEFAULT_MAX_POOL_WAITERS: usize = 50;

type Probe = Arc<dyn Fn() -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

#[derive(Clone)]
struct Check {
    name: Name,
    timeout: Option<Duration>,
    probe: Probe,
}

impl std::fmt::Debug for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Check")
            .field("name", &self.name)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

fn probe<F, Fut, E>(check: F) -> Probe
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: Display,
{
    Arc::new(move || {
        let fut = check();
        Box::pin(async move { fut.await.map_err(|err| err.to_string()) })
    })
}

/// How long a pool may have no free connection before readiness fails, by
/// default: 5 s.
pub const DEFAULT_POOL_EXHAUSTION_GRACE: Duration = Duration::from_secs(5);

/// How long a probe that finds a pool exhausted past its grace watches it
/// before failing. Probes only sample: a one-connection pool under load is
/// busy at most instants, so two probes can both find it busy while it was
/// free in between. Seen free within the watch, it is busy, not exhausted.
const EXHAUSTION_WATCH: Duration = Duration::from_millis(200);

/// How often the watch looks.
const EXHAUSTION_WATCH_EVERY: Duration = Duration::from_millis(5);

/// The verdict of one [`pool_exhaustion`](HealthBuilder::pool_exhaustion)
/// probe, given when the pool was first seen with nothing free.
async fn exhaustion(
    since: &parking_lot::Mutex<Option<clock::Instant>>,
    free: &(dyn Fn() -> usize + Send + Sync),
    grace: Duration,
) -> Result<(), String> {
    if free() > 0 {
        *since.lock() = None;
        return Ok(());
    }
    let first = *since.lock().get_or_insert_with(clock::now);
    let exhausted = first.elapsed();
    if exhausted < grace {
        return Ok(());
    }
    let watch_until = clock::now() + EXHAUSTION_WATCH;
    while clock::now() < watch_until {
        tokio::time::sleep(EXHAUSTION_WATCH_EVERY).await;
        if free() > 0 {
            *since.lock() = None;
            return Ok(());
        }
    }
    Err(format!(
        "pool exhausted: no connection free for {}ms",
        exhausted.as_millis()
    ))
}

/// How busy a connection pool is, as a
/// [`pool_saturation`](HealthBuilder::pool_saturation) hook reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolUsage {
    /// Connections free now.
    pub available: usize,
    /// Callers waiting for a connection now.
    pub waiters: usize,
}

/// Builds a [`Health`]; see the [module docs](crate::health).
#[derive(Debug, Default)]
#[must_use]
pub struct HealthBuilder {
    ready: Vec<Check>,
    deep: Vec<Check>,
    drain: Option<Drain>,
    check_timeout: Option<Duration>,
}

impl HealthBuilder {
    /// Fails readiness with `draining` once `drain` has been triggered.
    pub fn drain(mut self, drain: &Drain) -> Self {
        self.drain = Some(drain.clone());
        self
    }

    /// Adds a readiness check named `name`: something this instance owns
    /// and is useless without. Its error becomes the reason readiness
    /// fails. Never check a dependency here; that is what
    /// [`dependency`](Self::dependency) is for.
    pub fn ready_check<F, Fut, E>(mut self, name: &str, check: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Display,
    {
        self.ready.push(Check {
            name: Name::from(name),
            timeout: None,
            probe: probe(check),
        });
        self
    }

    /// Readiness requires the store's schema to have been migrated, checked
    /// with [`Store::ready`] until it first passes and never again: the
    /// database is shared by every instance, so pinging it on every
    /// readiness probe would make a database blip take every instance out
    /// of the load balancer at once, the cascade readiness exists to
    /// prevent. The store is pinged by the deep report instead, as the dependency
    /// `store` (within [`DEFAULT_CHECK_TIMEOUT`]).
    pub fn store<S: Store>(self, store: S) -> Self {
        let migrated = Arc::new(AtomicBool::new(false));
        let pinged = store.clone();
        self.ready_check("store", move || {
            let store = store.clone();
            let migrated = Arc::clone(&migrated);
            async move {
                if !migrated.load(Ordering::Acquire) {
                    store.ready().await?;
                    migrated.store(true, Ordering::Release);
                }
                Ok::<_, keel_store::StoreError>(())
            }
        })
        .dependency("store", DEFAULT_CHECK_TIMEOUT, move || {
            let store = pinged.clone();
            async move { store.ready().await }
        })
    }

    /// Readiness fails while the pool `probe` reports has no free
    /// connection and more than `max_waiters` callers waiting (e.g.
    /// [`DEFAULT_MAX_POOL_WAITERS`]): the instance would only add latency.
    pub fn pool_saturation<F>(self, name: &str, max_waiters: usize, probe: F) -> Self
    where
        F: Fn() -> PoolUsage + Send + Sync + 'static,
    {
        let probe = Arc::new(probe);
        self.ready_check(name, move || {
            let usage = probe();
            async move {
                if usage.available == 0 && usage.waiters > max_waiters {
                    Err(format!(
                        "pool saturated: no connection free and {} waiting (more than {max_waiters})",
                        usage.waiters
                    ))
                } else {
                    Ok(())
                }
            }
        })
    }

    /// Readiness fails once the pool `free` reports (connections idle or
    /// not yet opened) has had no free connection at every probe for at
    /// least `grace` (e.g. [`DEFAULT_POOL_EXHAUSTION_GRACE`]), and none
    /// frees while the failing probe watches it for 200 ms: for pools that
    /// cannot count their waiters, such as sqlx's. A pool that is busy for
    /// a moment, or busy whenever a probe happens to look, stays ready; one
    /// that stays exhausted only adds queueing to every request sent here.
    /// Reads no database. Keep the check timeout above the watch.
    pub fn pool_exhaustion<F>(self, name: &str, grace: Duration, free: F) -> Self
    where
        F: Fn() -> usize + Send + Sync + 'static,
    {
        let exhausted_since = Arc::new(parking_lot::Mutex::new(None));
        let free = Arc::new(free);
        self.ready_check(name, move || {
            let (since, free) = (Arc::clone(&exhausted_since), Arc::clone(&free));
            async move { exhaustion(&since, &*free, grace).await }
        })
    }

    /// The time limit of each readiness check (default
    /// [`DEFAULT_CHECK_TIMEOUT`], 1 s).
    pub fn check_timeout(mut self, timeout: Duration) -> Self {
        self.check_timeout = Some(timeout);
        self
    }

    /// Adds a dependency to ping from the deep report, within `timeout`.
    /// The ping runs under a [`Deadline`] of `timeout`, so a call that
    /// propagates deadlines (keel-client's) carries it. Dependencies are
    /// never checked by readiness.
    pub fn dependency<F, Fut, E>(mut self, name: &str, timeout: Duration, ping: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Display,
    {
        self.deep.push(Check {
            name: Name::from(name),
            timeout: Some(timeout),
            probe: probe(ping),
        });
        self
    }

    /// Checks the settings and builds the component: every timeout must be
    /// more than zero and every name unique.
    pub fn build(self) -> Result<Health, ConfigError> {
        let check_timeout = self.check_timeout.unwrap_or(DEFAULT_CHECK_TIMEOUT);
        if check_timeout.is_zero() {
            return Err(ConfigError::new(
                "check_timeout",
                "must be more than zero: every readiness check would time out",
            ));
        }
        for (list, field) in [(&self.ready, "ready_check"), (&self.deep, "dependency")] {
            let mut names = HashSet::new();
            for check in list {
                if !names.insert(&check.name) {
                    return Err(ConfigError::new(
                        field,
                        format!(
                            "`{}` is registered twice; give each check its own name",
                            check.name
                        ),
                    ));
                }
                if check.timeout.is_some_and(|t| t.is_zero()) {
                    return Err(ConfigError::new(
                        "timeout",
                        format!("the timeout of `{}` must be more than zero", check.name),
                    ));
                }
            }
        }
        Ok(Health {
            inner: Arc::new(Inner {
                ready: self.ready,
                deep: self.deep,
                drain: self.drain,
                check_timeout,
            }),
        })
    }
}

/// The health of one service instance, which every server it runs
/// answers from (keel-http's `/readyz`, keel-grpc's `grpc.health.v1`);
/// see the [module docs](crate::health). Cheap to clone.
///
/// ```
/// use std::time::Duration;
/// use keel_lifecycle::{Drain, Health};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let drain = Drain::builder().lb_notice(Duration::ZERO).build().unwrap();
/// let health = Health::builder()
///     .drain(&drain)
///     .dependency("payments", Duration::from_millis(200), || async { Ok::<_, String>(()) })
///     .build()
///     .unwrap();
/// assert!(health.readiness().await.is_ok());
/// assert!(health.deep().await.ok);
/// drain.trigger();
/// assert_eq!(health.readiness().await.unwrap_err().reasons, ["draining"]);
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Health {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    ready: Vec<Check>,
    deep: Vec<Check>,
    drain: Option<Drain>,
    check_timeout: Duration,
}

/// Why the instance is not ready: one reason per failed check, `draining`
/// alone while draining.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not ready: {}", reasons.join("; "))]
pub struct NotReady {
    /// `draining`, or `<check>: <error>` for each failed check.
    pub reasons: Vec<String>,
}

/// How one dependency answered its ping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PingStatus {
    /// It answered in time.
    Ok,
    /// It answered with an error (or the ping panicked).
    Failed,
    /// It did not answer within its timeout.
    TimedOut,
}

/// One dependency's line in a [`DeepReport`].
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DependencyStatus {
    /// The dependency.
    pub name: String,
    /// How it answered.
    pub status: PingStatus,
    /// How long the ping took, in milliseconds.
    pub latency_ms: f64,
    /// The ping's time limit, in milliseconds.
    pub timeout_ms: u64,
    /// The error, when it failed or timed out.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// The deep report: every dependency's answer (keel-http serves it as
/// `/debug/deep`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DeepReport {
    /// Whether every dependency answered in time.
    pub ok: bool,
    /// Each dependency, in registration order.
    pub dependencies: Vec<DependencyStatus>,
}

impl Health {
    /// Starts building the component.
    pub fn builder() -> HealthBuilder {
        HealthBuilder::default()
    }

    /// The drain this component's readiness follows, if one was given.
    pub fn drain(&self) -> Option<&Drain> {
        self.inner.drain.as_ref()
    }

    /// Whether the instance should get traffic: not draining, and every
    /// readiness check passing within its time limit (checks run
    /// concurrently; none runs while draining).
    pub async fn readiness(&self) -> Result<(), NotReady> {
        let inner = &*self.inner;
        if inner.drain.as_ref().is_some_and(Drain::is_draining) {
            return Err(NotReady {
                reasons: vec!["draining".to_owned()],
            });
        }
        let results = join_all(
            inner
                .ready
                .iter()
                .map(|check| run(check, inner.check_timeout)),
        )
        .await;
        let reasons: Vec<String> = inner
            .ready
            .iter()
            .zip(results)
            .filter_map(|(check, (outcome, _))| {
                let (_, error) = outcome.err()?;
                metrics::counter!("keel_http_not_ready_total", "check" => check.name.as_str())
                    .increment(1);
                Some(format!("{}: {error}", check.name))
            })
            .collect();
        if reasons.is_empty() {
            Ok(())
        } else {
            Err(NotReady { reasons })
        }
    }

    /// Pings every dependency concurrently, each within its own timeout.
    pub async fn deep(&self) -> DeepReport {
        let inner = &*self.inner;
        let results = join_all(
            inner
                .deep
                .iter()
                .map(|check| run(check, inner.check_timeout)),
        )
        .await;
        let dependencies: Vec<DependencyStatus> = inner
            .deep
            .iter()
            .zip(results)
            .map(|(check, (outcome, latency))| {
                let (status, error) = match outcome {
                    Ok(()) => (PingStatus::Ok, None),
                    Err((status, error)) => (status, Some(error)),
                };
                let label = match status {
                    PingStatus::Ok => "ok",
                    PingStatus::Failed => "failed",
                    PingStatus::TimedOut => "timed_out",
                };
                metrics::counter!("keel_http_deep_ping_total", "dependency" => check.name.as_str(), "status" => label)
                    .increment(1);
                DependencyStatus {
                    name: check.name.to_string(),
                    status,
                    latency_ms: latency.as_secs_f64() * 1000.0,
                    timeout_ms: u64::try_from(
                        check.timeout.unwrap_or(inner.check_timeout).as_millis(),
                    )
                    .unwrap_or(u64::MAX),
                    error,
                }
            })
            .collect();
        DeepReport {
            ok: dependencies.iter().all(|d| d.status == PingStatus::Ok),
            dependencies,
        }
    }
}

/// Runs one check within its time limit (and under that deadline), never
/// letting it panic through.
async fn run(
    check: &Check,
    default_timeout: Duration,
) -> (Result<(), (PingStatus, String)>, Duration) {
    let limit = check.timeout.unwrap_or(default_timeout);
    let started = clock::now();
    let fut = AssertUnwindSafe(Deadline::after(limit).scope((check.probe)())).catch_unwind();
    let outcome = match tokio::time::timeout(limit, fut).await {
        Ok(Ok(Ok(()))) => Ok(()),
        Ok(Ok(Err(error))) => Err((PingStatus::Failed, error)),
        Ok(Err(_panic)) => Err((PingStatus::Failed, "the check panicked".to_owned())),
        Err(_elapsed) => Err((PingStatus::TimedOut, format!("no answer within {limit:?}"))),
    };
    if let Err((_, error)) = &outcome {
        tracing::debug!(check = %check.name, %error, "health check failed");
    }
    (outcome, started.elapsed())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bad_settings_are_refused() {
        let err = Health::builder()
            .check_timeout(Duration::ZERO)
            .build()
            .unwrap_err();
        assert_eq!(err.field, "check_timeout");
        let twice = Health::builder()
            .ready_check("db", || async { Ok::<_, String>(()) })
            .ready_check("db", || async { Ok::<_, String>(()) })
            .build()
            .unwrap_err();
        assert_eq!(twice.field, "ready_check");
        let zero = Health::builder()
            .dependency("cache", Duration::ZERO, || async { Ok::<_, String>(()) })
            .build()
            .unwrap_err();
        assert_eq!(zero.field, "timeout");
    }

    #[tokio::test(start_paused = true)]
    async fn a_panicking_check_is_a_failure_not_a_crash() {
        let health = Health::builder()
            .dependency("flaky", Duration::from_millis(50), || async {
                if true {
                    panic!("boom");
                }
                Ok::<_, String>(())
            })
            .build()
            .unwrap();
        let report = health.deep().await;
        assert!(!report.ok);
        assert_eq!(report.dependencies[0].status, PingStatus::Failed);
    }
}
