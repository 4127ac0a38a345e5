//! The one mapping between Keel's errors and the statuses on the wire:
//! HTTP status codes and gRPC status codes, in both directions.
//!
//! A refusal must mean the same thing to a client whichever protocol it
//! speaks: a full bulkhead is "come back later" (`503` / `UNAVAILABLE`), a
//! rate limit is "slow down" (`429` / `RESOURCE_EXHAUSTED`), a passed
//! deadline is "too late" (`504` / `DEADLINE_EXCEEDED`). The HTTP edge
//! (`keel-http`'s problem details) and the gRPC edge (`keel-grpc`) both
//! answer from [`http_status`] and [`grpc_code`], so the two cannot drift.
//!
//! The other direction, what a gRPC code received from a dependency says
//! about the call, is [`GrpcCode::class`]: it decides whether a retry may
//! repeat the call and whether a breaker holds it against the dependency.
//!
//! | Keel | HTTP | gRPC |
//! |---|---|---|
//! | circuit open, bulkhead full, overloaded, budget exhausted, no endpoint, injected fault | `503` + `Retry-After` | `UNAVAILABLE` (+ `grpc-retry-pushback-ms`) |
//! | rate limited | `429` + `Retry-After` | `RESOURCE_EXHAUSTED` (+ pushback) |
//! | deadline exceeded, timeout | `504` | `DEADLINE_EXCEEDED` |
//!
//! ```
//! use keel_core::status::{grpc_code, http_status, GrpcCode};
//! use keel_core::{ErrorClass, Rejected};
//!
//! let limited = Rejected::RateLimited { name: "api".into(), retry_after: Default::default() };
//! assert_eq!((http_status(&limited), grpc_code(&limited)), (429, GrpcCode::ResourceExhausted));
//! assert_eq!(GrpcCode::Unavailable.class(), ErrorClass::Retryable);
//! assert_eq!(GrpcCode::DeadlineExceeded.class(), ErrorClass::OutcomeUnknown);
//! ```

use std::time::Duration;

use crate::{ErrorClass, Rejected};

/// The problem type (RFC 9457) of an HTTP answer whose write may or may not
/// have committed (a lost `COMMIT`). It comes with `503` and `Retry-After`,
/// so that a client retries with the same idempotency key, but a `503`
/// alone says the request did nothing: a client reading this type knows
/// better.
pub const COMMIT_OUTCOME_UNKNOWN_PROBLEM: &str = "urn:keel:problem:commit_outcome_unknown";

/// The header (or trailer) carrying a gRPC call's status code.
pub const GRPC_STATUS_HEADER: &str = "grpc-status";

/// The metadata a server uses to say when to retry, in milliseconds
/// (gRFC A6). A client retries no sooner; a value that is not a number
/// means "do not retry".
pub const RETRY_PUSHBACK_HEADER: &str = "grpc-retry-pushback-ms";

/// A `grpc-retry-pushback-ms` value as a delay; `None` for one that is not
/// a number of milliseconds, which gRFC A6 reads as "do not retry".
pub fn parse_retry_pushback(value: &[u8]) -> Option<Duration> {
    let ms = std::str::from_utf8(value)
        .ok()?
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(Duration::from_millis(ms))
}

/// A delay as a `grpc-retry-pushback-ms` value: whole milliseconds.
pub fn format_retry_pushback(after: Duration) -> u64 {
    u64::try_from(after.as_millis()).unwrap_or(u64::MAX)
}

/// A gRPC status code, as numbered by the gRPC specification
/// (`google.rpc.Code`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(i32)]
#[allow(missing_docs)] // The names are the specification's; see `class` for what each means here.
pub enum GrpcCode {
    Ok = 0,
    Cancelled = 1,
    Unknown = 2,
    InvalidArgument = 3,
    DeadlineExceeded = 4,
    NotFound = 5,
    AlreadyExists = 6,
    PermissionDenied = 7,
    ResourceExhausted = 8,
    FailedPrecondition = 9,
    Aborted = 10,
    OutOfRange = 11,
    Unimplemented = 12,
    Internal = 13,
    Unavailable = 14,
    DataLoss = 15,
    Unauthenticated = 16,
}

