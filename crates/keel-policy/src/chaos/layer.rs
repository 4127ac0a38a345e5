//! The tower form of [`FaultInjection`].

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use keel_core::{BoxError, Rejected};
use pin_project_lite::pin_project;
use tokio::time::Sleep;
use tower_layer::Layer;
use tower_service::Service;

use super::FaultInjection;

/// Injects faults into the requests for which a matcher `Fn(&Req) -> bool`
/// returns true.
///
/// The matcher is how test traffic is recognised. With `http` requests,
/// match the [`EXPERIMENT_HEADER`](super::EXPERIMENT_HEADER), as in
/// `req.headers().get(EXPERIMENT_HEADER).is_some_and(|v| v == "pricing-latency")`:
///
/// ```
/// # use std::collections::HashMap;
/// # struct Request { headers: HashMap<&'static str, &'static str> }
/// use keel_policy::chaos::{EXPERIMENT_HEADER, FaultInjection};
///
/// let chaos = FaultInjection::builder("pricing").abort(10.0).enabled(true).build()?;
/// let layer = chaos.layer(|req: &Request| {
///     req.headers.get(EXPERIMENT_HEADER) == Some(&"pricing-latency")
/// });
/// # let _ = layer;
/// # Ok::<_, keel_policy::ConfigError>(())
/// ```
///
/// or, where the edge already set [`ChaosExperiment`](super::ChaosExperiment),
/// `move |_: &Req| chaos.in_experiment()`.
///
/// An aborted request never reaches the inner service. A delayed request is
/// passed to the inner service's `call` at once, but its response future is
/// not polled until the delay has passed (services that start work in `call`
/// rather than on poll start it early). A disabled injector does not even
/// run the matcher.
#[derive(Clone)]
pub struct FaultInjectionLayer<M> {
    policy: FaultInjection,
    matcher: M,
}

impl<M> FaultInjectionLayer<M> {
    /// A layer injecting `policy`'s faults into requests `matcher` accepts.
    pub fn new(policy: FaultInjection, matcher: M) -> Self {
        Self { policy, matcher }
    }
}

impl<M> fmt::Debug for FaultInjectionLayer<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultInjectionLayer")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl<S, M: Clone> Layer<S> for FaultInjectionLayer<M> {
    type Service = FaultInjectionService<S, M>;

    fn layer(&self, inner: S) -> Self::Service {
        FaultInjectionService {
            inner,
            policy: self.policy.clone(),
            matcher: self.matcher.clone(),
        }
    }
}

/// A service with faults injected into matching requests; see
/// [`FaultInjectionLayer`].
#[derive(Clone)]
pub struct FaultInjectionService<S, M> {
    inner: S,
    policy: FaultInjection,
    matcher: M,
}

impl<S, M> FaultInjectionService<S, M> {
    keel_core::inner_service_accessors!(inner: S);
}

impl<S: fmt::Debug, M> fmt::Debug for FaultInjectionService<S, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultInjectionService")
            .field("inner", &self.inner)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl<S, M, Req> Service<Req> for FaultInjectionService<S, M>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    M: Fn(&Req) -> bool,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, req: Req) -> Self::Future {
        if !self.policy.is_enabled() || !(self.matcher)(&req) {
            return ResponseFuture::passing(self.inner.call(req));
        }
        let faults = self.policy.roll();
        let state = match (faults.delay, faults.abort) {
            (None, false) => State::Passing {
                inner: self.inner.call(req),
            },
            (Some(delay), false) => State::Delayed {
                sleep: Box::pin(tokio::time::sleep(delay)),
                slept: false,
                inner: self.inner.call(req),
            },
            (Some(delay), true) => State::DelayedAbort {
                sleep: Box::pin(tokio::time::sleep(delay)),
                rejected: self.policy.aborted(),
            },
            (None, true) => State::Aborted {
                rejected: self.policy.aborted(),
            },
        };
        ResponseFuture { state }
    }
}

pin_project! {
    /// The response future of a [`FaultInjectionService`].
    pub struct ResponseFuture<F> {
        #[pin]
        state: State<F>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Passing { #[pin] inner: F },
        // Timers are boxed: only test traffic is delayed, and every other
        // response future stays small.
        Delayed { sleep: Pin<Box<Sleep>>, slept: bool, #[pin] inner: F },
        DelayedAbort { sleep: Pin<Box<Sleep>>, rejected: Rejected },
        Aborted { rejected: Rejected },
    }
}

impl<F> ResponseFuture<F> {
    fn passing(inner: F) -> Self {
        Self {
            state: State::Passing { inner },
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
            StateProj::Passing { inner } => inner.poll(cx).map_err(Into::into),
            StateProj::Delayed {
                sleep,
                slept,
                inner,
            } => {
                if !*slept {
                    ready!(sleep.as_mut().poll(cx));
                    *slept = true;
                }
                inner.poll(cx).map_err(Into::into)
            }
            StateProj::DelayedAbort { sleep, rejected } => {
                ready!(sleep.as_mut().poll(cx));
                Poll::Ready(Err(Box::new(rejected.clone())))
            }
            StateProj::Aborted { rejected } => Poll::Ready(Err(Box::new(rejected.clone()))),
        }
    }
}
