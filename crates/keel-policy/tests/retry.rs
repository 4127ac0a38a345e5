//! Retry behaviour with paused time: what is retried, when, and when retries
//! stop to protect the dependency.
#![cfg(feature = "retry")]

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use keel_core::clock::{self, Instant};
use keel_core::{BoxError, Classified, Classify, Deadline, ErrorClass, PolicyError, Rejected};
use keel_policy::retry::{Backoff, Jitter, Retry, RetryBudget, RetryLayer, Verdict};
use parking_lot::Mutex;
use tower::{Layer, Service, ServiceBuilder, ServiceExt};

const MS: Duration = Duration::from_millis(1);

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
enum Fail {
    #[error("connection refused")]
    Transient,
    #[error("bad request")]
    Permanent,
    #[error("timed out after sending")]
    Unknown,
    #[error("slow down")]
    SlowDown(Duration),
}

impl Classify for Fail {
    fn class(&self) -> ErrorClass {
        match self {
            Self::Transient | Self::SlowDown(_) => ErrorClass::Retryable,
            Self::Permanent => ErrorClass::Permanent,
            Self::Unknown => ErrorClass::OutcomeUnknown,
        }
    }

    fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::SlowDown(after) => Some(*after),
            _ => None,
        }
    }
}

fn exact(base: Duration, factor: f64) -> Backoff {
    Backoff::exponential(base, factor, Duration::from_secs(10))
        .and_then(|b| b.with_jitter(Jitter::None))
        .unwrap()
}

/// A dependency that records when it was called and answers from a script
/// (the last answer repeats).
#[derive(Clone)]
struct Dependency<T> {
    calls: Arc<Mutex<Vec<Instant>>>,
    script: Arc<Vec<Result<T, Fail>>>,
}

impl<T: Clone> Dependency<T> {
    fn new(script: Vec<Result<T, Fail>>) -> Self {
        Self {
            calls: Arc::default(),
            script: Arc::new(script),
        }
    }

    fn failing(error: Fail) -> Self {
        Self::new(vec![Err(error)])
    }

    fn call(&self) -> impl Future<Output = Result<T, Fail>> + use<T> {
        let mut calls = self.calls.lock();
        calls.push(clock::now());
        let index = (calls.len() - 1).min(self.script.len() - 1);
        let answer = self.script[index].clone();
        async move { answer }
    }

    fn count(&self) -> usize {
        self.calls.lock().len()
    }

    fn gaps(&self) -> Vec<Duration> {
        self.calls.lock().windows(2).map(|w| w[1] - w[0]).collect()
    }
}

#[tokio::test(start_paused = true)]
async fn waits_the_exact_backoff_sequence() {
    let delays = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&delays);
    let retry = Retry::builder("dep")
        .max_attempts(5)
        .backoff(exact(MS * 100, 2.0))
        .on_retry(move |event| seen.lock().push((event.attempt, event.delay)))
        .build()
        .unwrap();
    let dep = Dependency::<u32>::failing(Fail::Transient);
    let result = retry.call(|| dep.call()).await;
    assert_eq!(result, Err(PolicyError::Inner(Fail::Transient)));
    assert_eq!(dep.gaps(), [MS * 100, MS * 200, MS * 400, MS * 800]);
    assert_eq!(
        *delays.lock(),
        [(2, MS * 100), (3, MS * 200), (4, MS * 400), (5, MS * 800)]
    );
}

#[tokio::test(start_paused = true)]
async fn succeeds_once_the_dependency_recovers() {
    let retry = Retry::builder("dep")
        .backoff(exact(MS * 10, 2.0))
        .build()
        .unwrap();
    let dep = Dependency::new(vec![Err(Fail::Transient), Ok(7)]);
    assert_eq!(retry.call(|| dep.call()).await, Ok(7));
    assert_eq!(dep.count(), 2);
}

