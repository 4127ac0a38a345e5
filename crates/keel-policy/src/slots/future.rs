//! The response future of a [`SlotService`](super::SlotService): the
//! bulkhead's and load shedding's.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use keel_core::{BoxError, Rejected};
use pin_project_lite::pin_project;

use super::Slot;

pin_project! {
    /// The response of a call through a bulkhead or load-shedding service:
    /// the inner response, holding its slot until it completes, or a refusal.
    #[derive(Debug)]
    pub struct ResponseFuture<F> {
        #[pin]
        state: State<F>,
    }
}

pin_project! {
    #[project = StateProj]
    #[derive(Debug)]
    enum State<F> {
        Admitted { #[pin] future: F, slot: Option<Slot> },
        Refused { rejected: Rejected },
    }
}

impl<F> ResponseFuture<F> {
    pub(crate) fn admitted(future: F, slot: Slot) -> Self {
        Self {
            state: State::Admitted {
                future,
                slot: Some(slot),
            },
        }
    }

    pub(crate) fn refused(rejected: Rejected) -> Self {
        Self {
            state: State::Refused { rejected },
        }
    }
}

impl<F, T, E> Future for ResponseFuture<F>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Admitted { future, slot } => {
                let output = ready!(future.poll(cx));
                // Free the slot as soon as the response is in.
                drop(slot.take());
                Poll::Ready(output.map_err(Into::into))
            }
            StateProj::Refused { rejected } => Poll::Ready(Err(Box::new(rejected.clone()))),
        }
    }
}
