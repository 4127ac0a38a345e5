//! The admin token: the secret that guards the admin API and the console.
//!
//! The admin API can replay messages and steer sagas, so it is as sensitive
//! as the database. [`AdminToken::require_for`] refuses to build an admin
//! bound to a non-loopback address without a token. On loopback a token is
//! optional: then safe requests from an allowed `Host` pass, and unsafe
//! ones still need a session and its CSRF token (see [`super::access`]).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::http::{HeaderMap, header};
use keel_core::{Classify, ErrorClass};
use subtle::ConstantTimeEq;

use keel_http::access::digest;

/// The shortest token accepted, in characters.
pub const MIN_TOKEN_LEN: usize = 16;

/// The secret that guards the admin API and the console, or its deliberate
/// absence on a loopback address. Its `Debug` output never shows the token.
#[derive(Clone)]
pub struct AdminToken {
    secret: Option<Arc<str>>,
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminToken")
            .field("required", &self.is_required())
            .finish()
    }
}

/// An admin token could not be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AdminTokenError {
    /// The admin would listen on a non-loopback address with no token.
    #[error(
        "refusing to expose the admin API and console on {addr} without a token: set an admin \
         token (e.g. --admin-token or KEEL_ADMIN_TOKEN), or listen on 127.0.0.1"
    )]
    MissingOnPublicAddress {
        /// The address it would listen on.
        addr: SocketAddr,
    },
    /// The token is shorter than [`MIN_TOKEN_LEN`].
    #[error("the admin token has {len} characters; use at least {min} random characters")]
    TooShort {
        /// Its length.
        len: usize,
        /// The minimum.
        min: usize,
    },
    /// The token has characters that cannot travel in an HTTP header.
    #[error("the admin token may only contain visible ASCII characters (no spaces)")]
    InvalidCharacters,
}

impl Classify for AdminTokenError {
    fn class(&self) -> ErrorClass {
        ErrorClass::Permanent
    }
}

impl AdminToken {
    /// A required token. Refused when shorter than [`MIN_TOKEN_LEN`] or not
    /// visible ASCII.
    pub fn new(token: impl Into<String>) -> Result<Self, AdminTokenError> {
        let token = token.into();
        if !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(AdminTokenError::InvalidCharacters);
        }
        let len = token.chars().count();
        if len < MIN_TOKEN_LEN {
            return Err(AdminTokenError::TooShort {
                len,
                min: MIN_TOKEN_LEN,
            });
        }
        Ok(Self {
            secret: Some(token.into()),
        })
    }

    /// The token for an admin listening on `addr`: `token` if given (and
    /// valid); no token only when `addr` is a loopback address, else
    /// [`AdminTokenError::MissingOnPublicAddress`].
    pub fn require_for(addr: SocketAddr, token: Option<String>) -> Result<Self, AdminTokenError> {
        match token {
            Some(token) => Self::new(token),
            None if addr.ip().is_loopback() => Ok(Self { secret: None }),
            None => Err(AdminTokenError::MissingOnPublicAddress { addr }),
        }
    }

    /// No token: every request is let in. Only for loopback listeners and
    /// tests; prefer [`require_for`](Self::require_for), which checks that.
    pub fn none() -> Self {
        Self { secret: None }
    }

    /// Whether requests must present the token.
    pub fn is_required(&self) -> bool {
        self.secret.is_some()
    }

    /// Whether `presented` is the token, compared in constant time (over
    /// SHA-256 digests, so the length does not leak either). Always true
    /// when no token is required.
    pub fn verify(&self, presented: &str) -> bool {
        match &self.secret {
            None => true,
            Some(secret) => digest(secret).ct_eq(&digest(presented)).into(),
        }
    }

    /// The token, to derive session keys from.
    pub(crate) fn secret(&self) -> Option<&str> {
        self.secret.as_deref()
    }
}

/// The value of cookie `name` in the request's `Cookie` headers.
pub fn cookie<'h>(headers: &'h HeaderMap, name: &str) -> Option<&'h str> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .find(|(key, _)| *key == name)
        .map(|(_, value)| value)
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "correct-horse-battery-staple";

    #[test]
    fn a_public_address_needs_a_token_and_loopback_does_not() {
        let public: SocketAddr = "0.0.0.0:8080".parse().unwrap();
        let loopback: SocketAddr = "127.0.0.1:8080".parse().unwrap();
        assert_eq!(
            AdminToken::require_for(public, None).unwrap_err(),
            AdminTokenError::MissingOnPublicAddress { addr: public }
        );
        assert!(
            !AdminToken::require_for(loopback, None)
                .unwrap()
                .is_required()
        );
        assert!(
            AdminToken::require_for(public, Some(TOKEN.into()))
                .unwrap()
                .is_required()
        );
        assert!(matches!(
            AdminToken::new("short"),
            Err(AdminTokenError::TooShort { len: 5, .. })
        ));
        assert_eq!(
            AdminToken::new("has a space in it, sadly").unwrap_err(),
            AdminTokenError::InvalidCharacters
        );
    }
}
