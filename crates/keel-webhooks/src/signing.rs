//! Signing and verifying webhook requests: Standard Webhooks by default, the
//! `t=<timestamp>,v1=<hex>` format as an option.
//!
//! A receiver must know that a request came from us, unchanged, and
//! recently. So the sender signs the *timestamp* and the *raw body* with
//! HMAC-SHA256 under a secret shared with that endpoint alone: signing only
//! the body would let anyone who captured one delivery replay it forever,
//! and a re-serialised body would not verify.
//!
//! # Standard Webhooks (the default)
//!
//! The [Standard Webhooks](https://www.standardwebhooks.com) format, which
//! Svix and many receiver libraries speak:
//!
//! ```text
//! webhook-id: msg_p5jXN8AQM9LWM0D4loKWxJek
//! webhook-timestamp: 1614265330
//! webhook-signature: v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=
//! ```
//!
//! The signature is `v1,` + base64(HMAC-SHA256(key, "{id}.{timestamp}.{body}")),
//! where the key is the base64-decoded part of a `whsec_...` secret. During a
//! secret rotation the header carries one signature per active secret,
//! separated by spaces, and a receiver accepts the request if any of them
//! verifies with any secret it knows.
//!
//! # The `t=<timestamp>,v1=<hex>` format
//!
//! [`SignatureScheme::TimestampedHex`] sends `t=<timestamp>,v1=<hex>` (one
//! `v1=` per active secret) over `"{timestamp}.{body}"`. A raw (non-`whsec_`)
//! secret is used as its UTF-8 bytes there, as Python's `secret.encode()`
//! does.
//!
//! ```
//! use keel_webhooks::signing::{Secret, sign_standard};
//!
//! let secret = Secret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
//! let signature = sign_standard(&secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, br#"{"test": 2432232314}"#);
//! assert_eq!(signature, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
//! ```

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use axum::http::{HeaderMap, HeaderName, HeaderValue};
use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, Mac};
use sha2::Sha256;
use subtle::ConstantTimeEq;

type HmacSha256 = Hmac<Sha256>;

/// `webhook-id`: the event id, the same in every attempt; receivers dedupe on it.
pub const WEBHOOK_ID: HeaderName = HeaderName::from_static("webhook-id");
/// `webhook-timestamp`: when this attempt was signed, in Unix seconds.
pub const WEBHOOK_TIMESTAMP: HeaderName = HeaderName::from_static("webhook-timestamp");
/// `webhook-signature`: the signatures of this attempt.
pub const WEBHOOK_SIGNATURE: HeaderName = HeaderName::from_static("webhook-signature");

/// The prefix of a Standard Webhooks secret.
pub const SECRET_PREFIX: &str = "whsec_";
/// The key length of a generated secret, in bytes (Standard Webhooks asks
/// for 24 to 64).
pub const GENERATED_KEY_BYTES: usize = 32;
/// The longest secret accepted, in characters of its text form.
pub const MAX_SECRET_LEN: usize = 512;
/// The longest `webhook-id` accepted, in characters.
pub const MAX_ID_LEN: usize = 255;
/// The most signatures checked in one header (two during a rotation, a
/// few more from senders with several keys); more is refused so a request
/// cannot make the receiver compute HMACs without end.
pub const MAX_SIGNATURES: usize = 8;
/// The longest signature header accepted, in bytes.
pub const MAX_SIGNATURE_HEADER_LEN: usize = 1024;
/// How far a timestamp may be from the receiver's clock, either way
/// (five minutes, as in Standard Webhooks).
pub const DEFAULT_TOLERANCE: Duration = Duration::from_secs(300);

/// A signing secret: key bytes, and the text they were given as.
///
/// `whsec_<base64>` is decoded to its key bytes (Standard Webhooks); any
/// other text is used as its UTF-8 bytes (a raw secret). `Debug`
/// never shows the key.
#[derive(Clone)]
pub struct Secret {
    key: Arc<[u8]>,
    text: Arc<str>,
}

