//! IP networks in CIDR form, the unit of the guard's allow-list.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

/// An IP network in CIDR form (`10.0.0.0/8`, `::1/128`; a bare address is
/// a single host).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IpNetwork {
    addr: IpAddr,
    prefix: u8,
}

impl IpNetwork {
    /// The network of `addr` with `prefix` leading bits; the host bits of
    /// `addr` are cleared. Refuses a prefix longer than the address.
    pub fn new(addr: IpAddr, prefix: u8) -> Result<Self, InvalidNetwork> {
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return Err(InvalidNetwork(format!(
                "prefix /{prefix} is longer than {max} bits"
            )));
        }
        let addr = match addr {
            IpAddr::V4(v4) => IpAddr::V4(Ipv4Addr::from(u32::from(v4) & mask32(prefix))),
            IpAddr::V6(v6) => IpAddr::V6(Ipv6Addr::from(u128::from(v6) & mask128(prefix))),
        };
        Ok(Self { addr, prefix })
    }

    /// Whether `ip` is in the network (an IPv4-mapped IPv6 address counts
    /// as its IPv4 address).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.addr, ip.to_canonical()) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                u32::from(ip) & mask32(self.prefix) == u32::from(net)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                u128::from(ip) & mask128(self.prefix) == u128::from(net)
            }
            _ => false,
        }
    }
}

fn mask32(prefix: u8) -> u32 {
    u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0)
}

pub(super) fn mask128(prefix: u8) -> u128 {
    u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0)
}

impl FromStr for IpNetwork {
    type Err = InvalidNetwork;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (addr, prefix) = match s.split_once('/') {
            Some((addr, prefix)) => (
                addr,
                Some(
                    prefix
                        .parse::<u8>()
                        .map_err(|_| InvalidNetwork(format!("bad prefix length in {s:?}")))?,
                ),
            ),
            None => (s, None),
        };
        let addr: IpAddr = addr
            .parse()
            .map_err(|_| InvalidNetwork(format!("bad address in {s:?}")))?;
        let prefix = prefix.unwrap_or(if addr.is_ipv4() { 32 } else { 128 });
        Self::new(addr, prefix)
    }
}

impl fmt::Display for IpNetwork {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// A network could not be parsed or built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid IP network: {0} (write e.g. `10.0.0.0/8` or `::1/128`)")]
pub struct InvalidNetwork(String);