#[tokio::test(start_paused = true)]
async fn permanent_errors_are_never_retried() {
    let retry = Retry::builder("dep").max_attempts(10).build().unwrap();
    let dep = Dependency::<u32>::failing(Fail::Permanent);
    assert_eq!(
        retry.call(|| dep.call()).await,
        Err(PolicyError::Inner(Fail::Permanent))
    );
    assert_eq!(dep.count(), 1);
}

/// An error type Keel has never heard of: no `Classify`, no `Classified`.
#[derive(Debug, thiserror::Error)]
#[error("the dependency did something nobody foresaw")]
struct Unforeseen;

#[tokio::test(start_paused = true)]
async fn errors_nobody_classified_are_never_retried() {
    let retry = Retry::builder("dep")
        .max_attempts(10)
        .retry_outcome_unknown(true)
        .build()
        .unwrap();
    let calls = AtomicU32::new(0);
    let result = retry
        .call(|| async {
            calls.fetch_add(1, Ordering::SeqCst);
            Err::<u32, BoxError>(Box::new(Unforeseen))
        })
        .await;
    let err = result.unwrap_err().into_inner().expect("the error itself");
    assert!(err.is::<Unforeseen>());
    assert_eq!(err.class(), ErrorClass::Unclassified);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        1,
        "not known to be safe: not repeated, even for an idempotent call"
    );

    // The tower form reads the same class from the boxed error.
    let tower_calls = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&tower_calls);
    let inner = tower::service_fn(move |_: ()| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Err::<u32, BoxError>(Box::new(Unforeseen)) }
    });
    let err = retry.layer().layer(inner).oneshot(()).await.unwrap_err();
    assert!(err.is::<Unforeseen>());
    assert_eq!(tower_calls.load(Ordering::SeqCst), 1);
}

#[cfg(feature = "http")]
#[tokio::test(start_paused = true)]
async fn http_responses_are_retried_by_status_with_http_verdict() {
    use keel_policy::retry::http_verdict;

    let retried = |status: u16, idempotent: bool| async move {
        let retry = Retry::builder("dep")
            .max_attempts(3)
            .backoff(exact(MS * 10, 1.0))
            .retry_outcome_unknown(idempotent)
            .retry_on_result(http_verdict::<()>)
            .build()
            .unwrap();
        let calls = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&calls);
        let started = clock::now();
        let inner = tower::service_fn(move |_: ()| {
            counted.fetch_add(1, Ordering::SeqCst);
            let response = http::Response::builder()
                .status(status)
                .header("retry-after", "1")
                .body(())
                .unwrap();
            async move { Ok::<_, BoxError>(response) }
        });
        let response = retry.layer().layer(inner).oneshot(()).await.unwrap();
        assert_eq!(response.status(), status, "the last response is returned");
        (calls.load(Ordering::SeqCst), clock::now() - started)
    };
    // Not processed: retried, no sooner than Retry-After.
    assert_eq!(retried(503, false).await, (3, Duration::from_secs(2)));
    assert_eq!(retried(429, false).await, (3, Duration::from_secs(2)));
    // May have been processed: only an idempotent call is repeated.
    assert_eq!(retried(500, false).await.0, 1);
    assert_eq!(retried(500, true).await.0, 3);
    assert_eq!(retried(504, false).await.0, 1);
    // The caller's own fault, or a success: never repeated.
    assert_eq!(retried(404, true).await.0, 1);
    assert_eq!(retried(422, true).await.0, 1);
    assert_eq!(retried(200, true).await.0, 1);
}

