//! The safety net under choreography: a choreographed flow recorded in the
//! saga table, with a deadline, compensations when it passes, and a stuck
//! state, so it shows in the same console view as an orchestrated saga.
//!
//! With no coordinator, nobody notices a choreographed flow that stopped
//! half way: the payment was captured, the stock event never came. Such a
//! flow needs the same safety net as an orchestrated saga. A [`Flow`]
//! names the event types of one flow in order and which of them a
//! participant can undo.
//! Participants record each step in the transaction that emits it
//! ([`Flow::reached`], or [`Flow::track`] around a
//! [`Reaction`](super::choreography::Reaction)): the flow's record is a
//! [`SagaRecord`] of kind [`Flow::name`], keyed by the flow's correlation
//! id, so it is listed, counted and alerted on with the sagas.
//!
//! The [`FlowWatch`] keeps the deadline. A flow not finished in time gets
//! one [`FLOW_EXPIRED`] event (in the transaction that marks the flow
//! `compensating`) naming the steps to undo, newest first; each
//! participant undoes its own step and says so with
//! [`Flow::compensated`]. When all have, the flow is `compensated`. One
//! that has nothing to undo, or whose compensations are not all confirmed
//! within the compensation deadline, is `stuck`, with the reason, for an
//! operator. A step that arrives after its flow expired is refused
//! ([`FlowError::Expired`], dead-lettered as `flow_expired`), so it cannot
//! land after the undo.
//!
//! ```no_run
//! use std::time::Duration;
//! use keel_messaging::envelope::Envelope;
//! use keel_messaging::outbox::Outbox;
//! use keel_messaging::saga::flow::{Flow, FlowWatch};
//! use keel_messaging::store::{OutboxStore, SagaStore};
//!
//! # async fn demo<S: OutboxStore + SagaStore>(store: S, placed: Envelope) -> Result<(), Box<dyn std::error::Error>> {
//! let checkout = Flow::builder("checkout", Duration::from_secs(30))
//!     .step("shop.order.placed.v1")
//!     .compensable_step("shop.stock.reserved.v1") // released on expiry
//!     .compensable_step("pay.captured.v1") // refunded on expiry
//!     .step("ship.scheduled.v1")
//!     .build()?;
//! // The shop, in the transaction that appends `placed` to its outbox:
//! let mut tx = store.begin().await?;
//! Outbox::new(store.clone()).append(&mut tx, "orders", &placed).await?;
//! checkout.reached(&store, &mut tx, &placed).await?;
//! store.commit(tx).await?;
//! // One watch per service keeps the deadline.
//! let watch = FlowWatch::builder(store.clone(), Outbox::new(store.clone()), "/shop", "flows")
//!     .flow(&checkout)
//!     .build();
//! tokio::spawn(async move { watch.run(std::future::pending()).await });
//! # Ok(()) }
//! ```

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::choreography::CORRELATION_ID;
use crate::consumer::HandlerError;
use crate::envelope::Envelope;
use crate::store::{OutboxStore, SagaRecord, SagaStatus, SagaStore, StoreError};

/// The type of the event the watch emits when a flow's deadline passes.
pub const FLOW_EXPIRED: &str = "keel.flow.expired.v1";

/// How long a flow's participants get to confirm their compensations.
pub const DEFAULT_COMPENSATION_DEADLINE: Duration = Duration::from_secs(300);

/// How far ahead a stuck flow is parked: it waits for an operator.
const PARKED: TimeDelta = TimeDelta::days(365 * 100);

mod watch;

pub use watch::{FlowWatch, FlowWatchBuilder};

