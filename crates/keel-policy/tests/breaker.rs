//! Behaviour of the circuit breaker: when it opens, what it protects, how it
//! probes, and that every transition is reported.
#![cfg(feature = "breaker")]

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use futures_util::FutureExt;
use keel_core::{BoxError, Classify, ErrorClass, PolicyError, Rejected};
use keel_policy::breaker::{
    BreakerRegistry, BreakerRegistryConfig, CircuitBreaker, CircuitBreakerBuilder,
    CircuitBreakerConfig, Outcome, SlidingWindow, State, StateTransition,
};
use tokio::time::advance;

/// A dependency's errors, one per class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
enum DepError {
    #[error("dependency down")]
    Down,
    #[error("bad input")]
    BadInput,
    #[error("refused by an inner policy")]
    Refused,
}

impl Classify for DepError {
    fn class(&self) -> ErrorClass {
        match self {
            Self::Down => ErrorClass::Retryable,
            Self::BadInput => ErrorClass::Permanent,
            Self::Refused => ErrorClass::Rejected,
        }
    }
}

/// A dependency that counts how often it is really called.
#[derive(Debug, Default, Clone)]
struct Dependency {
    calls: Arc<AtomicUsize>,
}

impl Dependency {
    async fn answer(&self, result: Result<u32, DepError>) -> Result<u32, DepError> {
        self.calls.fetch_add(1, SeqCst);
        result
    }

    fn calls(&self) -> usize {
        self.calls.load(SeqCst)
    }
}

const SECOND: Duration = Duration::from_secs(1);

/// Defaults, without jitter, so that transitions happen at exact times.
fn breaker() -> CircuitBreakerBuilder {
    CircuitBreaker::builder("prices").open_duration_jitter(0.0)
}

async fn call(
    b: &CircuitBreaker,
    result: Result<u32, DepError>,
) -> Result<u32, PolicyError<DepError>> {
    b.call(|| async move { result }).await
}

async fn fail_times(b: &CircuitBreaker, n: usize) {
    for _ in 0..n {
        let _ = call(b, Err(DepError::Down)).await;
    }
}

fn retry_after(result: Result<u32, PolicyError<DepError>>) -> Duration {
    match result {
        Err(PolicyError::Rejected(open @ Rejected::CircuitOpen { .. })) => open
            .retry_after()
            .expect("an open breaker says when to retry"),
        other => panic!("expected a circuit-open refusal, got {other:?}"),
    }
}

fn transitions(
    events: &mut tokio::sync::broadcast::Receiver<StateTransition>,
) -> Vec<(State, State)> {
    std::iter::from_fn(|| events.try_recv().ok())
        .map(|t| (t.from, t.to))
        .collect()
}

#[tokio::test(start_paused = true)]
async fn breaker_opens_and_serves_fallback() {
    let dependency = Dependency::default();
    let b = breaker().minimum_calls(20).build().unwrap();

    for _ in 0..25 {
        let _ = b.call(|| dependency.answer(Err(DepError::Down))).await;
    }
    assert_eq!(b.state(), State::Open);
    assert_eq!(
        dependency.calls(),
        20,
        "the breaker opened after 20 calls and stopped calling"
    );

    let cached = 7;
    let price = b
        .call_or_fallback(
            || dependency.answer(Ok(1)),
            |_open| async move { Ok(cached) },
        )
        .await;
    assert_eq!(price, Ok(cached), "the fallback is served while open");
    for _ in 0..100 {
        let _ = b.call(|| dependency.answer(Ok(1))).await;
    }
    assert_eq!(
        dependency.calls(),
        20,
        "an open breaker protects the dependency: no call grows the count"
    );
}

#[tokio::test(start_paused = true)]
async fn opens_only_once_minimum_calls_are_recorded() {
    let b = breaker().minimum_calls(20).build().unwrap();
    fail_times(&b, 19).await;
    assert_eq!(
        b.state(),
        State::Closed,
        "19 failures out of 19 calls are too few samples"
    );
    assert_eq!(b.metrics().failure_rate, None);
    fail_times(&b, 1).await;
    assert_eq!(b.state(), State::Open);
}

#[tokio::test(start_paused = true)]
async fn opens_at_the_failure_rate_threshold_not_below() {
    let b = breaker()
        .minimum_calls(20)
        .failure_rate_threshold(50.0)
        .build()
        .unwrap();
    for _ in 0..11 {
        call(&b, Ok(1)).await.unwrap();
    }
    fail_times(&b, 9).await;
    assert_eq!(b.state(), State::Closed, "45% is below 50%");
    assert_eq!(b.metrics().failure_rate, Some(45.0));
    fail_times(&b, 1).await;
    assert_eq!(b.state(), State::Closed, "10 of 21 is still below");
    fail_times(&b, 1).await;
    assert_eq!(b.state(), State::Open, "11 of 22 is 50%: open");
}

#[tokio::test(start_paused = true)]
async fn old_calls_leave_the_count_window() {
    let b = breaker()
        .count_window(10)
        .minimum_calls(10)
        .build()
        .unwrap();
    fail_times(&b, 4).await;
    for _ in 0..10 {
        call(&b, Ok(1)).await.unwrap();
    }
    assert_eq!(
        b.metrics().failed_calls,
        0,
        "the failures fell out of the last 10 calls"
    );
    fail_times(&b, 4).await;
    assert_eq!(b.state(), State::Closed);
    fail_times(&b, 1).await;
    assert_eq!(b.state(), State::Open);
}

#[tokio::test(start_paused = true)]
async fn time_window_forgets_failures_older_than_its_span() {
    let b = breaker().time_window(10).minimum_calls(5).build().unwrap();
    fail_times(&b, 4).await;
    advance(11 * SECOND).await;
    fail_times(&b, 4).await;
    assert_eq!(
        b.state(),
        State::Closed,
        "only the last 10 s count: 4 calls"
    );
    assert_eq!(b.metrics().buffered_calls, 4);
    fail_times(&b, 1).await;
    assert_eq!(b.state(), State::Open);
}

#[tokio::test(start_paused = true)]
async fn time_window_counts_every_second_of_its_span() {
    let b = breaker().time_window(10).minimum_calls(5).build().unwrap();
    for _ in 0..5 {
        advance(SECOND).await;
        fail_times(&b, 1).await;
    }
    assert_eq!(b.state(), State::Open, "5 failures within the last 10 s");
}

#[tokio::test(start_paused = true)]
async fn time_window_metrics_forget_calls_older_than_its_span() {
    let b = breaker().time_window(10).minimum_calls(5).build().unwrap();
    fail_times(&b, 4).await;
    advance(5 * SECOND).await;
    assert_eq!(b.metrics().failed_calls, 4);
    advance(6 * SECOND).await;
    assert_eq!(
        b.metrics().buffered_calls,
        0,
        "11 s later, no call is left in the window"
    );
}

