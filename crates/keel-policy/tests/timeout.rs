//! Behaviour of the timeout policy: limits, deadlines, refusals, cancellation
//! and the "2 x 700ms must fit in 2s" rule.
#![cfg(feature = "timeout")]

use std::future::pending;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use keel_core::clock;
use keel_core::{BoxError, Deadline, PolicyError, Rejected};
use keel_policy::timeout::{Timeout, TimeoutConfig};
use keel_testkit::metrics::MetricsRecorder;
use tokio::time::{advance, sleep};
use tower::{Layer, Service, ServiceBuilder, ServiceExt, service_fn};

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn timeout(name: &str, limit: Duration) -> Timeout {
    Timeout::builder(name).timeout(limit).build().unwrap()
}

/// Sets a flag when dropped: proves the operation was cancelled.
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

type Result<T> = std::result::Result<T, PolicyError<std::io::Error>>;

#[tokio::test(start_paused = true)]
async fn fast_calls_pass_through_with_their_own_errors() {
    let t = timeout("pricing", ms(700));
    assert_eq!(
        t.call(|| async { Ok::<_, std::io::Error>(7) })
            .await
            .unwrap(),
        7
    );
    let err: Result<()> = t
        .call(|| async { Err(std::io::ErrorKind::ConnectionRefused.into()) })
        .await;
    assert!(
        matches!(err, Err(PolicyError::Inner(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused)
    );
}

#[tokio::test(start_paused = true)]
async fn a_slow_call_times_out_at_the_limit_and_is_cancelled() {
    let t = timeout("pricing", ms(700));
    let dropped = Arc::new(AtomicBool::new(false));
    let flag = DropFlag(dropped.clone());
    let start = clock::now();
    let result: Result<()> = t
        .call(|| async move {
            let _flag = flag;
            pending().await
        })
        .await;
    assert_eq!(clock::now() - start, ms(700));
    match result {
        Err(PolicyError::Rejected(Rejected::Timeout { name, after })) => {
            assert_eq!(&*name, "pricing");
            assert_eq!(after, ms(700));
        }
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(
        dropped.load(Ordering::SeqCst),
        "the operation must be dropped"
    );
}

#[tokio::test(start_paused = true)]
async fn a_closer_deadline_binds_and_reports_deadline_exceeded() {
    let t = timeout("pricing", ms(700));
    let start = clock::now();
    let result: Result<()> = Deadline::after(ms(300)).scope(t.call(pending)).await;
    assert_eq!(clock::now() - start, ms(300));
    assert!(matches!(
        result,
        Err(PolicyError::Rejected(Rejected::DeadlineExceeded))
    ));
}

#[tokio::test(start_paused = true)]
async fn too_little_time_left_means_the_operation_never_starts() {
    let t = timeout("pricing", ms(700));
    let started = AtomicUsize::new(0);
    let result: Result<()> = Deadline::after(ms(40))
        .scope(t.call(|| {
            started.fetch_add(1, Ordering::SeqCst);
            async { Ok(()) }
        }))
        .await;
    assert!(matches!(
        result,
        Err(PolicyError::Rejected(Rejected::DeadlineExceeded))
    ));
    assert_eq!(started.load(Ordering::SeqCst), 0, "do not even start");
}

#[tokio::test(start_paused = true)]
async fn min_time_to_start_is_configurable() {
    let t = Timeout::builder("pricing")
        .timeout(ms(700))
        .min_time_to_start(ms(200))
        .build()
        .unwrap();
    let refused: Result<()> = Deadline::after(ms(150))
        .scope(t.call(|| async { Ok(()) }))
        .await;
    assert!(matches!(
        refused,
        Err(PolicyError::Rejected(Rejected::DeadlineExceeded))
    ));
    let lenient = Timeout::builder("pricing")
        .min_time_to_start(Duration::ZERO)
        .build()
        .unwrap();
    let ran: Result<()> = Deadline::after(ms(1))
        .scope(lenient.call(|| async { Ok(()) }))
        .await;
    assert!(ran.is_ok());
}

#[tokio::test(start_paused = true)]
async fn the_operation_runs_under_the_timeout_as_its_deadline() {
    let t = timeout("orders", ms(2000));
    let expected = clock::now() + ms(2000);
    let seen: Result<Option<Deadline>> = t.call(|| async { Ok(Deadline::current()) }).await;
    assert_eq!(seen.unwrap().map(|d| d.instant()), Some(expected));

    let leaf = Timeout::builder("leaf")
        .propagate_deadline(false)
        .build()
        .unwrap();
    let unseen: Result<Option<Deadline>> = leaf.call(|| async { Ok(Deadline::current()) }).await;
    assert_eq!(unseen.unwrap(), None);
}

/// `timeout: 2s` around retries with `perTryTimeout: 700ms`: three attempts
/// at a hanging dependency with 100 ms between them. The total timeout's
/// deadline cuts the third attempt to the 400 ms that are left, so the whole
/// call ends at 2 s, never later.
#[tokio::test(start_paused = true)]
async fn two_times_700ms_must_fit_in_2s() {
    let total = timeout("orders-total", ms(2000));
    let per_try = timeout("orders-attempt", ms(700));
    let attempts = AtomicUsize::new(0);
    let mut errors = Vec::new();
    let start = clock::now();
    let (log, tries, per_try) = (&mut errors, &attempts, &per_try);
    let result: std::result::Result<(), PolicyError<PolicyError<std::io::Error>>> = total
        .call(|| async move {
            loop {
                tries.fetch_add(1, Ordering::SeqCst);
                let attempt: Result<()> = per_try.call(pending).await;
                let Err(err) = attempt else { return Ok(()) };
                let give_up = matches!(err, PolicyError::Rejected(Rejected::DeadlineExceeded));
                log.push((clock::now() - start, err));
                if give_up {
                    return Err(PolicyError::Rejected(Rejected::DeadlineExceeded));
                }
                sleep(ms(100)).await;
            }
        })
        .await;
    let elapsed = clock::now() - start;
    assert_eq!(elapsed, ms(2000), "the total cap holds");
    assert_eq!(attempts.load(Ordering::SeqCst), 3);
    assert!(matches!(
        result.map_err(PolicyError::flatten),
        Err(PolicyError::Rejected(Rejected::DeadlineExceeded))
    ));
    let ends: Vec<_> = errors.iter().map(|(at, _)| *at).collect();
    assert_eq!(ends, [ms(700), ms(1500), ms(2000)]);
    assert!(matches!(
        errors[0].1,
        PolicyError::Rejected(Rejected::Timeout { .. })
    ));
    assert!(matches!(
        errors[2].1,
        PolicyError::Rejected(Rejected::DeadlineExceeded)
    ));
}

/// Near the end of the total budget an attempt is not even started.
#[tokio::test(start_paused = true)]
async fn a_retry_with_too_little_budget_left_is_not_started() {
    let total = timeout("orders-total", ms(1000));
    let per_try = timeout("orders-attempt", ms(700));
    let calls = AtomicUsize::new(0);
    let _: Result<()> = total
        .call(|| async {
            sleep(ms(960)).await;
            per_try
                .call(|| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    async { Ok(()) }
                })
                .await
                .map_err(|e| match e {
                    PolicyError::Inner(e) => e,
                    PolicyError::Rejected(r) => std::io::Error::other(r),
                })
        })
        .await;
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

#[tokio::test(start_paused = true)]
async fn tower_layer_times_out_and_passes_responses() {
    let t = timeout("pricing", ms(700));
    let mut svc =
        ServiceBuilder::new()
            .layer(t.layer())
            .service(service_fn(|delay: u64| async move {
                sleep(ms(delay)).await;
                Ok::<_, BoxError>(delay)
            }));
    assert_eq!(svc.ready().await.unwrap().call(100).await.unwrap(), 100);
    let start = clock::now();
    let err = svc.ready().await.unwrap().call(5_000).await.unwrap_err();
    assert_eq!(clock::now() - start, ms(700));
    assert!(matches!(
        err.downcast_ref::<Rejected>(),
        Some(Rejected::Timeout { .. })
    ));
    assert_eq!(
        keel_core::error::classify(err.as_ref()),
        keel_core::ErrorClass::OutcomeUnknown
    );
}

#[tokio::test(start_paused = true)]
async fn tower_layer_cancels_the_inner_future_as_soon_as_the_limit_passes() {
    let dropped = Arc::new(AtomicBool::new(false));
    let flag = dropped.clone();
    let mut svc = timeout("pricing", ms(700))
        .layer()
        .layer(service_fn(move |()| {
            let flag = DropFlag(flag.clone());
            async move {
                let _flag = flag;
                pending::<std::result::Result<(), BoxError>>().await
            }
        }));
    let response = svc.ready().await.unwrap().call(());
    tokio::pin!(response);
    assert!(response.as_mut().await.is_err());
    assert!(
        dropped.load(Ordering::SeqCst),
        "cancelled before the caller drops the response future"
    );
}

/// The inner service sees the deadline both in `call` (where outgoing
/// headers are built) and while its future is polled.
#[tokio::test(start_paused = true)]
async fn tower_layer_propagates_the_deadline_into_call_and_poll() {
    let t = timeout("pricing", ms(700));
    let expected = Some(clock::now() + ms(700));
    let mut svc = t.layer().layer(service_fn(|()| {
        let in_call = Deadline::current().map(|d| d.instant());
        async move {
            tokio::task::yield_now().await;
            let in_poll = Deadline::current().map(|d| d.instant());
            Ok::<_, BoxError>((in_call, in_poll))
        }
    }));
    let (in_call, in_poll) = svc.ready().await.unwrap().call(()).await.unwrap();
    assert_eq!(in_call, expected);
    assert_eq!(in_poll, expected);
}

#[tokio::test(start_paused = true)]
async fn tower_layer_refuses_to_start_without_calling_the_inner_service() {
    let t = timeout("pricing", ms(700));
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let mut svc = t.layer().layer(service_fn(move |()| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, BoxError>(()) }
    }));
    let err = Deadline::after(ms(10))
        .scope(async { svc.ready().await.unwrap().call(()).await })
        .await
        .unwrap_err();
    assert!(matches!(
        err.downcast_ref::<Rejected>(),
        Some(Rejected::DeadlineExceeded)
    ));
    assert_eq!(calls.load(Ordering::SeqCst), 0);
}

/// Same behaviour as tower's own timeout on a slow call: both give up at the
/// limit; only the error type differs.
#[tokio::test(start_paused = true)]
async fn agrees_with_tower_timeout_on_when_to_give_up() {
    let slow = || {
        service_fn(|()| async {
            sleep(ms(5_000)).await;
            Ok::<_, BoxError>(())
        })
    };
    let mut keel = timeout("pricing", ms(700)).layer().layer(slow());
    let mut tower = tower::timeout::TimeoutLayer::new(ms(700)).layer(slow());
    let start = clock::now();
    let (a, b) = tokio::join!(
        keel.ready().await.unwrap().call(()),
        tower.ready().await.unwrap().call(())
    );
    assert_eq!(clock::now() - start, ms(700));
    assert!(a.unwrap_err().is::<Rejected>());
    assert!(b.unwrap_err().is::<tower::timeout::error::Elapsed>());
}

#[test]
fn config_round_trips_and_rejects_unknown_fields() {
    let config: TimeoutConfig =
        serde_json::from_str(r#"{"timeout":"700ms","min_time_to_start":"20ms"}"#).unwrap();
    assert_eq!(config.timeout, ms(700));
    assert_eq!(config.min_time_to_start, ms(20));
    assert!(config.propagate_deadline);
    let back: TimeoutConfig =
        serde_json::from_str(&serde_json::to_string(&config).unwrap()).unwrap();
    assert_eq!(back, config);
    assert!(serde_json::from_str::<TimeoutConfig>(r#"{"timout":"1s"}"#).is_err());
    assert_eq!(TimeoutConfig::default().timeout, Duration::from_secs(1));
}

#[test]
fn zero_timeout_is_rejected_from_config_and_builder() {
    let config = TimeoutConfig {
        timeout: Duration::ZERO,
        ..TimeoutConfig::default()
    };
    assert_eq!(config.build("t").unwrap_err().field, "timeout");
    assert_eq!(
        Timeout::builder("t")
            .timeout(Duration::ZERO)
            .build()
            .unwrap_err()
            .field,
        "timeout"
    );
}

#[tokio::test(start_paused = true)]
async fn an_elapsed_deadline_refuses_even_with_zero_minimum() {
    let t = Timeout::builder("t")
        .min_time_to_start(Duration::ZERO)
        .build()
        .unwrap();
    let deadline = Deadline::after(ms(10));
    advance(ms(20)).await;
    let r: Result<()> = deadline.scope(t.call(|| async { Ok(()) })).await;
    assert!(matches!(
        r,
        Err(PolicyError::Rejected(Rejected::DeadlineExceeded))
    ));
}

#[tokio::test(start_paused = true)]
async fn every_stop_is_counted_by_reason() {
    let counters = MetricsRecorder::new();
    let t = metrics::with_local_recorder(&counters, || timeout("pricing", ms(700)));
    let _: Result<()> = t.call(pending).await;
    let _: Result<()> = Deadline::after(ms(300)).scope(t.call(pending)).await;
    let _: Result<()> = Deadline::after(ms(10)).scope(t.call(pending)).await;
    let _: Result<()> = t.call(|| async { Ok(()) }).await;
    let key = |reason: &str| format!("keel_timeout_total,name=pricing,reason={reason}");
    assert_eq!(counters.counter(&key("timeout")), 1);
    assert_eq!(counters.counter(&key("deadline_exceeded")), 1);
    assert_eq!(counters.counter(&key("too_late_to_start")), 1);
}
