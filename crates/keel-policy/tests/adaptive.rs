//! Behaviour of the adaptive concurrency limit under paused time: it grows
//! on fast successes, falls when latency rises, and stays near its minimum
//! under steady timeouts instead of running away to its maximum.
#![cfg(feature = "adaptive")]

use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::join_all;
use keel_core::{BoxError, Classified, Classify, ErrorClass, PolicyError, Rejected};
use keel_policy::adaptive::{
    AdaptiveLimit, AdaptiveLimitLayer, AimdConfig, GradientConfig, LimitAlgorithm, Sample,
};
use keel_testkit::metrics::MetricsRecorder;
use tokio::time::sleep;
use tower::{Layer, Service, ServiceExt, service_fn};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

#[derive(Clone, Copy, Debug)]
enum Ending {
    /// Succeeds after this long.
    Ok(Duration),
    /// Hangs, and an outer timeout cancels it after this long.
    Cancelled(Duration),
    /// Fails with a dependency failure after this long.
    Failed(Duration),
}

/// One round trip at full use: as many concurrent calls as the limit
/// allows, each ending as told. Returns how many were refused.
async fn round(limit: &AdaptiveLimit, ending: Ending) -> usize {
    let calls = (0..limit.limit()).map(|_| async move {
        let call = limit.call(|| async move {
            match ending {
                Ending::Ok(rtt) => {
                    sleep(rtt).await;
                    Ok(())
                }
                Ending::Failed(rtt) => {
                    sleep(rtt).await;
                    Err(Classified::retryable(std::io::Error::other("503")))
                }
                Ending::Cancelled(_) => std::future::pending().await,
            }
        });
        match ending {
            Ending::Cancelled(after) => tokio::time::timeout(after, call).await.ok(),
            _ => Some(call.await),
        }
    });
    let outcomes = join_all(calls).await;
    outcomes
        .iter()
        .filter(|o| matches!(o, Some(Err(PolicyError::Rejected(_)))))
        .count()
}

/// Runs `rounds` rounds and returns the highest limit seen.
async fn rounds(limit: &AdaptiveLimit, rounds: usize, ending: Ending) -> usize {
    let mut highest = limit.limit();
    for _ in 0..rounds {
        assert_eq!(
            round(limit, ending).await,
            0,
            "a round stays within the limit"
        );
        highest = highest.max(limit.limit());
    }
    highest
}

fn aimd(initial: usize) -> AdaptiveLimit {
    AdaptiveLimit::builder("dep")
        .limits(initial, 1, 200)
        .aimd(AimdConfig::default())
        .build()
        .unwrap()
}

fn gradient(initial: usize) -> AdaptiveLimit {
    AdaptiveLimit::builder("dep")
        .limits(initial, 1, 200)
        .gradient(GradientConfig::default())
        .build()
        .unwrap()
}

#[tokio::test(start_paused = true)]
async fn aimd_grows_on_fast_successes_and_falls_when_calls_time_out() {
    let limit = aimd(10);
    rounds(&limit, 30, Ending::Ok(ms(10))).await;
    let grown = limit.limit();
    // Additive: at most one per round trip (30), not doubling per round.
    assert!((20..=40).contains(&grown), "{grown}");

    // Latency rises past the timeout: every call is now a drop.
    rounds(&limit, 3, Ending::Ok(ms(1_500))).await;
    assert!(limit.limit() < grown / 4, "{} after {grown}", limit.limit());
}

#[tokio::test(start_paused = true)]
async fn gradient_grows_on_fast_successes_and_falls_when_latency_rises() {
    let limit = gradient(10);
    rounds(&limit, 15, Ending::Ok(ms(10))).await;
    let grown = limit.limit();
    assert!(grown >= 60, "{grown}");

    // Round trips four times the minimum, yet well within the timeout:
    // queueing has begun, so the limit comes down.
    rounds(&limit, 10, Ending::Ok(ms(40))).await;
    let fallen = limit.limit();
    assert!(fallen < grown / 3, "{fallen} after {grown}");
}

#[tokio::test(start_paused = true)]
async fn steady_timeouts_keep_the_limit_near_its_minimum() {
    for (name, limit) in [("aimd", aimd(50)), ("gradient", gradient(50))] {
        // Calls the dependency never answers, cut by an outer timeout, for
        // far longer than the gradient's min_rtt window (30 s).
        let highest = rounds(&limit, 200, Ending::Cancelled(ms(500))).await;
        assert!(limit.limit() <= 2, "{name}: {}", limit.limit());
        assert!(highest <= 50, "{name}: never rose, peaked at {highest}");

        // Successes slower than the timeout are drops too.
        let highest = rounds(&limit, 50, Ending::Ok(ms(2_000))).await;
        assert!(highest <= 2 && limit.limit() <= 2, "{name}: {highest}");

        // And so are dependency failures.
        let highest = rounds(&limit, 50, Ending::Failed(ms(5))).await;
        assert!(highest <= 2 && limit.limit() <= 2, "{name}: {highest}");
        assert_eq!(limit.in_flight(), 0, "{name}: every slot was given back");
    }
}

