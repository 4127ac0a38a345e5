use std::time::Duration;

use serde_json::Value;

use super::*;

fn checkout() -> Flow {
    Flow::builder("checkout", Duration::from_secs(30))
        .compensable_step("shop.order.placed.v1")
        .compensable_step("pay.captured.v1")
        .step("mail.sent.v1")
        .compensable_step("stock.reserved.v1")
        .step("ship.scheduled.v1")
        .build()
        .unwrap()
}

#[test]
fn the_undo_list_is_the_compensable_steps_reached_and_not_undone_newest_first() {
    let flow = checkout();
    let mut state = FlowState {
        correlation_id: "c-1".into(),
        reached: vec![
            "shop.order.placed.v1".into(),
            "stock.reserved.v1".into(),
            "mail.sent.v1".into(),
            "pay.captured.v1".into(),
        ],
        compensated: Vec::new(),
    };
    assert_eq!(
        flow.to_undo(&state),
        [
            "stock.reserved.v1",
            "pay.captured.v1",
            "shop.order.placed.v1"
        ],
        "flow order, not arrival order; the mail is not undone"
    );
    state.compensated.push("pay.captured.v1".into());
    assert_eq!(
        flow.to_undo(&state),
        ["stock.reserved.v1", "shop.order.placed.v1"]
    );
}

#[test]
fn a_flow_needs_steps_each_once() {
    let none = Flow::builder("empty", Duration::from_secs(1)).build();
    assert!(none.unwrap_err().contains("no steps"));
    let twice = Flow::builder("twice", Duration::from_secs(1))
        .step("a.v1")
        .compensable_step("a.v1")
        .build();
    assert!(twice.unwrap_err().contains("twice"));
}

#[test]
fn the_correlation_id_is_the_extension_or_the_first_events_own_id() {
    let mut first = Envelope::new("/shop", "shop.order.placed.v1");
    first.id = "evt-1".into();
    assert_eq!(correlation_of(&first), "evt-1");
    let mut next = Envelope::new("/pay", "pay.captured.v1");
    next.extensions
        .insert(CORRELATION_ID.into(), Value::String("evt-1".into()));
    assert_eq!(correlation_of(&next), "evt-1");
    assert_eq!(checkout().record_id("evt-1"), "checkout:evt-1");
}

#[test]
fn an_expired_step_is_dead_lettered_under_its_own_kind_and_a_conflict_retried() {
    let expired: HandlerError = FlowError::Expired {
        flow: "checkout".into(),
        correlation_id: "c".into(),
        status: SagaStatus::Compensating,
        step: "stock.reserved.v1".into(),
    }
    .into_handler_error();
    assert_eq!(expired.kind(), Some("flow_expired"));
    let conflict: HandlerError = FlowError::Conflict {
        flow: "checkout".into(),
        correlation_id: "c".into(),
    }
    .into_handler_error();
    assert!(matches!(
        conflict.disposition(),
        crate::consumer::Disposition::Retry { .. }
    ));
}