impl Secret {
    /// A new random secret of [`GENERATED_KEY_BYTES`] from the operating
    /// system's generator, in `whsec_` form.
    pub fn generate() -> Result<Self, SecretError> {
        let mut key = [0u8; GENERATED_KEY_BYTES];
        getrandom::fill(&mut key).map_err(|e| SecretError::Random(e.to_string()))?;
        Self::from_key(&key)
    }

    /// A secret from its text form (see the type docs).
    pub fn parse(text: &str) -> Result<Self, SecretError> {
        if text.is_empty() {
            return Err(SecretError::Empty);
        }
        if text.len() > MAX_SECRET_LEN {
            return Err(SecretError::TooLong { len: text.len() });
        }
        let key: Vec<u8> = match text.strip_prefix(SECRET_PREFIX) {
            Some(encoded) => BASE64
                .decode(encoded)
                .map_err(|e| SecretError::InvalidBase64(e.to_string()))?,
            None => text.as_bytes().to_vec(),
        };
        if key.is_empty() {
            return Err(SecretError::Empty);
        }
        Ok(Self {
            key: key.into(),
            text: text.into(),
        })
    }

    /// A secret from raw key bytes, in `whsec_` form.
    pub fn from_key(key: &[u8]) -> Result<Self, SecretError> {
        if key.is_empty() {
            return Err(SecretError::Empty);
        }
        Self::parse(&format!("{SECRET_PREFIX}{}", BASE64.encode(key)))
    }

    /// The HMAC key.
    pub fn key(&self) -> &[u8] {
        &self.key
    }

    /// The text form, to store or to show the endpoint's owner once.
    pub fn expose(&self) -> &str {
        &self.text
    }

    fn mac(&self) -> HmacSha256 {
        match HmacSha256::new_from_slice(&self.key) {
            Ok(mac) => mac,
            // `new_from_slice` only fails for MACs with fixed-size keys.
            Err(_) => unreachable!("HMAC accepts keys of any length"),
        }
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

impl PartialEq for Secret {
    fn eq(&self, other: &Self) -> bool {
        bool::from(self.key.as_ref().ct_eq(other.key.as_ref()))
    }
}

impl Eq for Secret {}

/// A secret could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SecretError {
    /// The secret (or its decoded key) is empty.
    #[error("the webhook secret is empty: use `whsec_` + base64 of 24 to 64 random bytes")]
    Empty,
    /// The text is longer than [`MAX_SECRET_LEN`].
    #[error("the webhook secret is {len} characters long; the limit is {MAX_SECRET_LEN}")]
    TooLong {
        /// Its length.
        len: usize,
    },
    /// The part after `whsec_` is not base64.
    #[error("the webhook secret starts with `whsec_` but the rest is not base64: {0}")]
    InvalidBase64(String),
    /// The operating system's random generator failed.
    #[error("could not generate a webhook secret: the system's random generator failed: {0}")]
    Random(String),
}

/// How requests are signed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum SignatureScheme {
    /// Standard Webhooks: `webhook-signature: v1,<base64> [v1,<base64>]`
    /// over `"{id}.{timestamp}.{body}"`.
    #[default]
    StandardWebhooks,
    /// Timestamped hex: `<header>: t=<timestamp>,v1=<hex>[,v1=<hex>]`
    /// over `"{timestamp}.{body}"`. `webhook-id` and `webhook-timestamp` are
    /// sent too, but the id is not covered by the signature.
    TimestampedHex {
        /// The header carrying the signature (`webhook-signature` by default;
        /// a sender may use its own, such as `X-Acme-Signature`).
        header: HeaderName,
    },
}

impl SignatureScheme {
    /// The `t=<timestamp>,v1=<hex>` format in the `webhook-signature` header.
    pub fn timestamped_hex() -> Self {
        Self::TimestampedHex {
            header: WEBHOOK_SIGNATURE,
        }
    }

    /// The header that carries the signature.
    pub fn signature_header(&self) -> HeaderName {
        match self {
            Self::StandardWebhooks => WEBHOOK_SIGNATURE,
            Self::TimestampedHex { header } => header.clone(),
        }
    }
}

