//! [`DrainServe`]: an axum server run through a [`Drain`].

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use axum::Router;
use axum::serve::Listener;
use keel_lifecycle::{ConnectionLimits, Drain, DrainReport, Phase};
use tokio::task::JoinSet;

use super::listener::DrainListener;
use super::server::{answer_overloaded, serve_connection, slots};
use crate::connection::ConnectionInfo;

/// How long a server waits for aborted connections to wind down before
/// returning anyway.
const ABORT_GRACE: Duration = Duration::from_secs(1);

/// Serves an axum [`Router`] through a [`Drain`]; see the
/// [module docs](super) for the order of the shutdown.
pub trait DrainServe {
    /// Serves `router` on `listener` until the drain completes: new
    /// connections are accepted until the listener closes (after
    /// `lb_notice`), in-flight requests finish, and whatever is still open
    /// `drain_timeout` later is aborted. Returns once every connection is
    /// gone (or a second after aborting them).
    ///
    /// Listener errors never end the server (axum retries accepts).
    fn serve<L>(
        &self,
        listener: L,
        router: Router,
    ) -> impl Future<Output = io::Result<DrainReport>> + Send
    where
        L: Listener<Addr = SocketAddr>,
        L::Io: Unpin + ConnectionInfo;

    /// [`serve`](Self::serve) with these [`ConnectionLimits`] (header and
    /// body read and idle timeouts, a connection cap, a share per address).
    fn serve_with<L>(
        &self,
        listener: L,
        router: Router,
        limits: ConnectionLimits,
    ) -> impl Future<Output = io::Result<DrainReport>> + Send
    where
        L: Listener<Addr = SocketAddr>,
        L::Io: Unpin + ConnectionInfo;
}

impl DrainServe for Drain {
    async fn serve<L>(&self, listener: L, router: Router) -> io::Result<DrainReport>
    where
        L: Listener<Addr = SocketAddr>,
        L::Io: Unpin + ConnectionInfo,
    {
        self.serve_with(listener, router, ConnectionLimits::default())
            .await
    }

    async fn serve_with<L>(
        &self,
        listener: L,
        router: Router,
        limits: ConnectionLimits,
    ) -> io::Result<DrainReport>
    where
        L: Listener<Addr = SocketAddr>,
        L::Io: Unpin + ConnectionInfo,
    {
        let limits = limits
            .validate()
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e.to_string()))?;
        let mut listener = DrainListener::new(listener, self);
        let counts = listener.counts();
        let mut connections = JoinSet::new();
        accept_until_closing(self, &mut listener, &router, &limits, &mut connections).await;
        // Closing the listener stops new connections at the kernel.
        drop(listener);
        let all_closed = async { while connections.join_next().await.is_some() {} };
        let mut all_closed = std::pin::pin!(all_closed);
        tokio::select! {
            () = &mut all_closed => {}
            () = self.wait_for(Phase::Aborting) => {
                // Every connection still open fails its next read or write now.
                if tokio::time::timeout(ABORT_GRACE, &mut all_closed).await.is_err() {
                    tracing::warn!(
                        "aborted connections did not close within {ABORT_GRACE:?}; returning anyway"
                    );
                }
            }
        }
        // Counted by the connections themselves: the server may finish
        // because they were aborted.
        Ok(self.report(counts.aborted()))
    }
}

/// Accepts connections, each within its slot (or answered `503` past the
/// cap), until the drain closes the listener.
async fn accept_until_closing<L>(
    drain: &Drain,
    listener: &mut DrainListener<L>,
    router: &Router,
    limits: &ConnectionLimits,
    connections: &mut JoinSet<()>,
) where
    L: Listener<Addr = SocketAddr>,
    L::Io: Unpin + ConnectionInfo,
{
    let (slots, overflow) = slots(limits);
    let mut closing = std::pin::pin!(drain.closing());
    loop {
        let (io, peer) = tokio::select! {
            biased;
            () = &mut closing => return,
            accepted = listener.accept() => accepted,
        };
        while connections.try_join_next().is_some() {}
        if let Some(slot) = slots.try_take(peer.ip()) {
            let connection = serve_connection(
                io,
                peer,
                router.clone(),
                limits.clone(),
                drain.clone(),
                slot,
            );
            connections.spawn(connection);
        } else {
            metrics::counter!("keel_http_connections_refused_total").increment(1);
            tracing::warn!(%peer, "connection cap or the address's share reached: answering 503");
            if let Some(slot) = overflow.try_take(peer.ip()) {
                connections.spawn(answer_overloaded(io, slot));
            }
        }
    }
}