#[cfg(feature = "http")]
#[tokio::test(start_paused = true)]
async fn grpc_statuses_are_retried_by_class_after_the_servers_pushback() {
    use keel_policy::retry::grpc_verdict;

    let retried = |code: &'static str, pushback: Option<&'static str>, idempotent: bool| async move {
        let retry = Retry::builder("dep")
            .max_attempts(3)
            .backoff(exact(MS * 10, 1.0))
            .retry_outcome_unknown(idempotent)
            .retry_on_result(grpc_verdict::<()>)
            .build()
            .unwrap();
        let calls = Arc::new(AtomicU32::new(0));
        let counted = Arc::clone(&calls);
        let started = clock::now();
        let inner = tower::service_fn(move |_: ()| {
            counted.fetch_add(1, Ordering::SeqCst);
            let mut response = http::Response::builder().header("grpc-status", code);
            if let Some(ms) = pushback {
                response = response.header("grpc-retry-pushback-ms", ms);
            }
            let response = response.body(()).unwrap();
            async move { Ok::<_, BoxError>(response) }
        });
        retry.layer().layer(inner).oneshot(()).await.unwrap();
        (calls.load(Ordering::SeqCst), clock::now() - started)
    };
    // UNAVAILABLE: retried, no sooner than the pushback.
    assert_eq!(retried("14", Some("500"), false).await, (3, MS * 1000));
    assert_eq!(retried("8", None, false).await, (3, MS * 20));
    // A pushback that is not a number: the server said not to retry.
    assert_eq!(retried("14", Some("never"), false).await.0, 1);
    // DEADLINE_EXCEEDED may have taken effect: only idempotent calls.
    assert_eq!(retried("4", None, false).await.0, 1);
    assert_eq!(retried("4", None, true).await.0, 3);
    // The caller's own fault, and OK: never repeated.
    assert_eq!(retried("5", None, true).await.0, 1);
    assert_eq!(retried("3", None, true).await.0, 1);
    assert_eq!(retried("0", None, true).await.0, 1);
}

#[tokio::test(start_paused = true)]
async fn refusals_of_other_policies_are_not_retried() {
    let retry = Retry::builder("dep").max_attempts(10).build().unwrap();
    let calls = AtomicU32::new(0);
    let open = Rejected::circuit_open("dep", MS);
    let result = retry
        .call(|| {
            calls.fetch_add(1, Ordering::Relaxed);
            let open = open.clone();
            async move { Err::<(), _>(open) }
        })
        .await;
    assert!(matches!(
        result,
        Err(PolicyError::Inner(Rejected::CircuitOpen { .. }))
    ));
    assert_eq!(calls.load(Ordering::Relaxed), 1);
}

#[tokio::test(start_paused = true)]
async fn unknown_outcomes_are_retried_only_when_idempotent() {
    let dep = Dependency::<u32>::failing(Fail::Unknown);
    let retry = Retry::builder("dep")
        .backoff(exact(MS, 1.0))
        .build()
        .unwrap();
    assert_eq!(
        retry.call(|| dep.call()).await,
        Err(PolicyError::Inner(Fail::Unknown))
    );
    assert_eq!(
        dep.count(),
        1,
        "a non-idempotent call may have taken effect"
    );

    let dep = Dependency::<u32>::failing(Fail::Unknown);
    let idempotent = Retry::builder("dep")
        .backoff(exact(MS, 1.0))
        .retry_outcome_unknown(true)
        .build()
        .unwrap();
    assert_eq!(
        idempotent.call(|| dep.call()).await,
        Err(PolicyError::Inner(Fail::Unknown))
    );
    assert_eq!(dep.count(), 3);
}