/// One Standard Webhooks signature: `v1,<base64>` of HMAC-SHA256 over
/// `"{id}.{timestamp}.{body}"`.
pub fn sign_standard(secret: &Secret, id: &str, timestamp: i64, body: &[u8]) -> String {
    let mut mac = secret.mac();
    mac.update(id.as_bytes());
    mac.update(b".");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1,{}", BASE64.encode(mac.finalize().into_bytes()))
}

/// A timestamped hex signature header value: `t=<timestamp>` and one `v1=<hex>` of
/// HMAC-SHA256 over `"{timestamp}.{body}"` per secret.
pub fn sign_timestamped_hex<'a>(
    secrets: impl IntoIterator<Item = &'a Secret>,
    timestamp: i64,
    body: &[u8],
) -> String {
    let mut header = format!("t={timestamp}");
    for secret in secrets {
        let mut mac = secret.mac();
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        header.push_str(",v1=");
        header.push_str(&hex::encode(mac.finalize().into_bytes()));
    }
    header
}

/// The headers that sign one attempt: `webhook-id`, `webhook-timestamp` and
/// the signature header of `scheme`, with one signature per secret.
pub fn signature_headers<'a>(
    scheme: &SignatureScheme,
    secrets: impl IntoIterator<Item = &'a Secret>,
    id: &str,
    timestamp: i64,
    body: &[u8],
) -> Result<Vec<(HeaderName, HeaderValue)>, SignError> {
    let id_value = HeaderValue::from_str(id).map_err(|_| SignError::InvalidId)?;
    let signature = match scheme {
        SignatureScheme::StandardWebhooks => secrets
            .into_iter()
            .map(|secret| sign_standard(secret, id, timestamp, body))
            .collect::<Vec<_>>()
            .join(" "),
        SignatureScheme::TimestampedHex { .. } => sign_timestamped_hex(secrets, timestamp, body),
    };
    if signature.is_empty() || signature == format!("t={timestamp}") {
        return Err(SignError::NoSecret);
    }
    let signature = HeaderValue::from_str(&signature).map_err(|_| SignError::InvalidId)?;
    Ok(vec![
        (WEBHOOK_ID, id_value),
        (WEBHOOK_TIMESTAMP, HeaderValue::from(timestamp)),
        (scheme.signature_header(), signature),
    ])
}

/// A request could not be signed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SignError {
    /// No active secret: the endpoint's secrets all expired.
    #[error("the endpoint has no active signing secret: rotate in a new one")]
    NoSecret,
    /// The event id cannot be a header value.
    #[error("the event id is not a valid header value: use visible ASCII")]
    InvalidId,
}

/// Verifies signed requests against the secrets a receiver knows.
///
/// ```
/// use axum::http::HeaderMap;
/// use keel_webhooks::signing::{Secret, SignatureScheme, Verifier, signature_headers};
///
/// let secret = Secret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
/// let body = br#"{"type":"order.paid"}"#;
/// let mut headers = HeaderMap::new();
/// for (name, value) in signature_headers(&SignatureScheme::default(), [&secret], "evt_1", 1_700_000_000, body).unwrap() {
///     headers.insert(name, value);
/// }
/// let verified = Verifier::new([secret]).verify(&headers, body, 1_700_000_060).unwrap();
/// assert_eq!(verified.id, "evt_1");
/// ```
#[derive(Debug, Clone)]
pub struct Verifier {
    scheme: SignatureScheme,
    secrets: Vec<Secret>,
    tolerance: Duration,
}

/// What a verified request said about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    /// The `webhook-id` (the event id).
    pub id: String,
    /// The signed timestamp, in Unix seconds.
    pub timestamp: i64,
}

impl Verifier {
    /// A Standard Webhooks verifier accepting any of `secrets` (give two
    /// during a rotation), with the default ±5 minute tolerance.
    pub fn new(secrets: impl IntoIterator<Item = Secret>) -> Self {
        Self {
            scheme: SignatureScheme::StandardWebhooks,
            secrets: secrets.into_iter().collect(),
            tolerance: DEFAULT_TOLERANCE,
        }
    }

    /// Verifies the `t=<timestamp>,v1=<hex>` format (or Standard Webhooks) instead.
    pub fn scheme(mut self, scheme: SignatureScheme) -> Self {
        self.scheme = scheme;
        self
    }

