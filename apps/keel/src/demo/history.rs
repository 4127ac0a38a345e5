//! What every client call came to, recorded as Jepsen records a history:
//! each call is **ok** (a `201` read in full), **failed** (an answer that
//! says nothing was done: a `4xx`, or `409` for a duplicate in flight) or
//! **unknown** (no answer, a `5xx`, a body cut short: it may have been
//! done). The checker then judges what the database holds against what
//! the clients may have caused, never against what they were told alone.

use std::collections::BTreeMap;

use parking_lot::Mutex;
use serde::Serialize;

use super::workload::{Accepted, WorkloadResult};

/// What one call came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// `201`, with the order it names.
    Ok {
        /// The order id in the answer.
        order_id: String,
        /// Its total.
        total_cents: i64,
        /// `Idempotent-Replayed: true`: the stored first answer.
        replayed: bool,
    },
    /// An answer saying nothing was done.
    Failed {
        /// The status.
        status: u16,
    },
    /// No answer that tells: the order may or may not have been placed.
    Unknown {
        /// What the client saw instead.
        why: String,
    },
}

impl Outcome {
    /// The outcome of an answer with `status` that carried no readable
    /// order: `4xx` says nothing was done; anything else may have done it.
    pub fn of_status(status: u16) -> Self {
        if (400..500).contains(&status) {
            Self::Failed { status }
        } else {
            Self::Unknown {
                why: format!("status {status}"),
            }
        }
    }
}

/// Calls counted by outcome.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct OutcomeCounts {
    /// `201`s.
    pub ok: u64,
    /// Answers that said nothing was done.
    pub failed: u64,
    /// Calls whose outcome the client could not know.
    pub unknown: u64,
}

/// Every call of a workload, in the order they ended. Shared by the
/// workload's tasks.
#[derive(Debug, Default)]
pub struct History {
    calls: Mutex<Vec<(String, Outcome)>>,
}

impl History {
    /// Records that a call under `key` came to `outcome`.
    pub fn record(&self, key: &str, outcome: Outcome) {
        self.calls.lock().push((key.to_owned(), outcome));
    }

    /// What the clients saw, per key: the input of the checker.
    pub fn summarize(&self, latency_us: hdrhistogram::Histogram<u64>) -> WorkloadResult {
        let calls = std::mem::take(&mut *self.calls.lock());
        let mut by_key: BTreeMap<String, Vec<Outcome>> = BTreeMap::new();
        let mut counts = OutcomeCounts::default();
        for (key, outcome) in calls {
            match outcome {
                Outcome::Ok { .. } => counts.ok += 1,
                Outcome::Failed { .. } => counts.failed += 1,
                Outcome::Unknown { .. } => counts.unknown += 1,
            }
            by_key.entry(key).or_default().push(outcome);
        }
        let mut result = WorkloadResult::empty(latency_us);
        result.calls = counts;
        for (key, outcomes) in by_key {
            judge_key(&mut result, key, &outcomes);
        }
        result
    }
}

/// Adds what the clients saw of `key` to `result`.
fn judge_key(result: &mut WorkloadResult, key: String, outcomes: &[Outcome]) {
    let mut ids: BTreeMap<&str, i64> = BTreeMap::new();
    let mut originals = 0;
    for outcome in outcomes {
        match outcome {
            Outcome::Ok {
                order_id,
                total_cents,
                replayed,
            } => {
                if *replayed {
                    result.duplicates_absorbed += 1;
                } else {
                    originals += 1;
                }
                ids.insert(order_id, *total_cents);
            }
            Outcome::Failed { status: 409 } => result.in_flight_conflicts += 1,
            Outcome::Failed { .. } => result.rejected += 1,
            Outcome::Unknown { .. } => {}
        }
    }
    if outcomes
        .iter()
        .any(|o| matches!(o, Outcome::Unknown { .. }))
    {
        result.unknown_keys.push(key.clone());
    }
    if ids.len() > 1 || originals > 1 {
        result.conflicting_keys.push(key.clone());
    }
    result.sent_keys.push(key.clone());
    match ids.into_iter().next() {
        Some((order_id, total_cents)) => result.accepted.push(Accepted {
            key,
            order_id: order_id.to_owned(),
            total_cents,
        }),
        None => result.failed.push(key),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(order_id: &str, replayed: bool) -> Outcome {
        Outcome::Ok {
            order_id: order_id.into(),
            total_cents: 100,
            replayed,
        }
    }

    fn summarize(calls: &[(&str, Outcome)]) -> WorkloadResult {
        let history = History::default();
        for (key, outcome) in calls {
            history.record(key, outcome.clone());
        }
        history.summarize(hdrhistogram::Histogram::new(3).expect("histogram"))
    }

    #[test]
    fn each_call_is_counted_by_what_the_client_could_know() {
        let result = summarize(&[
            ("k1", Outcome::of_status(503)),
            ("k1", ok("o1", false)),
            ("k1", ok("o1", true)),
            ("k2", Outcome::of_status(409)),
            ("k2", ok("o2", true)),
            ("k3", Outcome::of_status(422)),
        ]);
        assert_eq!(
            result.calls,
            OutcomeCounts {
                ok: 3,
                failed: 2,
                unknown: 1
            }
        );
        assert_eq!(result.unknown_keys, ["k1"]);
        assert_eq!(result.in_flight_conflicts, 1);
        assert_eq!(result.rejected, 1);
        assert_eq!(result.failed, ["k3"]);
        assert_eq!(result.accepted.len(), 2);
        assert!(result.conflicting_keys.is_empty());
        assert_eq!(result.sent_keys, ["k1", "k2", "k3"]);
    }

    #[test]
    fn two_orders_or_two_fresh_answers_for_one_key_conflict() {
        let result = summarize(&[
            ("a", ok("o1", false)),
            ("a", ok("o2", true)),
            ("b", ok("o3", false)),
            ("b", ok("o3", false)),
        ]);
        assert_eq!(result.conflicting_keys, ["a", "b"]);
    }
}
