//! Load shedding as tower middleware.

use std::fmt;
use std::future::Future;
use std::mem;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use keel_core::{BoxError, Rejected};
use tower_layer::Layer;
use tower_service::Service;

use super::{LoadShed, ResponseFuture, Slot};

/// Applies a [`LoadShed`] policy to a tower service. Every service it makes
/// shares the policy's slots and queue.
#[derive(Debug, Clone)]
pub struct LoadShedLayer {
    shed: LoadShed,
}

impl LoadShedLayer {
    /// A layer sharing `shed`.
    pub fn new(shed: LoadShed) -> Self {
        Self { shed }
    }
}

impl<S> Layer<S> for LoadShedLayer {
    type Service = LoadShedService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        LoadShedService::new(inner, self.shed.clone())
    }
}

/// A tower service whose calls run in a [`LoadShed`] policy's slots.
///
/// The slot is taken in `poll_ready`, queueing there while the queue has
/// room. Shed calls do not wait: `poll_ready` is ready and the call fails
/// with a boxed [`Rejected::Overloaded`] (or `DeadlineExceeded` if the
/// deadline passed while queued).
pub struct LoadShedService<S> {
    inner: S,
    shed: LoadShed,
    admission: Admission,
}

type Waiting = Pin<Box<dyn Future<Output = Result<Slot, Rejected>> + Send>>;

enum Admission {
    Idle,
    Waiting(Waiting),
    Admitted(Slot),
    Refused(Rejected),
}

impl<S> LoadShedService<S> {
    /// Wraps `inner` in `shed`.
    pub fn new(inner: S, shed: LoadShed) -> Self {
        Self {
            inner,
            shed,
            admission: Admission::Idle,
        }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// Unwraps the inner service (a slot taken by `poll_ready` is freed).
    pub fn into_inner(self) -> S {
        self.inner
    }

    fn admit(&self) -> Admission {
        if let Some(slot) = self.shed.try_enter_owned() {
            Admission::Admitted(slot)
        } else if self.shed.can_queue() {
            // Only a call that has to wait pays for boxing its wait.
            Admission::Waiting(Box::pin(self.shed.clone().enter_owned()))
        } else {
            Admission::Refused(self.shed.shed())
        }
    }
}

impl<S, Req> Service<Req> for LoadShedService<S>
where
    S: Service<Req>,
    S::Error: Into<BoxError>,
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
            Admission::Idle | Admission::Waiting(_) => match self.shed.try_enter_owned() {
                Some(slot) => ResponseFuture::admitted(self.inner.call(req), slot),
                None => ResponseFuture::refused(self.shed.shed()),
            },
        }
    }
}

impl<S: Clone> Clone for LoadShedService<S> {
    /// A clone shares the policy but holds no slot of its own yet.
    fn clone(&self) -> Self {
        Self::new(self.inner.clone(), self.shed.clone())
    }
}

impl<S: fmt::Debug> fmt::Debug for LoadShedService<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let admission = match self.admission {
            Admission::Idle => "idle",
            Admission::Waiting(_) => "waiting",
            Admission::Admitted(_) => "admitted",
            Admission::Refused(_) => "refused",
        };
        f.debug_struct("LoadShedService")
            .field("inner", &self.inner)
            .field("shed", &self.shed)
            .field("admission", &admission)
            .finish()
    }
}
