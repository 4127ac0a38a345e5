//! The shared dedupe record on a real redis-server (no persistence): the
//! conformance suite every `SharedDedupStore` passes, and a restart that
//! forgets everything, which the promise (at least once) allows.

use keel_redis::RedisDedup;
use keel_store::{DedupClaim, SharedDedupStore};
use keel_testkit::services::{self, ServerLock, Service};
use keel_testkit::store_suite::Fixture;

async fn fresh(lock: ServerLock) -> Option<Fixture<RedisDedup>> {
    let url = services::redis_url()?;
    let prefix = format!("keel-test:{}:", keel_core::id::new_id().simple());
    let dedup = RedisDedup::new(&url, prefix).expect("a valid URL");
    Some(Fixture::new(dedup).keep_alive(lock))
}

// The suite's tests await this expression; without a server the test
// returns before it makes a store.
keel_testkit::shared_dedup_conformance_tests!(
    match fresh(ServerLock::shared(Service::Redis)).await {
        Some(fixture) => std::future::ready(fixture),
        None => return,
    }
);

/// Killed and started empty, Redis forgets a done mark: the message is
/// processed again if it comes back (a duplicate, never a loss).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_forgets_done_marks_so_a_redelivery_is_processed_again() {
    let Some(fixture) = fresh(ServerLock::exclusive(Service::Redis)).await else {
        return;
    };
    let dedup = fixture.store();
    let lease = std::time::Duration::from_secs(30);
    let DedupClaim::Claimed(token) = dedup.dedup_claim("emails", "m-1", lease).await.unwrap()
    else {
        panic!("a new message is claimed");
    };
    assert!(
        dedup
            .dedup_complete("emails", "m-1", &token, lease)
            .await
            .unwrap()
    );
    assert_eq!(
        dedup.dedup_claim("emails", "m-1", lease).await.unwrap(),
        DedupClaim::Done
    );
    services::crash(Service::Redis).expect("SIGKILL redis-server and start it again");
    let again = loop {
        match dedup.dedup_claim("emails", "m-1", lease).await {
            Ok(claim) => break claim,
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(100)).await,
        }
    };
    assert!(
        matches!(again, DedupClaim::Claimed(_)),
        "forgotten: processed again, {again:?}"
    );
}