#[tokio::test(start_paused = true)]
async fn closing_starts_a_fresh_time_window() {
    let b = breaker().time_window(60).minimum_calls(5).build().unwrap();
    fail_times(&b, 5).await;
    advance(30 * SECOND).await;
    call(&b, Ok(1)).await.unwrap();
    assert_eq!(b.state(), State::Closed);
    fail_times(&b, 1).await;
    assert_eq!(
        b.state(),
        State::Closed,
        "the 5 failures before the close, 30 s ago, no longer count"
    );
    assert_eq!(b.metrics().buffered_calls, 1);
}

#[tokio::test(start_paused = true)]
async fn permanent_errors_count_as_answers() {
    let b = breaker().minimum_calls(5).build().unwrap();
    for _ in 0..20 {
        let _ = call(&b, Err(DepError::BadInput)).await;
    }
    assert_eq!(b.state(), State::Closed);
    let m = b.metrics();
    assert_eq!((m.buffered_calls, m.failed_calls), (20, 0));
}

#[tokio::test(start_paused = true)]
async fn refusals_by_inner_policies_are_not_recorded() {
    let b = breaker().minimum_calls(5).build().unwrap();
    for _ in 0..20 {
        let _ = call(&b, Err(DepError::Refused)).await;
    }
    assert_eq!(b.state(), State::Closed);
    assert_eq!(b.metrics().buffered_calls, 0);
}

#[tokio::test(start_paused = true)]
async fn open_refuses_with_the_time_until_a_probe() {
    let b = breaker()
        .minimum_calls(5)
        .open_duration(30 * SECOND)
        .build()
        .unwrap();
    fail_times(&b, 5).await;
    assert_eq!(retry_after(call(&b, Ok(1)).await), 30 * SECOND);
    advance(29 * SECOND).await;
    assert_eq!(retry_after(call(&b, Ok(1)).await), SECOND);
}

