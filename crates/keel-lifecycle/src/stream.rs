//! [`DrainStream`]: connections a [`Drain`] can count and, once its
//! timeout passes, abort.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use crate::drain::{Drain, Phase};

/// A server's connections: open now, and aborted so far. Share one among
/// the [`DrainStream`]s of one listener.
#[derive(Debug, Default)]
pub struct ConnectionCounts {
    open: AtomicUsize,
    aborted: AtomicUsize,
}

impl ConnectionCounts {
    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.load(Ordering::Relaxed)
    }

    /// Connections aborted by the drain so far.
    pub fn aborted(&self) -> usize {
        self.aborted.load(Ordering::Relaxed)
    }
}

/// A connection, counted by its [`Drain`] while open, that fails its next
/// read or write once the drain reaches [`Phase::Aborting`].
///
/// A server that keeps no handle to its connections' tasks (axum spawns
/// one per connection) would be held alive by a connection that never
/// finishes (a stream that ignores [`Drain::signal`]) until the
/// orchestrator's SIGKILL. An aborted stream makes the server drop the
/// connection, its handler and its body. Upgraded connections (WebSocket)
/// keep the wrapped stream, so they are aborted too.
pub struct DrainStream<T> {
    io: T,
    abort: Pin<Box<dyn Future<Output = ()> + Send>>,
    aborted: bool,
    drain: Drain,
    counts: Arc<ConnectionCounts>,
}

impl<T> std::fmt::Debug for DrainStream<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrainStream")
            .field("aborted", &self.aborted)
            .finish_non_exhaustive()
    }
}

impl<T> DrainStream<T> {
    /// Wraps `io`, a connection of `drain`, counted in `counts` too.
    pub fn new(io: T, drain: &Drain, counts: Arc<ConnectionCounts>) -> Self {
        counts.open.fetch_add(1, Ordering::Relaxed);
        drain.inner().open().fetch_add(1, Ordering::Relaxed);
        let mut phases = drain.inner().phase().subscribe();
        let abort = Box::pin(async move {
            if phases.wait_for(|p| *p >= Phase::Aborting).await.is_err() {
                std::future::pending::<()>().await;
            }
        });
        Self {
            io,
            abort,
            aborted: false,
            drain: drain.clone(),
            counts,
        }
    }

    /// The wrapped stream.
    pub fn get_ref(&self) -> &T {
        &self.io
    }

    /// Whether the drain has aborted this connection; registers `cx` to be
    /// woken when it does.
    fn is_aborted(&mut self, cx: &mut Context<'_>) -> bool {
        if !self.aborted && self.abort.as_mut().poll(cx).is_ready() {
            self.aborted = true;
            self.counts.aborted.fetch_add(1, Ordering::Relaxed);
        }
        self.aborted
    }
}

fn aborted() -> io::Error {
    io::Error::new(
        io::ErrorKind::ConnectionAborted,
        "the drain timeout passed: connection aborted by the server",
    )
}

impl<T> Drop for DrainStream<T> {
    fn drop(&mut self) {
        self.counts.open.fetch_sub(1, Ordering::Relaxed);
        self.drain.inner().open().fetch_sub(1, Ordering::Relaxed);
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for DrainStream<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.is_aborted(cx) {
            return Poll::Ready(Err(aborted()));
        }
        Pin::new(&mut this.io).poll_read(cx, buf)
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for DrainStream<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.is_aborted(cx) {
            return Poll::Ready(Err(aborted()));
        }
        Pin::new(&mut this.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if this.is_aborted(cx) {
            return Poll::Ready(Err(aborted()));
        }
        Pin::new(&mut this.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if this.is_aborted(cx) {
            return Poll::Ready(Err(aborted()));
        }
        Pin::new(&mut this.io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}
