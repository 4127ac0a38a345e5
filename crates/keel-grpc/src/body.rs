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
use keel_http::health::{Drain, Phase};
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
        let end = |done: &mut bool, status: Status| {
            *done = true;
            Poll::Ready(Some(Ok(Frame::trailers(trailers(&status)))))
        };
        if this.deadline.is_some_and(|d| d.is_expired()) {
            count("deadline");
            return end(this.done, deadline_passed_mid_stream());
        }
        if this
            .drain
            .as_ref()
            .is_some_and(|d| d.phase() >= Phase::Closing)
        {
            count("drain");
            return end(this.done, draining());
        }
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
            Poll::Ready(Some(frame)) => {
                if frame.as_ref().is_ok_and(Frame::is_trailers) {
                    *this.done = true;
                }
                Poll::Ready(Some(frame.map_err(Into::into)))
            }
            Poll::Pending => {
                if let Some(deadline) = this.deadline {
                    let sleep = this.sleep.get_or_insert_with(|| {
                        Box::pin(tokio::time::sleep_until(deadline.instant()))
                    });
                    if sleep.as_mut().poll(cx).is_ready() {
                        count("deadline");
                        return end(this.done, deadline_passed_mid_stream());
                    }
                }
                if let Some(drain) = this.drain {
                    let closing = this
                        .closing
                        .get_or_insert_with(|| Box::pin(drain.closing()));
                    ready!(closing.as_mut().poll(cx));
                    count("drain");
                    return end(this.done, draining());
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
