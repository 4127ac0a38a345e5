//! Endpoint choice by load, with outlier ejection that never empties the
//! pool.
//!
//! A [`Balancer`] holds the endpoints of one dependency (URLs, addresses,
//! tower services: any value) and chooses one per request by *power of two
//! choices*: draw two endpoints at random and send to the less loaded. That
//! is nearly as good as always finding the least loaded endpoint, costs O(1),
//! and avoids every caller herding onto the same "best" endpoint. Load is, by
//! [`Strategy`]:
//!
//! - [`PeakEwma`](Strategy::PeakEwma) (default): the endpoint's latency
//!   estimate times its requests in flight. The estimate jumps to any new
//!   peak at once and decays slowly, so a *healthy but slow* endpoint — the
//!   grey failure a health check cannot see — quickly gets less traffic, and
//!   is tried again once its estimate has decayed;
//! - [`LeastRequest`](Strategy::LeastRequest): requests in flight only, the
//!   mesh's `LEAST_REQUEST`.
//!
//! Each pick returns a [`Picked`] guard that counts the request as in flight
//! and records its latency and outcome when finished (or, dropped unfinished,
//! as cancelled).
//!
//! # Outlier ejection
//!
//! An endpoint that fails [`consecutive_failures`](BalancerBuilder::consecutive_failures)
//! times in a row (default 5; only [dependency failures](keel_core::ErrorClass::is_dependency_failure)
//! count, and any answer resets the count) is ejected for
//! [`base_ejection_time`](BalancerBuilder::base_ejection_time) (30 s) times
//! the number of times it has been ejected, up to
//! [`max_ejection_time`](BalancerBuilder::max_ejection_time) (300 s): a
//! repeat offender stays out longer. Each full
//! [`interval`](BalancerBuilder::interval) (10 s) it then spends in the pool
//! forgives one past ejection. It returns by itself when its time is up.
//!
//! At most [`max_ejection_percent`](BalancerBuilder::max_ejection_percent)
//! (default 50) of the endpoints are ejected at once — `floor(n × pct / 100)`,
//! and the percentage must be below 100. During a dependency-wide outage every
//! endpoint looks unhealthy, and a balancer that ejects all of them turns a
//! degraded service into a total outage; keeping half the pool means failing
//! some requests instead of all of them. [`Rejected::NoEndpoint`] is returned
//! only when the set is empty.
//!
//! Metrics: `keel_outlier_ejections_total`, the `keel_outlier_ejected` gauge and
//! `keel_balance_no_endpoint_total`, each labelled with the balancer's name.
//! For tower services, [`BalanceService`] routes requests over a fixed list.
//!
//! ```
//! use keel_policy::balance::Balancer;
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let pricing = Balancer::builder("pricing")
//!     .build_with(["http://10.0.0.1", "http://10.0.0.2", "http://10.0.0.3"])?;
//!
//! let body = pricing
//!     .call(|url| {
//!         let url = url.to_string();
//!         async move { Ok::<_, std::io::Error>(format!("GET {url}/price")) }
//!     })
//!     .await
//!     .unwrap();
//! assert!(body.starts_with("GET http://10.0.0."));
//! # Ok::<_, keel_policy::ConfigError>(())
//! # }).unwrap();
//! ```

mod config;
mod outlier;
mod picked;
mod service;
mod slot;

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use keel_core::clock::{self, Instant};
use keel_core::{Classify, Name, PolicyError, Rejected};
use parking_lot::{Mutex, RwLock};

pub use config::{BalanceConfig, BalancerBuilder, Strategy};
pub use picked::Picked;
pub use service::{BalanceService, ResponseFuture};
use slot::Slot;

/// What the balancer knows about one endpoint, at one moment.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct EndpointSnapshot<E> {
    /// The endpoint.
    pub endpoint: E,
    /// Requests picked and not yet finished.
    pub in_flight: usize,
    /// The peak-EWMA latency estimate, decayed to now.
    pub rtt: Duration,
    /// Dependency failures in a row.
    pub consecutive_failures: u32,
    /// When the endpoint returns to the pool, if it is ejected.
    pub ejected_until: Option<Instant>,
    /// How many past ejections count towards the next one's length.
    pub times_ejected: u32,
}

/// Chooses endpoints by load and ejects outliers. Clones share one set of
/// endpoints; see the [module docs](self).
pub struct Balancer<E> {
    shared: Arc<Shared<E>>,
}

impl<E> Clone for Balancer<E> {
    fn clone(&self) -> Self {
        Self {
            shared: self.shared.clone(),
        }
    }
}

impl<E> fmt::Debug for Balancer<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Balancer")
            .field("name", &self.shared.name)
            .field("endpoints", &self.len())
            .field("ejected", &self.ejected())
            .finish_non_exhaustive()
    }
}

