//! What every admitting policy shares: the bulkhead, load shedding, the rate
//! limiters and the adaptive limit.
//!
//! Those policies differ in how they decide, not in what a decided call
//! looks like: either it was refused (the future answers the boxed
//! [`Rejected`] at once) or it was admitted holding a [`Permit`], which is
//! given back, told how the call ended, as soon as the inner response is in.
//! Policies that decide in `call` ([`AdmitCall`]) share one tower layer and
//! service too; each policy's module names them (`RateLimitLayer`,
//! `AdaptiveLimitLayer`, …).

mod service;

#[cfg(any(feature = "bulkhead", feature = "rate-limit"))]
pub use service::Keyed;
pub use service::{AdmitCall, AdmitLayer, AdmitService};

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use keel_core::{BoxError, Rejected};
use pin_project_lite::pin_project;

/// What an admitted call holds while it runs, given back when its response
/// is in (or dropped with the future if the call is cancelled).
pub trait Permit {
    /// Gives the permit back; `error` is the call's error, if it failed.
    fn release(self, error: Option<&BoxError>);
}

/// Rate limiters take their token up front and hold nothing while the call runs.
impl Permit for () {
    fn release(self, _error: Option<&BoxError>) {}
}

pin_project! {
    /// The response of a call through an admitting policy: the inner
    /// response, holding its [`Permit`] until it completes, or a refusal.
    #[derive(Debug)]
    pub struct ResponseFuture<F, P> {
        #[pin]
        state: State<F, P>,
    }
}

pin_project! {
    #[project = StateProj]
    #[derive(Debug)]
    enum State<F, P> {
        Admitted { #[pin] future: F, permit: Option<P> },
        Refused { rejected: Rejected },
    }
}

impl<F, P> ResponseFuture<F, P> {
    pub(crate) fn admitted(future: F, permit: P) -> Self {
        Self {
            state: State::Admitted {
                future,
                permit: Some(permit),
            },
        }
    }

    pub(crate) fn refused(rejected: Rejected) -> Self {
        Self {
            state: State::Refused { rejected },
        }
    }
}

impl<F, P, T, E> Future for ResponseFuture<F, P>
where
    F: Future<Output = Result<T, E>>,
    E: Into<BoxError>,
    P: Permit,
{
    type Output = Result<T, BoxError>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Admitted { future, permit } => {
                let output = ready!(future.poll(cx)).map_err(Into::into);
                if let Some(permit) = permit.take() {
                    permit.release(output.as_ref().err());
                }
                Poll::Ready(output)
            }
            StateProj::Refused { rejected } => Poll::Ready(Err(Box::new(rejected.clone()))),
        }
    }
}
