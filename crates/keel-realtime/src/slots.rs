//! [`ClientSlots`]: how many long-lived connections (SSE streams,
//! WebSockets, waiting long polls) one client, and everyone together, may
//! hold.
//!
//! A long-lived connection costs a task, a subscription and a buffer for as
//! long as the client likes, so one client opening a thousand of them
//! starves everyone else. Clients are told apart by their address (the
//! server's `ConnectInfo`); behind a proxy every client shares the proxy's
//! address, so raise the per-client cap there or let the proxy enforce it.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;

use parking_lot::Mutex;

/// Long-lived connections one client address may hold by default: 16.
pub const DEFAULT_MAX_PER_CLIENT: usize = 16;

/// Long-lived connections all clients together may hold by default: 4,096.
pub const DEFAULT_MAX_TOTAL: usize = 4096;

#[derive(Debug, Default)]
struct Held {
    total: usize,
    by_client: HashMap<IpAddr, usize>,
}

/// The counts; see the [module docs](self). Cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct ClientSlots {
    per_client: usize,
    total: usize,
    held: Arc<Mutex<Held>>,
}

/// One held connection; dropping it frees the slot.
#[derive(Debug)]
pub(crate) struct ClientSlot {
    client: Option<IpAddr>,
    held: Arc<Mutex<Held>>,
}

impl ClientSlots {
    pub(crate) fn new(per_client: usize, total: usize) -> Self {
        Self {
            per_client,
            total,
            held: Arc::default(),
        }
    }

    /// A slot for `client`, or `None` when it (or everyone) holds the most
    /// allowed. A client of unknown address counts only towards the total.
    pub(crate) fn claim(&self, client: Option<IpAddr>) -> Option<ClientSlot> {
        let mut held = self.held.lock();
        if held.total >= self.total {
            return None;
        }
        if let Some(ip) = client {
            let count = held.by_client.entry(ip).or_default();
            if *count >= self.per_client {
                return None;
            }
            *count += 1;
        }
        held.total += 1;
        Some(ClientSlot {
            client,
            held: Arc::clone(&self.held),
        })
    }
}

impl Drop for ClientSlot {
    fn drop(&mut self) {
        let mut held = self.held.lock();
        held.total = held.total.saturating_sub(1);
        if let Some(ip) = self.client
            && let Some(count) = held.by_client.get_mut(&ip)
        {
            *count -= 1;
            if *count == 0 {
                held.by_client.remove(&ip);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_client_and_everyone_together_are_capped_and_slots_come_back() {
        let slots = ClientSlots::new(2, 3);
        let a: IpAddr = "192.0.2.1".parse().unwrap();
        let b: IpAddr = "192.0.2.2".parse().unwrap();
        let a1 = slots.claim(Some(a)).unwrap();
        let _a2 = slots.claim(Some(a)).unwrap();
        assert!(slots.claim(Some(a)).is_none(), "a holds its two");
        let _b1 = slots.claim(Some(b)).unwrap();
        assert!(slots.claim(Some(b)).is_none(), "three in all");
        assert!(slots.claim(None).is_none());
        drop(a1);
        assert!(slots.claim(Some(a)).is_some(), "a's slot came back");
    }
}
