//! [`Sessions`]: console and CLI sessions that expire, can be revoked, and
//! carry the CSRF token that proves a state-changing request was meant.
//!
//! A session value is `id.expires.mac`: a random id, its expiry (Unix
//! seconds) and an HMAC of both, so any process holding the same key
//! accepts it without shared state, and nobody can extend or forge one.
//! The key is derived from the admin token (processes sharing the token
//! share sessions; a new token ends them all) or, without a token, random
//! per process. Logging out records the id as revoked until it would have
//! expired anyway; that record is per process, so behind a load balancer
//! a revoked session stays usable on the other processes until it
//! expires (at most the session lifetime). The revocations remembered are
//! bounded: past 10,000 live ones, every session issued so far ends.
//!
//! The CSRF token is an HMAC of the session id: a page that shows it must
//! have been read by someone holding the session, which a cross-site page
//! cannot do.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use hmac::{Hmac, Mac};
use parking_lot::Mutex;
use sha2::Sha256;
use subtle::ConstantTimeEq;

/// How long a session lives by default: 8 hours (a working day).
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(8 * 3600);

/// Revocations and notices remembered at most.
const MAX_REMEMBERED: usize = 10_000;

/// A session a request proved it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminSession {
    /// The session's id.
    pub id: String,
    /// When it expires, in Unix seconds.
    pub expires_at: u64,
    /// The CSRF token unsafe requests of this session must carry.
    pub csrf: String,
}

/// A notice for the session's next page: what its last action did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// The text.
    pub text: String,
    /// Whether it reports a failure.
    pub is_error: bool,
}

/// Issues and checks sessions; see the module docs. Cheap to
/// clone; clones share revocations.
#[derive(Clone)]
pub struct Sessions {
    key: Arc<[u8; 32]>,
    ttl: Duration,
    revoked: Arc<Mutex<HashMap<String, u64>>>,
    /// Every session expiring at or before this (Unix seconds) is over: set
    /// when more live sessions were revoked than are remembered, which ends
    /// every session issued so far instead of forgetting a revocation.
    ended_through: Arc<AtomicU64>,
    notices: Arc<Mutex<HashMap<String, Notice>>>,
}

impl std::fmt::Debug for Sessions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sessions")
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

type HmacSha256 = Hmac<Sha256>;

fn mac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    // An HMAC accepts keys of any length, so this cannot fail.
    let mut mac = <HmacSha256 as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    for part in parts {
        mac.update(part);
        mac.update(b"|");
    }
    mac.finalize().into_bytes().into()
}

impl Sessions {
    /// Sessions keyed by `secret` (the admin token), or by a random key
    /// when there is none.
    pub fn new(secret: Option<&str>, ttl: Duration) -> Self {
        let key = match secret {
            Some(secret) => mac(secret.as_bytes(), &[b"keel-admin-session-key-v2"]),
            None => {
                let mut key = [0u8; 32];
                if let Err(err) = getrandom::fill(&mut key) {
                    // Without randomness the key would be guessable: fail loudly.
                    panic!("no randomness for the session key: {err}");
                }
                key
            }
        };
        Self {
            key: Arc::new(key),
            ttl: ttl.max(Duration::from_secs(1)),
            revoked: Arc::default(),
            ended_through: Arc::default(),
            notices: Arc::default(),
        }
    }

    /// How long a new session lives.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// A new session, and the cookie value that carries it.
    pub fn issue(&self) -> (AdminSession, String) {
        let mut raw = [0u8; 16];
        if let Err(err) = getrandom::fill(&mut raw) {
            panic!("no randomness for a session id: {err}");
        }
        let id = hex::encode(raw);
        // Past the watermark of sessions ended at once (a login in the very
        // second they were ended would otherwise be born ended).
        let expires_at = (keel_core::clock::unix_seconds() + self.ttl.as_secs())
            .max(self.ended_through.load(Ordering::Relaxed) + 1);
        let value = format!("{id}.{expires_at}.{}", self.sign(&id, expires_at));
        let session = self.session(id, expires_at);
        (session, value)
    }

    /// The session `value` carries, if it is genuine, unexpired and not
    /// revoked.
    pub fn verify(&self, value: &str) -> Option<AdminSession> {
        self.verify_at(value, keel_core::clock::unix_seconds())
    }

    fn verify_at(&self, value: &str, now: u64) -> Option<AdminSession> {
        let mut parts = value.splitn(3, '.');
        let (id, expires, presented) = (parts.next()?, parts.next()?, parts.next()?);
        let expires_at: u64 = expires.parse().ok()?;
        let expected = self.sign(id, expires_at);
        let genuine: bool = expected.as_bytes().ct_eq(presented.as_bytes()).into();
        if !genuine || now >= expires_at || self.ended(id, expires_at) {
            return None;
        }
        Some(self.session(id.to_owned(), expires_at))
    }