/// After an attempt of unknown outcome, later attempts that only say
/// *they* did nothing (a `503` until the attempts run out) do not hide it:
/// the call returns the unknown outcome. A permanent answer settles the
/// call and is returned as it is, and so is a success.
#[tokio::test(start_paused = true)]
async fn an_attempt_that_may_have_applied_is_not_hidden_by_later_ones() {
    let idempotent = || {
        Retry::builder("dep")
            .backoff(exact(MS, 1.0))
            .max_attempts(3)
            .retry_outcome_unknown(true)
            .build()
            .unwrap()
    };
    let cases = [
        (
            vec![Err(Fail::Unknown), Err(Fail::Transient)],
            Err(Fail::Unknown),
        ),
        (
            vec![Err(Fail::Unknown), Err(Fail::Permanent)],
            Err(Fail::Permanent),
        ),
        (vec![Err(Fail::Unknown), Ok(7)], Ok(7)),
        (vec![Err(Fail::Transient)], Err(Fail::Transient)),
    ];
    for (script, expected) in cases {
        let dep = Dependency::<u32>::new(script.clone());
        let result = idempotent().call(|| dep.call()).await;
        assert_eq!(result, expected.map_err(PolicyError::Inner), "{script:?}");
    }

    // Nor does an empty budget answer "refused" for a call that was sent.
    let retry = Retry::builder("dep")
        .budget(
            RetryBudget::builder("dep")
                .min_per_sec(0.0)
                .build()
                .unwrap(),
        )
        .reject_on_budget_exhausted(true)
        .retry_outcome_unknown(true)
        .build()
        .unwrap();
    let dep = Dependency::<u32>::failing(Fail::Unknown);
    assert_eq!(
        retry.call(|| dep.call()).await,
        Err(PolicyError::Inner(Fail::Unknown))
    );
}

#[tokio::test(start_paused = true)]
async fn retry_after_is_honoured_when_longer_than_the_backoff() {
    let retry = Retry::builder("dep")
        .backoff(exact(MS * 100, 2.0))
        .build()
        .unwrap();
    let dep = Dependency::new(vec![
        Err(Fail::SlowDown(Duration::from_secs(3))),
        Err(Fail::SlowDown(MS * 10)),
        Ok(1),
    ]);
    assert_eq!(retry.call(|| dep.call()).await, Ok(1));
    assert_eq!(
        dep.gaps(),
        [Duration::from_secs(3), MS * 200],
        "max(backoff, Retry-After)"
    );
}

#[tokio::test(start_paused = true)]
async fn retry_after_beyond_the_bound_gives_up_at_once() {
    let retry = Retry::builder("dep")
        .retry_after_max(Duration::from_secs(30))
        .build()
        .unwrap();
    let dep = Dependency::<u32>::failing(Fail::SlowDown(Duration::from_secs(60)));
    let start = clock::now();
    let result = retry.call(|| dep.call()).await;
    assert_eq!(
        result,
        Err(PolicyError::Inner(Fail::SlowDown(Duration::from_secs(60))))
    );
    assert_eq!(dep.count(), 1, "neither ignored nor waited for");
    assert_eq!(clock::now(), start);
}

#[tokio::test(start_paused = true)]
async fn deadline_stops_retries_before_sleeping_past_it() {
    let retry = Retry::builder("dep")
        .max_attempts(10)
        .backoff(exact(MS * 400, 1.0))
        .build()
        .unwrap();
    let dep = Dependency::<u32>::failing(Fail::Transient);
    let start = clock::now();
    let deadline = Deadline::after(Duration::from_secs(1));
    let result = deadline.scope(retry.call(|| dep.call())).await;
    assert_eq!(
        result,
        Err(PolicyError::Inner(Fail::Transient)),
        "the last error, not a new one"
    );
    // Attempts at 0, 400 and 800 ms; at 800 ms, 400 ms + 50 ms no longer fit in the 200 ms left.
    assert_eq!(dep.count(), 3);
    assert_eq!(clock::now() - start, MS * 800);
}

#[tokio::test(start_paused = true)]
async fn mesh_rule_two_attempts_of_700ms_fit_in_2s() {
    let retry = Retry::builder("orders").max_attempts(2).build().unwrap();
    let attempts = AtomicU32::new(0);
    let start = clock::now();
    let per_try = |succeed: bool| {
        let n = attempts.fetch_add(1, Ordering::Relaxed);
        async move {
            let work = async move {
                if n == 0 || !succeed {
                    std::future::pending::<()>().await;
                }
                Ok::<_, Fail>("order")
            };
            tokio::time::timeout(MS * 700, work)
                .await
                .map_err(|_| Fail::Transient)?
        }
    };
    let deadline = Deadline::after(Duration::from_secs(2));
    let result = deadline.scope(retry.call(|| per_try(true))).await;
    assert_eq!(result, Ok("order"));
    assert_eq!(attempts.load(Ordering::Relaxed), 2);
    assert!(clock::now() - start < Duration::from_secs(2) - MS * 50);

    attempts.store(0, Ordering::Relaxed);
    let start = clock::now();
    let deadline = Deadline::after(Duration::from_secs(2));
    let result = deadline.scope(retry.call(|| per_try(false))).await;
    assert_eq!(result, Err(PolicyError::Inner(Fail::Transient)));
    assert_eq!(
        attempts.load(Ordering::Relaxed),
        2,
        "the second try started in time"
    );
    assert!(
        clock::now() - start <= MS * 1600,
        "700 + ≤200 backoff + 700 ms"
    );
}

