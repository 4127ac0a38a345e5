//! The order saga and the fake services it calls, shared by the
//! orchestrator's unit tests (`src/saga/tests.rs`, over an in-memory store
//! with paused time) and its integration tests (`tests/saga.rs`, over
//! SQLite): one fixture, so a scenario means the same in both.

// Each includer uses part of it.
#![allow(dead_code)]

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use keel_core::{BoxError, Classified};
use keel_messaging::envelope::Event;
use keel_messaging::saga::{
    Backoff, DEFAULT_FORWARD_BUDGET, Jitter, SagaDefinition, Step, StepContext,
};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

// --------------------------------------------------------------- services --

/// What a fake service does when called for a step.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Behaviour {
    /// Fails this many more times (retryable), then works.
    FailTimes(u32),
    /// Refuses for good.
    Refuse,
    /// Never answers.
    Hang,
}

/// One scripted answer of a fake service, taken before its behaviour.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Reply {
    /// Does the work, then the reply is lost: the caller times out.
    ApplyThenHang,
    /// The request is held up on its way (nothing done yet): the caller
    /// times out.
    Lost,
    /// `503`: nothing done this time.
    Unavailable,
    /// `4xx`: nothing done, and it will not be.
    Permanent,
    /// The caller's breaker is open: the call never left.
    BreakerOpen { retry_after: Duration },
}

/// Fake downstream services that dedupe on the idempotency key, refuse an
/// action whose key a compensation tombstoned, and keep a ledger of what
/// they were asked and what they did.
#[derive(Default)]
pub(crate) struct Services {
    behaviour: Mutex<HashMap<String, Behaviour>>,
    scripts: Mutex<HashMap<String, VecDeque<Reply>>>,
    tombstones: Mutex<HashSet<String>>,
    calls: Mutex<Vec<String>>,
    effects: Mutex<Vec<String>>,
}

impl Services {
    /// The next answers for `step`, in order; then its behaviour applies.
    pub(crate) fn script(&self, step: &str, replies: &[Reply]) {
        self.scripts
            .lock()
            .insert(step.to_owned(), replies.iter().copied().collect());
    }

    /// A compensation: leaves a tombstone under `action_key` (whether or
    /// not the action happened), then undoes under `key`.
    pub(crate) async fn undo(
        &self,
        step: &str,
        key: &str,
        action_key: String,
    ) -> Result<(), BoxError> {
        self.tombstones.lock().insert(action_key);
        self.call(step, key).await
    }

    pub(crate) fn set(&self, step: &str, b: Behaviour) {
        self.behaviour.lock().insert(step.to_owned(), b);
    }

    pub(crate) fn clear(&self, step: &str) {
        self.behaviour.lock().remove(step);
    }

    pub(crate) async fn call(&self, step: &str, key: &str) -> Result<(), BoxError> {
        self.calls.lock().push(key.to_owned());
        if self.tombstones.lock().contains(key) {
            return Err(Classified::permanent(format!("{key} was undone: refused")).into());
        }
        let reply = self
            .scripts
            .lock()
            .get_mut(step)
            .and_then(|s| s.pop_front());
        match reply {
            Some(Reply::ApplyThenHang) => {
                self.apply(key);
                std::future::pending::<()>().await;
            }
            Some(Reply::Lost) => std::future::pending::<()>().await,
            Some(Reply::Unavailable) => {
                return Err(Classified::retryable(format!("{step}: 503")).into());
            }
            Some(Reply::Permanent) => {
                return Err(Classified::permanent(format!("{step}: 422")).into());
            }
            Some(Reply::BreakerOpen { retry_after }) => {
                return Err(keel_core::Rejected::circuit_open(step, retry_after).into());
            }
            None => {}
        }
        let behaviour = self.behaviour.lock().get(step).copied();
        match behaviour {
            Some(Behaviour::Hang) => std::future::pending().await,
            Some(Behaviour::Refuse) => return Err(format!("{step} refused").into()),
            Some(Behaviour::FailTimes(n)) if n > 0 => {
                self.set(step, Behaviour::FailTimes(n - 1));
                return Err(Classified::retryable(format!("{step} unavailable")).into());
            }
            _ => {}
        }
        self.apply(key);
        Ok(())
    }

