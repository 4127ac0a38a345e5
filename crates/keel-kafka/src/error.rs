//! librdkafka's errors as the [`BrokerError`]s the contract names.

use keel_store::broker::BrokerError;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// What a failed call means for its caller: a refusal that no retry will
/// change is [`BrokerError::Invalid`]; a publish that timed out may have
/// been stored ([`BrokerError::OutcomeUnknown`]); the rest is
/// [`BrokerError::Unavailable`].
pub(crate) fn broker_error(error: KafkaError) -> BrokerError {
    use RDKafkaErrorCode as Code;
    match error.rdkafka_error_code() {
        Some(
            Code::MessageSizeTooLarge
            | Code::InvalidMessageSize
            | Code::InvalidTopic
            | Code::InvalidRecord
            | Code::InvalidMessage
            | Code::PolicyViolation,
        ) => BrokerError::Invalid(error.to_string()),
        Some(Code::MessageTimedOut | Code::RequestTimedOut | Code::TimedOutQueue) => {
            BrokerError::OutcomeUnknown(Box::new(error))
        }
        _ => BrokerError::Unavailable(Box::new(error)),
    }
}

/// A blocking librdkafka call's task did not finish (the runtime is
/// shutting down).
pub(crate) fn task_failed(error: tokio::task::JoinError) -> BrokerError {
    BrokerError::Unavailable(Box::new(error))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timed_out_publish_may_have_been_stored() {
        let timed_out = KafkaError::MessageProduction(RDKafkaErrorCode::MessageTimedOut);
        assert!(matches!(
            broker_error(timed_out),
            BrokerError::OutcomeUnknown(_)
        ));
        let too_large = KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge);
        assert!(matches!(broker_error(too_large), BrokerError::Invalid(_)));
        let down = KafkaError::MessageProduction(RDKafkaErrorCode::AllBrokersDown);
        assert!(matches!(broker_error(down), BrokerError::Unavailable(_)));
    }
}
