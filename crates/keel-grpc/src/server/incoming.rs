//! The connections a tonic server accepts, bounded as keel-http bounds its
//! own ([`ConnectionLimits`]): a cap, a share per client address, a time
//! for the first bytes (the HTTP/2 preface) to arrive, and an idle timeout.
//!
//! tonic's own server takes any connection and keeps it for as long as the
//! peer likes: a connection that never sends a byte holds a socket and a
//! task forever, and one address can open as many as it wants. Give
//! [`BoundedIncoming`] to `serve_with_incoming` instead of a listener.
//! Set HTTP/2 keep-alive pings on the server too
//! (`http2_keepalive_interval`): their round trips count as activity, so a
//! long-lived stream that carries nothing for a while stays open while its
//! peer answers.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use keel_lifecycle::{ConnectionLimits, ConnectionSlot, ConnectionSlots};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};
use tonic::transport::server::{Connected, TcpConnectInfo};

/// A listener's accepted connections, within [`ConnectionLimits`]; a
/// `Stream` of [`BoundedConnection`]s for `serve_with_incoming`. A
/// connection past the cap or its address's share is closed at once and
/// counted in `keel_grpc_connections_refused_total`.
#[derive(Debug)]
pub struct BoundedIncoming {
    listener: TcpListener,
    slots: ConnectionSlots,
    first_bytes: Duration,
    idle: Duration,
    /// After an accept error (a full file table), the wait before the
    /// next accept: trying again at once would spin.
    backoff: Option<Pin<Box<Sleep>>>,
}

/// How long accepting pauses after an error.
const ACCEPT_BACKOFF: Duration = Duration::from_secs(1);

impl BoundedIncoming {
    /// `listener`'s connections within `limits` (its header read timeout
    /// bounds the wait for a connection's first bytes).
    pub fn new(listener: TcpListener, limits: &ConnectionLimits) -> Self {
        Self {
            listener,
            slots: limits.connection_slots(),
            first_bytes: limits.header_read(),
            idle: limits.idle(),
            backoff: None,
        }
    }
}

impl futures_util::Stream for BoundedIncoming {
    type Item = io::Result<BoundedConnection>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            if let Some(backoff) = this.backoff.as_mut() {
                if backoff.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                this.backoff = None;
            }
            let (stream, peer) = match this.listener.poll_accept(cx) {
                Poll::Pending => return Poll::Pending,
                // An accept error (a full file table) ends no server: the
                // next accept comes after a pause.
                Poll::Ready(Err(error)) => {
                    tracing::warn!(%error, "gRPC accept failed; pausing accepts for {ACCEPT_BACKOFF:?}");
                    this.backoff = Some(Box::pin(tokio::time::sleep(ACCEPT_BACKOFF)));
                    continue;
                }
                Poll::Ready(Ok(accepted)) => accepted,
            };
            let Some(slot) = this.slots.try_take(peer.ip()) else {
                metrics::counter!("keel_grpc_connections_refused_total").increment(1);
                tracing::debug!(%peer, "gRPC connection past the cap or its address's share: closed");
                continue;
            };
            let _ = stream.set_nodelay(true);
            return Poll::Ready(Some(Ok(BoundedConnection {
                io: stream,
                peer,
                _slot: slot,
                idle: this.idle,
                deadline: Box::pin(tokio::time::sleep(this.first_bytes)),
                heard: false,
            })));
        }
    }
}

/// One accepted connection: it fails its next read once nothing moved for
/// its timeout (the first bytes' at first, then the idle one), and gives
/// its slot back when dropped.
#[derive(Debug)]
pub struct BoundedConnection {
    io: TcpStream,
    peer: SocketAddr,
    _slot: ConnectionSlot,
    idle: Duration,
    deadline: Pin<Box<Sleep>>,
    /// Whether the peer sent anything yet: until it has, the server's own
    /// writes (its HTTP/2 settings) do not extend the wait.
    heard: bool,
}

impl BoundedConnection {
    fn moved(&mut self) {
        self.deadline.as_mut().reset(Instant::now() + self.idle);
    }

    fn timed_out(&mut self, cx: &mut Context<'_>) -> bool {
        if self.deadline.as_mut().poll(cx).is_ready() {
            metrics::counter!("keel_grpc_idle_connections_closed_total").increment(1);
            tracing::debug!(peer = %self.peer, "silent gRPC connection closed");
            return true;
        }
        false
    }
}

impl Connected for BoundedConnection {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.io.connect_info()
    }
}

impl AsyncRead for BoundedConnection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        match Pin::new(&mut this.io).poll_read(cx, buf) {
            Poll::Ready(result) => {
                if buf.filled().len() > before {
                    this.heard = true;
                    this.moved();
                }
                Poll::Ready(result)
            }
            Poll::Pending if this.timed_out(cx) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the connection was silent for too long",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncWrite for BoundedConnection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.io).poll_write(cx, data);
        if this.heard && matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            this.moved();
        }
        polled
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}
