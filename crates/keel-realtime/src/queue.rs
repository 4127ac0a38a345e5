//! The bound between a connection's producer (reading the log) and its
//! consumer (the socket), measured in bytes.
//!
//! A client that does not read must not make the server hold an unbounded
//! amount of memory for it. Counting messages would not do (one event can
//! be a few bytes or a megabyte), so the queue counts bytes: a push that
//! would take it over the limit is refused ([`Push::Full`]) and the producer
//! decides, by phase, whether that means "wait" (catching up) or "cut the
//! client off" (live). One item larger than the whole limit still goes
//! through when the queue is empty, or it could never be delivered.
//!
//! Nothing is allocated up front: an idle connection's queue is an empty
//! `VecDeque` and two `Notify`s.

use std::collections::VecDeque;
use std::sync::Arc;
use std::task::{Context, Poll, Waker};

use parking_lot::Mutex;
use tokio::sync::Notify;

/// The outcome of [`SendQueue::try_push`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Push {
    /// Queued for the consumer.
    Queued,
    /// Refused: it would take the queue over its byte limit.
    Full,
    /// Refused: the consumer is gone, or the queue was closed.
    Gone,
}

/// What the consumer gets next.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pop<T> {
    /// An item.
    Item(T),
    /// The producer closed the queue and everything was taken.
    End,
    /// The producer cut the connection off; end it abruptly.
    Aborted,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Open,
    Closed,
    Aborted,
}

#[derive(Debug)]
struct State<T> {
    items: VecDeque<(T, usize)>,
    bytes: usize,
    phase: Phase,
    consumer_gone: bool,
    waker: Option<Waker>,
}

/// A single-producer, single-consumer queue bounded in bytes.
#[derive(Debug)]
pub(crate) struct SendQueue<T> {
    max: usize,
    state: Mutex<State<T>>,
    /// The consumer took something (or left).
    room: Notify,
    /// The consumer left.
    gone: Notify,
}

impl<T> SendQueue<T> {
    /// A queue holding at most `max` bytes, and its consumer end.
    pub(crate) fn new(max: usize) -> (Arc<Self>, Receiver<T>) {
        let queue = Arc::new(Self {
            max,
            state: Mutex::new(State {
                items: VecDeque::new(),
                bytes: 0,
                phase: Phase::Open,
                consumer_gone: false,
                waker: None,
            }),
            room: Notify::new(),
            gone: Notify::new(),
        });
        let receiver = Receiver {
            queue: Arc::clone(&queue),
        };
        (queue, receiver)
    }

    /// Queues `item` of `size` bytes unless that takes the queue over its
    /// limit (an item alone in the queue always fits).
    pub(crate) fn try_push(&self, item: T, size: usize) -> Push {
        let mut state = self.state.lock();
        if state.consumer_gone || state.phase != Phase::Open {
            return Push::Gone;
        }
        if !state.items.is_empty() && state.bytes.saturating_add(size) > self.max {
            return Push::Full;
        }
        state.items.push_back((item, size));
        state.bytes += size;
        let waker = state.waker.take();
        drop(state);
        if let Some(waker) = waker {
            waker.wake();
        }
        Push::Queued
    }

    /// Bytes waiting for the consumer.
    pub(crate) fn buffered(&self) -> usize {
        self.state.lock().bytes
    }

    /// Whether the queue is at most half full: the point where a producer
    /// that is catching up reads the next batch.
    fn has_room(&self) -> bool {
        let state = self.state.lock();
        state.consumer_gone || state.bytes <= self.max / 2
    }

    /// Waits until the queue is at most half full (or the consumer left).
    pub(crate) async fn room(&self) {
        while !self.has_room() {
            self.room.notified().await;
        }
    }

    /// Whether the consumer is gone.
    pub(crate) fn is_gone(&self) -> bool {
        self.state.lock().consumer_gone
    }

    /// Waits until the consumer is gone (the client disconnected).
    pub(crate) async fn gone(&self) {
        while !self.is_gone() {
            self.gone.notified().await;
        }
    }

    /// Ends the queue gracefully: the consumer gets what is queued, then
    /// `last` (if any, whatever its size), then [`Pop::End`].
    pub(crate) fn close(&self, last: Option<(T, usize)>) {
        self.finish(Phase::Closed, last);
    }

    /// Ends the queue abruptly: what is queued is dropped, the consumer gets
    /// `last` (if any), then [`Pop::Aborted`].
    pub(crate) fn abort(&self, last: Option<(T, usize)>) {
        self.finish(Phase::Aborted, last);
    }

    fn finish(&self, phase: Phase, last: Option<(T, usize)>) {
        let mut state = self.state.lock();
        if state.phase != Phase::Open {
            return;
        }
        state.phase = phase;
        if phase == Phase::Aborted {
            state.items.clear();
            state.bytes = 0;
        }
        if let Some((item, size)) = last {
            state.items.push_back((item, size));
            state.bytes += size;
        }
        let waker = state.waker.take();
        drop(state);
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// The consumer end; dropping it tells the producer the client is gone.
#[derive(Debug)]
pub(crate) struct Receiver<T> {
    queue: Arc<SendQueue<T>>,
}

impl<T> Receiver<T> {
    /// The next item, or the end.
    pub(crate) fn poll_pop(&mut self, cx: &mut Context<'_>) -> Poll<Pop<T>> {
        let mut state = self.queue.state.lock();
        if let Some((item, size)) = state.items.pop_front() {
            state.bytes -= size;
            drop(state);
            self.queue.room.notify_one();
            return Poll::Ready(Pop::Item(item));
        }
        match state.phase {
            Phase::Open => {
                if !state
                    .waker
                    .as_ref()
                    .is_some_and(|w| w.will_wake(cx.waker()))
                {
                    state.waker = Some(cx.waker().clone());
                }
                Poll::Pending
            }
            Phase::Closed => Poll::Ready(Pop::End),
            Phase::Aborted => Poll::Ready(Pop::Aborted),
        }
    }

    /// [`poll_pop`](Self::poll_pop) as a future.
    pub(crate) async fn pop(&mut self) -> Pop<T> {
        std::future::poll_fn(|cx| self.poll_pop(cx)).await
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        let mut state = self.queue.state.lock();
        state.consumer_gone = true;
        state.items.clear();
        state.bytes = 0;
        drop(state);
        self.queue.gone.notify_one();
        self.queue.room.notify_one();
    }
}
