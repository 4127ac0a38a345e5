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
        // The last outcome that may have taken effect, once a later attempt
        // was started: what the call returns unless a later one settles it.
        maybe_applied: Option<Result<A::Ok, A::Error>>,
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
            maybe_applied: None,
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
                    let unknown = verdict.may_have_taken_effect();
                    if verdict == Verdict::Accept {
                        let earlier = this.maybe_applied.take();
                        return Poll::Ready(shared.accept(outcome, earlier));
                    }
                    let delay = match shared.next_retry(verdict, this.progress) {
                        Ok(delay) => delay,
                        Err(stop) => {
                            let earlier = this.maybe_applied.take();
                            return Poll::Ready(shared.finish(outcome, verdict, earlier, stop));
                        }
                    };
                    if unknown {
                        *this.maybe_applied = Some(outcome);
                    }
                    if delay.is_zero() {
                        this.state.set(State::Starting);
                    } else {
                        this.state.set(State::Sleeping {
                            sleep: Box::pin(tokio::time::sleep(delay)),
                        });
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
                        Err(error) => {
                            let earlier = this.maybe_applied.take();
                            return Poll::Ready(this.shared.accept(Err(error), earlier));
                        }
                    }
                }
            }
        }
    }
}
