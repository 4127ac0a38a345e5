//! A degraded answer instead of an error, chosen by what kind of failure
//! happened.
//!
//! "A breaker without a fallback just moves the error around": when a
//! dependency is refused (breaker open, bulkhead full, deadline too close),
//! failing, or too slow, a [`Fallback`] serves a cached price or a list of
//! popular items instead. Which failures qualify is decided by
//! [`ErrorClass`], never by error type:
//!
//! - handled by default: [`ErrorClass::Rejected`], [`ErrorClass::Retryable`],
//!   [`ErrorClass::OutcomeUnknown`] (timeouts) and
//!   [`ErrorClass::Unclassified`] (an error nobody classified, which breakers
//!   also count as the dependency's failure) — the dependency could not
//!   answer;
//! - not handled by default: [`ErrorClass::Permanent`]. A `404` or a
//!   validation error is the *right* answer; replacing it with cached data
//!   would hide a bug or serve stale data for something that does not exist.
//!   Opt in with [`FallbackBuilder::classes`] if you really mean it.
//!
//! The fallback function is given per call, with the error it replaces: the
//! policy is not tied to one response type, and the fallback usually needs the
//! call's own context (which SKU's cached price). A fallback never refuses, so
//! [`Fallback::call`] returns the operation's error type unchanged, which lets
//! it wrap other policies without another layer of [`PolicyError`].
//!
//! Every fallback served is counted in `keel_fallback_total{name, class}`:
//! a rising rate is how you find out a dependency is degraded while your
//! users do not.
//!
//! ```
//! use std::time::Duration;
//! use keel_policy::fallback::Fallback;
//! use keel_policy::{PolicyError, Rejected};
//!
//! # tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(async {
//! let fallback = Fallback::builder("pricing").build()?;
//! // What a breaker returns while open:
//! let open = || async {
//!     Err::<u32, PolicyError<std::io::Error>>(PolicyError::Rejected(Rejected::circuit_open(
//!         "pricing",
//!         Duration::from_secs(5),
//!     )))
//! };
//! let price = fallback.call(open, |_err| async { Ok(1999) }).await;
//! assert_eq!(price.unwrap(), 1999);
//! # Ok::<_, keel_policy::ConfigError>(())
//! # }).unwrap();
//! ```

pub mod last_good;
mod layer;

use std::future::Future;
use std::sync::Arc;

use keel_core::{Classify, ErrorClass, Name};
use serde::{Deserialize, Serialize};

use crate::ConfigError;
pub use last_good::{Answer, LastGood, LastGoodBuilder};
pub use layer::{FallbackLayer, FallbackService, ResponseFuture};

#[cfg(doc)]
use keel_core::PolicyError;

/// The classes handled unless configured otherwise: everything except
/// [`ErrorClass::Permanent`].
pub const DEFAULT_CLASSES: [ErrorClass; 4] = [
    ErrorClass::Rejected,
    ErrorClass::Retryable,
    ErrorClass::OutcomeUnknown,
    ErrorClass::Unclassified,
];

/// The configuration of a [`Fallback`], as read from a file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FallbackConfig {
    /// The error classes that are replaced by the fallback (default
    /// [`DEFAULT_CLASSES`]). Must not be empty.
    pub classes: Vec<ErrorClass>,
}

impl Default for FallbackConfig {
    fn default() -> Self {
        Self {
            classes: DEFAULT_CLASSES.to_vec(),
        }
    }
}

impl FallbackConfig {
    /// Validates the configuration and builds the policy.
    pub fn build(self, name: impl Into<Name>) -> Result<Fallback, ConfigError> {
        let classes = ClassSet::from_classes(&self.classes);
        ConfigError::ensure(
            !classes.is_empty(),
            "classes",
            "must name at least one error class: a fallback that handles nothing never runs",
        )?;
        Ok(Fallback {
            inner: Arc::new(Inner::new(name.into(), classes)),
        })
    }
}

/// Builds a [`Fallback`]; see the setters for the defaults.
#[derive(Debug, Clone)]
#[must_use]
pub struct FallbackBuilder {
    name: Name,
    config: FallbackConfig,
}

impl FallbackBuilder {
    /// The error classes the fallback replaces (default [`DEFAULT_CLASSES`]:
    /// all but [`ErrorClass::Permanent`]).
    pub fn classes(mut self, classes: impl IntoIterator<Item = ErrorClass>) -> Self {
        self.config.classes = classes.into_iter().collect();
        self
    }

