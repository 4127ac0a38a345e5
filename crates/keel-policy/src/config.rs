use std::borrow::Cow;

/// A policy configuration value that cannot work, found when the policy is
/// built. Names the field and says why, so the fix is obvious.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid `{field}`: {reason}")]
pub struct ConfigError {
    /// The configuration field, as named in the builder and the serde form.
    pub field: &'static str,
    /// Why the value was refused.
    pub reason: Cow<'static, str>,
}

impl ConfigError {
    /// A refusal of `field` for `reason`.
    pub fn new(field: &'static str, reason: impl Into<Cow<'static, str>>) -> Self {
        Self {
            field,
            reason: reason.into(),
        }
    }

    /// `Ok` when `ok` holds, else the error for `field` with `reason`: a
    /// configuration check in one line.
    pub fn ensure(ok: bool, field: &'static str, reason: &'static str) -> Result<(), Self> {
        if ok {
            Ok(())
        } else {
            Err(Self::new(field, reason))
        }
    }
}
