//! The orchestrator: finds due sagas, makes their calls, saves each result
//! before the next call, and lets operators look and steer.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use keel_core::TraceParent;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tracing::Instrument;

use super::SagaError;
use super::definition::{ErasedSaga, SagaData, SagaDefinition};
use super::hook::{AfterCommit, SagaHook};
use super::machine::{self, Claim, Plan};
use started::{Claimed, Work};

mod call;
mod operator;
mod started;
use crate::store::{SagaRecord, SagaStatus, SagaStore, StoreError};
pub use operator::SagaView;
pub use started::StartedSaga;

/// How an orchestrator works through sagas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OrchestratorOptions {
    /// How often to look for due sagas when idle (default 500 ms).
    pub poll_interval: Duration,
    /// How many due sagas to load at once (default 32).
    pub batch: usize,
    /// How many sagas to drive at once (default 16).
    pub concurrency: usize,
    /// A claimed call's lease is its step's timeout plus this (default
    /// 5 s). When a process dies mid-call, its sagas become due again once
    /// their lease ends.
    pub lease_grace: Duration,
}

impl Default for OrchestratorOptions {
    fn default() -> Self {
        Self {
            poll_interval: Duration::from_millis(500),
            batch: 32,
            concurrency: 16,
            lease_grace: Duration::from_secs(5),
        }
    }
}

/// Builds a [`SagaOrchestrator`].
pub struct OrchestratorBuilder<S> {
    store: S,
    sagas: Vec<Arc<dyn ErasedSaga>>,
    hooks: Vec<Arc<dyn SagaHook<S>>>,
    options: OrchestratorOptions,
}

impl<S> std::fmt::Debug for OrchestratorBuilder<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<&str> = self.sagas.iter().map(|s| s.name()).collect();
        f.debug_struct("OrchestratorBuilder")
            .field("sagas", &names)
            .field("hooks", &self.hooks.len())
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl<S: SagaStore> OrchestratorBuilder<S> {
    /// Registers a saga definition.
    pub fn saga<D: SagaData>(mut self, definition: &SagaDefinition<D>) -> Self {
        self.sagas.push(definition.erased());
        self
    }

    /// Adds a hook that writes, in the transaction saving a saga's new
    /// status, what follows from it ([`SagaHook`]). Hooks run in the order
    /// added.
    pub fn hook(mut self, hook: impl SagaHook<S>) -> Self {
        self.hooks.push(Arc::new(hook));
        self
    }

    /// Replaces all options.
    pub fn options(mut self, options: OrchestratorOptions) -> Self {
        self.options = options;
        self
    }

    /// See [`OrchestratorOptions::poll_interval`].
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.options.poll_interval = interval;
        self
    }

    /// See [`OrchestratorOptions::concurrency`].
    pub fn concurrency(mut self, n: usize) -> Self {
        self.options.concurrency = n.max(1);
        self
    }

    /// See [`OrchestratorOptions::lease_grace`].
    pub fn lease_grace(mut self, grace: Duration) -> Self {
        self.options.lease_grace = grace;
        self
    }

    /// The orchestrator, or [`SagaError::DuplicateKind`].
    pub fn build(self) -> Result<SagaOrchestrator<S>, SagaError> {
        let mut sagas = HashMap::new();
        for saga in self.sagas {
            let kind = saga.name().to_owned();
            if sagas.insert(kind.clone(), saga).is_some() {
                return Err(SagaError::DuplicateKind { kind });
            }
        }
        Ok(SagaOrchestrator {
            inner: Arc::new(Inner {
                store: self.store,
                sagas,
                hooks: self.hooks,
                options: OrchestratorOptions {
                    batch: self.options.batch.max(1),
                    concurrency: self.options.concurrency.max(1),
                    ..self.options
                },
                wake: Notify::new(),
                started: Mutex::default(),
            }),
        })
    }
}

struct Inner<S> {
    store: S,
    sagas: HashMap<String, Arc<dyn ErasedSaga>>,
    hooks: Vec<Arc<dyn SagaHook<S>>>,
    options: OrchestratorOptions,
    wake: Notify,
    /// Sagas started with their first call claimed, committed, and not
    /// yet driven (see [`SagaOrchestrator::start_claimed`]).
    started: Mutex<VecDeque<Box<Claimed>>>,
}

/// Runs sagas: a cheap handle (clone it freely) over the store and the
/// registered definitions.
///
/// Every transition is saved before the next call is made, with an
/// optimistic version check, so several orchestrators can share a store and
/// any of them can crash between any two lines: the saga resumes from its
/// last saved state, repeating at most the call that was in flight, with
/// the same idempotency key.
pub struct SagaOrchestrator<S> {
    inner: Arc<Inner<S>>,
}