/// Why a flow step could not be recorded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FlowError {
    /// The flow expired (or finished) before this step: undo the step's
    /// local work (rolling its transaction back does) instead of going on.
    #[error("flow {flow} of {correlation_id} is {status:?}: step {step} arrived too late")]
    Expired {
        /// The flow.
        flow: String,
        /// The flow instance.
        correlation_id: String,
        /// Where the flow is.
        status: SagaStatus,
        /// The step that came too late.
        step: String,
    },
    /// The event is not one of the flow's steps.
    #[error("{step} is not a step of flow {flow}")]
    UnknownStep {
        /// The flow.
        flow: String,
        /// The event type.
        step: String,
    },
    /// Someone else saved the flow first; run the transaction again.
    #[error("flow {flow} of {correlation_id} changed meanwhile; retry")]
    Conflict {
        /// The flow.
        flow: String,
        /// The flow instance.
        correlation_id: String,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl FlowError {
    /// What a consumer does about it: a step too late or not of the flow is
    /// dead-lettered (a late one under the kind `flow_expired`), a conflict
    /// retried, a store failure classified.
    pub fn into_handler_error(self) -> HandlerError {
        match self {
            Self::Expired { .. } => HandlerError::permanent(self).with_kind("flow_expired"),
            Self::UnknownStep { .. } => HandlerError::permanent(self),
            Self::Conflict { .. } => HandlerError::retryable(self),
            Self::Store(e) => HandlerError::classify(e),
        }
    }
}

/// What a flow's record holds in `data`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowState {
    /// The flow's correlation id.
    pub correlation_id: String,
    /// The steps (event types) reached, in the order they were recorded.
    pub reached: Vec<String>,
    /// The steps whose participant confirmed the undo.
    pub compensated: Vec<String>,
}

/// One choreographed flow: its steps in order and its deadlines. Cheap to
/// clone.
#[derive(Debug, Clone)]
pub struct Flow {
    inner: Arc<FlowInner>,
}

#[derive(Debug)]
struct FlowInner {
    name: String,
    steps: Vec<(String, bool)>,
    deadline: Duration,
    compensation_deadline: Duration,
}

/// Builds a [`Flow`].
#[derive(Debug)]
pub struct FlowBuilder {
    name: String,
    steps: Vec<(String, bool)>,
    deadline: Duration,
    compensation_deadline: Duration,
}

impl FlowBuilder {
    /// A step nobody undoes (a notification, the pivot and what follows).
    pub fn step(mut self, event_type: impl Into<String>) -> Self {
        self.steps.push((event_type.into(), false));
        self
    }

    /// A step its participant undoes when the flow expires.
    pub fn compensable_step(mut self, event_type: impl Into<String>) -> Self {
        self.steps.push((event_type.into(), true));
        self
    }

    /// How long participants get to confirm their undo (default
    /// [`DEFAULT_COMPENSATION_DEADLINE`]).
    pub fn compensation_deadline(mut self, deadline: Duration) -> Self {
        self.compensation_deadline = deadline;
        self
    }

    /// The flow, or why it cannot be one (no steps, a step twice).
    pub fn build(self) -> Result<Flow, String> {
        if self.steps.is_empty() {
            return Err(format!("flow {} has no steps", self.name));
        }
        for (i, (step, _)) in self.steps.iter().enumerate() {
            if self.steps[..i].iter().any(|(s, _)| s == step) {
                return Err(format!("flow {} lists step {step} twice", self.name));
            }
        }
        Ok(Flow {
            inner: Arc::new(FlowInner {
                name: self.name,
                steps: self.steps,
                deadline: self.deadline,
                compensation_deadline: self.compensation_deadline,
            }),
        })
    }
}

/// The correlation id of the flow `envelope` belongs to: its
/// `correlationid` extension, or its own id when it starts the flow.
pub fn correlation_of(envelope: &Envelope) -> String {
    match envelope.extensions.get(CORRELATION_ID) {
        Some(Value::String(id)) => id.clone(),
        _ => envelope.id.clone(),
    }
}

impl Flow {
    /// A flow named `name` (its records' saga kind) that must finish within
    /// `deadline` of its first recorded step.
    pub fn builder(name: impl Into<String>, deadline: Duration) -> FlowBuilder {
        FlowBuilder {
            name: name.into(),
            steps: Vec::new(),
            deadline,
            compensation_deadline: DEFAULT_COMPENSATION_DEADLINE,
        }
    }

    /// The flow's name: its records' saga kind.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The record id of the flow instance `correlation_id`.
    pub fn record_id(&self, correlation_id: &str) -> String {
        format!("{}:{correlation_id}", self.inner.name)
    }

    fn index_of(&self, step: &str) -> Result<usize, FlowError> {
        self.inner
            .steps
            .iter()
            .position(|(s, _)| s == step)
            .ok_or_else(|| FlowError::UnknownStep {
                flow: self.inner.name.clone(),
                step: step.to_owned(),
            })
    }

