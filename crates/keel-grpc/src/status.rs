//! Keel's errors as gRPC statuses, and gRPC statuses as Keel's errors.
//!
//! The codes come from [`keel_core::status`], the table the HTTP edge's
//! problem details answer from too: a full bulkhead is `UNAVAILABLE` here
//! exactly when it is `503` there. This module adds what is gRPC's own:
//! the retry pushback (`grpc-retry-pushback-ms`, gRFC A6) that carries a
//! refusal's `Retry-After`, and a [`GrpcCallError`] that gives a received
//! [`Status`] its [`ErrorClass`], so Keel's retries and breakers judge it.

use std::error::Error as StdError;
use std::fmt;
use std::time::Duration;

use keel_core::error::{causes, report};
use keel_core::status::{GrpcCode, grpc_code};
use keel_core::{Classify, ErrorClass, Rejected};
use tonic::metadata::MetadataValue;
use tonic::{Code, Status};

/// The metadata key a server uses to say when to retry, in milliseconds
/// (gRFC A6). A client retries no sooner; a value that is not a number
/// means "do not retry".
pub const RETRY_PUSHBACK_KEY: &str = keel_core::status::RETRY_PUSHBACK_HEADER;

/// The status for a policy's refusal: its code from
/// [`keel_core::status::grpc_code`], its message saying what to do, and
/// its `Retry-After` as the retry pushback.
///
/// ```
/// use std::time::Duration;
/// use keel_core::Rejected;
/// use keel_grpc::status::{from_rejected, retry_pushback};
///
/// let open = Rejected::circuit_open("payments", Duration::from_millis(1500));
/// let status = from_rejected(&open);
/// assert_eq!(status.code(), tonic::Code::Unavailable);
/// // The wait left when the status was built, in whole milliseconds.
/// let pushback = retry_pushback(&status).unwrap();
/// assert!(pushback <= Duration::from_millis(1500) && pushback > Duration::from_secs(1));
/// ```
pub fn from_rejected(rejected: &Rejected) -> Status {
    let mut status = Status::new(code(grpc_code(rejected)), rejected.to_string());
    if let Some(after) = rejected.retry_after() {
        set_retry_pushback(&mut status, after);
    }
    status
}

/// Tells the caller to retry no sooner than `after`
/// (`grpc-retry-pushback-ms`).
pub fn set_retry_pushback(status: &mut Status, after: Duration) {
    let ms = keel_core::status::format_retry_pushback(after);
    status
        .metadata_mut()
        .insert(RETRY_PUSHBACK_KEY, MetadataValue::from(ms));
}

/// The status for any error, the one conversion a gRPC handler or client
/// layer needs:
///
/// - a [`Status`] among its causes is answered as it is (code, message,
///   details and metadata);
/// - a [`Rejected`] among its causes as [`from_rejected`] says;
/// - tonic's own `TimeoutExpired` (its channel's timer for `grpc-timeout`)
///   as `DEADLINE_EXCEEDED`, where tonic says `CANCELLED`; its
///   `ConnectError` as `UNAVAILABLE`;
/// - otherwise by its [`ErrorClass`], through
///   [`GrpcCode::for_class`]; an error nobody classified is `INTERNAL`
///   with a message that leaks nothing (the error is logged).
///
/// ```
/// use keel_core::{Classified, Rejected};
/// use keel_grpc::status::from_error;
///
/// assert_eq!(from_error(&Rejected::DeadlineExceeded).code(), tonic::Code::DeadlineExceeded);
/// let busy = Classified::retryable(std::io::Error::other("pool exhausted"));
/// assert_eq!(from_error(&busy).code(), tonic::Code::Unavailable);
/// assert_eq!(from_error(&std::fmt::Error).message(), "internal error");
/// ```
pub fn from_error(err: &(dyn StdError + 'static)) -> Status {
    for cause in causes(err) {
        if let Some(status) = cause.downcast_ref::<Status>() {
            return Status::with_details_and_metadata(
                status.code(),
                status.message(),
                status.details().to_vec().into(),
                status.metadata().clone(),
            );
        }
        if let Some(rejected) = cause.downcast_ref::<Rejected>() {
            return from_rejected(rejected);
        }
        // tonic's channel ends a call at its `grpc-timeout` itself and
        // calls it CANCELLED; it is the deadline that passed.
        if cause.is::<tonic::TimeoutExpired>() {
            return Status::deadline_exceeded(
                "the call's deadline passed before the server answered",
            );
        }
        if cause.is::<tonic::ConnectError>() {
            return Status::unavailable(report(err));
        }
    }
    let class = keel_core::error::classify(err);
    if class == ErrorClass::Unclassified {
        tracing::error!(error = %report(err), "unclassified error answered as INTERNAL");
        return Status::internal("internal error");
    }
    let mut status = Status::new(code(GrpcCode::for_class(class)), report(err));
    if let Some(after) = keel_core::error::retry_after(err) {
        set_retry_pushback(&mut status, after);
    }
    status
}

/// What a received status says about the call: the class of its code
/// ([`GrpcCode::class`]).
pub fn class_of(status: &Status) -> ErrorClass {
    keel_code(status.code()).class()
}

/// The retry pushback a status carries, if it carries a valid one.
pub fn retry_pushback(status: &Status) -> Option<Duration> {
    let value = status.metadata().get(RETRY_PUSHBACK_KEY)?;
    keel_core::status::parse_retry_pushback(value.as_encoded_bytes())
}

/// Whether a status's pushback says "do not retry": present, but not a
/// number of milliseconds (gRFC A6).
fn pushback_forbids_retry(status: &Status) -> bool {
    status.metadata().get(RETRY_PUSHBACK_KEY).is_some() && retry_pushback(status).is_none()
}

/// tonic's code for a Keel code; they share the specification's numbers.
pub fn code(code: GrpcCode) -> Code {
    Code::from_i32(code.as_i32())
}

/// Keel's code for a tonic code.
pub fn keel_code(code: Code) -> GrpcCode {
    GrpcCode::from_i32(code as i32)
}

/// A status received from a call, classified: wrap a tonic client's error
/// in it (`client.get(req).await.map_err(GrpcCallError::from)`) to run the
/// call through Keel's plain async policies, which then retry `UNAVAILABLE`
/// after the server's pushback, count `INTERNAL` against the breaker, and
/// leave `NOT_FOUND` alone.
///
/// It shows as its status and has the status as its source, so converting
/// it back (tonic does, and [`from_error`]) gives the same status.
#[derive(Debug)]
pub struct GrpcCallError(pub Status);

impl GrpcCallError {
    /// The status.
    pub fn status(&self) -> &Status {
        &self.0
    }

    /// Unwraps the status.
    pub fn into_status(self) -> Status {
        self.0
    }
}

impl From<Status> for GrpcCallError {
    fn from(status: Status) -> Self {
        Self(status)
    }
}

impl From<GrpcCallError> for Status {
    fn from(err: GrpcCallError) -> Self {
        err.0
    }
}

impl fmt::Display for GrpcCallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "gRPC call failed with {:?}: {}",
            self.0.code(),
            self.0.message()
        )
    }
}