impl<S> Clone for SagaOrchestrator<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<S> std::fmt::Debug for SagaOrchestrator<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<&String> = self.inner.sagas.keys().collect();
        names.sort();
        f.debug_struct("SagaOrchestrator")
            .field("sagas", &names)
            .field("options", &self.inner.options)
            .finish_non_exhaustive()
    }
}

impl<S: SagaStore> SagaOrchestrator<S> {
    /// A builder over `store`.
    pub fn builder(store: S) -> OrchestratorBuilder<S> {
        OrchestratorBuilder {
            store,
            sagas: Vec::new(),
            hooks: Vec::new(),
            options: OrchestratorOptions::default(),
        }
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.inner.store
    }

    /// Starts a saga inside the caller's transaction (e.g. the inbox
    /// handler of the event that triggers it), so it exists if and only if
    /// that transaction commits. Derive `id` from the trigger (the order
    /// id): starting the same id twice is not an error and returns `false`.
    pub async fn start<D: SagaData>(
        &self,
        tx: &mut S::Tx,
        definition: &SagaDefinition<D>,
        id: &str,
        data: &D,
    ) -> Result<bool, SagaError> {
        let record = self.new_record(definition, id, data)?;
        self.insert(tx, &record).await
    }

    /// A new saga's first record: running, at its first step, due now.
    fn new_record<D: SagaData>(
        &self,
        definition: &SagaDefinition<D>,
        id: &str,
        data: &D,
    ) -> Result<SagaRecord, SagaError> {
        let kind = definition.name();
        if !self.inner.sagas.contains_key(kind) {
            return Err(SagaError::UnknownKind {
                kind: kind.to_owned(),
            });
        }
        let now = keel_core::clock::utc_now();
        Ok(SagaRecord {
            id: id.to_owned(),
            kind: kind.to_owned(),
            status: SagaStatus::Running,
            step: 0,
            data: serde_json::to_value(data).map_err(SagaError::Data)?,
            attempts: 0,
            outcome_unknown: false,
            first_attempt_at: None,
            last_error: None,
            next_attempt_at: now,
            created_at: now,
            updated_at: now,
            version: 1,
            traceparent: TraceParent::current().map(|t| t.to_string()),
        })
    }

    /// Inserts a new saga's `record` in `tx`; `false` if one with its id
    /// exists.
    async fn insert(&self, tx: &mut S::Tx, record: &SagaRecord) -> Result<bool, SagaError> {
        let created = self.inner.store.saga_insert(tx, record).await?;
        let (kind, id) = (&record.kind, &record.id);
        if created {
            metrics::counter!("keel_saga_started_total", "saga" => kind.clone()).increment(1);
            tracing::info!(saga = %kind, saga_id = %id, "saga started");
        } else {
            tracing::debug!(saga = %kind, saga_id = %id, "saga already exists");
        }
        Ok(created)
    }

    /// Wakes the run loop to look for due sagas now (e.g. after committing
    /// a transaction that started one).
    pub fn notify(&self) {
        self.inner.wake.notify_one();
    }

