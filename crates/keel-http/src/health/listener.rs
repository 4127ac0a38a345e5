//! [`DrainListener`]: connections a [`Drain`] can count and, once its
//! timeout passes, abort.

use std::io;
use std::sync::Arc;

use axum::serve::Listener;
use keel_lifecycle::{ConnectionCounts, Drain, DrainStream};

/// Wraps a listener so that every connection it accepts is counted by the
/// [`Drain`] and aborted when the drain reaches [`Phase::Aborting`](keel_lifecycle::Phase::Aborting).
///
/// axum spawns a task per connection and keeps no handle to it, so a
/// connection that never finishes (a stream that ignores
/// [`Drain::signal`]) would keep the server, and the process, alive until
/// the orchestrator's SIGKILL. Each [`DrainStream`] instead fails its next
/// read or write once the drain timeout passes, which makes hyper drop the
/// connection, its handler and its body.
///
/// [`DrainServe::serve`](super::DrainServe::serve) uses it; use it yourself with `axum::serve` if you
/// need a different setup.
#[derive(Debug)]
pub struct DrainListener<L> {
    inner: L,
    drain: Drain,
    counts: Arc<ConnectionCounts>,
}

impl<L> DrainListener<L> {
    /// Wraps `inner`, for `drain`.
    pub fn new(inner: L, drain: &Drain) -> Self {
        Self {
            inner,
            drain: drain.clone(),
            counts: Arc::default(),
        }
    }

    /// Connections accepted by this listener and still open.
    pub fn open_connections(&self) -> usize {
        self.counts.open()
    }

    /// Connections of this listener aborted by the drain so far.
    pub fn aborted_connections(&self) -> usize {
        self.counts.aborted()
    }

    pub(super) fn counts(&self) -> Arc<ConnectionCounts> {
        Arc::clone(&self.counts)
    }
}

impl<L: Listener> Listener for DrainListener<L> {
    type Io = DrainStream<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        let (io, addr) = self.inner.accept().await;
        (
            DrainStream::new(io, &self.drain, Arc::clone(&self.counts)),
            addr,
        )
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}
