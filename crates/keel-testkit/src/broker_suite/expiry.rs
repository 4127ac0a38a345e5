//! Expiring groups: a group nobody reads goes, with the topic created for
//! it; one that is read stays.

use std::time::Duration;

use keel_core::clock;
use keel_store::broker::{Broker, SubscribeOptions, Subscription};

use super::support::{
    LONG_LEASE, PATIENCE, ack_all, collect, message, publish, receive, unique_topic,
};

/// The expiry the scenarios use: long enough for a slow machine's polls,
/// short enough to watch pass.
const IDLE: Duration = Duration::from_secs(1);

async fn subscribe_expiring<B: Broker>(
    broker: &B,
    topic: &str,
    group: &str,
) -> Box<dyn Subscription> {
    broker
        .subscribe(
            SubscribeOptions::new(topic, group)
                .lease(LONG_LEASE)
                .expire_after_idle(IDLE),
        )
        .await
        .expect("subscribe failed")
}

async fn sweep<B: Broker>(broker: &B) -> u64 {
    broker.sweep_expired().await.expect("sweep failed")
}

/// Whether `group` of `topic` still exists, as its backlog tells.
async fn exists<B: Broker>(broker: &B, topic: &str, group: &str) -> bool {
    broker
        .backlog(topic, group)
        .await
        .expect("backlog failed")
        .is_some()
}

/// A topic with no group left and no message: a new group finds nothing
/// retained (a topic that still existed would hand it what it keeps).
async fn assert_topic_is_gone<B: Broker>(broker: &B, topic: &str, why: &str) {
    let mut late = broker
        .subscribe(SubscribeOptions::new(topic, "late").lease(LONG_LEASE))
        .await
        .expect("subscribe failed");
    let got = receive(late.as_mut(), 10, Duration::from_millis(500)).await;
    assert!(
        got.is_empty(),
        "{why}: the topic kept {} message(s)",
        got.len()
    );
    broker.remove_group(topic, "late").await.expect("remove");
}

/// A group subscribed with `expire_after_idle` that nobody reads any more
/// is deleted by the sweep once its expiry has passed, not before, and the
/// topic created for it goes too, with the messages nobody read.
pub async fn an_idle_expiring_group_is_swept_with_its_topic<B: Broker>(broker: B) {
    let topic = unique_topic("expiring-idle");
    let mut sub = subscribe_expiring(&broker, &topic, "replies").await;
    publish(&broker, &[message(&topic, "m-1", "k", "read")]).await;
    let reading = clock::now();
    ack_all(&collect(sub.as_mut(), 1, PATIENCE).await).await;
    publish(&broker, &[message(&topic, "m-2", "k", "never read")]).await;
    drop(sub);
    let dropped = clock::now();

    sweep(&broker).await;
    if dropped.elapsed() < IDLE / 2 {
        assert!(
            exists(&broker, &topic, "replies").await,
            "a sweep within the expiry keeps the group"
        );
    }
    let deadline = clock::now() + PATIENCE * 3;
    loop {
        sweep(&broker).await;
        if !exists(&broker, &topic, "replies").await {
            break;
        }
        assert!(clock::now() < deadline, "the idle group was never swept");
        tokio::time::sleep(IDLE / 4).await;
    }
    assert!(
        reading.elapsed() >= IDLE,
        "swept before its expiry passed since the last read"
    );
    // A server that deletes the group itself leaves the topic to the sweep.
    sweep(&broker).await;
    assert_topic_is_gone(&broker, &topic, "after the sweep").await;
}

/// An expiring group whose member keeps reading outlives its expiry many
/// times over, sweeps notwithstanding, and goes on receiving.
pub async fn an_expiring_group_in_use_is_kept<B: Broker>(broker: B) {
    let topic = unique_topic("expiring-used");
    let mut sub = subscribe_expiring(&broker, &topic, "replies").await;
    let until = clock::now() + IDLE * 3;
    while clock::now() < until {
        receive(sub.as_mut(), 10, IDLE / 5).await;
        sweep(&broker).await;
    }
    assert!(
        exists(&broker, &topic, "replies").await,
        "a group in use was swept"
    );
    publish(&broker, &[message(&topic, "m-1", "k", "still here")]).await;
    let got = collect(sub.as_mut(), 1, PATIENCE).await;
    assert_eq!(got.len(), 1, "the member still receives");
    ack_all(&got).await;
    broker
        .remove_group(&topic, "replies")
        .await
        .expect("remove");
}

/// `remove_group` deletes a group at once, and the expiring topic with its
/// last group; a topic that was not created for expiring groups stays for
/// the groups still reading it. Removing a group that does not exist is
/// not an error.
pub async fn remove_group_deletes_at_once<B: Broker>(broker: B) {
    let topic = unique_topic("expiring-removed");
    let sub = subscribe_expiring(&broker, &topic, "replies").await;
    publish(&broker, &[message(&topic, "m-1", "k", "unread")]).await;
    drop(sub);
    broker
        .remove_group(&topic, "replies")
        .await
        .expect("remove");
    assert!(
        !exists(&broker, &topic, "replies").await,
        "the group is gone"
    );
    assert_topic_is_gone(&broker, &topic, "after remove_group").await;

    let kept = unique_topic("kept");
    let mut stays = broker
        .subscribe(SubscribeOptions::new(&kept, "stays").lease(LONG_LEASE))
        .await
        .expect("subscribe failed");
    let leaves = broker
        .subscribe(SubscribeOptions::new(&kept, "leaves").lease(LONG_LEASE))
        .await
        .expect("subscribe failed");
    drop(leaves);
    broker.remove_group(&kept, "leaves").await.expect("remove");
    broker
        .remove_group(&kept, "never-was")
        .await
        .expect("remove unknown");
    publish(&broker, &[message(&kept, "m-1", "k", "for stays")]).await;
    let got = collect(stays.as_mut(), 1, PATIENCE).await;
    assert_eq!(got.len(), 1, "the other group still reads the topic");
    ack_all(&got).await;
}
