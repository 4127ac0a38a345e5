//! Server-side deduplication of client messages by id, across connections.
//!
//! A client that sent a message and lost the connection before the ack
//! cannot know whether it arrived, so it resends it, with the same id, on
//! its *next* connection. The window is therefore shared by all connections
//! (keyed by stream and id), not per connection. An id is remembered once
//! its message was handled successfully; while it is being handled, a
//! resend is told to retry later rather than acked, because the first
//! attempt may still fail. It is bounded in time and count
//! ([`DedupWindow`]), so it is best-effort by construction: the
//! application's effect should also be idempotent on the id (an idempotency
//! key in its own store) for the rare duplicate that outlives the window.

use std::collections::HashSet;
use std::hash::{BuildHasher, RandomState};
use std::num::NonZeroUsize;
use std::time::Duration;

use keel_store::dedup::DedupWindow;
use parking_lot::Mutex;

use super::super::stream::StreamId;

const SHARDS: usize = 16;

#[derive(Debug)]
struct Shard {
    done: DedupWindow,
    in_flight: HashSet<String>,
}

/// Handled client message ids, sharded by key so connections rarely
/// contend.
#[derive(Debug)]
pub(crate) struct Acks {
    shards: Box<[Mutex<Shard>]>,
    hasher: RandomState,
}

/// What a client message id stands for.
#[derive(Debug)]
pub(crate) enum Begin<'a> {
    /// New: handle it, then call [`InFlight::succeeded`].
    New(InFlight<'a>),
    /// Handled before: ack it again, do not handle it.
    Duplicate,
    /// Being handled on another connection right now.
    Busy,
}

impl Acks {
    /// A window of about `capacity` ids in total, each kept for `ttl`.
    pub(crate) fn new(capacity: NonZeroUsize, ttl: Duration) -> Self {
        let per_shard =
            NonZeroUsize::new(capacity.get().div_ceil(SHARDS)).unwrap_or(NonZeroUsize::MIN);
        let shards = (0..SHARDS)
            .map(|_| {
                Mutex::new(Shard {
                    done: DedupWindow::new(ttl, per_shard),
                    in_flight: HashSet::new(),
                })
            })
            .collect();
        Self {
            shards,
            hasher: RandomState::new(),
        }
    }

    fn shard(&self, key: &str) -> &Mutex<Shard> {
        let index = usize::try_from(self.hasher.hash_one(key) % SHARDS as u64).unwrap_or(0);
        &self.shards[index]
    }

    /// Looks `id` of `stream` up, marking it in flight if it is new.
    pub(crate) fn begin(&self, stream: &StreamId, id: &str) -> Begin<'_> {
        // Stream ids have no control characters, so "\n" cannot be forged.
        let key = format!("{stream}\n{id}");
        let mut shard = self.shard(&key).lock();
        if shard.done.contains(&key) {
            return Begin::Duplicate;
        }
        if !shard.in_flight.insert(key.clone()) {
            return Begin::Busy;
        }
        drop(shard);
        Begin::New(InFlight {
            acks: self,
            key,
            done: false,
        })
    }
}

/// A client message being handled; dropping it without
/// [`succeeded`](Self::succeeded) forgets the id (a resend is handled).
#[derive(Debug)]
pub(crate) struct InFlight<'a> {
    acks: &'a Acks,
    key: String,
    done: bool,
}

impl InFlight<'_> {
    /// The message was handled: remember its id.
    pub(crate) fn succeeded(mut self) {
        let mut shard = self.acks.shard(&self.key).lock();
        shard.in_flight.remove(&self.key);
        shard.done.check_and_insert(&self.key);
        self.done = true;
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.acks
                .shard(&self.key)
                .lock()
                .in_flight
                .remove(&self.key);
        }
    }
}
