use super::*;

const STEPS: [&str; 3] = ["capture", "reserve", "ship"];

/// Two keys, three events, two handlers, everything right.
fn clean() -> Ledger {
    let ledger = Ledger::with_handlers(["billing", "audit"]);
    ledger.committed("a1", "A", 1);
    ledger.committed("a2", "A", 2);
    ledger.committed("b1", "B", 1);
    ledger.aborted("x1");
    for id in ["a1", "b1", "a1", "a2"] {
        ledger.published(id); // a republish of a1 is fine
    }
    for (id, handler) in [
        ("b1", "billing"),
        ("a1", "billing"),
        ("a1", "audit"),
        ("a2", "billing"),
        ("b1", "audit"),
        ("a2", "audit"),
    ] {
        ledger.applied(id, handler);
    }
    ledger.saga_started("s1", STEPS);
    for step in STEPS {
        ledger.saga_action("s1", step);
    }
    ledger.saga_ended("s1", SagaStatus::Completed);
    ledger.saga_started("s2", STEPS);
    ledger.saga_action("s2", "capture");
    ledger.saga_action("s2", "reserve");
    ledger.saga_compensation("s2", "reserve");
    ledger.saga_compensation("s2", "capture");
    ledger.saga_ended("s2", SagaStatus::Compensated);
    ledger
}

#[test]
fn a_clean_history_passes_with_its_counts() {
    let report = clean().check().expect("clean");
    assert_eq!(report.committed, 3);
    assert_eq!(report.aborted, 1);
    assert_eq!(report.published, 3);
    assert_eq!(report.republished, 1);
    assert_eq!(report.applied, 6);
    assert_eq!(report.sagas, 2);
    assert_eq!(report.handlers, ["audit", "billing"]);
    assert!(report.to_string().ends_with("every invariant holds"));
}

#[test]
fn a_committed_event_a_handler_never_applied_is_lost() {
    let ledger = clean();
    ledger.committed("a3", "A", 3);
    ledger.published("a3");
    ledger.applied("a3", "audit");
    ledger.committed("b2", "B", 2);
    let err = ledger.check().unwrap_err();
    let lost = &err.report().lost;
    assert_eq!(lost.len(), 2);
    assert_eq!(
        lost[0],
        Lost {
            event_id: "a3".into(),
            key: "A".into(),
            seq: 3,
            missing: vec!["billing".into()],
            published: true,
        }
    );
    assert_eq!(lost[1].event_id, "b2");
    assert_eq!(lost[1].missing, ["audit", "billing"]);
    assert!(!lost[1].published);
    let text = err.to_string();
    assert!(text.contains("lost: a3 (key A #3) published but never applied by billing"));
    assert!(text.contains("lost: b2 (key B #2) never published"));
}

#[test]
fn a_dead_lettered_event_is_delivered_not_lost() {
    let ledger = clean();
    ledger.committed("poison", "P", 1);
    ledger.published("poison");
    ledger.dead_lettered("poison", "billing");
    ledger.dead_lettered("poison", "audit");
    let report = ledger.check().expect("dead letters are an outcome");
    assert_eq!(report.dead_lettered.len(), 2);
}

#[test]
fn without_mandatory_handlers_an_unpublished_event_is_lost() {
    let ledger = Ledger::new();
    ledger.committed("e1", "K", 1);
    ledger.committed("e2", "K", 2);
    ledger.published("e1");
    let err = ledger.check().unwrap_err();
    assert_eq!(err.report().lost.len(), 1);
    assert_eq!(err.report().lost[0].event_id, "e2");
    assert!(err.report().lost[0].missing.is_empty());
}

#[test]
fn an_effect_applied_twice_or_applied_and_dead_lettered_is_duplicated() {
    let ledger = clean();
    ledger.applied("a1", "billing");
    ledger.applied("a1", "billing");
    ledger.dead_lettered("b1", "audit");
    let err = ledger.check().unwrap_err();
    let dup = &err.report().duplicated;
    assert_eq!(dup.len(), 2);
    assert_eq!(
        (
            dup[0].event_id.as_str(),
            dup[0].handler.as_str(),
            dup[0].times
        ),
        ("a1", "billing", 3)
    );
    assert_eq!(
        (dup[1].event_id.as_str(), dup[1].dead_lettered),
        ("b1", true)
    );
    assert!(
        err.to_string()
            .contains("duplicated: a1 applied 3 times by billing")
    );
    assert!(
        err.report().out_of_order.is_empty(),
        "a repeat is a duplicate, not an order violation"
    );
}

