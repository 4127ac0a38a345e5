//! Keel's HTTP edge: axum and tower components for services that must
//! survive their clients and their dependencies.
//!
//! Every failure becomes a response: [`problem`] is the one place where
//! Keel's errors and policy refusals become HTTP statuses with an
//! `application/problem+json` body and, where it helps, `Retry-After`.

pub mod problem;

#[cfg(feature = "health")]
pub mod health;
#[cfg(feature = "idempotency")]
pub mod idempotency;
#[cfg(feature = "jobs")]
pub mod jobs;
#[cfg(feature = "pagination")]
pub mod pagination;
#[cfg(feature = "propagation")]
pub mod propagation;
#[cfg(feature = "realtime")]
pub mod realtime;
#[cfg(feature = "shed")]
pub mod shed;
#[cfg(feature = "webhooks")]
pub mod webhooks;