    /// Records, in `tx` (the one that emits or handles `event`), that the
    /// flow `event` belongs to reached the step `event` is. The first step
    /// recorded starts the flow and its deadline; the last completes it; a
    /// step recorded before changes nothing. A new step is refused with
    /// [`FlowError::Expired`] when the flow expired already.
    pub async fn reached<S: SagaStore>(
        &self,
        store: &S,
        tx: &mut S::Tx,
        event: &Envelope,
    ) -> Result<SagaStatus, FlowError> {
        let index = self.index_of(&event.ty)?;
        let correlation_id = correlation_of(event);
        let now = keel_core::clock::utc_now();
        let id = self.record_id(&correlation_id);
        let Some(mut record) = store.saga_get_in(tx, &id).await? else {
            let record = self.start(&correlation_id, &event.ty, index, now);
            if !store.saga_insert(tx, &record).await? {
                return Err(self.conflict(&correlation_id));
            }
            return Ok(record.status);
        };
        let mut state = state_of(&record)?;
        if state.reached.contains(&event.ty) {
            // Recorded already (the same step told twice): nothing changes.
            return Ok(record.status);
        }
        if record.status != SagaStatus::Running {
            return Err(FlowError::Expired {
                flow: self.inner.name.clone(),
                correlation_id,
                status: record.status,
                step: event.ty.clone(),
            });
        }
        state.reached.push(event.ty.clone());
        record.step = record.step.max(step_count(index));
        if index + 1 == self.inner.steps.len() {
            record.status = SagaStatus::Completed;
            record.next_attempt_at = now;
        }
        self.save(store, tx, record, &state, now).await
    }

    /// Records, in the participant's transaction, that it undid `step` of
    /// the flow `correlation_id` after the flow expired. When every step
    /// the [`FLOW_EXPIRED`] event asked to undo is undone, the flow is
    /// compensated, even if it was already stuck waiting for this word.
    pub async fn compensated<S: SagaStore>(
        &self,
        store: &S,
        tx: &mut S::Tx,
        correlation_id: &str,
        step: &str,
    ) -> Result<SagaStatus, FlowError> {
        self.index_of(step)?;
        let now = keel_core::clock::utc_now();
        let id = self.record_id(correlation_id);
        let Some(mut record) = store.saga_get_in(tx, &id).await? else {
            return Err(StoreError::NotFound(format!("flow {id}")).into());
        };
        let mut state = state_of(&record)?;
        if !state.compensated.iter().any(|s| s == step) {
            state.compensated.push(step.to_owned());
        }
        let pending = self.to_undo(&state);
        let waiting = matches!(record.status, SagaStatus::Compensating | SagaStatus::Stuck);
        if pending.is_empty() && waiting {
            record.status = SagaStatus::Compensated;
            record.next_attempt_at = now;
        }
        self.save(store, tx, record, &state, now).await
    }

    /// The compensable steps reached and not yet undone, newest first.
    pub fn to_undo(&self, state: &FlowState) -> Vec<String> {
        let mut steps: Vec<(usize, &String)> = state
            .reached
            .iter()
            .filter(|s| !state.compensated.contains(s))
            .filter_map(|s| {
                let i = self.inner.steps.iter().position(|(n, _)| n == s)?;
                self.inner.steps[i].1.then_some((i, s))
            })
            .collect();
        steps.sort_by_key(|&(i, _)| std::cmp::Reverse(i));
        steps.into_iter().map(|(_, s)| s.clone()).collect()
    }

    /// Wraps a reaction so each event it emits is recorded as a step of
    /// this flow, in the reaction's transaction, and a cause whose flow has
    /// expired is refused before the reaction runs.
    pub fn track<S, R>(&self, store: S, reaction: R) -> Tracked<S, R> {
        Tracked {
            flow: self.clone(),
            store,
            reaction,
        }
    }

