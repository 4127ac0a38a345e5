//! What a saga is: named steps in order, each with an action and maybe a
//! compensation, one of them the pivot.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use keel_core::{BoxError, Classified};
use keel_policy::retry::Backoff;
use parking_lot::Mutex;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::SagaError;
use super::machine::{Call, Shape, StepShape};
use crate::store::SagaRecord;

/// How long one call of a step may take by default before it counts as a
/// failure of unknown outcome.
pub const DEFAULT_STEP_TIMEOUT: Duration = Duration::from_secs(30);

/// Attempts at a step before the pivot (the first included) before the saga
/// compensates.
pub const DEFAULT_MAX_ATTEMPTS: u32 = 3;

/// Attempts at a compensation before the saga is marked stuck for an
/// operator.
pub const DEFAULT_STUCK_AFTER: u32 = 10;

/// How long a saga retries forward (a step after the pivot, or a pivot that
/// may have happened) with the same idempotency key before it is marked
/// stuck for an operator. Counted from the step's first attempt.
///
/// Why a time and not a count: a brown-out of the dependency (an open
/// breaker, a wave of 503s, slow answers) lasts a time, whatever the number
/// of attempts it eats; and after the pivot there is no alternative to
/// going forward, so the saga keeps trying for as long as an operator would
/// reasonably wait before looking.
pub const DEFAULT_FORWARD_BUDGET: Duration = Duration::from_secs(10 * 60);

/// How long a saga waits after a policy refused its call (breaker open,
/// bulkhead full, retry budget empty) when the refusal names no
/// `Retry-After`. A refusal is not an attempt: the call never left.
pub const DEFAULT_REFUSAL_WAIT: Duration = Duration::from_secs(1);

/// The longest a saga waits on one refusal's `Retry-After`: a longer one (a
/// dependency's header, a breaker's hint) is read as this, so no single
/// answer can park a saga for good. Refused again, it waits again.
pub const MAX_REFUSAL_WAIT: Duration = Duration::from_secs(5 * 60);

/// The data a saga carries from step to step: serializable (it is persisted
/// after every step) and cloneable.
pub trait SagaData: Serialize + DeserializeOwned + Clone + Send + Sync + 'static {}

impl<T: Serialize + DeserializeOwned + Clone + Send + Sync + 'static> SagaData for T {}

/// What a step's action or compensation is given.
///
/// The [`idempotency_key`](Self::idempotency_key) is derived, not random
/// (`saga_id:step` for the action, `saga_id:undo:step` for the
/// compensation): after a crash, a timeout or a retry, the call is repeated
/// with the *same* key, so the service it calls can recognise the repeat and
/// not charge the card twice. Pass it on.
pub struct StepContext<D> {
    saga_id: Arc<str>,
    step: Arc<str>,
    idempotency_key: String,
    attempt: u32,
    data: Arc<Mutex<D>>,
}

impl<D> fmt::Debug for StepContext<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StepContext")
            .field("saga_id", &self.saga_id)
            .field("step", &self.step)
            .field("idempotency_key", &self.idempotency_key)
            .field("attempt", &self.attempt)
            .finish_non_exhaustive()
    }
}

impl<D: Clone> StepContext<D> {
    /// The saga's id.
    pub fn saga_id(&self) -> &str {
        &self.saga_id
    }

    /// The step's name.
    pub fn step(&self) -> &str {
        &self.step
    }

    /// The key to send with the call so the callee can deduplicate it:
    /// `saga_id:step`, or `saga_id:undo:step` for a compensation.
    pub fn idempotency_key(&self) -> &str {
        &self.idempotency_key
    }

    /// The idempotency key of the step's *action* (`saga_id:step`), also in
    /// a compensation: the key the compensation must leave a tombstone
    /// under. An action whose reply was lost may still be on its way (a
    /// retried request in a proxy, a queue): if it arrives after its undo,
    /// the dependency must refuse it, or the refund lands before the charge
    /// and the charge stays. So a compensation records "`action_key` is
    /// undone" in the same transaction as its effect (even when there was
    /// nothing to undo), and the action refuses a tombstoned key.
    pub fn action_key(&self) -> String {
        format!("{}:{}", self.saga_id, self.step)
    }

    /// Which attempt at this call this is (1 the first time).
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// A copy of the saga's data.
    pub fn data(&self) -> D {
        self.data.lock().clone()
    }

    /// Changes the saga's data (e.g. to record the payment id a later
    /// compensation needs). Kept only if the call succeeds, and persisted
    /// with the step's result.
    pub fn update(&self, f: impl FnOnce(&mut D)) {
        f(&mut self.data.lock());
    }
}

