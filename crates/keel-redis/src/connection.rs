//! The connection every Redis-backed store here shares the settings of.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};

use crate::error::RedisConfigError;

/// How long a command, or a connection attempt, may take by default: 1 s.
/// A call that cannot reach Redis in that time fails, and the caller keeps
/// believing only what its last answer said.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(1);

/// What every key starts with by default: `keel:`.
pub const DEFAULT_KEY_PREFIX: &str = "keel:";

/// A multiplexed connection to the Redis at `url`, made on first use and
/// again after a drop, every command and connection attempt within
/// `timeout`. Call it inside a tokio runtime.
pub(crate) fn connect(url: &str, timeout: Duration) -> Result<ConnectionManager, RedisConfigError> {
    if timeout.is_zero() {
        return Err(RedisConfigError::Invalid {
            field: "timeout",
            problem: "must be more than zero",
        });
    }
    let invalid = |source| RedisConfigError::InvalidUrl {
        url: url.to_owned(),
        source,
    };
    let client = redis::Client::open(url).map_err(invalid)?;
    let config = ConnectionManagerConfig::new()
        .set_connection_timeout(Some(timeout))
        .set_response_timeout(Some(timeout))
        .set_number_of_retries(2);
    ConnectionManager::new_lazy_with_config(client, config).map_err(invalid)
}
