//! Resilience policies for async Rust.
//!
//! Each policy protects a caller from a sick dependency, or a dependency from
//! its callers, in one specific way. Every one of them has:
//!
//! - a builder with documented defaults that rejects invalid values when the
//!   policy is built ([`ConfigError`] names the field and the reason);
//! - a serde configuration form;
//! - a plain async API, `policy.call(|| async { ... }).await`, returning the
//!   operation's own error untouched or a [`Rejected`]
//!   refusal inside a [`PolicyError`];
//! - a tower [`Layer`](tower_layer::Layer), whose service speaks
//!   [`BoxError`] with the same refusals as marker errors;
//! - `tracing` events and `metrics` counters for every refusal and state change.
//!
//! Each policy is behind a cargo feature of the same name (`full` enables all).
//! All time is read through tokio's clock, so every policy can be tested with
//! `tokio::time::pause()`.

#![cfg_attr(docsrs, feature(doc_cfg))]
mod config;
pub use config::ConfigError;

#[cfg(feature = "adaptive")]
pub mod adaptive;
#[cfg(any(
    feature = "adaptive",
    feature = "bulkhead",
    feature = "rate-limit",
    feature = "shed"
))]
pub mod admission;
#[cfg(feature = "balance")]
pub mod balance;
#[cfg(feature = "breaker")]
pub mod breaker;
#[cfg(feature = "bulkhead")]
pub mod bulkhead;
#[cfg(feature = "chaos")]
pub mod chaos;
#[cfg(feature = "fallback")]
pub mod fallback;
#[cfg(feature = "hedge")]
pub mod hedge;
#[cfg(feature = "pipeline")]
pub mod pipeline;
#[cfg(feature = "rate-limit")]
pub mod rate_limit;
#[cfg(feature = "retry")]
pub mod retry;
#[cfg(feature = "scatter-gather")]
pub mod scatter_gather;
#[cfg(feature = "shed")]
pub mod shed;
#[cfg(any(feature = "bulkhead", feature = "shed"))]
pub mod slots;
#[cfg(feature = "timeout")]
pub mod timeout;

pub use keel_core::{BoxError, Classify, ErrorClass, PolicyError, Rejected};
