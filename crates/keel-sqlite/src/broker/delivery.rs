//! Settling deliveries: ack, nack, extend and terminate, by lease token.
//!
//! Settles go through one task per broker that applies whatever has queued
//! up in a single transaction, so a hundred handlers acking at once cost one
//! commit, not a hundred. The caller still waits for its own outcome, so the
//! API stays "returns once it is durable". Because the transaction runs in
//! that task, a caller that gives up waiting cannot cancel it halfway.

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use keel_store::broker::{BrokerError, DeliveryControl};
use tokio::sync::{mpsc, oneshot};

use super::db::{Db, SettleAction, SettleRequest};
use super::error::replicate;
use super::topics::Topic;

/// The most settles applied in one transaction.
const MAX_SETTLE_BATCH: usize = 512;

/// A queued settle and where its outcome goes.
struct Queued {
    request: SettleRequest,
    topic: Arc<Topic>,
    reply: oneshot::Sender<Result<bool, BrokerError>>,
}

/// The handle to a broker's settle task. Cheap to clone; the task ends when
/// the last handle is dropped.
#[derive(Clone)]
pub(super) struct Settler {
    queue: mpsc::Sender<Queued>,
}

impl Settler {
    /// Starts the settle task on the current tokio runtime.
    pub(super) fn spawn(db: Db) -> Self {
        let (queue, inbox) = mpsc::channel(4 * MAX_SETTLE_BATCH);
        tokio::spawn(run(db, inbox));
        Self { queue }
    }

    /// Applies `request`; `Ok(false)` when its lease was no longer held.
    async fn settle(&self, request: SettleRequest, topic: Arc<Topic>) -> Result<bool, BrokerError> {
        let (reply, outcome) = oneshot::channel();
        let queued = Queued {
            request,
            topic,
            reply,
        };
        let stopped =
            || BrokerError::Unavailable("the sqlite broker's settle task has stopped".into());
        self.queue.send(queued).await.map_err(|_| stopped())?;
        outcome.await.map_err(|_| stopped())?
    }
}

async fn run(db: Db, mut inbox: mpsc::Receiver<Queued>) {
    let mut batch = Vec::with_capacity(MAX_SETTLE_BATCH);
    while inbox.recv_many(&mut batch, MAX_SETTLE_BATCH).await > 0 {
        let requests: Vec<&SettleRequest> = batch.iter().map(|q| &q.request).collect();
        let outcome = db.settle(&requests).await;
        match outcome {
            Ok(held) => {
                for (queued, held) in batch.drain(..).zip(held) {
                    record(queued.request.action, held);
                    if held && !matches!(queued.request.action, SettleAction::Extend(_)) {
                        // Something may be deliverable now: the next message
                        // of an acked key, or a nacked one.
                        queued.topic.changed.notify_waiters();
                    }
                    // The caller may have stopped waiting; the settle stands.
                    let _ = queued.reply.send(Ok(held));
                }
            }
            Err(error) => {
                tracing::warn!(%error, settles = batch.len(), "sqlite broker settle batch failed");
                for queued in batch.drain(..) {
                    let _ = queued.reply.send(Err(replicate(&error)));
                }
            }
        }
    }
}

fn record(action: SettleAction, held: bool) {
    if held {
        metrics::counter!("keel_broker_settled_total", "outcome" => action.name()).increment(1);
    } else {
        metrics::counter!("keel_broker_lease_lost_total", "outcome" => action.name()).increment(1);
        tracing::debug!(action = action.name(), "settle after the lease was lost");
    }
}

/// Where a delivery stands, as far as its holder knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Local {
    /// Leased to us (as far as we know).
    Held = 0,
    /// We acked or terminated it.
    Finished = 1,
    /// We nacked it, or a settle found the lease gone.
    Released = 2,
}

impl Local {
    fn from_u8(value: u8) -> Self {
        match value {
            1 => Self::Finished,
            2 => Self::Released,
            _ => Self::Held,
        }
    }
}

/// Settles one delivery of the SQLite broker. The lease token is the
/// delivery count the lease was granted with: any later lease of the same
/// message has a higher one, so a settle after the lease was lost and taken
/// by someone else matches nothing and returns [`BrokerError::LeaseLost`].
pub(super) struct SqliteDeliveryControl {
    settler: Settler,
    topic: Arc<Topic>,
    group_id: i64,
    seq: i64,
    lease_token: i64,
    local: AtomicU8,
}

impl SqliteDeliveryControl {
    pub(super) fn new(
        settler: Settler,
        topic: Arc<Topic>,
        group_id: i64,
        seq: i64,
        lease_token: i64,
    ) -> Self {
        Self {
            settler,
            topic,
            group_id,
            seq,
            lease_token,
            local: AtomicU8::new(Local::Held as u8),
        }
    }

    async fn apply(&self, action: SettleAction) -> Result<(), BrokerError> {
        let finishing = matches!(action, SettleAction::Ack | SettleAction::Terminate);
        match Local::from_u8(self.local.load(Ordering::Acquire)) {
            Local::Held => {}
            // Acking twice is harmless: the message is done either way.
            Local::Finished if finishing => return Ok(()),
            Local::Finished => {
                return Err(BrokerError::Invalid(format!(
                    "cannot {} a delivery that was already acked or terminated",
                    action.name()
                )));
            }
            Local::Released => return Err(BrokerError::LeaseLost),
        }
        let request = SettleRequest {
            group_id: self.group_id,
            seq: self.seq,
            lease_token: self.lease_token,
            action,
        };
        if !self.settler.settle(request, self.topic.clone()).await? {
            self.local.store(Local::Released as u8, Ordering::Release);
            return Err(BrokerError::LeaseLost);
        }
        let now = match action {
            SettleAction::Ack | SettleAction::Terminate => Local::Finished,
            SettleAction::Nack(_) => Local::Released,
            SettleAction::Extend(_) => Local::Held,
        };
        self.local.store(now as u8, Ordering::Release);
        Ok(())
    }
}

#[async_trait]
impl DeliveryControl for SqliteDeliveryControl {
    async fn ack(&self) -> Result<(), BrokerError> {
        self.apply(SettleAction::Ack).await
    }

    async fn nack(&self, delay: Duration) -> Result<(), BrokerError> {
        self.apply(SettleAction::Nack(delay)).await
    }

    async fn extend(&self, lease: Duration) -> Result<(), BrokerError> {
        if lease.is_zero() {
            return Err(BrokerError::Invalid(
                "a lease extension must be positive".into(),
            ));
        }
        self.apply(SettleAction::Extend(lease)).await
    }

    async fn terminate(&self) -> Result<(), BrokerError> {
        self.apply(SettleAction::Terminate).await
    }
}
