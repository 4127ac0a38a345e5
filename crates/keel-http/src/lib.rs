//! Keel's HTTP edge: axum and tower components for services that must
//! survive their clients and their dependencies.
//!
//! Every failure becomes a response: [`problem`] is the one place where
//! Keel's errors and policy refusals become HTTP statuses with an
//! `application/problem+json` body and, where it helps, `Retry-After`.
//!
//! Each module is behind the cargo feature of the same name (and `client`
//! adds the problem for a failed `keel-client` call):
//!
//! - `idempotency`: the `Idempotency-Key` layer (record first, replay,
//!   409 in flight, 422 on a different request);
//! - `pagination`: keyset pagination with signed, opaque cursors;
//! - `jobs`: asynchronous jobs (202, poll, 303 to the result);
//! - `health`: `/livez`, `/readyz`, `/debug/deep` and graceful drain;
//! - `propagation`: the deadline and trace context of incoming requests
//!   (the calling half is the `keel-client` crate);
//! - `shed`: load shedding at the edge (503 + `Retry-After`);
//! - `request-metrics`: rate, errors and duration per route (RED);
//! - `chaos`: chaos experiments scoped to requests carrying
//!   `x-chaos-experiment` (faults per route, off by default, loopback
//!   clients only unless trusted);
//! - `tls`: HTTPS with rustls, handshakes bounded in number and time;
//!
//! No feature is on by default: a service compiles only the parts it uses.
//! [`problem`] and [`access`] (API keys, allowed hosts, failure throttling)
//! are always there, because every part answers with problems and the
//! crates built on this one (`keel-realtime`, `keel-webhooks`,
//! `keel-admin`) share the access checks.

#![cfg_attr(docsrs, feature(doc_cfg))]
pub mod access;
pub mod body;
pub mod problem;
pub use keel_lifecycle::slots;

#[cfg(any(feature = "health", feature = "tls"))]
pub mod connection;
#[cfg(feature = "chaos")]
pub mod experiment;
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
#[cfg(feature = "request-metrics")]
pub mod request_metrics;
#[cfg(any(feature = "idempotency", feature = "propagation", feature = "shed"))]
mod response_future;
#[cfg(feature = "shed")]
pub mod shed;
#[cfg(feature = "tls")]
pub mod tls;