impl GrpcCode {
    const ALL: [Self; 17] = [
        Self::Ok,
        Self::Cancelled,
        Self::Unknown,
        Self::InvalidArgument,
        Self::DeadlineExceeded,
        Self::NotFound,
        Self::AlreadyExists,
        Self::PermissionDenied,
        Self::ResourceExhausted,
        Self::FailedPrecondition,
        Self::Aborted,
        Self::OutOfRange,
        Self::Unimplemented,
        Self::Internal,
        Self::Unavailable,
        Self::DataLoss,
        Self::Unauthenticated,
    ];

    /// The code numbered `code`; a number outside the specification is
    /// [`Unknown`](Self::Unknown), as gRPC's own libraries read it.
    pub fn from_i32(code: i32) -> Self {
        usize::try_from(code)
            .ok()
            .and_then(|i| Self::ALL.get(i).copied())
            .unwrap_or(Self::Unknown)
    }

    /// The code as it is sent in `grpc-status`.
    pub fn as_i32(self) -> i32 {
        self as i32
    }

    /// The code in a `grpc-status` header value (ASCII digits); a value
    /// that is not a number is [`Unknown`](Self::Unknown).
    pub fn from_header(value: &[u8]) -> Self {
        std::str::from_utf8(value)
            .ok()
            .and_then(|text| text.trim().parse::<i32>().ok())
            .map_or(Self::Unknown, Self::from_i32)
    }

    /// What a call that ended with this code says, for retries and breakers.
    ///
    /// - `UNAVAILABLE` and `RESOURCE_EXHAUSTED`: [`Retryable`](ErrorClass::Retryable).
    ///   The specification calls `UNAVAILABLE` transient and safe to retry;
    ///   an overloaded server answers `RESOURCE_EXHAUSTED` with pushback.
    /// - `DEADLINE_EXCEEDED`, `CANCELLED` and `INTERNAL`:
    ///   [`OutcomeUnknown`](ErrorClass::OutcomeUnknown): the call may have
    ///   taken effect before it was cut off or failed.
    /// - `UNKNOWN` and `DATA_LOSS`: [`Unclassified`](ErrorClass::Unclassified):
    ///   held against the dependency, never repeated.
    /// - the caller's own faults, `INVALID_ARGUMENT`, `NOT_FOUND`,
    ///   `ALREADY_EXISTS`, `PERMISSION_DENIED`, `FAILED_PRECONDITION`,
    ///   `ABORTED` (a conflict: re-read, then decide), `OUT_OF_RANGE`,
    ///   `UNIMPLEMENTED` and `UNAUTHENTICATED`: [`Permanent`](ErrorClass::Permanent).
    ///   The dependency is up and answering.
    /// - `OK` is not a failure; it is classed permanent only so that
    ///   nothing retries it.
    pub fn class(self) -> ErrorClass {
        match self {
            Self::Unavailable | Self::ResourceExhausted => ErrorClass::Retryable,
            Self::DeadlineExceeded | Self::Cancelled | Self::Internal => ErrorClass::OutcomeUnknown,
            Self::Unknown | Self::DataLoss => ErrorClass::Unclassified,
            _ => ErrorClass::Permanent,
        }
    }

    /// The code for an error of `class` that carries no more specific
    /// answer: retryable → `UNAVAILABLE`, refused → `UNAVAILABLE`, the
    /// caller's fault → `FAILED_PRECONDITION`, outcome unknown and
    /// unclassified → `INTERNAL` (a bug until someone says otherwise, and
    /// something that may have happened).
    ///
    /// Each code's [`class`](Self::class) at the caller is no safer than
    /// the class it was sent for: an outcome unknown sent as `UNKNOWN`
    /// would be read back as unclassified, and a caller keeping a record
    /// of what may have happened (a saga) would forget this call.
    pub fn for_class(class: ErrorClass) -> Self {
        match class {
            ErrorClass::Retryable | ErrorClass::Rejected => Self::Unavailable,
            ErrorClass::Permanent => Self::FailedPrecondition,
            ErrorClass::OutcomeUnknown | ErrorClass::Unclassified => Self::Internal,
        }
    }
}

