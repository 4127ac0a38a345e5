//! Hedging behaviour with paused time: when hedges start, who wins, what is
//! cancelled, and when hedging holds back to protect the dependency.
#![cfg(feature = "hedge")]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use keel_core::clock::{self, Instant};
use keel_core::{Deadline, PolicyError};
use keel_policy::hedge::{Hedge, HedgeDelay, HedgeLayer};
use keel_policy::retry::RetryBudget;
use parking_lot::Mutex;
use tower::{Layer, ServiceExt};

const MS: Duration = Duration::from_millis(1);

/// Sets its flag when dropped: proves an attempt was cancelled.
struct DropGuard(Arc<AtomicBool>);

impl Drop for DropGuard {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

/// A replica set whose n-th attempt takes `latency[n]` and then answers
/// `answer[n]` (the last entry repeats); records when attempts started and
/// whether each was dropped.
#[derive(Clone, Default)]
struct Replicas {
    script: Arc<Vec<(Duration, Result<u32, &'static str>)>>,
    started: Arc<Mutex<Vec<Instant>>>,
    dropped: Arc<Mutex<Vec<Arc<AtomicBool>>>>,
}

impl Replicas {
    fn new(script: Vec<(Duration, Result<u32, &'static str>)>) -> Self {
        Self {
            script: Arc::new(script),
            ..Self::default()
        }
    }

    fn attempt(&self) -> impl Future<Output = Result<u32, &'static str>> + Send + use<> {
        let mut started = self.started.lock();
        started.push(clock::now());
        let index = (started.len() - 1).min(self.script.len() - 1);
        let (latency, answer) = self.script[index];
        let flag = Arc::new(AtomicBool::new(false));
        self.dropped.lock().push(Arc::clone(&flag));
        let guard = DropGuard(flag);
        async move {
            let _guard = guard;
            tokio::time::sleep(latency).await;
            answer
        }
    }

    fn starts(&self) -> Vec<Duration> {
        let started = self.started.lock();
        started.iter().map(|t| *t - started[0]).collect()
    }

