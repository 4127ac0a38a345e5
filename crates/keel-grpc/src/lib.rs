//! Keel's gRPC edge, for tonic services and clients.
//!
//! gRPC puts the deadline in the call (`grpc-timeout`), so a server can
//! read it and abandon work that will be too late, and a client's budget
//! shrinks as the call crosses services. tonic carries the header but does
//! little with it: a handler cannot ask how much time is left, a passed
//! deadline is answered `CANCELLED` (which a client cannot tell from its
//! own cancellation), nothing is sent on to the next call, and a Keel
//! refusal (a breaker open, a bulkhead full) would reach the caller as
//! `UNKNOWN`. This crate closes those gaps, each with a tower layer:
//!
//! - [`server::DeadlineLayer`]: the caller's `grpc-timeout`, capped, as the
//!   handler's [`keel_core::Deadline`]; `DEADLINE_EXCEEDED` when it passes,
//!   before the answer or in the middle of a stream; a malformed header is
//!   `INVALID_ARGUMENT`; streams end with `UNAVAILABLE`, resumable, when
//!   the server drains. [`server::require_remaining`] lets a handler refuse
//!   to start with too little time left (50 ms, say).
//! - [`server::TraceContextLayer`]: the caller's `traceparent` as the
//!   handler's trace context.
//! - [`client::PropagationLayer`]: the current deadline as `grpc-timeout`
//!   and the trace as `traceparent` on every call; refuses to send with
//!   too little time left; every error from below reaches the caller as
//!   the status it means.
//! - [`status`]: Keel's errors as statuses (with `grpc-retry-pushback-ms`)
//!   and statuses as classified errors, from the same table the HTTP edge
//!   answers from ([`keel_core::status`]).
//! - [`replay`]: request bodies that can be resent, so keel-policy's retry
//!   and hedge work on a tonic `Channel` (its breaker, timeout and
//!   bulkhead work as they are; `GrpcStatus` and `grpc_verdict` judge the
//!   statuses).
//! - [`health`] (feature `health`): `grpc.health.v1` answering from Keel's
//!   readiness and drain; [`reflection`] (feature `reflection`).
//!
//! Everything here is the gRPC wire protocol and nothing else: a client
//! or server in any language interoperates with it.

#![cfg_attr(docsrs, feature(doc_cfg))]
mod body;
pub mod client;
#[cfg(feature = "health")]
pub mod health;
#[cfg(feature = "reflection")]
pub mod reflection;
pub mod replay;
pub mod server;
mod span;
pub mod status;

pub use status::GrpcCallError;
