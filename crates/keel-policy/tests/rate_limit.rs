//! Behaviour of the rate limiter under paused time: bursts, refills, the
//! `retry_after` it reports, waiting within the deadline, per-key isolation
//! and bounded memory under a flood of distinct keys.
#![cfg(feature = "rate-limit")]

use std::time::Duration;

use futures_util::FutureExt;
use keel_core::{BoxError, Classify, Deadline, ErrorClass, PolicyError, Rejected, clock};
use keel_policy::rate_limit::{KeyedRateLimitLayer, KeyedRateLimiter, RateLimitLayer, RateLimiter};
use tokio::time::advance;
use tower::{Layer, Service, ServiceExt, service_fn};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn retry_after(result: Result<(), Rejected>) -> Duration {
    match result {
        Err(Rejected::RateLimited { retry_after, .. }) => retry_after,
        other => panic!("expected a rate limit refusal, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_burst_is_admitted_then_refused_with_the_exact_wait() {
    let limiter = RateLimiter::builder("api")
        .rate(5, ms(1000))
        .build()
        .unwrap();
    for _ in 0..5 {
        assert!(limiter.check().is_ok());
    }
    assert_eq!(retry_after(limiter.check()), ms(200));
    advance(ms(50)).await;
    assert_eq!(
        retry_after(limiter.check()),
        ms(150),
        "the wait shrinks as time passes"
    );
}

#[tokio::test(start_paused = true)]
async fn the_limit_refills_as_time_advances_but_never_beyond_the_burst() {
    let limiter = RateLimiter::builder("api")
        .rate(5, ms(1000))
        .build()
        .unwrap();
    for _ in 0..5 {
        limiter.check().unwrap();
    }
    advance(ms(200)).await;
    assert!(limiter.check().is_ok(), "one interval refills one call");
    assert!(limiter.check().is_err());
    advance(ms(10_000)).await;
    let admitted = (0..20).filter(|_| limiter.check().is_ok()).count();
    assert_eq!(admitted, 5, "a long quiet spell refills one burst, no more");
}

#[tokio::test(start_paused = true)]
async fn a_burst_can_be_smaller_than_the_rate() {
    let limiter = RateLimiter::builder("api")
        .rate(10, ms(1000))
        .burst(2)
        .build()
        .unwrap();
    assert!(limiter.check().is_ok());
    assert!(limiter.check().is_ok());
    assert_eq!(retry_after(limiter.check()), ms(100));
}

#[tokio::test(start_paused = true)]
async fn acquire_waits_exactly_until_the_call_conforms() {
    let limiter = RateLimiter::builder("api")
        .rate(4, ms(1000))
        .burst(1)
        .build()
        .unwrap();
    limiter.check().unwrap();
    let started = clock::now();
    limiter.acquire().await.unwrap();
    assert_eq!(clock::now() - started, ms(250));
    let out = limiter
        .call_waiting(|| async { Ok::<_, std::io::Error>(1) })
        .await;
    assert_eq!(out.unwrap(), 1);
    assert_eq!(clock::now() - started, ms(500));
}

#[tokio::test(start_paused = true)]
async fn acquire_never_waits_past_the_deadline() {
    let limiter = RateLimiter::builder("api")
        .rate(1, ms(1000))
        .build()
        .unwrap();
    limiter.check().unwrap();
    let started = clock::now();
    let refused = Deadline::after(ms(300)).scope(limiter.acquire()).await;
    assert_eq!(retry_after(refused), ms(1000));
    assert_eq!(
        clock::now(),
        started,
        "refused at once, not after a useless wait"
    );

    advance(ms(800)).await;
    let admitted = Deadline::after(ms(300)).scope(limiter.acquire()).await;
    assert!(
        admitted.is_ok(),
        "a wait that fits in the deadline is taken"
    );
    assert_eq!(clock::now() - started, ms(1000));
}

#[tokio::test(start_paused = true)]
async fn call_refuses_without_running_the_operation() {
    let limiter = RateLimiter::builder("api")
        .rate(1, ms(1000))
        .build()
        .unwrap();
    let mut ran = 0;
    for _ in 0..3 {
        let out = limiter
            .call(|| {
                ran += 1;
                async { Ok::<_, std::io::Error>(()) }
            })
            .await;
        if let Err(err) = out {
            assert!(matches!(
                err,
                PolicyError::Rejected(Rejected::RateLimited { .. })
            ));
            assert_eq!(err.class(), ErrorClass::Rejected);
            assert_eq!(err.retry_after(), Some(ms(1000)));
        }
    }
    assert_eq!(ran, 1, "refused calls never reach the dependency");
}

#[tokio::test(start_paused = true)]
async fn each_key_has_its_own_limit() {
    let per_client: KeyedRateLimiter<&'static str> = RateLimiter::builder("api")
        .rate(2, ms(1000))
        .build_keyed()
        .unwrap();
    per_client.check_key(&"noisy").unwrap();
    per_client.check_key(&"noisy").unwrap();
    assert_eq!(retry_after(per_client.check_key(&"noisy")), ms(500));
    assert!(per_client.check_key(&"quiet").is_ok());
    assert!(per_client.check_key(&"quiet").is_ok());
    advance(ms(500)).await;
    assert!(per_client.check_key(&"noisy").is_ok());
    let waited = per_client.acquire_key(&"noisy");
    let started = clock::now();
    waited.await.unwrap();
    assert_eq!(clock::now() - started, ms(500));
}

#[tokio::test(start_paused = true)]
async fn a_flood_of_distinct_keys_stays_within_max_keys() {
    let per_client: KeyedRateLimiter<u64> = RateLimiter::builder("api")
        .rate(1, ms(1000))
        .max_keys(1_000)
        .build_keyed()
        .unwrap();
    per_client.check_key(&0).unwrap();
    let mut admitted = 0;
    for key in 1..100_000u64 {
        if per_client.check_key(&key).is_ok() {
            admitted += 1;
        }
        assert!(per_client.len() <= 1_000);
    }
    // 999 keys fit in the table; all the others shared one overflow limit,
    // which let exactly one call through.
    assert_eq!(admitted, 999 + 1);
    assert!(
        per_client.check_key(&0).is_err(),
        "a tracked key keeps its own state"
    );
    advance(ms(1000)).await;
    assert!(per_client.check_key(&0).is_ok());
    // governor forgets a key one emission interval after it has refilled.
    advance(ms(1000)).await;
    per_client.evict_idle();
    assert_eq!(per_client.len(), 1, "refilled keys are forgotten");
    advance(ms(1000)).await;
    per_client.evict_idle();
    assert!(per_client.is_empty());
}

#[tokio::test(start_paused = true)]
async fn memory_follows_the_live_keys_not_every_key_ever_seen() {
    let per_client: KeyedRateLimiter<u64> = RateLimiter::builder("api")
        .rate(1, ms(1000))
        .build_keyed()
        .unwrap();
    let mut peak = 0;
    for key in 0..100_000u64 {
        per_client.check_key(&key).unwrap();
        peak = peak.max(per_client.len());
        advance(Duration::from_micros(1_000)).await;
    }
    // About 2 000 keys are live at any time (1 per ms, each kept until one
    // interval after it refilled: 2 s), plus at most one eviction interval
    // (max_keys / 8 = 12 500) of new keys; not the 100 000 seen.
    assert!(peak <= 2_000 + 12_500, "peak {peak}");
}

#[tokio::test(start_paused = true)]
async fn the_tower_services_refuse_with_retry_after() {
    let limiter = RateLimiter::builder("api")
        .rate(1, ms(1000))
        .build()
        .unwrap();
    let echo = service_fn(|x: u32| async move { Ok::<_, std::io::Error>(x) });
    let mut service = RateLimitLayer::new(limiter).layer(echo);
    assert_eq!(service.ready().await.unwrap().call(1).await.unwrap(), 1);
    let err: BoxError = service.ready().await.unwrap().call(2).await.unwrap_err();
    assert_eq!(err.class(), ErrorClass::Rejected);
    assert_eq!(err.retry_after(), Some(ms(1000)));

    let per_client: KeyedRateLimiter<u32> = RateLimiter::builder("api")
        .rate(1, ms(1000))
        .build_keyed()
        .unwrap();
    let key_of = |req: &(u32, &'static str)| req.0;
    let mut keyed = KeyedRateLimitLayer::new(per_client, key_of).layer(service_fn(
        |req: (u32, &'static str)| async move { Ok::<_, std::io::Error>(req.1) },
    ));
    assert_eq!(
        keyed.ready().await.unwrap().call((1, "a")).await.unwrap(),
        "a"
    );
    assert!(keyed.ready().await.unwrap().call((1, "b")).await.is_err());
    assert_eq!(
        keyed.ready().await.unwrap().call((2, "c")).await.unwrap(),
        "c"
    );
}
#[path = "support/counting_alloc.rs"]
mod counting_alloc;
use counting_alloc::allocations_in;

#[test]
fn the_happy_path_does_not_allocate() {
    let limiter = RateLimiter::builder("api")
        .rate(1_000_000, ms(1))
        .build()
        .unwrap();
    let keyed: KeyedRateLimiter<u64> = RateLimiter::builder("api")
        .rate(1_000_000, ms(1))
        .build_keyed()
        .unwrap();
    keyed.check_key(&1).unwrap();
    let mut service = RateLimitLayer::new(limiter.clone()).layer(service_fn(|x: u32| async move {
        Ok::<_, std::io::Error>(x)
    }));
    let waker = futures_util::task::noop_waker();
    let mut cx = std::task::Context::from_waker(&waker);
    let n = allocations_in(|| {
        for _ in 0..100 {
            let out = limiter
                .call(|| async { Ok::<_, std::io::Error>(1) })
                .now_or_never();
            assert!(matches!(out, Some(Ok(1))));
            let out = keyed
                .call(&1, || async { Ok::<_, std::io::Error>(1) })
                .now_or_never();
            assert!(matches!(out, Some(Ok(1))));
            assert!(service.poll_ready(&mut cx).is_ready());
            assert!(matches!(service.call(1).now_or_never(), Some(Ok(1))));
        }
    });
    assert_eq!(n, 0);
}
