//! The futures that enforce a [`Timeout`].

use std::future::{Future, poll_fn};
use std::pin::{Pin, pin};
use std::task::{Context, Poll, Waker, ready};

use keel_core::clock::Instant;
use keel_core::{BoxError, Deadline, Rejected};
use pin_project_lite::pin_project;
use tokio::time::Sleep;

use super::{Plan, Timeout};

pin_project! {
    /// Polls `inner` until it completes (`Some`) or its deadline passes
    /// (`None`).
    ///
    /// The timer is armed only when `inner` is still pending after a poll, so
    /// an operation that is ready at once never touches the timer wheel.
    pub(crate) struct Elapsing<F> {
        #[pin]
        inner: F,
        #[pin]
        timer: Timer,
    }
}

pin_project! {
    #[project = TimerProj]
    #[project_ref = TimerRef]
    enum Timer {
        Unarmed { at: Instant },
        Armed { #[pin] sleep: Sleep },
    }
}

impl<F> Elapsing<F> {
    pub(crate) fn new(inner: F, at: Instant) -> Self {
        Self {
            inner,
            timer: Timer::Unarmed { at },
        }
    }

    /// When the operation must have completed.
    fn at(self: Pin<&Self>) -> Instant {
        match self.project_ref().timer.project_ref() {
            TimerRef::Unarmed { at } => *at,
            TimerRef::Armed { sleep } => sleep.deadline(),
        }
    }
}

impl<F: Future> Future for Elapsing<F> {
    type Output = Option<F::Output>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        if let Poll::Ready(output) = this.inner.poll(cx) {
            return Poll::Ready(Some(output));
        }
        if let TimerProj::Unarmed { at } = this.timer.as_mut().project() {
            let sleep = tokio::time::sleep_until(*at);
            this.timer.set(Timer::Armed { sleep });
        }
        match this.timer.project() {
            TimerProj::Armed { sleep } => {
                ready!(sleep.poll(cx));
                Poll::Ready(None)
            }
            TimerProj::Unarmed { .. } => Poll::Pending,
        }
    }
}

pin_project! {
    /// The response future of a [`TimeoutService`](super::TimeoutService).
    pub struct ResponseFuture<F> {
        #[pin]
        state: State<F>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Running {
            #[pin]
            elapsing: Elapsing<F>,
            deadline_binds: bool,
            propagate: bool,
            policy: Timeout,
        },
        Refused { rejected: Rejected },
    }
}

impl<F> ResponseFuture<F> {
    pub(crate) fn running(inner: F, plan: Plan, policy: Timeout) -> Self {
        Self {
            state: State::Running {
                elapsing: Elapsing::new(inner, plan.at()),
                deadline_binds: plan.deadline_binds(),
                propagate: plan.scope().is_some(),
                policy,
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
        let mut state = self.project().state;
        let rejected = match state.as_mut().project() {
            StateProj::Refused { rejected } => return Poll::Ready(Err(Box::new(rejected.clone()))),
            StateProj::Running {
                elapsing,
                deadline_binds,
                propagate,
                policy,
            } => {
                let scope = propagate.then(|| Deadline::at(elapsing.as_ref().at()));
                match ready!(poll_in_scope(elapsing, scope, cx)) {
                    Some(result) => return Poll::Ready(result.map_err(Into::into)),
                    None => policy.elapsed(*deadline_binds),
                }
            }
        };
        // Cancel the operation now, not whenever the caller drops this future.
        state.set(State::Refused {
            rejected: rejected.clone(),
        });
        Poll::Ready(Err(Box::new(rejected)))
    }
}

/// Polls `fut` once with `scope` as the current deadline, so whatever the
/// inner service does while polled (retry sleeps, further calls) sees it.
fn poll_in_scope<F: Future>(
    mut fut: Pin<&mut F>,
    scope: Option<Deadline>,
    cx: &mut Context<'_>,
) -> Poll<F::Output> {
    match scope {
        Some(deadline) => pin!(deadline.scope(poll_fn(|cx| fut.as_mut().poll(cx)))).poll(cx),
        None => fut.poll(cx),
    }
}

/// Runs `f` synchronously with `deadline` as the current deadline, so a
/// tower service's `call` (which often builds the outgoing request, headers
/// included) sees it.
pub(crate) fn call_in_scope<R>(deadline: Deadline, f: impl FnOnce() -> R) -> R {
    let mut cx = Context::from_waker(Waker::noop());
    match pin!(deadline.scope(async move { f() })).poll(&mut cx) {
        Poll::Ready(output) => output,
        // An async block without an `.await` completes on its first poll.
        Poll::Pending => unreachable!("a block without await points is always ready"),
    }
}
