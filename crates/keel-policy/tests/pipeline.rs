//! The pipeline composes its policies in the order that protects the
//! dependency: these tests assert the protection, not just the result.
#![cfg(feature = "full")]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use keel_core::{Classified, PolicyError, Rejected};
use keel_policy::breaker::{CircuitBreaker, State};
use keel_policy::bulkhead::Bulkhead;
use keel_policy::fallback::Fallback;
use keel_policy::pipeline::{Pipeline, PipelineConfig};
use keel_policy::retry::{Backoff, Jitter, Retry};
use keel_policy::timeout::Timeout;
use tower::{Layer, Service, ServiceExt, service_fn};

fn timeout(name: &str, limit: Duration) -> Timeout {
    Timeout::builder(name.to_owned())
        .timeout(limit)
        .build()
        .unwrap()
}

fn no_jitter_retry(attempts: u32) -> Retry {
    let backoff = Backoff::exponential(Duration::from_millis(100), 2.0, Duration::from_secs(1))
        .unwrap()
        .with_jitter(Jitter::None)
        .unwrap();
    Retry::builder("payments")
        .max_attempts(attempts)
        .backoff(backoff)
        .build()
        .unwrap()
}

fn breaker(min_calls: u32) -> CircuitBreaker {
    CircuitBreaker::builder("payments")
        .minimum_calls(min_calls)
        .open_duration(Duration::from_secs(30))
        .open_duration_jitter(0.0)
        .build()
        .unwrap()
}

/// A dependency that always fails retryably, counting its calls.
fn failing(
    calls: &Arc<AtomicUsize>,
) -> impl FnMut() -> std::future::Ready<Result<u32, Classified>> + '_ {
    move || {
        calls.fetch_add(1, Ordering::SeqCst);
        std::future::ready(Err(Classified::retryable("connection refused")))
    }
}

#[tokio::test(start_paused = true)]
async fn an_open_breaker_stops_retries_and_the_fallback_is_served() {
    let payments = Pipeline::builder("payments")
        .retry(no_jitter_retry(3))
        .breaker(breaker(4))
        .fallback(Fallback::builder("payments").build().unwrap())
        .build()
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));

    // Two calls × (1 + 2 retries) reach the dependency until the breaker
    // has 4 failures; then it opens and refuses the rest.
    for _ in 0..2 {
        let _ = payments.call(failing(&calls)).await;
    }
    assert_eq!(payments.breaker().unwrap().state(), State::Open);
    let before = calls.load(Ordering::SeqCst);
    assert_eq!(
        before, 4,
        "the breaker opened on its 4th failure; the 6th attempt was refused"
    );

    for _ in 0..10 {
        let served = payments
            .call_or_else(failing(&calls), |_| async { Ok(7) })
            .await;
        assert_eq!(
            served.unwrap(),
            7,
            "the fallback answers while the breaker is open"
        );
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        before,
        "no call reached the sick dependency"
    );
    let refused = payments.call(failing(&calls)).await.unwrap_err();
    assert!(matches!(
        refused,
        PolicyError::Rejected(Rejected::CircuitOpen { .. })
    ));
}

#[tokio::test(start_paused = true)]
async fn the_total_timeout_bounds_retries_and_hung_attempts_count_as_failures() {
    let payments = Pipeline::builder("payments")
        .total_timeout(timeout("payments.total", Duration::from_secs(2)))
        .retry(no_jitter_retry(2).clone())
        .breaker(breaker(100))
        .attempt_timeout(timeout("payments.attempt", Duration::from_millis(700)))
        .build()
        .unwrap();
    let hanging = Arc::new(AtomicUsize::new(0));
    let start = tokio::time::Instant::now();
    let err = payments
        .call(|| {
            hanging.fetch_add(1, Ordering::SeqCst);
            std::future::pending::<Result<u32, Classified>>()
        })
        .await
        .unwrap_err();
    // A timed-out attempt's outcome is unknown: not retried unless the
    // operation is marked idempotent, and counted by the breaker.
    assert!(
        matches!(err, PolicyError::Rejected(Rejected::Timeout { .. })),
        "{err:?}"
    );
    assert_eq!(hanging.load(Ordering::SeqCst), 1);
    assert_eq!(start.elapsed(), Duration::from_millis(700));
    assert_eq!(payments.breaker().unwrap().metrics().failed_calls, 1);
}

#[tokio::test(start_paused = true)]
async fn idempotent_calls_retry_hung_attempts_within_the_total() {
    let retry = Retry::builder("search")
        .max_attempts(2)
        .retry_outcome_unknown(true)
        .backoff(
            Backoff::exponential(Duration::from_millis(100), 2.0, Duration::from_secs(1))
                .unwrap()
                .with_jitter(Jitter::None)
                .unwrap(),
        )
        .build()
        .unwrap();
    let search = Pipeline::builder("search")
        .total_timeout(timeout("search.total", Duration::from_secs(2)))
        .retry(retry)
        .attempt_timeout(timeout("search.attempt", Duration::from_millis(700)))
        .build()
        .unwrap();
    let attempts = AtomicUsize::new(0);
    let start = tokio::time::Instant::now();
    let result = search
        .call(|| {
            let n = attempts.fetch_add(1, Ordering::SeqCst);
            async move {
                if n == 0 {
                    std::future::pending::<()>().await;
                }
                Ok::<_, Classified>(n)
            }
        })
        .await;
    assert_eq!(result.unwrap(), 1);
    assert_eq!(
        start.elapsed(),
        Duration::from_millis(800),
        "700 ms attempt + 100 ms backoff"
    );
}

