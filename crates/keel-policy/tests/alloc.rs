//! The happy path of every policy, and of a five-policy pipeline, makes no
//! heap allocation: resilience must not cost the calls that succeed.
//! (bulkhead, rate_limit, shed and adaptive prove it in their own files.)
#![cfg(feature = "full")]

#[path = "support/counting_alloc.rs"]
mod counting_alloc;

use std::time::Duration;

use counting_alloc::allocations_in;
use keel_core::Classified;
use keel_policy::balance::Balancer;
use keel_policy::breaker::CircuitBreaker;
use keel_policy::bulkhead::Bulkhead;
use keel_policy::chaos::FaultInjection;
use keel_policy::fallback::Fallback;
use keel_policy::hedge::{Hedge, HedgeDelay};
use keel_policy::pipeline::Pipeline;
use keel_policy::rate_limit::RateLimiter;
use keel_policy::retry::Retry;
use keel_policy::timeout::Timeout;

const CALLS: usize = 1_000;

fn ok() -> std::future::Ready<Result<u32, Classified>> {
    std::future::ready(Ok(1))
}

/// Runs `body` on a current-thread runtime (same thread, so the counter
/// sees every allocation): once to warm lazy state up, then measured.
fn allocations_of<F, Fut>(mut body: F) -> usize
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(body());
    allocations_in(|| rt.block_on(body()))
}

fn pipeline() -> Pipeline {
    Pipeline::builder("payments")
        .total_timeout(
            Timeout::builder("payments.total")
                .timeout(Duration::from_secs(2))
                .build()
                .unwrap(),
        )
        .retry(Retry::builder("payments").max_attempts(2).build().unwrap())
        .breaker(CircuitBreaker::builder("payments").build().unwrap())
        .attempt_timeout(
            Timeout::builder("payments.attempt")
                .timeout(Duration::from_millis(700))
                .build()
                .unwrap(),
        )
        .bulkhead(Bulkhead::builder("payments").build().unwrap())
        .rate_limit(
            RateLimiter::builder("payments")
                .rate(1_000_000, Duration::from_secs(1))
                .build()
                .unwrap(),
        )
        .fallback(Fallback::builder("payments").build().unwrap())
        .build()
        .unwrap()
}

#[test]
fn breaker_retry_timeout_fallback_do_not_allocate() {
    let breaker = CircuitBreaker::builder("b").build().unwrap();
    let retry = Retry::builder("r").build().unwrap();
    let timeout = Timeout::builder("t")
        .timeout(Duration::from_secs(1))
        .build()
        .unwrap();
    let fallback = Fallback::builder("f").build().unwrap();
    let n = allocations_of(|| async {
        for _ in 0..CALLS {
            assert_eq!(breaker.call(ok).await.unwrap(), 1);
            assert_eq!(retry.call(ok).await.unwrap(), 1);
            assert_eq!(timeout.call(ok).await.unwrap(), 1);
            assert_eq!(fallback.call_or(ok, 0).await.unwrap(), 1);
        }
    });
    assert_eq!(n, 0, "allocations on the happy path");
}

#[test]
fn hedge_balance_and_disabled_chaos_do_not_allocate() {
    let hedge = Hedge::builder("h")
        .delay(HedgeDelay::fixed(Duration::from_millis(50)))
        .build()
        .unwrap();
    let balancer = Balancer::builder("lb").build_with(["a", "b", "c"]).unwrap();
    let chaos = FaultInjection::builder("c").build().unwrap();
    let n = allocations_of(|| async {
        for _ in 0..CALLS {
            assert_eq!(hedge.call(ok).await.unwrap(), 1);
            assert_eq!(balancer.call(|_| ok()).await.unwrap(), 1);
            assert_eq!(chaos.call(ok).await.unwrap(), 1);
        }
    });
    assert_eq!(n, 0, "allocations on the happy path");
}

#[test]
fn a_full_pipeline_does_not_allocate() {
    let payments = pipeline();
    let n = allocations_of(|| async {
        for _ in 0..CALLS {
            assert_eq!(payments.call(ok).await.unwrap(), 1);
            let served = payments.call_or_else(ok, |_| async { Ok(0) }).await;
            assert_eq!(served.unwrap(), 1);
        }
    });
    assert_eq!(n, 0, "allocations on the happy path");
}

#[test]
fn the_counter_counts() {
    assert_eq!(
        allocations_in(|| drop(std::hint::black_box(Vec::<u8>::with_capacity(8)))),
        1
    );
}