    pub(crate) fn apply(&self, key: &str) {
        let mut effects = self.effects.lock();
        if !effects.iter().any(|k| k == key) {
            effects.push(key.to_owned());
        }
    }

    pub(crate) fn calls(&self) -> Vec<String> {
        self.calls.lock().clone()
    }

    pub(crate) fn calls_of(&self, key: &str) -> usize {
        self.calls.lock().iter().filter(|k| *k == key).count()
    }

    pub(crate) fn effects(&self) -> Vec<String> {
        self.effects.lock().clone()
    }
}

// ------------------------------------------------------------------ saga --

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct Order {
    pub(crate) order_id: String,
    pub(crate) total_minor: i64,
    pub(crate) payment_id: Option<String>,
}

pub(crate) fn order(id: &str) -> Order {
    Order {
        order_id: id.to_owned(),
        total_minor: 8210,
        payment_id: None,
    }
}

/// How long a step may take: long enough for a slow machine's SQLite
/// commit, short enough for the scenarios that wait one out.
pub(crate) const STEP_TIMEOUT: Duration = Duration::from_millis(300);

pub(crate) fn step(svc: &Arc<Services>, name: &'static str) -> Step<Order> {
    let action = svc.clone();
    Step::new(name, move |ctx: StepContext<Order>| {
        let svc = action.clone();
        async move {
            svc.call(name, ctx.idempotency_key()).await?;
            if name == "capture_payment" {
                ctx.update(|o| o.payment_id = Some(format!("pay-{}", o.order_id)));
            }
            Ok::<_, BoxError>(())
        }
    })
    .timeout(STEP_TIMEOUT)
    .max_attempts(2)
}

pub(crate) fn compensable(svc: &Arc<Services>, name: &'static str) -> Step<Order> {
    let undo = svc.clone();
    step(svc, name).compensate_with(move |ctx: StepContext<Order>| {
        let svc = undo.clone();
        async move {
            if name == "capture_payment" && ctx.data().payment_id.is_none() {
                // A capture that never reported recorded nothing in the
                // data: the refund goes by the capture's key.
                assert_eq!(
                    ctx.action_key(),
                    format!("{}:capture_payment", ctx.saga_id())
                );
            }
            svc.undo(
                &format!("undo_{name}"),
                ctx.idempotency_key(),
                ctx.action_key(),
            )
            .await
        }
    })
}

/// The order saga: capture_payment, reserve_stock, schedule_shipment (the
/// pivot), send_receipt.
pub(crate) fn seed_saga(svc: &Arc<Services>) -> SagaDefinition<Order> {
    seed_saga_with(svc, Duration::from_millis(2), DEFAULT_FORWARD_BUDGET)
}

/// The order saga with this first backoff (capped at four times it),
/// retrying forward (after the pivot, or at a pivot that may have
/// happened) for `forward_budget`.
pub(crate) fn seed_saga_with(
    svc: &Arc<Services>,
    first_backoff: Duration,
    forward_budget: Duration,
) -> SagaDefinition<Order> {
    SagaDefinition::builder("order_fulfilment")
        .step(compensable(svc, "capture_payment"))
        .step(compensable(svc, "reserve_stock"))
        .pivot(step(svc, "schedule_shipment"))
        .step(step(svc, "send_receipt"))
        .backoff(
            Backoff::exponential(first_backoff, 2.0, first_backoff * 4)
                .unwrap()
                .with_jitter(Jitter::None)
                .unwrap(),
        )
        .stuck_after(3)
        .forward_budget(forward_budget)
        .build()
        .unwrap()
}

/// `{id}:{name}` for each name: the keys the steps are called with.
pub(crate) fn keys(id: &str, names: &[&str]) -> Vec<String> {
    names.iter().map(|n| format!("{id}:{n}")).collect()
}

// --------------------------------------------------------- choreography --

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct OrderPlaced {
    pub(crate) order_id: String,
}
impl Event for OrderPlaced {
    const TYPE: &'static str = "shop.order.placed.v1";
    fn subject(&self) -> String {
        self.order_id.clone()
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct StockReserved {
    pub(crate) order_id: String,
}
impl Event for StockReserved {
    const TYPE: &'static str = "shop.stock.reserved.v1";
    fn subject(&self) -> String {
        self.order_id.clone()
    }
}
