//! Entity versions: a version is recorded only over an older one, in the
//! caller's transaction, per scope; racing writers serialize.

use std::time::Duration;

use keel_messaging::version_guard::{Freshness, VersionGuard, VersionGuardError};
use keel_store::MessagingStore;
use keel_store::envelope::Envelope;

async fn advance<S: MessagingStore>(store: &S, scope: &str, entity: &str, version: u64) -> bool {
    let mut tx = store.begin().await.expect("begin");
    let newer = store
        .entity_version_advance(&mut tx, scope, entity, version)
        .await
        .expect("advance");
    store.commit(tx).await.expect("commit");
    newer
}

/// Only a higher version is recorded; the same or a lower one is refused
/// and changes nothing.
pub async fn only_a_newer_version_advances<S: MessagingStore>(store: &S) {
    assert_eq!(
        store.entity_version_get("proj", "A-1").await.expect("get"),
        None
    );
    assert!(advance(store, "proj", "A-1", 2).await, "first seen");
    assert!(
        !advance(store, "proj", "A-1", 2).await,
        "the same version again"
    );
    assert!(!advance(store, "proj", "A-1", 1).await, "an older one");
    assert!(advance(store, "proj", "A-1", 5).await, "a gap is fine");
    assert_eq!(
        store.entity_version_get("proj", "A-1").await.expect("get"),
        Some(5)
    );
    assert!(
        advance(store, "proj", "A-2", 1).await,
        "entities are independent"
    );
    assert!(advance(store, "other", "A-1", 1).await, "so are scopes");
    assert_eq!(
        store.entity_version_get("proj", "A-1").await.expect("get"),
        Some(5)
    );
    assert_eq!(
        store.entity_version_get("other", "A-1").await.expect("get"),
        Some(1)
    );
}

/// A version recorded in a transaction that rolls back was never recorded.
pub async fn a_rolled_back_advance_leaves_nothing<S: MessagingStore>(store: &S) {
    assert!(advance(store, "proj", "A-1", 1).await);
    let mut tx = store.begin().await.expect("begin");
    assert!(
        store
            .entity_version_advance(&mut tx, "proj", "A-1", 7)
            .await
            .expect("advance")
    );
    store.rollback(tx).await.expect("rollback");
    assert_eq!(
        store.entity_version_get("proj", "A-1").await.expect("get"),
        Some(1)
    );
    assert!(advance(store, "proj", "A-1", 7).await, "7 is still news");
}

/// Two transactions advancing one entity at once: the second waits for the
/// first, then is judged against its version, so the older event loses
/// whichever commits first.
pub async fn racing_advances_serialize<S: MessagingStore>(store: &S) {
    assert!(advance(store, "proj", "A-1", 1).await);
    let mut first = store.begin().await.expect("begin");
    assert!(
        store
            .entity_version_advance(&mut first, "proj", "A-1", 3)
            .await
            .expect("advance")
    );
    let racer = store.clone();
    let second = tokio::spawn(async move { advance(&racer, "proj", "A-1", 2).await });
    tokio::time::sleep(Duration::from_millis(50)).await;
    store.commit(first).await.expect("commit");
    assert!(
        !second.await.expect("join"),
        "2 is older than the committed 3"
    );
    assert_eq!(
        store.entity_version_get("proj", "A-1").await.expect("get"),
        Some(3)
    );
}

/// The guard reads the entity and version from the envelope: events that
/// arrive out of order are admitted only when newer, and an event that
/// cannot be ordered is refused as permanent.
pub async fn the_guard_drops_events_that_arrive_late<S: MessagingStore>(store: &S) {
    let guard = VersionGuard::new(store.clone(), "order-projection");
    let event = |version: u64| {
        let mut env = Envelope::new("/services/orders", "shop.order.changed.v1");
        env.subject = Some("A-4471".to_owned());
        env.data = Some(serde_json::json!({ "version": version }));
        env
    };
    let mut admitted = Vec::new();
    for version in [1, 3, 2, 3, 4] {
        let mut tx = store.begin().await.expect("begin");
        if guard.admit(&mut tx, &event(version)).await.expect("admit") == Freshness::Newer {
            admitted.push(version);
        }
        store.commit(tx).await.expect("commit");
    }
    assert_eq!(
        admitted,
        [1, 3, 4],
        "2 came after 3; the second 3 is a repeat"
    );
    assert_eq!(guard.applied("A-4471").await.expect("applied"), Some(4));

    let mut unordered = event(5);
    unordered.subject = None;
    let mut tx = store.begin().await.expect("begin");
    let err = guard
        .admit(&mut tx, &unordered)
        .await
        .expect_err("no subject");
    assert!(
        matches!(
            err,
            VersionGuardError::Unversioned {
                missing: "subject",
                ..
            }
        ),
        "{err:?}"
    );
    store.rollback(tx).await.expect("rollback");
}
