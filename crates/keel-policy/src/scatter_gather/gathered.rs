//! What a gather answers: the results that arrived, and what is missing.

use keel_core::{Name, PolicyError};

/// The answer of a [`ScatterGather`](super::ScatterGather): each target
/// that answered in time with its value, and each that did not with why,
/// both in the order the targets were added.
#[derive(Debug)]
pub struct Gathered<T, E> {
    /// The targets that answered, with their values.
    pub results: Vec<(Name, T)>,
    /// The targets that did not.
    pub missing: Vec<Missing<E>>,
}

impl<T, E> Default for Gathered<T, E> {
    fn default() -> Self {
        Self {
            results: Vec::new(),
            missing: Vec::new(),
        }
    }
}

impl<T, E> Gathered<T, E> {
    /// Whether any target is missing: the answer is incomplete, and the
    /// caller should say so rather than pretend.
    pub fn is_partial(&self) -> bool {
        !self.missing.is_empty()
    }

    /// The names of the missing targets.
    pub fn missing_targets(&self) -> Vec<&str> {
        self.missing.iter().map(|m| &*m.target).collect()
    }

    /// The values alone, for a caller that ranks or merges them.
    pub fn values(self) -> impl Iterator<Item = T> {
        self.results.into_iter().map(|(_, value)| value)
    }
}

/// A target that did not answer in time, and why: its own error
/// ([`PolicyError::Inner`]), its breaker open
/// ([`Rejected::CircuitOpen`](keel_core::Rejected::CircuitOpen)), cut off
/// at the budget ([`Rejected::Timeout`](keel_core::Rejected::Timeout)), or
/// not called because too little time was left
/// ([`Rejected::DeadlineExceeded`](keel_core::Rejected::DeadlineExceeded)).
#[derive(Debug)]
pub struct Missing<E> {
    /// The target.
    pub target: Name,
    /// Why it is missing.
    pub error: PolicyError<E>,
}
