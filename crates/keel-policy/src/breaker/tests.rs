//! Unit tests of the breaker's internals: the packed state word and the windows.

use std::sync::Arc;
use std::time::Duration;

use keel_core::ErrorClass;

use super::state::Word;
use super::window::{FastRem, Sample, Tally, Window};
use super::{CircuitBreaker, Outcome, SlidingWindow, State};

const OK: Sample = Sample {
    failed: false,
    slow: false,
};
const FAILED: Sample = Sample {
    failed: true,
    slow: false,
};
const SLOW: Sample = Sample {
    failed: false,
    slow: true,
};

#[test]
fn word_packs_state_generation_and_probe_counts() {
    let word = Word::new(State::HalfOpen, 0x00AB_CDEF)
        .with_issued(65_535)
        .with_succeeded(7);
    assert_eq!(word.state(), State::HalfOpen);
    assert_eq!(word.generation(), 0x00AB_CDEF);
    assert_eq!((word.issued(), word.succeeded()), (65_535, 7));
    assert_eq!(word.with_issued(3).succeeded(), 7);
    assert!(word.same_epoch(Word::new(State::HalfOpen, 0x00AB_CDEF)));
    assert!(!word.same_epoch(Word::new(State::Open, 0x00AB_CDEF)));
    let last = Word::new(State::Closed, 0x00FF_FFFF);
    assert_eq!(
        last.next_generation(),
        0,
        "the generation wraps within its 24 bits"
    );
    for state in State::ALL {
        assert_eq!(Word::new(state, 1).state(), state);
    }
}

#[test]
fn fast_remainder_equals_the_hardware_one() {
    let mut rng = fastrand::Rng::with_seed(1);
    for divisor in [1, 2, 3, 7, 100, 1_000_000, u32::MAX - 1, u32::MAX] {
        let rem = FastRem::new(divisor);
        for n in [0, 1, divisor - 1, divisor, u32::MAX - 1, u32::MAX] {
            assert_eq!(rem.of(n), n % divisor, "{n} % {divisor}");
        }
        for _ in 0..10_000 {
            let n = rng.u32(..);
            assert_eq!(rem.of(n), n % divisor, "{n} % {divisor}");
        }
    }
}

#[test]
fn count_window_holds_only_the_last_n_calls() {
    let window = Window::new(SlidingWindow::Count { size: 4 });
    for sample in [FAILED, FAILED, SLOW, OK] {
        window.record(sample, 0);
    }
    assert_eq!(
        window.tally(0),
        Tally {
            calls: 4,
            failures: 2,
            slow: 1
        }
    );
    window.record(OK, 0);
    window.record(OK, 0);
    assert_eq!(
        window.tally(0),
        Tally {
            calls: 4,
            failures: 0,
            slow: 1
        }
    );
    window.clear();
    assert_eq!(window.tally(0), Tally::default());
}

#[test]
fn count_window_asks_for_evaluation_only_when_rates_may_rise() {
    let window = Window::new(SlidingWindow::Count { size: 2 });
    assert!(
        window.record(OK, 0).is_some(),
        "filling an empty slot adds a call"
    );
    assert!(window.record(OK, 0).is_some());
    assert!(
        window.record(OK, 0).is_none(),
        "a success replacing a success changes nothing"
    );
    assert!(window.record(FAILED, 0).is_some());
    assert!(
        window.record(OK, 0).is_none(),
        "a success replacing anything only lowers rates"
    );
}

#[test]
fn a_window_of_successes_skips_turning_but_keeps_the_last_n() {
    let window = Window::new(SlidingWindow::Count { size: 3 });
    for _ in 0..13 {
        window.record(OK, 0);
    }
    window.record(FAILED, 0);
    window.record(OK, 0);
    window.record(OK, 0);
    assert_eq!(
        window.tally(0),
        Tally {
            calls: 3,
            failures: 1,
            slow: 0
        }
    );
    window.record(OK, 0);
    assert_eq!(
        window.tally(0),
        Tally {
            calls: 3,
            failures: 0,
            slow: 0
        }
    );
}

