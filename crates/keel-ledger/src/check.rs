//! Checking the recorded facts against the invariants.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use keel_store::SagaStatus;

use super::*;

/// Per event: publish count, handlers that applied it (with counts), and
/// handlers that dead-lettered it.
#[derive(Default)]
struct Seen<'a> {
    published: usize,
    applied: BTreeMap<&'a str, usize>,
    dead: BTreeSet<&'a str>,
}

impl Facts {
    pub(super) fn report(&self) -> LedgerReport {
        let seen = self.seen();
        let mut report = LedgerReport {
            committed: self.committed.len(),
            aborted: self.aborted.len(),
            published: seen.values().filter(|s| s.published > 0).count(),
            republished: seen.values().map(|s| s.published.saturating_sub(1)).sum(),
            applied: self.effects.len(),
            dead_lettered: sorted_unique(&self.dead),
            handlers: self.handlers.iter().cloned().collect(),
            sagas: self.sagas.len(),
            ..LedgerReport::default()
        };
        self.check_events(&seen, &mut report);
        report.contradictions.sort();
        self.check_order(&mut report);
        self.check_sagas(&mut report);
        report
    }

    fn seen(&self) -> BTreeMap<&str, Seen<'_>> {
        let mut seen: BTreeMap<&str, Seen<'_>> = BTreeMap::new();
        for id in &self.publishes {
            seen.entry(id).or_default().published += 1;
        }
        for (id, handler) in &self.effects {
            *seen
                .entry(id)
                .or_default()
                .applied
                .entry(handler)
                .or_default() += 1;
        }
        for (id, handler) in &self.dead {
            seen.entry(id).or_default().dead.insert(handler);
        }
        seen
    }

    /// Lost, duplicated, leaked, unknown and contradictory events.
    fn check_events(&self, seen: &BTreeMap<&str, Seen<'_>>, report: &mut LedgerReport) {
        let nothing = Seen::default();
        let mut committed: Vec<(&String, &Committed)> = self.committed.iter().collect();
        committed.sort_by(|a, b| (&a.1.key, a.1.seq, a.0).cmp(&(&b.1.key, b.1.seq, b.0)));
        for (id, c) in committed {
            let s = seen.get(id.as_str()).unwrap_or(&nothing);
            let missing: Vec<String> = self
                .handlers
                .iter()
                .filter(|h| !s.applied.contains_key(h.as_str()) && !s.dead.contains(h.as_str()))
                .cloned()
                .collect();
            let unseen = self.handlers.is_empty()
                && s.published == 0
                && s.applied.is_empty()
                && s.dead.is_empty();
            if !missing.is_empty() || unseen {
                report.lost.push(Lost {
                    event_id: id.clone(),
                    key: c.key.clone(),
                    seq: c.seq,
                    missing,
                    published: s.published > 0,
                });
            }
            if self.aborted.contains(id) {
                report.contradictions.push(id.clone());
            }
        }
        for (id, s) in seen {
            for (handler, times) in &s.applied {
                let dead = s.dead.contains(handler);
                if *times > 1 || dead {
                    report.duplicated.push(Duplicated {
                        event_id: (*id).to_owned(),
                        handler: (*handler).to_owned(),
                        times: *times,
                        dead_lettered: dead,
                    });
                }
            }
            let stray = || Stray {
                event_id: (*id).to_owned(),
                published: s.published,
                applied_by: s.applied.keys().map(|h| (*h).to_owned()).collect(),
                dead_lettered_by: s.dead.iter().map(|h| (*h).to_owned()).collect(),
            };
            // An event recorded both ways is a contradiction *and*, if it
            // was seen, a leak: the user believed it aborted.
            if self.aborted.contains(*id) {
                report.leaked.push(stray());
            } else if !self.committed.contains_key(*id) {
                report.unknown.push(stray());
            }
        }
    }

    /// Per key, the first publication and each handler's first effect of
    /// every committed event must follow the key's sequence.
    fn check_order(&self, report: &mut LedgerReport) {
        let mut streams: BTreeMap<Stage, Vec<&str>> = BTreeMap::new();
        streams.insert(
            Stage::Published,
            self.publishes.iter().map(String::as_str).collect(),
        );
        for (id, handler) in &self.effects {
            streams
                .entry(Stage::Applied {
                    handler: handler.clone(),
                })
                .or_default()
                .push(id);
        }
        for (stage, ids) in streams {
            let mut first_seen = BTreeSet::new();
            // Key → the highest (seq, event id) seen so far.
            let mut high: HashMap<&str, (u64, &str)> = HashMap::new();
            for id in ids {
                if !first_seen.insert(id) {
                    continue; // repeats are duplicates, not order problems
                }
                let Some(c) = self.committed.get(id) else {
                    continue;
                };
                match high.get(c.key.as_str()) {
                    Some(&(seq, after)) if seq >= c.seq => {
                        report.out_of_order.push(OutOfOrder {
                            key: c.key.clone(),
                            stage: stage.clone(),
                            event_id: id.to_owned(),
                            seq: c.seq,
                            after_event_id: after.to_owned(),
                            after_seq: seq,
                        });
                    }
                    _ => {
                        high.insert(c.key.as_str(), (c.seq, id));
                    }
                }
            }
        }
    }

    fn check_sagas(&self, report: &mut LedgerReport) {
        for (id, saga) in &self.sagas {
            for problem in saga.problems() {
                report.sagas_unsettled.push(UnsettledSaga {
                    saga_id: id.clone(),
                    problem,
                });
            }
        }
    }
}