#[tokio::test(start_paused = true)]
async fn budget_stops_retries_during_a_widespread_outage() {
    const REQUESTS: u32 = 2_000;
    const RATIO: f64 = 0.1;
    const MIN_PER_SEC: f64 = 10.0;
    let budget = RetryBudget::builder("dep")
        .ratio(RATIO)
        .min_per_sec(MIN_PER_SEC)
        .build()
        .unwrap();
    let retry = Retry::builder("dep")
        .max_attempts(3)
        .backoff(exact(MS * 50, 2.0))
        .budget(budget)
        .build()
        .unwrap();
    let dependency_calls = Arc::new(AtomicU32::new(0));
    let start = clock::now();
    let mut callers = tokio::task::JoinSet::new();
    for _ in 0..REQUESTS {
        let (retry, calls) = (retry.clone(), Arc::clone(&dependency_calls));
        callers.spawn(async move {
            retry
                .call(|| {
                    calls.fetch_add(1, Ordering::Relaxed);
                    async { Err::<(), _>(Fail::Transient) }
                })
                .await
        });
        tokio::time::sleep(MS * 5).await; // 200 requests per second, for 10 s
    }
    while let Some(result) = callers.join_next().await {
        assert_eq!(result.unwrap(), Err(PolicyError::Inner(Fail::Transient)));
    }
    let elapsed = (clock::now() - start).as_secs_f64();
    let calls = f64::from(dependency_calls.load(Ordering::Relaxed));
    let bound = f64::from(REQUESTS) * (1.0 + RATIO) + MIN_PER_SEC * elapsed + MIN_PER_SEC;
    assert!(calls <= bound, "{calls} calls > {bound}");
    assert!(
        calls < f64::from(REQUESTS) * 1.25,
        "naive retries would make {}",
        REQUESTS * 3
    );
}

#[tokio::test(start_paused = true)]
async fn an_exhausted_budget_can_answer_with_a_refusal() {
    let budget = RetryBudget::builder("dep")
        .min_per_sec(0.0)
        .build()
        .unwrap();
    let retry = Retry::builder("dep")
        .budget(budget)
        .reject_on_budget_exhausted(true)
        .build()
        .unwrap();
    let dep = Dependency::<u32>::failing(Fail::Transient);
    let result = retry.call(|| dep.call()).await;
    assert_eq!(
        result,
        Err(PolicyError::Rejected(Rejected::BudgetExhausted {
            name: "dep".into()
        }))
    );
    assert_eq!(dep.count(), 1);
}

#[tokio::test(start_paused = true)]
async fn results_can_be_retried_by_a_predicate() {
    let retry = Retry::builder("web")
        .backoff(exact(MS * 10, 2.0))
        .retry_on_result(|status: &u16| *status == 503)
        .build()
        .unwrap();
    let dep = Dependency::new(vec![Ok(503), Ok(503), Ok(200)]);
    assert_eq!(retry.call(|| dep.call()).await, Ok(200));
    assert_eq!(dep.count(), 3);

    let down = Dependency::new(vec![Ok(503u16)]);
    assert_eq!(
        retry.call(|| down.call()).await,
        Ok(503),
        "the last result, as it is"
    );
    assert_eq!(down.count(), 3);
}

