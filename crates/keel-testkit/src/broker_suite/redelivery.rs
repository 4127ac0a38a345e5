//! Nacks, leases and lost leases: at-least-once, and never early.
//!
//! Timing assertions here are one-sided where a slow machine could break
//! them: "not before the delay" compares against a clock read *before* the
//! settle was sent, so a stall can only make a scenario more lenient, never
//! fail it falsely.

use std::time::Duration;

use keel_core::clock;
use keel_store::broker::{Broker, BrokerError};

use super::support::{
    LONG_LEASE, PATIENCE, SHORT_LEASE, SLOP, collect, declare_groups, drain_for, ids, message,
    publish, receive, subscribe, unique_topic, wait_for,
};

/// A nack with a delay redelivers the message after the delay, not before,
/// with the delivery count one higher.
pub async fn nack_with_delay_redelivers_after_the_delay<B: Broker>(broker: B) {
    let topic = unique_topic("nack-delay");
    declare_groups(&broker, &topic, &["g"]).await;
    publish(&broker, &[message(&topic, "m-1", "k", "x")]).await;
    let mut sub = subscribe(&broker, &topic, "g", LONG_LEASE).await;
    let first = collect(sub.as_mut(), 1, PATIENCE).await;
    assert_eq!(ids(&first), ["m-1"]);
    assert_eq!(first[0].delivery_count, 1);

    let delay = Duration::from_millis(400);
    let nacked_at = clock::now();
    first[0].nack(delay).await.expect("nack");
    let (again, others) = wait_for(sub.as_mut(), "m-1", PATIENCE).await;
    assert!(
        others.is_empty(),
        "unexpected deliveries: {:?}",
        ids(&others)
    );
    let (again, at) = again.expect("the nacked message is redelivered");
    assert!(
        at + SLOP >= nacked_at + delay,
        "redelivered {:?} after a nack with a {delay:?} delay",
        at - nacked_at
    );
    assert_eq!(again.delivery_count, 2, "the delivery count goes up");
    again.ack().await.expect("ack");
}

/// A nack without delay redelivers promptly.
pub async fn nack_without_delay_redelivers_promptly<B: Broker>(broker: B) {
    let topic = unique_topic("nack-now");
    declare_groups(&broker, &topic, &["g"]).await;
    publish(&broker, &[message(&topic, "m-1", "k", "x")]).await;
    let mut sub = subscribe(&broker, &topic, "g", LONG_LEASE).await;
    let first = collect(sub.as_mut(), 1, PATIENCE).await;
    assert_eq!(ids(&first), ["m-1"]);
    first[0].nack(Duration::ZERO).await.expect("nack");
    let again = collect(sub.as_mut(), 1, Duration::from_secs(3)).await;
    assert_eq!(ids(&again), ["m-1"], "redelivered promptly");
    assert_eq!(again[0].delivery_count, 2);
    again[0].ack().await.expect("ack");
}

/// A delivery neither acked nor nacked comes back once its lease runs out,
/// not before, with the delivery count one higher.
pub async fn lease_expiry_redelivers<B: Broker>(broker: B) {
    let topic = unique_topic("lease-expiry");
    declare_groups(&broker, &topic, &["g"]).await;
    publish(&broker, &[message(&topic, "m-1", "k", "x")]).await;
    let mut sub = subscribe(&broker, &topic, "g", SHORT_LEASE).await;
    let asked_at = clock::now();
    let first = collect(sub.as_mut(), 1, PATIENCE).await;
    assert_eq!(ids(&first), ["m-1"]);
    // Simulate a consumer that crashed: never settle `first`.
    let (again, _) = wait_for(sub.as_mut(), "m-1", PATIENCE).await;
    let (again, at) = again.expect("redelivered after the lease ran out");
    assert!(
        at + SLOP >= asked_at + SHORT_LEASE,
        "redelivered {:?} into a {SHORT_LEASE:?} lease",
        at - asked_at
    );
    assert_eq!(again.delivery_count, 2);
    again.ack().await.expect("ack");
    drop(first);
}

