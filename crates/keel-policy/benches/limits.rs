//! Overhead of the limiting policies, keel against the peers on the same
//! workload: wrapping a trivial ready operation in a bulkhead (vs tower's
//! `ConcurrencyLimit`), a rate limiter (vs governor used directly, which
//! keel wraps), load shedding (vs tower's `LoadShed` over a
//! `ConcurrencyLimit`) and an adaptive limit; and a bulkhead with two
//! threads calling at once.
//!
//! Futures are polled once with `now_or_never` inside an entered
//! current-thread runtime, so the executor is not what is measured.
//! `baseline/ready_op` is the operation alone: subtract it for overhead.

use std::convert::Infallible;
use std::hint::black_box;
use std::num::NonZeroU32;
use std::task::{Context, Poll};
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use futures_util::FutureExt;
use futures_util::task::noop_waker_ref;
use keel_core::clock;
use keel_policy::adaptive::{AdaptiveLimit, AdaptiveLimitLayer};
use keel_policy::bulkhead::{Bulkhead, BulkheadLayer};
use keel_policy::rate_limit::{KeyedRateLimiter, RateLimiter};
use keel_policy::shed::{LoadShed, LoadShedLayer};
use tower::{Layer, Service, service_fn};

const KEYS: u64 = 1024;

async fn op() -> Result<u32, Infallible> {
    Ok(black_box(1))
}

fn echo() -> impl Service<u32, Response = u32, Error = Infallible, Future: Send> + Clone {
    service_fn(|x: u32| async move { Ok::<u32, Infallible>(x) })
}

/// One request through a tower service: `poll_ready`, `call`, and one poll
/// of the response.
fn through<S: Service<u32>>(service: &mut S) -> Option<Result<S::Response, S::Error>> {
    let mut cx = Context::from_waker(noop_waker_ref());
    match service.poll_ready(&mut cx) {
        Poll::Ready(Ok(())) => service.call(black_box(1)).now_or_never(),
        _ => None,
    }
}

fn baseline(c: &mut Criterion) {
    c.bench_function("baseline/ready_op", |b| {
        b.iter(|| black_box(op().now_or_never()))
    });
}

fn bulkhead(c: &mut Criterion) {
    let mut group = c.benchmark_group("bulkhead/happy");
    let keel = Bulkhead::builder("bench").build().expect("valid config");
    group.bench_function("keel", |b| {
        b.iter(|| black_box(keel.call(op).now_or_never()))
    });
    let mut keel_tower = BulkheadLayer::new(keel.clone()).layer(echo());
    group.bench_function("keel_tower", |b| {
        b.iter(|| black_box(through(&mut keel_tower)))
    });
    let mut tower = tower::limit::ConcurrencyLimit::new(echo(), 10);
    group.bench_function("tower", |b| b.iter(|| black_box(through(&mut tower))));
    group.finish();
}

/// Both threads make `iters` calls; the time per iteration is what one call
/// costs while another thread calls the same bulkhead.
fn on_two_threads(iters: u64, call: impl Fn() + Sync) -> Duration {
    let start = clock::now();
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| (0..iters).for_each(|_| call()));
        }
    });
    start.elapsed()
}

fn bulkhead_contended(c: &mut Criterion) {
    let mut group = c.benchmark_group("bulkhead/contended");
    let keel = Bulkhead::builder("bench").build().expect("valid config");
    group.bench_function("keel", |b| {
        b.iter_custom(|iters| {
            on_two_threads(iters, || {
                black_box(keel.call(op).now_or_never());
            })
        })
    });
    let tower = tower::limit::ConcurrencyLimit::new(echo(), 10);
    group.bench_function("tower", |b| {
        b.iter_custom(|iters| {
            on_two_threads(iters, || {
                let mut service = tower.clone();
                black_box(through(&mut service));
            })
        })
    });
    group.finish();
}

fn nonzero(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).expect("non-zero")
}

/// A limit so generous that every check is allowed: the happy path.
fn generous() -> keel_policy::rate_limit::RateLimitBuilder {
    RateLimiter::builder("bench")
        .rate(1_000_000_000, Duration::from_secs(1))
        .burst(u32::MAX)
}

fn generous_quota() -> governor::Quota {
    governor::Quota::per_second(nonzero(1_000_000_000)).allow_burst(nonzero(u32::MAX))
}

fn rate_limit(c: &mut Criterion) {
    let mut group = c.benchmark_group("rate_limit/check");
    let keel = generous().build().expect("valid config");
    group.bench_function("keel", |b| b.iter(|| black_box(keel.check())));
    let governor = governor::RateLimiter::direct(generous_quota());
    group.bench_function("governor", |b| b.iter(|| black_box(governor.check())));
    group.bench_function("keel_call", |b| {
        b.iter(|| black_box(keel.call(op).now_or_never()))
    });
    group.finish();

    let mut group = c.benchmark_group("rate_limit/keyed");
    let keel: KeyedRateLimiter<u64> = generous().build_keyed().expect("valid config");
    let governor = governor::RateLimiter::<u64, _, _>::dashmap(generous_quota());
    for key in 0..KEYS {
        keel.check_key(&key).expect("allowed");
        governor.check_key(&key).expect("allowed");
    }
    let mut key = 0;
    group.bench_function("keel", |b| {
        b.iter(|| {
            key = (key + 1) % KEYS;
            black_box(keel.check_key(&key))
        })
    });
    group.bench_function("governor", |b| {
        b.iter(|| {
            key = (key + 1) % KEYS;
            black_box(governor.check_key(&key))
        })
    });
    group.finish();
}

fn shed(c: &mut Criterion) {
    let mut group = c.benchmark_group("shed/happy");
    let keel = LoadShed::builder("bench").build().expect("valid config");
    group.bench_function("keel", |b| {
        b.iter(|| black_box(keel.call(op).now_or_never()))
    });
    let mut keel_tower = LoadShedLayer::new(keel.clone()).layer(echo());
    group.bench_function("keel_tower", |b| {
        b.iter(|| black_box(through(&mut keel_tower)))
    });
    let mut tower =
        tower::load_shed::LoadShed::new(tower::limit::ConcurrencyLimit::new(echo(), 64));
    group.bench_function("tower", |b| b.iter(|| black_box(through(&mut tower))));
    group.finish();
}

fn adaptive(c: &mut Criterion) {
    let mut group = c.benchmark_group("adaptive/happy");
    let keel = AdaptiveLimit::builder("bench")
        .build()
        .expect("valid config");
    group.bench_function("keel", |b| {
        b.iter(|| black_box(keel.call(op).now_or_never()))
    });
    let mut keel_tower = AdaptiveLimitLayer::new(keel.clone()).layer(echo());
    group.bench_function("keel_tower", |b| {
        b.iter(|| black_box(through(&mut keel_tower)))
    });
    // No peer adapts its limit; tower's fixed limit is the reference point.
    let mut tower = tower::limit::ConcurrencyLimit::new(echo(), 20);
    group.bench_function("tower_fixed_limit", |b| {
        b.iter(|| black_box(through(&mut tower)))
    });
    group.finish();
}

fn benches(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let _entered = runtime.enter();
    baseline(c);
    bulkhead(c);
    bulkhead_contended(c);
    rate_limit(c);
    shed(c);
    adaptive(c);
}

criterion_group!(limits, benches);
criterion_main!(limits);
