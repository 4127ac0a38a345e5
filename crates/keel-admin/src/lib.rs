//! The admin API: JSON over HTTP for the operator's levers — dead letters,
//! sagas, webhook deliveries, circuit breakers and lag — behind a token.
//!
//! Keel's messaging crate already has the operations ([`DeadLetters`], the
//! outbox's parked rows, [`SagaOrchestrator`], the webhook log); this crate
//! puts them on the network so that the operator console (the `console`
//! module, feature `console`) and the `keel` CLI are two views of one API,
//! and every error an operator can cause (an unknown id, a retry of a
//! finished saga, a malformed filter, a missing token) comes
//! back as problem+json with the status that says what happened.
//!
//! Each capability is a section of the router: the messaging tables' always,
//! the webhook deliveries' with the `webhooks` feature, which is also what
//! makes keel-webhooks a dependency and [`AdminStore`] ask for the
//! webhook tables. A service without webhooks builds neither.
//!
//! ```text
//! POST   /admin/api/session                      a session and its CSRF token
//! DELETE /admin/api/session                      ends it
//! GET  /admin/api/summary                          counts at a glance
//! GET  /admin/api/dead-letters?topic=&kind=&status=&limit=
//! POST /admin/api/dead-letters/replay-matching?topic=&kind=&limit=
//! GET  /admin/api/dead-letters/{id}                with the error history
//! POST /admin/api/dead-letters/{id}/replay         back to its topic via the outbox
//! POST /admin/api/dead-letters/{id}/discard
//! GET  /admin/api/outbox/parked?topic=&limit=      rows the broker refused for good
//! GET  /admin/api/outbox/parked/{id}
//! POST /admin/api/outbox/parked/{id}/replay        published again, before its key
//! POST /admin/api/outbox/parked/{id}/discard       deleted; frees its key
//! GET  /admin/api/sagas?status=&idle_secs=&limit=
//! GET  /admin/api/sagas/{id}
//! POST /admin/api/sagas/{id}/retry                 a stuck saga, now
//! POST /admin/api/sagas/{id}/cancel                before its pivot
//! GET  /admin/api/webhook-deliveries?endpoint=&status=&event=&before=&limit=  (feature `webhooks`)
//! GET  /admin/api/webhook-deliveries/{id}          with the attempt log
//! POST /admin/api/webhook-deliveries/{id}/resend
//! GET  /admin/api/breakers
//! GET  /admin/api/lag                              outbox backlog and gauges
//! GET  /admin/api/history?resolution=&kind=&name=  what changed: the last 15 min or 24 h
//! ```
//!
//! ```no_run
//! # async fn demo(store: keel_sqlite::store::SqliteStore) -> Result<(), Box<dyn std::error::Error>> {
//! use keel_admin::{Admin, AdminToken};
//!
//! let addr: std::net::SocketAddr = "127.0.0.1:8080".parse()?;
//! let token = AdminToken::require_for(addr, std::env::var("KEEL_ADMIN_TOKEN").ok())?;
//! let admin = Admin::builder(store).token(token).build();
//! let app = axum::Router::new().merge(admin.router());
//! # let _ = app; Ok(()) }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
mod access;
mod auth;
mod builder;
mod error;
pub mod export;
mod gauges;
pub mod history;
mod model;
mod query;
mod routes;
mod session;

#[cfg(feature = "console")]
pub mod console;
#[cfg(feature = "webhooks")]
mod webhooks;

use std::collections::BTreeMap;
use std::sync::Arc;

use chrono::Utc;
use keel_messaging::dead_letter::DeadLetters;
use keel_messaging::outbox::Outbox;
use keel_messaging::saga::{SagaOrchestrator, SagaView};
use keel_policy::breaker::{BreakerRegistry, State};
use keel_store::MessagingStore;
use keel_store::SagaRecord;
#[cfg(feature = "webhooks")]
use keel_store::WebhookStore;

#[cfg(feature = "webhooks")]
use keel_webhooks::Endpoints;

