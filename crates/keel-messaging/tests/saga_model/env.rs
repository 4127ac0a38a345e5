//! The environment of the saga model: the dependencies its steps call,
//! answering as the test tells them, with a ledger of what they saw.

use std::collections::{BTreeSet, VecDeque};

use keel_core::{BoxError, Classified, Rejected};
use parking_lot::Mutex;
use tokio::sync::{Notify, oneshot};

use super::model::Call;
use super::{Answer, MINUTE};

/// The dependencies: they dedupe on the key, and an action whose key was
/// tombstoned by its compensation is refused (a late action cannot land).
#[derive(Default)]
pub(crate) struct Env {
    pub(crate) answers: Mutex<VecDeque<Answer>>,
    pub(crate) sent: Mutex<Vec<Call>>,
    pub(crate) effects: Mutex<BTreeSet<Call>>,
    pub(crate) tombstones: Mutex<BTreeSet<usize>>,
    pub(crate) wrong_keys: Mutex<Vec<String>>,
    pub(crate) resume: Mutex<Option<oneshot::Sender<Answer>>>,
    pub(crate) stalled: Notify,
}

impl Env {
    pub(crate) async fn call(&self, call: Call, key: &str) -> Result<(), BoxError> {
        let answer = self.answers.lock().pop_front();
        let answer = answer.unwrap_or(Answer::Refused(None));
        if let Answer::Refused(after) = answer {
            return Err(refusal(after));
        }
        if key != call.key() {
            self.wrong_keys.lock().push(key.to_owned());
        }
        self.sent.lock().push(call);
        let mut done = false;
        let answer = match answer {
            Answer::Stall { applied } => {
                if applied {
                    self.apply(call)?;
                    done = true;
                }
                let late = self.stall().await;
                if applied { late.after_effect() } else { late }
            }
            other => other,
        };
        if answer.applies() && !done {
            self.apply(call)?;
        }
        reply(answer)
    }

    fn apply(&self, call: Call) -> Result<(), BoxError> {
        match call {
            Call::Action(i) if self.tombstones.lock().contains(&i) => {
                return Err(Classified::permanent("tombstoned: undone already").into());
            }
            Call::Undo(i) => {
                self.tombstones.lock().insert(i);
            }
            Call::Action(_) => {}
        }
        self.effects.lock().insert(call);
        Ok(())
    }

    /// Waits to be resumed; killed, it never returns.
    async fn stall(&self) -> Answer {
        let (tx, rx) = oneshot::channel();
        *self.resume.lock() = Some(tx);
        self.stalled.notify_one();
        match rx.await {
            Ok(answer) => answer,
            Err(_) => std::future::pending().await,
        }
    }
}

fn refusal(after: Option<u32>) -> BoxError {
    let name = keel_core::Name::from("dependency");
    match after {
        Some(m) => Rejected::circuit_open(name, MINUTE * m),
        None => Rejected::BulkheadFull { name },
    }
    .into()
}

fn reply(answer: Answer) -> Result<(), BoxError> {
    match answer {
        Answer::Ok => Ok(()),
        Answer::Retryable => Err(Classified::retryable("503 unavailable").into()),
        Answer::Permanent => Err(Classified::permanent("422 refused for good").into()),
        _ => Err(Rejected::Timeout {
            name: "dependency".into(),
            after: MINUTE,
        }
        .into()),
    }
}
