//! Limits on every connection a server accepts, so that no client holds
//! it open: a request head sent a byte a minute, a connection opened and
//! never used, a thousand of either.
//!
//! - **header read timeout**: the whole request head must arrive within
//!   it, counted from the moment the connection waits for one (so it also
//!   bounds an idle keep-alive connection between requests);
//! - **idle timeout**: a connection that moves no byte either way for this
//!   long is asked to close, and dropped if it stays silent;
//! - **body read timeout**: a request's body must arrive whole within it,
//!   counted from its head, however steadily its bytes trickle in;
//! - **connection cap**, and **a share per address** of it
//!   ([`ConnectionSlots`]): one client address cannot take what every
//!   other client needs (an IPv6 /64 counts as one address). Behind a
//!   proxy every client shares the proxy's address: raise the share to
//!   the cap there, and bound clients at the proxy.
//!
//! keel-http's server enforces all five; keel-grpc's enforces the cap,
//! the share and the time to start a connection.

use std::time::Duration;

use keel_policy::ConfigError;

use crate::slots::ConnectionSlots;

/// The default header read timeout: 10 s.
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// The default idle timeout: 60 s, above a long poll's 25 s wait and an
/// SSE stream's 15 s keep-alive.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// The default cap on open connections: 1,024.
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;

/// The default share of the connections one client address may hold: 256.
pub const DEFAULT_MAX_CONNECTIONS_PER_ADDRESS: usize = 256;

/// The default body read timeout: 10 s.
pub const DEFAULT_BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Limits on every connection a server accepts; see the module docs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionLimits {
    header_read_timeout: Duration,
    body_read_timeout: Duration,
    idle_timeout: Duration,
    max_connections: usize,
    max_connections_per_address: usize,
}

impl Default for ConnectionLimits {
    fn default() -> Self {
        Self {
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            body_read_timeout: DEFAULT_BODY_READ_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_address: DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
        }
    }
}

impl ConnectionLimits {
    /// The defaults: [`DEFAULT_HEADER_READ_TIMEOUT`],
    /// [`DEFAULT_BODY_READ_TIMEOUT`], [`DEFAULT_IDLE_TIMEOUT`],
    /// [`DEFAULT_MAX_CONNECTIONS`], [`DEFAULT_MAX_CONNECTIONS_PER_ADDRESS`].
    pub fn new() -> Self {
        Self::default()
    }

    /// How long a request's body may take to arrive whole, from its head.
    pub fn body_read_timeout(mut self, timeout: Duration) -> Self {
        self.body_read_timeout = timeout;
        self
    }

    /// How many of the connections one client address may hold (capped at
    /// `max_connections`).
    pub fn max_connections_per_address(mut self, max: usize) -> Self {
        self.max_connections_per_address = max;
        self
    }

    /// The share of one client address.
    pub fn per_address(&self) -> usize {
        self.max_connections_per_address.min(self.max_connections)
    }

    /// How long a request head may take to arrive.
    pub fn header_read_timeout(mut self, timeout: Duration) -> Self {
        self.header_read_timeout = timeout;
        self
    }

    /// How long a connection may stay silent.
    pub fn idle_timeout(mut self, timeout: Duration) -> Self {
        self.idle_timeout = timeout;
        self
    }

    /// How many connections may be open at once.
    pub fn max_connections(mut self, max: usize) -> Self {
        self.max_connections = max;
        self
    }

    /// The idle timeout.
    pub fn idle(&self) -> Duration {
        self.idle_timeout
    }

    /// Checks that no limit is zero.
    pub fn validate(self) -> Result<Self, ConfigError> {
        if self.header_read_timeout.is_zero() {
            return Err(ConfigError::new(
                "header_read_timeout",
                "must be more than zero",
            ));
        }
        if self.idle_timeout.is_zero() {
            return Err(ConfigError::new("idle_timeout", "must be more than zero"));
        }
        if self.max_connections == 0 {
            return Err(ConfigError::new("max_connections", "must be at least 1"));
        }
        if self.body_read_timeout.is_zero() {
            return Err(ConfigError::new(
                "body_read_timeout",
                "must be more than zero",
            ));
        }
        if self.max_connections_per_address == 0 {
            return Err(ConfigError::new(
                "max_connections_per_address",
                "must be at least 1",
            ));
        }
        Ok(self)
    }

    /// Slots for `max_connections` connections, each address's share of
    /// them as `max_connections_per_address` says.
    pub fn connection_slots(&self) -> ConnectionSlots {
        ConnectionSlots::new(self.max_connections, self.per_address())
    }

    /// The header read timeout.
    pub fn header_read(&self) -> Duration {
        self.header_read_timeout
    }

    /// The body read timeout.
    pub fn body_read(&self) -> Duration {
        self.body_read_timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_limit_may_be_zero() {
        assert!(ConnectionLimits::new().validate().is_ok());
        for limits in [
            ConnectionLimits::new().header_read_timeout(Duration::ZERO),
            ConnectionLimits::new().idle_timeout(Duration::ZERO),
            ConnectionLimits::new().max_connections(0),
            ConnectionLimits::new().body_read_timeout(Duration::ZERO),
            ConnectionLimits::new().max_connections_per_address(0),
        ] {
            assert!(limits.validate().is_err());
        }
    }
}
