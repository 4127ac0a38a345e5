use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use keel_core::{Classified, Deadline, PolicyError, Rejected};

use super::*;
use crate::breaker::State;

const MS: Duration = Duration::from_millis(1);

#[derive(Debug, thiserror::Error)]
#[error("carrier failed")]
struct CarrierDown;

/// A breaker that opens after `n` failures in a row and stays open for a
/// minute, so a test sees it refuse.
fn trips_after(n: u32) -> CircuitBreakerConfig {
    CircuitBreakerConfig {
        consecutive_failures: Some(n),
        open_duration: Duration::from_secs(60),
        open_duration_jitter: 0.0,
        ..CircuitBreakerConfig::default()
    }
}

fn carriers(budget: Duration) -> ScatterGather {
    ScatterGather::builder("quote")
        .target("fast")
        .target("slow")
        .target("broken")
        .budget(budget)
        .build()
        .expect("valid")
}

/// `fast` answers in 10 ms, `slow` in 5 s, `broken` fails at once.
async fn ask(target: Name) -> Result<u32, Classified> {
    match &*target {
        "fast" => {
            tokio::time::sleep(10 * MS).await;
            Ok(1)
        }
        "slow" => {
            tokio::time::sleep(Duration::from_secs(5)).await;
            Ok(2)
        }
        _ => Err(Classified::retryable(CarrierDown)),
    }
}

#[tokio::test(start_paused = true)]
async fn every_target_answers_in_target_order() {
    let gather = ScatterGather::builder("all")
        .target("b")
        .target("a")
        .build()
        .expect("valid");
    let answer = gather
        .call(|t| async move { Ok::<_, std::io::Error>(t.to_uppercase()) })
        .await;
    assert!(!answer.is_partial());
    let results: Vec<_> = answer
        .results
        .iter()
        .map(|(t, v)| (&**t, v.as_str()))
        .collect();
    assert_eq!(results, [("b", "B"), ("a", "A")]);
}

#[tokio::test(start_paused = true)]
async fn degrades_instead_of_failing_and_says_what_is_missing() {
    let started = clock::now();
    let answer = carriers(300 * MS).call(ask).await;
    assert_eq!(
        started.elapsed(),
        300 * MS,
        "it waits for the budget, no longer"
    );
    assert!(answer.is_partial());
    assert_eq!(answer.missing_targets(), ["slow", "broken"]);
    assert!(matches!(
        answer.missing[0].error,
        PolicyError::Rejected(Rejected::Timeout { after, .. }) if after == 300 * MS
    ));
    assert!(matches!(answer.missing[1].error, PolicyError::Inner(_)));
    assert_eq!(answer.values().collect::<Vec<_>>(), [1]);
}

#[tokio::test(start_paused = true)]
async fn a_target_still_running_at_the_budget_is_cancelled() {
    struct Dropped<'a>(&'a AtomicU32);
    impl Drop for Dropped<'_> {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let (finished, dropped) = (AtomicU32::new(0), AtomicU32::new(0));
    let gather = ScatterGather::builder("g")
        .target("slow")
        .budget(100 * MS)
        .build()
        .expect("valid");
    let answer = gather
        .call(|_| async {
            let _guard = Dropped(&dropped);
            tokio::time::sleep(Duration::from_secs(5)).await;
            finished.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(())
        })
        .await;
    assert_eq!(answer.missing_targets(), ["slow"]);
    assert_eq!(dropped.load(Ordering::SeqCst), 1, "the work was dropped");
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(finished.load(Ordering::SeqCst), 0, "and never finished");
}

#[tokio::test(start_paused = true)]
async fn a_failing_target_is_not_called_once_its_breaker_opens() {
    let calls = AtomicU32::new(0);
    let gather = ScatterGather::builder("g")
        .target("ok")
        .target_with_breaker("down", trips_after(3).build("down").expect("valid"))
        .build()
        .expect("valid");
    for _ in 0..10 {
        let answer = gather
            .call(|t| {
                let calls = &calls;
                async move {
                    if &*t == "ok" {
                        return Ok(());
                    }
                    calls.fetch_add(1, Ordering::SeqCst);
                    Err(Classified::retryable(CarrierDown))
                }
            })
            .await;
        assert_eq!(answer.missing_targets(), ["down"]);
        assert_eq!(answer.results.len(), 1, "the healthy target still answers");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 3, "the dependency is spared");
    let answer = gather.call(|_| async { Ok::<_, Classified>(()) }).await;
    assert!(matches!(
        answer.missing[0].error,
        PolicyError::Rejected(Rejected::CircuitOpen { .. })
    ));
    assert_eq!(gather.breaker("down").expect("target").state(), State::Open);
}