    /// How far a timestamp may be from `now`, either way (default 5 minutes).
    pub fn tolerance(mut self, tolerance: Duration) -> Self {
        self.tolerance = tolerance;
        self
    }

    /// The secrets it accepts.
    pub fn secrets(&self) -> &[Secret] {
        &self.secrets
    }

    /// Checks the headers, the timestamp against `now` (Unix seconds) and
    /// the signature over the raw `body`, in constant time, for every known
    /// secret. Malformed headers and stale timestamps are told apart from a
    /// wrong signature, so the receiver can answer `400` and `401`.
    pub fn verify(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        now: i64,
    ) -> Result<Verified, VerifyError> {
        let id = single_header(headers, &WEBHOOK_ID)?;
        if id.is_empty() || id.len() > MAX_ID_LEN || !id.bytes().all(|b| (0x21..=0x7e).contains(&b))
        {
            return Err(VerifyError::InvalidHeader {
                header: WEBHOOK_ID.as_str().to_owned(),
                reason: format!("must be 1 to {MAX_ID_LEN} visible ASCII characters"),
            });
        }
        let signature_header = self.scheme.signature_header();
        let raw = single_header(headers, &signature_header)?;
        if raw.len() > MAX_SIGNATURE_HEADER_LEN {
            return Err(invalid(
                &signature_header,
                format!("is longer than {MAX_SIGNATURE_HEADER_LEN} bytes"),
            ));
        }
        let (timestamp_text, signatures) = match &self.scheme {
            SignatureScheme::StandardWebhooks => {
                let ts = single_header(headers, &WEBHOOK_TIMESTAMP)?;
                (ts, parse_standard(raw, &signature_header)?)
            }
            SignatureScheme::TimestampedHex { header } => parse_timestamped_hex(raw, header)?,
        };
        let timestamp = parse_timestamp(timestamp_text).ok_or_else(|| {
            let header = match self.scheme {
                SignatureScheme::StandardWebhooks => WEBHOOK_TIMESTAMP,
                SignatureScheme::TimestampedHex { .. } => signature_header.clone(),
            };
            invalid(
                &header,
                "the timestamp must be Unix seconds (digits only)".to_owned(),
            )
        })?;
        let tolerance = i64::try_from(self.tolerance.as_secs()).unwrap_or(i64::MAX);
        let skew = now.saturating_sub(timestamp);
        if skew > tolerance {
            return Err(VerifyError::TooOld { age_secs: skew });
        }
        if skew < -tolerance {
            return Err(VerifyError::TooNew { ahead_secs: -skew });
        }

        let mut matched = subtle::Choice::from(0);
        for secret in &self.secrets {
            let mut mac = secret.mac();
            if self.scheme == SignatureScheme::StandardWebhooks {
                mac.update(id.as_bytes());
                mac.update(b".");
            }
            mac.update(timestamp_text.as_bytes());
            mac.update(b".");
            mac.update(body);
            let expected = mac.finalize().into_bytes();
            for candidate in &signatures {
                // Every pair is compared, in constant time, whatever matched.
                matched |= expected.as_slice().ct_eq(candidate.as_slice());
            }
        }
        if bool::from(matched) {
            Ok(Verified {
                id: id.to_owned(),
                timestamp,
            })
        } else {
            Err(VerifyError::BadSignature)
        }
    }
}

/// The signatures of a Standard Webhooks header: space-separated
/// `version,base64` entries; versions other than `v1` are ignored.
fn parse_standard(raw: &str, header: &HeaderName) -> Result<Vec<Vec<u8>>, VerifyError> {
    let mut signatures = Vec::new();
    let entries: Vec<&str> = raw.split(' ').filter(|e| !e.is_empty()).collect();
    if entries.len() > MAX_SIGNATURES {
        return Err(invalid(
            header,
            format!("carries more than {MAX_SIGNATURES} signatures"),
        ));
    }
    for entry in entries {
        let Some((version, encoded)) = entry.split_once(',') else {
            return Err(invalid(
                header,
                "each signature must be `v1,<base64>`, separated by spaces".to_owned(),
            ));
        };
        if version != "v1" {
            continue;
        }
        let bytes = BASE64
            .decode(encoded)
            .map_err(|_| invalid(header, "a v1 signature is not valid base64".to_owned()))?;
        if bytes.len() != 32 {
            return Err(invalid(
                header,
                "a v1 signature must be 32 bytes (HMAC-SHA256)".to_owned(),
            ));
        }
        signatures.push(bytes);
    }
    if signatures.is_empty() {
        return Err(invalid(
            header,
            "no `v1,<base64>` signature found".to_owned(),
        ));
    }
    Ok(signatures)
}