#[tokio::test(start_paused = true)]
async fn a_successful_probe_closes_and_clears_the_window() {
    let b = breaker()
        .minimum_calls(5)
        .open_duration(30 * SECOND)
        .build()
        .unwrap();
    let mut events = b.subscribe();
    fail_times(&b, 5).await;
    advance(30 * SECOND).await;
    assert_eq!(
        b.state(),
        State::Open,
        "the state moves on when a call arrives to probe"
    );
    call(&b, Ok(1)).await.unwrap();
    assert_eq!(b.state(), State::Closed);
    assert_eq!(
        b.metrics().buffered_calls,
        0,
        "closing starts a fresh window"
    );
    assert_eq!(
        transitions(&mut events),
        [
            (State::Closed, State::Open),
            (State::Open, State::HalfOpen),
            (State::HalfOpen, State::Closed)
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn failed_probes_double_the_open_duration_up_to_the_cap_then_reset() {
    let b = breaker()
        .minimum_calls(5)
        .open_duration(30 * SECOND)
        .max_open_duration(300 * SECOND)
        .build()
        .unwrap();
    fail_times(&b, 5).await;
    for expected in [30, 60, 120, 240, 300, 300] {
        assert_eq!(retry_after(call(&b, Ok(1)).await), expected * SECOND);
        advance(expected * SECOND).await;
        fail_times(&b, 1).await;
        assert_eq!(b.state(), State::Open, "one failed probe reopens");
    }
    advance(300 * SECOND).await;
    call(&b, Ok(1)).await.unwrap();
    assert_eq!(b.state(), State::Closed);
    fail_times(&b, 5).await;
    assert_eq!(
        retry_after(call(&b, Ok(1)).await),
        30 * SECOND,
        "a successful close resets the backoff"
    );
}

#[tokio::test(start_paused = true)]
async fn half_open_closes_only_after_every_probe_succeeded() {
    let b = breaker()
        .minimum_calls(5)
        .permitted_calls_in_half_open(3)
        .build()
        .unwrap();
    fail_times(&b, 5).await;
    advance(30 * SECOND).await;
    let probes: Vec<_> = (0..3).map(|_| b.try_acquire().unwrap()).collect();
    assert!(probes.iter().all(|p| p.is_probe()));
    assert!(
        b.try_acquire().is_err(),
        "a fourth caller is refused while 3 probes are out"
    );
    let mut probes = probes.into_iter();
    probes.next().unwrap().record(Outcome::Success);
    probes.next().unwrap().record(Outcome::Success);
    assert_eq!(
        b.state(),
        State::HalfOpen,
        "two of three is not enough: never average"
    );
    probes.next().unwrap().record(Outcome::Success);
    assert_eq!(b.state(), State::Closed);
}

#[tokio::test(start_paused = true)]
async fn one_failed_probe_reopens_and_the_others_no_longer_count() {
    let b = breaker()
        .minimum_calls(5)
        .permitted_calls_in_half_open(3)
        .build()
        .unwrap();
    fail_times(&b, 5).await;
    advance(30 * SECOND).await;
    let first = b.try_acquire().unwrap();
    let second = b.try_acquire().unwrap();
    first.record(Outcome::Failure);
    assert_eq!(b.state(), State::Open);
    second.record(Outcome::Success);
    assert_eq!(
        b.state(),
        State::Open,
        "a probe from the failed round is stale"
    );
    assert_eq!(retry_after(call(&b, Ok(1)).await), 60 * SECOND);
}

#[tokio::test(start_paused = true)]
async fn a_cancelled_probe_gives_its_slot_back() {
    let b = breaker().minimum_calls(5).build().unwrap();
    fail_times(&b, 5).await;
    advance(30 * SECOND).await;
    let dependency = Dependency::default();
    let mut hanging = Box::pin(b.call(|| async {
        dependency.calls.fetch_add(1, SeqCst);
        std::future::pending::<Result<u32, DepError>>().await
    }));
    assert!(
        hanging.as_mut().now_or_never().is_none(),
        "the probe is in flight"
    );
    assert!(b.try_acquire().is_err(), "its slot is taken");
    drop(hanging);
    assert_eq!(b.state(), State::HalfOpen);
    call(&b, Ok(1)).await.unwrap();
    assert_eq!(b.state(), State::Closed, "the next caller probed instead");
    assert_eq!(dependency.calls(), 1);
}

#[tokio::test(start_paused = true)]
async fn an_ignored_probe_gives_its_slot_back() {
    let b = breaker().minimum_calls(5).build().unwrap();
    fail_times(&b, 5).await;
    advance(30 * SECOND).await;
    let _ = call(&b, Err(DepError::Refused)).await;
    assert_eq!(b.state(), State::HalfOpen);
    assert_eq!(b.metrics().probes_in_flight, 0);
    call(&b, Ok(1)).await.unwrap();
    assert_eq!(b.state(), State::Closed);
}

#[tokio::test(start_paused = true)]
async fn a_probe_cancelled_after_its_round_ended_frees_no_slot_in_the_next() {
    let b = breaker()
        .minimum_calls(5)
        .permitted_calls_in_half_open(2)
        .build()
        .unwrap();
    fail_times(&b, 5).await;
    advance(30 * SECOND).await;
    let stale = b.try_acquire().unwrap();
    b.try_acquire().unwrap().record(Outcome::Failure);
    advance(60 * SECOND).await;
    let _probes = (b.try_acquire().unwrap(), b.try_acquire().unwrap());
    drop(stale);
    assert!(
        b.try_acquire().is_err(),
        "the new round's 2 probes are out; the old round's cancel is not one of them"
    );
    assert_eq!(b.metrics().probes_in_flight, 2);
}

#[tokio::test(start_paused = true)]
async fn probes_that_never_answer_count_as_failed_after_max_wait() {
    let b = breaker()
        .minimum_calls(5)
        .max_wait_in_half_open(5 * SECOND)
        .build()
        .unwrap();
    fail_times(&b, 5).await;
    advance(30 * SECOND).await;
    let _stuck = b.try_acquire().unwrap();
    advance(4 * SECOND).await;
    assert_eq!(retry_after(call(&b, Ok(1)).await), SECOND);
    advance(SECOND).await;
    assert_eq!(
        retry_after(call(&b, Ok(1)).await),
        60 * SECOND,
        "reopened, with the doubled duration"
    );
    assert_eq!(b.state(), State::Open);
}

#[tokio::test(start_paused = true)]
async fn outcomes_from_before_a_transition_are_stale() {
    let b = breaker().minimum_calls(5).build().unwrap();
    let slow_success = b.try_acquire().unwrap();
    fail_times(&b, 5).await;
    advance(30 * SECOND).await;
    let probe = b.try_acquire().unwrap();
    slow_success.record(Outcome::Success);
    assert_eq!(
        b.state(),
        State::HalfOpen,
        "a call let through while closed is not a probe"
    );
    probe.record(Outcome::Success);
    assert_eq!(b.state(), State::Closed);
}

#[tokio::test(start_paused = true)]
async fn consecutive_failures_alone_open_the_breaker() {
    let b = breaker()
        .sliding_window(SlidingWindow::Off)
        .consecutive_failures(3)
        .build()
        .unwrap();
    fail_times(&b, 2).await;
    call(&b, Ok(1)).await.unwrap();
    fail_times(&b, 2).await;
    assert_eq!(b.state(), State::Closed, "a success ends the run");
    assert_eq!(b.metrics().consecutive_failures, 2);
    fail_times(&b, 1).await;
    assert_eq!(b.state(), State::Open);
}

#[tokio::test(start_paused = true)]
async fn consecutive_failures_work_alongside_rates() {
    let b = breaker()
        .minimum_calls(20)
        .consecutive_failures(5)
        .build()
        .unwrap();
    fail_times(&b, 5).await;
    assert_eq!(b.state(), State::Open, "5 in a row, long before 20 calls");
}

#[tokio::test(start_paused = true)]
async fn slow_calls_open_the_breaker() {
    let b = breaker()
        .minimum_calls(4)
        .slow_call_duration_threshold(2 * SECOND)
        .slow_call_rate_threshold(50.0)
        .build()
        .unwrap();
    let slow = || async {
        tokio::time::sleep(3 * SECOND).await;
        Ok::<u32, DepError>(1)
    };
    b.call(slow).await.unwrap();
    call(&b, Ok(1)).await.unwrap();
    call(&b, Ok(1)).await.unwrap();
    assert_eq!(b.state(), State::Closed);
    b.call(slow).await.unwrap();
    assert_eq!(b.state(), State::Open, "2 of 4 calls were slow");
    assert_eq!(b.metrics().slow_call_rate, Some(50.0));
}

#[tokio::test(start_paused = true)]
async fn a_slow_call_rate_below_the_threshold_keeps_it_closed() {
    let b = breaker()
        .count_window(4)
        .minimum_calls(4)
        .slow_call_duration_threshold(2 * SECOND)
        .slow_call_rate_threshold(50.0)
        .build()
        .unwrap();
    let slow = || async {
        tokio::time::sleep(3 * SECOND).await;
        Ok::<u32, DepError>(1)
    };
    for _ in 0..3 {
        call(&b, Ok(1)).await.unwrap();
    }
    b.call(slow).await.unwrap();
    assert_eq!(b.state(), State::Closed, "1 of 4 calls slow: 25% < 50%");
    assert_eq!(b.metrics().slow_calls, 1, "fast calls are not slow");
    b.call(slow).await.unwrap();
    assert_eq!(b.state(), State::Open, "2 of the last 4 were slow");
}

#[tokio::test(start_paused = true)]
async fn force_open_refuses_until_reset() {
    let b = breaker().build().unwrap();
    let mut events = b.subscribe();
    b.force_open();
    advance(3600 * SECOND).await;
    assert!(matches!(
        call(&b, Ok(1)).await,
        Err(PolicyError::Rejected(Rejected::CircuitOpen { .. }))
    ));
    assert_eq!(b.state(), State::ForcedOpen);
    b.reset();
    call(&b, Ok(1)).await.unwrap();
    assert_eq!(
        transitions(&mut events),
        [
            (State::Closed, State::ForcedOpen),
            (State::ForcedOpen, State::Closed)
        ]
    );
}

#[tokio::test(start_paused = true)]
async fn disabled_lets_everything_through_and_still_records() {
    let dependency = Dependency::default();
    let b = breaker().minimum_calls(5).build().unwrap();
    b.disable();
    for _ in 0..50 {
        let _ = b.call(|| dependency.answer(Err(DepError::Down))).await;
    }
    assert_eq!(dependency.calls(), 50);
    assert_eq!(b.state(), State::Disabled);
    assert_eq!(b.metrics().failure_rate, Some(100.0), "still recorded");
    b.reset();
    assert_eq!(b.state(), State::Closed);
    assert_eq!(b.metrics().buffered_calls, 0, "reset clears the window");
}

#[tokio::test(start_paused = true)]
async fn reset_of_a_closed_breaker_forgets_its_failures() {
    let b = breaker().minimum_calls(5).build().unwrap();
    fail_times(&b, 4).await;
    b.reset();
    assert_eq!(b.metrics().buffered_calls, 0);
    fail_times(&b, 4).await;
    assert_eq!(
        b.state(),
        State::Closed,
        "4 calls since the reset are too few to open"
    );
}

#[tokio::test(start_paused = true)]
async fn reset_closes_an_open_breaker_and_forgets_its_backoff() {
    let b = breaker().minimum_calls(5).build().unwrap();
    fail_times(&b, 5).await;
    advance(30 * SECOND).await;
    fail_times(&b, 1).await;
    b.reset();
    assert_eq!(b.state(), State::Closed);
    fail_times(&b, 5).await;
    assert_eq!(retry_after(call(&b, Ok(1)).await), 30 * SECOND);
}

#[tokio::test(start_paused = true)]
async fn only_half_open_permits_are_probes() {
    let b = breaker().minimum_calls(5).build().unwrap();
    assert!(!b.try_acquire().unwrap().is_probe());
    assert!(!b.try_acquire_owned().unwrap().is_probe());
    fail_times(&b, 5).await;
    advance(30 * SECOND).await;
    assert!(b.try_acquire().unwrap().is_probe());
}

#[tokio::test(start_paused = true)]
async fn record_result_counts_a_result_by_its_class() {
    let b = breaker().minimum_calls(5).build().unwrap();
    b.try_acquire()
        .unwrap()
        .record_result(&Err::<u32, _>(DepError::Down));
    b.try_acquire_owned()
        .unwrap()
        .record_result(&Err::<u32, _>(DepError::Down));
    b.try_acquire()
        .unwrap()
        .record_result(&Ok::<u32, DepError>(1));
    b.try_acquire_owned()
        .unwrap()
        .record_result(&Err::<u32, _>(DepError::BadInput));
    let m = b.metrics();
    assert_eq!((m.buffered_calls, m.failed_calls), (4, 2));
}

#[tokio::test(start_paused = true)]
async fn each_transition_moves_the_state_gauge_and_is_counted_by_state_names() {
    let recorder = keel_testkit::metrics::MetricsRecorder::new();
    let b = metrics::with_local_recorder(&recorder, || breaker().minimum_calls(5).build().unwrap());
    let gauge = || recorder.gauge("keel_breaker_state,name=prices");
    fail_times(&b, 5).await;
    assert_eq!(gauge(), 1.0, "open");
    advance(30 * SECOND).await;
    let probe = b.try_acquire().unwrap();
    assert_eq!(gauge(), 2.0, "half-open");
    probe.record(Outcome::Success);
    assert_eq!(gauge(), 0.0, "closed");
    b.force_open();
    assert_eq!(gauge(), 3.0, "forced open");
    b.disable();
    assert_eq!(gauge(), 4.0, "disabled");
    let moved = |from: &str, to: &str| {
        recorder.counter(&format!(
            "keel_breaker_transitions_total,name=prices,from={from},to={to}"
        ))
    };
    assert_eq!(
        [
            moved("closed", "open"),
            moved("open", "half_open"),
            moved("half_open", "closed"),
            moved("closed", "forced_open"),
            moved("forced_open", "disabled"),
        ],
        [1; 5]
    );
}

#[test]
fn states_display_as_their_stable_names() {
    let names = State::ALL.map(|s| s.to_string());
    assert_eq!(
        names,
        ["closed", "open", "half_open", "forced_open", "disabled"]
    );
    for state in State::ALL {
        assert_eq!(serde_json::to_value(state).unwrap(), state.as_str());
    }
}

/// Collects the `why` of every event: the reason a transition was logged with.
#[derive(Debug, Clone, Default)]
struct Reasons(Arc<parking_lot::Mutex<Vec<String>>>);

struct WhyField<'a>(&'a mut Option<String>);

impl tracing::field::Visit for WhyField<'_> {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        if field.name() == "why" {
            *self.0 = Some(format!("{value:?}"));
        }
    }
}

