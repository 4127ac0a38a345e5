//! The HTTP server [`DrainServe::serve`](super::DrainServe::serve) runs: hyper with every connection
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
//! - **body read timeout**: a request's body must arrive whole within it,
//!   counted from its head, on every route, however steadily its bytes
//!   trickle in (each byte resets the idle timer, not this); past it the
//!   request is answered `408` and the connection closed;
//! - **connection cap**: past it, a new connection gets a `503` with
//!   `Retry-After` and is closed (up to a small number of such answers at
//!   once; beyond that it is closed unanswered). `/livez` is answered `200`
//!   there: a server at its cap is alive, and an orchestrator that
//!   restarted it would only hand the attacker a restart loop;
//! - **a share per address**: one client address holds at most
//!   `max_connections_per_address` of the slots, so one address cannot take
//!   what every other client needs (an IPv6 /64 counts as one address).
//!   Behind a proxy every client shares the proxy's address: raise the
//!   share to the cap there, and bound clients at the proxy.
//!
//! Each request carries the peer's address as `ConnectInfo<SocketAddr>`,
//! which per-client limits and throttles read, and what the connection
//! knows of its peer ([`ConnectionInfo`]: a TLS client's identity).

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::ConnectInfo;
use axum::http::{HeaderValue, Request, StatusCode, header};
use axum::response::IntoResponse;
use hyper::body::{Body as _, Incoming};
use hyper_util::rt::{TokioIo, TokioTimer};
use keel_core::clock::{self, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tower::ServiceExt;

use keel_lifecycle::{ConnectionLimits, ConnectionSlot, ConnectionSlots, Drain};

use crate::connection::ConnectionInfo;
use crate::problem::Problem;

/// Over-the-cap answers one address gets at once.
const OVERFLOW_ANSWERS_PER_ADDRESS: usize = 4;

/// Connections over the cap answered `503` at once, at most.
const OVERFLOW_ANSWERS: usize = 64;

/// How long an over-the-cap connection gets to send its request head.
const OVERFLOW_HEADER_TIMEOUT: Duration = Duration::from_secs(2);

/// The slots for connections, and the few over the cap answered `503`.
pub(super) fn slots(limits: &ConnectionLimits) -> (ConnectionSlots, ConnectionSlots) {
    (
        limits.connection_slots(),
        ConnectionSlots::new(OVERFLOW_ANSWERS, OVERFLOW_ANSWERS_PER_ADDRESS),
    )
}

/// Serves one accepted connection until it ends, is idle too long, or the
/// drain closes it.
pub(super) async fn serve_connection<Io>(
    io: Io,
    peer: SocketAddr,
    router: Router,
    limits: ConnectionLimits,
    drain: Drain,
    _slot: ConnectionSlot,
) where
    Io: AsyncRead + AsyncWrite + Unpin + Send + ConnectionInfo + 'static,
{
    // Asked once per connection; a plain TCP connection knows nothing more,
    // and its requests then pay for no copy.
    let mut known = axum::http::Extensions::new();
    io.extend(&mut known);
    let known = (!known.is_empty()).then_some(known);
    let activity = Activity::default();
    let io = TokioIo::new(Tracked {
        io,
        activity: activity.clone(),
    });
    let body_read_timeout = limits.body_read();
    let service = hyper::service::service_fn(move |request: Request<Incoming>| {
        serve_request(
            router.clone(),
            request,
            peer,
            known.clone(),
            body_read_timeout,
        )
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read());
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
            () = activity.silent_for(limits.idle()) => {
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

/// One request through `router`, its body bounded by `body_read_timeout`:
/// a body still arriving past it fails the handler's read, and the answer
/// is `408` (and the connection closes).
async fn serve_request(
    router: Router,
    request: Request<Incoming>,
    peer: SocketAddr,
    known: Option<axum::http::Extensions>,
    body_read_timeout: Duration,
) -> Result<axum::response::Response, std::convert::Infallible> {
    let (mut parts, body) = request.into_parts();
    parts.extensions.insert(ConnectInfo(peer));
    if let Some(known) = known {
        parts.extensions.extend(known);
    }
    if body.is_end_stream() {
        return router
            .oneshot(Request::from_parts(parts, Body::new(body)))
            .await;
    }
    let expired = Arc::new(AtomicBool::new(false));
    let body = DeadlineBody {
        inner: body,
        deadline: Box::pin(tokio::time::sleep(body_read_timeout)),
        expired: Arc::clone(&expired),
    };
    let response = router
        .oneshot(Request::from_parts(parts, Body::new(body)))
        .await?;
    if !expired.load(Ordering::Relaxed) {
        return Ok(response);
    }
    metrics::counter!("keel_http_slow_bodies_total").increment(1);
    tracing::debug!(%peer, "request body not read within its timeout: 408");
    let mut timed_out = Problem::new(
        StatusCode::REQUEST_TIMEOUT,
        format!("the request body did not arrive within {body_read_timeout:?}"),
    )
    .into_response();
    timed_out
        .headers_mut()
        .insert(header::CONNECTION, HeaderValue::from_static("close"));
    Ok(timed_out)
}

/// A request body that must arrive whole before its deadline; past it, an
/// error (and `expired` set) in place of the next frame.
struct DeadlineBody {
    inner: Incoming,
    deadline: Pin<Box<tokio::time::Sleep>>,
    expired: Arc<AtomicBool>,
}

/// What a handler reading a body past its deadline gets.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within its read timeout")]
struct BodyReadTimedOut;

impl hyper::body::Body for DeadlineBody {
    type Data = Bytes;
    type Error = axum::BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if let Poll::Ready(frame) = Pin::new(&mut this.inner).poll_frame(cx) {
            return Poll::Ready(frame.map(|frame| frame.map_err(Into::into)));
        }
        if this.deadline.as_mut().poll(cx).is_ready() {
            this.expired.store(true, Ordering::Relaxed);
            return Poll::Ready(Some(Err(BodyReadTimedOut.into())));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Answers a connection over the cap with `503` and `Retry-After`, then
/// closes it; `GET /livez` with `200`, since a server at its cap is alive.
pub(super) async fn answer_overloaded<Io>(io: Io, _slot: ConnectionSlot)
where
    Io: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(|request: Request<Incoming>| async move {
        if request.uri().path() == "/livez" {
            let alive = axum::Json(serde_json::json!({ "ok": true, "at_connection_cap": true }));
            return Ok::<_, std::convert::Infallible>(alive.into_response());
        }
        Ok(Problem::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server has as many connections open as it allows; retry shortly",
        )
        .with_retry_after(Duration::from_secs(1))
        .into_response())
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
