//! Behaviour of the fallback policy: which failures get a degraded answer,
//! which must not, and that every one served is counted.
#![cfg(feature = "fallback")]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use keel_core::{BoxError, Classified, ErrorClass, PolicyError, Rejected};
use keel_policy::fallback::{Fallback, FallbackConfig};
use keel_testkit::metrics::MetricsRecorder;
use tower::{Layer, Service, ServiceExt, service_fn};

type Error = PolicyError<Classified>;

fn circuit_open() -> Error {
    PolicyError::Rejected(Rejected::circuit_open("pricing", Duration::from_secs(5)))
}

/// A dependency behind a refusing gate (what an open breaker does): the gate
/// answers, the dependency is never called.
struct Dependency {
    calls: AtomicUsize,
    gate_open: bool,
}

impl Dependency {
    async fn price(&self) -> Result<u32, Error> {
        if !self.gate_open {
            return Err(circuit_open());
        }
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(2500)
    }
}

#[tokio::test]
async fn a_breaker_rejection_is_served_the_fallback() {
    let counters = MetricsRecorder::new();
    let fallback =
        metrics::with_local_recorder(&counters, || Fallback::builder("pricing").build()).unwrap();
    let dependency = Dependency {
        calls: AtomicUsize::new(0),
        gate_open: false,
    };
    let cached_price = 1999;
    let mut seen = None;
    let price = fallback
        .call(
            || dependency.price(),
            |err| {
                seen = Some(err.rejected().map(Rejected::kind));
                async move { Ok(cached_price) }
            },
        )
        .await;
    assert_eq!(price.unwrap(), cached_price);
    assert_eq!(
        seen,
        Some(Some("circuit_open")),
        "the fallback receives the error"
    );
    assert_eq!(dependency.calls.load(Ordering::SeqCst), 0);
    assert_eq!(
        counters.counter("keel_fallback_total,name=pricing,class=rejected"),
        1
    );
}

#[tokio::test]
async fn a_permanent_error_passes_through() {
    let counters = MetricsRecorder::new();
    let fallback =
        metrics::with_local_recorder(&counters, || Fallback::builder("catalog").build()).unwrap();
    let served = AtomicUsize::new(0);
    let not_found = || async { Err::<u32, _>(Classified::permanent("404 sku not found")) };
    let result = fallback
        .call(not_found, |_| {
            served.fetch_add(1, Ordering::SeqCst);
            async { Ok(1) }
        })
        .await;
    let err = result.unwrap_err();
    assert_eq!(
        err.to_string(),
        "404 sku not found",
        "a 404 must not become cached data"
    );
    assert_eq!(served.load(Ordering::SeqCst), 0);
    assert_eq!(
        counters.counter("keel_fallback_total,name=catalog,class=permanent"),
        0
    );
}

#[tokio::test]
async fn a_deadline_exceeded_is_served() {
    let fallback = Fallback::builder("pricing").build().unwrap();
    let late = || async { Err::<u32, Error>(PolicyError::Rejected(Rejected::DeadlineExceeded)) };
    assert_eq!(fallback.call_or(late, 1999).await.unwrap(), 1999);
}

#[cfg(feature = "timeout")]
#[tokio::test(start_paused = true)]
async fn a_real_timeout_and_a_real_deadline_are_served() {
    use keel_core::Deadline;
    use keel_policy::timeout::Timeout;

    let fallback = Fallback::builder("pricing").build().unwrap();
    let timeout = Timeout::builder("pricing")
        .timeout(Duration::from_millis(700))
        .build()
        .unwrap();
    let hang = || std::future::pending::<Result<u32, std::io::Error>>();

    let timed_out = fallback.call_or(|| timeout.call(hang), 1999).await;
    assert_eq!(timed_out.unwrap(), 1999);

    let too_late = Deadline::after(Duration::from_millis(10))
        .scope(fallback.call_or(|| timeout.call(hang), 1999))
        .await;
    assert_eq!(too_late.unwrap(), 1999);
}

