//! Settling one JetStream delivery: ack, nack, extend, terminate, each
//! confirmed by the server (an ack or terminate by its key-cursor write),
//! and refused with `LeaseLost` once the lease ran out.
//!
//! JetStream does not tell a late holder that its delivery was handed to
//! someone else: an ack sent after the ack wait acks the *new* holder's
//! delivery. So every delivery tracks its lease deadline on the client,
//! measured from when it arrived (which is after the server started its
//! ack-wait clock) minus a safety margin, and a settle after that deadline
//! returns [`BrokerError::LeaseLost`] without sending anything.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::AckKind;
use async_nats::{Client, Subject};
use async_trait::async_trait;
use bytes::Bytes;
use keel_core::clock::{self, Instant};
use keel_store::broker::{BrokerError, DeliveryControl};
use parking_lot::Mutex;
use tokio::task::AbortHandle;

use crate::cursor::Cursors;
use crate::error::unavailable;

/// How much earlier than the server the client considers a lease gone.
pub(crate) fn margin(ack_wait: Duration) -> Duration {
    (ack_wait / 10).min(Duration::from_millis(100))
}

/// Where a delivery stands, as far as its holder knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Leased to us until the deadline.
    Held,
    /// Acked or terminated.
    Finished,
    /// Nacked, expired, or dropped unsettled.
    Released,
}

struct LeaseState {
    phase: Phase,
    deadline: Instant,
    keeper: Option<AbortHandle>,
}

/// One delivery's lease, shared with the subscription that tracks which
/// keys it holds.
pub(crate) struct Lease {
    state: Mutex<LeaseState>,
}

impl Lease {
    pub(crate) fn new(deadline: Instant) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(LeaseState {
                phase: Phase::Held,
                deadline,
                keeper: None,
            }),
        })
    }

    /// Whether the delivery is still held by us (settled or expired ones
    /// are not).
    pub(crate) fn is_held(&self, now: Instant) -> bool {
        let state = self.state.lock();
        state.phase == Phase::Held && state.deadline > now
    }

    fn set_phase(&self, phase: Phase) {
        let mut state = self.state.lock();
        state.phase = phase;
        if let Some(keeper) = state.keeper.take() {
            keeper.abort();
        }
    }
}

/// The deliveries a subscription has handed out, by escaped key, so that a
/// later message of a key it holds is held back without asking the server.
#[derive(Default)]
pub(crate) struct HeldKeys {
    keys: Mutex<HashMap<String, Vec<HeldDelivery>>>,
}

/// A handed-out delivery's stream sequence and lease.
type HeldDelivery = (u64, Arc<Lease>);

impl HeldKeys {
    pub(crate) fn insert(&self, key: &str, sequence: u64, lease: Arc<Lease>) {
        self.keys
            .lock()
            .entry(key.to_owned())
            .or_default()
            .push((sequence, lease));
    }

    /// Forgets deliveries that are settled or expired, so keys seen once do
    /// not stay in memory.
    pub(crate) fn purge(&self) {
        let now = clock::now();
        self.keys.lock().retain(|_, held| {
            held.retain(|(_, lease)| lease.is_held(now));
            !held.is_empty()
        });
    }

    /// Whether an earlier message of `key` is still held here.
    pub(crate) fn blocks(&self, key: &str, sequence: u64) -> bool {
        let now = clock::now();
        let mut keys = self.keys.lock();
        let Some(held) = keys.get_mut(key) else {
            return false;
        };
        held.retain(|(_, lease)| lease.is_held(now));
        if held.is_empty() {
            keys.remove(key);
            return false;
        }
        held.iter().any(|(s, _)| *s < sequence)
    }
}

/// Settles one delivery of the NATS broker.
pub(crate) struct NatsDeliveryControl {
    pub(crate) client: Client,
    pub(crate) reply: Subject,
    pub(crate) lease: Arc<Lease>,
    pub(crate) cursors: Arc<Cursors>,
    pub(crate) cursor_key: String,
    pub(crate) sequence: u64,
    pub(crate) ack_wait: Duration,
    pub(crate) request_timeout: Duration,
}

enum Go {
    Proceed,
    AlreadyFinished,
}

impl NatsDeliveryControl {
    /// Checks the lease before a settle named `action`.
    fn begin(&self, action: &str, finishing: bool) -> Result<Go, BrokerError> {
        let mut state = self.lease.state.lock();
        match state.phase {
            Phase::Held => {}
            // Acking twice is harmless: the message is done either way.
            Phase::Finished if finishing => return Ok(Go::AlreadyFinished),
            Phase::Finished => {
                return Err(BrokerError::Invalid(format!(
                    "cannot {action} a delivery that was already acked or terminated"
                )));
            }
            Phase::Released => return Err(BrokerError::LeaseLost),
        }
        if clock::now() >= state.deadline {
            state.phase = Phase::Released;
            if let Some(keeper) = state.keeper.take() {
                keeper.abort();
            }
            metrics::counter!("keel_broker_lease_lost_total", "outcome" => action.to_owned())
                .increment(1);
            return Err(BrokerError::LeaseLost);
        }
        Ok(Go::Proceed)
    }

