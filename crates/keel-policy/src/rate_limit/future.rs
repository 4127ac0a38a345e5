//! The response future of the rate limiting services.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use keel_core::{BoxError, Rejected};
use pin_project_lite::pin_project;

pin_project! {
    /// The response of a call through a rate limiting service: the inner
    /// response, or a refusal.
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
        Allowed { #[pin] future: F },
        Refused { rejected: Rejected },
    }
}

impl<F> ResponseFuture<F> {
    pub(super) fn allowed(future: F) -> Self {
        Self {
            state: State::Allowed { future },
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
            StateProj::Allowed { future } => future.poll(cx).map_err(Into::into),
            StateProj::Refused { rejected } => Poll::Ready(Err(Box::new(rejected.clone()))),
        }
    }
}