struct Shared<E> {
    name: Name,
    config: BalanceConfig,
    decay_ns: f64,
    epoch: Instant,
    slots: RwLock<Vec<Arc<Slot<E>>>>,
    len: AtomicUsize,
    ejected: AtomicUsize,
    /// Serialises ejection decisions so the cap holds under concurrency.
    ejecting: Mutex<()>,
    rng: Rng,
    ejections_total: metrics::Counter,
    ejected_gauge: metrics::Gauge,
    no_endpoint_total: metrics::Counter,
}

impl<E> Shared<E> {
    fn new(name: Name, config: BalanceConfig, seed: Option<u64>) -> Self {
        let label = name.to_string();
        Self {
            ejections_total: metrics::counter!("keel_outlier_ejections_total", "name" => label.clone()),
            ejected_gauge: metrics::gauge!("keel_outlier_ejected", "name" => label.clone()),
            no_endpoint_total: metrics::counter!("keel_balance_no_endpoint_total", "name" => label),
            decay_ns: config.decay.as_nanos() as f64,
            config,
            name,
            epoch: clock::now(),
            slots: RwLock::new(Vec::new()),
            len: AtomicUsize::new(0),
            ejected: AtomicUsize::new(0),
            ejecting: Mutex::new(()),
            rng: Rng::new(seed),
        }
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    fn instant(&self, nanos: u64) -> Instant {
        self.epoch
            .checked_add(Duration::from_nanos(nanos))
            .unwrap_or(self.epoch)
    }

    /// The most endpoints that may be ejected out of `n`.
    fn max_ejected(&self, n: usize) -> usize {
        n.saturating_mul(usize::from(self.config.max_ejection_percent)) / 100
    }
}

enum Rng {
    PerThread,
    Seeded(Mutex<fastrand::Rng>),
}

impl Rng {
    fn new(seed: Option<u64>) -> Self {
        match seed {
            Some(seed) => Self::Seeded(Mutex::new(fastrand::Rng::with_seed(seed))),
            None => Self::PerThread,
        }
    }

    /// A uniform index below `n`, which must be at least 1.
    fn below(&self, n: usize) -> usize {
        match self {
            Self::PerThread => fastrand::usize(..n),
            Self::Seeded(rng) => rng.lock().usize(..n),
        }
    }
}

/// Random draws tried before scanning for an endpoint in the pool. At most
/// half the pool is ejected by default, so eight misses in a row are rare.
const DRAWS: usize = 8;

impl Balancer<()> {
    /// A builder named after the dependency, with the defaults. The endpoint
    /// type is chosen when building.
    pub fn builder(name: impl Into<Name>) -> BalancerBuilder {
        BalancerBuilder::new(name.into())
    }
}

impl<E> Balancer<E> {
    /// The balancer's name.
    pub fn name(&self) -> &Name {
        &self.shared.name
    }

    /// The number of endpoints, ejected ones included.
    pub fn len(&self) -> usize {
        self.shared.len.load(Ordering::Relaxed)
    }

    /// Whether there are no endpoints at all.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The number of endpoints ejected now (returns are noticed lazily, when
    /// an expired endpoint is next considered).
    pub fn ejected(&self) -> usize {
        self.shared.ejected.load(Ordering::Relaxed)
    }

    /// Adds an endpoint, with the default latency estimate.
    pub fn insert(&self, endpoint: E) {
        let shared = &*self.shared;
        let now_ns = shared.nanos(clock::now());
        let mut slots = shared.slots.write();
        let slot = Slot::new(endpoint, slots.len(), shared.config.default_rtt, now_ns);
        slots.push(Arc::new(slot));
        shared.len.store(slots.len(), Ordering::Relaxed);
    }

    /// Keeps only the endpoints for which `keep` is true. Requests in flight
    /// to removed endpoints finish normally.
    pub fn retain(&self, mut keep: impl FnMut(&E) -> bool) {
        let shared = &*self.shared;
        let _ejecting = shared.ejecting.lock();
        let mut slots = shared.slots.write();
        slots.retain(|slot| {
            let kept = keep(&slot.endpoint);
            if !kept {
                self.readmit(slot, slot.ejected_until());
            }
            kept
        });
        shared.len.store(slots.len(), Ordering::Relaxed);
    }

    /// Chooses an endpoint for one request, by power of two choices among
    /// those not ejected. Fails only if there are no endpoints.
    pub fn pick(&self) -> Result<Picked<E>, Rejected> {
        let shared = &*self.shared;
        let now = clock::now();
        let now_ns = shared.nanos(now);
        let slots = shared.slots.read();
        let chosen = match slots.len() {
            0 => None,
            1 => slots.first(),
            n => slots.get(self.choose(&slots, n, now_ns)),
        };
        match chosen {
            Some(slot) => {
                let slot = slot.clone();
                drop(slots);
                Ok(Picked::new(self.clone(), slot, now))
            }
            None => {
                drop(slots);
                Err(self.no_endpoint())
            }
        }
    }

    /// A pick of the endpoint at `position`, if it is in the pool.
    pub(crate) fn pick_at(&self, position: usize) -> Option<Picked<E>> {
        let now = clock::now();
        let now_ns = self.shared.nanos(now);
        let slots = self.shared.slots.read();
        let slot = slots
            .get(position)
            .filter(|slot| self.in_pool(slot, now_ns))?
            .clone();
        drop(slots);
        Some(Picked::new(self.clone(), slot, now))
    }