pub use access::{AdminAccess, AdminAuth, AdminAuthLayer, CSRF_FIELD, CSRF_HEADER, SESSION_COOKIE};
pub use auth::{AdminToken, AdminTokenError, MIN_TOKEN_LEN, cookie};
pub use builder::AdminBuilder;
pub use error::AdminError;
pub use export::{DEFAULT_EXPORT_INTERVAL, GaugeExport};
pub use gauges::{BrokerLag, FnGauges, Gauge, GaugeSource};
pub use model::{
    ActionJson, AttemptJson, BreakerJson, DeadLetterJson, LagJson, Listing, OutboxLagJson,
    PAYLOAD_PREVIEW, ParkedJson, SagaJson, SummaryJson,
};
#[cfg(feature = "webhooks")]
pub use model::{DeliveryAttemptJson, DeliveryJson};
#[cfg(feature = "webhooks")]
pub use query::DeliveryQuery;
pub use query::{DEFAULT_LIMIT, DeadLetterQuery, MAX_LIMIT, ParkedQuery, SagaQuery};
pub use session::{AdminSession, DEFAULT_SESSION_TTL, Notice, Sessions};

/// The path prefix of every admin API route.
pub const API_PREFIX: &str = "/admin/api";

struct Inner<S> {
    store: S,
    access: AdminAccess,
    dead_letters: DeadLetters<S>,
    outbox: Outbox<S>,
    #[cfg(feature = "webhooks")]
    endpoints: Endpoints<S>,
    sagas: Option<SagaOrchestrator<S>>,
    breakers: Option<BreakerRegistry>,
    gauges: Vec<Arc<dyn GaugeSource>>,
    history: Option<history::History>,
}

/// What the admin API and the console read and repair: every messaging
/// table and the webhooks'. Implemented for every store that has them.
#[cfg(feature = "webhooks")]
pub trait AdminStore: MessagingStore + WebhookStore {}

#[cfg(feature = "webhooks")]
impl<S: MessagingStore + WebhookStore> AdminStore for S {}

/// What the admin API and the console read and repair: every messaging
/// table. Implemented for every store that has them.
#[cfg(not(feature = "webhooks"))]
pub trait AdminStore: MessagingStore {}

#[cfg(not(feature = "webhooks"))]
impl<S: MessagingStore> AdminStore for S {}

/// The admin operations over a store, and their HTTP API
/// ([`router`](Self::router)). Cheap to clone. The operations are public
/// so other front ends (the console) call exactly the same code.
pub struct Admin<S> {
    inner: Arc<Inner<S>>,
}

impl<S> Clone for Admin<S> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
        }
    }
}

impl<S> std::fmt::Debug for Admin<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Admin")
            .field("access", &self.inner.access)
            .field("sagas", &self.inner.sagas.is_some())
            .finish_non_exhaustive()
    }
}

