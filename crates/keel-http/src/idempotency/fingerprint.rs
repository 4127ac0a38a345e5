//! The request fingerprint: what "the same request" means for a key.
//!
//! A key replays only for the request it was first used with; another
//! request under the same key is a client bug (a reused key), answered with
//! `422`. "The same" is decided by a SHA-256 over the method, the path, the
//! raw query, the configured headers (by default `content-type`) and the
//! body, each length-prefixed so no two different requests can run together
//! into the same bytes.

use axum::http::HeaderName;
use axum::http::request::Parts;
use sha2::{Digest, Sha256};

/// Prefix of the hashed bytes, so a future change of the recipe can never
/// collide with an old fingerprint still stored.
const DOMAIN: &[u8] = b"keel-idempotency-fingerprint-v1";

/// The hex SHA-256 fingerprint of a request.
pub(crate) fn fingerprint(parts: &Parts, headers: &[HeaderName], body: &[u8]) -> String {
    let mut hash = Sha256::new();
    field(&mut hash, DOMAIN);
    field(&mut hash, parts.method.as_str().as_bytes());
    field(&mut hash, parts.uri.path().as_bytes());
    field(&mut hash, parts.uri.query().unwrap_or("").as_bytes());
    for name in headers {
        field(&mut hash, name.as_str().as_bytes());
        let values = parts.headers.get_all(name);
        let count = values.iter().count();
        hash.update((count as u64).to_be_bytes());
        for value in values {
            field(&mut hash, value.as_bytes());
        }
    }
    field(&mut hash, body);
    hex::encode(hash.finalize())
}

/// The hex SHA-256 of `bytes`, truncated to 128 bits: enough to tell
/// principals apart without storing their credentials.
pub(crate) fn short_digest(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    hex::encode(&digest[..16])
}

fn field(hash: &mut Sha256, bytes: &[u8]) {
    hash.update((bytes.len() as u64).to_be_bytes());
    hash.update(bytes);
}

#[cfg(test)]
mod tests {
    use axum::http::{Request, header};

    use super::*;

    fn parts(method: &str, uri: &str, content_type: &str) -> Parts {
        Request::builder()
            .method(method)
            .uri(uri)
            .header(header::CONTENT_TYPE, content_type)
            .body(())
            .expect("request")
            .into_parts()
            .0
    }

    #[test]
    fn every_component_changes_the_fingerprint() {
        let ct = [header::CONTENT_TYPE];
        let base = fingerprint(&parts("POST", "/a?x=1", "application/json"), &ct, b"{}");
        assert_eq!(base.len(), 64);
        assert_eq!(
            base,
            fingerprint(&parts("POST", "/a?x=1", "application/json"), &ct, b"{}")
        );
        for other in [
            fingerprint(&parts("PATCH", "/a?x=1", "application/json"), &ct, b"{}"),
            fingerprint(&parts("POST", "/b?x=1", "application/json"), &ct, b"{}"),
            fingerprint(&parts("POST", "/a?x=2", "application/json"), &ct, b"{}"),
            fingerprint(&parts("POST", "/a?x=1", "text/plain"), &ct, b"{}"),
            fingerprint(&parts("POST", "/a?x=1", "application/json"), &ct, b"{ }"),
        ] {
            assert_ne!(base, other);
        }
        // Not configured: the header does not count.
        assert_eq!(
            fingerprint(&parts("POST", "/a", "application/json"), &[], b""),
            fingerprint(&parts("POST", "/a", "text/plain"), &[], b"")
        );
    }

    #[test]
    fn fields_cannot_run_together() {
        let ct: [HeaderName; 0] = [];
        assert_ne!(
            fingerprint(&parts("POST", "/ab?", "x"), &ct, b"c"),
            fingerprint(&parts("POST", "/a?b", "x"), &ct, b"c")
        );
        assert_ne!(
            fingerprint(&parts("POST", "/a?b", "x"), &ct, b"c"),
            fingerprint(&parts("POST", "/a?bc", "x"), &ct, b"")
        );
    }
}