#[tokio::test(start_paused = true)]
async fn a_mostly_idle_limit_does_not_inflate() {
    for limit in [aimd(20), gradient(20)] {
        for _ in 0..1_000 {
            let ok = limit
                .call(|| async {
                    sleep(ms(5)).await;
                    Ok::<_, std::io::Error>(())
                })
                .await;
            assert!(ok.is_ok());
        }
        assert_eq!(
            limit.limit(),
            20,
            "one call at a time says nothing about a limit of 20"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn calls_beyond_the_limit_are_refused_with_retry_after() {
    let limit = AdaptiveLimit::builder("dep")
        .limits(2, 1, 10)
        .build()
        .unwrap();
    let hang = || limit.call(std::future::pending::<Result<(), std::io::Error>>);
    let (mut a, mut b) = (Box::pin(hang()), Box::pin(hang()));
    assert!((&mut a).now_or_never().is_none());
    assert!((&mut b).now_or_never().is_none());
    let mut ran = false;
    let refused = limit
        .call(|| {
            ran = true;
            async { Ok::<_, std::io::Error>(()) }
        })
        .await;
    let Err(PolicyError::Rejected(rejected)) = refused else {
        panic!("expected a refusal")
    };
    assert!(matches!(rejected, Rejected::Overloaded { .. }));
    assert_eq!(rejected.retry_after(), Some(Duration::from_secs(1)));
    assert!(!ran, "the refused call never reached the dependency");
    drop((a, b));
    assert_eq!(
        limit.in_flight(),
        0,
        "cancelled calls give their slots back"
    );
}

#[tokio::test(start_paused = true)]
async fn permanent_errors_say_nothing_about_load() {
    let limit = aimd(10);
    for _ in 0..100 {
        let calls = (0..10).map(|_| {
            limit.call(|| async {
                Err::<(), _>(Classified::permanent(std::io::Error::other("404")))
            })
        });
        for outcome in join_all(calls).await {
            assert_eq!(outcome.unwrap_err().class(), ErrorClass::Permanent);
        }
    }
    assert_eq!(limit.limit(), 10);
}

#[tokio::test(start_paused = true)]
async fn the_tower_service_learns_from_classified_inner_errors() {
    let limit = aimd(10);
    let mut service =
        AdaptiveLimitLayer::new(limit.clone()).layer(service_fn(|fail: bool| async move {
            if fail {
                Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
            } else {
                Ok(())
            }
        }));
    let err: BoxError = service.ready().await.unwrap().call(true).await.unwrap_err();
    assert!(err.downcast_ref::<std::io::Error>().is_some());
    assert_eq!(limit.limit(), 9, "a refused connection is a drop");
    service.ready().await.unwrap().call(false).await.unwrap();
    assert_eq!(limit.in_flight(), 0);

    let tight = AdaptiveLimit::builder("dep")
        .limits(1, 1, 1)
        .build()
        .unwrap();
    let (mock, _handle) = tower_test::mock::pair::<u32, u32>();
    let mut service = AdaptiveLimitLayer::new(tight.clone()).layer(mock);
    let _pending = service.ready().await.unwrap().call(1);
    let err = service.ready().await.unwrap().call(2).await.unwrap_err();
    assert_eq!(err.class(), ErrorClass::Rejected);
    assert_eq!(err.retry_after(), Some(Duration::from_secs(1)));
}

/// A custom algorithm that always answers NaN or infinity must not break
/// the bounds.
struct Broken(bool);

impl LimitAlgorithm for Broken {
    fn update(&mut self, _limit: f64, _sample: &Sample) -> f64 {
        self.0 = !self.0;
        if self.0 { f64::NAN } else { f64::INFINITY }
    }
}

#[tokio::test(start_paused = true)]
async fn a_custom_algorithm_stays_within_the_bounds() {
    let limit = AdaptiveLimit::builder("dep")
        .limits(5, 2, 8)
        .algorithm(Broken(false))
        .build()
        .unwrap();
    for _ in 0..10 {
        round(&limit, Ending::Ok(ms(1))).await;
        assert!((2..=8).contains(&limit.limit()));
    }
}

#[tokio::test(start_paused = true)]
async fn the_limit_is_published_as_a_gauge() {
    let recorded = MetricsRecorder::new();
    let limit = metrics::with_local_recorder(&recorded, || aimd(10));
    assert_eq!(recorded.gauge("keel_adaptive_limit,name=dep"), 10.0);
    rounds(&limit, 5, Ending::Ok(ms(10))).await;
    assert_eq!(
        recorded.gauge("keel_adaptive_limit,name=dep"),
        limit.limit() as f64
    );
    assert!(limit.limit() > 10);
    let tight = metrics::with_local_recorder(&recorded, || {
        AdaptiveLimit::builder("tight")
            .limits(1, 1, 1)
            .build()
            .unwrap()
    });
    let hold = tight.call(std::future::pending::<Result<(), std::io::Error>>);
    let mut hold = Box::pin(hold);
    assert!((&mut hold).now_or_never().is_none());
    assert!(
        tight
            .call(|| async { Ok::<_, std::io::Error>(()) })
            .await
            .is_err()
    );
    assert_eq!(
        recorded.counter("keel_adaptive_rejected_total,name=tight"),
        1
    );
}
#[path = "support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::allocations_in;

#[test]
fn the_happy_path_does_not_allocate() {
    let limit = AdaptiveLimit::builder("dep").build().unwrap();
    let mut service =
        AdaptiveLimitLayer::new(limit.clone()).layer(service_fn(|x: u32| async move {
            Ok::<_, std::io::Error>(x)
        }));
    let waker = futures_util::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    let n = allocations_in(|| {
        for _ in 0..100 {
            let out = limit
                .call(|| async { Ok::<_, std::io::Error>(1) })
                .now_or_never();
            assert!(matches!(out, Some(Ok(1))));
            assert!(service.poll_ready(&mut cx).is_ready());
            assert!(matches!(service.call(1).now_or_never(), Some(Ok(1))));
        }
    });
    assert_eq!(n, 0);
}
