//! What can go wrong when managing endpoints and queueing deliveries.

use keel_core::{Classify, ErrorClass};
use keel_store::StoreError;

use super::signing::SecretError;
use super::ssrf::SsrfError;

/// A webhook operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum WebhookError {
    /// The store failed; see [`StoreError`] for whether to retry.
    #[error("webhook store: {0}")]
    Store(#[from] StoreError),
    /// A payload is over the limit. Send less: an id and a link, and let the
    /// receiver fetch the details from your authenticated API ("fetch,
    /// don't trust").
    #[error(
        "webhook payload is {size} bytes; the limit is {limit}: send an id and let the receiver \
         fetch the rest from your API"
    )]
    PayloadTooLarge {
        /// The payload's size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// An event or endpoint field is not acceptable.
    #[error("invalid webhook {field}: {reason}")]
    Invalid {
        /// Which field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The endpoint URL is refused by the SSRF guard.
    #[error("webhook URL refused: {0}")]
    Url(#[from] SsrfError),
    /// A secret is unusable.
    #[error(transparent)]
    Secret(#[from] SecretError),
    /// A stored secret could not be sealed or opened.
    #[error(transparent)]
    Sealing(#[from] super::sealing::SealError),
    /// No endpoint has this id.
    #[error("webhook endpoint {0:?} not found")]
    EndpointNotFound(String),
    /// No delivery has this id.
    #[error("webhook delivery {0} not found")]
    DeliveryNotFound(i64),
    /// The operation does not fit the current state (resending a delivery
    /// that is being attempted, replaying for a disabled endpoint).
    #[error("{0}")]
    Conflict(String),
    /// The options are invalid.
    #[error("invalid webhook options: {0}")]
    Config(String),
}

impl WebhookError {
    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Self::Invalid {
            field,
            reason: reason.into(),
        }
    }
}

impl Classify for WebhookError {
    fn class(&self) -> ErrorClass {
        match self {
            Self::Store(err) => err.class(),
            Self::Url(err) if err.is_transient() => ErrorClass::Retryable,
            _ => ErrorClass::Permanent,
        }
    }
}