    /// Drives due sagas until `shutdown` completes; then lets the calls in
    /// flight finish (each within its step timeout), saves their outcome,
    /// and returns. Sagas interrupted harder than that resume after their
    /// lease, here or in another process.
    pub async fn run(&self, shutdown: impl Future<Output = ()> + Send) {
        tokio::pin!(shutdown);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let in_flight: Arc<Mutex<HashSet<String>>> = Arc::default();
        let mut tasks = JoinSet::new();
        tracing::info!(sagas = self.inner.sagas.len(), "saga orchestrator running");
        let spawn = |tasks: &mut JoinSet<()>, work: Work| {
            if !in_flight.lock().insert(work.id().to_owned()) {
                return;
            }
            let this = self.clone();
            let stop = stop.clone();
            let in_flight = in_flight.clone();
            tasks.spawn(async move {
                let id = work.id().to_owned();
                this.drive_logged(work, &stop).await;
                in_flight.lock().remove(&id);
            });
        };
        loop {
            while let Some(done) = tasks.try_join_next() {
                log_join(done);
            }
            let mut free = self.inner.options.concurrency.saturating_sub(tasks.len());
            while free > 0 {
                let Some(started) = self.inner.started.lock().pop_front() else {
                    break;
                };
                spawn(&mut tasks, Work::Started(started));
                free -= 1;
            }
            if free > 0 {
                let limit = free.min(self.inner.options.batch);
                match self
                    .inner
                    .store
                    .saga_due(&self.kinds(), keel_core::clock::utc_now(), limit)
                    .await
                {
                    Ok(due) => due
                        .into_iter()
                        .for_each(|record| spawn(&mut tasks, Work::Due(record))),
                    Err(e) => tracing::warn!(error = %e, "could not load due sagas"),
                }
            }
            tokio::select! {
                () = &mut shutdown => break,
                () = self.inner.wake.notified() => {}
                () = tokio::time::sleep(self.inner.options.poll_interval) => {}
                Some(done) = tasks.join_next(), if !tasks.is_empty() => log_join(done),
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Release);
        while let Some(done) = tasks.join_next().await {
            log_join(done);
        }
        tracing::info!("saga orchestrator stopped");
    }

    /// Drives every saga handed over by [`committed`](Self::committed) and
    /// every saga that is due now, one after the other, as far as each
    /// goes; returns how many it looked at. A saga that fails to move
    /// (a store error) is logged and left for the next tick. For tests and
    /// for cron-style use without [`run`](Self::run).
    pub async fn tick(&self) -> Result<usize, SagaError> {
        let never = std::sync::atomic::AtomicBool::new(false);
        let started: Vec<_> = self.inner.started.lock().drain(..).collect();
        let mut n = started.len();
        for started in started {
            self.drive_logged(Work::Started(started), &never).await;
        }
        let due = self
            .inner
            .store
            .saga_due(
                &self.kinds(),
                keel_core::clock::utc_now(),
                self.inner.options.batch,
            )
            .await?;
        n += due.len();
        for record in due {
            self.drive_logged(Work::Due(record), &never).await;
        }
        Ok(n)
    }

    /// [`drive_work`](Self::drive_work), logging a saga that an error
    /// stopped: it resumes when due again.
    async fn drive_logged(&self, work: Work, stop: &std::sync::atomic::AtomicBool) {
        let id = work.id().to_owned();
        if let Err(e) = self.drive_work(work, stop).await {
            tracing::warn!(saga_id = %id, error = %e, "saga paused by an error; it resumes when due again");
        }
    }

    /// Drives one saga as far as it goes now (until it finishes, is stuck,
    /// or waits for a backoff); returns it as saved.
    pub async fn drive(&self, id: &str) -> Result<SagaRecord, SagaError> {
        let record = self.load(id).await?;
        let never = std::sync::atomic::AtomicBool::new(false);
        self.drive_record(record, &never).await
    }

    async fn load(&self, id: &str) -> Result<SagaRecord, SagaError> {
        self.inner
            .store
            .saga_get(id)
            .await?
            .ok_or_else(|| SagaError::NotFound { id: id.to_owned() })
    }

    /// The saga kinds this orchestrator runs: the only ones it picks up.
    fn kinds(&self) -> Vec<&str> {
        self.inner.sagas.keys().map(String::as_str).collect()
    }

    fn saga(&self, kind: &str) -> Result<Arc<dyn ErasedSaga>, SagaError> {
        self.inner
            .sagas
            .get(kind)
            .cloned()
            .ok_or_else(|| SagaError::UnknownKind {
                kind: kind.to_owned(),
            })
    }

    /// Runs `record` forward until it is idle, finished, or lost to another
    /// writer; returns it as last saved.
    ///
    /// A call's result that leaves the status as it was is not saved on its
    /// own: it goes out with the next call's claim, in the one save that
    /// must precede that call anyway (a step costs one save, not two). A
    /// crash before that save repeats the call with the same key, as a
    /// crash right after the call always could. A change of status is
    /// saved at once, so that hooks see every one.
    async fn drive_record(
        &self,
        record: SagaRecord,
        stop: &std::sync::atomic::AtomicBool,
    ) -> Result<SagaRecord, SagaError> {
        self.drive_from(record, None, stop).await
    }

    /// Drives `work`: a due saga as [`drive_record`](Self::drive_record)
    /// does, a started one from its claimed first call while its lease has
    /// time for the call, else (the run loop fell behind) from its
    /// unclaimed record, claiming anew.
    async fn drive_work(
        &self,
        work: Work,
        stop: &std::sync::atomic::AtomicBool,
    ) -> Result<SagaRecord, SagaError> {
        match work {
            Work::Due(record) => self.drive_record(record, stop).await,
            Work::Started(started) => {
                let Claimed { claim, unclaimed } = *started;
                let claimed_at = claim.record.updated_at;
                let fresh = keel_core::clock::utc_now() - claimed_at
                    < chrono::TimeDelta::from_std(self.inner.options.lease_grace / 2)
                        .unwrap_or(chrono::TimeDelta::MAX);
                if fresh {
                    self.drive_from(claim.record.clone(), Some(claim), stop)
                        .await
                } else {
                    self.drive_from(unclaimed, None, stop).await
                }
            }
        }
    }

    /// Runs `saved` (as stored) forward, making `claimed`'s call first if
    /// given (its claim is `saved`).
    async fn drive_from(
        &self,
        saved: SagaRecord,
        mut claimed: Option<Claim>,
        stop: &std::sync::atomic::AtomicBool,
    ) -> Result<SagaRecord, SagaError> {
        let saga = self.saga(&saved.kind)?;
        let span = tracing::info_span!("saga", saga = %saved.kind, saga_id = %saved.id);
        async move {
            let grace = self.inner.options.lease_grace;
            let mut saved = saved;
            let mut record = saved.clone();
            loop {
                if let Some(claim) = claimed.take() {
                    record = self.call(saga.as_ref(), &claim).await?;
                } else {
                    if stop.load(std::sync::atomic::Ordering::Acquire) {
                        break;
                    }
                    let now = keel_core::clock::utc_now();
                    match machine::plan(&record, saga.shape(), now, grace) {
                        Plan::Idle => break,
                        Plan::Save(next) => record = machine::rebase(next, &saved),
                        Plan::Call(mut claim) => {
                            claim.record = machine::rebase(claim.record, &saved);
                            if !self.save(&saved, &claim.record).await? {
                                return Ok(saved);
                            }
                            saved = claim.record.clone();
                            claimed = Some(claim);
                            continue;
                        }
                    }
                }
                if record.status != saved.status && !self.catch_up(&mut saved, &record).await? {
                    return Ok(saved);
                }
            }
            self.catch_up(&mut saved, &record).await?;
            Ok(saved)
        }
        .instrument(span)
        .await
    }

    /// Saves `record` over `saved` if it is ahead; `false` if someone else
    /// saved first.
    async fn catch_up(
        &self,
        saved: &mut SagaRecord,
        record: &SagaRecord,
    ) -> Result<bool, SagaError> {
        if record.version == saved.version {
            return Ok(true);
        }
        if !self.save(saved, record).await? {
            return Ok(false);
        }
        *saved = record.clone();
        Ok(true)
    }

    /// Saves `next` over `prev`; `false` (and a log line) if someone else
    /// saved first.
    async fn save(&self, prev: &SagaRecord, next: &SagaRecord) -> Result<bool, SagaError> {
        let hooked = prev.status != next.status && !self.inner.hooks.is_empty();
        let saved = if hooked {
            // What a hook writes (a webhook, an event) joins the story of
            // what started the saga.
            let started_in = next.traceparent.as_deref().and_then(|t| t.parse().ok());
            let hooks = self.save_with_hooks(prev, next);
            match started_in {
                Some(trace) => TraceParent::scope(trace, hooks).await?,
                None => hooks.await?,
            }
        } else {
            self.inner.store.saga_save(next).await?
        };
        if !saved {
            tracing::info!(saga_id = %next.id, "saga changed by someone else (another orchestrator or an operator); leaving it to them");
            return Ok(false);
        }
        if prev.status != next.status {
            let status = next.status.as_str();
            tracing::info!(
                from = prev.status.as_str(),
                to = status,
                step = next.step,
                "saga status changed"
            );
            if next.status.is_terminal() || next.status == SagaStatus::Stuck {
                metrics::counter!("keel_saga_total", "saga" => next.kind.clone(), "status" => status)
                    .increment(1);
            }
            if next.status == SagaStatus::Stuck {
                tracing::error!(saga = %next.kind, saga_id = %next.id, error = ?next.last_error, "saga stuck: an operator must retry or fix it");
            }
        }
        Ok(true)
    }

    /// Saves `next` and runs the hooks in one transaction; their
    /// after-commit work runs once it committed (or may have).
    async fn save_with_hooks(
        &self,
        prev: &SagaRecord,
        next: &SagaRecord,
    ) -> Result<bool, StoreError> {
        let store = &self.inner.store;
        let mut tx = store.begin().await?;
        let mut after = Vec::with_capacity(self.inner.hooks.len());
        let written = async {
            if !store.saga_save_in(&mut tx, next).await? {
                return Ok(false);
            }
            for hook in &self.inner.hooks {
                after.push(hook.status_changed(&mut tx, prev, next).await?);
            }
            Ok(true)
        }
        .await;
        if !matches!(written, Ok(true)) {
            if let Err(err) = store.rollback(tx).await {
                tracing::debug!(error = %err, "rolling back a saga save failed; the connection drops it");
            }
            return written;
        }
        let committed = store.commit(tx).await;
        if matches!(committed, Ok(()) | Err(StoreError::OutcomeUnknown(_))) {
            after.into_iter().for_each(AfterCommit::run);
        }
        committed.map(|()| true)
    }
}

fn log_join(done: Result<(), tokio::task::JoinError>) {
    if let Err(e) = done {
        tracing::error!(error = %e, "a saga task panicked; the saga resumes after its lease");
    }
}