    fn dropped(&self, attempt: usize) -> bool {
        self.dropped.lock()[attempt].load(Ordering::SeqCst)
    }
}

fn fixed(delay: Duration) -> Hedge {
    Hedge::builder("replicas")
        .delay(HedgeDelay::fixed(delay))
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_fast_first_attempt_is_not_hedged() {
    let replicas = Replicas::new(vec![(MS * 50, Ok(1))]);
    let result = fixed(MS * 100).call(|| replicas.attempt()).await;
    assert_eq!(result.unwrap(), 1);
    assert_eq!(replicas.starts().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn hedge_fires_after_the_delay_and_the_slow_attempt_is_cancelled() {
    let replicas = Replicas::new(vec![(Duration::from_secs(5), Ok(1)), (MS * 20, Ok(2))]);
    let start = clock::now();
    let result = fixed(MS * 100).call(|| replicas.attempt()).await;
    assert_eq!(result.unwrap(), 2, "the hedge won");
    assert_eq!(replicas.starts(), [Duration::ZERO, MS * 100]);
    assert_eq!(clock::now() - start, MS * 120);
    assert!(replicas.dropped(0), "the slow attempt was cancelled");
}

#[tokio::test(start_paused = true)]
async fn when_the_first_attempt_wins_the_hedge_is_cancelled() {
    let replicas = Replicas::new(vec![(MS * 150, Ok(1)), (Duration::from_secs(5), Ok(2))]);
    let result = fixed(MS * 100).call(|| replicas.attempt()).await;
    assert_eq!(result.unwrap(), 1);
    assert_eq!(replicas.starts().len(), 2);
    assert!(replicas.dropped(1));
}

#[tokio::test(start_paused = true)]
async fn a_failure_does_not_end_the_call_while_another_attempt_runs() {
    let replicas = Replicas::new(vec![(MS * 150, Err("reset")), (MS * 200, Ok(2))]);
    let start = clock::now();
    let result = fixed(MS * 100).call(|| replicas.attempt()).await;
    assert_eq!(result.unwrap(), 2);
    assert_eq!(clock::now() - start, MS * 300);
}

#[tokio::test(start_paused = true)]
async fn when_every_attempt_fails_the_last_error_is_returned() {
    let replicas = Replicas::new(vec![(MS * 300, Err("first")), (MS * 100, Err("hedge"))]);
    let result = fixed(MS * 100).call(|| replicas.attempt()).await;
    assert_eq!(result.unwrap_err(), PolicyError::Inner("first"));
}

#[tokio::test(start_paused = true)]
async fn a_failure_before_the_delay_ends_the_call_without_a_hedge() {
    let replicas = Replicas::new(vec![(MS * 10, Err("refused"))]);
    let result = fixed(MS * 100).call(|| replicas.attempt()).await;
    assert_eq!(result.unwrap_err(), PolicyError::Inner("refused"));
    assert_eq!(replicas.starts().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn hedges_are_spaced_by_the_delay_up_to_the_limit() {
    let replicas = Replicas::new(vec![(Duration::from_secs(1), Ok(1))]);
    let hedge = Hedge::builder("replicas")
        .delay(HedgeDelay::fixed(MS * 100))
        .max_hedged_attempts(3)
        .build()
        .unwrap();
    let result = hedge.call(|| replicas.attempt()).await;
    assert_eq!(result.unwrap(), 1);
    assert_eq!(
        replicas.starts(),
        [Duration::ZERO, MS * 100, MS * 200, MS * 300]
    );
    assert!(
        (1..4).all(|n| replicas.dropped(n)),
        "the losers were cancelled"
    );
}

#[tokio::test(start_paused = true)]
async fn an_empty_budget_means_no_hedge() {
    let budget = RetryBudget::builder("replicas")
        .min_per_sec(0.0)
        .build()
        .unwrap();
    let hedge = Hedge::builder("replicas")
        .delay(HedgeDelay::fixed(MS * 100))
        .budget(budget.clone())
        .build()
        .unwrap();
    let replicas = Replicas::new(vec![(Duration::from_secs(1), Ok(1))]);
    let start = clock::now();
    assert_eq!(hedge.call(|| replicas.attempt()).await.unwrap(), 1);
    assert_eq!(
        replicas.starts().len(),
        1,
        "no extra load on a dependency slow for everyone"
    );
    assert_eq!(clock::now() - start, Duration::from_secs(1));

    for _ in 0..10 {
        budget.deposit(); // ten more requests earn one hedge
    }
    let replicas = Replicas::new(vec![(Duration::from_secs(1), Ok(1)), (MS, Ok(2))]);
    assert_eq!(hedge.call(|| replicas.attempt()).await.unwrap(), 2);
}

#[tokio::test(start_paused = true)]
async fn no_hedge_starts_too_close_to_the_deadline() {
    let replicas = Replicas::new(vec![(MS * 200, Ok(1))]);
    let deadline = Deadline::after(MS * 140);
    let result = deadline
        .scope(fixed(MS * 100).call(|| replicas.attempt()))
        .await;
    assert_eq!(result.unwrap(), 1);
    assert_eq!(
        replicas.starts().len(),
        1,
        "40 ms left is less than the 50 ms needed to start"
    );

    let replicas = Replicas::new(vec![(MS * 200, Ok(1))]);
    let deadline = Deadline::after(MS * 160);
    let _ = deadline
        .scope(fixed(MS * 100).call(|| replicas.attempt()))
        .await;
    assert_eq!(replicas.starts().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn the_percentile_delay_adapts_to_observed_latency() {
    let hedge = Hedge::builder("replicas")
        .delay(HedgeDelay::Percentile {
            percentile: 95.0,
            min_samples: 10,
            window: 20,
            fallback: Duration::from_secs(1),
        })
        .budget_config(None)
        .build()
        .unwrap();
    assert_eq!(
        hedge.current_delay(),
        Duration::from_secs(1),
        "the fallback until 10 samples"
    );
    let fast = Replicas::new(vec![(MS * 80, Ok(1))]);
    for _ in 0..10 {
        hedge.call(|| fast.attempt()).await.unwrap();
    }
    assert_eq!(hedge.current_delay(), MS * 80);

    let slow_then_fast = Replicas::new(vec![(Duration::from_secs(5), Ok(1)), (MS * 10, Ok(2))]);
    let start = clock::now();
    assert_eq!(hedge.call(|| slow_then_fast.attempt()).await.unwrap(), 2);
    assert_eq!(
        clock::now() - start,
        MS * 90,
        "hedged at the observed p95 of 80 ms"
    );

    let slower = Replicas::new(vec![(MS * 300, Ok(1))]);
    for _ in 0..20 {
        hedge.call(|| slower.attempt()).await.unwrap();
    }
    assert_eq!(hedge.current_delay(), MS * 300, "the window moved on");
}

#[tokio::test(start_paused = true)]
async fn tower_service_hedges_slow_requests() {
    let replicas = Replicas::new(vec![(Duration::from_secs(5), Ok(1)), (MS * 10, Ok(2))]);
    let backend = replicas.clone();
    let service = tower::service_fn(move |request: u32| {
        let attempt = backend.attempt();
        async move {
            attempt
                .await
                .map(|n| n * request)
                .map_err(keel_core::BoxError::from)
        }
    });
    let hedged = HedgeLayer::new(fixed(MS * 100)).layer(service);
    let start = clock::now();
    assert_eq!(hedged.oneshot(10).await.unwrap(), 20);
    assert_eq!(clock::now() - start, MS * 110);
    assert!(replicas.dropped(0));
}
