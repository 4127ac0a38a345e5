use chrono::{TimeZone, Utc};
use keel_admin::AttemptJson;
use keel_store::{DeadLetterStatus, DeliveryStatus, SagaStatus};

use super::format::MAX_CELL;
use super::*;

fn at() -> chrono::DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 11, 29, 12, 0, 0).unwrap()
}

fn letter() -> DeadLetterJson {
    DeadLetterJson {
        id: "billing:evt-1".into(),
        status: DeadLetterStatus::Pending,
        topic: "orders".into(),
        key: "order-1".into(),
        group: "billing".into(),
        error_kind: "too_many_attempts".into(),
        message_id: "evt-1".into(),
        dead_at: at(),
        last_error: Some("ledger timeout\nafter 5 s".into()),
        history: vec![AttemptJson {
            attempt: 1,
            error: "ledger timeout".into(),
            at: at(),
        }],
        later_failures: Vec::new(),
        headers: Default::default(),
        payload: "{}".into(),
        payload_truncated: false,
    }
}

fn saga() -> SagaJson {
    SagaJson {
        id: "order-7".into(),
        kind: "order".into(),
        status: SagaStatus::Stuck,
        step: 0,
        step_name: Some("capture_payment".into()),
        attempts: 2,
        outcome_unknown: false,
        last_error: Some("x".repeat(100)),
        created_at: at(),
        updated_at: at(),
        age_ms: 10_800_000,
        idle_ms: 5_000,
        version: 7,
        data: serde_json::json!({"order_id": "order-7"}),
    }
}

#[test]
fn dead_letters_print_as_an_aligned_table_on_one_line_each() {
    let out = dead_letter_table(&[letter()]);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2);
    assert!(lines[0].starts_with("ID             STATUS   TOPIC"));
    assert_eq!(
        lines[1],
        "billing:evt-1  pending  orders  too_many_attempts  1         2026-11-29 12:00:00  ledger timeout after 5 s"
    );
    assert_eq!(dead_letter_table(&[]), "no dead letters\n");
    let detail = dead_letter_detail(&letter());
    assert!(detail.contains("#1 2026-11-29 12:00:00  ledger timeout"));
}

#[test]
fn sagas_show_step_names_ages_and_cut_errors() {
    let out = saga_table(&[saga()]);
    let row = out.lines().nth(1).unwrap();
    assert!(row.contains("stuck"));
    assert!(row.contains("capture_payment"));
    assert!(row.contains("3h") && row.contains("5s"));
    assert!(row.ends_with('…'), "{row}");
    let error = row.rsplit("  ").next().unwrap();
    assert_eq!(error.chars().count(), MAX_CELL, "long errors are cut");
    assert!(saga_detail(&saga()).contains("data:       {\"order_id\":\"order-7\"}"));
    assert_eq!(
        saga_changed("Retried", &saga()),
        "Retried saga order-7: now stuck\n"
    );
}

#[test]
fn deliveries_and_actions_read_plainly() {
    let d = DeliveryJson {
        id: 42,
        endpoint_id: "ep_partner".into(),
        event_id: "evt_1".into(),
        event_type: "order.placed".into(),
        status: DeliveryStatus::Failed,
        attempts: 7,
        next_attempt_at: at(),
        created_at: at(),
        updated_at: at(),
        attempt_log: Vec::new(),
    };
    let out = delivery_table(&[d]);
    assert!(
        out.lines()
            .nth(1)
            .unwrap()
            .starts_with("42  ep_partner  order.placed  failed  7")
    );
    let a = ActionJson {
        action: "replayed".into(),
        id: "billing:evt-1".into(),
        affected: 1,
    };
    assert_eq!(
        action_line(&a, "dead letter"),
        "Replayed dead letter billing:evt-1\n"
    );
}

#[test]
fn parked_rows_print_their_key_refusal_and_what_waits_behind_them() {
    let p = ParkedJson {
        id: 42,
        event_id: "evt-7".into(),
        topic: "orders".into(),
        key: "order\n7".into(),
        attempts: 1,
        last_error: "broker refused the request: key contains a line break".into(),
        created_at: at(),
        parked_at: at(),
        held_back: 2,
        headers: Default::default(),
        payload: "{}".into(),
        payload_truncated: false,
    };
    let out = parked_table(std::slice::from_ref(&p));
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "a key with a line break stays on one line");
    assert!(lines[0].starts_with("ID  TOPIC   KEY"), "{}", lines[0]);
    assert!(
        lines[1].starts_with("42  orders  order 7  1         2          2026-11-29 12:00:00"),
        "{}",
        lines[1]
    );
    assert_eq!(parked_table(&[]), "no parked outbox rows\n");
    let detail = parked_detail(&p);
    assert!(detail.contains("(key \"order\\n7\")"), "{detail}");
    assert!(detail.contains("held back: 2 later event(s)"));
    let a = ActionJson {
        action: "replayed".into(),
        id: "42".into(),
        affected: 1,
    };
    assert_eq!(
        action_line(&a, "parked outbox row"),
        "Replayed parked outbox row 42\n"
    );
    let client = AdminClient::new(&AdminClientArgs {
        server: "http://127.0.0.1:8080".into(),
        token: None,
    })
    .unwrap();
    assert_eq!(
        client.url(&["outbox", "parked", "42", "discard"]).as_str(),
        "http://127.0.0.1:8080/admin/api/outbox/parked/42/discard"
    );
}

#[test]
fn problems_print_status_title_and_detail() {
    let body = r#"{"type":"about:blank","title":"Conflict","status":409,"detail":"saga `order-7` is Completed, not stuck"}"#;
    assert_eq!(
        problem_message(409, body),
        "error 409 Conflict: saga `order-7` is Completed, not stuck"
    );
    let unauthorized = problem_message(401, "");
    assert!(unauthorized.starts_with("error 401 Unauthorized"));
    assert!(unauthorized.contains("--token"));
    assert_eq!(
        problem_message(502, "bad gateway from proxy"),
        "error 502 Bad Gateway: bad gateway from proxy"
    );
}

#[test]
fn ids_are_percent_encoded_into_the_path() {
    let client = AdminClient::new(&AdminClientArgs {
        server: "http://127.0.0.1:8080/".into(),
        token: None,
    })
    .unwrap();
    let url = client.url(&["dead-letters", "billing:a/b?c", "replay"]);
    assert_eq!(
        url.as_str(),
        "http://127.0.0.1:8080/admin/api/dead-letters/billing:a%2Fb%3Fc/replay"
    );
}