#[test]
fn count_window_counters_never_drift_under_concurrent_records_and_clears() {
    let window = Arc::new(Window::new(SlidingWindow::Count { size: 16 }));
    let writers: Vec<_> = (0..4)
        .map(|seed| {
            let window = Arc::clone(&window);
            std::thread::spawn(move || {
                let mut rng = fastrand::Rng::with_seed(seed);
                for _ in 0..20_000 {
                    window.record(
                        Sample {
                            failed: rng.bool(),
                            slow: rng.bool(),
                        },
                        0,
                    );
                }
            })
        })
        .collect();
    for _ in 0..200 {
        window.clear();
    }
    for writer in writers {
        writer.join().unwrap();
    }
    for _ in 0..16 {
        window.record(OK, 0);
    }
    assert_eq!(
        window.tally(0),
        Tally {
            calls: 16,
            failures: 0,
            slow: 0
        }
    );
}

#[test]
fn time_window_forgets_seconds_that_fall_out_of_it() {
    let window = Window::new(SlidingWindow::Time { seconds: 3 });
    window.record(FAILED, 0);
    window.record(FAILED, 1);
    window.record(OK, 2);
    assert_eq!(
        window.tally(2),
        Tally {
            calls: 3,
            failures: 2,
            slow: 0
        }
    );
    assert_eq!(
        window.tally(3),
        Tally {
            calls: 2,
            failures: 1,
            slow: 0
        }
    );
    assert_eq!(window.tally(100), Tally::default());
    window.record(SLOW, 100);
    assert_eq!(
        window.tally(100),
        Tally {
            calls: 1,
            failures: 0,
            slow: 1
        }
    );
}

#[test]
fn time_window_counts_a_late_clock_read_into_the_newest_second() {
    let window = Window::new(SlidingWindow::Time { seconds: 2 });
    window.record(OK, 10);
    window.record(FAILED, 9);
    assert_eq!(
        window.tally(10),
        Tally {
            calls: 2,
            failures: 1,
            slow: 0
        }
    );
    assert_eq!(window.tally(12), Tally::default());
}

#[test]
fn outcomes_follow_the_error_class() {
    assert_eq!(Outcome::from_class(ErrorClass::Retryable), Outcome::Failure);
    assert_eq!(
        Outcome::from_class(ErrorClass::OutcomeUnknown),
        Outcome::Failure
    );
    assert_eq!(Outcome::from_class(ErrorClass::Permanent), Outcome::Success);
    assert_eq!(
        Outcome::from_class(ErrorClass::Unclassified),
        Outcome::Failure
    );
    assert_eq!(Outcome::from_class(ErrorClass::Rejected), Outcome::Ignored);
    assert_eq!(Outcome::of(&Ok::<(), std::io::Error>(())), Outcome::Success);
}

#[tokio::test(start_paused = true)]
async fn jitter_spreads_open_durations_within_bounds() {
    let mut seen = Vec::new();
    for seed in 0..40 {
        let breaker = CircuitBreaker::builder("jitter")
            .consecutive_failures(1)
            .open_duration(Duration::from_secs(30))
            .open_duration_jitter(0.1)
            .seed(seed)
            .build()
            .unwrap();
        breaker.try_acquire().unwrap().record(Outcome::Failure);
        let open_for = breaker.metrics().retry_after.unwrap();
        assert!(
            (Duration::from_secs(27)..=Duration::from_secs(33)).contains(&open_for),
            "{open_for:?}"
        );
        seen.push(open_for);
    }
    seen.sort();
    seen.dedup();
    assert!(seen.len() > 30, "jitter must actually spread the durations");
}

#[tokio::test(start_paused = true)]
async fn unseeded_jitter_spreads_open_durations_within_bounds() {
    let open_for: Vec<_> = (0..40)
        .map(|_| {
            let breaker = CircuitBreaker::builder("unseeded")
                .consecutive_failures(1)
                .open_duration(Duration::from_secs(30))
                .open_duration_jitter(0.1)
                .build()
                .unwrap();
            breaker.try_acquire().unwrap().record(Outcome::Failure);
            breaker.metrics().retry_after.unwrap()
        })
        .collect();
    let bounds = Duration::from_secs(27)..=Duration::from_secs(33);
    assert!(open_for.iter().all(|d| bounds.contains(d)), "{open_for:?}");
    let thirty = Duration::from_secs(30);
    assert!(
        open_for.iter().any(|d| *d < thirty) && open_for.iter().any(|d| *d > thirty),
        "spread both ways: {open_for:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn the_same_seed_gives_the_same_open_duration() {
    let open_for = |seed| {
        let breaker = CircuitBreaker::builder("seeded")
            .consecutive_failures(1)
            .seed(seed)
            .build()
            .unwrap();
        breaker.try_acquire().unwrap().record(Outcome::Failure);
        breaker.metrics().retry_after
    };
    assert_eq!(open_for(7), open_for(7));
}