type StepFuture = Pin<Box<dyn Future<Output = Result<(), BoxError>> + Send>>;
type StepFn<D> = Arc<dyn Fn(StepContext<D>) -> StepFuture + Send + Sync>;

fn boxed<D, F, Fut, E>(f: F) -> StepFn<D>
where
    F: Fn(StepContext<D>) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: Into<BoxError>,
{
    Arc::new(move |ctx| {
        let fut = f(ctx);
        Box::pin(async move { fut.await.map_err(Into::into) })
    })
}

/// One step of a saga: an action, and optionally the compensation that
/// semantically undoes it (a refund for a capture, a release for a
/// reservation).
///
/// Errors are classified with [`keel_core::error::classify`]: wrap them in
/// [`Classified::retryable`] (did not take effect, try again) or
/// [`Classified::outcome_unknown`] (may have taken effect); a policy's
/// [`Rejected`](keel_core::Rejected) refusal (breaker open, bulkhead full,
/// budget empty) is not an attempt and waits its `Retry-After`; anything
/// else (permanent, or unclassified) is not retried. Both action and
/// compensation must be idempotent under their key: each can run more than
/// once.
///
/// An attempt of unknown outcome is remembered on the saga record: the
/// step is compensated if the saga turns back, even if later attempts fail
/// in ways that say nothing was done, because the first may have been.
/// The compensation must therefore tolerate an action that never happened,
/// and leave a tombstone under [`StepContext::action_key`] so a late
/// action is refused.
pub struct Step<D> {
    name: Arc<str>,
    action: StepFn<D>,
    compensation: Option<StepFn<D>>,
    timeout: Duration,
    max_attempts: u32,
}

impl<D> fmt::Debug for Step<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Step")
            .field("name", &self.name)
            .field("compensable", &self.compensation.is_some())
            .field("timeout", &self.timeout)
            .field("max_attempts", &self.max_attempts)
            .finish_non_exhaustive()
    }
}

impl<D: SagaData> Step<D> {
    /// A step named `name` (unique in its saga; no `:`) running `action`.
    pub fn new<F, Fut, E>(name: impl Into<String>, action: F) -> Self
    where
        F: Fn(StepContext<D>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<BoxError>,
    {
        Self {
            name: name.into().into(),
            action: boxed(action),
            compensation: None,
            timeout: DEFAULT_STEP_TIMEOUT,
            max_attempts: DEFAULT_MAX_ATTEMPTS,
        }
    }

    /// The compensation that undoes this step. It must tolerate being
    /// called for an action that never took effect (a timed-out action is
    /// compensated because it *may* have), and it must leave a tombstone
    /// under the action's key ([`StepContext::action_key`]) so that the
    /// dependency refuses the action if it arrives after its undo. It
    /// cannot count on what the action recorded with
    /// [`StepContext::update`]: an action that may have happened never
    /// reported, so find what to undo by the action's key.
    pub fn compensate_with<F, Fut, E>(mut self, compensation: F) -> Self
    where
        F: Fn(StepContext<D>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<BoxError>,
    {
        self.compensation = Some(boxed(compensation));
        self
    }

    /// How long one call (action or compensation) may take (default 30 s);
    /// a call that takes longer is cancelled and counts as a failure of
    /// unknown outcome.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Attempts before the saga gives up on this step and compensates
    /// (default 3; refusals by a policy do not count). Only for a step that
    /// can still turn back: once a pivot may have happened, and for every
    /// step after it, the saga retries forward for its
    /// [`forward_budget`](SagaDefinitionBuilder::forward_budget) instead.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }
}

/// A saga: named steps run in order, state persisted after every one.
/// Cheap to clone.
///
/// The **pivot** is the point of no return (in an order saga, scheduling
/// the shipment). Before it, a step that keeps failing makes the saga undo the
/// completed steps in reverse order; after it, there is no way back, so the
/// saga retries forward with backoff and is marked stuck for a human if it
/// keeps failing. The pivot itself has no compensation: once an attempt at
/// it may have happened (it timed out), it too only goes forward.
pub struct SagaDefinition<D> {
    inner: Arc<DefinitionInner<D>>,
}

impl<D> Clone for SagaDefinition<D> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<D> fmt::Debug for SagaDefinition<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SagaDefinition")
            .field("name", &self.inner.name)
            .field("steps", &self.inner.steps)
            .field("pivot", &self.inner.shape.pivot)
            .finish()
    }
}

struct DefinitionInner<D> {
    name: String,
    steps: Vec<Step<D>>,
    shape: Shape,
}

