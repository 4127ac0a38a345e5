//! The tower service of a slot policy.

use std::fmt;
use std::future::Future;
use std::mem;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use keel_core::{BoxError, Rejected};
use tower_service::Service;

use super::{Admit, ResponseFuture, Slot};

/// A tower service whose calls run in a policy's slots.
///
/// The slot is taken in `poll_ready` (waiting there while the policy lets
/// calls wait), so a policy with no room answers at once: `poll_ready` is
/// ready and the call fails with the policy's boxed [`Rejected`].
pub struct SlotService<S, P> {
    inner: S,
    policy: P,
    admission: Admission,
}

type Waiting = Pin<Box<dyn Future<Output = Result<Slot, Rejected>> + Send>>;

enum Admission {
    Idle,
    Waiting(Waiting),
    Admitted(Slot),
    Refused(Rejected),
}

impl<S, P: Admit> SlotService<S, P> {
    /// Wraps `inner` in `policy`.
    pub fn new(inner: S, policy: P) -> Self {
        Self {
            inner,
            policy,
            admission: Admission::Idle,
        }
    }

    keel_core::inner_service_accessors!(inner: S);

    fn admit(&self) -> Admission {
        if let Some(slot) = self.policy.try_enter_owned() {
            Admission::Admitted(slot)
        } else if self.policy.can_queue() {
            // Only a call that has to wait pays for boxing its wait.
            Admission::Waiting(Box::pin(self.policy.clone().enter_owned()))
        } else {
            Admission::Refused(self.policy.refuse())
        }
    }
}

impl<S, P, Req> Service<Req> for SlotService<S, P>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
    P: Admit,
{
    type Response = S::Response;
    type Error = BoxError;
    type Future = ResponseFuture<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        loop {
            match &mut self.admission {
                Admission::Idle => self.admission = self.admit(),
                Admission::Waiting(wait) => {
                    self.admission = match ready!(wait.as_mut().poll(cx)) {
                        Ok(slot) => Admission::Admitted(slot),
                        Err(rejected) => Admission::Refused(rejected),
                    };
                }
                Admission::Admitted(_) => return self.inner.poll_ready(cx).map_err(Into::into),
                Admission::Refused(_) => return Poll::Ready(Ok(())),
            }
        }
    }

    fn call(&mut self, req: Req) -> Self::Future {
        match mem::replace(&mut self.admission, Admission::Idle) {
            Admission::Admitted(slot) => ResponseFuture::admitted(self.inner.call(req), slot),
            Admission::Refused(rejected) => ResponseFuture::refused(rejected),
            // Called without `poll_ready`: admit only if a slot is free now.
            Admission::Idle | Admission::Waiting(_) => match self.policy.try_enter_owned() {
                Some(slot) => ResponseFuture::admitted(self.inner.call(req), slot),
                None => ResponseFuture::refused(self.policy.refuse()),
            },
        }
    }
}

impl<S: Clone, P: Admit> Clone for SlotService<S, P> {
    /// A clone shares the policy but holds no slot of its own yet.
    fn clone(&self) -> Self {
        Self::new(self.inner.clone(), self.policy.clone())
    }
}

impl<S: fmt::Debug, P: fmt::Debug> fmt::Debug for SlotService<S, P> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let admission = match self.admission {
            Admission::Idle => "idle",
            Admission::Waiting(_) => "waiting",
            Admission::Admitted(_) => "admitted",
            Admission::Refused(_) => "refused",
        };
        f.debug_struct("SlotService")
            .field("inner", &self.inner)
            .field("policy", &self.policy)
            .field("admission", &admission)
            .finish()
    }
}
