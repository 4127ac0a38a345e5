//! Outbox archiving: published rows past a cut-off move to the archive in
//! bounded batches, once each, never an unpublished one, and stay listed
//! there after they left the outbox.

use std::time::Duration;

use keel_store::{OutboxAdminStore, OutboxStore};

use super::now_ms;
use super::outbox::{append_committed, record};

/// Published rows before the cut-off move in bounded batches; unpublished
/// and later rows stay; each archived row is listed once, by id.
pub async fn archive_moves_published_rows_in_bounded_batches<S: OutboxStore + OutboxAdminStore>(
    store: &S,
) {
    let records: Vec<_> = (0..6)
        .map(|i| record(&format!("e-{i}"), &format!("K-{i}")))
        .collect();
    append_committed(store, &records).await;
    let claimed = store
        .outbox_claim("relay-a", 10, Duration::from_secs(60))
        .await
        .expect("claim");
    let ids: Vec<i64> = claimed.iter().map(|p| p.id).collect();
    store.outbox_mark_published(&ids[..5]).await.expect("mark");
    store
        .outbox_release("relay-a", &ids[5..])
        .await
        .expect("release");

    let earlier = now_ms() - chrono::TimeDelta::seconds(5);
    assert_eq!(
        store.outbox_archive(earlier, 100).await.expect("archive"),
        0
    );

    let later = now_ms() + chrono::TimeDelta::minutes(1);
    let mut moved = Vec::new();
    for _ in 0..4 {
        moved.push(store.outbox_archive(later, 2).await.expect("archive"));
    }
    assert_eq!(moved, [2, 2, 1, 0], "bounded batches until none is left");
    assert_eq!(store.outbox_published(0, 10).await.expect("published"), []);
    let archived = store.outbox_archived(0, 10).await.expect("archived");
    let listed: Vec<(i64, String)> = archived
        .iter()
        .map(|a| (a.id, a.event_id.clone()))
        .collect();
    let expected: Vec<(i64, String)> = ids[..5]
        .iter()
        .enumerate()
        .map(|(i, id)| (*id, format!("e-{i}")))
        .collect();
    assert_eq!(listed, expected, "each once, lowest id first");
    let page = store.outbox_archived(ids[2], 10).await.expect("page");
    assert_eq!(page, archived[3..]);
    let stats = store.outbox_stats().await.expect("stats");
    assert_eq!(stats.unpublished, 1, "the unpublished row never moves");
}
