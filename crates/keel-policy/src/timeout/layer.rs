//! The tower form of [`Timeout`].

use std::task::{Context, Poll};

use keel_core::BoxError;
use tower_layer::Layer;
use tower_service::Service;

use super::Timeout;
use super::future::{ResponseFuture, call_in_scope};

/// Applies a [`Timeout`] to every request of the wrapped service.
///
/// Refusals and elapsed limits are boxed [`Rejected`](keel_core::Rejected)s
/// (`DeadlineExceeded` or `Timeout`); the inner service's errors pass through.
/// With deadline propagation on, the inner service's `call` and every poll of
/// its future run with the timeout as the current deadline.
#[derive(Debug, Clone)]
pub struct TimeoutLayer {
    policy: Timeout,
}

impl TimeoutLayer {
    /// A layer applying `policy`.
    pub fn new(policy: Timeout) -> Self {
        Self { policy }
    }
}

impl<S> Layer<S> for TimeoutLayer {
    type Service = TimeoutService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        TimeoutService {
            inner,
            policy: self.policy.clone(),
        }
    }
}

/// A service whose calls are limited by a [`Timeout`]; see [`TimeoutLayer`].
#[derive(Debug, Clone)]
pub struct TimeoutService<S> {
    inner: S,
    policy: Timeout,
}

impl<S> TimeoutService<S> {
    /// Wraps `inner` with `policy`.
    pub fn new(inner: S, policy: Timeout) -> Self {
        Self { inner, policy }
    }

    keel_core::inner_service_accessors!(inner: S);
}

impl<S, Req> Service<Req> for TimeoutService<S>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        match self.policy.plan() {
            Err(rejected) => ResponseFuture::refused(rejected),
            Ok(plan) => {
                let inner = &mut self.inner;
                let future = match plan.scope() {
                    Some(deadline) => call_in_scope(deadline, || inner.call(req)),
                    None => inner.call(req),
                };
                ResponseFuture::running(future, plan, self.policy.clone())
            }
        }
    }
}
