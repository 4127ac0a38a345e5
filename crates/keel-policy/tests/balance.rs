//! Behaviour of the balancer: load-aware choice, outlier ejection with a
//! growing penalty, and a pool that is never emptied.
#![cfg(feature = "balance")]

use std::collections::{HashMap, HashSet};
use std::future::{Ready, ready};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use keel_core::{BoxError, Classified, ErrorClass, PolicyError, Rejected, clock};
use keel_policy::balance::{
    BalanceConfig, BalanceService, Balancer, BalancerBuilder, Picked, Strategy,
};
use keel_testkit::metrics::MetricsRecorder;
use parking_lot::Mutex;
use proptest::prelude::*;
use tokio::time::advance;
use tower::{Service, ServiceExt, service_fn};

fn builder() -> BalancerBuilder {
    Balancer::builder("pricing").seed(42)
}

/// For tests that aim failures at one endpoint: with least-request and no
/// request in flight, every endpoint is equally likely to come up. (With
/// peak EWMA, a failing endpoint keeps its latency estimate while idle ones
/// decay, so it would rarely be picked again.)
fn even() -> BalancerBuilder {
    builder().strategy(Strategy::LeastRequest)
}

fn endpoints(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("10.0.0.{i}")).collect()
}

/// Picks until `target` comes up; other picks are released untouched.
fn pick<E: PartialEq + std::fmt::Debug>(balancer: &Balancer<E>, target: &E) -> Picked<E> {
    for _ in 0..10_000 {
        let picked = balancer.pick().unwrap();
        if picked.endpoint() == target {
            return picked;
        }
        picked.release();
    }
    panic!("{target:?} was never picked");
}

fn fail<E: PartialEq + std::fmt::Debug>(balancer: &Balancer<E>, target: &E, times: usize) {
    for _ in 0..times {
        pick(balancer, target).failure(ErrorClass::Retryable);
    }
}

fn is_ejected<E: Clone + PartialEq>(balancer: &Balancer<E>, target: &E) -> bool {
    balancer
        .snapshot()
        .iter()
        .any(|s| &s.endpoint == target && s.ejected_until.is_some())
}

/// Which endpoints `picks` picks go to, released untouched.
fn traffic<E: Clone + Eq + std::hash::Hash>(
    balancer: &Balancer<E>,
    picks: usize,
) -> HashMap<E, usize> {
    let mut seen = HashMap::new();
    for _ in 0..picks {
        let picked = balancer.pick().unwrap();
        *seen.entry(picked.endpoint().clone()).or_default() += 1;
        picked.release();
    }
    seen
}

#[tokio::test(start_paused = true)]
async fn a_slow_endpoint_gets_less_traffic_with_peak_ewma() {
    let balancer = builder().build_with(["a", "b", "slow"]).unwrap();
    let mut served: HashMap<&str, usize> = HashMap::new();
    for _ in 0..1_000 {
        let picked = balancer.pick().unwrap();
        let endpoint = *picked.endpoint();
        let latency = if endpoint == "slow" { 200 } else { 5 };
        advance(Duration::from_millis(latency)).await;
        picked.success();
        *served.entry(endpoint).or_default() += 1;
    }
    let slow = served.get("slow").copied().unwrap_or(0);
    assert!(
        slow <= 20,
        "the slow endpoint got {slow} of 1000: {served:?}"
    );
    assert!(served["a"] > 400 && served["b"] > 400, "{served:?}");
}

#[tokio::test(start_paused = true)]
async fn least_request_prefers_the_idle_endpoint() {
    let balancer = builder()
        .strategy(Strategy::LeastRequest)
        .build_with(["busy", "idle-1", "idle-2"])
        .unwrap();
    let held = pick(&balancer, &"busy");
    let seen = traffic(&balancer, 200);
    assert_eq!(
        seen.get("busy"),
        None,
        "a busy endpoint loses every comparison: {seen:?}"
    );

    let two = builder()
        .strategy(Strategy::LeastRequest)
        .build_with(["x", "y"])
        .unwrap();
    let in_flight: Vec<_> = (0..10).map(|_| two.pick().unwrap()).collect();
    let per_endpoint = two
        .snapshot()
        .iter()
        .map(|s| s.in_flight)
        .collect::<Vec<_>>();
    assert_eq!(
        per_endpoint,
        [5, 5],
        "outstanding requests are spread evenly"
    );
    drop((held, in_flight));
    assert!(two.snapshot().iter().all(|s| s.in_flight == 0));
}

