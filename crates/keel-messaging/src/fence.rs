//! Fencing tokens: the resource itself rejects writes from a lock holder
//! that has been superseded.
//!
//! A lock with a timeout is a *lease*: a holder that pauses (a 35 s GC
//! pause, a stalled VM, a slow network) can wake up after its lease expired
//! and someone else acquired it, still believing it holds the lock, and
//! then both write. No timeout fixes this, because a crashed holder and a
//! paused one look the same from outside. What does fix it is a **fencing
//! token**: every acquisition gets a number larger than all before it, every
//! write carries it, and the resource refuses a write whose token is older
//! than the newest one it has seen. The stale holder's write then changes
//! nothing, however late it arrives.
//!
//! - [`FencedLock::acquire`] hands out tokens from the store
//!   ([`FenceStore::fence_next`]): strictly increasing per resource, across
//!   restarts. Acquiring *takes over*: the new token fences off every
//!   earlier holder. (Mutual exclusion while things are healthy, if you
//!   need it, comes from elsewhere: a lease, a consumer group, a leader
//!   election. The token is what keeps it *safe* when they fail.)
//! - The check belongs in the resource's own write, atomically. For a SQL
//!   row that is one conditional update, [`FENCED_UPDATE`]:
//!
//!   ```sql
//!   UPDATE invoices SET status = 'charged', fence = ?1
//!    WHERE id = ?2 AND fence < ?1
//!   ```
//!
//!   with a `fence INTEGER NOT NULL DEFAULT 0` column (tokens start at 1).
//!   Zero rows changed means a newer holder got there first:
//!   [`FencingToken::check_rows`] turns that into a [`StaleToken`] error.
//!   For an upsert, put the condition on the conflict branch
//!   ([`FENCED_UPSERT`]).
//! - For a resource in this process (a file, an in-memory map),
//!   [`FenceGate`] keeps the newest token seen and admits only newer or equal
//!   ones.
//!
//! ```
//! use keel_messaging::fence::{FenceGate, FencingToken};
//!
//! let gate = FenceGate::new();
//! let old = FencingToken::new(41);
//! let new = FencingToken::new(42);
//! assert!(gate.admit(new).is_ok());
//! // The old holder wakes from its pause and tries to write: refused.
//! let err = gate.admit(old).unwrap_err();
//! assert_eq!(err.current, Some(new));
//! ```

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

use keel_core::{Classify, ErrorClass};
use serde::{Deserialize, Serialize};

use crate::store::{FenceStore, StoreError};

/// The SQL pattern for a write fenced by a token: `?1` is the token,
/// `?2` the row id. Replace the table and the `SET` list with your own.
pub const FENCED_UPDATE: &str =
    "UPDATE <table> SET <columns> = <values>, fence = ?1 WHERE id = ?2 AND fence < ?1";

/// The SQL pattern for a fenced upsert (SQLite and PostgreSQL): the row is
/// created with the token, or updated only if the token is newer.
pub const FENCED_UPSERT: &str = "INSERT INTO <table> (id, <columns>, fence) VALUES (?2, <values>, ?1) \
     ON CONFLICT (id) DO UPDATE SET <columns> = excluded.<columns>, fence = excluded.fence \
     WHERE <table>.fence < excluded.fence";

/// A fencing token: larger means newer. Carry it with every write to the
/// fenced resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct FencingToken(u64);

impl FencingToken {
    /// A token with the given value (as stored by the resource).
    pub const fn new(value: u64) -> Self {
        Self(value)
    }

    /// The token's value.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The value as a signed 64-bit integer, for SQL `INTEGER`/`BIGINT`
    /// columns (saturating; a store never hands out 2⁶³ tokens).
    pub fn as_i64(self) -> i64 {
        i64::try_from(self.0).unwrap_or(i64::MAX)
    }

    /// Whether a write carrying this token may replace state last written
    /// with `stored` (`None`: never written). The comparison the resource
    /// makes: strictly newer wins, so the same token twice is refused too
    /// (matching `fence < ?1`).
    pub fn supersedes(self, stored: Option<FencingToken>) -> bool {
        stored.is_none_or(|s| s < self)
    }

