//! Where the running task's deadline lives: a thread-local cell that a
//! [`Scoped`] future fills around each poll of the future it wraps, and
//! restores afterwards, so the value follows the task wherever it is polled.
//!
//! tokio's `task_local!` does the same with a `RefCell<Option<T>>` and keeps
//! the wrapped future in an `Option` so it can drop it inside the scope. A
//! deadline is `Copy` and nothing reads it while being dropped, so a `Cell`
//! swap is all a scope needs; keel-policy's `Pipeline` polls two scopes per
//! call (total and attempt timeouts), and every hop of a request at least
//! one.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use pin_project_lite::pin_project;

use super::Deadline;

thread_local! {
    static CURRENT: Cell<Option<Deadline>> = const { Cell::new(None) };
}

/// The deadline of whatever is being polled on this thread right now.
#[inline]
pub(super) fn current() -> Option<Deadline> {
    // A const-initialised cell without a destructor is never torn down, so
    // this only fails in a thread's own teardown, where no task runs.
    CURRENT.try_with(Cell::get).ok().flatten()
}

/// Makes `deadline` the current one until the guard drops, even if what runs
/// in between panics.
#[inline]
pub(super) fn enter(deadline: Deadline) -> Restore {
    Restore(CURRENT.replace(Some(deadline)))
}

/// Puts back the deadline that was current before [`enter`].
pub(super) struct Restore(Option<Deadline>);

impl Drop for Restore {
    #[inline]
    fn drop(&mut self) {
        CURRENT.set(self.0);
    }
}

pin_project! {
    /// The future returned by [`Deadline::scope`]: `F`, polled with its
    /// deadline as the current one. (Dropping it drops `F` outside the
    /// scope.)
    #[derive(Debug)]
    #[must_use = "futures do nothing unless polled"]
    pub struct Scoped<F> {
        deadline: Deadline,
        #[pin]
        inner: F,
    }
}

impl<F> Scoped<F> {
    pub(super) fn new(deadline: Deadline, inner: F) -> Self {
        Self { deadline, inner }
    }
}

impl<F: Future> Future for Scoped<F> {
    type Output = F::Output;

    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let _restore = enter(*this.deadline);
        this.inner.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::future::poll_fn;
    use std::panic::{AssertUnwindSafe, catch_unwind};
    use std::pin::pin;
    use std::task::Waker;
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_scope_is_current_only_while_its_future_is_polled() {
        let deadline = Deadline::after(Duration::from_secs(1));
        let mut polls = 0;
        let mut scoped = pin!(deadline.scope(poll_fn(|_| {
            assert_eq!(Deadline::current(), Some(deadline));
            polls += 1;
            if polls == 2 {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })));
        let mut cx = Context::from_waker(Waker::noop());
        assert!(scoped.as_mut().poll(&mut cx).is_pending());
        assert_eq!(Deadline::current(), None, "between polls, no scope");
        assert!(scoped.as_mut().poll(&mut cx).is_ready());
        assert_eq!(Deadline::current(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_panic_inside_a_scope_puts_the_outer_deadline_back() {
        let outer = Deadline::after(Duration::from_secs(2));
        let inner = Deadline::after(Duration::from_secs(1));
        outer
            .scope(async {
                let panicked = catch_unwind(AssertUnwindSafe(|| {
                    inner.sync_scope(|| panic!("the operation panics inside its scope"))
                }));
                assert!(panicked.is_err());
                assert_eq!(Deadline::current(), Some(outer));
            })
            .await;
        assert_eq!(Deadline::current(), None);
    }
}