impl tracing::Subscriber for Reasons {
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        true
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        let mut why = None;
        event.record(&mut WhyField(&mut why));
        self.0.lock().extend(why);
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

#[test]
fn each_transition_is_logged_with_its_reason() {
    let reasons = Reasons::default();
    let b = breaker()
        .sliding_window(SlidingWindow::Off)
        .consecutive_failures(2)
        .build()
        .unwrap();
    tracing::subscriber::with_default(reasons.clone(), || {
        for _ in 0..2 {
            b.try_acquire().unwrap().record(Outcome::Failure);
        }
        b.reset();
    });
    assert_eq!(
        *reasons.0.lock(),
        ["2 calls failed in a row", "reset by an operator"]
    );
}

#[tokio::test(start_paused = true)]
async fn a_sick_dependency_never_cuts_off_a_healthy_one() {
    let defaults = CircuitBreakerConfig {
        minimum_calls: 5,
        ..CircuitBreakerConfig::default()
    };
    let registry = BreakerRegistry::new(defaults).unwrap();
    let recommendations = registry.get("recommendations");
    fail_times(&recommendations, 5).await;
    assert_eq!(
        registry.get("recommendations").state(),
        State::Open,
        "the same breaker is handed out"
    );
    let payments = registry.get("payments");
    assert_eq!(payments.state(), State::Closed);
    call(&payments, Ok(1)).await.unwrap();
    let refunds = registry.get_endpoint("payments", "refunds");
    assert_eq!(refunds.name().as_ref(), "payments/refunds");
    fail_times(&refunds, 5).await;
    assert_eq!(refunds.state(), State::Open);
    assert_eq!(
        payments.state(),
        State::Closed,
        "an endpoint's breaker is its own"
    );

    let snapshot = registry.snapshot();
    let view: Vec<_> = snapshot
        .iter()
        .map(|s| {
            (
                s.dependency.as_str(),
                s.endpoint.as_deref(),
                s.metrics.state,
            )
        })
        .collect();
    assert_eq!(
        view,
        [
            ("payments", None, State::Closed),
            ("payments", Some("refunds"), State::Open),
            ("recommendations", None, State::Open)
        ]
    );
}

#[test]
fn registry_overrides_apply_by_dependency_then_endpoint() {
    let registry = BreakerRegistryConfig {
        defaults: CircuitBreakerConfig::default(),
        dependencies: [
            (
                "payments".to_owned(),
                CircuitBreakerConfig {
                    minimum_calls: 5,
                    ..Default::default()
                },
            ),
            (
                "payments/refunds".to_owned(),
                CircuitBreakerConfig {
                    minimum_calls: 7,
                    ..Default::default()
                },
            ),
        ]
        .into(),
    }
    .build()
    .unwrap();
    assert_eq!(registry.get("search").config().minimum_calls, 20);
    assert_eq!(registry.get("payments").config().minimum_calls, 5);
    assert_eq!(
        registry
            .get_endpoint("payments", "charge")
            .config()
            .minimum_calls,
        5
    );
    assert_eq!(
        registry
            .get_endpoint("payments", "refunds")
            .config()
            .minimum_calls,
        7
    );
}

#[test]
fn registry_rejects_an_invalid_override_naming_field_and_dependency() {
    let bad = CircuitBreakerConfig {
        failure_rate_threshold: 0.0,
        ..Default::default()
    };
    let err = BreakerRegistry::with_overrides(
        CircuitBreakerConfig::default(),
        [("payments".to_owned(), bad)],
    )
    .unwrap_err();
    assert_eq!(err.field, "failure_rate_threshold");
    assert!(err.reason.contains("payments"), "{err}");
}

mod tower_service {
    use super::*;
    use tower::{ServiceExt, service_fn};

    fn refused_io() -> std::io::Error {
        std::io::ErrorKind::ConnectionRefused.into()
    }

