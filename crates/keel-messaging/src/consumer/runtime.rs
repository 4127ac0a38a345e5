//! The moving parts of a running consumer: receive loops that take only as
//! many messages as there are free slots, per-key chains that process them
//! in order, and the shutdown signals that stop and drain them.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tracing::Instrument;

use super::handler::Disposition;
use super::process::{ConsumerStore, Processor, Route};
use crate::broker::{Broker, Delivery, Subscription};

/// What the receive loops and delivery chains share.
pub(super) struct Shared<S: ConsumerStore> {
    pub(super) processor: Arc<Processor<S>>,
    pub(super) slots: Arc<Semaphore>,
    pub(super) stop: watch::Receiver<bool>,
    pub(super) abort: watch::Receiver<bool>,
    pub(super) released: Arc<AtomicUsize>,
}

impl<S: ConsumerStore> Clone for Shared<S> {
    fn clone(&self) -> Self {
        Self {
            processor: Arc::clone(&self.processor),
            slots: Arc::clone(&self.slots),
            stop: self.stop.clone(),
            abort: self.abort.clone(),
            released: Arc::clone(&self.released),
        }
    }
}

/// Receives batches for one route while slots are free, and hands each
/// batch out as per-key chains.
pub(super) async fn receive_loop<S, B>(
    broker: Arc<B>,
    route: Arc<Route<S::Tx>>,
    mut shared: Shared<S>,
) where
    S: ConsumerStore,
    S::Tx: 'static,
    B: Broker + ?Sized,
{
    let Some(mut subscription) = subscribe(broker.as_ref(), &route, &mut shared).await else {
        return;
    };
    let processor = Arc::clone(&shared.processor);
    let options = &processor.options;
    let mut failures: u32 = 0;
    loop {
        let free = tokio::select! {
            permit = Arc::clone(&shared.slots).acquire_owned() => match permit {
                Ok(p) => p,
                Err(_) => break,
            },
            () = stopped(&mut shared.stop) => break,
        };
        // Ask for as many messages as there are free slots, but hold none
        // while the broker waits: an idle group must not sit on the slots a
        // busy one needs.
        let want = (1 + shared.slots.available_permits()).min(options.max_in_flight.get());
        drop(free);
        let batch = match subscription.receive(want, options.receive_wait).await {
            Ok(batch) => {
                failures = 0;
                batch
            }
            Err(err) => {
                let delay = options.backoff.delay(failures).unwrap_or_default();
                failures = failures.saturating_add(1);
                tracing::warn!(topic = %route.topic, group = %route.group, error = %err, ?delay,
                    "receive failed; backing off");
                tokio::select! {
                    () = tokio::time::sleep(delay) => continue,
                    () = stopped(&mut shared.stop) => break,
                }
            }
        };
        let Some(permits) = slots_for(&mut shared, batch.len()).await else {
            for delivery in &batch {
                release(&route, &shared, delivery).await;
            }
            break;
        };
        dispatch(&route, &shared, batch, permits).await;
        if *shared.stop.borrow() {
            break;
        }
    }
}

/// A slot for each of `n` received deliveries: usually free at once, else
/// as soon as handlers finish. `None` if shutdown began while waiting.
async fn slots_for<S: ConsumerStore>(
    shared: &mut Shared<S>,
    n: usize,
) -> Option<Vec<OwnedSemaphorePermit>> {
    let mut permits = Vec::with_capacity(n);
    while permits.len() < n {
        tokio::select! {
            permit = Arc::clone(&shared.slots).acquire_owned() => permits.push(permit.ok()?),
            () = stopped(&mut shared.stop) => return None,
        }
    }
    Some(permits)
}

/// Prunes the inbox now and every prune interval until shutdown.
pub(super) async fn prune_inbox_loop<S: ConsumerStore>(mut shared: Shared<S>, retention: Duration) {
    let every = shared.processor.options.inbox_prune_interval;
    loop {
        if let Err(err) = shared.processor.prune_inbox(retention).await {
            tracing::warn!(error = %err, "inbox prune failed; trying again next interval");
        }
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            () = stopped(&mut shared.stop) => return,
        }
    }
}

