//! Circuit breaker overhead, keel against failsafe and recloser on the same
//! workload: wrapping a trivial ready operation while closed, refusing while
//! open, and both with two threads calling at once.
//!
//! Futures are polled once with `now_or_never` inside an entered
//! current-thread runtime, so the executor is not what is measured.

use std::convert::Infallible;
use std::hint::black_box;
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use failsafe::futures::CircuitBreaker as _;
use futures_util::FutureExt;
use keel_core::{Classified, clock};
use keel_policy::breaker::{CircuitBreaker, SlidingWindow};
use recloser::{AsyncRecloser, Recloser};

const HOUR: Duration = Duration::from_secs(3600);

fn keel() -> CircuitBreaker {
    CircuitBreaker::builder("bench")
        .build()
        .expect("valid config")
}

fn keel_open() -> CircuitBreaker {
    let b = CircuitBreaker::builder("bench")
        .sliding_window(SlidingWindow::Off)
        .consecutive_failures(1)
        .open_duration(HOUR)
        .max_open_duration(HOUR)
        .build()
        .expect("valid config");
    let tripped = b
        .call(|| async { Err::<u32, _>(Classified::retryable("down")) })
        .now_or_never();
    assert!(matches!(tripped, Some(Err(_))));
    assert!(b.try_acquire().is_err(), "keel breaker must be open");
    b
}

type Failsafe = failsafe::StateMachine<
    failsafe::failure_policy::ConsecutiveFailures<failsafe::backoff::Constant>,
    (),
>;

fn failsafe_breaker() -> Failsafe {
    let policy =
        failsafe::failure_policy::consecutive_failures(1, failsafe::backoff::constant(HOUR));
    failsafe::Config::new().failure_policy(policy).build()
}

fn failsafe_open() -> Failsafe {
    let b = failsafe_breaker();
    let _ = b.call(async { Err::<u32, ()>(()) }).now_or_never();
    assert!(!b.is_call_permitted(), "failsafe breaker must be open");
    b
}

fn recloser() -> AsyncRecloser {
    AsyncRecloser::from(Recloser::custom().closed_len(100).open_wait(HOUR).build())
}

fn recloser_open() -> AsyncRecloser {
    let b = AsyncRecloser::from(Recloser::custom().closed_len(1).open_wait(HOUR).build());
    for _ in 0..3 {
        let _ = b.call(async { Err::<u32, ()>(()) }).now_or_never();
    }
    let refused = b.call(async { Ok::<u32, ()>(1) }).now_or_never();
    assert!(
        matches!(refused, Some(Err(recloser::Error::Rejected))),
        "recloser must be open"
    );
    b
}

fn happy(c: &mut Criterion) {
    let mut group = c.benchmark_group("breaker/happy");
    let k = keel();
    group.bench_function("keel", |b| {
        b.iter(|| {
            black_box(
                k.call(|| async { Ok::<u32, Infallible>(black_box(1)) })
                    .now_or_never(),
            )
        })
    });
    let f = failsafe_breaker();
    group.bench_function("failsafe", |b| {
        b.iter(|| black_box(f.call(async { Ok::<u32, ()>(black_box(1)) }).now_or_never()))
    });
    let r = recloser();
    group.bench_function("recloser", |b| {
        b.iter(|| black_box(r.call(async { Ok::<u32, ()>(black_box(1)) }).now_or_never()))
    });
    group.finish();
}

fn open(c: &mut Criterion) {
    let mut group = c.benchmark_group("breaker/open");
    let k = keel_open();
    group.bench_function("keel", |b| {
        b.iter(|| {
            black_box(
                k.call(|| async { Ok::<u32, Infallible>(black_box(1)) })
                    .now_or_never(),
            )
        })
    });
    group.bench_function("keel_try_acquire", |b| {
        b.iter(|| black_box(k.try_acquire().is_err()))
    });
    // Tripped on a thread without a runtime: no cool-down timer, so every
    // refusal reads the clock (what the timer saves).
    let without_timer = std::thread::scope(|s| s.spawn(keel_open).join().expect("tripped"));
    group.bench_function("keel_try_acquire_reading_the_clock", |b| {
        b.iter(|| black_box(without_timer.try_acquire().is_err()))
    });
    // What any breaker must pay to know whether its open duration is over.
    group.bench_function("baseline_clock_read", |b| {
        b.iter(|| black_box(clock::now()))
    });
    let f = failsafe_open();
    group.bench_function("failsafe", |b| {
        b.iter(|| black_box(f.call(async { Ok::<u32, ()>(black_box(1)) }).now_or_never()))
    });
    let r = recloser_open();
    group.bench_function("recloser", |b| {
        b.iter(|| black_box(r.call(async { Ok::<u32, ()>(black_box(1)) }).now_or_never()))
    });
    group.finish();
}

/// Both threads make `iters` calls; the time per iteration is what one call
/// costs while another thread calls the same breaker.
fn on_two_threads(iters: u64, call: impl Fn() + Sync) -> Duration {
    let start = clock::now();
    std::thread::scope(|s| {
        for _ in 0..2 {
            s.spawn(|| (0..iters).for_each(|_| call()));
        }
    });
    start.elapsed()
}

/// Two threads calling one breaker at once, closed (`breaker/contended`)
/// or open (`breaker/contended_open`: refusals must not share a write).
fn contended(c: &mut Criterion, name: &str, k: CircuitBreaker, f: Failsafe, r: AsyncRecloser) {
    let mut group = c.benchmark_group(name);
    group.bench_function("keel", |b| {
        b.iter_custom(|iters| {
            on_two_threads(iters, || {
                black_box(
                    k.call(|| async { Ok::<u32, Infallible>(black_box(1)) })
                        .now_or_never(),
                );
            })
        })
    });
    group.bench_function("failsafe", |b| {
        b.iter_custom(|iters| {
            on_two_threads(iters, || {
                black_box(f.call(async { Ok::<u32, ()>(black_box(1)) }).now_or_never());
            })
        })
    });
    group.bench_function("recloser", |b| {
        b.iter_custom(|iters| {
            on_two_threads(iters, || {
                black_box(r.call(async { Ok::<u32, ()>(black_box(1)) }).now_or_never());
            })
        })
    });
    group.finish();
}

fn benches(c: &mut Criterion) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let _entered = runtime.enter();
    happy(c);
    open(c);
    let closed = (keel(), failsafe_breaker(), recloser());
    contended(c, "breaker/contended", closed.0, closed.1, closed.2);
    let open = (keel_open(), failsafe_open(), recloser_open());
    contended(c, "breaker/contended_open", open.0, open.1, open.2);
}

criterion_group!(breaker, benches);
criterion_main!(breaker);
