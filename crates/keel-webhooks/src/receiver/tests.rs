use super::*;

#[tokio::test(start_paused = true)]
async fn seen_ids_are_bounded_by_age_and_count_and_can_be_released() {
    let mut seen = SeenIds::new(Duration::from_secs(10), 3);
    assert!(seen.check_and_insert("a"));
    assert!(!seen.check_and_insert("a"));
    seen.remove("a");
    assert!(seen.check_and_insert("a"), "released ids count as new");
    for id in ["b", "c", "d"] {
        assert!(seen.check_and_insert(id));
    }
    assert!(seen.seen.len() <= 3);
    assert!(
        seen.check_and_insert("a"),
        "the oldest went when the count was reached"
    );
    tokio::time::advance(Duration::from_secs(11)).await;
    assert!(seen.check_and_insert("d"), "forgotten after the ttl");
}
