//! [`RedisLeases`]: the lease contract on Redis.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use keel_core::clock;
use keel_store::{LeaseGrant, LeaseStore, StoreError};
use redis::Script;
use redis::aio::ConnectionManager;

use crate::connection::{DEFAULT_KEY_PREFIX, DEFAULT_TIMEOUT, connect};
use crate::error::{RedisConfigError, store_error};

/// Takes a free lease with `SET NX PX`, or extends the caller's own; never
/// touches another holder's. The token counter is started from the
/// server's clock (in microseconds) when it does not exist, which is what
/// keeps tokens growing after a restart that lost every key.
///
/// KEYS: the lease, its token counter. ARGV: holder, ttl in ms.
/// Returns the token as a string, or nil when another holder has it.
const ACQUIRE: &str = r"
local current = redis.call('GET', KEYS[1])
if current then
  local sep = string.find(current, ':', 1, true)
  if string.sub(current, sep + 1) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return string.sub(current, 1, sep - 1)
  end
  return false
end
if redis.call('EXISTS', KEYS[2]) == 0 then
  local now = redis.call('TIME')
  redis.call('SET', KEYS[2], now[1] .. string.sub('000000' .. now[2], -6))
end
redis.call('INCR', KEYS[2])
local token = redis.call('GET', KEYS[2])
redis.call('SET', KEYS[1], token .. ':' .. ARGV[1], 'NX', 'PX', ARGV[2])
return token
";

/// Deletes the lease only if this holder still has it under this token.
///
/// KEYS: the lease. ARGV: holder, token. Returns 1 if it was released.
const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[2] .. ':' .. ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
";

/// Builds [`RedisLeases`]. Defaults: keys under [`DEFAULT_KEY_PREFIX`],
/// every command and connection attempt within [`DEFAULT_TIMEOUT`].
#[derive(Debug, Clone)]
#[must_use]
pub struct RedisLeasesBuilder {
    url: String,
    key_prefix: String,
    timeout: Duration,
}

impl RedisLeasesBuilder {
    /// Puts every key under `prefix` (default [`DEFAULT_KEY_PREFIX`]), so
    /// several services can share one Redis.
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// How long a command or a connection attempt may take (default
    /// [`DEFAULT_TIMEOUT`]). Keep it well under the leases' time to live:
    /// a renewal that takes longer than what is left of the lease is a
    /// renewal of a lease already lost.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Checks the settings and makes the client. It connects on first use
    /// (and again after a dropped connection), so a Redis that is down at
    /// start is an error of the first call, not of the build. Call it
    /// inside a tokio runtime.
    pub fn build(self) -> Result<RedisLeases, RedisConfigError> {
        let connection = connect(&self.url, self.timeout)?;
        Ok(RedisLeases {
            connection,
            key_prefix: self.key_prefix.into(),
            acquire: Arc::new(Script::new(ACQUIRE)),
            release: Arc::new(Script::new(RELEASE)),
        })
    }
}

/// Leases on Redis; see the [crate docs](crate) for what a Redis lease
/// promises and what it does not. Cheap to clone: clones share one
/// multiplexed connection.
#[derive(Clone)]
pub struct RedisLeases {
    connection: ConnectionManager,
    key_prefix: Arc<str>,
    acquire: Arc<Script>,
    release: Arc<Script>,
}

impl std::fmt::Debug for RedisLeases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisLeases")
            .field("key_prefix", &self.key_prefix)
            .finish_non_exhaustive()
    }
}

impl RedisLeases {
    /// A builder for the Redis at `url` (`redis://host:port/db`).
    pub fn builder(url: impl Into<String>) -> RedisLeasesBuilder {
        RedisLeasesBuilder {
            url: url.into(),
            key_prefix: DEFAULT_KEY_PREFIX.to_owned(),
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Asks Redis for a `PONG`: the deep health check's ping (never a
    /// readiness check, which a Redis blip must not fail on every
    /// instance at once).
    pub async fn ping(&self) -> Result<(), StoreError> {
        let mut connection = self.connection.clone();
        redis::cmd("PING")
            .query_async::<String>(&mut connection)
            .await
            .map(drop)
            .map_err(store_error)
    }

    /// The lease's key and its token counter's: one hash tag, so both live
    /// on one node of a Redis Cluster and one script may touch both.
    fn keys(&self, name: &str) -> (String, String) {
        let prefix = &self.key_prefix;
        (
            format!("{prefix}lease:{{{name}}}"),
            format!("{prefix}lease-token:{{{name}}}"),
        )
    }
}

#[async_trait]
impl LeaseStore for RedisLeases {
    async fn lease_acquire(
        &self,
        name: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<LeaseGrant>, StoreError> {
        let ttl_ms = u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1);
        // Before the call: the lease cannot end earlier than this says.
        let asked_at = clock::utc_now();
        let (lease, counter) = self.keys(name);
        let mut connection = self.connection.clone();
        let token: Option<String> = self
            .acquire
            .key(lease)
            .key(counter)
            .arg(holder)
            .arg(ttl_ms)
            .invoke_async(&mut connection)
            .await
            .map_err(store_error)?;
        let Some(token) = token else {
            return Ok(None);
        };
        let token = token
            .parse::<u64>()
            .map_err(|e| StoreError::other(format!("lease token `{token}` from Redis: {e}")))?;
        let ttl = chrono::Duration::milliseconds(i64::try_from(ttl_ms).unwrap_or(i64::MAX));
        Ok(Some(LeaseGrant {
            token,
            expires_at: asked_at + ttl,
        }))
    }

    async fn lease_release(
        &self,
        name: &str,
        holder: &str,
        token: u64,
    ) -> Result<bool, StoreError> {
        let (lease, _) = self.keys(name);
        let mut connection = self.connection.clone();
        let released: i64 = self
            .release
            .key(lease)
            .arg(holder)
            .arg(token.to_string())
            .invoke_async(&mut connection)
            .await
            .map_err(store_error)?;
        Ok(released == 1)
    }
}
