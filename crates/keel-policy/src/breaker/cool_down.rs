//! The cool-down timer: how an open breaker refuses without reading the
//! clock.
//!
//! Deciding whether an open breaker's cool-down is over takes a clock read,
//! which costs more than the rest of a refusal together. So when a breaker
//! opens inside a tokio runtime, it registers one timer with tokio's time
//! driver, due shortly before the cool-down ends, and marks its state word
//! "cooling". Until the timer fires, a refusal only loads that word.
//!
//! The timer is never polled by a task. Its waker clears the mark, and the
//! time driver calls that waker itself, in the same turn that moves the
//! clock. So under `tokio::time::pause` a test that advances past the
//! cool-down sees the probe let through at once, exactly as with a clock
//! read, and in real time the mark is gone [`WAKE_EARLY`] before a probe is
//! due. A runtime so busy that its driver runs later than that delays the
//! first probe by the difference, as it delays every timer. A breaker that opens outside a runtime, in one without timers, or
//! for less than [`SHORTEST`], reads the clock on every refusal instead. If
//! the runtime shuts down, its time driver fires every timer it holds, so
//! the mark cannot outlive it.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::sync::{Arc, Weak};
use std::task::{Context, Wake, Waker};
use std::time::Duration;

use keel_core::clock::Instant;
use tokio::time::Sleep;

use super::machine::Inner;
use super::state::Word;

/// How long before a probe is due the timer fires. It covers the driver's
/// 1 ms tick, to which timers round up, and a driver turn that runs late.
pub(super) const WAKE_EARLY: Duration = Duration::from_millis(10);

/// Cool-downs shorter than this read the clock: half of one would not
/// cover the driver's tick.
pub(super) const SHORTEST: Duration = Duration::from_millis(4);

/// The armed timer, kept so that it stays registered; dropping it (a new
/// transition) deregisters it.
pub(super) type CoolDown = Pin<Box<Sleep>>;

/// Whether a breaker opening now for `open_for` can arm a timer.
pub(super) fn can_arm(open_for: Duration) -> bool {
    open_for >= SHORTEST && tokio::runtime::Handle::try_current().is_ok()
}

/// Arms the timer for the open `word`, already published, whose probe is
/// due at `probe_at`. Returns it, or `None` when it fired at once or could
/// not be armed (the mark is then already cleared, and refusals read the
/// clock).
pub(super) fn arm(
    inner: Weak<Inner>,
    word: Word,
    probe_at: Instant,
    open_for: Duration,
) -> Option<CoolDown> {
    let wake_at = probe_at - WAKE_EARLY.min(open_for / 2);
    let waker = Waker::from(Arc::new(Over { inner, word }));
    // tokio cannot be asked whether this runtime has timers, or whether its
    // time driver is shutting down: it panics when a timer is made or
    // polled then. That panic only means "no timer", so it is caught and
    // the breaker reads the clock instead. Nothing is left half-changed by
    // it: the timer is this function's own.
    let armed = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let mut timer = Box::pin(tokio::time::sleep_until(wake_at));
        let fired = timer
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_ready();
        (!fired).then_some(timer)
    }));
    match armed {
        Ok(Some(timer)) => Some(timer),
        Ok(None) | Err(_) => {
            waker.wake();
            None
        }
    }
}

/// The timer's waker: clears the mark of the open state it was armed for.
struct Over {
    inner: Weak<Inner>,
    word: Word,
}

impl Wake for Over {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if let Some(inner) = self.inner.upgrade() {
            inner.cool_down_over(self.word);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures_util::FutureExt;
    use keel_core::Classified;
    use tokio::time::advance;

    use super::WAKE_EARLY;
    use crate::breaker::{CircuitBreaker, SlidingWindow, State};

    const MS: Duration = Duration::from_millis(1);

    fn breaker(open_for: Duration) -> CircuitBreaker {
        CircuitBreaker::builder("cooling")
            .sliding_window(SlidingWindow::Off)
            .consecutive_failures(1)
            .open_duration(open_for)
            .max_open_duration(open_for)
            .open_duration_jitter(0.0)
            .build()
            .expect("a valid breaker")
    }

    async fn trip(b: &CircuitBreaker) {
        let failed = b.call(|| async { Err::<(), _>(Classified::retryable("down")) });
        assert!(failed.await.is_err());
        assert_eq!(b.state(), State::Open);
    }

    async fn tripped(open_for: Duration) -> CircuitBreaker {
        let b = breaker(open_for);
        trip(&b).await;
        b
    }

    fn probes(b: &CircuitBreaker) -> bool {
        b.try_acquire().is_ok_and(|permit| permit.is_probe())
    }

    fn wait_left(b: &CircuitBreaker) -> Duration {
        let refused = b.try_acquire().expect_err("still open");
        refused.retry_after().expect("an open breaker says when")
    }

