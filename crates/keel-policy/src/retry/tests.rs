use std::time::Duration;

use keel_core::clock;
use proptest::prelude::*;

use super::*;
use crate::ConfigError;
use std::fmt;

const MS: Duration = Duration::from_millis(1);

fn exp(base: Duration, factor: f64, max: Duration, jitter: Jitter) -> Result<Backoff, ConfigError> {
    Backoff::exponential(base, factor, max)?.with_jitter(jitter)
}

fn refused_field<T: fmt::Debug>(result: Result<T, ConfigError>) -> &'static str {
    result.expect_err("the value must be refused").field
}

#[test]
fn backoff_refuses_a_zero_base() {
    assert_eq!(
        refused_field(exp(Duration::ZERO, 2.0, MS, Jitter::None)),
        "base"
    );
}

#[test]
fn backoff_refuses_a_factor_below_one_or_not_finite() {
    for factor in [0.5, -2.0, f64::NAN, f64::INFINITY] {
        assert_eq!(
            refused_field(exp(MS, factor, MS * 10, Jitter::None)),
            "factor"
        );
    }
}

#[test]
fn backoff_refuses_a_max_below_base() {
    assert_eq!(
        refused_field(exp(MS * 10, 2.0, MS, Jitter::None)),
        "max_delay"
    );
}

#[test]
fn backoff_refuses_nan_negative_or_excessive_jitter() {
    for p in [f64::NAN, -0.1, 1.5, f64::INFINITY] {
        assert_eq!(
            refused_field(exp(MS, 2.0, MS * 10, Jitter::Proportional(p))),
            "jitter"
        );
    }
}

#[test]
fn backoff_refuses_an_empty_schedule() {
    assert_eq!(refused_field(Backoff::schedule([])), "delays");
}

#[test]
fn backoff_refuses_decorrelated_jitter_on_a_schedule() {
    let schedule = Backoff::schedule([MS]).unwrap();
    assert_eq!(
        refused_field(schedule.with_jitter(Jitter::Decorrelated)),
        "jitter"
    );
}

#[test]
fn default_backoff_is_seed_000() {
    let backoff = Backoff::default();
    assert_eq!(backoff.jitter(), Jitter::Full);
    assert_eq!(backoff.nominal_delay(0), Some(MS * 200));
    assert_eq!(backoff.nominal_delay(1), Some(MS * 400));
    assert_eq!(backoff.nominal_delay(10), Some(Duration::from_secs(10)));
    assert_eq!(
        backoff.nominal_delay(u32::MAX),
        Some(Duration::from_secs(10))
    );
}

#[test]
fn schedule_ends_and_stateless_delay_agrees_with_the_iterator() {
    let delays = [5, 300, 1800, 7200, 18_000, 36_000, 36_000].map(Duration::from_secs);
    let webhook = Backoff::schedule(delays).unwrap();
    assert_eq!(webhook.iter().collect::<Vec<_>>(), delays);
    assert_eq!(webhook.delay(6), Some(Duration::from_secs(36_000)));
    assert_eq!(webhook.delay(7), None);
    assert_eq!(webhook.max_retries(), Some(7));
}

#[test]
fn seeded_sequences_repeat() {
    let backoff = Backoff::default();
    let a: Vec<_> = backoff.iter_seeded(7).take(8).collect();
    let b: Vec<_> = backoff.iter_seeded(7).take(8).collect();
    let c: Vec<_> = backoff.iter_seeded(8).take(8).collect();
    assert_eq!(a, b);
    assert_ne!(a, c);
}