/// Builds a [`SagaDefinition`].
pub struct SagaDefinitionBuilder<D> {
    name: String,
    steps: Vec<Step<D>>,
    pivot: Option<usize>,
    problems: Vec<String>,
    backoff: Backoff,
    stuck_after: u32,
    forward_budget: Duration,
    refusal_wait: Duration,
    deadline: Option<Duration>,
}

impl<D> fmt::Debug for SagaDefinitionBuilder<D> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SagaDefinitionBuilder")
            .field("name", &self.name)
            .field("steps", &self.steps)
            .finish_non_exhaustive()
    }
}

impl<D: SagaData> SagaDefinition<D> {
    /// A builder for a saga kind named `name` (stored with every instance).
    pub fn builder(name: impl Into<String>) -> SagaDefinitionBuilder<D> {
        SagaDefinitionBuilder {
            name: name.into(),
            steps: Vec::new(),
            pivot: None,
            problems: Vec::new(),
            backoff: Backoff::default(),
            stuck_after: DEFAULT_STUCK_AFTER,
            forward_budget: DEFAULT_FORWARD_BUDGET,
            refusal_wait: DEFAULT_REFUSAL_WAIT,
            deadline: None,
        }
    }

    /// The saga kind's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// The step names, in order.
    pub fn step_names(&self) -> impl Iterator<Item = &str> {
        self.inner.steps.iter().map(|s| &*s.name)
    }

    /// The pivot step's index, if there is one.
    pub fn pivot(&self) -> Option<usize> {
        self.inner.shape.pivot
    }

    pub(crate) fn erased(&self) -> Arc<dyn ErasedSaga> {
        self.inner.clone()
    }
}

impl<D: SagaData> SagaDefinitionBuilder<D> {
    /// Appends a step.
    pub fn step(mut self, step: Step<D>) -> Self {
        self.steps.push(step);
        self
    }

    /// Appends the pivot step: the point of no return. It cannot have a
    /// compensation, and there is only one.
    pub fn pivot(mut self, step: Step<D>) -> Self {
        if self.pivot.is_some() {
            self.problems
                .push(format!("`{}`: a saga has at most one pivot", step.name));
        }
        if step.compensation.is_some() {
            self.problems.push(format!(
                "pivot `{}` has a compensation: the pivot is the point of no return, so nothing \
                 undoes it; remove the compensation or make it an ordinary step",
                step.name
            ));
        }
        self.pivot = Some(self.steps.len());
        self.steps.push(step);
        self
    }

    /// The delays between attempts (default: 200 ms doubling to 10 s, full
    /// jitter).
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// Attempts at a compensation before the saga is marked stuck (default
    /// 10; refusals by a policy do not count).
    pub fn stuck_after(mut self, attempts: u32) -> Self {
        self.stuck_after = attempts.max(1);
        self
    }

    /// How long the saga retries forward, with the same idempotency key,
    /// at a step after the pivot or at a pivot that may have happened,
    /// before it is marked stuck for an operator (default
    /// [`DEFAULT_FORWARD_BUDGET`], 10 minutes, from the step's first
    /// attempt). It is never compensated past the pivot.
    pub fn forward_budget(mut self, budget: Duration) -> Self {
        self.forward_budget = budget;
        self
    }

    /// The whole saga's deadline: the time it may take from its start,
    /// however its steps spend it (default: none). When it passes before
    /// the pivot, the saga compensates, with the reason in `last_error`.
    /// Before the pivot no call runs past it: a step does not start with
    /// less than 50 ms left, its timeout is cut to the time left, and a
    /// retry's backoff ends at the deadline. Past the pivot the saga cannot
    /// turn back, so the deadline no longer applies: forward recovery goes
    /// on within its [budget](Self::forward_budget).
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// How long to wait after a policy refused a call without naming a
    /// `Retry-After` (default [`DEFAULT_REFUSAL_WAIT`], 1 s).
    pub fn refusal_wait(mut self, wait: Duration) -> Self {
        self.refusal_wait = wait;
        self
    }

