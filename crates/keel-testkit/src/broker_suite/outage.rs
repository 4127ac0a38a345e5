//! A broker server's outage under load: the scenario every broker's
//! crash and restart tests share.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use keel_core::{Classify, ErrorClass, clock};
use keel_store::broker::{Broker, Message, SubscribeOptions};

use crate::ledger::Ledger;

/// The server goes away (`outage`: a restart, or a `SIGKILL` and a start)
/// while a publisher and a consumer run: errors on the way are retryable
/// or outcome-unknown, and (republishing with the same ids, the consumer
/// deduping by id as an inbox does) every message takes effect exactly
/// once and in per-key order. Afterwards the client works again and a
/// republish of everything is deduped. Returns how many publishes failed
/// and were retried.
pub async fn an_outage_under_load_loses_nothing<B: Broker>(
    broker: Arc<B>,
    outage: impl FnOnce() + Send + 'static,
) -> usize {
    const MESSAGES: usize = 400;
    const KEYS: usize = 8;
    let topic = "ledger";
    let ledger = Ledger::with_handlers(["effects"]);
    let messages: Vec<Message> = (0..MESSAGES)
        .map(|i| {
            let key = format!("entity-{}", i % KEYS);
            ledger.committed(format!("m-{i:04}"), &key, (i / KEYS + 1) as u64);
            Message::new(format!("m-{i:04}"), topic, key, i.to_string())
        })
        .collect();
    let mut sub = broker
        .subscribe(SubscribeOptions::new(topic, "effects").lease(Duration::from_secs(2)))
        .await
        .expect("subscribe");

    let publisher = {
        let broker = broker.clone();
        let messages = messages.clone();
        tokio::spawn(async move {
            let mut errors = 0;
            for chunk in messages.chunks(10) {
                while let Err(error) = broker.publish(chunk).await {
                    assert!(
                        matches!(
                            error.class(),
                            ErrorClass::Retryable | ErrorClass::OutcomeUnknown
                        ),
                        "the outage caused a permanent error: {error}"
                    );
                    errors += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                tokio::time::sleep(Duration::from_millis(15)).await;
            }
            errors
        })
    };
    let consumer = {
        let ledger = ledger.clone();
        tokio::spawn(async move {
            let mut applied = HashSet::new();
            let deadline = clock::now() + Duration::from_secs(80);
            while applied.len() < MESSAGES && clock::now() < deadline {
                let batch = match sub.receive(32, Duration::from_millis(200)).await {
                    Ok(batch) => batch,
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                for delivery in batch {
                    let id = delivery.message.id.clone();
                    ledger.published(&id);
                    if applied.insert(id.clone()) {
                        ledger.applied(&id, "effects");
                    }
                    // A failed ack is redelivered; the dedupe absorbs it.
                    let _ = delivery.ack().await;
                }
            }
            (applied.len(), sub)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !publisher.is_finished(),
        "the outage must hit a running publisher"
    );
    tokio::task::spawn_blocking(outage)
        .await
        .expect("the outage panicked");
    let publish_errors = publisher.await.expect("publisher panicked");
    let (applied, mut sub) = consumer.await.expect("consumer panicked");
    assert_eq!(applied, MESSAGES, "every message took effect");
    if let Err(error) = ledger.check() {
        panic!("the outage broke an invariant: {error}");
    }
    broker.ping().await.expect("the client reconnected");
    // The dedupe survived the outage: republishing everything stores
    // nothing new.
    broker.publish(&messages).await.expect("republish");
    let again = sub
        .receive(10, Duration::from_millis(500))
        .await
        .expect("receive");
    assert!(
        again.is_empty(),
        "a republish after the outage was delivered again"
    );
    publish_errors
}
