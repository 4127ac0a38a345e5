//! Wake-ups: "stream S now has events up to seq N", from the appender to
//! every connection waiting on S.
//!
//! # Why only a seq, never the event
//!
//! The log is the one source of truth; a notification carries no event, only
//! the new high-water seq, and a woken reader reads the log after the last
//! seq *it* sent. So a lost, late or coalesced notification costs a read,
//! never an event, and "no gap, no duplicate" is a property of the cursor,
//! not of the bus. It also keeps a future cross-node backplane trivial: it
//! has to carry `(stream, seq)`, which fits a PostgreSQL `NOTIFY` payload or
//! a NATS core message.
//!
//! # Memory
//!
//! [`LocalNotifier`] keeps one `tokio::sync::watch` channel per stream *that
//! has a subscriber right now*: a notification for a stream nobody watches
//! is dropped on the floor, and the last [`Subscription`] of a stream to go
//! removes its entry. A watch channel holds one value however many
//! notifications arrive, so memory grows with connected users, never with
//! the event rate or with users who ever connected.
//!
//! # Another backplane
//!
//! With several nodes, the appender's node must wake subscribers on every
//! node. Implement [`Notifier`] around a [`LocalNotifier`]: `notify`
//! publishes `(stream, seq)` to the shared bus, a listener task calls
//! `local.notify` for every message it receives (its own included), and
//! `subscribe` delegates to `local`.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use parking_lot::Mutex;
use tokio::sync::watch;

use super::stream::StreamId;

/// Carries "stream S has events up to seq N" to S's subscribers.
pub trait Notifier: Send + Sync + 'static {
    /// Announces that `stream` has committed events up to `seq`. Call it
    /// after the commit (a notification before it could wake a reader that
    /// then finds nothing). Never blocks.
    fn notify(&self, stream: &StreamId, seq: i64);

    /// Starts watching `stream`: announcements made from now on wake the
    /// subscription. Subscribe *before* reading the log, so nothing
    /// committed between the read and the wait can be missed.
    fn subscribe(&self, stream: &StreamId) -> Subscription;
}

impl std::fmt::Debug for dyn Notifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Notifier")
    }
}

/// How many shards the stream table is split into, so that connections of
/// different users rarely contend for one lock.
const SHARDS: usize = 16;

type Shard = Mutex<HashMap<StreamId, watch::Sender<i64>>>;

#[derive(Debug)]
struct Hub {
    shards: Box<[Shard]>,
    hasher: RandomState,
    streams: AtomicUsize,
}

impl Hub {
    fn shard(&self, stream: &StreamId) -> &Shard {
        let index =
            usize::try_from(self.hasher.hash_one(stream.as_str()) % SHARDS as u64).unwrap_or(0);
        &self.shards[index]
    }

    /// Records that the table gained (`true`) or lost an entry.
    fn counted(&self, added: bool) {
        let now = if added {
            self.streams.fetch_add(1, Ordering::Relaxed) + 1
        } else {
            self.streams
                .fetch_sub(1, Ordering::Relaxed)
                .saturating_sub(1)
        };
        #[allow(clippy::cast_precision_loss)] // a gauge
        metrics::gauge!("keel_realtime_subscribed_streams").set(now as f64);
    }
}

/// The in-process [`Notifier`]: one bounded `watch` channel per stream with
/// subscribers, removed with its last subscriber. Cheap to clone (clones
/// share the table).
#[derive(Debug, Clone)]
pub struct LocalNotifier {
    hub: Arc<Hub>,
}

impl Default for LocalNotifier {
    fn default() -> Self {
        Self::new()
    }
}

impl LocalNotifier {
    /// An empty notifier.
    pub fn new() -> Self {
        let shards = (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect();
        Self {
            hub: Arc::new(Hub {
                shards,
                hasher: RandomState::new(),
                streams: AtomicUsize::new(0),
            }),
        }
    }

    /// How many streams have at least one subscriber (the table's size).
    pub fn streams(&self) -> usize {
        self.hub.streams.load(Ordering::Relaxed)
    }
}

impl Notifier for LocalNotifier {
    fn notify(&self, stream: &StreamId, seq: i64) {
        let shard = self.hub.shard(stream).lock();
        if let Some(sender) = shard.get(stream) {
            // Keep the maximum: two appenders may notify out of order.
            sender.send_if_modified(|latest| {
                let newer = seq > *latest;
                if newer {
                    *latest = seq;
                }
                newer
            });
        }
    }

    fn subscribe(&self, stream: &StreamId) -> Subscription {
        let mut shard = self.hub.shard(stream).lock();
        let receiver = match shard.get(stream) {
            Some(sender) => sender.subscribe(),
            None => {
                let (sender, receiver) = watch::channel(0);
                shard.insert(stream.clone(), sender);
                self.hub.counted(true);
                receiver
            }
        };
        drop(shard);
        Subscription {
            hub: Arc::clone(&self.hub),
            stream: stream.clone(),
            receiver: Some(receiver),
        }
    }
}

/// A stream being watched; dropping it unsubscribes (and frees the stream's
/// entry if it was the last one).
#[derive(Debug)]
pub struct Subscription {
    hub: Arc<Hub>,
    stream: StreamId,
    /// `Some` until dropped.
    receiver: Option<watch::Receiver<i64>>,
}

impl Subscription {
    /// The stream watched.
    pub fn stream(&self) -> &StreamId {
        &self.stream
    }

    /// The highest seq announced while this stream had subscribers (0 if
    /// none). Only a hint: read the log for the truth.
    pub fn latest(&self) -> i64 {
        self.receiver.as_ref().map_or(0, |r| *r.borrow())
    }

    /// Waits until a seq greater than `seq` is announced, and returns the
    /// highest announced. Returns at once if one already was (also before
    /// this call, since subscribing). Cancel-safe.
    pub async fn wait_beyond(&mut self, seq: i64) -> i64 {
        let Some(receiver) = self.receiver.as_mut() else {
            return std::future::pending().await;
        };
        let latest = receiver
            .wait_for(|latest| *latest > seq)
            .await
            .map(|latest| *latest);
        match latest {
            Ok(latest) => latest,
            // The sender lives as long as a receiver does (it is only
            // removed when the last subscription drops), so this is
            // unreachable; never wake for nothing.
            Err(_) => std::future::pending().await,
        }
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut shard = self.hub.shard(&self.stream).lock();
        // Drop our receiver under the lock, so a concurrent subscribe either
        // sees our entry with a receiver or no entry at all.
        self.receiver = None;
        let idle = shard
            .get(&self.stream)
            .is_some_and(|sender| sender.receiver_count() == 0);
        if idle {
            shard.remove(&self.stream);
            drop(shard);
            self.hub.counted(false);
        }
    }
}
