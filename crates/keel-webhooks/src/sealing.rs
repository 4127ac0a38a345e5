//! [`SecretSealer`]: endpoint secrets encrypted at rest.
//!
//! The sender needs each endpoint's secret itself to sign, so a digest
//! will not do: the secret is sealed with ChaCha20-Poly1305 under a key
//! from configuration, and a database dump or backup alone reveals none.
//! A sealed value reads `sealed:v1:` then base64url of the nonce and the
//! ciphertext; the AEAD's associated data names the purpose, so a value
//! sealed for something else does not open here.
//!
//! Without a key, secrets are stored as given (and the server says so at
//! start). Values stored before a key was set keep working: a value
//! without the prefix is read as plain text, and sealed on its next
//! rotation.

use std::sync::Arc;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use ring::aead::{Aad, CHACHA20_POLY1305, LessSafeKey, NONCE_LEN, Nonce, UnboundKey};

const PREFIX: &str = "sealed:v1:";
const PURPOSE: &[u8] = b"keel-webhook-secret-v1";

/// The key length: 32 bytes.
pub const SEALING_KEY_LEN: usize = 32;

/// A secret could not be sealed or opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SealError {
    /// The configured key is not 32 bytes of base64 or hex.
    #[error("the secrets key must be {SEALING_KEY_LEN} bytes, written as base64 or hex")]
    BadKey,
    /// A sealed value but no key to open it.
    #[error(
        "a webhook secret is sealed but no secrets key is configured: set the key it was sealed with"
    )]
    NoKey,
    /// The value is damaged or was sealed with another key.
    #[error("a sealed webhook secret does not open with this key (another key, or damaged)")]
    Unopenable,
    /// No randomness for a nonce.
    #[error("no randomness for a nonce: {0}")]
    Random(String),
}

/// Seals and opens endpoint secrets; see the [module docs](self). Cheap to
/// clone. `Debug` never shows the key.
#[derive(Clone, Default)]
pub struct SecretSealer {
    key: Option<Arc<LessSafeKey>>,
}

impl std::fmt::Debug for SecretSealer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretSealer")
            .field("sealing", &self.is_sealing())
            .finish()
    }
}

impl SecretSealer {
    /// No key: secrets are stored as given.
    pub fn plaintext() -> Self {
        Self::default()
    }

    /// A sealer with `key` (32 bytes).
    pub fn new(key: &[u8]) -> Result<Self, SealError> {
        let key = UnboundKey::new(&CHACHA20_POLY1305, key).map_err(|_| SealError::BadKey)?;
        Ok(Self {
            key: Some(Arc::new(LessSafeKey::new(key))),
        })
    }

    /// A sealer with a key written as base64 (standard or URL-safe) or hex.
    pub fn parse(text: &str) -> Result<Self, SealError> {
        let text = text.trim();
        let engines = [
            base64::engine::general_purpose::STANDARD,
            base64::engine::general_purpose::URL_SAFE,
        ];
        let decoded = hex::decode(text)
            .ok()
            .filter(|k| k.len() == SEALING_KEY_LEN)
            .or_else(|| engines.iter().find_map(|e| e.decode(text).ok()))
            .or_else(|| URL_SAFE_NO_PAD.decode(text).ok())
            .filter(|k| k.len() == SEALING_KEY_LEN)
            .ok_or(SealError::BadKey)?;
        Self::new(&decoded)
    }

    /// Whether secrets are sealed.
    pub fn is_sealing(&self) -> bool {
        self.key.is_some()
    }

    /// `secret` as it is stored.
    pub fn seal(&self, secret: &str) -> Result<String, SealError> {
        let Some(key) = &self.key else {
            return Ok(secret.to_owned());
        };
        let mut nonce = [0u8; NONCE_LEN];
        getrandom::fill(&mut nonce).map_err(|e| SealError::Random(e.to_string()))?;
        let mut sealed = secret.as_bytes().to_vec();
        key.seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(PURPOSE),
            &mut sealed,
        )
        .map_err(|_| SealError::Unopenable)?;
        let mut out = nonce.to_vec();
        out.extend_from_slice(&sealed);
        Ok(format!("{PREFIX}{}", URL_SAFE_NO_PAD.encode(out)))
    }

    /// The secret a stored value holds.
    pub fn open(&self, stored: &str) -> Result<String, SealError> {
        let Some(encoded) = stored.strip_prefix(PREFIX) else {
            return Ok(stored.to_owned());
        };
        let key = self.key.as_ref().ok_or(SealError::NoKey)?;
        let raw = URL_SAFE_NO_PAD
            .decode(encoded)
            .map_err(|_| SealError::Unopenable)?;
        if raw.len() < NONCE_LEN {
            return Err(SealError::Unopenable);
        }
        let (nonce, sealed) = raw.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).map_err(|_| SealError::Unopenable)?;
        let mut sealed = sealed.to_vec();
        let opened = key
            .open_in_place(nonce, Aad::from(PURPOSE), &mut sealed)
            .map_err(|_| SealError::Unopenable)?;
        String::from_utf8(opened.to_vec()).map_err(|_| SealError::Unopenable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f";

    #[test]
    fn a_sealed_secret_opens_only_with_its_key_and_shows_nothing() {
        let sealer = SecretSealer::parse(KEY).unwrap();
        let sealed = sealer.seal("whsec_topsecret").unwrap();
        assert!(sealed.starts_with(PREFIX));
        assert!(!sealed.contains("topsecret"));
        assert_ne!(
            sealed,
            sealer.seal("whsec_topsecret").unwrap(),
            "a fresh nonce each time"
        );
        assert_eq!(sealer.open(&sealed).unwrap(), "whsec_topsecret");
        let other = SecretSealer::new(&[7u8; 32]).unwrap();
        assert_eq!(other.open(&sealed), Err(SealError::Unopenable));
        assert_eq!(
            SecretSealer::plaintext().open(&sealed),
            Err(SealError::NoKey)
        );
        let mut raw = URL_SAFE_NO_PAD
            .decode(sealed.strip_prefix(PREFIX).unwrap())
            .unwrap();
        let last = raw.len() - 1;
        raw[last] ^= 1;
        let tampered = format!("{PREFIX}{}", URL_SAFE_NO_PAD.encode(raw));
        assert_eq!(sealer.open(&tampered), Err(SealError::Unopenable));
    }

    #[test]
    fn plain_values_stay_readable_and_keys_are_checked() {
        let sealer = SecretSealer::parse(KEY).unwrap();
        assert_eq!(sealer.open("whsec_legacy").unwrap(), "whsec_legacy");
        assert_eq!(
            SecretSealer::plaintext().seal("whsec_x").unwrap(),
            "whsec_x"
        );
        assert_eq!(SecretSealer::parse("short").unwrap_err(), SealError::BadKey);
        let b64 = base64::engine::general_purpose::STANDARD.encode([9u8; 32]);
        assert!(SecretSealer::parse(&b64).unwrap().is_sealing());
        assert!(!format!("{sealer:?}").contains("0001"));
    }
}