#[tokio::test(start_paused = true)]
async fn peak_ewma_also_counts_requests_in_flight() {
    let balancer = builder().build_with(["a", "b"]).unwrap();
    let held = pick(&balancer, &"a");
    let seen = traffic(&balancer, 50);
    assert_eq!(seen.get("a"), None, "{seen:?}");
    drop(held);
}

#[tokio::test(start_paused = true)]
async fn five_consecutive_failures_eject_an_endpoint() {
    let metrics = MetricsRecorder::new();
    let balancer =
        metrics::with_local_recorder(&metrics, || even().build_with(endpoints(3))).unwrap();
    let sick = "10.0.0.1".to_string();
    fail(&balancer, &sick, 4);
    assert!(!is_ejected(&balancer, &sick), "4 failures are not enough");
    fail(&balancer, &sick, 1);
    assert!(is_ejected(&balancer, &sick));

    let snapshot = balancer.snapshot();
    let sick_state = snapshot.iter().find(|s| s.endpoint == sick).unwrap();
    assert_eq!(
        sick_state.ejected_until,
        Some(clock::now() + Duration::from_secs(30))
    );
    assert_eq!(sick_state.times_ejected, 1);
    assert_eq!(sick_state.consecutive_failures, 0);

    let seen = traffic(&balancer, 300);
    assert_eq!(
        seen.get(&sick),
        None,
        "an ejected endpoint gets no traffic: {seen:?}"
    );
    assert_eq!(
        metrics.counter("keel_outlier_ejections_total,name=pricing"),
        1
    );
    assert_eq!(metrics.gauge("keel_outlier_ejected,name=pricing"), 1.0);
}

#[tokio::test(start_paused = true)]
async fn an_answer_resets_the_consecutive_count() {
    let balancer = even().build_with(endpoints(3)).unwrap();
    let flaky = "10.0.0.0".to_string();
    fail(&balancer, &flaky, 4);
    pick(&balancer, &flaky).success();
    fail(&balancer, &flaky, 4);
    assert!(!is_ejected(&balancer, &flaky));
    // A 404 is an answer, and a local refusal never reached the endpoint.
    pick(&balancer, &flaky).failure(ErrorClass::Permanent);
    for _ in 0..10 {
        pick(&balancer, &flaky).failure(ErrorClass::Rejected);
    }
    fail(&balancer, &flaky, 4);
    assert!(!is_ejected(&balancer, &flaky));
    fail(&balancer, &flaky, 1);
    assert!(is_ejected(&balancer, &flaky));
}

#[tokio::test(start_paused = true)]
async fn ejection_time_grows_on_repeat_offences_up_to_the_maximum() {
    let balancer = even()
        .max_ejection_time(Duration::from_secs(75))
        .build_with(endpoints(3))
        .unwrap();
    let sick = "10.0.0.2".to_string();
    let mut lengths = Vec::new();
    for _ in 0..4 {
        fail(&balancer, &sick, 5);
        let until = balancer
            .snapshot()
            .into_iter()
            .find(|s| s.endpoint == sick)
            .unwrap()
            .ejected_until;
        let length = until.unwrap() - clock::now();
        lengths.push(length.as_secs());
        advance(length).await;
    }
    assert_eq!(lengths, [30, 60, 75, 75]);
}

#[tokio::test(start_paused = true)]
async fn time_healthy_in_the_pool_forgives_past_ejections() {
    let balancer = even().build_with(endpoints(3)).unwrap();
    let sick = "10.0.0.2".to_string();
    fail(&balancer, &sick, 5);
    advance(Duration::from_secs(30)).await;
    fail(&balancer, &sick, 5);
    advance(Duration::from_secs(60)).await;
    // Two full 10 s intervals back in the pool forgive both offences.
    advance(Duration::from_secs(20)).await;
    fail(&balancer, &sick, 5);
    let state = balancer
        .snapshot()
        .into_iter()
        .find(|s| s.endpoint == sick)
        .unwrap();
    assert_eq!(state.times_ejected, 1);
    assert_eq!(
        state.ejected_until,
        Some(clock::now() + Duration::from_secs(30))
    );
}

