//! Request bodies that can be sent again, so retries and hedges work on a
//! tonic `Channel`.
//!
//! tower's retry and hedge clone the request for each attempt, and a
//! tonic request's body is a stream that can be read once.
//! [`ReplayBodyLayer`] reads it whole into a [`ReplayBody`] (bounded: 4 MiB
//! by default, gRPC's default largest message) and [`ChannelBodyLayer`]
//! hands it back to the `Channel` at the bottom of the stack.
//!
//! Only for calls whose request is one message (unary and server
//! streaming): a client stream would be read to its end before the first
//! message is sent. Give streaming calls a channel stack without these
//! layers (and without retries: a stream cannot be replayed anyway).

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::Request;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, LengthLimitError, Limited};
use keel_core::BoxError;
use tonic::Status;
use tower_layer::Layer;
use tower_service::Service;

/// How many bytes of a request [`ReplayBodyLayer`] keeps by default:
/// 4 MiB, the largest message a gRPC server accepts by default.
pub const DEFAULT_REPLAY_LIMIT: usize = 4 * 1024 * 1024;

/// A request body held in memory, which every clone sends again whole.
#[derive(Debug, Clone, Default)]
pub struct ReplayBody {
    data: Option<Bytes>,
}

impl ReplayBody {
    /// A body of `data`.
    pub fn new(data: Bytes) -> Self {
        Self {
            data: (!data.is_empty()).then_some(data),
        }
    }
}

impl Body for ReplayBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        Poll::Ready(self.get_mut().data.take().map(|data| Ok(Frame::data(data))))
    }

    fn is_end_stream(&self) -> bool {
        self.data.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.data.as_ref().map_or(0, |d| d.len() as u64))
    }
}

/// Reads each request's body into a [`ReplayBody`], refusing one over the
/// limit with `RESOURCE_EXHAUSTED` before anything is sent.
#[derive(Debug, Clone, Copy)]
pub struct ReplayBodyLayer {
    limit: usize,
}

impl Default for ReplayBodyLayer {
    fn default() -> Self {
        Self::new()
    }
}

impl ReplayBodyLayer {
    /// Keeps up to [`DEFAULT_REPLAY_LIMIT`] (4 MiB).
    pub fn new() -> Self {
        Self {
            limit: DEFAULT_REPLAY_LIMIT,
        }
    }

    /// Keeps up to `limit` bytes.
    #[must_use]
    pub fn limit(mut self, limit: usize) -> Self {
        self.limit = limit;
        self
    }
}

impl<S> Layer<S> for ReplayBodyLayer {
    type Service = ReplayRequest<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ReplayRequest {
            inner,
            limit: self.limit,
        }
    }
}

/// The service made by [`ReplayBodyLayer`].
#[derive(Debug, Clone)]
pub struct ReplayRequest<S> {
    inner: S,
    limit: usize,
}

impl<S, B> Service<Request<B>> for ReplayRequest<S>
where
    S: Service<Request<ReplayBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let limit = self.limit;
        Box::pin(async move {
            let (parts, body) = request.into_parts();
            let data = Limited::new(body, limit)
                .collect()
                .await
                .map_err(|err| too_large_or(err, limit))?
                .to_bytes();
            let request = Request::from_parts(parts, ReplayBody::new(data));
            inner.call(request).await.map_err(Into::into)
        })
    }
}

fn too_large_or(err: BoxError, limit: usize) -> BoxError {
    if err.is::<LengthLimitError>() {
        return Box::new(Status::resource_exhausted(format!(
            "the request is larger than the {limit} bytes kept for retries: not sent; raise \
             ReplayBodyLayer::limit or send it on a channel without retries"
        )));
    }
    err
}

/// The bottom of a stack over a tonic `Channel`: gives the channel the
/// [`ReplayBody`] as the body type it takes.
#[derive(Debug, Clone, Copy, Default)]
pub struct ChannelBodyLayer;

impl<S> Layer<S> for ChannelBodyLayer {
    type Service = ChannelBody<S>;

    fn layer(&self, inner: S) -> Self::Service {
        ChannelBody { inner }
    }
}

/// The service made by [`ChannelBodyLayer`].
#[derive(Debug, Clone)]
pub struct ChannelBody<S> {
    inner: S,
}

impl<S> Service<Request<ReplayBody>> for ChannelBody<S>
where
    S: Service<Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReplayBody>) -> S::Future {
        self.inner.call(request.map(tonic::body::Body::new))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_clone_sends_the_whole_body_again() {
        let body = ReplayBody::new(Bytes::from_static(b"\0\0\0\0\x02hi"));
        let again = body.clone();
        let first = body.collect().await.unwrap().to_bytes();
        assert_eq!(first, again.collect().await.unwrap().to_bytes());
        assert!(ReplayBody::new(Bytes::new()).is_end_stream());
    }

    #[tokio::test]
    async fn a_body_over_the_limit_is_refused_before_sending() {
        let sent = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = sent.clone();
        let inner = tower::service_fn(move |_: Request<ReplayBody>| {
            seen.store(true, std::sync::atomic::Ordering::SeqCst);
            async { Ok::<_, Infallible>(()) }
        });
        let mut service = ReplayBodyLayer::new().limit(4).layer(inner);
        let big = Request::new(http_body_util::Full::new(Bytes::from_static(b"12345")));
        let err = tower::ServiceExt::oneshot(&mut service, big)
            .await
            .unwrap_err();
        assert_eq!(
            Status::from_error(err).code(),
            tonic::Code::ResourceExhausted
        );
        assert!(!sent.load(std::sync::atomic::Ordering::SeqCst));
    }
}
