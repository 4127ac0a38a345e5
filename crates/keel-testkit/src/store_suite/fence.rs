//! Fencing tokens: strictly increasing per resource, whoever asks.

use std::collections::HashSet;

use keel_store::MessagingStore;

/// Each token is greater than the one before, per resource.
pub async fn tokens_strictly_increase<S: MessagingStore>(store: &S) {
    let mut last = 0;
    for _ in 0..5 {
        let token = store.fence_next("invoice:1").await.expect("fence_next");
        assert!(token > last, "{token} must exceed {last}");
        last = token;
    }
    let other = store.fence_next("invoice:2").await.expect("fence_next");
    assert!(other > 0, "tokens are positive");
    let next = store.fence_next("invoice:1").await.expect("fence_next");
    assert!(next > last, "another resource does not move this one back");
}

/// Many tasks asking at once never get the same token, and each task sees
/// its own tokens increase.
pub async fn tokens_stay_distinct_and_ordered_under_concurrency<S: MessagingStore>(store: &S) {
    const TASKS: usize = 8;
    const PER_TASK: usize = 25;
    let mut handles = Vec::new();
    for _ in 0..TASKS {
        let store = store.clone();
        handles.push(tokio::spawn(async move {
            let mut tokens = Vec::with_capacity(PER_TASK);
            for _ in 0..PER_TASK {
                tokens.push(store.fence_next("ledger").await.expect("fence_next"));
            }
            tokens
        }));
    }
    let mut all = HashSet::new();
    for handle in handles {
        let tokens = handle.await.expect("task");
        assert!(
            tokens.windows(2).all(|w| w[0] < w[1]),
            "a caller's tokens increase: {tokens:?}"
        );
        for token in tokens {
            assert!(all.insert(token), "token {token} handed out twice");
        }
    }
    assert_eq!(all.len(), TASKS * PER_TASK);
}