/// The timestamp and signatures of a `t=...,v1=...` header.
fn parse_timestamped_hex<'a>(
    raw: &'a str,
    header: &HeaderName,
) -> Result<(&'a str, Vec<Vec<u8>>), VerifyError> {
    let mut timestamp = None;
    let mut signatures = Vec::new();
    let entries: Vec<&str> = raw.split(',').map(str::trim).collect();
    if entries.len() > MAX_SIGNATURES + 1 {
        return Err(invalid(
            header,
            format!("carries more than {MAX_SIGNATURES} signatures"),
        ));
    }
    for entry in entries {
        let Some((key, value)) = entry.split_once('=') else {
            return Err(invalid(
                header,
                "must be `t=<timestamp>,v1=<hex>`".to_owned(),
            ));
        };
        match key {
            "t" if timestamp.is_none() => timestamp = Some(value),
            "t" => return Err(invalid(header, "carries two timestamps".to_owned())),
            "v1" => {
                let bytes = hex::decode(value)
                    .ok()
                    .filter(|b| b.len() == 32)
                    .ok_or_else(|| {
                        invalid(header, "a v1 signature must be 64 hex digits".to_owned())
                    })?;
                signatures.push(bytes);
            }
            _ => {} // other schemes: ignored, as Stripe-style receivers do
        }
    }
    let timestamp =
        timestamp.ok_or_else(|| invalid(header, "has no `t=<timestamp>`".to_owned()))?;
    if signatures.is_empty() {
        return Err(invalid(header, "has no `v1=<hex>` signature".to_owned()));
    }
    Ok((timestamp, signatures))
}

fn parse_timestamp(text: &str) -> Option<i64> {
    if text.is_empty() || text.len() > 18 || !text.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    text.parse().ok()
}

fn single_header<'a>(headers: &'a HeaderMap, name: &HeaderName) -> Result<&'a str, VerifyError> {
    let mut values = headers.get_all(name).iter();
    let value = values
        .next()
        .ok_or_else(|| VerifyError::MissingHeader(name.as_str().to_owned()))?;
    if values.next().is_some() {
        return Err(invalid(name, "must be sent once".to_owned()));
    }
    value
        .to_str()
        .map(str::trim)
        .map_err(|_| invalid(name, "must be visible ASCII".to_owned()))
}

fn invalid(header: &HeaderName, reason: String) -> VerifyError {
    VerifyError::InvalidHeader {
        header: header.as_str().to_owned(),
        reason,
    }
}

/// Why a request's signature was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum VerifyError {
    /// A required header is missing (`400`).
    #[error(
        "the `{0}` header is missing: a signed webhook carries webhook-id, webhook-timestamp and webhook-signature"
    )]
    MissingHeader(String),
    /// A header is malformed (`400`).
    #[error("the `{header}` header is malformed: it {reason}")]
    InvalidHeader {
        /// The header.
        header: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The timestamp is older than the tolerance (`400`): a replay, or a
    /// sender's clock far behind.
    #[error(
        "the webhook timestamp is {age_secs} s old, outside the tolerance: a captured request cannot be replayed later; check the sender's clock"
    )]
    TooOld {
        /// How old it is.
        age_secs: i64,
    },
    /// The timestamp is ahead of the tolerance (`400`).
    #[error(
        "the webhook timestamp is {ahead_secs} s in the future, outside the tolerance; check the sender's clock"
    )]
    TooNew {
        /// How far ahead it is.
        ahead_secs: i64,
    },
    /// No signature verified with any known secret (`401`).
    #[error("bad webhook signature: no signature matches the raw body with any configured secret")]
    BadSignature,
}

#[cfg(test)]
mod tests;