#[tokio::test(start_paused = true)]
async fn a_result_predicate_can_carry_retry_after() {
    let retry = Retry::builder("web")
        .backoff(exact(MS * 10, 2.0))
        .retry_on_result(|status: &u16| match status {
            503 => Verdict::retry_after(Duration::from_secs(2)),
            _ => Verdict::Accept,
        })
        .build()
        .unwrap();
    let dep = Dependency::new(vec![Ok(503), Ok(200)]);
    assert_eq!(retry.call(|| dep.call()).await, Ok(200));
    assert_eq!(dep.gaps(), [Duration::from_secs(2)]);
}

#[tokio::test(start_paused = true)]
async fn an_error_predicate_replaces_classification() {
    let retry = Retry::builder("dep")
        .backoff(exact(MS, 1.0))
        .retry_if(|e: &Fail| *e == Fail::Permanent)
        .build()
        .unwrap();
    let dep = Dependency::<u32>::new(vec![Err(Fail::Permanent), Ok(1)]);
    assert_eq!(retry.call(|| dep.call()).await, Ok(1));
    let dep = Dependency::<u32>::failing(Fail::Transient);
    assert_eq!(
        retry.call(|| dep.call()).await,
        Err(PolicyError::Inner(Fail::Transient))
    );
    assert_eq!(dep.count(), 1);
}

#[tokio::test(start_paused = true)]
async fn seeded_jitter_is_reproducible_and_bounded() {
    let run = |seed| async move {
        let retry = Retry::builder("dep")
            .max_attempts(6)
            .seed(seed)
            .build()
            .unwrap();
        let dep = Dependency::<u32>::failing(Fail::Transient);
        let _ = retry.call(|| dep.call()).await;
        dep.gaps()
    };
    let (a, b) = (run(1).await, run(1).await);
    assert_eq!(a, b);
    assert_ne!(a, run(2).await);
    for (n, gap) in a.iter().enumerate() {
        assert!(
            *gap <= MS * 200 * 2u32.pow(u32::try_from(n).unwrap()),
            "full jitter stays under the nominal delay"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn tower_service_retries_with_boxed_errors() {
    let calls = Arc::new(AtomicU32::new(0));
    let counter = Arc::clone(&calls);
    let inner = tower::service_fn(move |request: u32| {
        let n = counter.fetch_add(1, Ordering::Relaxed);
        async move {
            if n < 2 {
                Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused))
            } else {
                Ok(request * 2)
            }
        }
    });
    let retry = Retry::builder("svc")
        .backoff(exact(MS * 10, 2.0))
        .build()
        .unwrap();
    let mut service = ServiceBuilder::new()
        .layer(RetryLayer::new(retry.clone()))
        .service(inner);
    let response = service.ready().await.unwrap().call(21).await.unwrap();
    assert_eq!(response, 42);
    assert_eq!(calls.load(Ordering::Relaxed), 3);

    let permanent =
        tower::service_fn(|_: u32| async { Err::<u32, BoxError>("no such order".into()) });
    let mut service = retry.layer().layer(permanent);
    let error = service.ready().await.unwrap().call(1).await.unwrap_err();
    assert_eq!(error.to_string(), "no such order");
}

#[tokio::test(start_paused = true)]
async fn tower_service_reports_budget_refusals_as_boxed_rejected() {
    let budget = RetryBudget::builder("svc")
        .min_per_sec(0.0)
        .build()
        .unwrap();
    let retry = Retry::builder("svc")
        .budget(budget)
        .reject_on_budget_exhausted(true)
        .build()
        .unwrap();
    let inner = tower::service_fn(|_: ()| async { Err::<(), _>(Classified::retryable("refused")) });
    let error = retry.layer().layer(inner).oneshot(()).await.unwrap_err();
    let rejected = error.downcast_ref::<Rejected>().expect("a boxed refusal");
    assert_eq!(rejected.kind(), "budget_exhausted");
}