#[tokio::test]
async fn retryable_and_outcome_unknown_failures_are_served_and_counted_by_class() {
    let counters = MetricsRecorder::new();
    let fallback =
        metrics::with_local_recorder(&counters, || Fallback::builder("recs").build()).unwrap();
    let refused = || async { Err::<u32, _>(Classified::retryable("connection refused")) };
    let reset = || async { Err::<u32, _>(Classified::outcome_unknown("connection reset")) };
    assert_eq!(fallback.call_or(refused, 0).await.unwrap(), 0);
    assert_eq!(fallback.call_or(reset, 0).await.unwrap(), 0);
    assert_eq!(fallback.call_or(reset, 0).await.unwrap(), 0);
    assert_eq!(
        counters.counter("keel_fallback_total,name=recs,class=retryable"),
        1
    );
    assert_eq!(
        counters.counter("keel_fallback_total,name=recs,class=outcome_unknown"),
        2
    );
}

#[tokio::test]
async fn successes_are_untouched_and_the_fallback_may_fail_too() {
    let fallback = Fallback::builder("recs").build().unwrap();
    let ok = fallback
        .call(|| async { Ok::<_, Classified>(5) }, |_| async { Ok(0) })
        .await;
    assert_eq!(ok.unwrap(), 5);
    let still_failing = fallback
        .call(
            || async { Err::<u32, _>(Classified::retryable("primary down")) },
            |_| async { Err(Classified::retryable("cache down too")) },
        )
        .await;
    assert_eq!(still_failing.unwrap_err().to_string(), "cache down too");
}

#[tokio::test]
async fn classes_are_configurable() {
    let only_refusals = Fallback::builder("pricing")
        .classes([ErrorClass::Rejected])
        .build()
        .unwrap();
    assert!(!only_refusals.handles(ErrorClass::Retryable));
    let failing = || async { Err::<u32, _>(Classified::retryable("503")) };
    assert!(only_refusals.call_or(failing, 1).await.is_err());

    let everything = Fallback::builder("pricing")
        .classes([ErrorClass::Permanent, ErrorClass::Retryable])
        .build()
        .unwrap();
    let not_found = || async { Err::<u32, _>(Classified::permanent("404")) };
    assert_eq!(everything.call_or(not_found, 1).await.unwrap(), 1);
}

#[tokio::test]
async fn tower_layer_serves_refusals_and_passes_permanent_errors() {
    let fallback = Fallback::builder("pricing").build().unwrap();
    let layer = fallback.layer(|err: BoxError| {
        assert!(err.is::<Rejected>());
        Ok::<u32, BoxError>(1999)
    });
    let mut svc = layer.layer(service_fn(|sku: &'static str| async move {
        match sku {
            "open" => Err::<u32, BoxError>(circuit_open().rejected().cloned().unwrap().into()),
            "missing" => Err(Classified::permanent("404").into()),
            _ => Ok(2500),
        }
    }));
    assert_eq!(svc.ready().await.unwrap().call("ok").await.unwrap(), 2500);
    assert_eq!(svc.ready().await.unwrap().call("open").await.unwrap(), 1999);
    let err = svc
        .ready()
        .await
        .unwrap()
        .call("missing")
        .await
        .unwrap_err();
    assert_eq!(
        keel_core::error::classify(err.as_ref()),
        ErrorClass::Permanent
    );
}

#[test]
fn config_reads_class_names_and_rejects_nonsense() {
    let config: FallbackConfig =
        serde_json::from_str(r#"{"classes":["rejected","permanent"]}"#).unwrap();
    let policy = config.build("p").unwrap();
    assert!(policy.handles(ErrorClass::Permanent));
    assert!(!policy.handles(ErrorClass::Retryable));
    assert!(
        !FallbackConfig::default()
            .build("p")
            .unwrap()
            .handles(ErrorClass::Permanent)
    );
    assert!(serde_json::from_str::<FallbackConfig>(r#"{"class":["rejected"]}"#).is_err());
    assert!(serde_json::from_str::<FallbackConfig>(r#"{"classes":["sometimes"]}"#).is_err());
    let empty: FallbackConfig = serde_json::from_str(r#"{"classes":[]}"#).unwrap();
    assert_eq!(empty.build("p").unwrap_err().field, "classes");
}
