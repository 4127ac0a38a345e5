//! Redis leases against a real redis-server (no persistence), started by
//! `scripts/services.sh`: the lease conformance suite every lease store
//! passes, and what happens when Redis is killed and comes back empty.

use std::time::Duration;

use keel_redis::RedisLeases;
use keel_store::{LeaseStore, StoreError};
use keel_testkit::services::{self, ServerLock, Service};
use keel_testkit::store_suite::Fixture;

/// A store no other test shares (its own key prefix), and a shared hold on
/// the server, so a test that kills Redis waits for this one to end.
async fn fresh(lock: ServerLock) -> Option<Fixture<RedisLeases>> {
    let url = services::redis_url()?;
    let prefix = format!("keel-test:{}:", uuid_like());
    let leases = RedisLeases::builder(url)
        .key_prefix(prefix)
        .build()
        .expect("a valid URL");
    Some(Fixture::new(leases).keep_alive(lock))
}

fn uuid_like() -> String {
    format!(
        "{:x}{:x}",
        std::process::id(),
        keel_core::clock::utc_now()
            .timestamp_nanos_opt()
            .unwrap_or(0)
    )
}

// The suite's tests await this expression; without a server the test
// returns before it makes a store.
keel_testkit::store_conformance_tests!(
    match fresh(ServerLock::shared(Service::Redis)).await {
        Some(fixture) => std::future::ready(fixture),
        None => return,
    };
    lease
);

const TTL: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_that_loses_every_key_frees_the_lease_but_tokens_keep_growing() {
    let Some(fixture) = fresh(ServerLock::exclusive(Service::Redis)).await else {
        return;
    };
    let leases = fixture.store();
    let first = leases
        .lease_acquire("report", "pod-a", TTL)
        .await
        .expect("acquire")
        .expect("a free lease");
    let extended = leases
        .lease_acquire("report", "pod-a", TTL)
        .await
        .expect("extend")
        .expect("its holder extends it");
    assert_eq!(extended.token, first.token);

    services::crash(Service::Redis).expect("SIGKILL redis-server and start it again");

    // pod-a still believes it holds the lease for 30 s: a lease, not a lock.
    let taken = eventually_acquired(leases, "report", "pod-b").await;
    assert!(
        taken.token > first.token,
        "a new holder after the restart gets a higher token: {} then {}",
        first.token,
        taken.token
    );
    assert!(
        !leases
            .lease_release("report", "pod-a", first.token)
            .await
            .expect("release"),
        "the old holder's release does not end the new holder's lease"
    );
    assert!(
        leases
            .lease_acquire("report", "pod-a", TTL)
            .await
            .expect("acquire")
            .is_none(),
        "the new holder's lease stands"
    );
}

/// The first acquire after a restart, retried while the client reconnects.
async fn eventually_acquired(
    leases: &RedisLeases,
    name: &str,
    holder: &str,
) -> keel_store::LeaseGrant {
    let mut last = None;
    for _ in 0..50 {
        match leases.lease_acquire(name, holder, TTL).await {
            Ok(Some(grant)) => return grant,
            Ok(None) => panic!("the restart kept the lease: Redis had persistence on"),
            Err(err) => last = Some(err),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("Redis did not come back: {last:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_token_is_seeded_from_the_server_clock() {
    let Some(fixture) = fresh(ServerLock::shared(Service::Redis)).await else {
        return;
    };
    let before_us = keel_core::clock::utc_now().timestamp_micros();
    let grant = fixture
        .store()
        .lease_acquire("seeded", "pod-a", TTL)
        .await
        .expect("acquire")
        .expect("a free lease");
    let token = i64::try_from(grant.token).expect("fits");
    // Loopback: the server's clock is this machine's.
    assert!(
        (token - before_us).abs() < 60_000_000,
        "token {token} is the server's time in microseconds (about {before_us})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ping_answers_and_a_stopped_redis_is_an_error_not_a_hang() {
    let Some(fixture) = fresh(ServerLock::exclusive(Service::Redis)).await else {
        return;
    };
    let leases = fixture.store();
    leases.ping().await.expect("PONG");
    services::stop(Service::Redis).expect("stop redis-server");
    let started = keel_core::clock::now();
    let err = leases.ping().await.expect_err("Redis is down");
    let acquire = leases.lease_acquire("down", "pod-a", TTL).await;
    services::start(Service::Redis).expect("start redis-server");
    assert!(
        matches!(
            err,
            StoreError::Unavailable(_) | StoreError::OutcomeUnknown(_)
        ),
        "got {err:?}"
    );
    assert!(acquire.is_err(), "no lease without Redis: {acquire:?}");
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "bounded by the timeout and the retries"
    );
}

#[test]
fn a_bad_url_or_a_zero_timeout_is_refused() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let _guard = runtime.enter();
    let err = RedisLeases::builder("http://not-redis")
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("not a Redis URL"), "{err}");
    let err = RedisLeases::builder("redis://127.0.0.1:1")
        .timeout(Duration::ZERO)
        .build()
        .unwrap_err();
    assert!(err.to_string().starts_with("timeout"), "{err}");
}

/// Two holders at once, as a restart that forgot the lease makes them: the
/// fence where the effect lands accepts the new holder's writes and
/// refuses the old one's, however sure the old one is of its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_restart_the_fence_accepts_only_the_new_holders_writes() {
    use keel_messaging::fence::FenceGate;
    use keel_messaging::lease::LeaseLock;

    let Some(fixture) = fresh(ServerLock::exclusive(Service::Redis)).await else {
        return;
    };
    let leases = fixture.store().clone();
    let pod_a = LeaseLock::new(leases.clone(), "ledger", "pod-a", TTL);
    let pod_b = LeaseLock::new(leases, "ledger", "pod-b", TTL);
    let resource = FenceGate::new();

    let a = pod_a.try_acquire().await.expect("acquire").expect("free");
    resource.admit(a.token()).expect("the holder writes");
    assert!(pod_b.try_acquire().await.expect("acquire").is_none());

    services::crash(Service::Redis).expect("SIGKILL redis-server and start it again");
    let b = loop {
        match pod_b.try_acquire().await {
            Ok(Some(lease)) => break lease,
            Ok(None) => panic!("the restart kept the lease"),
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    assert!(
        a.is_live(),
        "pod-a's lease has not run out by its own clock"
    );
    resource.admit(b.token()).expect("the new holder writes");
    let stale = resource
        .admit(a.token())
        .expect_err("the old holder's write is refused");
    assert_eq!(stale.current, Some(b.token()));
    assert!(
        pod_a.renew(&a).await.expect("renew").is_none(),
        "and the old holder learns it lost the lease at its next renewal"
    );
}

/// The election contract's suite on Redis leases, as on every backend.
mod election_on_leases {
    use keel_messaging::election::LeaseElection;
    use keel_testkit::services::{ServerLock, Service};
    use keel_testkit::store_suite::Fixture;

    keel_testkit::election_conformance_tests!(
        match crate::fresh(ServerLock::shared(Service::Redis)).await {
            Some(leases) => std::future::ready({
                let election = LeaseElection::new(
                    leases.store().clone(),
                    "report",
                    std::time::Duration::from_secs(2),
                );
                Fixture::new(election).keep_alive(leases)
            }),
            None => return,
        }
    );
}