/// Extending a lease keeps the message away from the rest of the group past
/// the original lease; it comes back only after the extended one.
pub async fn extend_lease_keeps_it_invisible<B: Broker>(broker: B) {
    let topic = unique_topic("extend");
    declare_groups(&broker, &topic, &["g"]).await;
    publish(&broker, &[message(&topic, "m-1", "k", "x")]).await;
    let mut holder = subscribe(&broker, &topic, "g", SHORT_LEASE).await;
    let mut other = subscribe(&broker, &topic, "g", SHORT_LEASE).await;
    let first = collect(holder.as_mut(), 1, PATIENCE).await;
    assert_eq!(ids(&first), ["m-1"]);

    let extension = Duration::from_millis(1500);
    let extended_at = clock::now();
    first[0]
        .extend_lease(extension)
        .await
        .expect("extend_lease");
    // Watch well past the original lease.
    let seen = drain_for(other.as_mut(), SHORT_LEASE * 3).await;
    for (delivery, at) in &seen {
        assert!(
            *at + SLOP >= extended_at + extension,
            "{} delivered {:?} into an extended lease of {extension:?}",
            delivery.message.id,
            *at - extended_at
        );
    }
    if seen.is_empty() {
        let (again, _) = wait_for(other.as_mut(), "m-1", PATIENCE).await;
        let (again, at) = again.expect("redelivered after the extended lease");
        assert!(at + SLOP >= extended_at + extension);
        assert_eq!(again.delivery_count, 2);
        again.ack().await.expect("ack");
    }
}

/// Once a lease ran out and another consumer received the message, every
/// kind of settle of the stale delivery fails with `LeaseLost` and changes
/// nothing: the new holder's lease and ack stand, and nothing is
/// redelivered.
pub async fn settle_after_lease_loss_is_lease_lost<B: Broker>(broker: B) {
    let topic = unique_topic("lease-lost");
    declare_groups(&broker, &topic, &["g"]).await;
    let actions = ["ack", "nack", "extend", "terminate"];
    let sent: Vec<_> = actions.iter().map(|a| message(&topic, a, a, "x")).collect();
    publish(&broker, &sent).await;
    let mut slow = subscribe(&broker, &topic, "g", SHORT_LEASE).await;
    let mut fast = subscribe(&broker, &topic, "g", SHORT_LEASE).await;
    let stale = collect(slow.as_mut(), actions.len(), PATIENCE).await;
    assert_eq!(stale.len(), actions.len());
    // The slow consumer stalls past its lease; the fast one takes over.
    let fresh = collect(fast.as_mut(), actions.len(), PATIENCE).await;
    assert_eq!(
        ids(&fresh),
        ids(&stale),
        "redelivered to the other consumer after the lease ran out"
    );
    assert!(
        fresh.iter().all(|d| d.delivery_count == 2),
        "second deliveries"
    );
    // The new holder keeps its leases for the rest of the scenario.
    for delivery in &fresh {
        delivery
            .extend_lease(LONG_LEASE)
            .await
            .expect("the new holder extends its lease");
    }

    for delivery in &stale {
        let outcome = match delivery.message.id.as_str() {
            "ack" => delivery.ack().await,
            "nack" => delivery.nack(Duration::ZERO).await,
            "extend" => delivery.extend_lease(LONG_LEASE).await,
            _ => delivery.terminate().await,
        };
        assert!(
            matches!(outcome, Err(BrokerError::LeaseLost)),
            "a stale {} returned {outcome:?}",
            delivery.message.id
        );
    }
    // The stale nack released nothing: the new holder still has everything.
    let meanwhile = receive(slow.as_mut(), 10, Duration::from_millis(300)).await;
    assert!(
        meanwhile.is_empty(),
        "a stale settle released: {:?}",
        ids(&meanwhile)
    );
    for delivery in &fresh {
        delivery.ack().await.expect("the new holder's ack stands");
    }
    let after = receive(fast.as_mut(), 10, SHORT_LEASE * 2).await;
    assert!(
        after.is_empty(),
        "acked messages came back: {:?}",
        ids(&after)
    );
}