    #[tokio::test(start_paused = true)]
    async fn refusals_are_boxed_rejections_and_inner_errors_are_classified() {
        let b = breaker().minimum_calls(3).build().unwrap();
        let svc = b.layer();
        let failing = tower::ServiceBuilder::new()
            .layer(svc)
            .service(service_fn(|_: ()| async { Err::<u32, _>(refused_io()) }));
        for _ in 0..3 {
            let err = failing.clone().oneshot(()).await.unwrap_err();
            assert!(
                err.downcast_ref::<std::io::Error>().is_some(),
                "the inner error passes untouched"
            );
        }
        assert_eq!(
            b.state(),
            State::Open,
            "connection refused is a dependency failure"
        );
        let err = failing.clone().oneshot(()).await.unwrap_err();
        let rejected = err.downcast_ref::<Rejected>().expect("a boxed Rejected");
        assert_eq!(rejected.kind(), "circuit_open");
        assert_eq!(
            keel_core::error::classify(err.as_ref()),
            ErrorClass::Rejected
        );
    }

    #[tokio::test(start_paused = true)]
    async fn poll_ready_takes_no_probe_slot() {
        let b = breaker().minimum_calls(3).build().unwrap();
        fail_times(&b, 3).await;
        advance(30 * SECOND).await;
        let inner = service_fn(|_: ()| async { Ok::<u32, Infallible>(1) });
        let mut services: Vec<_> = (0..10).map(|_| b.layer().layer_service(inner)).collect();
        for svc in &mut services {
            svc.ready().await.unwrap();
        }
        assert_eq!(b.state(), State::Open, "readiness alone changes nothing");
        let answer = services.pop().unwrap().oneshot(()).await.unwrap();
        assert_eq!(answer, 1);
        assert_eq!(b.state(), State::Closed, "the one call made was the probe");
    }

    pub(super) trait LayerExt {
        fn layer_service<S>(&self, inner: S) -> keel_policy::breaker::CircuitBreakerService<S>;
    }

    impl LayerExt for keel_policy::breaker::CircuitBreakerLayer {
        fn layer_service<S>(&self, inner: S) -> keel_policy::breaker::CircuitBreakerService<S> {
            tower::Layer::layer(self, inner)
        }
    }

    #[tokio::test]
    async fn the_service_exposes_its_inner_service() {
        let b = breaker().build().unwrap();
        let mut svc = b.layer().layer_service(7u8);
        assert_eq!(*svc.get_ref(), 7);
        *svc.get_mut() = 8;
        assert_eq!(svc.breaker().name().as_ref(), "prices");
        assert_eq!(svc.into_inner(), 8);
        let _: Option<BoxError> = None;
    }
}

mod concurrency {
    use super::*;
    use std::sync::Barrier;

    fn tripped(probes: u32) -> CircuitBreaker {
        let b = breaker()
            .sliding_window(SlidingWindow::Off)
            .consecutive_failures(1)
            .open_duration(Duration::from_millis(1))
            .permitted_calls_in_half_open(probes)
            .build()
            .unwrap();
        b.try_acquire().unwrap().record(Outcome::Failure);
        b
    }

    /// Real threads race for probe slots the moment the open duration ends;
    /// the slots taken are never more than permitted.
    #[test]
    fn threads_hammering_half_open_never_exceed_the_permitted_probes() {
        for probes in [1, 3] {
            for _ in 0..20 {
                let b = tripped(probes);
                std::thread::sleep(Duration::from_millis(3));
                let start = Arc::new(Barrier::new(8));
                let workers: Vec<_> = (0..8)
                    .map(|_| {
                        let (b, start) = (b.clone(), Arc::clone(&start));
                        std::thread::spawn(move || {
                            start.wait();
                            (0..2_000)
                                .filter_map(|_| b.try_acquire_owned().ok())
                                .collect::<Vec<_>>()
                        })
                    })
                    .collect();
                let held: Vec<_> = workers
                    .into_iter()
                    .flat_map(|w| w.join().unwrap())
                    .collect();
                assert_eq!(held.len(), probes as usize);
                assert_eq!(b.state(), State::HalfOpen);
            }
        }
    }

    /// Churn: probes are taken and given back (cancelled) all the time; the
    /// number held at once still never exceeds the permitted number.
    #[test]
    fn released_probe_slots_are_never_over_issued() {
        let b = tripped(2);
        std::thread::sleep(Duration::from_millis(3));
        let holding = Arc::new(AtomicUsize::new(0));
        let most = Arc::new(AtomicUsize::new(0));
        let workers: Vec<_> = (0..4)
            .map(|_| {
                let (b, holding, most) = (b.clone(), Arc::clone(&holding), Arc::clone(&most));
                std::thread::spawn(move || {
                    for _ in 0..20_000 {
                        if let Ok(permit) = b.try_acquire() {
                            let now = holding.fetch_add(1, SeqCst) + 1;
                            most.fetch_max(now, SeqCst);
                            holding.fetch_sub(1, SeqCst);
                            drop(permit);
                        }
                    }
                })
            })
            .collect();
        for w in workers {
            w.join().unwrap();
        }
        assert!(
            most.load(SeqCst) <= 2,
            "held {} probes at once",
            most.load(SeqCst)
        );
        assert_eq!(
            b.metrics().probes_in_flight,
            0,
            "every cancelled probe gave its slot back"
        );
    }

    /// Many tasks on a multi-threaded runtime call through `call`: exactly
    /// the permitted probes reach the dependency, then the breaker closes.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn tasks_racing_through_call_let_only_the_probes_reach_the_dependency() {
        let b = tripped(3);
        tokio::time::sleep(Duration::from_millis(3)).await;
        let dependency = Dependency::default();
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let start = Arc::new(tokio::sync::Barrier::new(64));
        let finished = Arc::new(AtomicUsize::new(0));
        let tasks: Vec<_> = (0..64)
            .map(|_| {
                let (b, dependency, release, start, finished) = (
                    b.clone(),
                    dependency.clone(),
                    release.clone(),
                    start.clone(),
                    finished.clone(),
                );
                tokio::spawn(async move {
                    start.wait().await;
                    let answer = b
                        .call(|| async move {
                            dependency.calls.fetch_add(1, SeqCst);
                            let _ = release.acquire().await;
                            Ok::<u32, DepError>(1)
                        })
                        .await;
                    finished.fetch_add(1, SeqCst);
                    answer
                })
            })
            .collect();
        // Hold the probes until every other task has been turned away, so
        // none of them can arrive after the probes closed the breaker.
        let the_rest_refused = async {
            while dependency.calls() < 3 || finished.load(SeqCst) < 61 {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(10), the_rest_refused)
            .await
            .expect("3 probes enter and 61 calls are refused");
        release.add_permits(64);
        let mut answered = 0;
        for task in tasks {
            answered += usize::from(task.await.unwrap().is_ok());
        }
        assert_eq!(
            dependency.calls(),
            3,
            "only the probes reached the dependency"
        );
        assert_eq!(answered, 3);
        assert_eq!(b.state(), State::Closed);
    }
}

mod config {
    use super::*;

    fn rejected_field(config: CircuitBreakerConfig) -> &'static str {
        config.build("bad").unwrap_err().field
    }

    fn with(f: impl FnOnce(&mut CircuitBreakerConfig)) -> CircuitBreakerConfig {
        let mut config = CircuitBreakerConfig::default();
        f(&mut config);
        config
    }

