//! What an admin operation can fail with, and the status each one means.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use keel_core::{Classify, ErrorClass};
use keel_messaging::dead_letter::DeadLetterError;
use keel_messaging::saga::SagaError;
use keel_store::StoreError;

use keel_http::problem::Problem;
#[cfg(feature = "webhooks")]
use keel_webhooks::WebhookError;

/// An admin operation failed. Every variant maps to one status (see
/// [`AdminError::status`]) and is answered as problem+json.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum AdminError {
    /// No such dead letter, saga or delivery (`404`).
    #[error("{0}")]
    NotFound(String),
    /// The thing is not in a state that allows the action, e.g. retrying a
    /// completed saga or replaying a discarded letter (`409`).
    #[error("{0}")]
    Conflict(String),
    /// A filter or id is malformed (`400`).
    #[error("{0}")]
    BadRequest(String),
    /// This admin was built without the part the route needs, e.g. no saga
    /// orchestrator (`501`).
    #[error("{0} is not configured on this server")]
    NotConfigured(&'static str),
    /// The request did not carry the admin token (`401`).
    #[error("the admin API needs the admin token: send `Authorization: Bearer <token>`")]
    Unauthorized,
    /// The store is unavailable or busy; try again (`503`).
    #[error("the store is unavailable: {0}")]
    Unavailable(String),
    /// The store lost a commit: the action may or may not have happened
    /// (`503`, like every lost commit; read back before acting again).
    #[error("the outcome is unknown: {0}")]
    OutcomeUnknown(String),
    /// Anything else (`500`; the detail is logged, not sent).
    #[error("{0}")]
    Internal(String),
}

impl AdminError {
    /// The HTTP status this error is answered with.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::NotFound(_) => StatusCode::NOT_FOUND,
            Self::Conflict(_) => StatusCode::CONFLICT,
            Self::BadRequest(_) => StatusCode::BAD_REQUEST,
            Self::NotConfigured(_) => StatusCode::NOT_IMPLEMENTED,
            Self::Unauthorized => StatusCode::UNAUTHORIZED,
            Self::Unavailable(_) | Self::OutcomeUnknown(_) => StatusCode::SERVICE_UNAVAILABLE,
            Self::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub(crate) fn bad_request(detail: impl Into<String>) -> Self {
        Self::BadRequest(detail.into())
    }
}

impl Classify for AdminError {
    fn class(&self) -> ErrorClass {
        match self {
            Self::Unavailable(_) => ErrorClass::Retryable,
            _ => ErrorClass::Permanent,
        }
    }
}

impl From<AdminError> for Problem {
    fn from(err: AdminError) -> Self {
        match err {
            AdminError::Internal(detail) => Problem::internal(detail),
            AdminError::Unavailable(detail) => {
                Problem::from_store(&StoreError::Unavailable(detail.into()))
            }
            AdminError::OutcomeUnknown(detail) => {
                Problem::from_store(&StoreError::OutcomeUnknown(detail.into()))
            }
            other => Problem::new(other.status(), other.to_string()),
        }
    }
}

impl IntoResponse for AdminError {
    fn into_response(self) -> Response {
        Problem::from(self).into_response()
    }
}

impl From<StoreError> for AdminError {
    fn from(err: StoreError) -> Self {
        match err {
            StoreError::NotFound(what) => Self::NotFound(what),
            StoreError::Conflict(what) => Self::Conflict(what),
            other if other.class() == ErrorClass::Retryable => Self::Unavailable(other.to_string()),
            StoreError::OutcomeUnknown(e) => Self::OutcomeUnknown(e.to_string()),
            other => Self::Internal(other.to_string()),
        }
    }
}

impl From<DeadLetterError> for AdminError {
    fn from(err: DeadLetterError) -> Self {
        match err {
            DeadLetterError::NotFound(_) => Self::NotFound(err.to_string()),
            DeadLetterError::NotPending { .. } => Self::Conflict(err.to_string()),
            DeadLetterError::Store(store) => store.into(),
            other => Self::Internal(other.to_string()),
        }
    }
}

impl From<SagaError> for AdminError {
    fn from(err: SagaError) -> Self {
        match err {
            SagaError::NotFound { .. } => Self::NotFound(err.to_string()),
            SagaError::NotStuck { .. }
            | SagaError::PastPivot { .. }
            | SagaError::Finished { .. }
            | SagaError::Conflict { .. }
            | SagaError::UnknownKind { .. } => Self::Conflict(err.to_string()),
            SagaError::Store(store) => store.into(),
            other => Self::Internal(other.to_string()),
        }
    }
}

#[cfg(feature = "webhooks")]
impl From<WebhookError> for AdminError {
    fn from(err: WebhookError) -> Self {
        match err {
            WebhookError::DeliveryNotFound(_) | WebhookError::EndpointNotFound(_) => {
                Self::NotFound(err.to_string())
            }
            WebhookError::Conflict(detail) => Self::Conflict(detail),
            WebhookError::Invalid { .. } => Self::BadRequest(err.to_string()),
            WebhookError::Store(store) => store.into(),
            other => Self::Internal(other.to_string()),
        }
    }
}
