//! The circuit breaker against a small reference model, on sequences of
//! operations proptest generates: calls that start and hold their permit,
//! outcomes recorded in any order (a success, a failure, or ignored), calls
//! cancelled without an outcome, and the clock moving by anything from
//! nothing to a jump of minutes. Time is tokio's paused clock, so every
//! `Retry-After` is compared exactly.
//!
//! The model covers the consecutive-failures breaker with probes and open
//! durations that double after each failed probe (capped), without jitter:
//!
//! - closed: every call is let through; a failure recorded for a call let
//!   through since the last transition extends the run of failures, a
//!   success ends it; `n` in a row open the breaker for `open_for`;
//! - open: refused, saying how long is left, until `open_for` has passed;
//!   then the next call is a probe and the breaker is half-open;
//! - half-open: up to `p` probes; a probe's failure opens it again, for
//!   twice as long (at most `max_open`); `p` successes close it; a probe
//!   cancelled or ignored gives its slot back; further calls are refused;
//! - an outcome of a call let through before the last transition changes
//!   nothing.
//!
//! Failing cases are persisted by proptest next to this file and replayed
//! first on the next run.

use std::time::Duration;

use keel_core::Rejected;
use keel_policy::breaker::{CircuitBreaker, Outcome, OwnedPermit, SlidingWindow, State};
use proptest::prelude::*;

const OPEN_FOR: Duration = Duration::from_millis(1_000);
const MAX_OPEN: Duration = Duration::from_millis(4_000);

#[derive(Debug, Clone)]
enum Op {
    /// A call asks to start, and holds its permit if it gets one.
    Acquire,
    /// The held call at this index (modulo how many are held) ends so.
    Record(usize, Outcome),
    /// The held call at this index is cancelled: no outcome.
    Cancel(usize),
    /// The clock moves.
    Advance(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Acquire),
        4 => (any::<usize>(), prop_oneof![
            3 => Just(Outcome::Failure),
            2 => Just(Outcome::Success),
            1 => Just(Outcome::Ignored),
        ])
            .prop_map(|(i, o)| Op::Record(i, o)),
        1 => any::<usize>().prop_map(Op::Cancel),
        2 => prop_oneof![0..1_500_u64, Just(0_u64), 5_000..600_000_u64].prop_map(Op::Advance),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ModelState {
    Closed { run: u32 },
    Open { until: Duration },
    HalfOpen { issued: u32, succeeded: u32 },
}

/// A permit as the model sees it: the epoch (transitions so far) it was
/// given in, and whether it is a probe.
#[derive(Debug, Clone, Copy)]
struct Ticket {
    epoch: u64,
    probe: bool,
}

struct Model {
    n: u32,
    p: u32,
    now: Duration,
    state: ModelState,
    epoch: u64,
    reopened: u32,
}

impl Model {
    fn enter(&mut self, state: ModelState) {
        self.state = state;
        self.epoch += 1;
    }

    fn open(&mut self) {
        let doubled = OPEN_FOR.saturating_mul(1 << self.reopened.min(16));
        let until = self.now + doubled.min(MAX_OPEN);
        self.enter(ModelState::Open { until });
    }

    /// `Ok(probe)` if the call may start, else how long until it may.
    fn acquire(&mut self) -> Result<Ticket, Duration> {
        match self.state {
            ModelState::Closed { .. } => Ok(Ticket {
                epoch: self.epoch,
                probe: false,
            }),
            ModelState::Open { until } if self.now < until => Err(until - self.now),
            ModelState::Open { .. } => {
                self.enter(ModelState::HalfOpen {
                    issued: 1,
                    succeeded: 0,
                });
                Ok(Ticket {
                    epoch: self.epoch,
                    probe: true,
                })
            }
            ModelState::HalfOpen { issued, succeeded } if issued < self.p => {
                self.state = ModelState::HalfOpen {
                    issued: issued + 1,
                    succeeded,
                };
                Ok(Ticket {
                    epoch: self.epoch,
                    probe: true,
                })
            }
            // No time limit on half-open: refused for one open duration.
            ModelState::HalfOpen { .. } => Err(OPEN_FOR),
        }
    }