    #[test]
    fn defaults_are_the_documented_ones() {
        let c = CircuitBreakerConfig::default();
        assert_eq!(c.failure_rate_threshold, 50.0);
        assert_eq!(c.slow_call_rate_threshold, 100.0);
        assert_eq!(c.slow_call_duration_threshold, None);
        assert_eq!(c.sliding_window, SlidingWindow::Count { size: 100 });
        assert_eq!(c.minimum_calls, 20);
        assert_eq!(c.consecutive_failures, None);
        assert_eq!(c.permitted_calls_in_half_open, 1);
        assert_eq!(c.open_duration, Duration::from_secs(30));
        assert_eq!(c.max_open_duration, Duration::from_secs(300));
        assert_eq!(c.open_duration_jitter, 0.1);
        assert!(CircuitBreaker::builder("ok").build().is_ok());
    }

    #[test]
    fn zero_window_is_rejected() {
        assert_eq!(
            rejected_field(with(|c| c.sliding_window = SlidingWindow::Count { size: 0 })),
            "sliding_window.size"
        );
        assert_eq!(
            rejected_field(with(
                |c| c.sliding_window = SlidingWindow::Time { seconds: 0 }
            )),
            "sliding_window.seconds"
        );
    }

    #[test]
    fn oversized_window_is_rejected() {
        let huge = with(|c| c.sliding_window = SlidingWindow::Count { size: u32::MAX });
        assert_eq!(rejected_field(huge), "sliding_window.size");
        let long = with(|c| c.sliding_window = SlidingWindow::Time { seconds: 86_400 });
        assert_eq!(rejected_field(long), "sliding_window.seconds");
    }

    #[test]
    fn no_window_and_no_consecutive_rule_is_rejected() {
        assert_eq!(
            rejected_field(with(|c| c.sliding_window = SlidingWindow::Off)),
            "sliding_window"
        );
    }

    #[test]
    fn failure_rate_outside_0_to_100_is_rejected() {
        for bad in [0.0, -1.0, 100.1, f64::NAN, f64::INFINITY] {
            assert_eq!(
                rejected_field(with(|c| c.failure_rate_threshold = bad)),
                "failure_rate_threshold"
            );
        }
        assert!(
            with(|c| c.failure_rate_threshold = 100.0)
                .validate()
                .is_ok()
        );
    }

    #[test]
    fn slow_call_rate_outside_0_to_100_is_rejected() {
        for bad in [0.0, 250.0, f64::NAN] {
            assert_eq!(
                rejected_field(with(|c| c.slow_call_rate_threshold = bad)),
                "slow_call_rate_threshold"
            );
        }
    }

    #[test]
    fn zero_slow_call_duration_is_rejected() {
        let zero = with(|c| c.slow_call_duration_threshold = Some(Duration::ZERO));
        assert_eq!(rejected_field(zero), "slow_call_duration_threshold");
    }

    #[test]
    fn zero_minimum_calls_is_rejected() {
        assert_eq!(
            rejected_field(with(|c| c.minimum_calls = 0)),
            "minimum_calls"
        );
    }

    #[test]
    fn minimum_calls_beyond_the_window_is_rejected() {
        let never = with(|c| c.sliding_window = SlidingWindow::Count { size: 10 });
        let err = never.build("bad").unwrap_err();
        assert_eq!(err.field, "minimum_calls");
        assert!(err.reason.contains("never open"), "{err}");
    }

    #[test]
    fn zero_consecutive_failures_is_rejected() {
        assert_eq!(
            rejected_field(with(|c| c.consecutive_failures = Some(0))),
            "consecutive_failures"
        );
    }

    #[test]
    fn zero_or_too_many_probes_are_rejected() {
        assert_eq!(
            rejected_field(with(|c| c.permitted_calls_in_half_open = 0)),
            "permitted_calls_in_half_open"
        );
        assert_eq!(
            rejected_field(with(|c| c.permitted_calls_in_half_open = 70_000)),
            "permitted_calls_in_half_open"
        );
    }

    #[test]
    fn zero_open_duration_is_rejected() {
        assert_eq!(
            rejected_field(with(|c| c.open_duration = Duration::ZERO)),
            "open_duration"
        );
    }

    #[test]
    fn max_open_duration_below_open_duration_is_rejected() {
        assert_eq!(
            rejected_field(with(|c| c.max_open_duration = Duration::from_secs(1))),
            "max_open_duration"
        );
    }

    #[test]
    fn jitter_outside_0_to_1_is_rejected() {
        for bad in [-0.1, 1.0, f64::NAN] {
            assert_eq!(
                rejected_field(with(|c| c.open_duration_jitter = bad)),
                "open_duration_jitter"
            );
        }
    }

    #[test]
    fn zero_max_wait_in_half_open_is_rejected() {
        assert_eq!(
            rejected_field(with(|c| c.max_wait_in_half_open = Some(Duration::ZERO))),
            "max_wait_in_half_open"
        );
    }

    #[test]
    fn builder_and_config_share_validation() {
        let err = CircuitBreaker::builder("bad")
            .failure_rate_threshold(f64::NAN)
            .build()
            .unwrap_err();
        assert_eq!(err.field, "failure_rate_threshold");
    }

    #[test]
    fn huge_durations_do_not_panic() {
        let b = CircuitBreaker::builder("forever")
            .consecutive_failures(1)
            .open_duration(Duration::MAX)
            .max_open_duration(Duration::MAX)
            .build()
            .unwrap();
        b.try_acquire().unwrap().record(Outcome::Failure);
        assert!(b.try_acquire().is_err());
    }

    #[test]
    fn config_round_trips_through_json() {
        let json = r#"{
            "failure_rate_threshold": 25.5,
            "slow_call_duration_threshold": "2s",
            "sliding_window": { "type": "time", "seconds": 60 },
            "minimum_calls": 10,
            "consecutive_failures": 5,
            "permitted_calls_in_half_open": 3,
            "open_duration": "10s",
            "max_open_duration": "2m",
            "open_duration_jitter": 0.0,
            "max_wait_in_half_open": "30s"
        }"#;
        let config: CircuitBreakerConfig = serde_json::from_str(json).unwrap();
        assert_eq!(config.sliding_window, SlidingWindow::Time { seconds: 60 });
        assert_eq!(config.max_open_duration, Duration::from_secs(120));
        assert_eq!(
            config.slow_call_duration_threshold,
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            config.slow_call_rate_threshold, 100.0,
            "unnamed fields keep their defaults"
        );
        let again: CircuitBreakerConfig =
            serde_json::from_str(&serde_json::to_string(&config).unwrap()).unwrap();
        assert_eq!(again, config);
        assert_eq!(again.build("from-json").unwrap().config().minimum_calls, 10);
    }

    #[test]
    fn unknown_fields_are_rejected() {
        assert!(serde_json::from_str::<CircuitBreakerConfig>(r#"{"failure_rate": 50}"#).is_err());
        let window = r#"{"sliding_window": {"type": "count", "size": 10, "seconds": 3}}"#;
        assert!(serde_json::from_str::<CircuitBreakerConfig>(window).is_err());
    }

    #[test]
    fn registry_config_reads_from_json() {
        let json = r#"{
            "defaults": { "minimum_calls": 10 },
            "dependencies": { "payments": { "open_duration": "1m" } }
        }"#;
        let registry = serde_json::from_str::<BreakerRegistryConfig>(json)
            .unwrap()
            .build()
            .unwrap();
        assert_eq!(registry.get("search").config().minimum_calls, 10);
        assert_eq!(
            registry.get("payments").config().open_duration,
            Duration::from_secs(60)
        );
    }
}