#[test]
fn backoff_config_round_trips_and_refuses_unknown_fields() {
    let config = Backoff::schedule([MS, MS * 300_000]).unwrap().to_config();
    let json = serde_json::to_string(&config).unwrap();
    assert_eq!(
        json,
        r#"{"kind":"schedule","delays":["1ms","5m"],"jitter":"none"}"#
    );
    assert_eq!(
        serde_json::from_str::<BackoffConfig>(&json).unwrap(),
        config
    );
    let typo = r#"{"kind":"exponential","bace":"1s"}"#;
    assert!(serde_json::from_str::<BackoffConfig>(typo).is_err());
    let defaults: BackoffConfig = serde_json::from_str(r#"{"kind":"exponential"}"#).unwrap();
    assert_eq!(defaults.build().unwrap(), Backoff::default());
}

fn jitter_strategy() -> impl Strategy<Value = Jitter> {
    prop_oneof![
        Just(Jitter::None),
        (0.0..=1.0f64).prop_map(Jitter::Proportional),
        Just(Jitter::Full),
        Just(Jitter::Equal),
        Just(Jitter::Decorrelated),
    ]
}

proptest! {
    #[test]
    fn every_delay_is_within_its_bounds(
        base_us in 1u64..10_000_000,
        factor in 1.0..10.0f64,
        cap_multiple in 1u64..1_000,
        jitter in jitter_strategy(),
        seed: u64,
    ) {
        let base = Duration::from_micros(base_us);
        let max = base * u32::try_from(cap_multiple).unwrap();
        let backoff = exp(base, factor, max, jitter).unwrap();
        let mut prev: Option<Duration> = None;
        for (n, delay) in backoff.iter_seeded(seed).take(40).enumerate() {
            let nominal = backoff.nominal_delay(u32::try_from(n).unwrap()).unwrap();
            prop_assert!(delay <= max, "{delay:?} > max {max:?}");
            prop_assert!(nominal <= max);
            match jitter {
                Jitter::None => prop_assert_eq!(delay, nominal),
                Jitter::Proportional(p) => {
                    let low = nominal.as_secs_f64() * (1.0 - p);
                    let high = nominal.as_secs_f64() * (1.0 + p);
                    prop_assert!(delay.as_secs_f64() >= low - 1e-9, "{delay:?} below {low}");
                    prop_assert!(delay.as_secs_f64() <= high + 1e-9, "{delay:?} above {high}");
                }
                Jitter::Full => prop_assert!(delay <= nominal),
                Jitter::Equal => {
                    prop_assert!(delay <= nominal);
                    prop_assert!(delay >= nominal / 2, "{delay:?} below half of {nominal:?}");
                }
                Jitter::Decorrelated => {
                    prop_assert!(delay >= base);
                    let high = prev.map_or(base * 3, |p| (p * 3).max(base));
                    prop_assert!(delay <= high + Duration::from_nanos(1), "{delay:?} above {high:?}");
                }
            }
            prev = Some(delay);
        }
    }

    #[test]
    fn stateless_delays_stay_within_bounds(
        base_ms in 1u64..1_000,
        jitter in jitter_strategy(),
        attempt in 0u32..200,
    ) {
        let backoff = exp(MS * u32::try_from(base_ms).unwrap(), 2.0, Duration::from_secs(60), jitter).unwrap();
        let delay = backoff.delay(attempt).unwrap();
        prop_assert!(delay <= Duration::from_secs(60));
    }

    #[test]
    fn unjittered_sequence_grows_monotonically_to_the_cap(
        base_us in 1u64..1_000_000,
        factor in 1.0..5.0f64,
        cap_multiple in 1u32..10_000,
    ) {
        let base = Duration::from_micros(base_us);
        let max = base * cap_multiple;
        let backoff = exp(base, factor, max, Jitter::None).unwrap();
        let delays: Vec<_> = backoff.iter().take(64).collect();
        prop_assert_eq!(delays[0], base);
        prop_assert!(delays.windows(2).all(|w| w[0] <= w[1]), "{delays:?}");
        prop_assert!(delays.iter().all(|d| *d <= max));
    }

    #[test]
    fn schedule_delays_stay_within_their_bounds(
        delays_ms in prop::collection::vec(0u64..100_000, 1..10),
        jitter in prop_oneof![Just(Jitter::None), (0.0..=1.0f64).prop_map(Jitter::Proportional), Just(Jitter::Full)],
        seed: u64,
    ) {
        let delays: Vec<_> = delays_ms.iter().map(|ms| Duration::from_millis(*ms)).collect();
        let max = delays.iter().copied().max().unwrap();
        let backoff = Backoff::schedule(delays.clone()).unwrap().with_jitter(jitter).unwrap();
        let produced: Vec<_> = backoff.iter_seeded(seed).collect();
        prop_assert_eq!(produced.len(), delays.len());
        for (delay, nominal) in produced.iter().zip(&delays) {
            prop_assert!(*delay <= max);
            if jitter == Jitter::None {
                prop_assert_eq!(delay, nominal);
            }
            if jitter == Jitter::Full {
                prop_assert!(delay <= nominal);
            }
        }
    }
}

#[test]
fn budget_refuses_a_ratio_outside_zero_to_one() {
    for ratio in [0.0, -0.1, 1.01, f64::NAN] {
        assert_eq!(
            refused_field(RetryBudget::builder("b").ratio(ratio).build()),
            "ratio"
        );
    }
    assert!(RetryBudget::builder("b").ratio(1.0).build().is_ok());
}

#[test]
fn budget_refuses_a_negative_or_nan_min_per_sec() {
    for min in [-1.0, f64::NAN, f64::INFINITY] {
        assert_eq!(
            refused_field(RetryBudget::builder("b").min_per_sec(min).build()),
            "min_per_sec"
        );
    }
}

#[test]
fn budget_refuses_fewer_than_one_token() {
    for cap in [0.5, 0.0, f64::NAN] {
        assert_eq!(
            refused_field(RetryBudget::builder("b").max_tokens(cap).build()),
            "max_tokens"
        );
    }
}

#[test]
fn budget_earns_ratio_per_request_up_to_the_cap() {
    let budget = RetryBudget::builder("b")
        .min_per_sec(0.0)
        .max_tokens(2.0)
        .build()
        .unwrap();
    assert!(!budget.try_withdraw(), "a new budget has earned nothing");
    for _ in 0..1000 {
        budget.deposit();
    }
    assert_eq!(budget.earned_tokens(), 2.0);
    assert!(budget.try_withdraw());
    assert!(budget.try_withdraw());
    assert_eq!(
        budget.withdraw(),
        Err(Rejected::BudgetExhausted { name: "b".into() })
    );
}

#[test]
fn budget_reserve_refills_with_time() {
    let start = clock::now();
    let budget = RetryBudget::builder("b").min_per_sec(2.0).build().unwrap();
    assert!(budget.try_withdraw_at(start));
    assert!(budget.try_withdraw_at(start));
    assert!(
        !budget.try_withdraw_at(start),
        "the reserve holds one second's worth"
    );
    assert!(!budget.try_withdraw_at(start + MS * 400));
    assert!(
        budget.try_withdraw_at(start + MS * 600),
        "1.2 retries earned since the start"
    );
    assert!(budget.reserve_tokens() < 1.0);
    assert!(budget.try_withdraw_at(start + Duration::from_secs(60)));
    assert!(budget.try_withdraw_at(start + Duration::from_secs(60)));
    assert!(!budget.try_withdraw_at(start + Duration::from_secs(60)));
}

#[derive(Debug, Clone)]
enum Op {
    Request,
    Retry,
    Wait(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![3 => Just(Op::Request), 3 => Just(Op::Retry), 1 => (0u64..2_000).prop_map(Op::Wait)]
}

proptest! {
    #[test]
    fn budget_never_grants_more_than_earned(
        ratio in 0.001..=1.0f64,
        min_per_sec in prop_oneof![Just(0.0), 0.1..50.0f64],
        max_tokens in 1.0..200.0f64,
        ops in prop::collection::vec(op(), 1..500),
    ) {
        let start = clock::now();
        let budget = RetryBudget::builder("b")
            .ratio(ratio).min_per_sec(min_per_sec).max_tokens(max_tokens).build().unwrap();
        let (mut requests, mut granted, mut elapsed) = (0u32, 0u32, Duration::ZERO);
        for op in ops {
            match op {
                Op::Request => { budget.deposit(); requests += 1; }
                Op::Retry => granted += u32::from(budget.try_withdraw_at(start + elapsed)),
                Op::Wait(ms) => elapsed += Duration::from_millis(ms),
            }
            prop_assert!(budget.earned_tokens() >= 0.0);
            prop_assert!(budget.earned_tokens() <= max_tokens);
            prop_assert!(budget.reserve_tokens() <= min_per_sec.max(1.0));
            let initial = if min_per_sec > 0.0 { min_per_sec.max(1.0) } else { 0.0 };
            let bound = ratio * f64::from(requests) + min_per_sec * elapsed.as_secs_f64() + initial;
            prop_assert!(f64::from(granted) <= bound + 1e-9, "{granted} retries > bound {bound}");
        }
    }
}

#[test]
fn retry_refuses_zero_attempts() {
    assert_eq!(
        refused_field(Retry::builder("r").max_attempts(0).build()),
        "max_attempts"
    );
}

#[test]
fn retry_refuses_a_zero_retry_after_max() {
    assert_eq!(
        refused_field(Retry::builder("r").retry_after_max(Duration::ZERO).build()),
        "retry_after_max"
    );
}

#[test]
fn retry_config_refuses_an_invalid_nested_value() {
    let config = RetryConfig {
        budget: Some(RetryBudgetConfig {
            ratio: 2.0,
            ..Default::default()
        }),
        ..Default::default()
    };
    assert_eq!(refused_field(config.build("r")), "ratio");
}

#[test]
fn retry_config_defaults_and_round_trip() {
    let config: RetryConfig = serde_json::from_str("{}").unwrap();
    assert_eq!(config, RetryConfig::default());
    assert_eq!(config.max_attempts.get(), 3);
    assert_eq!(config.retry_after_max, Duration::from_secs(30));
    assert!(!config.retry_outcome_unknown);
    let json = serde_json::to_string(&config).unwrap();
    assert_eq!(serde_json::from_str::<RetryConfig>(&json).unwrap(), config);
    assert!(serde_json::from_str::<RetryConfig>(r#"{"max_attempts": 0}"#).is_err());
    assert!(serde_json::from_str::<RetryConfig>(r#"{"max_atempts": 2}"#).is_err());
    let no_budget: RetryConfig = serde_json::from_str(r#"{"budget": null}"#).unwrap();
    assert!(no_budget.build("r").unwrap().budget().is_none());
    let retry = config.build("r").unwrap();
    assert_eq!(retry.backoff(), &Backoff::default());
    assert_eq!(
        retry.budget().unwrap().config(),
        &RetryBudgetConfig::default()
    );
    let tuned: RetryConfig =
        serde_json::from_str(r#"{"budget": {"ratio": 0.5, "min_per_sec": 2.0}}"#).unwrap();
    let budget = tuned
        .clone()
        .build("r")
        .unwrap()
        .budget()
        .unwrap()
        .config()
        .clone();
    assert_eq!(
        Some(budget),
        tuned.budget,
        "the budget keeps its configuration"
    );
}

#[test]
fn futures_are_send_for_multi_threaded_servers() {
    fn assert_send<T: Send>(_: &T) {}
    let retry = Retry::builder("r").on_retry(|_| {}).build().unwrap();
    assert_send(&retry.call(|| async { Ok::<u32, std::io::Error>(1) }));
    let service = tower::service_fn(|x: u32| async move { Ok::<u32, std::io::Error>(x) });
    let mut retried = tower_layer::Layer::layer(&retry.layer(), service);
    assert_send(&tower_service::Service::call(&mut retried, 1));
}

#[test]
fn a_budget_debugs_in_whole_retries() {
    let budget = RetryBudget::builder("b")
        .ratio(0.5)
        .min_per_sec(2.0)
        .build()
        .unwrap();
    for _ in 0..3 {
        budget.deposit();
    }
    let text = format!("{budget:?}");
    assert!(
        text.starts_with("RetryBudget")
            && text.contains("tokens: 1.5")
            && text.contains("reserve: 2.0"),
        "{text}"
    );
}

#[test]
fn a_backoff_reports_the_jitter_it_was_given() {
    for jitter in [
        Jitter::None,
        Jitter::Proportional(0.25),
        Jitter::Decorrelated,
    ] {
        assert_eq!(exp(MS, 2.0, MS * 10, jitter).unwrap().jitter(), jitter);
    }
}

#[test]
fn a_schedule_read_without_jitter_follows_its_delays_exactly() {
    let config: BackoffConfig =
        serde_json::from_str(r#"{"kind":"schedule","delays":["1s","5s"]}"#).unwrap();
    let backoff = config.build().unwrap();
    assert_eq!(backoff.jitter(), Jitter::None);
    assert_eq!(
        backoff.iter().collect::<Vec<_>>(),
        [Duration::from_secs(1), Duration::from_secs(5)]
    );
}

/// The first two delays of `backoff` under each of 500 seeds.
fn first_two_delays(backoff: &Backoff) -> Vec<(f64, f64)> {
    (0..500)
        .map(|seed| {
            let mut delays = backoff.iter_seeded(seed).map(|d| d.as_secs_f64());
            (delays.next().unwrap(), delays.next().unwrap())
        })
        .collect()
}

fn spread(values: impl Iterator<Item = f64>) -> (f64, f64) {
    values.fold((f64::MAX, f64::MIN), |(lo, hi), v| (lo.min(v), hi.max(v)))
}

/// Bounds alone pass a jitter that does nothing: the delays must also reach
/// both ends of their range, or a herd of clients still retries in step.
#[test]
fn proportional_and_full_jitter_reach_both_ends_of_their_range() {
    let base = MS * 100;
    let proportional = exp(base, 2.0, MS * 10_000, Jitter::Proportional(0.5)).unwrap();
    let (lo, hi) = spread(first_two_delays(&proportional).into_iter().map(|d| d.0));
    assert!(
        lo < 0.055 && hi > 0.145,
        "±50% of 100 ms spread over {lo}..{hi}"
    );
    let full = exp(base, 2.0, MS * 10_000, Jitter::Full).unwrap();
    let (lo, hi) = spread(first_two_delays(&full).into_iter().map(|d| d.0));
    assert!(lo < 0.01 && hi > 0.09, "0..100 ms spread over {lo}..{hi}");
}

/// Decorrelated jitter draws each delay from `[base, 3 × previous]`.
#[test]
fn decorrelated_jitter_draws_from_base_to_three_times_the_previous_delay() {
    let base = 0.1;
    let backoff = exp(MS * 100, 2.0, MS * 100_000, Jitter::Decorrelated).unwrap();
    let delays = first_two_delays(&backoff);
    let (lo, hi) = spread(delays.iter().map(|d| d.0));
    assert!(lo < base * 1.2 && hi > base * 2.7, "first: {lo}..{hi}");
    let (lo, hi) = spread(delays.iter().map(|(first, second)| second / first));
    assert!(hi > 2.7, "the second reaches 3× the first: at most {hi}×");
    assert!(lo < 0.6, "and goes back towards the base: at least {lo}×");
    let (lo, _) = spread(delays.iter().map(|d| d.1));
    assert!(lo < base * 1.2, "second: from {lo}");
}

/// The stateless form grows from the previous attempt's nominal delay: the
/// fifth retry of 100 ms × 2ⁿ may wait up to 3 × 800 ms, not 3 × 100 ms.
#[test]
fn stateless_decorrelated_delays_grow_from_the_previous_nominal_delay() {
    let backoff = exp(MS * 100, 2.0, Duration::from_secs(60), Jitter::Decorrelated).unwrap();
    let longest = (0..200).filter_map(|_| backoff.delay(4)).max().unwrap();
    assert!(longest > Duration::from_secs(1), "{longest:?}");
    assert!(longest <= MS * 2_400, "{longest:?}");
}

/// A zero delay retries at once: no timer, no yield to the scheduler, so a
/// call that fails once and then succeeds is done within its first poll.
#[test]
fn a_zero_delay_retries_within_the_same_poll() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let _context = runtime.enter();
    let retry = Retry::builder("r")
        .backoff(Backoff::schedule([Duration::ZERO]).unwrap())
        .build()
        .unwrap();
    let calls = std::sync::atomic::AtomicU32::new(0);
    let call = retry.call(|| {
        let n = calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        async move {
            match n {
                0 => Err(keel_core::Classified::retryable("refused")),
                _ => Ok(n),
            }
        }
    });
    let mut call = std::pin::pin!(call);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    match call.as_mut().poll(&mut cx) {
        std::task::Poll::Ready(result) => assert_eq!(result.unwrap(), 1),
        std::task::Poll::Pending => panic!("a zero delay waited for a timer"),
    }
}

#[test]
fn predicate_policies_name_themselves_in_debug_output() {
    let on_error = RetryIf::new(|_: &std::io::Error| true);
    assert_eq!(format!("{on_error:?}"), "RetryIf");
    let on_result = RetryOnResult::new(ByClass, |_: &u32| false);
    let text = format!("{on_result:?}");
    assert!(
        text.starts_with("RetryOnResult") && text.contains("errors"),
        "{text}"
    );
}

#[test]
fn jitter_spreads_delays_at_the_cap_too() {
    let max = Duration::from_secs(5);
    for (jitter, low) in [(Jitter::Full, Duration::ZERO), (Jitter::Equal, max / 2)] {
        let backoff = exp(MS * 100, 2.0, max, jitter).unwrap();
        let late: Vec<Duration> = (0..200u64)
            .map(|seed| backoff.iter_seeded(seed).nth(40).unwrap())
            .collect();
        assert!(
            late.iter().all(|d| (low..=max).contains(d)),
            "{jitter:?}: {late:?}"
        );
        let mean = late.iter().sum::<Duration>() / 200;
        let middle = (low + max) / 2;
        assert!(
            mean > middle - MS * 300 && mean < middle + MS * 300,
            "{jitter:?} at the cap averages {mean:?}, not about {middle:?}"
        );
    }
}
