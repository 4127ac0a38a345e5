//! lapin's errors in the contract's terms.

use std::future::Future;
use std::time::Duration;

use keel_store::broker::BrokerError;
use lapin::ErrorKind;
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};

/// What a failed AMQP call means for the caller: a refusal of what was
/// asked (bad arguments, a topic declared otherwise) is [`BrokerError::Invalid`];
/// everything else (I/O, a closed channel or connection) may pass, so it is
/// [`BrokerError::Unavailable`].
pub(crate) fn broker_error(error: lapin::Error) -> BrokerError {
    match soft_error(&error) {
        Some(AMQPSoftError::PRECONDITIONFAILED | AMQPSoftError::ACCESSREFUSED) => {
            BrokerError::Invalid(error.to_string())
        }
        _ => BrokerError::Unavailable(Box::new(error)),
    }
}

/// The channel-level error RabbitMQ answered with, if it was one.
pub(crate) fn soft_error(error: &lapin::Error) -> Option<AMQPSoftError> {
    match error.kind() {
        ErrorKind::ProtocolError(amqp) => match amqp.kind() {
            AMQPErrorKind::Soft(soft) => Some(soft.clone()),
            AMQPErrorKind::Hard(_) => None,
        },
        _ => None,
    }
}

/// Whether RabbitMQ said the queue or exchange does not exist.
pub(crate) fn is_not_found(error: &lapin::Error) -> bool {
    matches!(soft_error(error), Some(AMQPSoftError::NOTFOUND))
}

/// How long one AMQP call may take before it counts as unavailable: a
/// server that accepted the connection can still leave a call unanswered
/// (a quorum queue without a leader), and nothing may wait forever.
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// `call` within [`CALL_TIMEOUT`], its error in the contract's terms.
pub(crate) async fn within<T>(
    call: impl Future<Output = Result<T, lapin::Error>>,
) -> Result<T, BrokerError> {
    bounded(call).await?.map_err(broker_error)
}

/// `call` within [`CALL_TIMEOUT`], its own error left for the caller to
/// read (a missing queue, an exchange still in use); running out of time
/// is [`BrokerError::Unavailable`].
pub(crate) async fn bounded<T>(
    call: impl Future<Output = Result<T, lapin::Error>>,
) -> Result<Result<T, lapin::Error>, BrokerError> {
    tokio::time::timeout(CALL_TIMEOUT, call)
        .await
        .map_err(|elapsed| BrokerError::Unavailable(Box::new(elapsed)))
}

/// [`within`] as a method of every AMQP call.
pub(crate) trait Within<T>: Future<Output = Result<T, lapin::Error>> + Sized {
    /// This call within [`CALL_TIMEOUT`].
    fn within(self) -> impl Future<Output = Result<T, BrokerError>> {
        within(self)
    }
}

impl<T, F: Future<Output = Result<T, lapin::Error>>> Within<T> for F {}
