//! The retry budget against a reference model, on sequences of requests,
//! retries and clock moves that proptest generates.
//!
//! The model is the budget's contract in whole millionths of a retry:
//! each request earns `ratio` (up to `max_tokens`); a retry spends one
//! earned token if there is one, else one from a reserve that refills at
//! `min_per_sec` and holds at most one second's worth (at least one); a
//! retry with neither is refused. With ratios and rates that are whole
//! millionths and a clock that moves in milliseconds, the arithmetic is
//! exact, so every decision is compared, not a bound.
//!
//! Besides the decisions, the test checks what protects the dependency:
//! the retries granted never exceed what the requests earned, plus the
//! reserve it started with, plus the reserve's rate over the time elapsed.

use std::time::Duration;

use keel_policy::retry::RetryBudget;
use proptest::prelude::*;

const ONE: u64 = 1_000_000;

#[derive(Debug, Clone)]
enum Op {
    Requests(u32),
    Retry,
    /// What `available` reports (it refills the reserve, as a retry would).
    Available,
    Advance(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1_u32..30).prop_map(Op::Requests),
        4 => Just(Op::Retry),
        1 => Just(Op::Available),
        2 => prop_oneof![0..400_u64, 1_000..5_000_u64, Just(3_600_000_u64)].prop_map(Op::Advance),
    ]
}

struct Model {
    per_request: u64,
    max_tokens: u64,
    per_sec: u64,
    reserve_cap: u64,
    tokens: u64,
    reserve: u64,
    refilled_at_ms: u64,
    now_ms: u64,
}

impl Model {
    fn new(ratio_millionths: u64, per_sec_millionths: u64, max_tokens: u64) -> Self {
        let reserve_cap = if per_sec_millionths > 0 {
            per_sec_millionths.max(ONE)
        } else {
            0
        };
        Self {
            per_request: ratio_millionths,
            max_tokens: max_tokens * ONE,
            per_sec: per_sec_millionths,
            reserve_cap,
            tokens: 0,
            reserve: reserve_cap,
            refilled_at_ms: 0,
            now_ms: 0,
        }
    }

    fn request(&mut self) {
        self.tokens = (self.tokens + self.per_request).min(self.max_tokens);
    }

    fn refill(&mut self) {
        let earned =
            ((self.now_ms - self.refilled_at_ms) * self.per_sec / 1_000).min(self.reserve_cap);
        if earned > 0 {
            self.refilled_at_ms = self.now_ms;
            self.reserve = (self.reserve + earned).min(self.reserve_cap);
        }
    }

    fn available(&mut self) -> f64 {
        self.refill();
        (self.tokens + self.reserve) as f64 / ONE as f64
    }

    fn retry(&mut self) -> bool {
        if self.tokens >= ONE {
            self.tokens -= ONE;
            return true;
        }
        self.refill();
        if self.reserve >= ONE {
            self.reserve -= ONE;
            return true;
        }
        false
    }
}

async fn run(ratio: u64, per_sec: u64, max_tokens: u64, ops: Vec<Op>) -> Result<(), TestCaseError> {
    let budget = RetryBudget::builder("model")
        .ratio(ratio as f64 / ONE as f64)
        .min_per_sec(per_sec as f64 / ONE as f64)
        .max_tokens(max_tokens as f64)
        .build()
        .expect("a valid budget");
    let mut model = Model::new(ratio, per_sec, max_tokens);
    let (mut requests, mut granted) = (0_u64, 0_u64);
    for (step, op) in ops.into_iter().enumerate() {
        match op {
            Op::Requests(n) => {
                for _ in 0..n {
                    budget.deposit();
                    model.request();
                }
                requests += u64::from(n);
            }
            Op::Retry => {
                let real = budget.try_withdraw();
                prop_assert_eq!(real, model.retry(), "step {}: retry granted", step);
                granted += u64::from(real);
            }
            Op::Available => {
                let (real, expected) = (budget.available(), model.available());
                prop_assert!(
                    (real - expected).abs() < 1e-9,
                    "step {}: {} available, the model says {}",
                    step,
                    real,
                    expected
                );
            }
            Op::Advance(ms) => {
                tokio::time::advance(Duration::from_millis(ms)).await;
                model.now_ms += ms;
            }
        }
        // Never more retries than the requests earned, the reserve held at
        // the start, and the reserve's rate since.
        let allowance = requests * ratio + model.reserve_cap + model.now_ms * per_sec / 1_000;
        prop_assert!(
            granted * ONE <= allowance,
            "step {}: {} retries granted, {} millionths allowed",
            step,
            granted,
            allowance
        );
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn the_budget_grants_exactly_what_its_model_grants(
        ratio in prop_oneof![Just(100_000_u64), Just(200_000), Just(250_000), Just(500_000), Just(ONE)],
        per_sec in prop_oneof![Just(0_u64), Just(500_000), Just(ONE), Just(2 * ONE), Just(10 * ONE)],
        max_tokens in 1_u64..20,
        ops in proptest::collection::vec(op(), 1..100),
    ) {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()
            .expect("a runtime");
        runtime.block_on(run(ratio, per_sec, max_tokens, ops))?;
    }
}
