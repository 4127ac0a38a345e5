//! Overhead of retry and hedging on a call that succeeds at once, of backoff
//! delay computation and of the retry budget, next to tower and backon.
//!
//! Futures are polled once with `now_or_never` inside a current-thread
//! runtime's context, so the policy is measured, not the scheduler.

use std::hint::black_box;
use std::io;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder, Retryable};
use criterion::{Criterion, criterion_group, criterion_main};
use futures_util::FutureExt;
use keel_policy::hedge::{Hedge, HedgeDelay};
use keel_policy::retry::{Backoff, Jitter, Retry, RetryBudget};
use tower::retry::budget::{Budget, TpsBudget};
use tower::{Service, ServiceExt};

const MS: Duration = Duration::from_millis(1);

async fn ready_op() -> Result<u32, io::Error> {
    Ok(1)
}

/// tower's retry with a policy that never retries (the cheapest possible).
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

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("a runtime")
}

fn retry_happy(c: &mut Criterion) {
    let rt = runtime();
    let _context = rt.enter();
    let mut group = c.benchmark_group("retry/happy");
    group.bench_function("bare", |b| b.iter(|| black_box(ready_op().now_or_never())));

    let keel = Retry::builder("bench").build().expect("valid");
    group.bench_function("keel", |b| {
        b.iter(|| black_box(keel.call(ready_op).now_or_never()))
    });
    let unbudgeted = Retry::builder("bench")
        .budget_config(None)
        .build()
        .expect("valid");
    group.bench_function("keel_no_budget", |b| {
        b.iter(|| black_box(unbudgeted.call(ready_op).now_or_never()))
    });

    let backon = ExponentialBuilder::default().with_jitter();
    group.bench_function("backon", |b| {
        b.iter(|| black_box(ready_op.retry(backon).now_or_never()))
    });

    let inner = tower::service_fn(|x: u32| async move { Ok::<u32, io::Error>(x) });
    let mut keel_tower = tower::Layer::layer(&keel.layer(), inner);
    group.bench_function("keel_tower", |b| {
        b.iter(|| {
            let _ = keel_tower.ready().now_or_never();
            black_box(keel_tower.call(1).now_or_never())
        })
    });
    let mut tower_retry = tower::retry::Retry::new(NeverRetry, inner);
    group.bench_function("tower", |b| {
        b.iter(|| {
            let _ = tower_retry.ready().now_or_never();
            black_box(tower_retry.call(1).now_or_never())
        })
    });
    group.finish();
}

fn backoff_delays(c: &mut Criterion) {
    let mut group = c.benchmark_group("backoff/10_delays");
    let keel = Backoff::default();
    group.bench_function("keel", |b| {
        b.iter(|| black_box(keel.iter().take(10).sum::<Duration>()))
    });
    let keel_exact = Backoff::default().with_jitter(Jitter::None).expect("valid");
    group.bench_function("keel_no_jitter", |b| {
        b.iter(|| black_box(keel_exact.iter().take(10).sum::<Duration>()))
    });
    let backon = ExponentialBuilder::default()
        .with_min_delay(MS * 200)
        .with_max_delay(Duration::from_secs(10))
        .with_max_times(10);
    group.bench_function("backon", |b| {
        b.iter(|| black_box(backon.with_jitter().build().sum::<Duration>()))
    });
    group.bench_function("backon_no_jitter", |b| {
        b.iter(|| black_box(backon.build().sum::<Duration>()))
    });
    group.finish();

    let mut group = c.benchmark_group("backoff/stateless_delay");
    group.bench_function("keel", |b| b.iter(|| black_box(keel.delay(black_box(5)))));
    group.finish();
}

fn budget(c: &mut Criterion) {
    let rt = runtime();
    let _context = rt.enter();
    let mut group = c.benchmark_group("budget/deposit");
    let keel = RetryBudget::builder("bench").build().expect("valid");
    group.bench_function("keel", |b| b.iter(|| keel.deposit()));
    let tower = TpsBudget::new(Duration::from_secs(10), 10, 0.1);
    group.bench_function("tower", |b| b.iter(|| tower.deposit()));
    group.finish();

    // Ten requests and one retry: the steady state of a 10% budget.
    let mut group = c.benchmark_group("budget/10_deposits_1_withdraw");
    group.bench_function("keel", |b| {
        b.iter(|| {
            for _ in 0..10 {
                keel.deposit();
            }
            black_box(keel.try_withdraw())
        })
    });
    group.bench_function("tower", |b| {
        b.iter(|| {
            for _ in 0..10 {
                tower.deposit();
            }
            black_box(tower.withdraw())
        })
    });
    group.finish();
}

fn hedge_happy(c: &mut Criterion) {
    let rt = runtime();
    let _context = rt.enter();
    let mut group = c.benchmark_group("hedge/happy");
    group.bench_function("bare", |b| b.iter(|| black_box(ready_op().now_or_never())));
    let fixed = Hedge::builder("bench")
        .delay(HedgeDelay::fixed(MS * 50))
        .build()
        .expect("valid");
    group.bench_function("keel_fixed", |b| {
        b.iter(|| black_box(fixed.call(ready_op).now_or_never()))
    });
    let percentile = Hedge::builder("bench").build().expect("valid");
    group.bench_function("keel_p95", |b| {
        b.iter(|| black_box(percentile.call(ready_op).now_or_never()))
    });
    group.finish();
}

criterion_group!(benches, retry_happy, backoff_delays, budget, hedge_happy);
criterion_main!(benches);