    /// Whether the session was revoked, alone or with every session of its
    /// time; the watermark is read under the lock a revocation holds while
    /// it raises it and empties the map, so no revocation slips between.
    fn ended(&self, id: &str, expires_at: u64) -> bool {
        let revoked = self.revoked.lock();
        expires_at <= self.ended_through.load(Ordering::Relaxed) || revoked.contains_key(id)
    }

    /// Ends `session` in this process.
    pub fn revoke(&self, session: &AdminSession) {
        let now = keel_core::clock::unix_seconds();
        let mut revoked = self.revoked.lock();
        if revoked.len() >= MAX_REMEMBERED {
            revoked.retain(|_, expires| *expires > now);
        }
        if revoked.len() >= MAX_REMEMBERED {
            // Still full of live revocations: end every session issued so
            // far (they all expire by now + ttl) rather than grow.
            tracing::warn!(
                remembered = revoked.len(),
                "too many sessions revoked at once: every session ends, log in again"
            );
            self.ended_through
                .fetch_max(now + self.ttl.as_secs(), Ordering::Relaxed);
            revoked.clear();
        }
        revoked.insert(session.id.clone(), session.expires_at);
        self.notices.lock().remove(&session.id);
    }

    /// Whether `presented` is `session`'s CSRF token (constant time).
    pub fn csrf_matches(session: &AdminSession, presented: &str) -> bool {
        session.csrf.as_bytes().ct_eq(presented.as_bytes()).into()
    }

    /// Keeps `notice` for the session's next page (only the latest).
    pub fn set_notice(&self, session: &AdminSession, notice: Notice) {
        let mut notices = self.notices.lock();
        if notices.len() >= MAX_REMEMBERED && !notices.contains_key(&session.id) {
            notices.clear();
        }
        notices.insert(session.id.clone(), notice);
    }

    /// Takes the session's notice, if any.
    pub fn take_notice(&self, session: &AdminSession) -> Option<Notice> {
        self.notices.lock().remove(&session.id)
    }

    fn sign(&self, id: &str, expires_at: u64) -> String {
        hex::encode(mac(
            self.key.as_slice(),
            &[b"session", id.as_bytes(), expires_at.to_string().as_bytes()],
        ))
    }

    fn session(&self, id: String, expires_at: u64) -> AdminSession {
        let csrf = hex::encode(&mac(self.key.as_slice(), &[b"csrf", id.as_bytes()])[..16]);
        AdminSession {
            id,
            expires_at,
            csrf,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revocations_past_the_bound_end_every_session_instead_of_growing() {
        let sessions = Sessions::new(Some("the-admin-token-0123"), DEFAULT_SESSION_TTL);
        let (kept, kept_value) = sessions.issue();
        for _ in 0..MAX_REMEMBERED {
            let (session, _) = sessions.issue();
            sessions.revoke(&session);
        }
        assert!(sessions.verify(&kept_value).is_some());
        let (one_more, _) = sessions.issue();
        sessions.revoke(&one_more);
        assert!(sessions.revoked.lock().len() <= 1, "the map was emptied");
        assert!(
            sessions.verify(&kept_value).is_none(),
            "every session issued so far ended: {kept:?}"
        );
        let (_, fresh) = sessions.issue();
        assert!(
            sessions.verify(&fresh).is_some(),
            "a new login works at once"
        );
    }

    #[test]
    fn sessions_are_unique_expire_and_end_when_revoked() {
        let sessions = Sessions::new(Some("the-admin-token-0123"), DEFAULT_SESSION_TTL);
        let (a, value_a) = sessions.issue();
        let (b, value_b) = sessions.issue();
        assert_ne!(value_a, value_b, "every login gets its own session");
        assert_ne!(a.csrf, b.csrf);
        assert!(!value_a.contains("the-admin-token"));
        assert_eq!(sessions.verify(&value_a), Some(a.clone()));
        let expired = a.expires_at;
        assert_eq!(sessions.verify_at(&value_a, expired), None, "expired");
        let (id, rest) = value_a.split_once('.').unwrap();
        let (_, mac) = rest.split_once('.').unwrap();
        let extended = format!("{id}.{}.{mac}", expired + 3600);
        assert_eq!(sessions.verify(&extended), None, "the expiry is signed");
        sessions.revoke(&a);
        assert_eq!(sessions.verify(&value_a), None, "logged out");
        assert_eq!(sessions.verify(&value_b), Some(b));
    }

    #[test]
    fn another_token_or_process_without_one_accepts_none_of_them() {
        let sessions = Sessions::new(Some("the-admin-token-0123"), DEFAULT_SESSION_TTL);
        let (_, value) = sessions.issue();
        let same_token = Sessions::new(Some("the-admin-token-0123"), DEFAULT_SESSION_TTL);
        assert!(
            same_token.verify(&value).is_some(),
            "shared across processes"
        );
        let rotated = Sessions::new(Some("a-new-admin-token-456"), DEFAULT_SESSION_TTL);
        assert!(rotated.verify(&value).is_none());
        assert!(
            Sessions::new(None, DEFAULT_SESSION_TTL)
                .verify(&value)
                .is_none()
        );
        assert!(sessions.verify("garbage").is_none());
    }
}
