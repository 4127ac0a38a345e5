//! Starting a saga with its first call already claimed, so that its first
//! step costs no save of its own.

use super::{SagaOrchestrator, SagaRecord};
use crate::saga::SagaError;
use crate::saga::definition::{SagaData, SagaDefinition};
use crate::saga::machine::{self, Claim, Plan};
use crate::store::SagaStore;

/// How many committed starts may wait for the run loop; past it a start
/// is left to its lease (it resumes when the lease ends), so a run loop
/// that is not running cannot make the queue grow without bound.
const MAX_WAITING: usize = 4_096;

/// A saga [`SagaOrchestrator::start_claimed`] inserted: give it to
/// [`SagaOrchestrator::committed`] once the transaction that started it
/// committed (for a consumer's handler,
/// [`DeliveryInfo::on_commit`](crate::consumer::DeliveryInfo::on_commit)).
#[derive(Debug)]
#[must_use = "give it to `SagaOrchestrator::committed` after the commit, or the saga waits for its lease"]
pub struct StartedSaga {
    /// The first call's claim, as inserted, and the record as it would
    /// have been without it; `None` when nothing was claimed (the saga
    /// existed already, or its first move is not a call).
    claimed: Option<(Claim, SagaRecord)>,
    created: bool,
}

impl StartedSaga {
    /// Whether this start created the saga (`false`: it existed).
    pub fn created(&self) -> bool {
        self.created
    }
}

/// A committed start waiting for the run loop: its first call's claim,
/// as stored, and the record as it would be without the claim.
#[derive(Debug)]
pub(super) struct Claimed {
    pub(super) claim: Claim,
    pub(super) unclaimed: SagaRecord,
}

/// What a run-loop task drives.
pub(super) enum Work {
    /// A saga the store says is due.
    Due(SagaRecord),
    /// A saga started here with its first call claimed.
    Started(Box<Claimed>),
}

impl Work {
    pub(super) fn id(&self) -> &str {
        match self {
            Self::Due(record) => &record.id,
            Self::Started(started) => &started.claim.record.id,
        }
    }
}

impl<S: SagaStore> SagaOrchestrator<S> {
    /// [`start`](Self::start), with the first step's call claimed in the
    /// same insert: the saga is stored as the run loop would save it just
    /// before that call (attempt counted, lease taken, step marked as
    /// maybe applied), so the first step costs no save of its own.
    ///
    /// Give the result to [`committed`](Self::committed) once `tx` has
    /// committed, and only then: the call must not be made for a saga whose
    /// transaction may still roll back. If that never happens (the process
    /// stops, the commit's outcome is unknown), the saga is due when the
    /// claim's lease ends (the step's timeout plus the lease grace), as
    /// after a crash during a call, and the attempt counts.
    pub async fn start_claimed<D: SagaData>(
        &self,
        tx: &mut S::Tx,
        definition: &SagaDefinition<D>,
        id: &str,
        data: &D,
    ) -> Result<StartedSaga, SagaError> {
        let record = self.new_record(definition, id, data)?;
        let saga = self.saga(&record.kind)?;
        let grace = self.inner.options.lease_grace;
        let Plan::Call(mut claim) = machine::plan(&record, saga.shape(), record.created_at, grace)
        else {
            let created = self.insert(tx, &record).await?;
            return Ok(StartedSaga {
                claimed: None,
                created,
            });
        };
        claim.record.version = record.version;
        let created = self.insert(tx, &claim.record).await?;
        Ok(StartedSaga {
            claimed: created.then_some((claim, record)),
            created,
        })
    }

    /// Hands a saga [`start_claimed`](Self::start_claimed) inserted to the
    /// run loop (or the next [`tick`](Self::tick)), now that the
    /// transaction that started it committed, and wakes it.
    pub fn committed(&self, started: StartedSaga) {
        if let Some((claim, unclaimed)) = started.claimed {
            let mut waiting = self.inner.started.lock();
            if waiting.len() < MAX_WAITING {
                waiting.push_back(Box::new(Claimed { claim, unclaimed }));
            } else {
                tracing::debug!(saga_id = %claim.record.id, "too many started sagas waiting; this one resumes when its lease ends");
            }
        }
        self.notify();
    }
}