    /// A probe that ends without an outcome gives its slot back.
    fn release(&mut self, ticket: Ticket) {
        if let ModelState::HalfOpen { issued, succeeded } = self.state
            && ticket.probe
            && ticket.epoch == self.epoch
            && issued > succeeded
        {
            self.state = ModelState::HalfOpen {
                issued: issued - 1,
                succeeded,
            };
        }
    }

    fn record(&mut self, ticket: Ticket, outcome: Outcome) {
        if outcome == Outcome::Ignored {
            return self.release(ticket);
        }
        if ticket.epoch != self.epoch {
            return;
        }
        let failed = outcome == Outcome::Failure;
        match self.state {
            ModelState::Closed { run } if !ticket.probe => {
                let run = if failed { run + 1 } else { 0 };
                self.state = ModelState::Closed { run };
                if run >= self.n {
                    self.open();
                }
            }
            ModelState::HalfOpen { issued, succeeded } if ticket.probe => {
                if failed {
                    self.reopened += 1;
                    self.open();
                } else if succeeded + 1 >= self.p {
                    self.reopened = 0;
                    self.enter(ModelState::Closed { run: 0 });
                } else {
                    self.state = ModelState::HalfOpen {
                        issued,
                        succeeded: succeeded + 1,
                    };
                }
            }
            _ => {}
        }
    }

    fn public_state(&self) -> State {
        match self.state {
            ModelState::Closed { .. } => State::Closed,
            ModelState::Open { .. } => State::Open,
            ModelState::HalfOpen { .. } => State::HalfOpen,
        }
    }
}

fn breaker(n: u32, p: u32) -> CircuitBreaker {
    CircuitBreaker::builder("model")
        .sliding_window(SlidingWindow::Off)
        .consecutive_failures(n)
        .permitted_calls_in_half_open(p)
        .open_duration(OPEN_FOR)
        .max_open_duration(MAX_OPEN)
        .open_duration_jitter(0.0)
        .build()
        .expect("a valid breaker")
}

async fn run(n: u32, p: u32, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let real = breaker(n, p);
    let mut model = Model {
        n,
        p,
        now: Duration::ZERO,
        state: ModelState::Closed { run: 0 },
        epoch: 0,
        reopened: 0,
    };
    let mut held: Vec<(OwnedPermit, Ticket)> = Vec::new();
    for (step, op) in ops.into_iter().enumerate() {
        match op {
            Op::Acquire => match (real.try_acquire_owned(), model.acquire()) {
                (Ok(permit), Ok(ticket)) => {
                    prop_assert_eq!(permit.is_probe(), ticket.probe, "step {}: probe", step);
                    held.push((permit, ticket));
                }
                (Err(open @ Rejected::CircuitOpen { .. }), Err(left)) => {
                    prop_assert_eq!(open.retry_after(), Some(left), "step {}: retry after", step);
                }
                (real, model) => prop_assert!(
                    false,
                    "step {}: breaker said {:?}, model said {:?}",
                    step,
                    real.map(|p| p.is_probe()),
                    model
                ),
            },
            Op::Record(i, outcome) if !held.is_empty() => {
                let (permit, ticket) = held.remove(i % held.len());
                permit.record(outcome);
                model.record(ticket, outcome);
            }
            Op::Cancel(i) if !held.is_empty() => {
                let (permit, ticket) = held.remove(i % held.len());
                drop(permit);
                model.release(ticket);
            }
            Op::Record(..) | Op::Cancel(_) => {}
            Op::Advance(ms) => {
                let by = Duration::from_millis(ms);
                tokio::time::advance(by).await;
                model.now += by;
            }
        }
        // An open breaker whose time is up still reads open until a call
        // comes to probe, in both.
        prop_assert_eq!(real.state(), model.public_state(), "step {}: state", step);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn the_breaker_does_what_its_model_does(
        n in 1_u32..4,
        p in 1_u32..4,
        ops in proptest::collection::vec(op(), 1..80),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("a runtime");
        runtime.block_on(run(n, p, ops))?;
    }
}
