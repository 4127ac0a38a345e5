//! The hedging state machine, shared by [`Hedge::call`](super::Hedge::call)
//! and the tower service.
//!
//! The first attempt lives inline, so a call that finishes before the hedge
//! delay allocates nothing and arms no timer. Hedges, started only on the
//! slow path, are boxed.

use std::future::Future;
use std::ops::Deref;
use std::pin::Pin;
use std::task::{Context, Poll};

use keel_core::PolicyError;
use keel_core::clock::Instant;
use pin_project_lite::pin_project;
use tokio::time::Sleep;

use super::Shared;
use crate::retry::attempts::Attempts;

/// Whether more hedges may start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Not polled yet: the request is not recorded, the first attempt not started.
    New,
    /// Waiting for the first attempt to start (a service may not be ready).
    Opening,
    /// The timer is not armed yet (armed when the first attempt is pending).
    Unarmed,
    /// Waiting for the hedge delay.
    Waiting,
    /// A hedge is due; waiting for the service to be ready.
    Starting,
    /// No more hedges: the limit, budget or deadline says so.
    Done,
}

type Running<F> = (Pin<Box<F>>, Option<Instant>);

pin_project! {
    /// One call going through a hedging policy.
    pub(crate) struct HedgeFuture<R, A: Attempts> {
        shared: R,
        attempts: A,
        #[pin]
        primary: Option<A::Future>,
        primary_started: Option<Instant>,
        hedges: Vec<Running<A::Future>>,
        #[pin]
        timer: Option<Sleep>,
        phase: Phase,
        launched: u32,
    }
}

impl<R, A: Attempts> HedgeFuture<R, A> {
    /// A call whose first attempt starts when it is first polled.
    pub(crate) fn new(shared: R, attempts: A) -> Self {
        Self {
            shared,
            attempts,
            primary: None,
            primary_started: None,
            hedges: Vec::new(),
            timer: None,
            phase: Phase::New,
            launched: 0,
        }
    }

    /// A call whose first attempt is already running (a tower service calls
    /// its ready inner service at once).
    pub(crate) fn started(shared: R, attempts: A, first: A::Future, at: Option<Instant>) -> Self {
        Self {
            primary: Some(first),
            primary_started: at,
            phase: Phase::Unarmed,
            ..Self::new(shared, attempts)
        }
    }
}

impl<R, A> Future for HedgeFuture<R, A>
where
    A: Attempts,
    R: Deref<Target = Shared>,
{
    type Output = Result<A::Ok, PolicyError<A::Error>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let shared = &**this.shared;
        if *this.phase == Phase::New {
            shared.record_request();
            *this.primary_started = shared.start_clock();
            *this.phase = Phase::Opening;
        }
        if *this.phase == Phase::Opening {
            match this.attempts.poll_start(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Err(error)) => return Poll::Ready(Err(PolicyError::Inner(error))),
                Poll::Ready(Ok(first)) => {
                    this.primary.set(Some(first));
                    *this.phase = Phase::Unarmed;
                }
            }
        }
        if let Some(primary) = this.primary.as_mut().as_pin_mut()
            && let Poll::Ready(outcome) = primary.poll(cx)
        {
            this.primary.set(None);
            match outcome {
                Ok(value) => {
                    shared.record_success(*this.primary_started, false);
                    return Poll::Ready(Ok(value));
                }
                Err(error) if this.hedges.is_empty() && *this.phase != Phase::Starting => {
                    return Poll::Ready(Err(PolicyError::Inner(error)));
                }
                Err(_) => {}
            }
        }
        loop {
            let mut index = 0;
            while let Some((hedge, started)) = this.hedges.get_mut(index) {
                let Poll::Ready(outcome) = hedge.as_mut().poll(cx) else {
                    index += 1;
                    continue;
                };
                let started = *started;
                drop(this.hedges.swap_remove(index));
                match outcome {
                    Ok(value) => {
                        shared.record_success(started, true);
                        return Poll::Ready(Ok(value));
                    }
                    Err(error) if this.hedges.is_empty() && this.primary.is_none() => {
                        return Poll::Ready(Err(PolicyError::Inner(error)));
                    }
                    Err(_) => {}
                }
            }
            if *this.phase == Phase::Unarmed {
                *this.phase = Phase::Waiting;
                this.timer.set(Some(tokio::time::sleep(shared.delay())));
            }
            if *this.phase == Phase::Waiting {
                let Some(timer) = this.timer.as_mut().as_pin_mut() else {
                    return Poll::Pending;
                };
                if timer.poll(cx).is_pending() {
                    return Poll::Pending;
                }
                *this.phase = if shared.may_hedge() {
                    Phase::Starting
                } else {
                    Phase::Done
                };
            }
            if *this.phase != Phase::Starting {
                return Poll::Pending;
            }
            match this.attempts.poll_start(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(hedge)) => {
                    *this.launched += 1;
                    this.hedges.push((Box::pin(hedge), shared.start_clock()));
                    shared.announce_hedge(*this.launched);
                    *this.phase = if *this.launched < shared.max_hedges {
                        this.timer.set(Some(tokio::time::sleep(shared.delay())));
                        Phase::Waiting
                    } else {
                        this.timer.set(None);
                        Phase::Done
                    };
                }
                Poll::Ready(Err(error)) => {
                    *this.phase = Phase::Done;
                    if this.hedges.is_empty() && this.primary.is_none() {
                        return Poll::Ready(Err(PolicyError::Inner(error)));
                    }
                }
            }
        }
    }
}
