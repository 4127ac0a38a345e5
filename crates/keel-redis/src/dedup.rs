//! [`RedisDedup`]: the shared dedupe record on Redis.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keel_store::{DedupClaim, DedupToken, SharedDedupStore, StoreError};
use redis::Script;
use redis::aio::ConnectionManager;

use crate::connection::{DEFAULT_TIMEOUT, connect};
use crate::error::{RedisConfigError, store_error};

/// Claims a message unless it is done or claimed: `SET key claim:TOKEN PX
/// lease` only when the key is absent.
///
/// KEYS: the record. ARGV: token, lease in ms.
const CLAIM: &str = r"
local current = redis.call('GET', KEYS[1])
if current == 'done' then return 'done' end
if current then return 'busy' end
redis.call('SET', KEYS[1], 'claim:' .. ARGV[1], 'PX', ARGV[2])
return 'claimed'
";

/// Marks the message done for a while, if this token still holds it.
///
/// KEYS: the record. ARGV: token, remember in ms.
const COMPLETE: &str = r"
if redis.call('GET', KEYS[1]) == 'claim:' .. ARGV[1] then
  redis.call('SET', KEYS[1], 'done', 'PX', ARGV[2])
  return 1
end
return 0
";

/// Gives the claim back, if this token still holds it.
///
/// KEYS: the record. ARGV: token.
const ABANDON: &str = r"
if redis.call('GET', KEYS[1]) == 'claim:' .. ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
";

/// The shared dedupe record on Redis: see `keel_store::SharedDedupStore`
/// for the promise (at least once, duplicates rare, never lost). Without
/// persistence a restart forgets every claim and every done mark: the
/// messages in flight and those redelivered afterwards are processed
/// again, which the promise allows. Cheap to clone.
#[derive(Clone)]
pub struct RedisDedup {
    connection: ConnectionManager,
    key_prefix: Arc<str>,
    scripts: Arc<[Script; 3]>,
}

impl std::fmt::Debug for RedisDedup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisDedup")
            .field("key_prefix", &self.key_prefix)
            .finish_non_exhaustive()
    }
}

impl RedisDedup {
    /// The record on the Redis at `url`, its keys under `key_prefix`
    /// (e.g. [`DEFAULT_KEY_PREFIX`](crate::DEFAULT_KEY_PREFIX)), every command within
    /// [`DEFAULT_TIMEOUT`]. Connects on first use; call it inside a tokio
    /// runtime.
    pub fn new(url: &str, key_prefix: impl Into<String>) -> Result<Self, RedisConfigError> {
        Ok(Self {
            connection: connect(url, DEFAULT_TIMEOUT)?,
            key_prefix: key_prefix.into().into(),
            scripts: Arc::new([
                Script::new(CLAIM),
                Script::new(COMPLETE),
                Script::new(ABANDON),
            ]),
        })
    }

    fn key(&self, scope: &str, id: &str) -> String {
        format!("{}dedup:{scope}:{id}", self.key_prefix)
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis())
        .unwrap_or(u64::MAX)
        .max(1)
}

#[async_trait]
impl SharedDedupStore for RedisDedup {
    async fn dedup_claim(
        &self,
        scope: &str,
        id: &str,
        lease: Duration,
    ) -> Result<DedupClaim, StoreError> {
        let token = keel_core::id::new_id().simple().to_string();
        let mut connection = self.connection.clone();
        let found: String = self.scripts[0]
            .key(self.key(scope, id))
            .arg(&token)
            .arg(millis(lease))
            .invoke_async(&mut connection)
            .await
            .map_err(store_error)?;
        match found.as_str() {
            "claimed" => Ok(DedupClaim::Claimed(DedupToken(token))),
            "done" => Ok(DedupClaim::Done),
            "busy" => Ok(DedupClaim::InProgress),
            other => Err(StoreError::other(format!(
                "unexpected claim answer `{other}`"
            ))),
        }
    }

    async fn dedup_complete(
        &self,
        scope: &str,
        id: &str,
        token: &DedupToken,
        remember: Duration,
    ) -> Result<bool, StoreError> {
        let mut connection = self.connection.clone();
        let completed: i64 = self.scripts[1]
            .key(self.key(scope, id))
            .arg(&token.0)
            .arg(millis(remember))
            .invoke_async(&mut connection)
            .await
            .map_err(store_error)?;
        Ok(completed == 1)
    }

    async fn dedup_abandon(
        &self,
        scope: &str,
        id: &str,
        token: &DedupToken,
    ) -> Result<bool, StoreError> {
        let mut connection = self.connection.clone();
        let abandoned: i64 = self.scripts[2]
            .key(self.key(scope, id))
            .arg(&token.0)
            .invoke_async(&mut connection)
            .await
            .map_err(store_error)?;
        Ok(abandoned == 1)
    }
}