#[tokio::test(start_paused = true)]
async fn a_target_that_keeps_running_out_the_budget_trips_its_breaker() {
    let gather = ScatterGather::builder("g")
        .target_with_breaker("slow", trips_after(2).build("slow").expect("valid"))
        .budget(100 * MS)
        .build()
        .expect("valid");
    let calls = AtomicU32::new(0);
    for _ in 0..4 {
        gather
            .call(|_| async {
                calls.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(5)).await;
                Ok::<_, std::io::Error>(())
            })
            .await;
    }
    assert_eq!(calls.load(Ordering::SeqCst), 2);
    assert_eq!(gather.breaker("slow").expect("target").state(), State::Open);
}

#[tokio::test(start_paused = true)]
async fn the_callers_deadline_shortens_the_budget_and_reaches_the_targets() {
    let gather = carriers(Duration::from_secs(1));
    let deadline = Deadline::after(200 * MS);
    let seen = parking_lot::Mutex::new(Vec::new());
    let started = clock::now();
    let answer = deadline
        .scope(gather.call(|t| {
            seen.lock().push(Deadline::current().map(|d| d.instant()));
            ask(t)
        }))
        .await;
    assert_eq!(started.elapsed(), 200 * MS);
    assert_eq!(answer.missing_targets(), ["slow", "broken"]);
    assert!(seen.lock().iter().all(|d| *d == Some(deadline.instant())));
}

#[tokio::test(start_paused = true)]
async fn nothing_is_called_with_too_little_time_left() {
    let calls = AtomicU32::new(0);
    let gather = carriers(Duration::from_secs(1));
    let answer = Deadline::after(40 * MS)
        .scope(gather.call(|t| {
            calls.fetch_add(1, Ordering::SeqCst);
            ask(t)
        }))
        .await;
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert_eq!(answer.missing.len(), 3);
    assert!(
        answer
            .missing
            .iter()
            .all(|m| matches!(m.error, PolicyError::Rejected(Rejected::DeadlineExceeded)))
    );
}

#[tokio::test(start_paused = true)]
async fn a_gather_dropped_by_its_caller_records_nothing() {
    let gather = ScatterGather::builder("g")
        .target("slow")
        .build()
        .expect("valid");
    let call = gather.call(|_| async {
        tokio::time::sleep(Duration::from_secs(5)).await;
        Ok::<_, std::io::Error>(())
    });
    assert!(tokio::time::timeout(10 * MS, call).await.is_err());
    let breaker = gather.breaker("slow").expect("target").metrics();
    assert_eq!(breaker.buffered_calls, 0);
}

#[tokio::test(start_paused = true)]
async fn targets_share_a_registry_under_the_gathers_name() {
    let registry = BreakerRegistry::new(CircuitBreakerConfig::default()).expect("valid");
    let gather = ScatterGather::builder("quote")
        .breakers(registry.clone())
        .target("fast")
        .build()
        .expect("valid");
    gather.call(|_| async { Ok::<_, std::io::Error>(()) }).await;
    let names: Vec<_> = registry
        .snapshot()
        .into_iter()
        .map(|b| (b.dependency, b.endpoint))
        .collect();
    assert_eq!(names, [("quote".to_owned(), Some("fast".to_owned()))]);
}

#[test]
fn refuses_what_cannot_work() {
    let refused = |b: ScatterGatherBuilder| b.build().expect_err("refused").field;
    assert_eq!(refused(ScatterGather::builder("g")), "targets");
    assert_eq!(
        refused(ScatterGather::builder("g").target("a").target("a")),
        "targets"
    );
    assert_eq!(
        refused(
            ScatterGather::builder("g")
                .target("a")
                .budget(Duration::ZERO)
        ),
        "budget"
    );
}