    /// Picks an endpoint, runs `f` against it and records the outcome. The
    /// operation's error is returned as [`PolicyError::Inner`]; the only
    /// refusal is [`Rejected::NoEndpoint`].
    pub async fn call<T, Er, F, Fut>(&self, f: F) -> Result<T, PolicyError<Er>>
    where
        F: FnOnce(&E) -> Fut,
        Fut: Future<Output = Result<T, Er>>,
        Er: Classify,
    {
        let picked = self.pick()?;
        let result = f(picked.endpoint()).await;
        picked.record(&result);
        result.map_err(PolicyError::Inner)
    }

    /// What the balancer knows about each endpoint now.
    pub fn snapshot(&self) -> Vec<EndpointSnapshot<E>>
    where
        E: Clone,
    {
        let shared = &*self.shared;
        let now_ns = shared.nanos(clock::now());
        let slots = shared.slots.read();
        slots
            .iter()
            .map(|slot| {
                let until = slot.ejected_until();
                EndpointSnapshot {
                    endpoint: slot.endpoint.clone(),
                    in_flight: slot.in_flight(),
                    rtt: Duration::from_nanos(slot.rtt_ns(now_ns, shared.decay_ns) as u64),
                    consecutive_failures: slot.consecutive_failures(),
                    ejected_until: (until > now_ns).then(|| shared.instant(until)),
                    times_ejected: slot.history().times_ejected,
                }
            })
            .collect()
    }

    /// The better of two random endpoints in the pool.
    fn choose(&self, slots: &[Arc<Slot<E>>], n: usize, now_ns: u64) -> usize {
        let Some(a) = self.draw(slots, n, None, now_ns) else {
            // Only possible after removals left nothing but ejected
            // endpoints: sending somewhere beats refusing.
            return self.shared.rng.below(n);
        };
        match self.draw(slots, n, Some(a), now_ns) {
            Some(b) if self.load(slots, b, now_ns) < self.load(slots, a, now_ns) => b,
            _ => a,
        }
    }

    /// A random endpoint in the pool other than `exclude`, if there is one.
    fn draw(
        &self,
        slots: &[Arc<Slot<E>>],
        n: usize,
        exclude: Option<usize>,
        now_ns: u64,
    ) -> Option<usize> {
        let rng = &self.shared.rng;
        let candidates = n - usize::from(exclude.is_some());
        let mut index = 0;
        for _ in 0..DRAWS {
            index = rng.below(candidates);
            if exclude.is_some_and(|x| index >= x) {
                index += 1;
            }
            if self.in_pool(slots.get(index)?, now_ns) {
                return Some(index);
            }
        }
        (1..n)
            .map(|k| (index + k) % n)
            .find(|&i| Some(i) != exclude && slots.get(i).is_some_and(|s| self.in_pool(s, now_ns)))
    }

    fn load(&self, slots: &[Arc<Slot<E>>], index: usize, now_ns: u64) -> f64 {
        let Some(slot) = slots.get(index) else {
            return f64::INFINITY;
        };
        let in_flight = slot.in_flight() as f64;
        match self.shared.config.strategy {
            Strategy::LeastRequest => in_flight,
            Strategy::PeakEwma => slot.rtt_ns(now_ns, self.shared.decay_ns) * (in_flight + 1.0),
        }
    }

    /// Whether `slot` may be chosen, returning it to the pool if its
    /// ejection has run out.
    fn in_pool(&self, slot: &Slot<E>, now_ns: u64) -> bool {
        match slot.ejected_until() {
            0 => true,
            until if until <= now_ns => {
                self.readmit(slot, until);
                true
            }
            _ => false,
        }
    }

    #[cold]
    fn no_endpoint(&self) -> Rejected {
        let shared = &*self.shared;
        shared.no_endpoint_total.increment(1);
        tracing::debug!(balancer = %shared.name, "refused: no endpoint to send to");
        Rejected::NoEndpoint { name: shared.name }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn balancer(n: usize) -> Balancer<usize> {
        Balancer::builder("t").seed(7).build_with(0..n).unwrap()
    }

    #[test]
    fn the_ejection_cap_rounds_down() {
        let b = balancer(0);
        let cap: Vec<_> = (0..6).map(|n| b.shared.max_ejected(n)).collect();
        assert_eq!(cap, [0, 0, 1, 1, 2, 2]);
    }

    #[tokio::test(start_paused = true)]
    async fn draws_never_return_the_excluded_endpoint() {
        let b = balancer(2);
        let slots = b.shared.slots.read().clone();
        for _ in 0..100 {
            assert_eq!(b.draw(&slots, 2, Some(0), 0), Some(1));
            assert_eq!(b.draw(&slots, 2, Some(1), 0), Some(0));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_empty_balancer_refuses() {
        let b = balancer(0);
        assert!(matches!(b.pick(), Err(Rejected::NoEndpoint { .. })));
    }
}
