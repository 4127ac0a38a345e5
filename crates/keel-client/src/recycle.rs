//! Connection recycling: a bounded life for the client's connections, so
//! that new backends get traffic.
//!
//! A keep-alive connection lives as long as both ends let it. Behind a
//! load balancer or a DNS name that is the problem: a client that opened
//! its connections before a scale-out keeps sending everything to the old
//! backends, and one that connected during a deploy keeps talking to the
//! instance that happened to answer first. The fix every mature client
//! has (gRPC's `MAX_CONNECTION_AGE`, Envoy's `max_connection_duration`,
//! Finagle's `maxLifeTime`) is to retire connections after a while.
//!
//! hyper's pool, under reqwest, has no per-connection age, so Keel retires
//! the *pool*: after [`ConnectionRecycling::max_lifetime`] or
//! [`ConnectionRecycling::max_requests`], the next call builds a fresh
//! `reqwest::Client` (new connections, a new DNS lookup) and the old one
//! closes its connections once its calls in flight finish. No connection
//! then outlives the bound by more than one call, and no call is cut off.

use std::sync::Arc;
use std::time::Duration;

use keel_core::clock::{self, Instant};
use parking_lot::Mutex;

/// When to replace the client's connections; see the [module docs](self).
/// The default never does.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConnectionRecycling {
    /// Retire connections this long after they were opened.
    pub max_lifetime: Option<Duration>,
    /// Retire connections after this many calls.
    pub max_requests: Option<u64>,
}

impl ConnectionRecycling {
    /// Connections retire after `lifetime` (a minute or a few is usual:
    /// long enough that the new handshakes cost nothing).
    pub fn after(lifetime: Duration) -> Self {
        Self {
            max_lifetime: Some(lifetime),
            max_requests: None,
        }
    }

    /// Connections also retire after `requests` calls.
    #[must_use]
    pub fn or_after_requests(mut self, requests: u64) -> Self {
        self.max_requests = Some(requests.max(1));
        self
    }

    fn is_due(&self, born: Instant, requests: u64, now: Instant) -> Option<&'static str> {
        if self
            .max_lifetime
            .is_some_and(|life| now.saturating_duration_since(born) >= life)
        {
            return Some("lifetime");
        }
        if self.max_requests.is_some_and(|max| requests >= max) {
            return Some("requests");
        }
        None
    }
}

type MakeClient = Arc<dyn Fn() -> reqwest::Client + Send + Sync>;

/// The client calls go through: one `reqwest::Client`, or one remade
/// whenever its [`ConnectionRecycling`] says so.
#[derive(Clone)]
pub(crate) struct ClientPool {
    make: Option<MakeClient>,
    recycling: ConnectionRecycling,
    current: Arc<Mutex<Generation>>,
}

struct Generation {
    client: reqwest::Client,
    born: Instant,
    requests: u64,
}

impl std::fmt::Debug for ClientPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientPool")
            .field("recycling", &self.recycling)
            .finish_non_exhaustive()
    }
}

impl ClientPool {
    pub(crate) fn fixed(client: reqwest::Client) -> Self {
        Self::with(None, ConnectionRecycling::default(), client)
    }

    pub(crate) fn recycling(make: MakeClient, recycling: ConnectionRecycling) -> Self {
        let client = make();
        Self::with(Some(make), recycling, client)
    }

    fn with(
        make: Option<MakeClient>,
        recycling: ConnectionRecycling,
        client: reqwest::Client,
    ) -> Self {
        Self {
            make,
            recycling,
            current: Arc::new(Mutex::new(Generation {
                client,
                born: clock::now(),
                requests: 0,
            })),
        }
    }

    /// The client to build requests with, without counting a call.
    pub(crate) fn peek(&self) -> reqwest::Client {
        self.current.lock().client.clone()
    }

    /// The client for one call: a fresh one first if the current one is
    /// due for retirement.
    pub(crate) fn for_call(&self) -> reqwest::Client {
        let mut current = self.current.lock();
        if let Some(make) = &self.make {
            let now = clock::now();
            if let Some(reason) = self.recycling.is_due(current.born, current.requests, now) {
                metrics::counter!("keel_http_client_recycled_total", "reason" => reason)
                    .increment(1);
                tracing::debug!(reason, "retiring the client's connections");
                *current = Generation {
                    client: make(),
                    born: now,
                    requests: 0,
                };
            }
        }
        current.requests += 1;
        current.client.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn due_by_lifetime_or_by_requests_and_never_by_default() {
        let born = clock::now();
        let later = born + Duration::from_secs(61);
        let both = ConnectionRecycling::after(Duration::from_secs(60)).or_after_requests(100);
        assert_eq!(both.is_due(born, 3, born), None);
        assert_eq!(both.is_due(born, 3, later), Some("lifetime"));
        assert_eq!(both.is_due(born, 100, born), Some("requests"));
        assert_eq!(
            ConnectionRecycling::default().is_due(born, u64::MAX, later),
            None
        );
        assert_eq!(
            ConnectionRecycling::after(Duration::from_secs(1))
                .or_after_requests(0)
                .max_requests,
            Some(1),
            "0 requests would remake the client on every call"
        );
    }
}