#[tokio::test(start_paused = true)]
async fn an_ejected_endpoint_returns_after_its_time() {
    let metrics = MetricsRecorder::new();
    let balancer =
        metrics::with_local_recorder(&metrics, || even().build_with(endpoints(3))).unwrap();
    let sick = "10.0.0.0".to_string();
    fail(&balancer, &sick, 5);
    advance(Duration::from_millis(29_999)).await;
    assert_eq!(traffic(&balancer, 200).get(&sick), None);
    advance(Duration::from_millis(1)).await;
    let seen = traffic(&balancer, 300);
    assert!(
        seen.get(&sick).copied().unwrap_or(0) > 50,
        "back in the pool: {seen:?}"
    );
    assert!(!is_ejected(&balancer, &sick));
    assert_eq!(balancer.ejected(), 0);
    assert_eq!(metrics.gauge("keel_outlier_ejected,name=pricing"), 0.0);
}

/// Every endpoint fails: at most half are ejected, and the rest keep getting
/// traffic, so the service degrades instead of going dark.
#[tokio::test(start_paused = true)]
async fn a_dependency_wide_outage_ejects_at_most_half_and_never_all() {
    for (n, cap) in [(10, 5), (5, 2), (3, 1), (2, 1), (1, 0)] {
        let balancer = builder().build_with(endpoints(n)).unwrap();
        for _ in 0..2_000 {
            balancer.pick().unwrap().failure(ErrorClass::Retryable);
            assert!(balancer.ejected() <= cap);
        }
        assert_eq!(balancer.ejected(), cap, "with {n} endpoints");
        let still_serving = traffic(&balancer, 500).len();
        assert_eq!(still_serving, n - cap, "with {n} endpoints");
    }
}

#[tokio::test(start_paused = true)]
async fn no_endpoint_only_when_the_set_is_empty() {
    let balancer: Balancer<&str> = builder().build().unwrap();
    let refused = balancer.call(|_| async { Ok::<_, Classified>(()) }).await;
    assert!(
        matches!(refused, Err(PolicyError::Rejected(Rejected::NoEndpoint { name })) if &*name == "pricing")
    );
    balancer.insert("only");
    for _ in 0..20 {
        balancer.pick().unwrap().failure(ErrorClass::Retryable);
    }
    assert_eq!(
        balancer.pick().unwrap().endpoint(),
        &"only",
        "a lone endpoint is never ejected"
    );
    balancer.retain(|_| false);
    assert!(balancer.is_empty());
    assert!(matches!(balancer.pick(), Err(Rejected::NoEndpoint { .. })));
}

#[tokio::test(start_paused = true)]
async fn removing_an_ejected_endpoint_frees_its_place_under_the_cap() {
    let balancer = even().build_with(endpoints(3)).unwrap();
    fail(&balancer, &"10.0.0.0".to_string(), 5);
    assert_eq!(balancer.ejected(), 1);
    balancer.retain(|e| e != "10.0.0.0");
    assert_eq!(balancer.ejected(), 0);
    balancer.insert("10.0.0.3".to_string());
    fail(&balancer, &"10.0.0.1".to_string(), 5);
    assert!(is_ejected(&balancer, &"10.0.0.1".to_string()));
}

#[tokio::test(start_paused = true)]
async fn a_dropped_pick_is_cancelled_not_failed() {
    let balancer = builder().build_with(["a", "b"]).unwrap();
    let picked = pick(&balancer, &"a");
    advance(Duration::from_secs(5)).await;
    drop(picked);
    let a = balancer
        .snapshot()
        .into_iter()
        .find(|s| s.endpoint == "a")
        .unwrap();
    assert_eq!(a.in_flight, 0);
    assert_eq!(a.consecutive_failures, 0);
    assert_eq!(
        a.rtt,
        Duration::from_secs(5),
        "the wait raised its latency estimate"
    );
}

