//! The retry state machine, shared by [`Retry::call`](super::Retry::call) and
//! the tower service: run an attempt, judge it, wait, start the next.

use std::future::Future;
use std::ops::Deref;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use keel_core::PolicyError;
use pin_project_lite::pin_project;
use tokio::time::Sleep;

use super::attempts::Attempts;
use super::policy::{RetryPolicy, Verdict};
use super::{Progress, Shared};

pin_project! {
    #[project = StateProj]
    enum State<F> {
        Running { #[pin] attempt: F },
        // Boxed: only a retry pays for the timer, and every call's future
        // stays small.
        Sleeping { sleep: Pin<Box<Sleep>> },
        Starting,
    }
}

pin_project! {
    /// One call going through a retry policy.
    pub(crate) struct RetryFuture<R, A: Attempts> {
        shared: R,
        attempts: A,
        progress: Progress,
        #[pin]
        state: State<A::Future>,
    }
}

impl<R, A: Attempts> RetryFuture<R, A> {
    /// A call whose first attempt is `first` if already started (a tower
    /// service calls its ready inner service at once), else started on the
    /// first poll.
    pub(crate) fn new(shared: R, attempts: A, first: Option<A::Future>) -> Self {
        let (state, progress) = match first {
            Some(attempt) => (State::Running { attempt }, Progress::started()),
            None => (State::Starting, Progress::default()),
        };
        Self {
            shared,
            attempts,
            progress,
            state,
        }
    }
}

impl<R, A, P> Future for RetryFuture<R, A>
where
    A: Attempts,
    R: Deref<Target = Shared<P>>,
    P: RetryPolicy<A::Ok, A::Error>,
{
    type Output = Result<A::Ok, PolicyError<A::Error>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Running { attempt } => {
                    let outcome = ready!(attempt.poll(cx));
                    let shared = &**this.shared;
                    let verdict = match &outcome {
                        Ok(value) => shared.policy.check_ok(value),
                        Err(error) => shared.policy.check_error(error),
                    };
                    if verdict == Verdict::Accept {
                        return Poll::Ready(outcome.map_err(PolicyError::Inner));
                    }
                    match shared.next_retry(verdict, this.progress) {
                        Ok(delay) if delay.is_zero() => this.state.set(State::Starting),
                        Ok(delay) => this.state.set(State::Sleeping {
                            sleep: Box::pin(tokio::time::sleep(delay)),
                        }),
                        Err(stop) => return Poll::Ready(shared.finish(outcome, stop)),
                    }
                }
                StateProj::Sleeping { sleep } => {
                    ready!(sleep.as_mut().poll(cx));
                    this.state.set(State::Starting);
                }
                StateProj::Starting => {
                    if this.progress.begin() {
                        this.shared.record_request();
                    }
                    match ready!(this.attempts.poll_start(cx)) {
                        Ok(attempt) => this.state.set(State::Running { attempt }),
                        Err(error) => return Poll::Ready(Err(PolicyError::Inner(error))),
                    }
                }
            }
        }
    }
}
