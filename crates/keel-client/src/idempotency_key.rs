//! `Idempotency-Key` values for the calling side: one per logical
//! operation, kept across its retries.
//!
//! The server dedupes on the key, so what matters is *when* the key is
//! made. Made inside the retry loop, every attempt is a new operation and
//! a lost reply turns into a second charge. Made once, before the first
//! attempt, and sent with every retry, the server answers a retry with the
//! first attempt's result. Two ways to make it:
//!
//! - [`IdempotencyKey::random`]: a fresh UUIDv7 for an operation the caller
//!   keeps track of (store it with the order before the first call, so a
//!   restarted process retries with the same key);
//! - [`IdempotencyKey::for_payload`]: the SHA-256 of an operation name and
//!   the request body, for a caller that cannot store anything. The same
//!   payload always gets the same key, even from another process, which is
//!   the point and the risk: two *intended* identical payments must differ
//!   somewhere (an order id, a client reference) or the second is deduped
//!   away.
//!
//! ```
//! use keel_client::IdempotencyKey;
//!
//! let key = IdempotencyKey::for_payload("capture", br#"{"orderId":"A-4471","amount":1999}"#);
//! assert_eq!(key, IdempotencyKey::for_payload("capture", br#"{"orderId":"A-4471","amount":1999}"#));
//! assert_ne!(key, IdempotencyKey::for_payload("refund", br#"{"orderId":"A-4471","amount":1999}"#));
//! let request = reqwest::Client::new().post("http://127.0.0.1:9/captures");
//! let request = key.apply(request); // the same key on every retry
//! # let _ = request;
//! ```

use std::fmt;

use sha2::{Digest, Sha256};

/// The `Idempotency-Key` request header.
pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";

/// An `Idempotency-Key` value: visible ASCII, at most 255 characters, as
/// Keel's server (and the IETF draft) accepts.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// A fresh, unique key (a UUIDv7, time-ordered).
    pub fn random() -> Self {
        Self(keel_core::id::new_id().to_string())
    }

    /// The key of `payload` under `operation`: `operation:` and the
    /// SHA-256 of both, in hex. Deterministic, so a retry, or a restarted
    /// caller, sends the same key for the same payload. `operation` keeps
    /// one payload sent to two endpoints apart; only its visible ASCII
    /// characters are kept, up to 64.
    pub fn for_payload(operation: &str, payload: &[u8]) -> Self {
        let mut hash = Sha256::new();
        hash.update((operation.len() as u64).to_be_bytes());
        hash.update(operation.as_bytes());
        hash.update(payload);
        let prefix: String = operation
            .chars()
            .filter(|c| c.is_ascii_graphic())
            .take(64)
            .collect();
        Self(format!("{prefix}:{}", hex::encode(hash.finalize())))
    }

    /// The key as sent.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Sets the `Idempotency-Key` header of `request` to this key.
    pub fn apply(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        request.header(IDEMPOTENCY_KEY_HEADER, self.as_str())
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acceptable(key: &IdempotencyKey) -> bool {
        (1..=255).contains(&key.as_str().len())
            && key.as_str().bytes().all(|b| (0x21..=0x7e).contains(&b))
    }

    #[test]
    fn random_keys_are_unique_and_acceptable() {
        let (a, b) = (IdempotencyKey::random(), IdempotencyKey::random());
        assert_ne!(a, b);
        assert!(acceptable(&a), "{a}");
    }

    #[test]
    fn payload_keys_are_stable_scoped_and_acceptable_whatever_the_operation_name() {
        let body = br#"{"orderId":"A-1"}"#;
        let key = IdempotencyKey::for_payload("capture", body);
        assert_eq!(key, IdempotencyKey::for_payload("capture", body));
        assert_ne!(
            key,
            IdempotencyKey::for_payload("capture", br#"{"orderId":"A-2"}"#)
        );
        assert_ne!(key, IdempotencyKey::for_payload("refund", body));
        assert!(key.as_str().starts_with("capture:"), "{key}");
        // The operation's length is hashed too: "ab"+"c…" is not "a"+"bc…".
        assert_ne!(
            IdempotencyKey::for_payload("ab", b"c"),
            IdempotencyKey::for_payload("a", b"bc")
        );
        let odd = IdempotencyKey::for_payload(&"été payé ".repeat(40), body);
        assert!(acceptable(&odd), "{odd}");
    }

    #[test]
    fn the_key_goes_in_the_header() {
        let key = IdempotencyKey::random();
        let request = key
            .apply(reqwest::Client::new().post("http://127.0.0.1:9/x"))
            .build()
            .unwrap();
        assert_eq!(request.headers()[IDEMPOTENCY_KEY_HEADER], key.as_str());
    }
}
