//! Weighted subsets and load balancing in the client path, over real HTTP
//! on loopback: a canary gets its share and its errors are told apart from
//! the baseline's, a failing host is ejected but a subset never empties,
//! and a slow host gets less traffic.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use keel_client::{Dependency, DependencyConfig, HttpCallError, PropagatingClient, SubsetConfig};
use keel_core::Rejected;
use keel_policy::balance::{BalanceConfig, Strategy};
use keel_policy::breaker::{CircuitBreakerConfig, MAX_WINDOW_CALLS, SlidingWindow};
use keel_policy::retry::RetryConfig;

/// A host that counts its calls and answers `status` after `delay`.
#[derive(Clone)]
struct Host {
    hits: Arc<AtomicUsize>,
    status: StatusCode,
    delay: Duration,
}

impl Host {
    async fn start(status: StatusCode, delay: Duration) -> (Self, String) {
        let host = Self {
            hits: Arc::default(),
            status,
            delay,
        };
        async fn answer(State(host): State<Host>) -> StatusCode {
            host.hits.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(host.delay).await;
            host.status
        }
        let router = Router::new()
            .route("/charges", get(answer))
            .with_state(host.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr: SocketAddr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router).await.unwrap() });
        (host, format!("http://{addr}"))
    }

    async fn ok() -> (Self, String) {
        Self::start(StatusCode::OK, Duration::ZERO).await
    }

    async fn failing() -> (Self, String) {
        Self::start(StatusCode::SERVICE_UNAVAILABLE, Duration::ZERO).await
    }

    fn hits(&self) -> usize {
        self.hits.load(Ordering::SeqCst)
    }
}

/// A dependency over `subsets` with one attempt per call and a breaker
/// that stays out of the way, so every call is one routed attempt.
fn payments(subsets: Vec<SubsetConfig>) -> Dependency {
    payments_balanced(subsets, BalanceConfig::default())
}

fn payments_balanced(subsets: Vec<SubsetConfig>, balance: BalanceConfig) -> Dependency {
    let config = DependencyConfig {
        retry: RetryConfig {
            max_attempts: std::num::NonZeroU32::MIN,
            ..RetryConfig::default()
        },
        breaker: CircuitBreakerConfig {
            sliding_window: SlidingWindow::Count {
                size: MAX_WINDOW_CALLS,
            },
            minimum_calls: MAX_WINDOW_CALLS,
            ..CircuitBreakerConfig::default()
        },
        subsets,
        balance,
        ..DependencyConfig::default()
    };
    PropagatingClient::new(reqwest::Client::new())
        .dependency("payments")
        .config(config)
        .build()
        .unwrap()
}

async fn charge(payments: &Dependency) -> Result<reqwest::Response, HttpCallError> {
    payments
        .send_routed(|http, endpoint| http.get(endpoint.url("/charges")))
        .await
}

#[tokio::test]
async fn a_canary_gets_its_weight_and_its_errors_are_labelled_apart() {
    let recorder = keel_testkit::metrics::MetricsRecorder::global();
    let (a, a_url) = Host::ok().await;
    let (b, b_url) = Host::ok().await;
    let (canary, canary_url) = Host::failing().await;
    let payments = payments(vec![
        SubsetConfig::new("stable", 90, [a_url, b_url]),
        SubsetConfig::new("v2", 10, [canary_url]).canary(),
    ]);
    let calls = 1_000;
    for _ in 0..calls {
        let _ = charge(&payments).await;
    }
    assert_eq!(a.hits() + b.hits() + canary.hits(), calls);
    // 10% of 1,000: 100 ± 5 standard deviations (9.5 each).
    assert!(
        (52..=148).contains(&canary.hits()),
        "the canary got {} of {calls} calls",
        canary.hits()
    );
    // A lone canary is never ejected (half of one endpoint rounds to none),
    // so it keeps failing where the alert can see it.
    assert_eq!(payments.balancers()[1].ejected(), 0);
    let metric = "keel_client_subset_attempt_duration_seconds,dependency=payments";
    let canary_errors = recorder.samples(&format!("{metric},subset=v2,track=canary,outcome=5xx"));
    let baseline_ok = recorder.samples(&format!(
        "{metric},subset=stable,track=baseline,outcome=2xx"
    ));
    assert_eq!(canary_errors.len(), canary.hits());
    assert_eq!(baseline_ok.len(), a.hits() + b.hits());
    assert!(
        recorder
            .samples(&format!(
                "{metric},subset=stable,track=baseline,outcome=5xx"
            ))
            .is_empty()
    );
}

#[tokio::test]
async fn a_failing_host_is_ejected_and_gets_no_more_calls() {
    let (bad, bad_url) = Host::failing().await;
    let mut good = Vec::new();
    let mut urls = vec![bad_url];
    for _ in 0..3 {
        let (host, url) = Host::ok().await;
        good.push(host);
        urls.push(url);
    }
    // By requests in flight alone, so that only ejection keeps the bad
    // host out (peak-EWMA would also shun it for its failures).
    let least_request = BalanceConfig {
        strategy: Strategy::LeastRequest,
        ..BalanceConfig::default()
    };
    let payments = payments_balanced(vec![SubsetConfig::new("stable", 1, urls)], least_request);
    for _ in 0..300 {
        let _ = charge(&payments).await;
    }
    // Five failures in a row eject it for 30 s; every later call goes to
    // the three good hosts.
    assert_eq!(bad.hits(), 5);
    assert_eq!(payments.balancers()[0].ejected(), 1);
    assert_eq!(good.iter().map(Host::hits).sum::<usize>(), 295);
}

#[tokio::test]
async fn a_subset_is_never_emptied_by_ejection() {
    let (first, first_url) = Host::failing().await;
    let (second, second_url) = Host::failing().await;
    let payments = payments(vec![SubsetConfig::new(
        "stable",
        1,
        [first_url, second_url],
    )]);
    for _ in 0..100 {
        let err = charge(&payments).await.unwrap_err();
        // Every call reaches a host and gets its answer: a dependency-wide
        // outage fails calls, it does not refuse them all for want of hosts.
        assert_eq!(err.status(), Some(StatusCode::SERVICE_UNAVAILABLE));
    }
    assert_eq!(first.hits() + second.hits(), 100);
    assert_eq!(payments.balancers()[0].ejected(), 1, "at most half of two");
}

#[tokio::test]
async fn a_slow_host_gets_less_traffic() {
    let (slow, slow_url) = Host::start(StatusCode::OK, Duration::from_millis(80)).await;
    let (fast, fast_url) = Host::ok().await;
    let payments = payments(vec![SubsetConfig::new("stable", 1, [slow_url, fast_url])]);
    for _ in 0..100 {
        charge(&payments).await.unwrap();
    }
    // Its first answer lifts its latency estimate to 80 ms at once; the
    // fast host stays near 1 ms, and power of two choices prefers it.
    assert!(slow.hits() <= 3, "the slow host got {} calls", slow.hits());
    assert_eq!(fast.hits(), 100 - slow.hits());
}

#[tokio::test]
async fn routing_without_subsets_is_refused_without_a_request() {
    let payments = payments(Vec::new());
    let err = charge(&payments).await.unwrap_err();
    assert!(
        matches!(err.rejected(), Some(Rejected::NoEndpoint { name }) if &**name == "payments"),
        "{err:?}"
    );
}