#[test]
fn an_aborted_event_seen_anywhere_is_leaked() {
    let ledger = clean();
    ledger.aborted("x2");
    ledger.aborted("x3");
    ledger.published("x1");
    ledger.applied("x2", "audit");
    ledger.dead_lettered("x3", "billing");
    let err = ledger.check().unwrap_err();
    let leaked: Vec<&str> = err
        .report()
        .leaked
        .iter()
        .map(|s| s.event_id.as_str())
        .collect();
    assert_eq!(leaked, ["x1", "x2", "x3"]);
    assert_eq!(err.report().leaked[1].applied_by, ["audit"]);
    assert!(
        err.to_string()
            .contains("leaked from an aborted transaction: x1 (published 1 times")
    );
}

#[test]
fn an_event_nobody_committed_is_unknown_and_a_double_fact_a_contradiction() {
    let ledger = clean();
    ledger.published("ghost");
    ledger.aborted("a2");
    let err = ledger.check().unwrap_err();
    assert_eq!(err.report().unknown[0].event_id, "ghost");
    assert_eq!(err.report().contradictions, ["a2"]);
    assert_eq!(
        err.report().leaked[0].event_id,
        "a2",
        "seen although believed aborted"
    );
}

#[test]
fn effects_or_publishes_against_the_key_sequence_are_out_of_order() {
    let ledger = Ledger::with_handlers(["billing"]);
    for (id, seq) in [("a1", 1), ("a2", 2), ("a3", 3)] {
        ledger.committed(id, "A", seq);
    }
    ledger.committed("b1", "B", 1);
    for id in ["a2", "b1", "a1", "a3"] {
        ledger.published(id);
    }
    for id in ["a1", "b1", "a3", "a2"] {
        ledger.applied(id, "billing");
    }
    let err = ledger.check().unwrap_err();
    let order = &err.report().out_of_order;
    assert_eq!(order.len(), 2, "{err}");
    assert_eq!(
        order[0],
        OutOfOrder {
            key: "A".into(),
            stage: Stage::Published,
            event_id: "a1".into(),
            seq: 1,
            after_event_id: "a2".into(),
            after_seq: 2,
        }
    );
    assert_eq!(
        order[1].stage,
        Stage::Applied {
            handler: "billing".into()
        }
    );
    assert_eq!(
        (order[1].event_id.as_str(), order[1].after_event_id.as_str()),
        ("a2", "a3")
    );
    assert!(
        err.to_string()
            .contains("out of order: key A applied by billing: a2 (#2) after a3 (#3)")
    );
}

fn saga_problems(ledger: &Ledger, saga: &str) -> Vec<SagaProblem> {
    let report = ledger.report();
    report
        .sagas_unsettled
        .into_iter()
        .filter(|s| s.saga_id == saga)
        .map(|s| s.problem)
        .collect()
}

#[test]
fn a_saga_that_never_ended_or_ended_stuck_is_unsettled() {
    let ledger = clean();
    ledger.saga_started("s3", STEPS);
    ledger.saga_action("s3", "capture");
    ledger.saga_started("s4", STEPS);
    ledger.saga_ended("s4", SagaStatus::Stuck);
    ledger.saga_ended("s5", SagaStatus::Cancelled);
    assert_eq!(saga_problems(&ledger, "s3"), [SagaProblem::NotEnded]);
    assert_eq!(
        saga_problems(&ledger, "s4"),
        [SagaProblem::EndedAs(SagaStatus::Stuck)]
    );
    assert_eq!(
        saga_problems(&ledger, "s5"),
        [SagaProblem::EndedAs(SagaStatus::Cancelled)]
    );
    let err = ledger.check().unwrap_err();
    assert!(err.to_string().contains("saga s4: ended stuck"));
}

#[test]
fn a_completed_saga_needs_every_action_and_no_undo() {
    let ledger = Ledger::new();
    ledger.saga_started("s", STEPS);
    ledger.saga_action("s", "capture");
    ledger.saga_compensation("s", "capture");
    ledger.saga_ended("s", SagaStatus::Completed);
    assert_eq!(
        saga_problems(&ledger, "s"),
        [
            SagaProblem::StepsMissing(vec!["reserve".into(), "ship".into()]),
            SagaProblem::UndoneButCompleted(vec!["capture".into()]),
        ]
    );
}

