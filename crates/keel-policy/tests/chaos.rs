//! Behaviour of fault injection: only test traffic is touched, faults come
//! at the configured rate, and the other policies can be seen to react.
#![cfg(feature = "chaos")]

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use keel_core::{BoxError, ErrorClass, PolicyError, Rejected, clock, error::classify};
use keel_policy::chaos::{
    ChaosExperiment, EXPERIMENT_HEADER, FaultInjection, FaultInjectionConfig,
};
use keel_testkit::metrics::MetricsRecorder;
use tower::{Layer, Service, ServiceExt, service_fn};

const EXPERIMENT: &str = "pricing-latency";

/// The mesh example: every request in the experiment delayed 5 s, and
/// (separately here) aborted.
fn pricing_chaos() -> FaultInjection {
    FaultInjection::builder("pricing")
        .experiment(EXPERIMENT)
        .delay(100.0, Duration::from_secs(5))
        .abort(100.0)
        .enabled(true)
        .build()
        .unwrap()
}

/// A dependency that counts how often it is really called.
#[derive(Default)]
struct Pricing {
    calls: AtomicUsize,
}

impl Pricing {
    async fn price(&self) -> Result<u32, std::io::Error> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(2500)
    }
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

#[tokio::test(start_paused = true)]
async fn unscoped_traffic_never_sees_a_fault_even_at_100_percent() {
    let chaos = pricing_chaos();
    let pricing = Pricing::default();
    let start = clock::now();
    for _ in 0..100 {
        assert_eq!(chaos.call(|| pricing.price()).await.unwrap(), 2500);
    }
    let other_experiment =
        ChaosExperiment::scope("stock-errors", chaos.call(|| pricing.price())).await;
    assert_eq!(other_experiment.unwrap(), 2500);
    assert_eq!(clock::now(), start, "no delay for ordinary traffic");
    assert_eq!(pricing.calls(), 101);
}

