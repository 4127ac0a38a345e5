use std::time::Duration;

use metrics_util::debugging::{DebugValue, DebuggingRecorder};

use super::*;

/// A history sampling every 5 s, merging every 2 fine points.
fn history() -> History {
    History::builder()
        .interval(Duration::from_secs(5))
        .coarse_every(2)
        .build()
}

fn values(history: &History, kind: SubjectKind, name: &str, measure: Measure) -> Vec<f64> {
    history.series(kind, name, measure)
}

/// Runs `f` with `history`'s recorder around a debugging recorder, and
/// returns what the debugging recorder (the "exporter") saw.
fn record(history: &History, f: impl FnOnce()) -> Vec<(String, DebugValue)> {
    let exporter = DebuggingRecorder::new();
    let snapshotter = exporter.snapshotter();
    let recorder = history.recorder(exporter);
    metrics::with_local_recorder(&recorder, f);
    snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| (key.key().name().to_owned(), value))
        .collect()
}

fn consume(group: &'static str, seconds: &[f64]) {
    for s in seconds {
        metrics::histogram!("keel_consumer_handler_seconds", "topic" => "orders", "group" => group)
            .record(*s);
    }
}

#[test]
fn a_consumer_groups_interval_has_its_rate_percentiles_and_counts() {
    let history = history();
    record(&history, || {
        let mut seconds: Vec<f64> = (1..=100).map(|i| f64::from(i) / 1000.0).collect();
        seconds.reverse();
        consume("billing", &seconds);
        metrics::gauge!("keel_consumer_lag", "topic" => "orders", "group" => "billing").set(7.0);
        metrics::gauge!("keel_consumer_lag", "topic" => "refunds", "group" => "billing").set(3.0);
        metrics::gauge!("keel_consumer_in_flight", "topic" => "orders", "group" => "billing")
            .increment(2.0);
        metrics::counter!("keel_consumer_retries_total", "topic" => "orders", "group" => "billing")
            .increment(4);
        metrics::counter!("keel_consumer_dead_lettered_total", "topic" => "orders", "group" => "billing", "kind" => "malformed")
            .increment(1);
    });
    history.sample_at(5_000);
    let point = |m| values(&history, SubjectKind::ConsumerGroup, "billing", m);
    assert_eq!(point(Measure::Throughput), [20.0], "100 handled in 5 s");
    assert_eq!(point(Measure::ProcessingP50), [0.05]);
    assert_eq!(point(Measure::ProcessingP99), [0.099]);
    assert_eq!(
        point(Measure::Lag),
        [10.0],
        "summed over the group's topics"
    );
    assert_eq!(point(Measure::InFlight), [2.0]);
    assert_eq!(point(Measure::Retries), [4.0]);
    assert_eq!(point(Measure::DeadLetters), [1.0]);
}

#[test]
fn counters_count_the_interval_and_an_idle_interval_has_no_percentile() {
    let history = history();
    record(&history, || {
        consume("billing", &[0.01]);
        metrics::counter!("keel_consumer_retries_total", "topic" => "orders", "group" => "billing")
            .increment(4);
    });
    history.sample_at(5_000);
    history.sample_at(10_000);
    let retries = values(
        &history,
        SubjectKind::ConsumerGroup,
        "billing",
        Measure::Retries,
    );
    assert_eq!(retries, [4.0, 0.0], "the second interval retried nothing");
    let handled = values(
        &history,
        SubjectKind::ConsumerGroup,
        "billing",
        Measure::Throughput,
    );
    assert_eq!(handled, [0.2, 0.0], "idle is a rate of 0, not unknown");
    let p99 = values(
        &history,
        SubjectKind::ConsumerGroup,
        "billing",
        Measure::ProcessingP99,
    );
    assert_eq!(p99[0], 0.01);
    assert!(p99[1].is_nan(), "nothing handled, nothing to measure");
}

/// The payments breaker moved from `from` to `to`.
fn transition(from: &'static str, to: &'static str) {
    metrics::counter!("keel_breaker_transitions_total", "name" => "payments", "from" => from, "to" => to)
        .increment(1);
}

/// The payments breaker's state gauge.
fn state() -> metrics::Gauge {
    metrics::gauge!("keel_breaker_state", "name" => "payments")
}

#[test]
fn a_breaker_that_opened_and_closed_within_one_interval_shows_open() {
    let history = history();
    record(&history, || {
        state().set(0.0);
        transition("closed", "open");
        transition("open", "half_open");
        transition("half_open", "closed");
        metrics::counter!("keel_breaker_rejected_total", "name" => "payments").increment(9);
    });
    history.sample_at(5_000);
    record(&history, || state().set(2.0));
    history.sample_at(10_000);
    record(&history, || state().set(0.0));
    history.sample_at(15_000);
    let series = |m| values(&history, SubjectKind::Dependency, "payments", m);
    assert_eq!(series(Measure::BreakerState), [2.0, 1.0, 0.0]);
    assert_eq!(series(Measure::Transitions), [3.0, 0.0, 0.0]);
    assert_eq!(series(Measure::Refused), [9.0, 0.0, 0.0]);
}