impl StdError for GrpcCallError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        Some(&self.0)
    }
}

impl Classify for GrpcCallError {
    /// The class of the status's code, or, for a status made from a Keel
    /// refusal on this side ([`crate::client::PropagationLayer`] keeps the
    /// refusal as the status's source), the refusal's own class: the call
    /// never left.
    fn class(&self) -> ErrorClass {
        if let Some(rejected) = keel_core::error::find_cause::<Rejected>(&self.0) {
            return rejected.class();
        }
        if pushback_forbids_retry(&self.0) && class_of(&self.0) == ErrorClass::Retryable {
            // The server said not to retry; it is still a failure of it.
            return ErrorClass::Unclassified;
        }
        class_of(&self.0)
    }

    fn retry_after(&self) -> Option<Duration> {
        retry_pushback(&self.0)
            .or_else(|| keel_core::error::find_cause::<Rejected>(&self.0)?.retry_after())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_refusal_becomes_its_code_with_pushback_where_known() {
        let limited = Rejected::RateLimited {
            name: "api".into(),
            retry_after: Duration::from_millis(250),
        };
        let status = from_rejected(&limited);
        assert_eq!(status.code(), Code::ResourceExhausted);
        assert_eq!(retry_pushback(&status), Some(Duration::from_millis(250)));
        let late = from_rejected(&Rejected::DeadlineExceeded);
        assert_eq!(late.code(), Code::DeadlineExceeded);
        assert_eq!(retry_pushback(&late), None);
        let full = from_rejected(&Rejected::BulkheadFull { name: "db".into() });
        assert_eq!(full.code(), Code::Unavailable);
    }

    #[test]
    fn a_status_in_the_chain_survives_the_round_trip() {
        let mut original = Status::not_found("no shipment S-1");
        original
            .metadata_mut()
            .insert("x-shipment", MetadataValue::from_static("S-1"));
        let wrapped = GrpcCallError(original);
        let back = from_error(&wrapped);
        assert_eq!(back.code(), Code::NotFound);
        assert_eq!(back.message(), "no shipment S-1");
        assert_eq!(back.metadata().get("x-shipment").unwrap(), "S-1");
        // tonic finds it the same way when a layer returns the error.
        let boxed: keel_core::BoxError = Box::new(wrapped);
        assert_eq!(Status::from_error(boxed).code(), Code::NotFound);
    }

    #[test]
    fn received_statuses_are_classified_for_retries_and_breakers() {
        let mut busy = Status::unavailable("busy");
        busy.metadata_mut()
            .insert(RETRY_PUSHBACK_KEY, MetadataValue::from(40_u64));
        let busy = GrpcCallError(busy);
        assert_eq!(busy.class(), ErrorClass::Retryable);
        assert_eq!(busy.retry_after(), Some(Duration::from_millis(40)));
        assert_eq!(
            GrpcCallError(Status::not_found("x")).class(),
            ErrorClass::Permanent
        );
        assert_eq!(
            GrpcCallError(Status::deadline_exceeded("x")).class(),
            ErrorClass::OutcomeUnknown
        );
        let mut refused = Status::unavailable("do not come back");
        refused
            .metadata_mut()
            .insert(RETRY_PUSHBACK_KEY, MetadataValue::from_static("never"));
        assert!(!GrpcCallError(refused).class().eq(&ErrorClass::Retryable));
        // Through a BoxError, as tower layers see it.
        let boxed: keel_core::BoxError = Box::new(keel_core::Classified::retryable(GrpcCallError(
            Status::unavailable("x"),
        )));
        assert_eq!(boxed.class(), ErrorClass::Retryable);
    }

    #[test]
    fn unclassified_errors_leak_nothing_and_classes_pick_a_code() {
        let secret = std::io::Error::other("password=hunter2 at db-7");
        let status = from_error(&secret);
        assert_eq!(status.code(), Code::Internal);
        assert!(!status.message().contains("hunter2"));
        let mine = keel_core::Classified::permanent(std::fmt::Error);
        assert_eq!(from_error(&mine).code(), Code::FailedPrecondition);
        let later = keel_core::Classified::retryable(std::fmt::Error)
            .with_retry_after(Duration::from_secs(2));
        assert_eq!(
            retry_pushback(&from_error(&later)),
            Some(Duration::from_secs(2))
        );
    }
}
