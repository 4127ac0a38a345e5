//! Deadline and trace propagation: every hop knows when the whole request
//! stops mattering and which trace it belongs to, and stops working for a
//! caller that is gone.
//!
//! A timeout says how long *this* hop may wait; a deadline says when the
//! *whole* request is worthless. Carried from the edge into every call
//! below it, the deadline lets each hop refuse work that would finish too
//! late, instead of doing it slowly for nobody. The trace context does the
//! same for observability: one trace id, five services.
//!
//! # Server side
//!
//! - [`DeadlineLayer`] reads `X-Request-Deadline-Unix-Ms`, **trusts it but
//!   never beyond our own maximum** (default 30 s, [`DEFAULT_MAX_DEADLINE`]):
//!   a caller must not pin our resources for an hour with one header. The
//!   handler runs inside [`Deadline::scope`](keel_core::Deadline::scope), so
//!   every policy and client below sees it, and is cancelled (dropped) when
//!   the deadline passes: `504` problem. A malformed header is a `400`
//!   problem; an already expired one is a `504` without running the
//!   handler.
//! - [`TraceContextLayer`] reads the W3C `traceparent`, runs the handler as a
//!   child span in [`TraceParent::scope`](keel_core::TraceParent::scope) and
//!   inside a `tracing` span carrying the trace id, and answers with
//!   `traceresponse` and `x-trace-id`. A malformed `traceparent` is a `400`
//!   problem by default (the issue's rule for malformed headers);
//!   [`TraceContextLayer::lenient`] follows the W3C recommendation instead
//!   (ignore it, start a new trace). No header starts a new trace.
//!
//! # If the client hangs up, everything downstream stops
//!
//! Nothing extra is needed for that, and nothing must get in its way: when a
//! connection closes, hyper drops the request's future, and with it every
//! future it is awaiting, outgoing HTTP calls through `keel-client`'s
//! `PropagatingClient` included (a dropped reqwest future aborts its
//! request). The one way to break this is `tokio::spawn`-ing work from a
//! handler: a spawned task outlives the request. [`DeadlineLayer`] counts such cancellations in
//! `keel_http_requests_cancelled_total`.
//!
//! # Client side
//!
//! The calling half lives in the `keel-client` crate, which needs no axum:
//! its `PropagatingClient` sends the current deadline (tightened to its own
//! timeout) and a child `traceparent` on every call, and refuses a call
//! with too little time left.
//!
//! # Order of layers
//!
//! ```
//! use std::time::Duration;
//! use axum::{Router, routing::get};
//! use keel_http::propagation::{DeadlineLayer, TraceContextLayer};
//!
//! let app: Router = Router::new()
//!     .route("/orders", get(|| async { "ok" }))
//!     // Inner: the deadline (its 400/504 answers still carry trace ids).
//!     .layer(DeadlineLayer::with_max(Duration::from_secs(2)).unwrap())
//!     // Outer: the trace context.
//!     .layer(TraceContextLayer::new());
//! ```

mod deadline;
mod trace;

pub use deadline::{DEFAULT_MAX_DEADLINE, DeadlineLayer, DeadlineService};
pub use trace::{TRACE_ID_HEADER, TRACERESPONSE_HEADER, TraceContextLayer, TraceContextService};

/// The response future of the propagation layers.
pub use crate::response_future::ResponseFuture;