/// The HTTP status a policy's refusal is answered with: `429` for a rate
/// limit, `504` for a deadline or a timeout, `503` for the rest.
pub fn http_status(rejected: &Rejected) -> u16 {
    match rejected {
        Rejected::RateLimited { .. } => 429,
        Rejected::DeadlineExceeded | Rejected::Timeout { .. } => 504,
        _ => 503,
    }
}

/// The gRPC code a policy's refusal is answered with, the same decision as
/// [`http_status`]: `RESOURCE_EXHAUSTED` for a rate limit,
/// `DEADLINE_EXCEEDED` for a deadline or a timeout, `UNAVAILABLE` for the
/// rest.
pub fn grpc_code(rejected: &Rejected) -> GrpcCode {
    match http_status(rejected) {
        429 => GrpcCode::ResourceExhausted,
        504 => GrpcCode::DeadlineExceeded,
        _ => GrpcCode::Unavailable,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn every_code_round_trips_and_strangers_are_unknown() {
        for (i, code) in GrpcCode::ALL.iter().enumerate() {
            assert_eq!(GrpcCode::from_i32(i as i32), *code);
            assert_eq!(code.as_i32(), i as i32);
            assert_eq!(GrpcCode::from_header(i.to_string().as_bytes()), *code);
        }
        for stranger in [-1, 17, i32::MAX] {
            assert_eq!(GrpcCode::from_i32(stranger), GrpcCode::Unknown);
        }
        assert_eq!(GrpcCode::from_header(b"fourteen"), GrpcCode::Unknown);
        assert_eq!(GrpcCode::from_header(b"\xff"), GrpcCode::Unknown);
    }

    #[test]
    fn a_pushback_round_trips_and_a_bad_one_reads_as_none() {
        let after = Duration::from_millis(250);
        let text = format_retry_pushback(after).to_string();
        assert_eq!(parse_retry_pushback(text.as_bytes()), Some(after));
        for bad in [&b"never"[..], b"-1", b"1.5", b"\xff"] {
            assert_eq!(parse_retry_pushback(bad), None);
        }
    }

    #[test]
    fn refusals_mean_the_same_on_both_protocols() {
        let name = || crate::Name::from("x");
        let after = Duration::from_secs(1);
        let cases = [
            (
                Rejected::circuit_open(name(), after),
                503,
                GrpcCode::Unavailable,
            ),
            (
                Rejected::RateLimited {
                    name: name(),
                    retry_after: after,
                },
                429,
                GrpcCode::ResourceExhausted,
            ),
            (Rejected::DeadlineExceeded, 504, GrpcCode::DeadlineExceeded),
            (
                Rejected::Timeout {
                    name: name(),
                    after,
                },
                504,
                GrpcCode::DeadlineExceeded,
            ),
            (
                Rejected::BulkheadFull { name: name() },
                503,
                GrpcCode::Unavailable,
            ),
        ];
        for (rejected, http, grpc) in cases {
            assert_eq!(http_status(&rejected), http, "{rejected}");
            assert_eq!(grpc_code(&rejected), grpc, "{rejected}");
            // What the edge answers, a Keel client reads back as retryable
            // or of unknown outcome, never as the caller's own fault.
            assert_ne!(grpc.class(), ErrorClass::Permanent, "{rejected}");
        }
    }

    #[test]
    fn a_class_sent_as_a_code_reads_back_as_no_safer_a_class() {
        for class in [
            ErrorClass::Retryable,
            ErrorClass::Permanent,
            ErrorClass::OutcomeUnknown,
            ErrorClass::Unclassified,
        ] {
            let back = GrpcCode::for_class(class).class();
            // A retry must never repeat what the sender did not call safe.
            if class != ErrorClass::Retryable {
                assert_ne!(back, ErrorClass::Retryable, "{class:?}");
            }
            // Nor may a call that may have happened read back as one that
            // did not, or as one nobody can say about.
            if class == ErrorClass::OutcomeUnknown {
                assert_eq!(back, ErrorClass::OutcomeUnknown);
            }
            assert_eq!(
                back.is_dependency_failure(),
                class.is_dependency_failure(),
                "{class:?}"
            );
        }
    }
}
