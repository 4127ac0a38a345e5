//! Keel's HTTP client: outgoing calls that carry the deadline and the trace
//! on, refuse to start when they cannot finish in time, and sit behind one
//! policy pipeline per dependency.
//!
//! It needs no server framework: a service that only *calls* others (a
//! worker, a CLI, a saga step) uses it without axum. The server half of
//! propagation (reading the deadline and `traceparent` of an incoming
//! request) is `keel-http`'s `propagation` module; together they give every
//! hop the same deadline and the same trace.
//!
//! # The client
//!
//! [`PropagatingClient`] wraps a `reqwest::Client`. Every request carries the
//! current deadline (tightened to the client's own timeout) and a child
//! `traceparent`; a call with no more than 50 ms left is refused with
//! [`Rejected::DeadlineExceeded`](keel_core::Rejected::DeadlineExceeded)
//! without leaving the process; the request timeout is
//! `min(own timeout, time left)`. Failures come back as [`HttpCallError`],
//! classified for retries and breakers ([`keel_core::Classify`]).
//!
//! A dropped call future aborts its request, so when the request that made
//! the call is cancelled (its client hung up, its deadline passed), the
//! call below it stops too.
//!
//! # One pipeline per dependency
//!
//! [`Dependency`] puts one downstream service behind its own policies:
//! a total timeout, retries with a budget, **its own** circuit breaker, a
//! bulkhead and a per-attempt timeout, so a failing payments service opens
//! the payments breaker and nothing else.
//!
//! A dependency on several hosts, or in the middle of a canary release,
//! lists its endpoints in weighted [`routing`] subsets (95% to `stable`, 5%
//! to `v2`); [`Dependency::send_routed`] draws a subset by weight and an
//! endpoint in it by peak-EWMA load, ejecting outliers but never a whole
//! subset, and labels every attempt with its subset and track so a canary's
//! error rate can be compared with the baseline's.
//!
//! Behind mTLS, [`PropagatingClient::with_identity`] presents the service's
//! own certificate and re-reads it as connections recycle, so a rotated
//! certificate needs no restart ([`identity`]).
//!
//! # The client loops
//!
//! A service that *consumes* another Keel service's push or jobs needs
//! loops that outlive a server restart: keep a cursor, reconnect with
//! jitter, resend what was not acknowledged, tell garbage from a hiccup.
//! Each is a feature, written once here:
//!
//! | feature | type | server side |
//! |---|---|---|
//! | `long-poll` | [`LongPoll`]: cursor kept, `204` is success | `keel_realtime` long polling |
//! | `sse` | [`SseClient`]: `Last-Event-ID` resume, the server's `retry` | `keel_realtime` SSE |
//! | `websocket` | [`KeelSocket`]: `keel.v1`, resume, acked resends, heartbeats | `keel_realtime` WebSocket |
//! | `jobs` | [`JobClient`]: `202` → poll → `303`, `DELETE` on cancel | `keel_http::jobs` |
//!
//! They share [`Reconnect`] (full-jitter backoff, `Retry-After`, the
//! current deadline) and one error type, [`LoopError`].

#![cfg_attr(docsrs, feature(doc_cfg))]
mod client;
mod dependency;
mod error;
pub mod idempotency_key;
pub mod identity;
#[cfg(feature = "jobs")]
pub mod jobs;
#[cfg(feature = "long-poll")]
pub mod long_poll;
#[cfg(any(
    feature = "long-poll",
    feature = "sse",
    feature = "websocket",
    feature = "jobs"
))]
mod loop_error;
#[cfg(any(
    feature = "long-poll",
    feature = "sse",
    feature = "websocket",
    feature = "jobs"
))]
pub mod reconnect;
pub mod recycle;
pub mod routing;
#[cfg(feature = "sse")]
pub mod sse;
#[cfg(feature = "websocket")]
pub mod websocket;

pub use client::{DEFAULT_CLIENT_TIMEOUT, ERROR_BODY_LIMIT, PropagatingClient};
pub use dependency::{Dependency, DependencyBuilder, DependencyConfig};
pub use error::{HttpCallError, parse_retry_after};
pub use idempotency_key::IdempotencyKey;
pub use recycle::ConnectionRecycling;
pub use routing::{Endpoint, SubsetConfig};

#[cfg(feature = "jobs")]
pub use jobs::{Job, JobClient, JobError, JobState};
#[cfg(feature = "long-poll")]
pub use long_poll::{Batch, LongPoll, LongPollBuilder, PolledEvent};
#[cfg(any(
    feature = "long-poll",
    feature = "sse",
    feature = "websocket",
    feature = "jobs"
))]
pub use loop_error::{LOOP_BODY_LIMIT, LoopError};
#[cfg(any(
    feature = "long-poll",
    feature = "sse",
    feature = "websocket",
    feature = "jobs"
))]
pub use reconnect::Reconnect;
#[cfg(feature = "sse")]
pub use sse::{SseClient, SseClientBuilder, SseEvent};
#[cfg(feature = "websocket")]
pub use websocket::{KeelSocket, KeelSocketBuilder, SocketMessage};
