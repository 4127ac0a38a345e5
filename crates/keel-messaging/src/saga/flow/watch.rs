//! [`FlowWatch`]: the deadline keeper of choreographed flows.

use std::future::Future;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde_json::json;

use super::{
    CORRELATION_ID, FLOW_EXPIRED, Flow, FlowError, FlowState, Flows, PARKED, delta, state_of,
};
use crate::envelope::Envelope;
use crate::outbox::Outbox;
use crate::store::{OutboxStore, SagaRecord, SagaStatus, SagaStore, StoreError};

/// Builds a [`FlowWatch`].
pub struct FlowWatchBuilder<S> {
    store: S,
    outbox: Outbox<S>,
    source: String,
    topic: String,
    flows: Flows,
    poll_interval: Duration,
    batch: usize,
}

impl<S> std::fmt::Debug for FlowWatchBuilder<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowWatchBuilder")
            .field("topic", &self.topic)
            .field("flows", &self.flows.keys())
            .finish_non_exhaustive()
    }
}

impl<S> std::fmt::Debug for FlowWatch<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlowWatch")
            .field("topic", &self.topic)
            .field("flows", &self.flows.keys())
            .finish_non_exhaustive()
    }
}

impl<S: OutboxStore + SagaStore> FlowWatchBuilder<S> {
    /// Keeps `flow`'s deadlines.
    pub fn flow(mut self, flow: &Flow) -> Self {
        self.flows.insert(flow.name().to_owned(), flow.clone());
        self
    }

    /// How often [`run`](FlowWatch::run) looks for expired flows (default
    /// 1 s).
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// The watch.
    pub fn build(self) -> FlowWatch<S> {
        FlowWatch {
            store: self.store,
            outbox: self.outbox,
            source: self.source,
            topic: self.topic,
            flows: self.flows,
            poll_interval: self.poll_interval,
            batch: self.batch,
        }
    }
}

/// Finds the choreographed flows past their deadline and turns them back:
/// emits [`FLOW_EXPIRED`] to the flows' topic and marks them
/// `compensating`, or `stuck` when there is nothing to undo or the undo is
/// not confirmed in time. Run one per service (several are safe: saves are
/// optimistic, and the event's id is derived from the flow, so a repeat is
/// deduped).
pub struct FlowWatch<S> {
    store: S,
    outbox: Outbox<S>,
    source: String,
    topic: String,
    flows: Flows,
    poll_interval: Duration,
    batch: usize,
}

impl<S: OutboxStore + SagaStore> FlowWatch<S> {
    /// A watch over `store` that emits from `source` to `topic` through
    /// `outbox` (the store's own).
    pub fn builder(
        store: S,
        outbox: Outbox<S>,
        source: impl Into<String>,
        topic: impl Into<String>,
    ) -> FlowWatchBuilder<S> {
        FlowWatchBuilder {
            store,
            outbox,
            source: source.into(),
            topic: topic.into(),
            flows: Flows::new(),
            poll_interval: Duration::from_secs(1),
            batch: 100,
        }
    }

    /// Handles every flow that is due now; returns how many it moved.
    pub async fn tick(&self) -> Result<usize, FlowError> {
        let kinds: Vec<&str> = self.flows.keys().map(String::as_str).collect();
        let now = keel_core::clock::utc_now();
        let due = self.store.saga_due(&kinds, now, self.batch).await?;
        let mut moved = 0;
        for record in due {
            match self.expire(record, now).await {
                Ok(true) => moved += 1,
                Ok(false) => {}
                Err(error) => tracing::warn!(%error, "could not expire a flow; retrying later"),
            }
        }
        Ok(moved)
    }

    /// Ticks every poll interval until `shutdown`.
    pub async fn run(&self, shutdown: impl Future<Output = ()> + Send) {
        tokio::pin!(shutdown);
        loop {
            if let Err(error) = self.tick().await {
                tracing::warn!(%error, "the flow watch could not read due flows");
            }
            tokio::select! {
                () = &mut shutdown => break,
                () = tokio::time::sleep(self.poll_interval) => {}
            }
        }
    }

    /// Moves one due flow on; `false` when someone else saved it first.
    async fn expire(&self, mut record: SagaRecord, now: DateTime<Utc>) -> Result<bool, FlowError> {
        let Some(flow) = self.flows.get(&record.kind) else {
            return Ok(false);
        };
        let state = state_of(&record)?;
        let undo = flow.to_undo(&state);
        let last = flow
            .step_name(record.step.saturating_sub(1) as usize)
            .to_owned();
        let mut tx = self.store.begin().await?;
        match record.status {
            SagaStatus::Running if undo.is_empty() => park(
                &mut record,
                format!(
                    "flow deadline of {:?} passed after step {last}, with nothing to undo: an \
                     operator decides",
                    flow.inner.deadline
                ),
                now,
            ),
            SagaStatus::Running => {
                let event = self.expired_event(flow, &record, &state, &undo, &last)?;
                self.outbox
                    .append(&mut tx, &self.topic, &event)
                    .await
                    .map_err(StoreError::other)?;
                record.status = SagaStatus::Compensating;
                record.last_error = Some(format!(
                    "flow deadline of {:?} passed after step {last}: asked to undo {}",
                    flow.inner.deadline,
                    undo.join(", ")
                ));
                record.next_attempt_at = now + delta(flow.inner.compensation_deadline);
            }
            SagaStatus::Compensating => park(
                &mut record,
                format!(
                    "undo not confirmed within {:?} for {}: an operator must check them",
                    flow.inner.compensation_deadline,
                    undo.join(", ")
                ),
                now,
            ),
            _ => return Ok(false),
        }
        record.updated_at = now;
        record.version += 1;
        if !self.store.saga_save_in(&mut tx, &record).await? {
            self.store.rollback(tx).await?;
            return Ok(false);
        }
        self.store.commit(tx).await?;
        metrics::counter!("keel_flow_expired_total", "flow" => record.kind.clone(),
            "status" => record.status.as_str())
        .increment(1);
        tracing::warn!(flow = %record.kind, id = %record.id, status = record.status.as_str(),
            reason = ?record.last_error, "choreographed flow expired");
        Ok(true)
    }

    fn expired_event(
        &self,
        flow: &Flow,
        record: &SagaRecord,
        state: &FlowState,
        undo: &[String],
        last: &str,
    ) -> Result<Envelope, FlowError> {
        let mut event = Envelope::new(self.source.clone(), FLOW_EXPIRED);
        event.id = format!("{}:expired", record.id);
        event.subject = Some(state.correlation_id.clone());
        event.data = Some(json!({
            "flow": flow.name(),
            "correlationId": state.correlation_id,
            "lastStep": last,
            "reached": state.reached,
            "undo": undo,
        }));
        event.extensions.insert(
            CORRELATION_ID.to_owned(),
            serde_json::Value::String(state.correlation_id.clone()),
        );
        event.validate().map_err(StoreError::other)?;
        Ok(event)
    }
}

/// Stuck, for an operator, with `reason`.
fn park(record: &mut SagaRecord, reason: String, now: DateTime<Utc>) {
    record.status = SagaStatus::Stuck;
    record.last_error = Some(reason);
    record.next_attempt_at = now + PARKED;
}
