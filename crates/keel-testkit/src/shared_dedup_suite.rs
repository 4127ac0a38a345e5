//! The shared dedupe record's conformance suite: what every
//! `SharedDedupStore` must do, written once and run against each backend
//! (Redis, and [`MemoryDedup`], the model that checks the suite itself).
//!
//! Run it with [`shared_dedup_conformance_tests!`](crate::shared_dedup_conformance_tests),
//! giving an async expression that makes a store no other test uses.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keel_core::clock::{self, Instant};
use keel_store::{DedupClaim, DedupToken, SharedDedupStore, StoreError};
use tokio::sync::Mutex;

const LEASE: Duration = Duration::from_secs(30);
const REMEMBER: Duration = Duration::from_secs(60);

async fn claimed<S: SharedDedupStore>(
    store: &S,
    scope: &str,
    id: &str,
    lease: Duration,
) -> DedupToken {
    match store.dedup_claim(scope, id, lease).await.expect("claim") {
        DedupClaim::Claimed(token) => token,
        other => panic!("{scope}/{id}: expected a claim, got {other:?}"),
    }
}

/// The first claim wins; while it lives, everyone else finds it in
/// progress; scopes (consumer groups) are independent.
pub async fn a_claim_is_one_consumers_while_it_lives<S: SharedDedupStore>(store: &S) {
    claimed(store, "emails", "m-1", LEASE).await;
    assert_eq!(
        store
            .dedup_claim("emails", "m-1", LEASE)
            .await
            .expect("claim"),
        DedupClaim::InProgress
    );
    claimed(store, "search-index", "m-1", LEASE).await;
}

/// A completed message is done for its remembered time, then forgotten.
pub async fn done_is_remembered_for_its_time<S: SharedDedupStore>(store: &S) {
    let token = claimed(store, "emails", "m-2", LEASE).await;
    let remember = Duration::from_millis(500);
    assert!(
        store
            .dedup_complete("emails", "m-2", &token, remember)
            .await
            .expect("complete")
    );
    assert_eq!(
        store
            .dedup_claim("emails", "m-2", LEASE)
            .await
            .expect("claim"),
        DedupClaim::Done
    );
    tokio::time::sleep(remember + Duration::from_millis(300)).await;
    claimed(store, "emails", "m-2", LEASE).await;
}

/// An abandoned claim (the effect failed) is claimable at once.
pub async fn an_abandoned_claim_is_claimable_at_once<S: SharedDedupStore>(store: &S) {
    let token = claimed(store, "emails", "m-3", LEASE).await;
    assert!(
        store
            .dedup_abandon("emails", "m-3", &token)
            .await
            .expect("abandon")
    );
    claimed(store, "emails", "m-3", LEASE).await;
}

/// A claim that ran out (its consumer died or stalled) is taken over, and
/// the old token can then neither complete nor abandon the new claim.
pub async fn an_expired_claim_is_taken_over_and_its_token_is_stale<S: SharedDedupStore>(store: &S) {
    let lease = Duration::from_millis(300);
    let old = claimed(store, "emails", "m-4", lease).await;
    tokio::time::sleep(lease + Duration::from_millis(200)).await;
    let new = claimed(store, "emails", "m-4", LEASE).await;
    assert_ne!(old, new);
    assert!(
        !store
            .dedup_complete("emails", "m-4", &old, REMEMBER)
            .await
            .expect("complete")
    );
    assert!(
        !store
            .dedup_abandon("emails", "m-4", &old)
            .await
            .expect("abandon")
    );
    assert!(
        store
            .dedup_complete("emails", "m-4", &new, REMEMBER)
            .await
            .expect("complete")
    );
}

/// Consumers racing for one message: exactly one gets the claim.
pub async fn racing_consumers_get_one_claim<S: SharedDedupStore>(store: &S) {
    let racers = (0..16).map(|_| {
        let store = store.clone();
        tokio::spawn(async move { store.dedup_claim("emails", "m-5", LEASE).await })
    });
    let mut claims = 0;
    for racer in racers {
        if matches!(
            racer.await.expect("racer").expect("claim"),
            DedupClaim::Claimed(_)
        ) {
            claims += 1;
        }
    }
    assert_eq!(claims, 1);
}

/// Per (scope, id): the claim's token (`None` once done) and until when
/// the record lives.
type Records = HashMap<(String, String), (Option<DedupToken>, Instant)>;

/// Whether `token` holds a live claim on `key`.
fn holds(records: &Records, key: &(String, String), token: &DedupToken) -> bool {
    matches!(records.get(key), Some((Some(t), until)) if t == token && *until > clock::now())
}

/// The model: claims and done marks in a map, on tokio's clock.
#[derive(Debug, Clone, Default)]
pub struct MemoryDedup {
    records: Arc<Mutex<Records>>,
}

#[async_trait]
impl SharedDedupStore for MemoryDedup {
    async fn dedup_claim(
        &self,
        scope: &str,
        id: &str,
        lease: Duration,
    ) -> Result<DedupClaim, StoreError> {
        let mut records = self.records.lock().await;
        let key = (scope.to_owned(), id.to_owned());
        match records.get(&key) {
            Some((None, until)) if *until > clock::now() => return Ok(DedupClaim::Done),
            Some((Some(_), until)) if *until > clock::now() => return Ok(DedupClaim::InProgress),
            _ => {}
        }
        let token = DedupToken(keel_core::id::new_id().simple().to_string());
        records.insert(key, (Some(token.clone()), clock::now() + lease));
        Ok(DedupClaim::Claimed(token))
    }

    async fn dedup_complete(
        &self,
        scope: &str,
        id: &str,
        token: &DedupToken,
        remember: Duration,
    ) -> Result<bool, StoreError> {
        let mut records = self.records.lock().await;
        let key = (scope.to_owned(), id.to_owned());
        let held = holds(&records, &key, token);
        if held {
            records.insert(key, (None, clock::now() + remember));
        }
        Ok(held)
    }

    async fn dedup_abandon(
        &self,
        scope: &str,
        id: &str,
        token: &DedupToken,
    ) -> Result<bool, StoreError> {
        let mut records = self.records.lock().await;
        let key = (scope.to_owned(), id.to_owned());
        let held = holds(&records, &key, token);
        if held {
            records.remove(&key);
        }
        Ok(held)
    }
}

/// Expands into one `#[tokio::test]` per behaviour, each against the store
/// `$make` (an async expression yielding a store or a
/// [`Fixture`](crate::store_suite::Fixture)) makes.
#[macro_export]
macro_rules! shared_dedup_conformance_tests {
    ($make:expr) => {
        $crate::shared_dedup_conformance_tests!(@tests $make;
            a_claim_is_one_consumers_while_it_lives,
            done_is_remembered_for_its_time,
            an_abandoned_claim_is_claimable_at_once,
            an_expired_claim_is_taken_over_and_its_token_is_stale,
            racing_consumers_get_one_claim,
        );
    };
    (@tests $make:expr; $($test:ident),* $(,)?) => {
        mod shared_dedup_conformance {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    let fixture = $crate::store_suite::Fixture::from($make.await);
                    $crate::shared_dedup_suite::$test(fixture.store()).await;
                }
            )*
        }
    };
}

#[cfg(test)]
mod model {
    use super::MemoryDedup;

    crate::shared_dedup_conformance_tests!(async { MemoryDedup::default() });
}
