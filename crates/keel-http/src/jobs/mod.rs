//! Asynchronous jobs: `202 Accepted` now, the result later, for work that
//! takes longer than a client should hold a connection open.
//!
//! A report that takes two minutes cannot be a request that takes two
//! minutes: proxies time out, clients retry, and every retry starts the work
//! again. Instead:
//!
//! | request | answer |
//! |---|---|
//! | `POST /reports` + `Idempotency-Key` | `202` + `Location: /jobs/{id}` + `Retry-After: 5` |
//! | the same `POST` again (same key) | the same job, nothing new started |
//! | the same key, other parameters | `422` problem |
//! | the same key after its job expired | `410` problem |
//! | no key / bad key | `400` problem |
//! | `GET /jobs/{id}` queued or running | `200` with status and progress + `Retry-After: 10` |
//! | `GET /jobs/{id}` succeeded | `303 See Other` to the result |
//! | `GET /jobs/{id}` failed | `200` with the error in the body |
//! | `GET /jobs/{id}` unknown / expired | `404` / `410 Gone` |
//! | `DELETE /jobs/{id}` queued / running | `200` / `202`: cancelled (a running worker stops at its next update) |
//! | `DELETE /jobs/{id}` cancelled before | `200` (a retried `DELETE` succeeds) |
//! | `DELETE /jobs/{id}` succeeded or failed | `409` problem |
//!
//! A *failed* job is still a *successful* status request: `200` with the
//! error in the body, so clients and retry layers never confuse "the job
//! failed" with "asking about it failed".
//!
//! # Why the outbox
//!
//! Starting a job is a write like any other. The job row and its
//! `job.requested.v1` event ([`JobRequested`]) commit in *one* transaction
//! through the [`Outbox`](keel_messaging::outbox::Outbox): a job exists if
//! and only if a worker will hear about it, with no window where the row
//! committed and the process died before publishing. A retried `POST`
//! returns the same job; the store's unique `(kind, key)` constraint settles
//! two retries racing each other, and the loser writes no event.
//!
//! Workers consume `job.requested.v1` and report through
//! [`Jobs::start`], [`Jobs::progress`], [`Jobs::succeed`] and [`Jobs::fail`];
//! each fails with [`JobError::AlreadyFinal`] once the client cancelled, so
//! the worker knows to stop.
//!
//! ```
//! use axum::{Router, body::Body, http::{Request, StatusCode}};
//! use keel_http::jobs::{Jobs, JobsOptions};
//! use keel_messaging::outbox::Outbox;
//! use keel_sqlite::SqliteStore;
//! use tower::ServiceExt;
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let store = SqliteStore::open_in_memory().await?;
//! let jobs = Jobs::new(Outbox::new(store), JobsOptions::new("report"))?;
//! let app = Router::new()
//!     .route("/reports", jobs.create_route())
//!     .merge(jobs.routes());
//!
//! let start = Request::post("/reports")
//!     .header("idempotency-key", "5f1c0a2e-report-2026-09")
//!     .body(Body::from(r#"{"month":"2026-09"}"#))?;
//! let accepted = app.clone().oneshot(start).await?;
//! assert_eq!(accepted.status(), StatusCode::ACCEPTED);
//! let status_url = accepted.headers()["location"].to_str()?.to_owned();
//!
//! // A worker picks the job up from the outbox event and finishes it.
//! let id = status_url.trim_start_matches("/jobs/");
//! jobs.start(id).await?;
//! jobs.succeed(id, "/reports/7").await?;
//!
//! let done = app.oneshot(Request::get(&status_url).body(Body::empty())?).await?;
//! assert_eq!(done.status(), StatusCode::SEE_OTHER);
//! assert_eq!(done.headers()["location"], "/reports/7");
//! # Ok(()) }
//! ```

mod component;
mod error;
mod handlers;
mod options;

pub use component::{Cancelled, Created, JobRequested, Jobs};
pub use error::{JobError, MAX_KEY_LEN};
pub use handlers::JobView;
pub use options::{
    DEFAULT_ACCEPTED_RETRY_AFTER, DEFAULT_BASE_PATH, DEFAULT_MAX_PARAMS, DEFAULT_POLL_RETRY_AFTER,
    DEFAULT_SOURCE, DEFAULT_TOPIC, DEFAULT_TTL, InvalidJobsOptions, JobPrincipalFn, JobsOptions,
    default_job_principal,
};
