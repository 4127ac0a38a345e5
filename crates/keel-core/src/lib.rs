//! The vocabulary every Keel crate shares.
//!
//! Resilience policies, the messaging runtime and the HTTP and gRPC edges all
//! need to agree on a few things, and this crate is where they are defined once:
//!
//! - [`error`]: what kind of failure an error is ([`ErrorClass`]: retryable,
//!   permanent, rejected by a policy, of unknown outcome, or unclassified:
//!   an error nobody classified counts as a failure for breakers and is not
//!   retried), the refusals a policy can answer with ([`Rejected`]), and
//!   walking an error's causes.
//! - [`deadline`]: the current request's [`Deadline`], carried in a task-local
//!   and across the wire as `X-Request-Deadline-Unix-Ms` or gRPC's `grpc-timeout`.
//! - [`trace`]: W3C `traceparent` parsing and formatting.
//! - [`status`]: the one mapping from Keel's errors to HTTP statuses and
//!   gRPC codes, and what a gRPC code received says about a call.
//! - [`id`]: time-ordered UUIDv7 identifiers.
//! - [`clock`]: the one place that reads time, so tests can pause it.

#![cfg_attr(docsrs, feature(doc_cfg))]
pub mod clock;
pub mod deadline;
pub mod error;
pub mod id;
mod middleware;
pub mod name;
pub mod status;
pub mod trace;

pub use deadline::Deadline;
pub use error::{BoxError, Classified, Classify, ErrorClass, Name, PolicyError, Rejected};
pub use trace::TraceParent;
