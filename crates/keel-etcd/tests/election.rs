//! Leader election against a real etcd (one member, started by
//! `scripts/services.sh`): one leader at a time, tokens that grow, and a
//! leader cut off from etcd that stops leading before another is elected.

use std::time::Duration;

use futures_util::StreamExt;
use keel_core::clock;
use keel_etcd::{EtcdElection, Leadership};
use keel_messaging::fence::{FenceGate, FencingToken};
use keel_testkit::services::{self, ServerLock, Service};

const TTL: Duration = Duration::from_secs(2);

/// A fresh election (a name of its own) on the suite's etcd. Callers
/// hold a `ServerLock` first: shared, or exclusive to stop etcd.
async fn election() -> Option<EtcdElection> {
    let url = services::etcd_url()?;
    let name = format!("keel-test/{}", keel_core::id::new_id().simple());
    Some(
        EtcdElection::builder([url], name)
            .ttl(TTL)
            .build()
            .await
            .expect("connect"),
    )
}

fn fence(leadership: &Leadership) -> FencingToken {
    FencingToken::new(leadership.token())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_leader_at_a_time_and_each_next_one_has_a_higher_token() {
    let _lock = ServerLock::shared(Service::Etcd);
    let Some(election) = election().await else {
        return;
    };
    let mut observed = election.observe();
    let a = election.campaign("pod-a").await.expect("pod-a campaigns");
    assert!(a.is_leader());
    assert_eq!(election.leader().await.unwrap().as_deref(), Some("pod-a"));

    let contender = election.clone();
    let b = tokio::spawn(async move { contender.campaign("pod-b").await });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!b.is_finished(), "pod-b waits while pod-a leads");

    a.proclaim("pod-a, phase two").await.expect("proclaim");
    let a_token = a.token();
    a.resign().await.expect("resign");
    let b = b.await.unwrap().expect("pod-b wins once pod-a resigns");
    assert!(b.token() > a_token, "{} then {}", a_token, b.token());

    let mut seen = Vec::new();
    while seen.last().map(String::as_str) != Some("pod-b") {
        let next = tokio::time::timeout(Duration::from_secs(5), observed.next())
            .await
            .expect("observed in time")
            .expect("the stream goes on")
            .expect("an observation");
        seen.push(next);
    }
    assert_eq!(seen, ["pod-a", "pod-a, phase two", "pod-b"]);
}

/// etcd is stopped under the leader (it is cut off). By its own clock the
/// leader stops leading within the TTL; etcd comes back, and only after
/// that can another process win, with a higher token that the fence
/// prefers to the deposed leader's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_off_leader_stops_before_another_is_elected_and_is_fenced_off() {
    let _lock = ServerLock::exclusive(Service::Etcd);
    let Some(election) = election().await else {
        return;
    };
    let resource = FenceGate::new();
    let a = election.campaign("pod-a").await.expect("pod-a campaigns");
    resource.admit(fence(&a)).expect("the leader writes");

    services::stop(Service::Etcd).expect("stop etcd");
    let cut_off = clock::now();
    tokio::time::timeout(TTL * 2, a.lost())
        .await
        .expect("leadership ends by the leader's clock within the TTL");
    let a_stopped = clock::now();
    assert!(!a.is_leader());
    assert!(a_stopped - cut_off <= TTL + Duration::from_millis(200));
    services::start(Service::Etcd).expect("start etcd");

    let b = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            match election.campaign("pod-b").await {
                Ok(b) => break b,
                Err(error) => {
                    eprintln!("campaign after the restart: {error}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
    })
    .await
    .expect("pod-b is elected once etcd is back and pod-a's lease ran out");
    let b_elected = clock::now();
    assert!(a_stopped < b_elected, "pod-a stopped before pod-b led");
    assert!(b.token() > a.token());
    resource.admit(fence(&b)).expect("the new leader writes");
    let stale = resource
        .admit(fence(&a))
        .expect_err("the deposed leader's write is refused");
    assert_eq!(stale.current, Some(fence(&b)));
}

#[tokio::test]
async fn a_ttl_etcd_cannot_keep_is_refused() {
    let err = EtcdElection::builder(["http://127.0.0.1:1"], "x")
        .ttl(Duration::from_millis(1500))
        .build()
        .await
        .unwrap_err();
    assert!(err.to_string().starts_with("ttl"), "{err}");
}

// The election contract's suite, as every backend runs it. The suite's
// tests await this expression; without a server the test returns first.
keel_testkit::election_conformance_tests!(match election().await {
    Some(election) => std::future::ready(
        keel_testkit::store_suite::Fixture::new(election)
            .keep_alive(ServerLock::shared(Service::Etcd)),
    ),
    None => return,
});