    #[tokio::test(start_paused = true)]
    async fn refusals_skip_the_clock_until_shortly_before_a_probe_is_due() {
        let open_for = Duration::from_secs(30);
        let b = tripped(open_for).await;
        assert!(b.cooling());
        advance(open_for - WAKE_EARLY - MS).await;
        assert!(b.cooling());
        assert_eq!(wait_left(&b), WAKE_EARLY + MS, "exact without the clock");
        advance(2 * MS).await;
        assert!(
            !b.cooling(),
            "the driver fired the timer as it moved the clock"
        );
        assert_eq!(wait_left(&b), WAKE_EARLY - MS);
        advance(WAKE_EARLY - MS).await;
        assert!(probes(&b), "a probe is let through when the cool-down ends");
        assert_eq!(b.state(), State::HalfOpen);
    }

    #[tokio::test(start_paused = true)]
    async fn a_test_that_sleeps_out_the_cool_down_sees_the_probe() {
        let open_for = Duration::from_secs(5);
        let b = tripped(open_for).await;
        tokio::time::sleep(open_for).await;
        assert!(probes(&b));
    }

    #[tokio::test(start_paused = true)]
    async fn a_jump_past_the_cool_down_sees_the_probe() {
        let open_for = Duration::from_secs(5);
        let b = tripped(open_for).await;
        advance(open_for).await;
        assert!(probes(&b));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn in_real_time_the_probe_goes_when_the_cool_down_ends() {
        let open_for = Duration::from_millis(40);
        let b = tripped(open_for).await;
        assert!(b.cooling());
        tokio::time::sleep(open_for).await;
        assert!(probes(&b));
    }

    #[tokio::test(start_paused = true)]
    async fn a_reopened_breaker_cools_down_again_and_the_old_timer_is_gone() {
        let open_for = Duration::from_secs(5);
        let b = tripped(open_for).await;
        advance(open_for).await;
        let probe = b.try_acquire().expect("a probe");
        probe.record(super::super::Outcome::Failure);
        assert_eq!(b.state(), State::Open);
        assert!(b.cooling(), "the new open state has a timer of its own");
        advance(open_for - WAKE_EARLY - MS).await;
        assert!(b.cooling());
        assert_eq!(wait_left(&b), WAKE_EARLY + MS);
        advance(WAKE_EARLY + MS).await;
        assert!(probes(&b));
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_racing_the_move_to_half_open_still_answers_a_sane_wait() {
        let open_for = Duration::from_secs(5);
        let b = tripped(open_for).await;
        assert!(b.cooling());
        // The word said "cooling", then the deadline became half-open's
        // "none" before the refusal read it.
        b.inner().forget_deadline();
        assert_eq!(wait_left(&b), open_for, "the open duration as a hint");
    }

    /// The same race where the refusal reads the clock (no timer, or the
    /// timer already fired): it used to answer the deadline as it found it,
    /// "probe in a century", and a saga parked its step for that long (found
    /// by `keel chaos --seed 3`).
    #[tokio::test(start_paused = true)]
    async fn a_refusal_reading_the_clock_while_racing_the_move_to_half_open_answers_a_sane_wait() {
        let open_for = super::SHORTEST - MS;
        let b = tripped(open_for).await;
        assert!(!b.cooling());
        b.inner().forget_deadline();
        assert_eq!(wait_left(&b), open_for, "the open duration as a hint");
    }

    #[tokio::test(start_paused = true)]
    async fn a_cool_down_too_short_for_the_timer_reads_the_clock() {
        let open_for = super::SHORTEST - MS;
        let b = tripped(open_for).await;
        assert!(!b.cooling());
        assert_eq!(wait_left(&b), open_for);
        advance(open_for).await;
        assert!(probes(&b));
    }

    #[test]
    fn a_breaker_opened_outside_a_runtime_reads_the_clock() {
        let b = breaker(Duration::from_millis(20));
        trip(&b).now_or_never().expect("ready at once");
        assert!(!b.cooling());
        assert!(wait_left(&b) <= Duration::from_millis(20));
        std::thread::sleep(Duration::from_millis(25));
        assert!(probes(&b));
    }

    /// Long enough to outlast the panic tokio prints (with a backtrace,
    /// when asked) before saying it has no timers.
    #[test]
    fn a_runtime_without_timers_leaves_the_clock_to_decide() {
        let open_for = Duration::from_secs(60);
        let b = breaker(open_for);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime without timers");
        runtime.block_on(trip(&b));
        assert!(!b.cooling(), "no timer, so no mark");
        let left = wait_left(&b);
        assert!(
            left > Duration::ZERO && left < open_for,
            "{left:?}, read off the clock"
        );
    }

    #[test]
    fn a_runtime_that_shuts_down_takes_its_timer_with_it() {
        let open_for = Duration::from_millis(20);
        let b = breaker(open_for);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("a runtime");
        runtime.block_on(trip(&b));
        assert!(b.cooling());
        drop(runtime);
        assert!(!b.cooling(), "the driver fired its timers as it shut down");
        std::thread::sleep(open_for + 5 * MS);
        assert!(probes(&b), "without the timer, the clock decides");
    }
}
