//! Keel's HTTP edge: axum and tower components for services that must
//! survive their clients and their dependencies.
//!
//! Every failure becomes a response: [`problem`] is the one place where
//! Keel's errors and policy refusals become HTTP statuses with an
//! `application/problem+json` body and, where it helps, `Retry-After`.
//!
//! Each module is behind the cargo feature of the same name:
//!
//! - `idempotency`: the `Idempotency-Key` layer (record first, replay,
//!   409 in flight, 422 on a different request);
//! - `pagination`: keyset pagination with signed, opaque cursors;
//! - `jobs`: asynchronous jobs (202, poll, 303 to the result);
//! - `health`: `/livez`, `/readyz`, `/debug/deep` and graceful drain;
//! - `propagation`: deadline and trace context in and out, and one policy
//!   pipeline per dependency;
//! - `shed`: load shedding at the edge (503 + `Retry-After`);
//! - `realtime`: long polling, SSE and WebSocket over a resumable event log;
//! - `webhooks`: signed sending behind an SSRF guard, and verified receiving;
//! - `admin`: the token-protected JSON admin API over dead letters, sagas,
//!   webhook deliveries, breakers and lag;
//! - `console`: the operator console, server-rendered HTML live over SSE.

pub mod access;
pub mod problem;

#[cfg(feature = "admin")]
pub mod admin;
#[cfg(feature = "console")]
pub mod console;
#[cfg(feature = "health")]
pub mod health;
#[cfg(feature = "idempotency")]
pub mod idempotency;
#[cfg(feature = "jobs")]
pub mod jobs;
#[cfg(feature = "pagination")]
pub mod pagination;
#[cfg(feature = "propagation")]
pub mod propagation;
#[cfg(feature = "realtime")]
pub mod realtime;
#[cfg(feature = "shed")]
pub mod shed;
#[cfg(feature = "webhooks")]
pub mod webhooks;