    fn start(
        &self,
        correlation_id: &str,
        step: &str,
        index: usize,
        now: DateTime<Utc>,
    ) -> SagaRecord {
        let state = FlowState {
            correlation_id: correlation_id.to_owned(),
            reached: vec![step.to_owned()],
            compensated: Vec::new(),
        };
        let done = index + 1 == self.inner.steps.len();
        SagaRecord {
            id: self.record_id(correlation_id),
            kind: self.inner.name.clone(),
            status: if done {
                SagaStatus::Completed
            } else {
                SagaStatus::Running
            },
            step: step_count(index),
            data: serde_json::to_value(&state).unwrap_or(Value::Null),
            attempts: 0,
            outcome_unknown: false,
            first_attempt_at: None,
            last_error: None,
            next_attempt_at: now + delta(self.inner.deadline),
            created_at: now,
            updated_at: now,
            version: 1,
            traceparent: keel_core::TraceParent::current().map(|t| t.to_string()),
        }
    }

    async fn save<S: SagaStore>(
        &self,
        store: &S,
        tx: &mut S::Tx,
        mut record: SagaRecord,
        state: &FlowState,
        now: DateTime<Utc>,
    ) -> Result<SagaStatus, FlowError> {
        record.data = serde_json::to_value(state).map_err(StoreError::other)?;
        record.updated_at = now;
        record.version += 1;
        if !store.saga_save_in(tx, &record).await? {
            return Err(self.conflict(&state.correlation_id));
        }
        Ok(record.status)
    }

    fn conflict(&self, correlation_id: &str) -> FlowError {
        FlowError::Conflict {
            flow: self.inner.name.clone(),
            correlation_id: correlation_id.to_owned(),
        }
    }

    /// The step name at `index` (for reasons).
    fn step_name(&self, index: usize) -> &str {
        self.inner
            .steps
            .get(index)
            .map_or("(none)", |(name, _)| name.as_str())
    }
}

/// A reaction whose emitted events are recorded as steps of a [`Flow`]; see
/// [`Flow::track`].
#[derive(Debug)]
pub struct Tracked<S, R> {
    flow: Flow,
    store: S,
    reaction: R,
}

impl<S, In, Out, F> Tracked<S, super::choreography::Reaction<S, In, Out, F>>
where
    S: OutboxStore + SagaStore,
    In: crate::Event + Send + 'static,
    Out: crate::Event + Send + Sync + 'static,
    F: super::choreography::ReactionFn<S::Tx, In, Out>,
{
    /// Refuses a cause whose flow is no longer running, reacts, and records
    /// the emitted event as the flow's next step, all in `tx`.
    pub async fn react(
        &self,
        tx: &mut S::Tx,
        cause: &Envelope,
    ) -> Result<Option<Envelope>, HandlerError> {
        let id = self.flow.record_id(&correlation_of(cause));
        if let Some(record) = self
            .store
            .saga_get(&id)
            .await
            .map_err(HandlerError::classify)?
            && record.status != SagaStatus::Running
        {
            return Err(FlowError::Expired {
                flow: self.flow.name().to_owned(),
                correlation_id: correlation_of(cause),
                status: record.status,
                step: cause.ty.clone(),
            }
            .into_handler_error());
        }
        let emitted = self.reaction.react(tx, cause).await?;
        if let Some(next) = &emitted {
            self.flow
                .reached(&self.store, tx, next)
                .await
                .map_err(FlowError::into_handler_error)?;
        }
        Ok(emitted)
    }
}

#[async_trait::async_trait]
impl<S, In, Out, F> crate::consumer::Handler<S::Tx>
    for Tracked<S, super::choreography::Reaction<S, In, Out, F>>
where
    S: OutboxStore + SagaStore,
    In: crate::Event + Send + 'static,
    Out: crate::Event + Send + Sync + 'static,
    F: super::choreography::ReactionFn<S::Tx, In, Out>,
{
    async fn handle(
        &self,
        tx: &mut S::Tx,
        envelope: &Envelope,
        _info: &crate::consumer::DeliveryInfo,
    ) -> Result<(), HandlerError> {
        self.react(tx, envelope).await.map(drop)
    }
}

/// The flow state stored in a record's `data`.
fn state_of(record: &SagaRecord) -> Result<FlowState, StoreError> {
    serde_json::from_value(record.data.clone()).map_err(StoreError::other)
}

fn step_count(index: usize) -> u32 {
    u32::try_from(index + 1).unwrap_or(u32::MAX)
}

fn delta(d: Duration) -> TimeDelta {
    TimeDelta::from_std(d).unwrap_or(TimeDelta::MAX)
}

/// The flows a watch keeps, by name.
type Flows = HashMap<String, Flow>;

#[cfg(test)]
mod tests;
