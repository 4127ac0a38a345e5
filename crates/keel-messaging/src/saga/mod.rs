//! Sagas: a business transaction across services, made of local steps that
//! are each undone by a compensation if the whole cannot finish.
//!
//! There is no distributed transaction to roll back, so a saga moves
//! forward one committed step at a time, and on failure walks back,
//! compensating (refund, release) the steps already done. This module
//! gives you what a saga needs either way, orchestrated or choreographed:
//!
//! - **A state machine persisted after every step.** The orchestrator saves
//!   the saga ([`SagaStore`](crate::store::SagaStore)) after each call and
//!   before the next (a result goes out with the next call's claim, in one
//!   save), so it can be killed between any two lines and resume exactly
//!   where it stopped: at worst the call in flight runs again. The
//!   core is pure (`plan` and `decide` over a [`SagaRecord`]); effects
//!   happen around it.
//! - **Idempotent steps and idempotent compensations.** Keys are derived,
//!   not random: `saga_id:step` for actions and `saga_id:undo:step` for
//!   compensations, so a repeated call carries the same key and the callee
//!   can recognise it. Compensation runs in reverse order and is itself
//!   resumable.
//! - **A pivot**: the point of no return. Before it, a step that keeps
//!   failing (after its retries, or at once for a permanent error) makes
//!   the saga compensate. Once the pivot succeeded, or an attempt at it
//!   may have happened, the saga only goes forward: it retries with the
//!   same key for a time budget ([`DEFAULT_FORWARD_BUDGET`]) and is then
//!   marked **stuck**, visibly, until an operator retries it. It is never
//!   compensated past the pivot.
//! - **An unknown outcome is never forgotten.** A call that exceeds its
//!   timeout (or loses its reply, or dies with the orchestrator) may have
//!   happened: the saga record says so (`outcome_unknown`, persisted), the
//!   call is retried with the same key, and if the saga turns back, the
//!   step is compensated with the others, however the later attempts
//!   failed. The direction is decided by everything that happened at a
//!   step, not by its last attempt.
//! - **A refusal is not an attempt.** A policy that refuses a call (breaker
//!   open, bulkhead full, retry budget empty, rate limited) never let it
//!   leave: the attempt is given back and the saga waits the refusal's
//!   `Retry-After` ([`DEFAULT_REFUSAL_WAIT`] if it has none, at most
//!   [`MAX_REFUSAL_WAIT`]).
//! - **Tombstones.** A compensation leaves a tombstone under the action's
//!   key ([`StepContext::action_key`]) and the action refuses a tombstoned
//!   key, so an action that arrives late (after its undo) cannot land.
//!   That part is the dependency's: Keel cannot do it for you.
//! - **A dashboard of in-flight sagas by state and age**
//!   ([`SagaOrchestrator::list`], [`SagaOrchestrator::counts`]) and
//!   **manual retry and cancel** ([`SagaOrchestrator::retry`],
//!   [`SagaOrchestrator::cancel`]; cancel is refused past the pivot), and
//!   [`SagaOrchestrator::confirm_not_applied`] for an operator who checked
//!   that a stuck step's action of unknown outcome did not happen.
//!
//! Every saga ends `completed`, fully `compensated` (or `cancelled`), or
//! `stuck` with the reason in `last_error`. Metrics: `keel_saga_total{saga,
//! status}` when a saga ends or sticks, `keel_saga_calls_total{saga, step,
//! call, outcome}`, `keel_saga_call_duration_seconds`, `keel_sagas{status}`.
//!
//! What the application shows of a saga's outcome (an order's status, a
//! customer's feed) is written by a [`SagaHook`], in the transaction that
//! saves the new status, never by reading the saga table.
//!
//! For two or three steps owned by one team, [`choreography`] chains
//! participants through their outboxes instead, without a coordinator, and
//! [`flow`] gives such a chain the same safety net: a deadline,
//! compensations when it passes, a stuck state, and records in the saga
//! table (so the console, the counts and the stuck-saga alert see it).
//!
//! A definition's [`deadline`](SagaDefinitionBuilder::deadline) bounds the
//! whole saga by elapsed time, however its steps spend it: it turns back
//! with the reason when it passes before the pivot; past the pivot, where
//! there is no way back, forward recovery goes on.
//!
//! ```no_run
//! use std::time::Duration;
//! use keel_core::Classified;
//! use keel_messaging::saga::{SagaDefinition, SagaOrchestrator, Step, StepContext};
//! use keel_messaging::store::SagaStore;
//! use serde::{Deserialize, Serialize};
//!
//! #[derive(Clone, Serialize, Deserialize)]
//! struct Order { id: String, total_minor: i64, payment_id: Option<String> }
//!
//! # async fn demo<S: SagaStore>(store: S) -> Result<(), Box<dyn std::error::Error>> {
//! let fulfil = SagaDefinition::<Order>::builder("order_fulfilment")
//!     .step(
//!         Step::new("capture_payment", |ctx: StepContext<Order>| async move {
//!             // payments.capture(ctx.data().total_minor, key = ctx.idempotency_key())
//!             ctx.update(|o| o.payment_id = Some(format!("pay-{}", ctx.idempotency_key())));
//!             Ok::<_, Classified>(())
//!         })
//!         .compensate_with(|_ctx| async move { Ok::<_, Classified>(()) }) // refund
//!         .timeout(Duration::from_secs(5)),
//!     )
//!     .step(Step::new("reserve_stock", |_ctx| async move { Ok::<_, Classified>(()) })
//!         .compensate_with(|_ctx| async move { Ok::<_, Classified>(()) })) // release
//!     .pivot(Step::new("schedule_shipment", |_ctx| async move { Ok::<_, Classified>(()) }))
//!     .step(Step::new("send_receipt", |_ctx| async move { Ok::<_, Classified>(()) }))
//!     .build()?;
//!
//! let orchestrator = SagaOrchestrator::builder(store.clone()).saga(&fulfil).build()?;
//! // In the inbox handler of `orders.placed`, inside its transaction:
//! let mut tx = store.begin().await?;
//! let order = Order { id: "A-4471".into(), total_minor: 8210, payment_id: None };
//! orchestrator.start(&mut tx, &fulfil, "A-4471", &order).await?;
//! store.commit(tx).await?;
//! orchestrator.notify();
//! tokio::spawn(async move { orchestrator.run(std::future::pending()).await });
//! # Ok(()) }
//! ```
//!
//! [`SagaRecord`]: crate::store::SagaRecord

pub mod choreography;
mod definition;
mod error;
pub mod flow;
mod hook;
mod machine;
mod orchestrator;

pub use definition::{
    DEFAULT_FORWARD_BUDGET, DEFAULT_MAX_ATTEMPTS, DEFAULT_REFUSAL_WAIT, DEFAULT_STEP_TIMEOUT,
    DEFAULT_STUCK_AFTER, MAX_REFUSAL_WAIT, SagaData, SagaDefinition, SagaDefinitionBuilder, Step,
    StepContext,
};
pub use error::SagaError;
pub use hook::{AfterCommit, SagaHook};
pub use keel_policy::retry::{Backoff, Jitter};
pub use orchestrator::{
    OrchestratorBuilder, OrchestratorOptions, SagaOrchestrator, SagaView, StartedSaga,
};

#[cfg(test)]
mod tests;
