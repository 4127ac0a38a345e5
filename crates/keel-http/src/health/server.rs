//! The HTTP server [`Drain::serve`] runs: hyper with every connection
//! bounded in time and in number.
//!
//! A server with no limits is held open by anyone: a request head sent a
//! byte a minute, a connection opened and never used, a thousand of either.
//! [`ConnectionLimits`] closes each of those doors:
//!
//! - **header read timeout**: the whole request head must arrive within
//!   it, counted from the moment the connection waits for one (so it also
//!   bounds an idle keep-alive connection between requests);
//! - **idle timeout**: a connection that moves no byte either way for this
//!   long is asked to close (after its response, if one is due), and
//!   dropped if it is still silent one more period later;
//! - **connection cap**: past it, a new connection gets a `503` with
//!   `Retry-After` and is closed (up to a small number of such answers at
//!   once; beyond that it is closed unanswered).
//!
//! Each request carries the peer's address as `ConnectInfo<SocketAddr>`,
//! which per-client limits and throttles read.

use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::extract::ConnectInfo;
use axum::http::{Request, StatusCode};
use axum::response::IntoResponse;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use keel_core::clock::{self, Instant};
use keel_policy::ConfigError;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower::ServiceExt;

use super::drain::Drain;
use crate::problem::Problem;

/// The default header read timeout: 10 s.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The default idle timeout: 60 s, above a long poll's 25 s wait and an
/// SSE stream's 15 s keep-alive.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// The default cap on open connections: 1,024.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// Connections over the cap answered `503` at once, at most.
const OVERFLOW_ANSWERS: usize = 64;

/// How long an over-the-cap connection gets to send its request head.
const OVERFLOW_HEADER_TIMEOUT: Duration = Duration::from_secs(2);

/// Limits on every connection [`Drain::serve_with`] accepts; see the
/// module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionLimits {
    header_read_timeout: Duration,
    idle_timeout: Duration,
    max_connections: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

impl ConnectionLimits {
    /// The defaults: [`DEFAULT_HEADER_READ_TIMEOUT`],
    /// [`DEFAULT_IDLE_TIMEOUT`], [`DEFAULT_MAX_CONNECTIONS`].
    pub fn new() -> Self {
        Self::default()
    }

    /// How long a request head may take to arrive.
    pub fn header_read_timeout(mut self, timeout: Duration) -> Self {
        self.header_read_timeout = timeout;
        self
    }

    /// How long a connection may stay silent.
    pub fn idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// How many connections may be open at once.
    pub fn max_connections(mut self, max: usize) -> Self {
        self.max_connections = max;
        self
    }

    /// The idle timeout.
    pub fn idle(&self) -> Duration {
        self.idle_timeout
    }

    /// Checks that no limit is zero.
    pub fn validate(self) -> Result<Self, ConfigError> {
        if self.header_read_timeout.is_zero() {
            return Err(ConfigError::new(
                "header_read_timeout",
                "must be more than zero",
            ));
        }
        if self.idle_timeout.is_zero() {
            return Err(ConfigError::new("idle_timeout", "must be more than zero"));
        }
        if self.max_connections == 0 {
            return Err(ConfigError::new("max_connections", "must be at least 1"));
        }
        Ok(self)
    }

    pub(super) fn slots(&self) -> (Arc<Semaphore>, Arc<Semaphore>) {
        (
            Arc::new(Semaphore::new(self.max_connections)),
            Arc::new(Semaphore::new(OVERFLOW_ANSWERS)),
        )
    }
}

/// Serves one accepted connection until it ends, is idle too long, or the
/// drain closes it.
pub(super) async fn serve_connection<Io>(
    io: Io,
    peer: SocketAddr,
    router: Router,
    limits: ConnectionLimits,
    drain: Drain,
    _slot: OwnedSemaphorePermit,
) where
    Io: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let activity = Activity::default();
    let io = TokioIo::new(Tracked {
        io,
        activity: activity.clone(),
    });
    let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
        request.extensions_mut().insert(ConnectInfo(peer));
        router.clone().oneshot(request)
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let connection = builder.serve_connection(io, service).with_upgrades();
    let mut connection = std::pin::pin!(connection);
    let mut closing = std::pin::pin!(drain.closing());
    let mut asked_to_close = false;
    let mut idle_periods = 0;
    loop {
        tokio::select! {
            result = connection.as_mut() => {
                if let Err(err) = result {
                    tracing::debug!(%peer, error = %err, "connection ended with an error");
                }
                return;
            }
            () = &mut closing, if !asked_to_close => {
                asked_to_close = true;
                connection.as_mut().graceful_shutdown();
            }
            () = activity.silent_for(limits.idle_timeout) => {
                idle_periods += 1;
                if idle_periods > 1 {
                    metrics::counter!("keel_http_idle_connections_closed_total").increment(1);
                    tracing::debug!(%peer, "idle connection dropped");
                    return;
                }
                asked_to_close = true;
                connection.as_mut().graceful_shutdown();
                activity.touch();
            }
        }
    }
}

/// Answers a connection over the cap with `503` and `Retry-After`, then
/// closes it.
pub(super) async fn answer_overloaded<Io>(io: Io, _slot: OwnedSemaphorePermit)
where
    Io: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(|_: Request<Incoming>| async {
        Ok::<_, std::convert::Infallible>(
            Problem::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "the server has as many connections open as it allows; retry shortly",
            )
            .with_retry_after(Duration::from_secs(1))
            .into_response(),
        )
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(OVERFLOW_HEADER_TIMEOUT)
        .keep_alive(false);
    let _ = builder.serve_connection(TokioIo::new(io), service).await;
}

/// When a connection last moved a byte, in milliseconds after its start.
#[derive(Debug, Clone)]
struct Activity {
    start: Instant,
    last_ms: Arc<AtomicU64>,
}

impl Default for Activity {
    fn default() -> Self {
        Self {
            start: clock::now(),
            last_ms: Arc::default(),
        }
    }
}

impl Activity {
    fn touch(&self) {
        let ms = clock::now()
            .saturating_duration_since(self.start)
            .as_millis();
        self.last_ms
            .store(u64::try_from(ms).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Resolves once nothing moved for `period`.
    async fn silent_for(&self, period: Duration) {
        loop {
            let last = self.start + Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
            let due = last + period;
            if clock::now() >= due {
                return;
            }
            tokio::time::sleep_until(due).await;
        }
    }
}

/// A stream that records its activity.
struct Tracked<T> {
    io: T,
    activity: Activity,
}

impl<T: AsyncRead + Unpin> AsyncRead for Tracked<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(polled, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.touch();
        }
        polled
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for Tracked<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        data: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, data);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_limit_may_be_zero() {
        assert!(ConnectionLimits::new().validate().is_ok());
        for limits in [
            ConnectionLimits::new().header_read_timeout(Duration::ZERO),
            ConnectionLimits::new().idle_timeout(Duration::ZERO),
            ConnectionLimits::new().max_connections(0),
        ] {
            assert!(limits.validate().is_err());
        }
    }

    #[tokio::test(start_paused = true)]
    async fn silence_is_measured_from_the_last_byte() {
        let activity = Activity::default();
        tokio::time::advance(Duration::from_secs(5)).await;
        activity.touch();
        let silent = activity.silent_for(Duration::from_secs(10));
        let started = clock::now();
        silent.await;
        assert_eq!(clock::now() - started, Duration::from_secs(10));
    }
}
