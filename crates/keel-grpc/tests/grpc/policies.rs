//! keel-policy's breaker and retry on a tonic `Channel`: what protects the
//! failing server, not only what the caller sees.

use std::time::Duration;

use keel_grpc::client::PropagationLayer;
use keel_grpc::replay::{ChannelBodyLayer, ReplayBodyLayer};
use keel_lifecycle::Drain;
use keel_policy::breaker::CircuitBreaker;
use keel_policy::bulkhead::{Bulkhead, BulkheadLayer};
use keel_policy::hedge::{Hedge, HedgeDelay};
use keel_policy::retry::{Backoff, Retry, grpc_verdict};
use keel_policy::timeout::Timeout;
use tonic::Code;
use tonic::transport::Channel;
use tonic_health::pb::health_client::HealthClient;

use crate::support::{Server, ask};

type Stack = tower::util::BoxCloneService<
    http::Request<tonic::body::Body>,
    http::Response<tonic::body::Body>,
    tonic::Status,
>;

fn protected(channel: Channel, breaker: &CircuitBreaker) -> HealthClient<Stack> {
    let retry = Retry::builder("shipping")
        .max_attempts(3)
        .backoff(Backoff::schedule([Duration::from_millis(5), Duration::from_millis(5)]).unwrap())
        .retry_on_result(grpc_verdict::<tonic::body::Body>)
        .build()
        .unwrap();
    let stack = tower::ServiceBuilder::new()
        .layer(PropagationLayer::new())
        .layer(ReplayBodyLayer::new())
        .layer(retry.layer())
        .layer(breaker.grpc_layer())
        .layer(ChannelBodyLayer)
        .service(channel);
    HealthClient::new(tower::util::BoxCloneService::new(stack))
}

#[tokio::test]
async fn the_retry_resends_unavailable_and_leaves_the_callers_faults_alone() {
    let server = Server::start(Duration::from_secs(10), &Drain::new()).await;
    let breaker = CircuitBreaker::builder("shipping").build().unwrap();
    let mut client = protected(server.channel().await, &breaker);

    client.check(ask("flaky")).await.unwrap();
    assert_eq!(
        server.calls(),
        3,
        "two UNAVAILABLE answers, then the success"
    );

    let status = client.check(ask("missing")).await.unwrap_err();
    assert_eq!(status.code(), Code::NotFound);
    assert_eq!(
        server.calls(),
        4,
        "NOT_FOUND is the caller's fault: asked once"
    );
}

#[tokio::test]
async fn an_open_breaker_stops_the_calls_and_says_when_to_come_back() {
    let server = Server::start(Duration::from_secs(10), &Drain::new()).await;
    let breaker = CircuitBreaker::builder("shipping")
        .count_window(10)
        .minimum_calls(5)
        .failure_rate_threshold(50.0)
        .open_duration(Duration::from_secs(30))
        .build()
        .unwrap();
    let mut client = protected(server.channel().await, &breaker);

    let mut refused = None;
    for _ in 0..20 {
        let status = client.check(ask("down")).await.unwrap_err();
        if status.message().contains("circuit breaker") {
            refused = Some(status);
            break;
        }
        assert_eq!(status.code(), Code::Unavailable);
    }
    let refused = refused.expect("the breaker opened");
    let reached = server.calls();
    assert!(
        reached <= 6,
        "the server saw {reached} calls before the breaker opened"
    );
    // The refusal is UNAVAILABLE with the pushback until the probe.
    assert_eq!(refused.code(), Code::Unavailable);
    let pushback = keel_grpc::status::retry_pushback(&refused).expect("pushback");
    assert!(pushback > Duration::from_secs(20), "{pushback:?}");

    for _ in 0..10 {
        let status = client.check(ask("down")).await.unwrap_err();
        assert_eq!(status.code(), Code::Unavailable);
    }
    assert_eq!(
        server.calls(),
        reached,
        "not one call reached the failing server"
    );
}

/// One hedged attempt, sent 50 ms after the first.
fn hedge_after_50ms() -> Hedge {
    Hedge::builder("shipping")
        .delay(HedgeDelay::Fixed {
            delay: Duration::from_millis(50),
        })
        .max_hedged_attempts(1)
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_hedge_a_timeout_and_a_bulkhead_work_on_a_channel_too() {
    let server = Server::start(Duration::from_secs(10), &Drain::new()).await;
    let hedge = hedge_after_50ms();
    let timeout = Timeout::builder("shipping")
        .timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let bulkhead = Bulkhead::builder("shipping")
        .max_concurrent(1)
        .max_waiting(0)
        .build()
        .unwrap();
    let stack = tower::ServiceBuilder::new()
        .layer(PropagationLayer::new())
        .layer(ReplayBodyLayer::new())
        .layer(timeout.layer())
        .layer(hedge.layer())
        .layer(BulkheadLayer::new(bulkhead))
        .layer(ChannelBodyLayer)
        .service(server.channel().await);
    let mut client = HealthClient::new(tower::util::BoxCloneService::new(stack));

    // The first attempt hangs; the hedge sent after 50 ms answers. The
    // bulkhead below the hedge holds one call at a time, so the hedge
    // waits for no slot: it is refused, and the slow attempt answers at
    // the timeout. Above the bulkhead each attempt has its own slot.
    let status = client.check(ask("slow-first")).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(
        status.message().contains("timed out"),
        "{}",
        status.message()
    );
    assert_eq!(
        server.calls(),
        1,
        "the bulkhead kept the hedge from a second slot"
    );
}

#[tokio::test]
async fn a_hedge_answers_for_a_slow_first_attempt() {
    let server = Server::start(Duration::from_secs(10), &Drain::new()).await;
    let hedge = hedge_after_50ms();
    let stack = tower::ServiceBuilder::new()
        .layer(PropagationLayer::new())
        .layer(ReplayBodyLayer::new())
        .layer(hedge.layer())
        .layer(ChannelBodyLayer)
        .service(server.channel().await);
    let mut client = HealthClient::new(tower::util::BoxCloneService::new(stack));
    let started = tokio::time::Instant::now();
    client.check(ask("slow-first")).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(server.calls(), 2, "the first attempt and its hedge");
}