/// A black hole fails instantly. Its latency estimate must not fall with
/// those instant failures, or peak EWMA would send it more traffic.
#[tokio::test(start_paused = true)]
async fn fast_failures_do_not_make_an_endpoint_look_fast() {
    let balancer = builder()
        .strategy(Strategy::LeastRequest)
        .build_with(["black-hole", "ok"])
        .unwrap();
    for _ in 0..3 {
        advance(Duration::from_secs(5)).await;
        pick(&balancer, &"black-hole").failure(ErrorClass::Retryable);
        let ok = pick(&balancer, &"ok");
        advance(Duration::from_millis(20)).await;
        ok.success();
    }
    let rtt: HashMap<_, _> = balancer
        .snapshot()
        .into_iter()
        .map(|s| (s.endpoint, s.rtt))
        .collect();
    assert!(rtt["black-hole"] > rtt["ok"], "{rtt:?}");
    assert!(rtt["black-hole"] >= Duration::from_millis(29), "{rtt:?}");
}

#[tokio::test(start_paused = true)]
async fn call_records_the_outcome_of_each_request() {
    let balancer = builder().build_with(endpoints(2)).unwrap();
    for _ in 0..12 {
        let result = balancer
            .call(|_| async { Err::<(), _>(Classified::retryable("503")) })
            .await;
        assert!(matches!(result, Err(PolicyError::Inner(_))));
    }
    assert_eq!(balancer.ejected(), 1);
    assert!(balancer.snapshot().iter().all(|s| s.in_flight == 0));
}

