//! Mapping async-nats errors onto [`BrokerError`] and its error classes.
//!
//! The rule: a failure to *reach* the server is `Unavailable` (retryable);
//! a publish whose acknowledgement did not arrive is `OutcomeUnknown`, and a
//! retry is safe because JetStream dedupes the republish on its
//! `Nats-Msg-Id`; anything the server refused for good is `Other` or
//! `Invalid`.

use async_nats::jetstream::context::{PublishError, PublishErrorKind};
use keel_store::broker::BrokerError;

/// A failure to reach or use the server: retryable.
pub(crate) fn unavailable(what: &str, error: impl std::fmt::Display) -> BrokerError {
    BrokerError::Unavailable(format!("{what}: {error}").into())
}

/// A failure waiting for a publish acknowledgement.
pub(crate) fn publish_ack(error: PublishError) -> BrokerError {
    match error.kind() {
        PublishErrorKind::TimedOut | PublishErrorKind::BrokenPipe => {
            BrokerError::OutcomeUnknown(Box::new(error))
        }
        PublishErrorKind::StreamNotFound => unavailable("the topic's stream is gone", error),
        PublishErrorKind::MaxPayloadExceeded => BrokerError::Invalid(error.to_string()),
        _ => BrokerError::Other(Box::new(error)),
    }
}

/// A failure sending a publish (before any ack could arrive).
pub(crate) fn publish_send(error: PublishError) -> BrokerError {
    match error.kind() {
        PublishErrorKind::MaxPayloadExceeded => BrokerError::Invalid(error.to_string()),
        // The bytes may have left before the connection broke.
        _ => BrokerError::OutcomeUnknown(Box::new(error)),
    }
}

#[cfg(test)]
mod tests {
    use keel_core::{Classify, ErrorClass};

    use super::*;

    #[test]
    fn ack_timeouts_are_outcome_unknown_and_refusals_are_not() {
        let timed_out = publish_ack(PublishError::new(PublishErrorKind::TimedOut));
        assert_eq!(timed_out.class(), ErrorClass::OutcomeUnknown);
        let too_big = publish_ack(PublishError::new(PublishErrorKind::MaxPayloadExceeded));
        assert!(matches!(too_big, BrokerError::Invalid(_)));
        assert_eq!(
            unavailable("ping", "connection refused").class(),
            ErrorClass::Retryable
        );
    }
}