impl<S> Admin<S>
where
    S: AdminStore,
{
    /// A builder over `store` (see [`AdminBuilder`] for the defaults).
    pub fn builder(store: S) -> AdminBuilder<S> {
        AdminBuilder::new(store)
    }

    /// The storage-backed gauges (dead letters, sagas, outbox, webhook
    /// endpoints, every registered [`GaugeSource`]) for Prometheus, read
    /// on a schedule: spawn its [`run`](GaugeExport::run).
    pub fn gauge_export(&self) -> GaugeExport<S> {
        GaugeExport::new(self.clone())
    }

    /// The token this admin demands.
    pub fn token(&self) -> &AdminToken {
        self.inner.access.token()
    }

    /// Who may use this admin: token, sessions, hosts, throttle.
    pub fn access(&self) -> &AdminAccess {
        &self.inner.access
    }

    /// The layer that admits requests to the JSON API (`401` problems).
    pub fn auth_layer(&self) -> AdminAuthLayer {
        self.inner.access.api_layer()
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.inner.store
    }

    /// Dead letters matching `query`, oldest first, payloads cut.
    pub async fn dead_letters(
        &self,
        query: &DeadLetterQuery,
    ) -> Result<Vec<DeadLetterJson>, AdminError> {
        let filter = query.filter()?;
        let letters = self.inner.dead_letters.list(&filter).await?;
        Ok(letters
            .iter()
            .map(|l| DeadLetterJson::new(l, true))
            .collect())
    }

    /// One dead letter with its whole error history and payload.
    pub async fn dead_letter(&self, id: &str) -> Result<DeadLetterJson, AdminError> {
        let letter = self
            .inner
            .dead_letters
            .inspect(id)
            .await?
            .ok_or_else(|| AdminError::NotFound(format!("no dead letter with id `{id}`")))?;
        let later = self
            .inner
            .store
            .failure_history(&letter.group, &letter.message.id)
            .await?;
        let mut json = DeadLetterJson::new(&letter, false);
        json.later_failures = later.iter().map(AttemptJson::from).collect();
        Ok(json)
    }

    /// Replays one pending dead letter through the outbox.
    pub async fn replay_dead_letter(&self, id: &str) -> Result<ActionJson, AdminError> {
        self.inner.dead_letters.replay(id).await?;
        Ok(action("replayed", id, 1))
    }

    /// Replays the pending dead letters matching `query` (oldest first, at
    /// most its limit); returns how many.
    pub async fn replay_dead_letters(
        &self,
        query: &DeadLetterQuery,
    ) -> Result<ActionJson, AdminError> {
        let filter = query.filter()?;
        let n = self.inner.dead_letters.replay_many(&filter).await?;
        Ok(action("replayed", &query.describe(), n as u64))
    }

    /// Discards one pending dead letter.
    pub async fn discard_dead_letter(&self, id: &str) -> Result<ActionJson, AdminError> {
        self.inner.dead_letters.discard(id).await?;
        Ok(action("discarded", id, 1))
    }

    /// Pending dead letters by error kind.
    pub async fn dead_letter_counts(&self) -> Result<BTreeMap<String, u64>, AdminError> {
        Ok(self
            .inner
            .dead_letters
            .counts()
            .await?
            .into_iter()
            .collect())
    }

    /// Parked outbox rows matching `query`, lowest id first, payloads cut.
    pub async fn parked_outbox(&self, query: &ParkedQuery) -> Result<Vec<ParkedJson>, AdminError> {
        let filter = query.filter()?;
        let rows = self.inner.store.outbox_parked(&filter).await?;
        Ok(rows.iter().map(|r| ParkedJson::new(r, true)).collect())
    }

    /// One parked outbox row with its whole payload.
    pub async fn parked_outbox_row(&self, id: &str) -> Result<ParkedJson, AdminError> {
        let number = outbox_id(id)?;
        let row = self
            .inner
            .store
            .outbox_parked_get(number)
            .await?
            .ok_or_else(|| not_parked(number))?;
        Ok(ParkedJson::new(&row, false))
    }

    /// Replays a parked outbox row: the relay publishes it again (woken
    /// now), still before the later events of its key. Replay after fixing
    /// what the broker refused (its limit, say), or it is parked again.
    pub async fn replay_parked(&self, id: &str) -> Result<ActionJson, AdminError> {
        let number = outbox_id(id)?;
        if !self.inner.store.outbox_unpark(number).await? {
            return Err(not_parked(number));
        }
        self.inner.outbox.notify();
        tracing::info!(id = number, "parked outbox row replayed by an operator");
        Ok(action("replayed", id, 1))
    }

    /// Discards a parked outbox row for good, freeing its key.
    pub async fn discard_parked(&self, id: &str) -> Result<ActionJson, AdminError> {
        let number = outbox_id(id)?;
        if !self.inner.store.outbox_discard(number).await? {
            return Err(not_parked(number));
        }
        self.inner.outbox.notify();
        tracing::warn!(id = number, "parked outbox row discarded by an operator");
        Ok(action("discarded", id, 1))
    }

    /// Sagas matching `query`, oldest update first.
    pub async fn sagas(&self, query: &SagaQuery) -> Result<Vec<SagaJson>, AdminError> {
        let filter = query.filter()?;
        let views = match &self.inner.sagas {
            Some(orchestrator) => orchestrator.list(&filter).await?,
            None => {
                let now = keel_core::clock::utc_now();
                let records = self.inner.store.saga_list(&filter).await?;
                records.into_iter().map(|r| bare_view(r, now)).collect()
            }
        };
        Ok(views.into_iter().map(SagaJson::from).collect())
    }

    /// One saga.
    pub async fn saga(&self, id: &str) -> Result<SagaJson, AdminError> {
        let record = self
            .inner
            .store
            .saga_get(id)
            .await?
            .ok_or_else(|| AdminError::NotFound(format!("no saga with id `{id}`")))?;
        Ok(self.saga_json(record).await)
    }

    /// Retries a stuck saga now and wakes the orchestrator.
    pub async fn retry_saga(&self, id: &str) -> Result<SagaJson, AdminError> {
        let orchestrator = self.orchestrator()?;
        let record = orchestrator.retry(id).await?;
        orchestrator.notify();
        Ok(self.saga_json(record).await)
    }

    /// Tells a stuck saga that its step's action did not take effect (an
    /// operator checked the dependency under the step's idempotency key and
    /// made sure it never will), so it runs again and may compensate; see
    /// [`SagaOrchestrator::confirm_not_applied`](keel_messaging::saga::SagaOrchestrator::confirm_not_applied).
    pub async fn confirm_not_applied(&self, id: &str) -> Result<SagaJson, AdminError> {
        let orchestrator = self.orchestrator()?;
        let record = orchestrator.confirm_not_applied(id).await?;
        orchestrator.notify();
        Ok(self.saga_json(record).await)
    }

    /// Cancels a saga before its pivot and wakes the orchestrator.
    pub async fn cancel_saga(&self, id: &str) -> Result<SagaJson, AdminError> {
        let orchestrator = self.orchestrator()?;
        let record = orchestrator.cancel(id).await?;
        orchestrator.notify();
        Ok(self.saga_json(record).await)
    }

    /// How many sagas are in each status.
    pub async fn saga_counts(&self) -> Result<BTreeMap<String, u64>, AdminError> {
        let counts = match &self.inner.sagas {
            Some(orchestrator) => orchestrator.counts().await?,
            None => self.inner.store.saga_counts().await?,
        };
        Ok(counts
            .into_iter()
            .map(|(status, n)| (status.as_str().to_owned(), n))
            .collect())
    }

    /// The short history, if the admin was built with one.
    pub fn history(&self) -> Option<&history::History> {
        self.inner.history.as_ref()
    }

    /// Every circuit breaker made so far (empty without a registry).
    pub fn breakers(&self) -> Vec<BreakerJson> {
        self.inner
            .breakers
            .as_ref()
            .map(|r| r.snapshot().iter().map(BreakerJson::from).collect())
            .unwrap_or_default()
    }

    /// The outbox backlog and every registered gauge.
    pub async fn lag(&self) -> Result<LagJson, AdminError> {
        let outbox = self.inner.store.outbox_stats().await?.into();
        let mut gauges = Vec::new();
        for source in &self.inner.gauges {
            gauges.extend(source.gauges().await);
        }
        Ok(LagJson { outbox, gauges })
    }

    /// Counts at a glance.
    pub async fn summary(&self) -> Result<SummaryJson, AdminError> {
        let breakers_not_closed = self
            .breakers()
            .into_iter()
            .filter(|b| b.state != State::Closed.as_str())
            .map(|b| {
                let name = match b.endpoint {
                    Some(endpoint) => format!("{}/{endpoint}", b.dependency),
                    None => b.dependency,
                };
                (name, b.state)
            })
            .collect();
        Ok(SummaryJson {
            dead_letters_pending: self.dead_letter_counts().await?,
            sagas: self.saga_counts().await?,
            breakers_not_closed,
            outbox: self.inner.store.outbox_stats().await?.into(),
        })
    }

    fn orchestrator(&self) -> Result<&SagaOrchestrator<S>, AdminError> {
        self.inner
            .sagas
            .as_ref()
            .ok_or(AdminError::NotConfigured("a saga orchestrator"))
    }

    /// The saga's JSON, with its step name when the orchestrator knows it.
    async fn saga_json(&self, record: SagaRecord) -> SagaJson {
        let now = keel_core::clock::utc_now();
        let Some(orchestrator) = &self.inner.sagas else {
            return bare_view(record, now).into();
        };
        // The orchestrator names steps only in its listings; look the saga
        // up among the few that share its status and last update.
        let filter = keel_store::SagaFilter {
            status: Some(record.status),
            updated_before: Some(record.updated_at + chrono::TimeDelta::milliseconds(1)),
            limit: Some(MAX_LIMIT),
        };
        match orchestrator.list(&filter).await {
            Ok(views) => views
                .into_iter()
                .find(|v| v.record.id == record.id)
                .unwrap_or_else(|| bare_view(record, now))
                .into(),
            Err(_) => bare_view(record, now).into(),
        }
    }
}

pub(crate) fn action(action: &str, id: &str, affected: u64) -> ActionJson {
    ActionJson {
        action: action.to_owned(),
        id: id.to_owned(),
        affected,
    }
}

fn outbox_id(id: &str) -> Result<i64, AdminError> {
    id.parse().map_err(|_| {
        AdminError::bad_request(format!(
            "`{id}` is not an outbox row id: outbox row ids are whole numbers"
        ))
    })
}

fn not_parked(id: i64) -> AdminError {
    AdminError::NotFound(format!(
        "no parked outbox row with id {id} (it may have been replayed, discarded or published)"
    ))
}

fn bare_view(record: SagaRecord, now: chrono::DateTime<Utc>) -> SagaView {
    let since = |t: chrono::DateTime<Utc>| (now - t).to_std().unwrap_or_default();
    SagaView {
        age: since(record.created_at),
        idle: since(record.updated_at),
        step_name: None,
        record,
    }
}