    /// The outcome of a fenced SQL write that changed `rows_affected` rows:
    /// zero means a newer token got there first (or the row does not exist;
    /// check if you need to tell the two apart).
    pub fn check_rows(self, rows_affected: u64) -> Result<(), StaleToken> {
        if rows_affected == 0 {
            metrics::counter!("keel_fence_rejected_total").increment(1);
            tracing::warn!(
                token = self.0,
                "fenced write changed no rows: token is stale"
            );
            return Err(StaleToken {
                token: self,
                current: None,
            });
        }
        Ok(())
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl From<FencingToken> for u64 {
    fn from(token: FencingToken) -> Self {
        token.0
    }
}

/// A write carried a token older than one the resource already accepted:
/// another holder has taken over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "write with fencing token {token} refused: {}; another holder took over, so stop and \
     re-acquire before writing again",
    match current { Some(c) => format!("the resource has already accepted token {c}"), None => "the resource holds a newer token".to_owned() }
)]
pub struct StaleToken {
    /// The token the refused write carried.
    pub token: FencingToken,
    /// The newest token the resource has accepted, if known.
    pub current: Option<FencingToken>,
}

impl Classify for StaleToken {
    fn class(&self) -> ErrorClass {
        ErrorClass::Permanent
    }
}

/// Hands out fencing tokens for resources, from a [`FenceStore`].
/// Cheap to clone.
#[derive(Debug, Clone)]
pub struct FencedLock<S> {
    store: S,
}

impl<S: FenceStore> FencedLock<S> {
    /// Tokens from `store`.
    pub fn new(store: S) -> Self {
        Self { store }
    }

    /// A token for `resource` newer than every token handed out for it
    /// before (across restarts and processes sharing the store). Every
    /// earlier holder is fenced off from the moment the resource sees a
    /// write with it.
    pub async fn acquire(&self, resource: &str) -> Result<FencingToken, StoreError> {
        let token = FencingToken(self.store.fence_next(resource).await?);
        metrics::counter!("keel_fence_acquired_total").increment(1);
        tracing::debug!(resource, %token, "fencing token acquired");
        Ok(token)
    }
}

/// The resource side of fencing for state in this process: admits a token
/// only if it is at least as new as every token admitted before.
///
/// Unlike [`FencingToken::supersedes`] (one write per token), the gate
/// admits the *current* holder's token again, so a holder can make many
/// writes; only older tokens are refused.
#[derive(Debug, Default)]
pub struct FenceGate {
    newest: AtomicU64,
}

impl FenceGate {
    /// A gate that has seen no token.
    pub fn new() -> Self {
        Self::default()
    }

    /// Admits `token` if no newer token was admitted before, and remembers
    /// it; refuses it with [`StaleToken`] otherwise.
    pub fn admit(&self, token: FencingToken) -> Result<(), StaleToken> {
        let previous = self.newest.fetch_max(token.0, Ordering::AcqRel);
        if previous > token.0 {
            metrics::counter!("keel_fence_rejected_total").increment(1);
            return Err(StaleToken {
                token,
                current: Some(FencingToken(previous)),
            });
        }
        Ok(())
    }

    /// The newest token admitted, if any.
    pub fn newest(&self) -> Option<FencingToken> {
        match self.newest.load(Ordering::Acquire) {
            0 => None,
            n => Some(FencingToken(n)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newer_supersedes_older_and_equal_does_not() {
        let t41 = FencingToken::new(41);
        let t42 = FencingToken::new(42);
        assert!(t42.supersedes(None));
        assert!(t42.supersedes(Some(t41)));
        assert!(!t41.supersedes(Some(t42)));
        assert!(!t42.supersedes(Some(t42)));
    }

    #[test]
    fn zero_rows_is_a_stale_token() {
        let t = FencingToken::new(41);
        assert!(t.check_rows(1).is_ok());
        let err = t.check_rows(0).unwrap_err();
        assert_eq!(err.token, t);
        assert!(err.to_string().contains("re-acquire"));
        assert_eq!(err.class(), ErrorClass::Permanent);
    }

    #[test]
    fn the_gate_admits_the_current_holder_and_refuses_older_ones() {
        let gate = FenceGate::new();
        assert_eq!(gate.newest(), None);
        gate.admit(FencingToken::new(41)).unwrap();
        gate.admit(FencingToken::new(41)).unwrap();
        gate.admit(FencingToken::new(42)).unwrap();
        let err = gate.admit(FencingToken::new(41)).unwrap_err();
        assert_eq!(err.current, Some(FencingToken::new(42)));
        assert!(err.to_string().contains("already accepted token 42"));
        assert_eq!(gate.newest(), Some(FencingToken::new(42)));
    }

    #[test]
    fn tokens_serialize_as_plain_numbers() {
        assert_eq!(serde_json::to_string(&FencingToken::new(7)).unwrap(), "7");
        assert_eq!(FencingToken::new(u64::MAX).as_i64(), i64::MAX);
    }
}