impl SagaFacts {
    fn problems(&self) -> Vec<SagaProblem> {
        let mut problems = Vec::new();
        match self.ended {
            None => problems.push(SagaProblem::NotEnded),
            Some(SagaStatus::Completed | SagaStatus::Compensated) => {}
            Some(status) => problems.push(SagaProblem::EndedAs(status)),
        }
        let mut counts: BTreeMap<(&str, bool), usize> = BTreeMap::new();
        for (step, undo) in &self.effects {
            *counts.entry((step, *undo)).or_default() += 1;
        }
        for (&(step, compensation), &times) in &counts {
            if times > 1 {
                problems.push(SagaProblem::DuplicateEffect {
                    step: step.to_owned(),
                    compensation,
                    times,
                });
            }
        }
        let done = |undo: bool| -> Vec<String> {
            counts
                .keys()
                .filter(|(_, u)| *u == undo)
                .map(|(s, _)| (*s).to_owned())
                .collect()
        };
        match self.ended {
            Some(SagaStatus::Completed) => {
                if let Some(steps) = &self.steps {
                    let missing: Vec<String> = steps
                        .iter()
                        .filter(|s| !counts.contains_key(&(s.as_str(), false)))
                        .cloned()
                        .collect();
                    if !missing.is_empty() {
                        problems.push(SagaProblem::StepsMissing(missing));
                    }
                }
                let undone = done(true);
                if !undone.is_empty() {
                    problems.push(SagaProblem::UndoneButCompleted(undone));
                }
            }
            Some(SagaStatus::Compensated) => {
                let not_undone: Vec<String> = done(false)
                    .into_iter()
                    .filter(|s| !counts.contains_key(&(s.as_str(), true)))
                    .collect();
                if !not_undone.is_empty() {
                    problems.push(SagaProblem::NotUndone(self.in_step_order(not_undone)));
                }
            }
            _ => {}
        }
        if let Some(steps) = &self.steps {
            problems.extend(self.order_problems(steps));
        }
        problems
    }

    fn in_step_order(&self, mut names: Vec<String>) -> Vec<String> {
        if let Some(steps) = &self.steps {
            names.sort_by_key(|n| steps.iter().position(|s| s == n));
        }
        names
    }

    /// Actions in step order, compensations in reverse, no action after the
    /// first compensation (repeats ignored).
    fn order_problems(&self, steps: &[String]) -> Vec<SagaProblem> {
        let mut problems = Vec::new();
        let mut last_action: Option<usize> = None;
        let mut last_undo: Option<usize> = None;
        let mut in_order = true;
        let mut seen = BTreeSet::new();
        for (step, undo) in &self.effects {
            let Some(index) = steps.iter().position(|s| s == step) else {
                problems.push(SagaProblem::UnknownStep(step.clone()));
                continue;
            };
            if !seen.insert((index, *undo)) {
                continue;
            }
            if *undo {
                in_order &= last_undo.is_none_or(|prev| index < prev);
                last_undo = Some(index);
            } else {
                in_order &= last_undo.is_none() && last_action.is_none_or(|prev| index > prev);
                last_action = Some(index);
            }
        }
        if !in_order {
            let observed = self
                .effects
                .iter()
                .map(|(step, undo)| {
                    if *undo {
                        format!("undo:{step}")
                    } else {
                        step.clone()
                    }
                })
                .collect();
            problems.push(SagaProblem::OutOfOrder(observed));
        }
        problems
    }
}

fn sorted_unique(pairs: &[(String, String)]) -> Vec<(String, String)> {
    let set: BTreeSet<&(String, String)> = pairs.iter().collect();
    set.into_iter().cloned().collect()
}
