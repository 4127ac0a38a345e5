//! [`DrainListener`]: connections a [`Drain`] can count and, once its
//! timeout passes, abort.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};

use axum::serve::Listener;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::drain::{Drain, Phase};

/// Wraps a listener so that every connection it accepts is counted by the
/// [`Drain`] and aborted when the drain reaches [`Phase::Aborting`].
///
/// axum spawns a task per connection and keeps no handle to it, so a
/// connection that never finishes (a stream that ignores
/// [`Drain::signal`]) would keep the server, and the process, alive until
/// the orchestrator's SIGKILL. Each [`DrainStream`] instead fails its next
/// read or write once the drain timeout passes, which makes hyper drop the
/// connection, its handler and its body. Upgraded connections (WebSocket)
/// keep the wrapped stream, so they are aborted too.
///
/// [`Drain::serve`] uses it; use it yourself with `axum::serve` if you
/// need a different setup.
#[derive(Debug)]
pub struct DrainListener<L> {
    inner: L,
    drain: Drain,
    counts: Arc<Counts>,
}

/// A listener's connections: open now, and aborted so far.
#[derive(Debug, Default)]
pub(super) struct Counts {
    pub(super) open: AtomicUsize,
    pub(super) aborted: AtomicUsize,
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
        self.counts.open.load(Ordering::Relaxed)
    }

    /// Connections of this listener aborted by the drain so far.
    pub fn aborted_connections(&self) -> usize {
        self.counts.aborted.load(Ordering::Relaxed)
    }

    pub(super) fn counts(&self) -> Arc<Counts> {
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

/// A connection accepted by a [`DrainListener`]: the stream itself, until
/// the drain aborts it.
pub struct DrainStream<T> {
    io: T,
    abort: Pin<Box<dyn Future<Output = ()> + Send>>,
    aborted: bool,
    drain: Drain,
    counts: Arc<Counts>,
}

impl<T> std::fmt::Debug for DrainStream<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DrainStream")
            .field("aborted", &self.aborted)
            .finish_non_exhaustive()
    }
}

impl<T> DrainStream<T> {
    fn new(io: T, drain: &Drain, counts: Arc<Counts>) -> Self {
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