#[tokio::test(start_paused = true)]
async fn scoped_traffic_gets_the_delay() {
    let chaos = FaultInjection::builder("pricing")
        .experiment(EXPERIMENT)
        .delay(100.0, Duration::from_secs(5))
        .enabled(true)
        .build()
        .unwrap();
    let pricing = Pricing::default();
    let start = clock::now();
    let price = ChaosExperiment::scope(EXPERIMENT, chaos.call(|| pricing.price())).await;
    assert_eq!(price.unwrap(), 2500);
    assert_eq!(clock::now() - start, Duration::from_secs(5));
    assert_eq!(pricing.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn scoped_traffic_gets_the_abort_and_the_dependency_is_not_called() {
    let counters = MetricsRecorder::new();
    let chaos = metrics::with_local_recorder(&counters, || {
        FaultInjection::builder("pricing")
            .abort(100.0)
            .enabled(true)
            .build()
    })
    .unwrap();
    let pricing = Pricing::default();
    let result = ChaosExperiment::scope("any-experiment", chaos.call(|| pricing.price())).await;
    match result {
        Err(PolicyError::Rejected(rejected @ Rejected::InjectedFault { .. })) => {
            assert_eq!(keel_core::Classify::class(&rejected), ErrorClass::Retryable);
        }
        other => panic!("expected an injected fault, got {other:?}"),
    }
    assert_eq!(pricing.calls(), 0);
    assert_eq!(
        counters.counter("keel_fault_injected_total,name=pricing,kind=abort"),
        1
    );
    assert_eq!(
        counters.counter("keel_fault_injected_total,name=pricing,kind=delay"),
        0
    );
}

#[tokio::test(start_paused = true)]
async fn faults_come_at_the_configured_rate() {
    let chaos = FaultInjection::builder("pricing")
        .delay(25.0, Duration::from_millis(100))
        .abort(10.0)
        .enabled(true)
        .seed(7)
        .build()
        .unwrap();
    let pricing = Pricing::default();
    let calls = 10_000;
    let start = clock::now();
    let mut aborted = 0;
    for _ in 0..calls {
        let result = ChaosExperiment::scope(EXPERIMENT, chaos.call(|| pricing.price())).await;
        aborted += usize::from(result.is_err());
    }
    let delayed = (clock::now() - start).as_millis() as usize / 100;
    assert!(
        (900..=1_100).contains(&aborted),
        "aborted {aborted} of {calls} at 10%"
    );
    assert!(
        (2_300..=2_700).contains(&delayed),
        "delayed {delayed} of {calls} at 25%"
    );
    assert_eq!(pricing.calls(), calls - aborted);
}

#[tokio::test(start_paused = true)]
async fn off_by_default_and_switchable_at_run_time() {
    let chaos = FaultInjection::builder("pricing")
        .abort(100.0)
        .build()
        .unwrap();
    let pricing = Pricing::default();
    assert!(!chaos.is_enabled());
    let r = ChaosExperiment::scope(EXPERIMENT, chaos.call(|| pricing.price())).await;
    assert!(r.is_ok(), "configured but not enabled: nothing happens");
    chaos.clone().set_enabled(true);
    let r = ChaosExperiment::scope(EXPERIMENT, chaos.call(|| pricing.price())).await;
    assert!(r.is_err());
    chaos.set_enabled(false);
    let r = ChaosExperiment::scope(EXPERIMENT, chaos.call(|| pricing.price())).await;
    assert!(r.is_ok(), "the kill switch works for every clone");
}

/// "does the caller's timeout fire?" — a 5 s injected delay against a 2 s
/// timeout: the timeout fires at 2 s and the dependency is never called.
#[cfg(feature = "timeout")]
#[tokio::test(start_paused = true)]
async fn the_callers_timeout_fires_on_injected_latency() {
    use keel_policy::timeout::Timeout;

    let chaos = FaultInjection::builder("pricing")
        .experiment(EXPERIMENT)
        .delay(100.0, Duration::from_secs(5))
        .enabled(true)
        .build()
        .unwrap();
    let timeout = Timeout::builder("pricing")
        .timeout(Duration::from_secs(2))
        .build()
        .unwrap();
    let pricing = Pricing::default();
    let start = clock::now();
    let result =
        ChaosExperiment::scope(EXPERIMENT, timeout.call(|| chaos.call(|| pricing.price()))).await;
    assert_eq!(clock::now() - start, Duration::from_secs(2));
    assert!(
        matches!(result, Err(PolicyError::Rejected(Rejected::Timeout { .. }))),
        "{result:?}"
    );
    assert_eq!(pricing.calls(), 0);
    // Untouched traffic through the same stack is fast.
    assert_eq!(
        timeout
            .call(|| chaos.call(|| pricing.price()))
            .await
            .unwrap(),
        2500
    );
}

/// "fallback serve?" — an injected 503 is served the fallback.
#[cfg(feature = "fallback")]
#[tokio::test(start_paused = true)]
async fn the_fallback_is_served_on_an_injected_failure() {
    use keel_policy::fallback::Fallback;

    let chaos = FaultInjection::builder("pricing")
        .abort(100.0)
        .enabled(true)
        .build()
        .unwrap();
    let fallback = Fallback::builder("pricing").build().unwrap();
    let pricing = Pricing::default();
    let cached = 1999;
    let price: Result<u32, PolicyError<std::io::Error>> = ChaosExperiment::scope(
        EXPERIMENT,
        fallback.call_or(|| chaos.call(|| pricing.price()), cached),
    )
    .await;
    assert_eq!(price.unwrap(), cached);
    assert_eq!(pricing.calls(), 0);
}

/// A request as an HTTP edge would see it.
struct Request {
    headers: HashMap<&'static str, &'static str>,
}

impl Request {
    fn plain() -> Self {
        Self {
            headers: HashMap::new(),
        }
    }
    fn in_experiment() -> Self {
        Self {
            headers: HashMap::from([(EXPERIMENT_HEADER, EXPERIMENT)]),
        }
    }
}

#[tokio::test(start_paused = true)]
async fn tower_layer_injects_only_into_matching_requests() {
    let calls = Arc::new(AtomicUsize::new(0));
    let counted = calls.clone();
    let inner = service_fn(move |_: Request| {
        counted.fetch_add(1, Ordering::SeqCst);
        async { Ok::<_, BoxError>(2500) }
    });
    let delay_only = FaultInjection::builder("pricing")
        .delay(100.0, Duration::from_secs(5))
        .enabled(true)
        .build()
        .unwrap();
    let matcher = |req: &Request| req.headers.get(EXPERIMENT_HEADER) == Some(&EXPERIMENT);
    let mut svc = delay_only.layer(matcher).layer(inner.clone());

    let start = clock::now();
    assert_eq!(
        svc.ready()
            .await
            .unwrap()
            .call(Request::plain())
            .await
            .unwrap(),
        2500
    );
    assert_eq!(clock::now(), start);
    assert_eq!(
        svc.ready()
            .await
            .unwrap()
            .call(Request::in_experiment())
            .await
            .unwrap(),
        2500
    );
    assert_eq!(clock::now() - start, Duration::from_secs(5));

    let abort = pricing_chaos();
    let mut svc = abort.layer(matcher).layer(inner);
    let before = calls.load(Ordering::SeqCst);
    let err = svc
        .ready()
        .await
        .unwrap()
        .call(Request::in_experiment())
        .await
        .unwrap_err();
    assert!(matches!(
        err.downcast_ref::<Rejected>(),
        Some(Rejected::InjectedFault { .. })
    ));
    assert_eq!(classify(err.as_ref()), ErrorClass::Retryable);
    assert_eq!(
        calls.load(Ordering::SeqCst),
        before,
        "an aborted request never reaches the service"
    );
    assert_eq!(
        clock::now() - start,
        Duration::from_secs(10),
        "delayed, then aborted"
    );
}

#[tokio::test(start_paused = true)]
async fn tower_layer_can_follow_the_task_local_experiment() {
    let chaos = FaultInjection::builder("pricing")
        .experiment(EXPERIMENT)
        .abort(100.0)
        .enabled(true)
        .build()
        .unwrap();
    let in_experiment = {
        let chaos = chaos.clone();
        move |_: &u32| chaos.in_experiment()
    };
    let mut svc = chaos
        .layer(in_experiment)
        .layer(service_fn(|n: u32| async move { Ok::<_, BoxError>(n) }));
    assert_eq!(svc.ready().await.unwrap().call(1).await.unwrap(), 1);
    let hit = ChaosExperiment::scope(EXPERIMENT, async {
        svc.ready().await.unwrap().call(2).await
    })
    .await;
    assert!(hit.is_err());
}

#[test]
fn invalid_percentages_and_delays_are_rejected() {
    let field = |b: keel_policy::chaos::FaultInjectionBuilder| b.build().unwrap_err().field;
    let chaos = || FaultInjection::builder("c");
    for bad in [f64::NAN, -1.0, 100.5, f64::INFINITY] {
        assert_eq!(field(chaos().abort(bad)), "abort.percentage", "{bad}");
        assert_eq!(
            field(chaos().delay(bad, Duration::from_secs(1))),
            "delay.percentage",
            "{bad}"
        );
    }
    assert_eq!(
        field(chaos().delay(50.0, Duration::ZERO)),
        "delay.fixed_delay"
    );
    assert_eq!(field(chaos().experiment("")), "experiment");
    assert!(
        chaos()
            .abort(0.0)
            .delay(100.0, Duration::from_millis(1))
            .build()
            .is_ok()
    );
}

#[test]
fn config_reads_the_mesh_fault_block() {
    let config: FaultInjectionConfig = serde_json::from_str(
        r#"{"enabled":true,"experiment":"pricing-latency",
            "delay":{"percentage":100,"fixed_delay":"5s"},
            "abort":{"percentage":10}}"#,
    )
    .unwrap();
    assert_eq!(config.delay.unwrap().fixed_delay, Duration::from_secs(5));
    assert_eq!(config.abort.unwrap().percentage, 10.0);
    let back: FaultInjectionConfig =
        serde_json::from_str(&serde_json::to_string(&config).unwrap()).unwrap();
    assert_eq!(back, config);
    assert!(config.build("pricing").unwrap().is_enabled());
    assert!(serde_json::from_str::<FaultInjectionConfig>(r#"{"abort":{"percent":10}}"#).is_err());
    let over: FaultInjectionConfig =
        serde_json::from_str(r#"{"abort":{"percentage":150}}"#).unwrap();
    assert_eq!(over.build("p").unwrap_err().field, "abort.percentage");
    assert!(
        !FaultInjectionConfig::default()
            .build("p")
            .unwrap()
            .is_enabled()
    );
}