mod model {
    //! The count-based breaker against a plain reference implementation of
    //! the reference algorithm, over random call sequences.
    use super::*;
    use proptest::prelude::*;
    use std::collections::VecDeque;

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Kind {
        Ok,
        Down,
        BadInput,
        Refused,
    }

    #[derive(Debug, Clone, Copy)]
    enum Op {
        Call(Kind),
        Wait(u64),
    }

    #[derive(Debug, Clone, Copy)]
    struct Params {
        size: u32,
        minimum: u32,
        threshold: u32,
        consecutive: Option<u32>,
        probes: u32,
        base: u64,
        cap_factor: u64,
    }

    /// The reference breaker, written as plainly as possible.
    struct Model {
        p: Params,
        state: State,
        window: VecDeque<bool>,
        run: u32,
        reopened: u32,
        until: u64,
        issued: u32,
        succeeded: u32,
    }

    impl Model {
        fn new(p: Params) -> Self {
            Self {
                p,
                state: State::Closed,
                window: VecDeque::new(),
                run: 0,
                reopened: 0,
                until: 0,
                issued: 0,
                succeeded: 0,
            }
        }

        fn allow(&mut self, now: u64) -> bool {
            if self.state == State::Open {
                if now < self.until {
                    return false;
                }
                (self.state, self.issued, self.succeeded) = (State::HalfOpen, 0, 0);
            }
            if self.state == State::HalfOpen {
                if self.issued == self.p.probes {
                    return false;
                }
                self.issued += 1;
            }
            true
        }

        fn record(&mut self, kind: Kind, now: u64) {
            let failed = match kind {
                Kind::Refused => {
                    if self.state == State::HalfOpen {
                        self.issued -= 1;
                    }
                    return;
                }
                Kind::Down => true,
                Kind::Ok | Kind::BadInput => false,
            };
            if self.state == State::HalfOpen {
                if failed {
                    self.reopened += 1;
                    return self.open(now);
                }
                self.succeeded += 1;
                if self.succeeded == self.p.probes {
                    (self.state, self.reopened, self.run) = (State::Closed, 0, 0);
                    self.window.clear();
                }
                return;
            }
            self.window.push_back(failed);
            if self.window.len() > self.p.size as usize {
                self.window.pop_front();
            }
            self.run = if failed { self.run + 1 } else { 0 };
            let failures = self.window.iter().filter(|f| **f).count() as u64;
            let calls = self.window.len() as u64;
            let by_rate = calls >= u64::from(self.p.minimum)
                && failures * 100 >= u64::from(self.p.threshold) * calls;
            let by_run = self.p.consecutive.is_some_and(|limit| self.run >= limit);
            if by_rate || by_run {
                self.open(now);
            }
        }

        fn open(&mut self, now: u64) {
            let duration =
                (self.p.base << self.reopened.min(20)).min(self.p.base * self.p.cap_factor);
            (self.state, self.until) = (State::Open, now + duration);
        }
    }

    fn params() -> impl Strategy<Value = Params> {
        (
            1u32..30,
            prop_oneof![Just(25u32), Just(50), Just(75), Just(100)],
            proptest::option::of(1u32..5),
            1u32..4,
            1u64..10,
            1u64..10,
        )
            .prop_flat_map(|(size, threshold, consecutive, probes, base, cap_factor)| {
                (1..=size).prop_map(move |minimum| Params {
                    size,
                    minimum,
                    threshold,
                    consecutive,
                    probes,
                    base,
                    cap_factor,
                })
            })
    }

    fn op() -> impl Strategy<Value = Op> {
        let kind = prop_oneof![
            Just(Kind::Ok),
            Just(Kind::Down),
            Just(Kind::Down),
            Just(Kind::BadInput),
            Just(Kind::Refused)
        ];
        prop_oneof![4 => kind.prop_map(Op::Call), 1 => (0u64..40).prop_map(Op::Wait)]
    }

    fn error(kind: Kind) -> Result<u32, DepError> {
        match kind {
            Kind::Ok => Ok(1),
            Kind::Down => Err(DepError::Down),
            Kind::BadInput => Err(DepError::BadInput),
            Kind::Refused => Err(DepError::Refused),
        }
    }

    async fn run(p: Params, ops: Vec<Op>) -> Result<(), TestCaseError> {
        let b = CircuitBreaker::builder("model")
            .count_window(p.size)
            .minimum_calls(p.minimum)
            .failure_rate_threshold(f64::from(p.threshold))
            .permitted_calls_in_half_open(p.probes)
            .open_duration(Duration::from_secs(p.base))
            .max_open_duration(Duration::from_secs(p.base * p.cap_factor))
            .open_duration_jitter(0.0)
            .config_consecutive(p.consecutive)
            .build()
            .unwrap();
        let mut model = Model::new(p);
        let mut now = 0;
        for (step, op) in ops.into_iter().enumerate() {
            match op {
                Op::Wait(secs) => {
                    advance(Duration::from_secs(secs)).await;
                    now += secs;
                }
                Op::Call(kind) => {
                    let called = Arc::new(AtomicUsize::new(0));
                    let counter = called.clone();
                    let _ = b
                        .call(|| async move {
                            counter.fetch_add(1, SeqCst);
                            error(kind)
                        })
                        .await;
                    let allowed = model.allow(now);
                    if allowed {
                        model.record(kind, now);
                    }
                    prop_assert_eq!(called.load(SeqCst) == 1, allowed, "step {}: {:?}", step, op);
                }
            }
            let state = b.state();
            prop_assert_eq!(state, model.state, "step {}: {:?}", step, op);
            if state == State::Closed {
                let failures = model.window.iter().filter(|f| **f).count() as u64;
                prop_assert_eq!(b.metrics().buffered_calls, model.window.len() as u64);
                prop_assert_eq!(b.metrics().failed_calls, failures);
            }
        }
        Ok(())
    }

    trait ConsecutiveExt {
        fn config_consecutive(self, limit: Option<u32>) -> Self;
    }

    impl ConsecutiveExt for CircuitBreakerBuilder {
        fn config_consecutive(self, limit: Option<u32>) -> Self {
            match limit {
                Some(limit) => self.consecutive_failures(limit),
                None => self,
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]
        #[test]
        fn count_breaker_matches_the_reference_model(p in params(), ops in proptest::collection::vec(op(), 1..300)) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_time().start_paused(true).build().unwrap();
            rt.block_on(run(p, ops))?;
        }
    }
}