#[test]
fn a_compensated_saga_must_undo_every_action_once_in_reverse() {
    let ledger = Ledger::new();
    ledger.saga_started("s", STEPS);
    ledger.saga_action("s", "capture");
    ledger.saga_action("s", "reserve");
    ledger.saga_compensation("s", "capture");
    ledger.saga_compensation("s", "capture");
    ledger.saga_ended("s", SagaStatus::Compensated);
    let problems = saga_problems(&ledger, "s");
    assert!(problems.contains(&SagaProblem::NotUndone(vec!["reserve".into()])));
    assert!(problems.contains(&SagaProblem::DuplicateEffect {
        step: "capture".into(),
        compensation: true,
        times: 2,
    }));

    let ledger = Ledger::new();
    ledger.saga_started("s", STEPS);
    ledger.saga_action("s", "capture");
    ledger.saga_action("s", "reserve");
    ledger.saga_compensation("s", "capture");
    ledger.saga_compensation("s", "reserve");
    ledger.saga_ended("s", SagaStatus::Compensated);
    assert_eq!(
        saga_problems(&ledger, "s"),
        [SagaProblem::OutOfOrder(vec![
            "capture".into(),
            "reserve".into(),
            "undo:capture".into(),
            "undo:reserve".into(),
        ])]
    );
}

#[test]
fn saga_actions_out_of_step_order_or_after_an_undo_are_caught() {
    let ledger = Ledger::new();
    ledger.saga_started("s", STEPS);
    ledger.saga_action("s", "reserve");
    ledger.saga_action("s", "capture");
    ledger.saga_action("s", "ship");
    ledger.saga_action("s", "teleport");
    ledger.saga_ended("s", SagaStatus::Completed);
    let problems = saga_problems(&ledger, "s");
    assert!(problems.contains(&SagaProblem::UnknownStep("teleport".into())));
    assert!(matches!(problems.last(), Some(SagaProblem::OutOfOrder(_))));

    let ledger = Ledger::new();
    ledger.saga_started("s", STEPS);
    ledger.saga_action("s", "capture");
    ledger.saga_compensation("s", "capture");
    ledger.saga_action("s", "reserve");
    ledger.saga_compensation("s", "reserve");
    ledger.saga_ended("s", SagaStatus::Compensated);
    assert!(matches!(
        saga_problems(&ledger, "s").as_slice(),
        [SagaProblem::OutOfOrder(_)]
    ));
}

#[test]
fn a_compensation_without_its_action_is_fine() {
    // A timed-out action is compensated because it may have happened.
    let ledger = Ledger::new();
    ledger.saga_started("s", STEPS);
    ledger.saga_action("s", "capture");
    ledger.saga_compensation("s", "reserve");
    ledger.saga_compensation("s", "capture");
    ledger.saga_ended("s", SagaStatus::Compensated);
    assert!(ledger.check().is_ok(), "{}", ledger.report());
}

#[test]
fn the_error_lists_every_violation() {
    let ledger = clean();
    ledger.committed("lost", "L", 1);
    ledger.applied("a1", "audit");
    ledger.published("x1");
    ledger.saga_ended("s1", SagaStatus::Stuck);
    let err = ledger.check().unwrap_err();
    let report = err.report();
    assert_eq!(report.violations().len(), 4, "{err}");
    let text = err.to_string();
    for id in ["lost", "a1", "x1", "s1"] {
        assert!(text.contains(id), "{id} missing from {text}");
    }
    assert!(text.contains("4 violation(s)"));
}

#[test]
fn facts_from_many_threads_all_count() {
    let ledger = Ledger::with_handlers(["h"]);
    std::thread::scope(|scope| {
        for t in 0..4 {
            let ledger = ledger.clone();
            scope.spawn(move || {
                for i in 0..250u64 {
                    let id = format!("t{t}-{i}");
                    ledger.committed(id.clone(), format!("k{t}"), i);
                    ledger.published(id.clone());
                    ledger.applied(id, "h");
                }
            });
        }
    });
    let report = ledger.check().expect("clean");
    assert_eq!((report.committed, report.applied), (1000, 1000));
}
