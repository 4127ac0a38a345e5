//! `keel demo` end to end: the binary runs the whole shop, and its JSON
//! report says every invariant held and the numbers add up.

use std::process::Command;

use serde_json::Value;

#[test]
fn the_demo_keeps_every_invariant_and_its_numbers_add_up() {
    let output = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["demo", "--orders", "200", "--json"])
        .output()
        .expect("the keel binary runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "keel demo failed ({:?})\nstdout:\n{stdout}\nstderr:\n{stderr}",
        output.status
    );
    let last = stdout.lines().last().expect("a JSON line");
    let report: Value = serde_json::from_str(last).expect("the last line is one JSON object");
    let n = |key: &str| {
        report[key]
            .as_u64()
            .unwrap_or_else(|| panic!("{key} in {report}"))
    };

    // The verdict.
    let invariants = &report["invariants"];
    assert_eq!(invariants["ok"], true, "{report}");
    assert_eq!(invariants["lost"], 0);
    assert_eq!(invariants["duplicated"], 0);
    assert_eq!(invariants["money_conserved"], true);
    assert_eq!(report["quiescent"], true);

    // Every order accepted once; every duplicate absorbed.
    assert_eq!(n("orders_sent"), 200);
    assert_eq!(n("orders_accepted"), 200);
    assert_eq!(n("orders_rejected"), 0);
    assert!(n("duplicates_sent") > 0);
    assert_eq!(n("duplicates_absorbed"), n("duplicates_sent"));

    // Every accepted order was published, applied once and settled.
    assert_eq!(n("events_published"), 200);
    assert_eq!(n("effects_applied"), 200);
    let sagas = n("sagas_completed") + n("sagas_compensated") + n("sagas_stuck") + n("sagas_other");
    assert_eq!(sagas, 200);
    assert_eq!(n("sagas_stuck"), 0);
    assert!(n("sagas_completed") > 0);
    assert!(
        n("sagas_compensated") > 0,
        "out-of-stock orders compensate: {report}"
    );
    assert_eq!(n("dead_letters"), 0);

    // The flaky payments service tripped its breaker.
    assert!(n("breaker_transitions") > 0, "{report}");

    // Scatter-gather: every quote answer said it was partial (the slow
    // carrier's breaker sparing it is judged by the demo's invariants).
    assert_eq!(n("quotes_partial"), 16, "{report}");
    assert!(
        report["shipping_quotes"]
            .as_str()
            .is_some_and(|s| s.contains("not asked: its breaker was open")),
        "{report}"
    );

    // The shipment watch over gRPC resumed without a gap or a duplicate
    // (the demo's invariants judge it); it says so.
    assert!(
        report["shipment_watch"]
            .as_str()
            .is_some_and(|s| s.contains("resumed") && s.contains("delivered")),
        "{report}"
    );

    // Money: captured − refunded is exactly what completed orders cost.
    let money = &report["money"];
    let captured = money["captured_cents"].as_i64().unwrap();
    let refunded = money["refunded_cents"].as_i64().unwrap();
    let completed = money["completed_orders_cents"].as_i64().unwrap();
    assert_eq!(captured - refunded, completed);
    assert_eq!(money["double_captures"], 0);

    // The table went to stdout too, before the JSON.
    assert!(stdout.contains("every invariant holds"));
}
