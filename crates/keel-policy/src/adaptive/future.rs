//! The response future of [`AdaptiveLimitService`](super::AdaptiveLimitService).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use keel_core::{BoxError, Rejected, error::classify};
use pin_project_lite::pin_project;

use super::{InFlight, Shared, outcome_of};

pin_project! {
    /// The response of a call through an
    /// [`AdaptiveLimitService`](super::AdaptiveLimitService): the inner
    /// response, whose ending (or cancellation) is learned from, or a refusal.
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
        Admitted { #[pin] future: F, in_flight: Option<InFlight<Arc<Shared>>> },
        Refused { rejected: Rejected },
    }
}

impl<F> ResponseFuture<F> {
    pub(super) fn admitted(future: F, in_flight: InFlight<Arc<Shared>>) -> Self {
        Self {
            state: State::Admitted {
                future,
                in_flight: Some(in_flight),
            },
        }
    }

    pub(super) fn refused(rejected: Rejected) -> Self {
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
            StateProj::Admitted { future, in_flight } => {
                let output = ready!(future.poll(cx)).map_err(Into::into);
                let class = output
                    .as_ref()
                    .err()
                    .map(|err: &BoxError| classify(err.as_ref()));
                if let Some(in_flight) = in_flight.take() {
                    in_flight.finish(outcome_of(class));
                }
                Poll::Ready(output)
            }
            StateProj::Refused { rejected } => Poll::Ready(Err(Box::new(rejected.clone()))),
        }
    }
}