/// An idempotent call's first attempt is applied by the dependency but
/// answered after the attempt's timeout; the timeout opens the breaker,
/// which refuses the second attempt before it is sent. The call must not
/// say "refused, never sent" (a saga would then forget the step may have
/// happened and never compensate it): it returns the timeout, whose
/// outcome is unknown.
#[tokio::test(start_paused = true)]
async fn a_refused_retry_does_not_hide_an_attempt_that_may_have_applied() {
    let retry = Retry::builder("payments")
        .max_attempts(3)
        .retry_outcome_unknown(true)
        .build()
        .unwrap();
    let payments = Pipeline::builder("payments")
        .retry(retry)
        .breaker(breaker(1))
        .attempt_timeout(timeout("payments.attempt", Duration::from_millis(700)))
        .build()
        .unwrap();
    let applied = Arc::new(AtomicUsize::new(0));
    let result = payments
        .call(|| {
            let applied = applied.clone();
            async move {
                applied.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(1)).await;
                Ok::<_, Classified>(())
            }
        })
        .await;
    assert_eq!(applied.load(Ordering::SeqCst), 1, "one attempt was sent");
    assert_eq!(payments.breaker().unwrap().state(), State::Open);
    let error = result.unwrap_err();
    assert!(
        matches!(error, PolicyError::Rejected(Rejected::Timeout { .. })),
        "{error:?}"
    );
    assert_eq!(
        keel_core::Classify::class(&error),
        keel_core::ErrorClass::OutcomeUnknown
    );
}

/// The first attempt's timeout counts from the call's start (one clock read
/// for both timeouts); a later attempt's from when it starts, never from the
/// call's start.
#[tokio::test(start_paused = true)]
async fn each_attempt_sees_its_own_limit_from_when_it_starts() {
    let payments = Pipeline::builder("payments")
        .total_timeout(timeout("payments.total", Duration::from_secs(2)))
        .retry(no_jitter_retry(2))
        .attempt_timeout(timeout("payments.attempt", Duration::from_millis(700)))
        .build()
        .unwrap();
    let start = tokio::time::Instant::now();
    let seen = parking_lot::Mutex::new(Vec::new());
    let result = payments
        .call(|| async {
            let first = {
                let mut seen = seen.lock();
                seen.push(keel_core::Deadline::current().map(|d| d.instant() - start));
                seen.len() == 1
            };
            if first {
                tokio::time::sleep(Duration::from_millis(50)).await;
                return Err(Classified::retryable("connection reset"));
            }
            Ok(7)
        })
        .await;
    assert_eq!(result.unwrap(), 7);
    assert_eq!(
        *seen.lock(),
        [
            Some(Duration::from_millis(700)),
            Some(Duration::from_millis(50 + 100 + 700)),
        ],
        "the second attempt starts after 50 ms of the first and 100 ms of backoff"
    );
}

#[tokio::test(start_paused = true)]
async fn a_full_bulkhead_is_a_refusal_the_breaker_does_not_count() {
    let payments = Pipeline::builder("payments")
        .breaker(breaker(1))
        .bulkhead(
            Bulkhead::builder("payments")
                .max_concurrent(1)
                .build()
                .unwrap(),
        )
        .build()
        .unwrap();
    let gate = Arc::new(tokio::sync::Notify::new());
    let held = {
        let payments = payments.clone();
        let gate = gate.clone();
        tokio::spawn(async move {
            payments
                .call(|| async {
                    gate.notified().await;
                    Ok::<_, Classified>(1)
                })
                .await
        })
    };
    tokio::task::yield_now().await;
    let refused = payments
        .call(|| async { Ok::<_, Classified>(2) })
        .await
        .unwrap_err();
    assert!(matches!(
        refused,
        PolicyError::Rejected(Rejected::BulkheadFull { .. })
    ));
    assert_eq!(
        payments.breaker().unwrap().state(),
        State::Closed,
        "a refusal is not a dependency failure"
    );
    gate.notify_one();
    assert_eq!(held.await.unwrap().unwrap(), 1);
}

#[test]
fn attempts_that_cannot_fit_in_the_total_are_refused_at_build_time() {
    let err = Pipeline::builder("orders")
        .total_timeout(timeout("orders.total", Duration::from_secs(2)))
        .retry(no_jitter_retry(3))
        .attempt_timeout(timeout("orders.attempt", Duration::from_millis(700)))
        .build()
        .unwrap_err();
    assert_eq!(err.field, "attempt_timeout");
    assert!(err.reason.contains("2.1s"), "{err}");
}

