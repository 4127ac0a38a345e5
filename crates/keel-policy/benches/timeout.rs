//! Overhead of timeout, fallback, balancing and fault injection on a trivial
//! ready operation, next to tower's timeout and power-of-two-choices balancer
//! on the same workload. (No peer crate has a fallback or fault injector;
//! those are compared with calling the operation bare.)
//!
//! Futures are polled once with `now_or_never` inside an entered
//! current-thread runtime, so the executor is not what is measured.

use std::convert::Infallible;
use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use futures_util::FutureExt;
use keel_core::{BoxError, Classified};
use keel_policy::balance::{BalanceService, Balancer, Strategy};
use keel_policy::chaos::FaultInjection;
use keel_policy::fallback::Fallback;
use keel_policy::timeout::Timeout;
use tower::balance::p2c::Balance;
use tower::discover::ServiceList;
use tower::load::{CompleteOnResponse, PeakEwmaDiscover};
use tower::{Layer, Service, ServiceExt, service_fn};

const ENDPOINTS: usize = 8;

async fn op() -> Result<u32, Infallible> {
    Ok(black_box(1))
}

fn ready_service() -> impl Service<u32, Response = u32, Error = Infallible, Future: Send> + Clone {
    service_fn(|x: u32| async move { Ok::<u32, Infallible>(x) })
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime")
}

fn timeout(c: &mut Criterion) {
    let mut group = c.benchmark_group("timeout/happy");
    group.bench_function("baseline", |b| b.iter(|| black_box(op().now_or_never())));

    let keel = Timeout::builder("bench").build().expect("valid config");
    group.bench_function("keel", |b| {
        b.iter(|| black_box(keel.call(op).now_or_never()))
    });
    let leaf = Timeout::builder("bench")
        .propagate_deadline(false)
        .build()
        .expect("valid config");
    group.bench_function("keel-no-propagate", |b| {
        b.iter(|| black_box(leaf.call(op).now_or_never()))
    });

    let mut keel_svc = keel.layer().layer(ready_service());
    group.bench_function("keel-layer", |b| {
        b.iter(|| black_box(keel_svc.call(black_box(1)).now_or_never()))
    });
    let mut leaf_svc = leaf.layer().layer(ready_service());
    group.bench_function("keel-layer-no-propagate", |b| {
        b.iter(|| black_box(leaf_svc.call(black_box(1)).now_or_never()))
    });
    let mut tower_svc =
        tower::timeout::TimeoutLayer::new(Duration::from_secs(1)).layer(ready_service());
    group.bench_function("tower", |b| {
        b.iter(|| black_box(tower_svc.call(black_box(1)).now_or_never()))
    });
    group.finish();
}

fn fallback(c: &mut Criterion) {
    let mut group = c.benchmark_group("fallback/happy");
    let ok = || async { Ok::<u32, Classified>(black_box(1)) };
    group.bench_function("baseline", |b| b.iter(|| black_box(ok().now_or_never())));
    let keel = Fallback::builder("bench").build().expect("valid config");
    group.bench_function("keel", |b| {
        b.iter(|| black_box(keel.call(ok, |_| async { Ok(0) }).now_or_never()))
    });
    group.bench_function("keel-value", |b| {
        b.iter(|| black_box(keel.call_or(ok, 0).now_or_never()))
    });
    let mut svc = keel
        .layer(|_: BoxError| Ok::<u32, BoxError>(0))
        .layer(ready_service());
    group.bench_function("keel-layer", |b| {
        b.iter(|| black_box(svc.call(black_box(1)).now_or_never()))
    });
    group.finish();

    let mut group = c.benchmark_group("fallback/served");
    let down = || async { Err::<u32, _>(Classified::retryable("down")) };
    group.bench_function("keel", |b| {
        b.iter(|| black_box(keel.call_or(down, 0).now_or_never()))
    });
    group.finish();
}

fn balance(c: &mut Criterion) {
    let mut group = c.benchmark_group("balance/pick-complete");
    let ewma = Balancer::builder("bench")
        .build_with(0..ENDPOINTS)
        .expect("valid config");
    group.bench_function("keel-ewma", |b| {
        b.iter(|| ewma.pick().map(|picked| picked.success()))
    });
    let least = Balancer::builder("bench")
        .strategy(Strategy::LeastRequest)
        .build_with(0..ENDPOINTS)
        .expect("valid config");
    group.bench_function("keel-least-request", |b| {
        b.iter(|| least.pick().map(|picked| picked.success()))
    });
    group.bench_function("keel-call", |b| {
        b.iter(|| {
            black_box(
                ewma.call(|&i| async move { Ok::<usize, Classified>(i) })
                    .now_or_never(),
            )
        })
    });

    let keyed = (0..ENDPOINTS).map(|i| (i, ready_service()));
    let mut keel_svc =
        BalanceService::new(Balancer::builder("bench"), keyed).expect("valid config");
    group.bench_function("keel-service", |b| {
        b.iter(|| {
            let svc = keel_svc.ready().now_or_never();
            black_box(svc.map(|s| s.map(|s| s.call(black_box(1)).now_or_never())))
        })
    });

    let list = ServiceList::new((0..ENDPOINTS).map(|_| ready_service()).collect::<Vec<_>>());
    let discover = PeakEwmaDiscover::new(
        list,
        Duration::from_millis(30),
        Duration::from_secs(10),
        CompleteOnResponse::default(),
    );
    let mut tower_svc: Balance<_, u32> = Balance::new(discover);
    group.bench_function("tower-p2c-ewma", |b| {
        b.iter(|| {
            let svc = tower_svc.ready().now_or_never();
            black_box(svc.map(|s| s.map(|s| s.call(black_box(1)).now_or_never())))
        })
    });
    group.finish();
}

fn chaos(c: &mut Criterion) {
    let mut group = c.benchmark_group("chaos/disabled");
    group.bench_function("baseline", |b| b.iter(|| black_box(op().now_or_never())));
    let configured_off = FaultInjection::builder("bench")
        .abort(100.0)
        .build()
        .expect("valid config");
    group.bench_function("keel", |b| {
        b.iter(|| black_box(configured_off.call(op).now_or_never()))
    });
    let on_but_unscoped = FaultInjection::builder("bench")
        .experiment("bench")
        .abort(100.0)
        .enabled(true)
        .build()
        .expect("valid config");
    group.bench_function("keel-enabled-unscoped", |b| {
        b.iter(|| black_box(on_but_unscoped.call(op).now_or_never()))
    });
    let mut svc = configured_off.layer(|_: &u32| true).layer(ready_service());
    group.bench_function("keel-layer", |b| {
        b.iter(|| black_box(svc.call(black_box(1)).now_or_never()))
    });
    let mut bare = ready_service();
    group.bench_function("baseline-service", |b| {
        b.iter(|| black_box(bare.call(black_box(1)).now_or_never()))
    });
    group.finish();
}

fn all(c: &mut Criterion) {
    let rt = runtime();
    let _entered = rt.enter();
    timeout(c);
    fallback(c);
    balance(c);
    chaos(c);
}

criterion_group!(benches, all);
criterion_main!(benches);
