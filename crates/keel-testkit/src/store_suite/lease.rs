//! Leases: one holder at a time while the lease runs, a higher token for
//! every new holder, the same token while one holder extends it.

use std::time::Duration;

use keel_store::LeaseStore;

const LONG: Duration = Duration::from_secs(60);

/// A running lease is its holder's alone; the holder extends it under the
/// same token; once it runs out another holder takes it with a higher one.
pub async fn a_lease_is_one_holders_until_it_runs_out<S: LeaseStore>(store: &S) {
    let first = store
        .lease_acquire("report", "pod-a", Duration::from_millis(300))
        .await
        .expect("acquire")
        .expect("a free lease is granted");
    assert!(
        store
            .lease_acquire("report", "pod-b", LONG)
            .await
            .expect("acquire")
            .is_none(),
        "another holder waits while it runs"
    );
    let extended = store
        .lease_acquire("report", "pod-a", Duration::from_millis(300))
        .await
        .expect("extend")
        .expect("its holder extends it");
    assert_eq!(extended.token, first.token, "extending keeps the token");
    assert!(extended.expires_at >= first.expires_at);
    assert!(
        store
            .lease_acquire("other", "pod-b", LONG)
            .await
            .expect("acquire")
            .is_some(),
        "leases are independent by name"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    let taken = store
        .lease_acquire("report", "pod-b", LONG)
        .await
        .expect("acquire")
        .expect("an expired lease is taken over");
    assert!(taken.token > first.token, "a new holder, a higher token");
    assert!(
        store
            .lease_acquire("report", "pod-a", LONG)
            .await
            .expect("acquire")
            .is_none(),
        "the old holder lost it"
    );
}

/// Releasing ends the lease at once, only for its holder and token, and
/// the next holder's token is still higher.
pub async fn release_ends_a_lease_and_tokens_keep_growing<S: LeaseStore>(store: &S) {
    let a = store
        .lease_acquire("prune", "pod-a", LONG)
        .await
        .expect("acquire")
        .expect("granted");
    assert!(
        !store
            .lease_release("prune", "pod-b", a.token)
            .await
            .expect("release"),
        "not another holder's to release"
    );
    assert!(
        !store
            .lease_release("prune", "pod-a", a.token + 1)
            .await
            .expect("release"),
        "not under another token"
    );
    assert!(
        store
            .lease_release("prune", "pod-a", a.token)
            .await
            .expect("release")
    );
    let b = store
        .lease_acquire("prune", "pod-b", LONG)
        .await
        .expect("acquire")
        .expect("a released lease is free");
    assert!(b.token > a.token);
    store
        .lease_release("prune", "pod-b", b.token)
        .await
        .expect("release");
    let again = store
        .lease_acquire("prune", "pod-b", LONG)
        .await
        .expect("acquire")
        .expect("granted");
    assert!(
        again.token > b.token,
        "even the same holder, after releasing"
    );
}

/// Holders racing for a free lease: exactly one gets it.
pub async fn racing_holders_get_one_lease<S: LeaseStore>(store: &S) {
    let attempts = (0..8).map(|i| {
        let store = store.clone();
        tokio::spawn(async move {
            store
                .lease_acquire("leader", &format!("pod-{i}"), LONG)
                .await
                .expect("acquire")
        })
    });
    let mut granted = 0;
    for attempt in attempts {
        if attempt.await.expect("task").is_some() {
            granted += 1;
        }
    }
    assert_eq!(granted, 1);
}
