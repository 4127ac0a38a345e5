use std::time::Duration;

use keel_core::{Classified, ErrorClass};
use keel_testkit::metrics::MetricsRecorder;

use super::*;

type Prices = LastGood<&'static str, u32>;

fn prices(max_age: Duration, capacity: usize) -> Prices {
    LastGood::builder("pricing")
        .max_age(max_age)
        .capacity(capacity)
        .build()
        .unwrap()
}

fn failing(class: ErrorClass) -> Result<u32, Classified> {
    Err(Classified::new(class, "pricing failed"))
}

#[tokio::test(start_paused = true)]
async fn a_failure_is_answered_with_the_last_good_value_and_its_age() {
    let p = prices(Duration::from_secs(60), 10);
    let fresh = p
        .call("SKU-1", || async { Ok::<_, Classified>(1999) })
        .await;
    assert_eq!(fresh.unwrap(), Answer::Fresh(1999));
    tokio::time::advance(Duration::from_secs(20)).await;
    let answer = p
        .call("SKU-1", || async { failing(ErrorClass::Retryable) })
        .await
        .unwrap();
    assert_eq!(
        answer,
        Answer::Stale {
            value: 1999,
            age: Duration::from_secs(20)
        }
    );
    assert_eq!(answer.staleness(), Some(Duration::from_secs(20)));
    let other = p
        .call("SKU-2", || async { failing(ErrorClass::Rejected) })
        .await;
    assert!(other.is_err(), "nothing cached for another key");
}

#[tokio::test(start_paused = true)]
async fn past_the_age_bound_the_error_goes_through() {
    let p = prices(Duration::from_secs(60), 10);
    p.call("SKU-1", || async { Ok::<_, Classified>(1999) })
        .await
        .unwrap();
    tokio::time::advance(Duration::from_secs(61)).await;
    let answer = p
        .call("SKU-1", || async { failing(ErrorClass::OutcomeUnknown) })
        .await;
    assert!(answer.is_err(), "a value past its age is not served");
    assert_eq!(p.recall(&"SKU-1"), None);
}

#[tokio::test(start_paused = true)]
async fn a_permanent_error_is_the_answer_not_a_cue_for_stale_data() {
    let p = prices(Duration::from_secs(60), 10);
    p.call("SKU-1", || async { Ok::<_, Classified>(1999) })
        .await
        .unwrap();
    let answer = p
        .call("SKU-1", || async { failing(ErrorClass::Permanent) })
        .await;
    assert_eq!(answer.unwrap_err().class(), ErrorClass::Permanent);
}

#[tokio::test(start_paused = true)]
async fn the_cache_is_bounded_and_forgets_the_oldest_first() {
    let p = prices(Duration::from_secs(600), 2);
    for (key, price) in [("A", 1), ("B", 2), ("C", 3)] {
        p.call(key, || async move { Ok::<_, Classified>(price) })
            .await
            .unwrap();
        tokio::time::advance(Duration::from_secs(1)).await;
    }
    assert_eq!(p.recall(&"A"), None, "the oldest went first");
    assert_eq!(p.recall(&"B").map(|(v, _)| v), Some(2));
    assert_eq!(p.recall(&"C").map(|(v, _)| v), Some(3));
    assert_eq!(p.inner.values.lock().len(), 2);
}

#[tokio::test(start_paused = true)]
async fn every_call_is_counted_so_the_fallback_rate_can_be_read() {
    let recorder = MetricsRecorder::new();
    let p = metrics::with_local_recorder(&recorder, || prices(Duration::from_secs(60), 10));
    p.call("SKU-1", || async { Ok::<_, Classified>(1999) })
        .await
        .unwrap();
    for _ in 0..3 {
        p.call("SKU-1", || async { failing(ErrorClass::Retryable) })
            .await
            .unwrap();
    }
    let _ = p
        .call("SKU-9", || async { failing(ErrorClass::Retryable) })
        .await;
    let count = |outcome: &str| {
        recorder.counter(&format!(
            "keel_last_good_total,name=pricing,outcome={outcome}"
        ))
    };
    assert_eq!(
        (count("fresh"), count("stale"), count("unavailable")),
        (1, 3, 1)
    );
}

#[test]
fn nonsense_settings_are_refused() {
    assert!(
        LastGood::builder("p")
            .max_age(Duration::ZERO)
            .build::<u8, u8>()
            .is_err()
    );
    assert!(
        LastGood::builder("p")
            .capacity(0)
            .build::<u8, u8>()
            .is_err()
    );
    assert!(
        LastGood::builder("p")
            .classes([])
            .build::<u8, u8>()
            .is_err()
    );
}
