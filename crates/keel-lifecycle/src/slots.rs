//! Connection slots with a share per client address, for any server that
//! must not let one client take what every other needs: keel-http's
//! connections and TLS handshakes, and keel-grpc's connections.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// A pool of connection slots with a share per client address: a server
/// takes one per connection it accepts, and refuses the connection when
/// there is none (see [`ConnectionLimits`](crate::ConnectionLimits)). The map holds only
/// addresses with a connection open, so it is never larger than the pool.
#[derive(Debug)]
pub struct ConnectionSlots {
    all: Arc<Semaphore>,
    per_address: usize,
    held: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

/// One slot of [`ConnectionSlots`], given back when dropped.
#[derive(Debug)]
pub struct ConnectionSlot {
    _permit: OwnedSemaphorePermit,
    address: IpAddr,
    held: Arc<Mutex<HashMap<IpAddr, usize>>>,
}

impl ConnectionSlots {
    /// `all` slots, at most `per_address` of them for one client address.
    pub fn new(all: usize, per_address: usize) -> Self {
        Self {
            all: Arc::new(Semaphore::new(all)),
            per_address,
            held: Arc::default(),
        }
    }

    /// A slot for a connection from `address`, unless the pool or the
    /// address's share is full. An IPv6 address shares with its whole /64
    /// (one host is given a /64 to choose from), an IPv4-mapped one with
    /// its IPv4 address.
    pub fn try_take(&self, address: IpAddr) -> Option<ConnectionSlot> {
        let address = share_key(address);
        let mut held = self.held.lock();
        if held.get(&address).is_some_and(|n| *n >= self.per_address) {
            metrics::counter!("keel_http_address_share_refused_total").increment(1);
            return None;
        }
        let permit = Arc::clone(&self.all).try_acquire_owned().ok()?;
        *held.entry(address).or_insert(0) += 1;
        Some(ConnectionSlot {
            _permit: permit,
            address,
            held: Arc::clone(&self.held),
        })
    }
}

/// The client that a connection from `address` counts against: the
/// address itself for IPv4 (mapped ones included), its /64 for IPv6.
pub fn share_key(address: IpAddr) -> IpAddr {
    match address.to_canonical() {
        IpAddr::V6(v6) => {
            let prefix = u128::from(v6) & !((1u128 << 64) - 1);
            IpAddr::V6(prefix.into())
        }
        v4 => v4,
    }
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        let mut held = self.held.lock();
        if let Some(count) = held.get_mut(&self.address) {
            *count -= 1;
            if *count == 0 {
                held.remove(&self.address);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ipv6_host_shares_with_its_64_and_a_mapped_address_with_its_ipv4() {
        let slots = ConnectionSlots::new(10, 2);
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let _a = slots.try_take(ip("2001:db8::1")).unwrap();
        let _b = slots.try_take(ip("2001:db8::ffff:2")).unwrap();
        assert!(
            slots.try_take(ip("2001:db8::3")).is_none(),
            "the /64's share"
        );
        assert!(
            slots.try_take(ip("2001:db8:0:1::1")).is_some(),
            "another /64"
        );
        let _c = slots.try_take(ip("192.0.2.1")).unwrap();
        let _d = slots.try_take(ip("::ffff:192.0.2.1")).unwrap();
        assert!(slots.try_take(ip("192.0.2.1")).is_none(), "one IPv4 client");
    }
}