/// Subscribes, retrying with backoff until it works or shutdown begins.
async fn subscribe<S: ConsumerStore, B: Broker + ?Sized>(
    broker: &B,
    route: &Route<S::Tx>,
    shared: &mut Shared<S>,
) -> Option<Box<dyn Subscription>> {
    let options = &shared.processor.options;
    let mut failures: u32 = 0;
    loop {
        match broker.subscribe(route.subscribe_options(options)).await {
            Ok(sub) => return Some(sub),
            Err(err) => {
                let delay = options.backoff.delay(failures).unwrap_or_default();
                failures = failures.saturating_add(1);
                tracing::warn!(topic = %route.topic, group = %route.group, error = %err, ?delay,
                    "subscribe failed; retrying");
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = stopped(&mut shared.stop) => return None,
                }
            }
        }
    }
}

/// Splits a batch into per-key chains (order kept within a key) and spawns
/// one task per chain. Deliveries beyond the slots taken are given back.
async fn dispatch<S>(
    route: &Arc<Route<S::Tx>>,
    shared: &Shared<S>,
    batch: Vec<Delivery>,
    permits: Vec<OwnedSemaphorePermit>,
) where
    S: ConsumerStore,
    S::Tx: 'static,
{
    let mut chains: Vec<Vec<(Delivery, OwnedSemaphorePermit)>> = Vec::new();
    let mut by_key: HashMap<String, usize> = HashMap::new();
    let mut permits = permits.into_iter();
    for delivery in batch {
        let Some(permit) = permits.next() else {
            // The broker returned more than asked for: give the rest back.
            shared
                .processor
                .settle_nack(route, &delivery, Duration::ZERO)
                .await;
            continue;
        };
        let index = *by_key
            .entry(delivery.message.key.clone())
            .or_insert_with(|| {
                chains.push(Vec::new());
                chains.len() - 1
            });
        chains[index].push((delivery, permit));
    }
    for chain in chains {
        tokio::spawn(run_chain(Arc::clone(route), shared.clone(), chain));
    }
}

/// Processes one key's deliveries in order, each in its own task so a
/// panicking handler is contained, and releases what shutdown interrupts.
async fn run_chain<S>(
    route: Arc<Route<S::Tx>>,
    mut shared: Shared<S>,
    chain: Vec<(Delivery, OwnedSemaphorePermit)>,
) where
    S: ConsumerStore,
    S::Tx: 'static,
{
    for (delivery, permit) in chain {
        if *shared.stop.borrow() {
            release(&route, &shared, &delivery).await;
            drop(permit);
            continue;
        }
        let delivery = Arc::new(delivery);
        metrics::gauge!("keel_consumer_in_flight", route.labels.iter()).increment(1.0);
        let span = tracing::info_span!("keel.consume",
            topic = %route.topic, group = %route.group,
            message_id = %delivery.message.id, key = %delivery.message.key,
            delivery_count = delivery.delivery_count);
        let mut task = tokio::spawn({
            let processor = Arc::clone(&shared.processor);
            let route = Arc::clone(&route);
            let delivery = Arc::clone(&delivery);
            async move { processor.process(&route, &delivery).await }.instrument(span)
        });
        let joined = tokio::select! {
            joined = &mut task => Some(joined),
            () = stopped(&mut shared.abort) => None,
        };
        match joined {
            Some(Ok(outcome)) => tracing::trace!(?outcome, "delivery done"),
            Some(Err(err)) if err.is_panic() => {
                let why = format!("handler panicked: {}", panic_text(err.into_panic()));
                tracing::error!(message_id = %delivery.message.id, "{why}");
                shared
                    .processor
                    .failed(
                        &route,
                        &delivery,
                        why,
                        Disposition::Retry { after: None },
                        None,
                    )
                    .await;
            }
            Some(Err(_)) => {}
            None => {
                task.abort();
                let _ = task.await;
                release(&route, &shared, &delivery).await;
            }
        }
        metrics::gauge!("keel_consumer_in_flight", route.labels.iter()).decrement(1.0);
        drop(permit);
    }
}

/// Gives a delivery back unprocessed, to be delivered again at once.
async fn release<S: ConsumerStore>(route: &Route<S::Tx>, shared: &Shared<S>, delivery: &Delivery) {
    shared
        .processor
        .settle_nack(route, delivery, Duration::ZERO)
        .await;
    shared.released.fetch_add(1, Ordering::Relaxed);
    metrics::counter!("keel_consumer_released_total", route.labels.iter()).increment(1);
}

/// Completes once the flag is set (or its sender is gone).
async fn stopped(flag: &mut watch::Receiver<bool>) {
    let _ = flag.wait_for(|set| *set).await;
}

fn panic_text(payload: Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a non-string panic payload".to_owned()
    }
}
