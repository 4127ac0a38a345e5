//! Recent replies by request id, for answering repeats.

use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use bytes::Bytes;
use keel_core::clock::{self, Instant};
use parking_lot::Mutex;

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct StoredReply {
    pub(super) status: &'static str,
    pub(super) payload: Bytes,
}

/// Recent replies by request id, bounded by age and by count (oldest
/// evicted first), like [`DedupWindow`](crate::dedup::DedupWindow) but
/// keeping the reply so a repeat can be answered.
pub(super) struct ReplyCache {
    ttl: Duration,
    capacity: usize,
    state: Mutex<CacheState>,
}

#[derive(Default)]
struct CacheState {
    replies: HashMap<String, (Instant, StoredReply)>,
    order: VecDeque<(Instant, String)>,
}

impl ReplyCache {
    pub(super) fn new(ttl: Duration, capacity: usize) -> Self {
        Self {
            ttl,
            capacity: capacity.max(1),
            state: Mutex::new(CacheState::default()),
        }
    }

    pub(super) fn get(&self, request_id: &str) -> Option<StoredReply> {
        let mut state = self.state.lock();
        self.evict(&mut state, clock::now());
        state.replies.get(request_id).map(|(_, r)| r.clone())
    }

    pub(super) fn insert(&self, request_id: &str, reply: StoredReply) {
        let now = clock::now();
        let mut state = self.state.lock();
        if state
            .replies
            .insert(request_id.to_owned(), (now, reply))
            .is_none()
        {
            state.order.push_back((now, request_id.to_owned()));
        }
        self.evict(&mut state, now);
    }

    fn evict(&self, state: &mut CacheState, now: Instant) {
        while let Some((at, id)) = state.order.front() {
            let expired = now.saturating_duration_since(*at) >= self.ttl;
            if !expired && state.order.len() <= self.capacity {
                break;
            }
            let id = id.clone();
            state.order.pop_front();
            state.replies.remove(&id);
        }
    }

    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.state.lock().replies.len()
    }
}