#[test]
fn config_form_builds_the_same_pipeline() {
    let config: PipelineConfig = serde_json::from_value(serde_json::json!({
        "total_timeout": { "timeout": "2s" },
        "retry": { "max_attempts": 2 },
        "breaker": {},
        "attempt_timeout": { "timeout": "700ms" },
        "bulkhead": { "max_concurrent": 8 }
    }))
    .unwrap();
    let pipeline = config.build("orders").unwrap();
    assert_eq!(pipeline.total_limit(), Some(Duration::from_secs(2)));
    assert!(pipeline.breaker().is_some());
    let bad: Result<PipelineConfig, _> =
        serde_json::from_value(serde_json::json!({ "retries": {} }));
    assert!(bad.is_err(), "unknown fields are refused");
}

#[tokio::test(start_paused = true)]
async fn the_tower_layer_applies_the_same_policies() {
    let payments = Pipeline::builder("payments")
        .retry(no_jitter_retry(3))
        .breaker(breaker(2))
        .build()
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let mut service = payments.layer().layer(service_fn(move |_: ()| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Err::<u32, _>(Classified::retryable("down")) }
    }));
    let err = service.ready().await.unwrap().call(()).await.unwrap_err();
    assert!(
        err.downcast_ref::<Rejected>().is_some(),
        "the breaker opened during the retries: {err}"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 2);
}

/// An error type Keel has never heard of: no `Classify`, no `Classified`.
#[derive(Debug, thiserror::Error)]
#[error("the dependency did something nobody foresaw")]
struct Unforeseen;

#[tokio::test(start_paused = true)]
async fn an_unclassified_error_is_tried_once_and_trips_the_breaker() {
    let payments = Pipeline::builder("payments")
        .retry(no_jitter_retry(3))
        .breaker(breaker(4))
        .build()
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));

    // The plain API.
    for n in 1..=4 {
        let result = payments
            .call(|| async {
                calls.fetch_add(1, Ordering::SeqCst);
                Err::<u32, keel_core::BoxError>(Box::new(Unforeseen))
            })
            .await;
        let err = result.unwrap_err().into_inner().expect("the error itself");
        assert!(err.is::<Unforeseen>());
        assert_eq!(
            calls.load(Ordering::SeqCst),
            n,
            "one attempt per call: no retry"
        );
    }
    assert_eq!(payments.breaker().unwrap().state(), State::Open);

    // The tower form shares the breaker: refused at once, the dependency is
    // no longer called.
    let counted = calls.clone();
    let mut service = payments.layer().layer(service_fn(move |_: ()| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Err::<u32, keel_core::BoxError>(Box::new(Unforeseen)) }
    }));
    for _ in 0..10 {
        let err = service.ready().await.unwrap().call(()).await.unwrap_err();
        assert!(err.is::<Rejected>(), "{err}");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}

#[tokio::test(start_paused = true)]
async fn through_the_tower_layer_an_unclassified_error_is_tried_once_and_trips_the_breaker() {
    let payments = Pipeline::builder("payments")
        .retry(no_jitter_retry(3))
        .breaker(breaker(4))
        .build()
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let mut service = payments.layer().layer(service_fn(move |_: ()| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Err::<u32, keel_core::BoxError>(Box::new(Unforeseen)) }
    }));
    for n in 1..=4 {
        let err = service.ready().await.unwrap().call(()).await.unwrap_err();
        assert!(err.is::<Unforeseen>(), "{err}");
        assert_eq!(
            calls.load(Ordering::SeqCst),
            n,
            "one attempt per call: no retry"
        );
    }
    for _ in 0..10 {
        let err = service.ready().await.unwrap().call(()).await.unwrap_err();
        assert!(err.is::<Rejected>(), "{err}");
    }
    assert_eq!(
        calls.load(Ordering::SeqCst),
        4,
        "the open breaker stopped the calls"
    );
}

#[tokio::test(start_paused = true)]
async fn the_tower_layer_can_count_http_server_errors() {
    use keel_policy::breaker::HttpStatus;

    let payments = Pipeline::builder("payments")
        .retry(no_jitter_retry(3))
        .breaker(breaker(4))
        .build()
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let mut service = payments
        .layer_classifying(HttpStatus)
        .layer(service_fn(move |_: ()| {
            counted.fetch_add(1, Ordering::SeqCst);
            let response = http::Response::builder().status(502).body(()).unwrap();
            async move { Ok::<_, keel_core::BoxError>(response) }
        }));
    for _ in 0..4 {
        let response = service.ready().await.unwrap().call(()).await.unwrap();
        assert_eq!(response.status(), 502);
    }
    assert_eq!(payments.breaker().unwrap().state(), State::Open);
    let err = service.ready().await.unwrap().call(()).await.unwrap_err();
    assert!(err.is::<Rejected>(), "{err}");
    assert_eq!(calls.load(Ordering::SeqCst), 4);
}
