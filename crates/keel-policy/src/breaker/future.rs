//! The tower service's response future.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use keel_core::error::classify;
use keel_core::{BoxError, Rejected};
use pin_project_lite::pin_project;

use super::classify::{Answered, ClassifyResponse};
use super::{Outcome, OwnedPermit};

pin_project! {
    /// The response future of [`CircuitBreakerService`](super::CircuitBreakerService).
    #[derive(Debug)]
    pub struct ResponseFuture<F, C = Answered> {
        #[pin]
        kind: Kind<F, C>,
    }
}

pin_project! {
    #[project = KindProj]
    #[derive(Debug)]
    enum Kind<F, C> {
        Called { #[pin] future: F, permit: Option<OwnedPermit>, classify: C },
        Rejected { rejected: Rejected },
    }
}

impl<F, C> ResponseFuture<F, C> {
    pub(super) fn called(future: F, permit: OwnedPermit, classify: C) -> Self {
        Self {
            kind: Kind::Called {
                future,
                permit: Some(permit),
                classify,
            },
        }
    }

    pub(super) fn rejected(rejected: Rejected) -> Self {
        Self {
            kind: Kind::Rejected { rejected },
        }
    }
}

impl<F, C, T, E> Future for ResponseFuture<F, C>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
    C: ClassifyResponse<T>,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().kind.project() {
            KindProj::Called {
                future,
                permit,
                classify: response_outcome,
            } => {
                let result = ready!(future.poll(cx)).map_err(Into::into);
                if let Some(permit) = permit.take() {
                    let outcome = match &result {
                        Ok(response) => response_outcome.classify(response),
                        Err(err) => Outcome::from_class(classify(err.as_ref())),
                    };
                    permit.record(outcome);
                }
                Poll::Ready(result)
            }
            KindProj::Rejected { rejected } => Poll::Ready(Err(Box::new(rejected.clone()))),
        }
    }
}