#[tokio::test(start_paused = true)]
async fn the_same_seed_gives_the_same_choices() {
    let run = || {
        let balancer = builder().build_with(endpoints(5)).unwrap();
        (0..50)
            .map(|_| {
                let picked = balancer.pick().unwrap();
                let endpoint = picked.endpoint().clone();
                picked.release();
                endpoint
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(run(), run());
}

/// A service that is never ready.
#[derive(Clone)]
struct NeverReady;

impl Service<u32> for NeverReady {
    type Response = &'static str;
    type Error = BoxError;
    type Future = Ready<Result<&'static str, BoxError>>;
    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Pending
    }
    fn call(&mut self, _: u32) -> Self::Future {
        ready(Ok("never"))
    }
}

#[tokio::test(start_paused = true)]
async fn balance_service_ejects_a_failing_service_and_skips_unready_ones() {
    let hits = Arc::new(Mutex::new(HashMap::<&str, usize>::new()));
    let endpoint = |name: &'static str, fails: bool| {
        let hits = hits.clone();
        service_fn(move |_: u32| {
            *hits.lock().entry(name).or_default() += 1;
            async move {
                if fails {
                    Err::<&str, BoxError>(Classified::retryable("503").into())
                } else {
                    Ok(name)
                }
            }
        })
        .boxed()
    };
    let mut svc = BalanceService::new(
        builder(),
        [
            ("a", endpoint("a", false)),
            ("b", endpoint("b", false)),
            ("sick", endpoint("sick", true)),
        ],
    )
    .unwrap();
    for i in 0..300 {
        let _ = svc.ready().await.unwrap().call(i).await;
    }
    let sick_calls = hits.lock()["sick"];
    assert!(
        sick_calls <= 10,
        "ejected after 5 failures in a row: {sick_calls}"
    );
    assert!(
        svc.snapshot()
            .iter()
            .any(|s| s.endpoint == "sick" && s.ejected_until.is_some())
    );

    let mut stuck = BalanceService::new(
        builder(),
        [
            ("stuck", NeverReady.boxed()),
            ("fine", endpoint("fine", false)),
        ],
    )
    .unwrap();
    for i in 0..20 {
        assert_eq!(stuck.ready().await.unwrap().call(i).await.unwrap(), "fine");
    }

    let mut empty = BalanceService::new(builder(), Vec::<(&str, NeverReady)>::new()).unwrap();
    let err = empty.ready().await.unwrap().call(1).await.unwrap_err();
    assert!(matches!(
        err.downcast_ref::<Rejected>(),
        Some(Rejected::NoEndpoint { .. })
    ));
}

#[test]
fn invalid_configurations_are_rejected() {
    let field = |b: BalancerBuilder| b.build::<()>().unwrap_err().field;
    assert_eq!(
        field(builder().max_ejection_percent(100)),
        "max_ejection_percent"
    );
    assert_eq!(
        field(builder().max_ejection_percent(255)),
        "max_ejection_percent"
    );
    assert_eq!(
        field(builder().consecutive_failures(0)),
        "consecutive_failures"
    );
    assert_eq!(
        field(builder().base_ejection_time(Duration::ZERO)),
        "base_ejection_time"
    );
    assert_eq!(
        field(builder().max_ejection_time(Duration::from_secs(10))),
        "max_ejection_time"
    );
    assert_eq!(field(builder().default_rtt(Duration::ZERO)), "default_rtt");
    assert_eq!(field(builder().decay(Duration::ZERO)), "decay");
    assert_eq!(field(builder().interval(Duration::ZERO)), "interval");
    assert!(builder().max_ejection_percent(0).build::<()>().is_ok());
}

#[test]
fn config_reads_the_mesh_settings() {
    let config: BalanceConfig = serde_json::from_str(
        r#"{"strategy":"least_request","consecutive_failures":5,"base_ejection_time":"30s","max_ejection_percent":50}"#,
    )
    .unwrap();
    assert_eq!(config.strategy, Strategy::LeastRequest);
    assert_eq!(config.max_ejection_time, Duration::from_secs(300));
    let back: BalanceConfig =
        serde_json::from_str(&serde_json::to_string(&config).unwrap()).unwrap();
    assert_eq!(back, config);
    assert!(serde_json::from_str::<BalanceConfig>(r#"{"maxEjectionPercent":50}"#).is_err());
    assert!(serde_json::from_str::<BalanceConfig>(r#"{"max_ejection_percent":-1}"#).is_err());
    let all: BalanceConfig = serde_json::from_str(r#"{"max_ejection_percent":100}"#).unwrap();
    assert_eq!(
        all.build::<()>("p").unwrap_err().field,
        "max_ejection_percent"
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever happens, no more than floor(n × pct / 100) endpoints are out,
    /// and a pick always finds one.
    #[test]
    fn the_ejection_cap_always_holds(
        n in 1usize..12,
        pct in 0u8..100,
        steps in proptest::collection::vec((any::<bool>(), 0u64..40_000), 1..300),
    ) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
        rt.block_on(async {
            let balancer = builder().max_ejection_percent(pct).build_with(0..n).unwrap();
            let cap = n * usize::from(pct) / 100;
            let mut picked = HashSet::new();
            for (fails, wait_ms) in steps {
                let p = balancer.pick().unwrap();
                picked.insert(*p.endpoint());
                if fails { p.failure(ErrorClass::Retryable) } else { p.success() }
                let out = balancer.snapshot().iter().filter(|s| s.ejected_until.is_some()).count();
                prop_assert!(out <= cap, "{out} ejected of {n} at {pct}%");
                prop_assert!(balancer.ejected() <= cap);
                advance(Duration::from_millis(wait_ms)).await;
            }
            Ok(())
        })?;
    }
}

#[tokio::test(start_paused = true)]
async fn concurrent_picks_count_in_flight_exactly() {
    let balancer = builder().build_with(endpoints(4)).unwrap();
    let done = Arc::new(AtomicUsize::new(0));
    let tasks: Vec<_> = (0..64)
        .map(|i| {
            let balancer = balancer.clone();
            let done = done.clone();
            tokio::spawn(async move {
                let picked = balancer.pick().unwrap();
                tokio::time::sleep(Duration::from_millis(10 + i % 7)).await;
                picked.success();
                done.fetch_add(1, Ordering::SeqCst);
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1)).await;
    let in_flight: usize = balancer.snapshot().iter().map(|s| s.in_flight).sum();
    assert_eq!(in_flight, 64);
    for task in tasks {
        task.await.unwrap();
    }
    assert_eq!(done.load(Ordering::SeqCst), 64);
    assert!(balancer.snapshot().iter().all(|s| s.in_flight == 0));
}
