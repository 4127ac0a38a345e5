//! [`Ending`]: a response body that ends the call with a status of its own
//! when the deadline passes or the server drains, between two messages.
//!
//! A gRPC stream's status travels in its trailers, after its last message.
//! Ending a stream well means sending trailers, not dropping the
//! connection: the client then reads `DEADLINE_EXCEEDED` or `UNAVAILABLE`
//! (and resumes from the last message it got) instead of a reset stream,
//! which tonic reports as `CANCELLED` or `UNKNOWN`. tonic hands the body
//! whole messages per frame, so ending between frames never cuts one.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use keel_core::{BoxError, Deadline};
use keel_lifecycle::{Drain, Phase};
use tokio::time::Sleep;
use tonic::Status;

type Closing = Pin<Box<dyn Future<Output = ()> + Send>>;

pin_project_lite::pin_project! {
    /// A body that runs its inner body under `deadline` (the task-local
    /// deadline is set while it is polled) and ends it with trailers when
    /// the deadline passes or `drain` closes.
    pub(crate) struct Ending<B> {
        #[pin]
        inner: B,
        deadline: Option<Deadline>,
        drain: Option<Drain>,
        // Made on the first `Pending` only: a unary answer, ready at once,
        // never pays for a timer or a drain subscription.
        sleep: Option<Pin<Box<Sleep>>>,
        closing: Option<Closing>,
        done: bool,
    }
}

impl<B> Ending<B> {
    pub(crate) fn new(inner: B, deadline: Option<Deadline>, drain: Option<Drain>) -> Self {
        Self {
            inner,
            deadline,
            drain,
            sleep: None,
            closing: None,
            done: false,
        }
    }
}

/// The status that ends a stream whose deadline passed.
pub(crate) fn deadline_passed_mid_stream() -> Status {
    Status::deadline_exceeded(
        "the call's deadline passed while its stream was open; the stream was ended after \
         the last whole message",
    )
}

/// The status that ends a stream when the server drains.
pub(crate) fn draining() -> Status {
    Status::unavailable(
        "the server is shutting down; reconnect and resume after the last message received",
    )
}

fn trailers(status: &Status) -> HeaderMap {
    let mut map = HeaderMap::new();
    if status.add_header(&mut map).is_err() {
        // Only a message with bytes no header can hold fails; the code
        // alone still ends the call correctly.
        map.insert(Status::GRPC_STATUS, (status.code() as i32).into());
    }
    map
}

impl<B> Body for Ending<B>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.project();
        if *this.done {
            return Poll::Ready(None);
        }
        let end = |done: &mut bool, why: &'static str, status: Status| {
            *done = true;
            count(why);
            Poll::Ready(Some(Ok(Frame::trailers(trailers(&status)))))
        };
        let inner = this.inner;
        let polled = match this.deadline {
            Some(deadline) => deadline.sync_scope(|| inner.poll_frame(cx)),
            None => inner.poll_frame(cx),
        };
        match polled {
            Poll::Ready(None) => {
                *this.done = true;
                Poll::Ready(None)
            }
            // The call ended on its own: its status goes through as it is.
            Poll::Ready(Some(Ok(frame))) if frame.is_trailers() => {
                *this.done = true;
                Poll::Ready(Some(Ok(frame)))
            }
            // A message ready after the deadline or the drain is not sent:
            // the stream ends before it (a resuming client asks for it
            // again). Checked here, not only on `Pending`, so a stream that
            // is always ready is cut too; a unary answer that was ready in
            // time goes out whole.
            Poll::Ready(Some(Ok(frame))) => {
                if this.deadline.is_some_and(|d| d.is_expired()) {
                    return end(this.done, "deadline", deadline_passed_mid_stream());
                }
                if this
                    .drain
                    .as_ref()
                    .is_some_and(|d| d.phase() >= Phase::Closing)
                {
                    return end(this.done, "drain", draining());
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(err))) => Poll::Ready(Some(Err(err.into()))),
            Poll::Pending => {
                if let Some(deadline) = this.deadline {
                    let sleep = this.sleep.get_or_insert_with(|| {
                        Box::pin(tokio::time::sleep_until(deadline.instant()))
                    });
                    if sleep.as_mut().poll(cx).is_ready() {
                        return end(this.done, "deadline", deadline_passed_mid_stream());
                    }
                }
                if let Some(drain) = this.drain {
                    let closing = this
                        .closing
                        .get_or_insert_with(|| Box::pin(drain.closing()));
                    ready!(closing.as_mut().poll(cx));
                    return end(this.done, "drain", draining());
                }
                Poll::Pending
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        if self.done {
            SizeHint::with_exact(0)
        } else {
            self.inner.size_hint()
        }
    }
}

fn count(why: &'static str) {
    metrics::counter!("keel_grpc_streams_ended_total", "why" => why).increment(1);
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::time::Duration;

    use http_body_util::{BodyExt, StreamBody};

    use super::*;

    type Frames = Vec<Result<Frame<Bytes>, Infallible>>;

    fn ok_trailers() -> Frame<Bytes> {
        let mut map = HeaderMap::new();
        map.insert(Status::GRPC_STATUS, 0.into());
        Frame::trailers(map)
    }

    fn status_of(frame: &Frame<Bytes>) -> Option<i32> {
        let value = frame.trailers_ref()?.get(Status::GRPC_STATUS)?;
        value.to_str().ok()?.parse().ok()
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_that_ended_on_its_own_keeps_its_status_even_after_the_deadline() {
        let frames: Frames = vec![Ok(ok_trailers())];
        let deadline = Deadline::after(Duration::from_millis(10));
        tokio::time::advance(Duration::from_millis(20)).await;
        let mut body = Ending::new(
            StreamBody::new(futures_util::stream::iter(frames)),
            Some(deadline),
            None,
        );
        let frame = body.frame().await.unwrap().unwrap();
        assert_eq!(status_of(&frame), Some(0));
        assert!(body.frame().await.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_that_is_always_ready_is_cut_at_its_deadline() {
        let endless = futures_util::stream::repeat_with(|| {
            Ok::<_, Infallible>(Frame::data(Bytes::from_static(b"\0\0\0\0\x01x")))
        });
        let deadline = Deadline::after(Duration::from_millis(50));
        let mut body = Ending::new(StreamBody::new(endless), Some(deadline), None);
        for _ in 0..3 {
            assert!(body.frame().await.unwrap().unwrap().is_data());
        }
        tokio::time::advance(Duration::from_millis(60)).await;
        let last = body.frame().await.unwrap().unwrap();
        assert_eq!(status_of(&last), Some(tonic::Code::DeadlineExceeded as i32));
        assert!(body.frame().await.is_none(), "nothing after the status");
    }

    #[tokio::test(start_paused = true)]
    async fn a_quiet_stream_ends_at_the_drain_with_unavailable() {
        let drain = Drain::builder().lb_notice(Duration::ZERO).build().unwrap();
        let quiet = futures_util::stream::pending::<Result<Frame<Bytes>, Infallible>>();
        let mut body = Ending::new(StreamBody::new(quiet), None, Some(drain.clone()));
        let waiting = tokio::spawn(async move { body.frame().await.map(|f| f.unwrap()) });
        tokio::task::yield_now().await;
        drain.trigger();
        let last = waiting.await.unwrap().unwrap();
        assert_eq!(status_of(&last), Some(tonic::Code::Unavailable as i32));
    }
}