#[test]
fn a_breaker_open_when_the_interval_began_shows_open_though_it_ended_closed() {
    let history = history();
    record(&history, || {
        state().set(1.0);
        transition("closed", "open");
    });
    history.sample_at(5_000);
    // Still open when this interval began; probed and closed within it.
    record(&history, || {
        transition("open", "half_open");
        transition("half_open", "closed");
        state().set(0.0);
    });
    history.sample_at(10_000);
    let levels = values(
        &history,
        SubjectKind::Dependency,
        "payments",
        Measure::BreakerState,
    );
    assert_eq!(levels, [2.0, 2.0]);
}

#[test]
fn a_dependencys_failed_calls_are_counted_apart() {
    let history = history();
    record(&history, || {
        let call = |outcome: &'static str, s: f64| {
            metrics::histogram!("keel_client_call_duration_seconds", "dependency" => "inventory", "outcome" => outcome)
                .record(s);
        };
        for _ in 0..8 {
            call("ok", 0.02);
        }
        call("error", 1.0);
        call("error", 1.0);
    });
    history.sample_at(5_000);
    let series = |m| values(&history, SubjectKind::Dependency, "inventory", m);
    assert_eq!(series(Measure::Calls), [2.0]);
    assert_eq!(series(Measure::Failures), [0.4]);
    assert_eq!(series(Measure::LatencyP50), [0.02]);
    assert_eq!(series(Measure::LatencyP99), [1.0]);
}

#[test]
fn every_metric_still_reaches_the_exporter() {
    let history = history();
    let seen = record(&history, || {
        consume("billing", &[0.5]);
        metrics::counter!("keel_untracked_total").increment(3);
    });
    let names: Vec<&str> = seen.iter().map(|(n, _)| n.as_str()).collect();
    assert!(
        names.contains(&"keel_consumer_handler_seconds"),
        "{names:?}"
    );
    assert!(
        seen.iter()
            .any(|(n, v)| n == "keel_untracked_total" && *v == DebugValue::Counter(3))
    );
    history.sample_at(5_000);
    assert!(
        history
            .names(SubjectKind::ConsumerGroup)
            .contains(&"billing".to_owned())
    );
}

#[test]
fn coarse_points_merge_the_fine_ones() {
    let history = history();
    record(&history, || {
        metrics::gauge!("keel_outbox_unpublished").set(40.0);
        metrics::counter!("keel_outbox_published_total", "topic" => "orders").increment(50);
    });
    history.sample_at(5_000);
    record(&history, || {
        metrics::gauge!("keel_outbox_unpublished").set(10.0);
        metrics::counter!("keel_outbox_published_total", "topic" => "orders").increment(100);
    });
    history.sample_at(10_000);
    let coarse = history.snapshot(&HistoryQuery::all(Resolution::Coarse));
    let outbox = &coarse.subjects[0];
    assert_eq!(coarse.interval_seconds, 10.0);
    assert_eq!(outbox.at, [10_000]);
    assert_eq!(outbox.values(Measure::Unpublished), [Some(40.0)], "worst");
    assert_eq!(outbox.values(Measure::Published), [Some(15.0)], "mean");
    let fine = history.snapshot(&HistoryQuery::all(Resolution::Fine));
    assert_eq!(fine.subjects[0].at, [5_000, 10_000]);
}

#[test]
fn subjects_past_the_bound_are_counted_not_kept() {
    let history = History::builder().max_subjects(2).build();
    record(&history, || {
        for group in ["a", "b", "c"] {
            consume(group, &[0.1]);
        }
    });
    history.sample_at(5_000);
    let json = history.snapshot(&HistoryQuery::all(Resolution::Fine));
    assert_eq!(json.subjects.len(), 2);
    assert_eq!(json.dropped_subjects, 1);
    history.sample_at(10_000);
    let json = history.snapshot(&HistoryQuery::all(Resolution::Fine));
    assert_eq!(
        json.dropped_subjects, 1,
        "the same one, not a running count"
    );
}

#[test]
fn the_rings_are_bounded() {
    let history = History::builder()
        .fine_points(3)
        .coarse_every(1)
        .coarse_points(2)
        .build();
    record(&history, || consume("billing", &[0.1]));
    for i in 1..=10 {
        history.sample_at(i * 5_000);
    }
    let fine = history.snapshot(&HistoryQuery::all(Resolution::Fine));
    assert_eq!(fine.subjects[0].at, [40_000, 45_000, 50_000]);
    let coarse = history.snapshot(&HistoryQuery::all(Resolution::Coarse));
    assert_eq!(coarse.subjects[0].at, [45_000, 50_000]);
}
