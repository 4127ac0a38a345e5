//! What can go wrong reading resources and policies.

/// A file Keel could not read as Istio resources or a Keel policy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MeshError {
    /// The text is not YAML; the message says where.
    #[error("not YAML: {0}")]
    Yaml(String),
    /// A resource of a kind Keel checks does not have the shape Istio
    /// defines; fix the field named.
    #[error("a {kind} Keel cannot read: {reason}")]
    Invalid {
        /// Its kind.
        kind: String,
        /// What did not fit.
        reason: String,
    },
    /// A dependency's Keel policy does not build (its own rules refuse it).
    #[error("Keel's policy for `{dependency}` is invalid: {reason}")]
    Policy {
        /// The dependency.
        dependency: String,
        /// The policy's refusal.
        reason: String,
    },
    /// `export` was asked for a dependency the policy does not name.
    #[error("no dependency `{0}` in the policy")]
    UnknownDependency(String),
}
