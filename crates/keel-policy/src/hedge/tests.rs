use std::time::Duration;

use super::latency::LatencyWindow;
use super::*;
use crate::retry::RetryBudgetConfig;

const MS: Duration = Duration::from_millis(1);

fn refused(config: HedgeConfig) -> &'static str {
    config
        .build("h")
        .expect_err("the value must be refused")
        .field
}

fn with_delay(delay: HedgeDelay) -> HedgeConfig {
    HedgeConfig {
        delay,
        ..HedgeConfig::default()
    }
}

fn percentile(percentile: f64, min_samples: u32, window: u32, fallback: Duration) -> HedgeDelay {
    HedgeDelay::Percentile {
        percentile,
        min_samples,
        window,
        fallback,
    }
}

#[test]
fn refuses_a_zero_fixed_delay() {
    assert_eq!(
        refused(with_delay(HedgeDelay::fixed(Duration::ZERO))),
        "delay"
    );
}

#[test]
fn refuses_a_percentile_outside_0_to_100() {
    for p in [0.0, -5.0, 100.5, f64::NAN] {
        assert_eq!(
            refused(with_delay(percentile(p, 10, 100, MS))),
            "percentile"
        );
    }
    assert!(
        with_delay(percentile(100.0, 10, 100, MS))
            .build("h")
            .is_ok()
    );
}

#[test]
fn refuses_zero_min_samples() {
    assert_eq!(
        refused(with_delay(percentile(95.0, 0, 100, MS))),
        "min_samples"
    );
}

#[test]
fn refuses_a_window_smaller_than_min_samples_or_huge() {
    assert_eq!(refused(with_delay(percentile(95.0, 10, 5, MS))), "window");
    assert_eq!(
        refused(with_delay(percentile(95.0, 10, 2_000_000, MS))),
        "window"
    );
}

#[test]
fn refuses_a_zero_fallback() {
    assert_eq!(
        refused(with_delay(percentile(95.0, 10, 100, Duration::ZERO))),
        "fallback"
    );
}

#[test]
fn refuses_zero_or_too_many_hedges() {
    for hedges in [0, 17] {
        assert_eq!(
            refused(HedgeConfig {
                max_hedged_attempts: hedges,
                ..HedgeConfig::default()
            }),
            "max_hedged_attempts"
        );
    }
}

#[test]
fn refuses_an_invalid_budget() {
    let budget = Some(RetryBudgetConfig {
        max_tokens: 0.0,
        ..RetryBudgetConfig::default()
    });
    assert_eq!(
        refused(HedgeConfig {
            budget,
            ..HedgeConfig::default()
        }),
        "max_tokens"
    );
}

#[test]
fn config_defaults_and_round_trip() {
    let config: HedgeConfig = serde_json::from_str("{}").unwrap();
    assert_eq!(config, HedgeConfig::default());
    assert_eq!(config.max_hedged_attempts, 1);
    assert_eq!(config.delay, percentile(95.0, 50, 1000, MS * 100));
    let json = serde_json::to_string(&config).unwrap();
    assert_eq!(serde_json::from_str::<HedgeConfig>(&json).unwrap(), config);
    let fixed: HedgeConfig =
        serde_json::from_str(r#"{"delay": {"kind": "fixed", "delay": "80ms"}}"#).unwrap();
    assert_eq!(fixed.delay, HedgeDelay::fixed(MS * 80));
    assert!(serde_json::from_str::<HedgeConfig>(r#"{"max_hedges": 2}"#).is_err());
    let hedge = fixed.build("h").unwrap();
    assert_eq!(hedge.current_delay(), MS * 80);
    assert!(hedge.budget().is_some());
}

#[test]
fn window_reports_the_fallback_until_it_has_enough_samples() {
    let window = LatencyWindow::new(95.0, 100, 10, MS * 500);
    for _ in 0..9 {
        window.record(MS);
    }
    assert_eq!(window.delay(), MS * 500);
    window.record(MS);
    assert_eq!(window.delay(), MS);
}

#[test]
fn window_reports_the_percentile() {
    let window = LatencyWindow::new(95.0, 100, 100, MS);
    for ms in (1..=100).rev() {
        window.record(MS * ms);
    }
    assert_eq!(window.delay(), MS * 95);
    let max = LatencyWindow::new(100.0, 8, 8, MS);
    for ms in [3, 9, 1, 4, 4, 2, 7, 5] {
        max.record(MS * ms);
    }
    assert_eq!(max.delay(), MS * 9);
}

#[test]
fn window_forgets_old_samples() {
    let window = LatencyWindow::new(50.0, 20, 4, MS);
    for _ in 0..20 {
        window.record(MS * 10);
    }
    assert_eq!(window.delay(), MS * 10);
    for _ in 0..20 {
        window.record(MS * 300);
    }
    assert_eq!(window.delay(), MS * 300);
}

#[test]
fn futures_are_send_for_multi_threaded_servers() {
    fn assert_send<T: Send>(_: &T) {}
    let hedge = HedgeConfig::default().build("h").unwrap();
    assert_send(&hedge.call(|| async { Ok::<u32, std::io::Error>(1) }));
    let service = tower::service_fn(|x: u32| async move { Ok::<u32, std::io::Error>(x) });
    let mut hedged = tower_layer::Layer::layer(&hedge.layer(), service);
    assert_send(&tower_service::Service::call(&mut hedged, 1));
}