    /// The definition, or [`SagaError::Definition`] saying what is wrong.
    pub fn build(mut self) -> Result<SagaDefinition<D>, SagaError> {
        if self.name.is_empty() {
            self.problems.push("the saga needs a name".to_owned());
        }
        if self.steps.is_empty() {
            self.problems
                .push("the saga needs at least one step".to_owned());
        }
        for (i, step) in self.steps.iter().enumerate() {
            if step.name.is_empty() || step.name.contains(':') {
                self.problems.push(format!(
                    "step {i} is named `{}`: names must be non-empty and contain no `:` (they \
                     are part of idempotency keys)",
                    step.name
                ));
            }
            if self.steps[..i].iter().any(|s| s.name == step.name) {
                self.problems
                    .push(format!("two steps are named `{}`", step.name));
            }
            if step.timeout.is_zero() {
                self.problems
                    .push(format!("step `{}` has a zero timeout", step.name));
            }
        }
        if !self.problems.is_empty() {
            return Err(SagaError::Definition {
                saga: self.name,
                problems: self.problems.join("; "),
            });
        }
        let shape = Shape {
            steps: self
                .steps
                .iter()
                .map(|s| StepShape {
                    name: s.name.clone(),
                    timeout: s.timeout,
                    max_attempts: s.max_attempts,
                    compensable: s.compensation.is_some(),
                })
                .collect(),
            pivot: self.pivot,
            stuck_after: self.stuck_after,
            backoff: self.backoff,
            forward_budget: self.forward_budget,
            refusal_wait: self.refusal_wait,
            deadline: self.deadline,
        };
        Ok(SagaDefinition {
            inner: Arc::new(DefinitionInner {
                name: self.name,
                steps: self.steps,
                shape,
            }),
        })
    }
}

/// A saga definition with its data type erased, as the orchestrator holds
/// many of them.
pub(crate) trait ErasedSaga: Send + Sync {
    fn name(&self) -> &str;
    fn shape(&self) -> &Shape;
    /// Runs `call` for `record`; the saga's data afterwards.
    fn call(
        &self,
        call: Call,
        record: &SagaRecord,
        key: String,
    ) -> Pin<Box<dyn Future<Output = Result<Value, BoxError>> + Send>>;
}

impl<D: SagaData> ErasedSaga for DefinitionInner<D> {
    fn name(&self) -> &str {
        &self.name
    }

    fn shape(&self) -> &Shape {
        &self.shape
    }

    fn call(
        &self,
        call: Call,
        record: &SagaRecord,
        key: String,
    ) -> Pin<Box<dyn Future<Output = Result<Value, BoxError>> + Send>> {
        let (index, f) = match call {
            Call::Action(i) => (i, self.steps.get(i).map(|s| s.action.clone())),
            Call::Compensation(i) => (i, self.steps.get(i).and_then(|s| s.compensation.clone())),
        };
        let data: Result<D, _> = serde_json::from_value(record.data.clone());
        let step = self.steps.get(index).map(|s| s.name.clone());
        let saga_id: Arc<str> = record.id.as_str().into();
        let attempt = record.attempts;
        let kind = self.name.clone();
        Box::pin(async move {
            let (Some(f), Some(step)) = (f, step) else {
                return Err(Classified::permanent(format!(
                    "saga `{kind}` has no {call:?}: the stored saga does not match its definition"
                ))
                .into());
            };
            let data = data.map_err(|e| {
                Classified::permanent(format!(
                    "the stored data of saga `{saga_id}` does not match `{kind}`'s data type: {e}"
                ))
            })?;
            let data = Arc::new(Mutex::new(data));
            let ctx = StepContext {
                saga_id,
                step,
                idempotency_key: key,
                attempt,
                data: data.clone(),
            };
            f(ctx).await?;
            let data = data.lock().clone();
            Ok(serde_json::to_value(data).map_err(Classified::permanent)?)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noop() -> impl Fn(StepContext<()>) -> std::future::Ready<Result<(), BoxError>> + Send + Sync
    {
        |_| std::future::ready(Ok(()))
    }

    #[test]
    fn bad_definitions_are_refused_with_every_reason() {
        let err = SagaDefinition::<()>::builder("orders")
            .step(Step::new("pay", noop()))
            .step(Step::new("pay", noop()))
            .pivot(Step::new("ship:now", noop()).compensate_with(noop()))
            .pivot(Step::new("mail", noop()))
            .build()
            .unwrap_err()
            .to_string();
        for reason in [
            "two steps are named `pay`",
            "contain no `:`",
            "point of no return",
            "at most one pivot",
        ] {
            assert!(err.contains(reason), "{reason:?} missing from {err}");
        }
        assert!(SagaDefinition::<()>::builder("empty").build().is_err());
    }

    #[test]
    fn a_good_definition_knows_its_shape() {
        let def = SagaDefinition::<()>::builder("orders")
            .step(Step::new("pay", noop()).compensate_with(noop()))
            .pivot(Step::new("ship", noop()))
            .step(Step::new("mail", noop()))
            .build()
            .unwrap();
        assert_eq!(def.pivot(), Some(1));
        assert_eq!(
            def.step_names().collect::<Vec<_>>(),
            ["pay", "ship", "mail"]
        );
        assert!(def.erased().shape().steps[0].compensable);
    }
}
