//! A five-policy pipeline on a call that succeeds at once (target: ≤ 200 ns),
//! next to the closest tower stack, plus an open-circuit rejection through
//! the pipeline.
//!
//! Futures are polled once with `now_or_never` inside a current-thread
//! runtime's context, so the policies are measured, not the scheduler.

use std::hint::black_box;
use std::io;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use futures_util::FutureExt;
use keel_core::Classified;
use keel_policy::breaker::CircuitBreaker;
use keel_policy::bulkhead::Bulkhead;
use keel_policy::pipeline::Pipeline;
use keel_policy::rate_limit::RateLimiter;
use keel_policy::retry::Retry;
use keel_policy::timeout::Timeout;
use tower::{Layer, Service, ServiceBuilder, ServiceExt};

async fn ready_op() -> Result<u32, Classified> {
    Ok(1)
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime")
}

fn timeout(name: &str, limit: Duration) -> Timeout {
    Timeout::builder(name.to_owned())
        .timeout(limit)
        .build()
        .expect("valid")
}

/// total timeout → retry + budget → breaker → attempt timeout → bulkhead.
fn five_policies() -> Pipeline {
    five_policies_with(CircuitBreaker::builder("bench").build().expect("valid"))
}

fn five_policies_with(breaker: CircuitBreaker) -> Pipeline {
    Pipeline::builder("bench")
        .total_timeout(timeout("bench.total", Duration::from_secs(2)))
        .retry(
            Retry::builder("bench")
                .max_attempts(2)
                .build()
                .expect("valid"),
        )
        .breaker(breaker)
        .attempt_timeout(timeout("bench.attempt", Duration::from_millis(700)))
        .bulkhead(
            Bulkhead::builder("bench")
                .max_concurrent(64)
                .build()
                .expect("valid"),
        )
        .build()
        .expect("valid")
}

/// tower's retry with a policy that never retries (its cheapest form).
#[derive(Clone)]
struct NeverRetry;

impl<Req: Clone, Res, E> tower::retry::Policy<Req, Res, E> for NeverRetry {
    type Future = std::future::Ready<()>;

    fn retry(&mut self, _: &mut Req, _: &mut Result<Res, E>) -> Option<Self::Future> {
        None
    }

    fn clone_request(&mut self, req: &Req) -> Option<Req> {
        Some(req.clone())
    }
}

fn pipeline_happy(c: &mut Criterion) {
    let rt = runtime();
    let _context = rt.enter();
    let mut group = c.benchmark_group("pipeline/happy");
    group.bench_function("bare", |b| b.iter(|| black_box(ready_op().now_or_never())));

    let keel = five_policies();
    group.bench_function("keel_5", |b| {
        b.iter(|| black_box(keel.call(ready_op).now_or_never()))
    });

    let with_limit = Pipeline::builder("bench6")
        .retry(Retry::builder("bench6").build().expect("valid"))
        .breaker(CircuitBreaker::builder("bench6").build().expect("valid"))
        .rate_limit(
            RateLimiter::builder("bench6")
                .rate(1_000_000, Duration::from_secs(1))
                .build()
                .expect("valid"),
        )
        .bulkhead(
            Bulkhead::builder("bench6")
                .max_concurrent(64)
                .build()
                .expect("valid"),
        )
        .total_timeout(timeout("bench6.total", Duration::from_secs(2)))
        .build()
        .expect("valid");
    group.bench_function("keel_5_with_rate_limit", |b| {
        b.iter(|| black_box(with_limit.call(ready_op).now_or_never()))
    });

    let inner = tower::service_fn(|x: u32| async move { Ok::<u32, io::Error>(x) });
    let mut keel_tower = keel.layer().layer(inner);
    group.bench_function("keel_5_tower", |b| {
        b.iter(|| {
            let _ = keel_tower.ready().now_or_never();
            black_box(keel_tower.call(1).now_or_never())
        })
    });

    // tower has no breaker; its closest stack: timeout → retry → timeout → limit.
    let mut tower_stack = ServiceBuilder::new()
        .timeout(Duration::from_secs(2))
        .retry(NeverRetry)
        .timeout(Duration::from_millis(700))
        .concurrency_limit(64)
        .service(inner);
    group.bench_function("tower_4", |b| {
        b.iter(|| {
            let _ = tower_stack.ready().now_or_never();
            black_box(tower_stack.call(1).now_or_never())
        })
    });
    group.finish();
}

fn pipeline_open(c: &mut Criterion) {
    let rt = runtime();
    let _context = rt.enter();
    // Tripped by a failure, as in production (forcing it open is an
    // operator's path, and it reads the clock for its hint).
    let hour = Duration::from_secs(3600);
    let breaker = CircuitBreaker::builder("bench")
        .sliding_window(keel_policy::breaker::SlidingWindow::Off)
        .consecutive_failures(1)
        .open_duration(hour)
        .max_open_duration(hour)
        .build()
        .expect("valid");
    let tripped = breaker.call(|| async { Err::<u32, _>(Classified::retryable("down")) });
    assert!(tripped.now_or_never().is_some_and(|r| r.is_err()));
    let keel = five_policies_with(breaker);
    c.bench_function("pipeline/open_circuit/keel_5", |b| {
        b.iter(|| black_box(keel.call(ready_op).now_or_never()))
    });
}

criterion_group!(benches, pipeline_happy, pipeline_open);
criterion_main!(benches);