    /// Validates the settings and builds the policy.
    pub fn build(self) -> Result<Fallback, ConfigError> {
        self.config.build(self.name)
    }
}

/// Serves a fallback for failures of the configured classes. Clones share one
/// policy; see the [module docs](self).
#[derive(Debug, Clone)]
pub struct Fallback {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    name: Name,
    classes: ClassSet,
    served: [metrics::Counter; CLASSES],
}

impl Inner {
    fn new(name: Name, classes: ClassSet) -> Self {
        let served = LABELS.map(|class| {
            metrics::counter!("keel_fallback_total", "name" => name.to_string(), "class" => class)
        });
        Self {
            name,
            classes,
            served,
        }
    }
}

impl Fallback {
    /// A builder named after the dependency whose failures it covers.
    pub fn builder(name: impl Into<Name>) -> FallbackBuilder {
        FallbackBuilder {
            name: name.into(),
            config: FallbackConfig::default(),
        }
    }

    /// The policy's name.
    pub fn name(&self) -> &Name {
        &self.inner.name
    }

    /// Whether failures of `class` are replaced by the fallback.
    pub fn handles(&self, class: ErrorClass) -> bool {
        self.inner.classes.contains(class)
    }

    /// A tower layer that answers handled errors with `handler`.
    pub fn layer<H>(&self, handler: H) -> FallbackLayer<H> {
        FallbackLayer::new(self.clone(), handler)
    }

    /// Runs `f`; if it fails with a handled class, returns what `fallback`
    /// makes of the error instead. Other errors are returned untouched.
    pub async fn call<T, E, F, Fut, H, HFut>(&self, f: F, fallback: H) -> Result<T, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: Classify,
        H: FnOnce(E) -> HFut,
        HFut: Future<Output = Result<T, E>>,
    {
        match f().await {
            Err(err) if self.should_serve(err.class()) => fallback(err).await,
            result => result,
        }
    }

    /// Runs `f`; if it fails with a handled class, returns `value` instead.
    /// `value` is built before the call: for anything costly, use
    /// [`call`](Self::call).
    pub async fn call_or<T, E, F, Fut>(&self, f: F, value: T) -> Result<T, E>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
        E: Classify,
    {
        match f().await {
            Err(err) if self.should_serve(err.class()) => Ok(value),
            result => result,
        }
    }

    /// Whether a failure of `class` gets the fallback; counts it if so.
    pub(crate) fn should_serve(&self, class: ErrorClass) -> bool {
        let inner = &*self.inner;
        if !inner.classes.contains(class) {
            return false;
        }
        if let Some(i) = index(class) {
            inner.served[i].increment(1);
        }
        tracing::debug!(fallback = %inner.name, ?class, "serving the fallback");
        true
    }
}

const CLASSES: usize = 5;
const LABELS: [&str; CLASSES] = [
    "retryable",
    "permanent",
    "rejected",
    "outcome_unknown",
    "unclassified",
];

fn index(class: ErrorClass) -> Option<usize> {
    match class {
        ErrorClass::Retryable => Some(0),
        ErrorClass::Permanent => Some(1),
        ErrorClass::Rejected => Some(2),
        ErrorClass::OutcomeUnknown => Some(3),
        ErrorClass::Unclassified => Some(4),
        _ => None,
    }
}

/// A set of error classes, one bit each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ClassSet(u8);

impl ClassSet {
    fn from_classes(classes: &[ErrorClass]) -> Self {
        Self(
            classes
                .iter()
                .filter_map(|&c| index(c))
                .fold(0, |bits, i| bits | 1 << i),
        )
    }

    fn contains(self, class: ErrorClass) -> bool {
        index(class).is_some_and(|i| self.0 & 1 << i != 0)
    }

    fn is_empty(self) -> bool {
        self.0 == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_classes_exclude_permanent() {
        let set = ClassSet::from_classes(&DEFAULT_CLASSES);
        assert!(set.contains(ErrorClass::Rejected));
        assert!(set.contains(ErrorClass::Retryable));
        assert!(set.contains(ErrorClass::OutcomeUnknown));
        assert!(set.contains(ErrorClass::Unclassified));
        assert!(!set.contains(ErrorClass::Permanent));
    }

    #[test]
    fn an_empty_class_list_is_rejected() {
        let err = Fallback::builder("f").classes([]).build().unwrap_err();
        assert_eq!(err.field, "classes");
    }
}