    /// Sends `kind` and waits for the server's confirmation.
    async fn send(&self, kind: AckKind) -> Result<(), BrokerError> {
        send_ack(&self.client, &self.reply, kind, self.request_timeout).await
    }

    /// Acks or terminates: the cursor moves first (that is the commit), then
    /// JetStream is told to forget the message. That second step is not
    /// waited for: if it is lost, the cursor already records the message as
    /// done, and its redelivery is acked on arrival without reaching the
    /// application again. Waiting would cost a round trip per ack.
    async fn finish(&self, action: &str, kind: AckKind) -> Result<(), BrokerError> {
        if let Go::AlreadyFinished = self.begin(action, true)? {
            return Ok(());
        }
        self.cursors
            .advance(&self.cursor_key, self.sequence)
            .await?;
        self.lease.set_phase(Phase::Finished);
        let payload: Bytes = kind.into();
        if let Err(error) = self.client.publish(self.reply.clone(), payload).await {
            tracing::warn!(%error, action, "telling JetStream a settle failed; the key cursor covers it");
        }
        metrics::counter!("keel_broker_settled_total", "outcome" => action.to_owned()).increment(1);
        Ok(())
    }
}

/// Sends an acknowledgement of `kind` to `reply` as a request, so the
/// server's answer confirms it (JetStream's "double ack").
pub(crate) async fn send_ack(
    client: &Client,
    reply: &Subject,
    kind: AckKind,
    timeout: Duration,
) -> Result<(), BrokerError> {
    let payload: Bytes = kind.into();
    match tokio::time::timeout(timeout, client.request(reply.clone(), payload)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(error)) => Err(unavailable("acknowledging a delivery", error)),
        Err(_) => Err(unavailable(
            "acknowledging a delivery",
            "no confirmation from the server in time",
        )),
    }
}

#[async_trait]
impl DeliveryControl for NatsDeliveryControl {
    async fn ack(&self) -> Result<(), BrokerError> {
        self.finish("ack", AckKind::Ack).await
    }

    async fn nack(&self, delay: Duration) -> Result<(), BrokerError> {
        self.begin("nack", false)?;
        self.lease.set_phase(Phase::Released);
        let delay = (!delay.is_zero()).then_some(delay);
        self.send(AckKind::Nak(delay)).await?;
        metrics::counter!("keel_broker_settled_total", "outcome" => "nack").increment(1);
        Ok(())
    }

    /// An in-progress ack restarts the server's ack wait. A lease longer
    /// than the group's ack wait is kept by a background task that sends
    /// another in-progress ack whenever half the ack wait is left, until the
    /// requested lease is covered (or the delivery is settled or dropped).
    /// A shorter one still gets the whole ack wait: JetStream has no
    /// per-delivery timer.
    async fn extend(&self, lease: Duration) -> Result<(), BrokerError> {
        if lease.is_zero() {
            return Err(BrokerError::Invalid(
                "a lease extension must be positive".into(),
            ));
        }
        self.begin("extend", false)?;
        let sent_at = clock::now();
        self.send(AckKind::Progress).await?;
        let covered = sent_at + self.ack_wait;
        let target = (sent_at + lease).max(covered);
        let keeper = (target > covered).then(|| {
            tokio::spawn(keep_alive(
                self.client.clone(),
                self.reply.clone(),
                self.lease.clone(),
                self.ack_wait,
                covered,
                target,
            ))
            .abort_handle()
        });
        let mut state = self.lease.state.lock();
        if state.phase != Phase::Held {
            if let Some(keeper) = keeper {
                keeper.abort();
            }
            return Ok(());
        }
        state.deadline = target - margin(self.ack_wait);
        if let Some(old) = std::mem::replace(&mut state.keeper, keeper) {
            old.abort();
        }
        Ok(())
    }

    async fn terminate(&self) -> Result<(), BrokerError> {
        self.finish("terminate", AckKind::Term).await
    }
}

impl Drop for NatsDeliveryControl {
    fn drop(&mut self) {
        let mut state = self.lease.state.lock();
        if state.phase == Phase::Held {
            // Dropped unsettled: the server redelivers it after the ack wait.
            state.phase = Phase::Released;
        }
        if let Some(keeper) = state.keeper.take() {
            keeper.abort();
        }
    }
}

/// Sends in-progress acks until the server's ack wait covers `target`.
async fn keep_alive(
    client: Client,
    reply: Subject,
    lease: Arc<Lease>,
    ack_wait: Duration,
    mut covered: Instant,
    target: Instant,
) {
    while covered < target {
        tokio::time::sleep_until(covered - ack_wait / 2).await;
        let sent_at = clock::now();
        let payload: Bytes = AckKind::Progress.into();
        if let Err(error) = client.publish(reply.clone(), payload).await {
            tracing::warn!(%error, "an in-progress ack failed; the lease ends early");
            lease.state.lock().deadline = covered - margin(ack_wait);
            return;
        }
        covered = sent_at + ack_wait;
    }
}