/// The rule: an error nobody classified is a failure, an error marked as the
/// caller's own fault is an answer, and failures answered as responses count
/// when the layer is told how to read them.
mod what_counts {
    use super::tower_service::LayerExt;
    use super::*;
    use keel_core::Classified;
    use tower::{Service, ServiceExt, service_fn};

    /// An error type Keel has never heard of: no `Classify`, no `Classified`.
    #[derive(Debug, thiserror::Error)]
    #[error("the dependency did something nobody foresaw")]
    struct Unforeseen;

    /// A tower service that counts its calls and fails with `error()`.
    fn failing_with<E>(
        calls: &Arc<AtomicUsize>,
        error: impl Fn() -> E + Clone,
    ) -> impl Service<(), Response = u32, Error = BoxError, Future: Send> + Clone
    where
        E: Into<BoxError>,
    {
        let calls = calls.clone();
        service_fn(move |()| {
            calls.fetch_add(1, SeqCst);
            let err: BoxError = error().into();
            async move { Err::<u32, _>(err) }
        })
    }

    #[tokio::test(start_paused = true)]
    async fn an_unclassified_error_opens_the_tower_breaker_and_stops_the_calls() {
        let b = breaker().minimum_calls(5).build().unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let mut svc = b.layer().layer_service(failing_with(&calls, || Unforeseen));
        for _ in 0..5 {
            let err = svc.ready().await.unwrap().call(()).await.unwrap_err();
            assert!(err.is::<Unforeseen>(), "the error passes untouched: {err}");
        }
        assert_eq!(b.state(), State::Open, "five failures out of five calls");
        assert_eq!(b.metrics().failed_calls, 5);
        for _ in 0..20 {
            let err = svc.ready().await.unwrap().call(()).await.unwrap_err();
            assert_eq!(
                err.downcast_ref::<Rejected>().map(Rejected::kind),
                Some("circuit_open")
            );
        }
        assert_eq!(
            calls.load(SeqCst),
            5,
            "an open breaker no longer lets calls reach the dependency"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn an_unclassified_error_opens_the_plain_breaker_and_stops_the_calls() {
        let b = breaker().minimum_calls(5).build().unwrap();
        let calls = AtomicUsize::new(0);
        for _ in 0..25 {
            let _ = b
                .call(|| async {
                    calls.fetch_add(1, SeqCst);
                    Err::<u32, BoxError>(Box::new(Unforeseen))
                })
                .await;
        }
        assert_eq!(b.state(), State::Open);
        assert_eq!(calls.load(SeqCst), 5);
    }

    #[tokio::test(start_paused = true)]
    async fn a_permanent_error_does_not_trip_the_breaker_an_unclassified_one_does() {
        let b = breaker().minimum_calls(5).build().unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let mut own_fault = b
            .layer()
            .layer_service(failing_with(&calls, || Classified::permanent(Unforeseen)));
        for _ in 0..20 {
            let err = own_fault.ready().await.unwrap().call(()).await.unwrap_err();
            assert!(err.is::<Classified>());
        }
        assert_eq!(
            b.state(),
            State::Closed,
            "the caller's own fault is an answer"
        );
        let m = b.metrics();
        assert_eq!((m.buffered_calls, m.failed_calls), (20, 0));
        assert_eq!(calls.load(SeqCst), 20);

        // The same underlying error, unmarked: now it is held against the
        // dependency (the window's 20 answers need 20 failures for 50%).
        let mut unmarked = b.layer().layer_service(failing_with(&calls, || Unforeseen));
        for _ in 0..20 {
            let _ = unmarked.ready().await.unwrap().call(()).await;
        }
        assert_eq!(b.state(), State::Open);
        let _ = unmarked.ready().await.unwrap().call(()).await;
        assert_eq!(calls.load(SeqCst), 40, "the call after opening was refused");
    }

    #[tokio::test(start_paused = true)]
    async fn a_closure_can_judge_responses() {
        let b = breaker().minimum_calls(3).build().unwrap();
        let calls = Arc::new(AtomicUsize::new(0));
        let counted = calls.clone();
        let inner = service_fn(move |()| {
            counted.fetch_add(1, SeqCst);
            async { Ok::<_, Infallible>("busy") }
        });
        let layer = b.layer().classify_response(|body: &&str| match *body {
            "busy" => Outcome::Failure,
            _ => Outcome::Success,
        });
        let mut svc = tower::Layer::layer(&layer, inner);
        for _ in 0..10 {
            let _ = svc.ready().await.unwrap().call(()).await;
        }
        assert_eq!(b.state(), State::Open);
        assert_eq!(calls.load(SeqCst), 3);
    }

    #[cfg(feature = "http")]
    mod http_responses {
        use super::*;

        /// A dependency answering every request with `status`, counting calls.
        fn answering(
            calls: &Arc<AtomicUsize>,
            status: u16,
        ) -> impl Service<(), Response = http::Response<()>, Error = Infallible> + Clone {
            let calls = calls.clone();
            service_fn(move |()| {
                calls.fetch_add(1, SeqCst);
                let response = http::Response::builder().status(status).body(()).unwrap();
                async move { Ok(response) }
            })
        }

        async fn open_on(status: u16) {
            let b = breaker().minimum_calls(5).build().unwrap();
            let calls = Arc::new(AtomicUsize::new(0));
            let mut svc = tower::Layer::layer(&b.http_layer(), answering(&calls, status));
            for _ in 0..5 {
                let response = svc.ready().await.unwrap().call(()).await.unwrap();
                assert_eq!(response.status(), status, "the response is still returned");
            }
            assert_eq!(b.state(), State::Open, "{status} is a failure");
            for _ in 0..20 {
                let err = svc.ready().await.unwrap().call(()).await.unwrap_err();
                assert!(err.is::<Rejected>(), "{err}");
            }
            assert_eq!(calls.load(SeqCst), 5, "{status}: the calls stopped");
        }

        #[tokio::test(start_paused = true)]
        async fn server_errors_open_the_breaker_and_stop_the_calls() {
            open_on(500).await;
            open_on(503).await;
        }

        #[tokio::test(start_paused = true)]
        async fn too_many_requests_opens_the_breaker_and_stops_the_calls() {
            open_on(429).await;
        }

        #[tokio::test(start_paused = true)]
        async fn client_errors_are_answers_and_never_open_it() {
            for status in [404, 422, 400, 200] {
                let b = breaker().minimum_calls(5).build().unwrap();
                let calls = Arc::new(AtomicUsize::new(0));
                let mut svc = tower::Layer::layer(&b.http_layer(), answering(&calls, status));
                for _ in 0..50 {
                    svc.ready().await.unwrap().call(()).await.unwrap();
                }
                assert_eq!(b.state(), State::Closed, "{status}");
                assert_eq!(b.metrics().failed_calls, 0, "{status}");
                assert_eq!(calls.load(SeqCst), 50, "{status}");
            }
        }
    }
}
