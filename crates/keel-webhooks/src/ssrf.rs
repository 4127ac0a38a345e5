//! The SSRF guard: webhook URLs are customer input, so the sender refuses
//! to call private, loopback, link-local and other internal addresses.
//!
//! A webhook sender makes HTTP requests to URLs its customers typed in, from
//! inside your network. Without a guard, `http://169.254.169.254/latest/meta-data/`
//! reads the cloud metadata service (credentials included), and
//! `http://10.0.0.5:6379/` talks to your Redis. The guard closes each way
//! around it:
//!
//! - **Every internal range is refused**: private (10/8, 172.16/12,
//!   192.168/16), loopback (127/8, ::1), link-local (169.254/16 with the
//!   metadata address, fe80::/10), CGNAT (100.64/10), unique-local
//!   (fc00::/7), unspecified, multicast, broadcast, reserved, benchmarking
//!   and documentation ranges, and IPv6 forms that embed an IPv4 address
//!   (IPv4-mapped `::ffff:a9fe:a9fe`, IPv4-compatible, NAT64 `64:ff9b::/96`,
//!   6to4 `2002::/16`) are judged by the IPv4 address inside. Odd IPv4
//!   spellings (`http://2130706433/`, `http://0x7f.1/`) are normalised by
//!   the URL parser first.
//! - **DNS is resolved by the guard itself** ([`tokio::net::lookup_host`]),
//!   and a name with *any* forbidden address is refused (which address a
//!   client picks is not ours to predict).
//! - **The checked address is the one connected to.** The HTTP client built
//!   by [`SsrfGuard::client_builder`] resolves through the guard
//!   ([`reqwest::dns::Resolve`]), so the addresses checked are exactly the
//!   addresses reqwest connects to: a DNS answer that changes between a
//!   check and the connection (DNS rebinding) is checked again, at the
//!   moment of connecting. IP literals skip DNS in reqwest, so
//!   [`SsrfGuard::check_url`] checks them before every request. Proxies are
//!   switched off: a proxy would connect on our behalf, unchecked.
//! - **Redirects are followed by the sender, one hop at a time**, and every
//!   hop is checked like the first (reqwest's own redirects are off).
//!
//! Tests and internal deployments that *mean* to call an internal address
//! say so with an explicit allow-list of networks ([`SsrfGuard::allow`]),
//! e.g. `127.0.0.1/32` for a loopback test receiver.
//!
//! ```
//! use keel_webhooks::ssrf::{SsrfGuard, SsrfError};
//!
//! let guard = SsrfGuard::new();
//! let metadata = "http://169.254.169.254/latest/meta-data/".parse().unwrap();
//! assert!(matches!(guard.check_url(&metadata), Err(SsrfError::Forbidden { .. })));
//! let mapped = "http://[::ffff:a9fe:a9fe]/".parse().unwrap();
//! assert!(matches!(guard.check_url(&mapped), Err(SsrfError::Forbidden { .. })));
//!
//! let tests = SsrfGuard::new().allow("127.0.0.1/32".parse().unwrap());
//! assert!(tests.check_url(&"http://127.0.0.1:8080/hook".parse().unwrap()).is_ok());
//! ```

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use reqwest::Url;
use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use reqwest::redirect;

mod network;

use network::mask128;
pub use network::{InvalidNetwork, IpNetwork};

/// How long a DNS lookup may take before the URL is refused (retryably).
pub const DEFAULT_RESOLVE_TIMEOUT: Duration = Duration::from_secs(5);
/// The longest URL accepted, in bytes.
pub const MAX_URL_LEN: usize = 2048;

/// Why the guard refused a URL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SsrfError {
    /// The URL does not parse.
    #[error("invalid webhook URL: {0}")]
    InvalidUrl(String),
    /// Not `http` or `https` (or not `https` where that is required).
    #[error("webhook URLs must use {allowed}, not `{scheme}`")]
    Scheme {
        /// The URL's scheme.
        scheme: String,
        /// What is allowed.
        allowed: &'static str,
    },
    /// The URL has no host.
    #[error("webhook URL has no host")]
    MissingHost,
    /// The URL carries a user name or password.
    #[error("webhook URLs must not carry credentials (user:password@); sign requests instead")]
    Credentials,
    /// The URL is longer than [`MAX_URL_LEN`].
    #[error("webhook URL is {len} bytes long; the limit is {MAX_URL_LEN}")]
    TooLong {
        /// Its length.
        len: usize,
    },
    /// The host is, or resolves to, an address in a forbidden range.
    ///
    /// The message names neither the address nor its range: a caller
    /// registering URLs must not learn what internal names resolve to.
    /// Both are in the server's log.
    #[error("{}", refusal(host))]
    Forbidden {
        /// The host as written.
        host: String,
        /// The forbidden address.
        ip: IpAddr,
        /// The range it is in.
        range: &'static str,
    },
    /// The name did not resolve (when a delivery is attempted: try again
    /// later). Said as a refusal is, so that no caller tells a name that
    /// does not exist from one that resolves inside; `reason` is logged.
    #[error("{}", refusal(host))]
    Resolve {
        /// The host.
        host: String,
        /// What the resolver said.
        reason: String,
    },
    /// The name resolved to no address (as [`Resolve`](Self::Resolve)).
    #[error("{}", refusal(host))]
    NoAddress {
        /// The host.
        host: String,
    },
    /// The name did not resolve when the endpoint was registered: refused
    /// as a forbidden address is, in the same words, so that registering
    /// URLs cannot probe which internal names exist.
    #[error("{}", refusal(host))]
    Unresolvable {
        /// The host.
        host: String,
    },
}

/// What every refusal of a host says, whatever the reason (forbidden,
/// unresolvable): the same words, naming no address or range.
fn refusal(host: &str) -> String {
    format!(
        "refusing to call {host}: it does not resolve to an address webhooks may call; \
         webhooks may only call public addresses (an operator can allow-list a network)"
    )
}

impl SsrfError {
    /// Whether trying again later may succeed (a resolver failure); a
    /// refused address or a bad URL stays refused.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Resolve { .. } | Self::NoAddress { .. })
    }
}

/// Refuses URLs and addresses in internal ranges, except explicitly allowed
/// networks. Cheap to clone.
#[derive(Debug, Clone)]
pub struct SsrfGuard {
    inner: Arc<GuardInner>,
}

#[derive(Clone)]
struct GuardInner {
    allow: Vec<IpNetwork>,
    deny: Vec<SocketAddr>,
    https_only: bool,
    resolve_timeout: Duration,
    resolver: Option<ResolveFn>,
}

impl fmt::Debug for GuardInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SsrfGuard")
            .field("allow", &self.allow)
            .field("deny", &self.deny)
            .field("https_only", &self.https_only)
            .field("resolve_timeout", &self.resolve_timeout)
            .field("custom_resolver", &self.resolver.is_some())
            .finish()
    }
}

/// A DNS resolver the guard can use instead of the system's: a host and a
/// port in, the socket addresses out.
pub type ResolveFn =
    Arc<dyn Fn(String, u16) -> BoxFuture<'static, std::io::Result<Vec<SocketAddr>>> + Send + Sync>;

impl Default for SsrfGuard {
    fn default() -> Self {
        Self::new()
    }
}

impl SsrfGuard {
    /// A guard refusing every internal range, with no exceptions, `http`
    /// and `https` allowed.
    pub fn new() -> Self {
        Self {
            inner: Arc::new(GuardInner {
                allow: Vec::new(),
                deny: Vec::new(),
                https_only: false,
                resolve_timeout: DEFAULT_RESOLVE_TIMEOUT,
                resolver: None,
            }),
        }
    }

    /// Allows addresses in `network` even if they are in a forbidden range
    /// (a loopback test receiver, a known internal service).
    pub fn allow(mut self, network: IpNetwork) -> Self {
        Arc::make_mut(&mut self.inner).allow.push(network);
        self
    }

    /// Refuses plain `http` URLs (default: allowed).
    pub fn https_only(mut self, https_only: bool) -> Self {
        Arc::make_mut(&mut self.inner).https_only = https_only;
        self
    }

    /// How long a DNS lookup may take (default [`DEFAULT_RESOLVE_TIMEOUT`]).
    pub fn resolve_timeout(mut self, timeout: Duration) -> Self {
        Arc::make_mut(&mut self.inner).resolve_timeout = timeout;
        self
    }

    /// Resolves names with `resolver` instead of the system's
    /// [`tokio::net::lookup_host`] (your own DNS client, or a test double);
    /// every address it returns is still checked.
    pub fn resolver(mut self, resolver: ResolveFn) -> Self {
        Arc::make_mut(&mut self.inner).resolver = Some(resolver);
        self
    }

    /// Never calls `addr`, even inside an allowed network: the server's
    /// own listeners, so a webhook cannot be aimed at its admin API. An
    /// unspecified address (`0.0.0.0:8080`) stands for every address on
    /// that port. Names are checked with their port when an endpoint is
    /// registered and before every attempt.
    pub fn deny(mut self, addr: SocketAddr) -> Self {
        Arc::make_mut(&mut self.inner).deny.push(addr);
        self
    }

    /// Whether some socket is denied (so attempts resolve names first).
    pub fn denies_sockets(&self) -> bool {
        !self.inner.deny.is_empty()
    }

    fn check_socket(&self, host: &str, addr: SocketAddr) -> Result<(), SsrfError> {
        // Canonical forms: `::ffff:127.0.0.1` is `127.0.0.1`.
        let ip = addr.ip().to_canonical();
        let denied = self.inner.deny.iter().any(|d| {
            let denied_ip = d.ip().to_canonical();
            d.port() == addr.port()
                && (denied_ip == ip || denied_ip.is_unspecified() || ip.is_unspecified())
        });
        if !denied {
            return Ok(());
        }
        metrics::counter!("keel_webhook_ssrf_refused_total", "range" => "own listener")
            .increment(1);
        tracing::warn!(host, %addr, "SSRF guard refused the server's own listener");
        Err(SsrfError::Forbidden {
            host: host.to_owned(),
            ip: addr.ip(),
            range: "own listener",
        })
    }

    /// The allow-list.
    pub fn allowed(&self) -> &[IpNetwork] {
        &self.inner.allow
    }

    /// Whether the guard lets the client connect to `ip`.
    pub fn check_ip(&self, host: &str, ip: IpAddr) -> Result<(), SsrfError> {
        if self.inner.allow.iter().any(|net| net.contains(ip)) {
            return Ok(());
        }
        match forbidden_range(ip) {
            None => Ok(()),
            Some(range) => {
                metrics::counter!("keel_webhook_ssrf_refused_total", "range" => range).increment(1);
                tracing::warn!(host, %ip, range, "SSRF guard refused an address");
                Err(SsrfError::Forbidden {
                    host: host.to_owned(),
                    ip,
                    range,
                })
            }
        }
    }

    /// Checks a URL without DNS: the scheme, credentials, length, and the
    /// address if the host is an IP literal. Names are checked when they
    /// are resolved ([`resolve`](Self::resolve), and the guarded client's
    /// resolver at connection time).
    pub fn check_url(&self, url: &Url) -> Result<(), SsrfError> {
        let len = url.as_str().len();
        if len > MAX_URL_LEN {
            return Err(SsrfError::TooLong { len });
        }
        let allowed = if self.inner.https_only {
            "https"
        } else {
            "http or https"
        };
        match url.scheme() {
            "https" => {}
            "http" if !self.inner.https_only => {}
            other => {
                return Err(SsrfError::Scheme {
                    scheme: other.to_owned(),
                    allowed,
                });
            }
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err(SsrfError::Credentials);
        }
        let host = url.host_str().unwrap_or_default();
        match literal_ip(url) {
            Err(err) => Err(err),
            Ok(Some(ip)) => {
                let port = url.port_or_known_default().unwrap_or(0);
                self.check_socket(host, SocketAddr::new(ip, port))?;
                self.check_ip(host, ip)
            }
            Ok(None) => Ok(()),
        }
    }

    /// Parses and checks a URL, resolving its host: what to call when an
    /// endpoint is registered, so a bad URL is refused at once rather than
    /// at its first delivery. Returns the parsed URL. A name that does not
    /// resolve is [`SsrfError::Unresolvable`], refused for good and in the
    /// words of a forbidden one.
    pub async fn check(&self, url: &str) -> Result<Url, SsrfError> {
        if url.len() > MAX_URL_LEN {
            return Err(SsrfError::TooLong { len: url.len() });
        }
        let parsed = Url::parse(url).map_err(|e| SsrfError::InvalidUrl(e.to_string()))?;
        self.check_url(&parsed)?;
        if literal_ip(&parsed)?.is_none() {
            let host = parsed.host_str().unwrap_or_default();
            self.resolve(host, parsed.port_or_known_default().unwrap_or(0))
                .await
                .map_err(|err| match err {
                    SsrfError::Resolve { host, reason } => {
                        tracing::info!(
                            host,
                            reason,
                            "webhook URL refused: its name does not resolve"
                        );
                        SsrfError::Unresolvable { host }
                    }
                    SsrfError::NoAddress { host } => SsrfError::Unresolvable { host },
                    other => other,
                })?;
        }
        Ok(parsed)
    }

    /// Resolves `host` with [`tokio::net::lookup_host`] (or the configured
    /// [`resolver`](Self::resolver)) and checks every address: all of them
    /// pass, or the name is refused.
    pub async fn resolve(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, SsrfError> {
        let lookup = async {
            match &self.inner.resolver {
                Some(resolver) => resolver(host.to_owned(), port).await,
                None => tokio::net::lookup_host((host, port))
                    .await
                    .map(|addrs| addrs.collect()),
            }
        };
        let addrs: Vec<SocketAddr> =
            match tokio::time::timeout(self.inner.resolve_timeout, lookup).await {
                Ok(Ok(addrs)) => addrs,
                Ok(Err(err)) => {
                    return Err(SsrfError::Resolve {
                        host: host.to_owned(),
                        reason: err.to_string(),
                    });
                }
                Err(_) => {
                    return Err(SsrfError::Resolve {
                        host: host.to_owned(),
                        reason: format!("timed out after {:?}", self.inner.resolve_timeout),
                    });
                }
            };
        if addrs.is_empty() {
            return Err(SsrfError::NoAddress {
                host: host.to_owned(),
            });
        }
        for addr in &addrs {
            if port != 0 {
                self.check_socket(host, *addr)?;
            }
            self.check_ip(host, addr.ip())?;
        }
        Ok(addrs)
    }

    /// A reqwest client builder that resolves names through this guard
    /// (every connection goes to an address the guard checked), follows no
    /// redirects and uses no proxy. Follow redirects yourself, checking each
    /// `Location` with [`check_url`](Self::check_url).
    pub fn client_builder(&self) -> reqwest::ClientBuilder {
        reqwest::Client::builder()
            .dns_resolver(Arc::new(GuardedResolver {
                guard: self.clone(),
            }))
            .redirect(redirect::Policy::none())
            .no_proxy()
    }
}

/// The URL's host as an address, if it is an IP literal (the URL parser
/// has normalised odd IPv4 spellings and bracketed IPv6 already).
fn literal_ip(url: &Url) -> Result<Option<IpAddr>, SsrfError> {
    let host = url.host_str().ok_or(SsrfError::MissingHost)?;
    if host.is_empty() {
        return Err(SsrfError::MissingHost);
    }
    let bare = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    Ok(bare.parse::<IpAddr>().ok())
}

/// reqwest's resolver, through the guard.
#[derive(Debug)]
struct GuardedResolver {
    guard: SsrfGuard,
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let guard = self.guard.clone();
        Box::pin(async move {
            // Port 0: reqwest puts the URL's port (or the scheme's) in.
            let addrs = guard.resolve(name.as_str(), 0).await?;
            Ok(Box::new(addrs.into_iter()) as Addrs)
        })
    }
}

/// The forbidden range `ip` is in, by name, or `None` for a public address.
///
/// IPv6 addresses that embed an IPv4 address (mapped, compatible,
/// translated, NAT64, 6to4) are judged by the embedded address.
pub fn forbidden_range(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => forbidden_v6(v6),
    }
}

fn forbidden_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let [a, b, c, _] = ip.octets();
    Some(match (a, b, c) {
        _ if ip.is_unspecified() => "unspecified",
        _ if ip.is_broadcast() => "broadcast",
        (0, ..) => "\"this network\" (0.0.0.0/8)",
        (10, ..) => "private (10.0.0.0/8)",
        (100, 64..=127, _) => "carrier-grade NAT (100.64.0.0/10)",
        (127, ..) => "loopback (127.0.0.0/8)",
        (169, 254, _) => "link-local (169.254.0.0/16, cloud metadata)",
        (172, 16..=31, _) => "private (172.16.0.0/12)",
        (192, 0, 0) => "IETF protocol assignments (192.0.0.0/24)",
        (192, 0, 2) => "documentation (192.0.2.0/24)",
        (192, 88, 99) => "6to4 relay anycast (192.88.99.0/24)",
        (192, 168, _) => "private (192.168.0.0/16)",
        (198, 18..=19, _) => "benchmarking (198.18.0.0/15)",
        (198, 51, 100) => "documentation (198.51.100.0/24)",
        (203, 0, 113) => "documentation (203.0.113.0/24)",
        (224..=239, ..) => "multicast (224.0.0.0/4)",
        (240..=255, ..) => "reserved (240.0.0.0/4)",
        _ => return None,
    })
}

fn forbidden_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let bits = u128::from(ip);
    let segments = ip.segments();
    let embedded = Ipv4Addr::from((bits & 0xffff_ffff) as u32);
    if ip.is_unspecified() {
        return Some("unspecified (::)");
    }
    if ip.is_loopback() {
        return Some("loopback (::1)");
    }
    // ::ffff:a.b.c.d (mapped) and ::ffff:0:a.b.c.d (translated).
    if bits >> 32 == 0xffff || bits >> 32 == 0xffff_0000 {
        return forbidden_v4(embedded);
    }
    // ::a.b.c.d (IPv4-compatible, deprecated).
    if bits >> 32 == 0 {
        return Some(forbidden_v4(embedded).unwrap_or("IPv4-compatible (::/96, deprecated)"));
    }
    // 64:ff9b::a.b.c.d (NAT64): the gateway would connect to the IPv4 address.
    if bits >> 32 == 0x0064_ff9b_0000_0000_0000_0000_u128 {
        return forbidden_v4(embedded);
    }
    // 2002:a.b.c.d::/48 (6to4).
    if segments[0] == 0x2002 {
        let inner = Ipv4Addr::from(((bits >> 80) & 0xffff_ffff) as u32);
        return forbidden_v4(inner);
    }
    let prefix = |len: u8, net: u128| bits & mask128(len) == net;
    Some(match () {
        _ if prefix(48, 0x0064_ff9b_0001_u128 << 80) => "NAT64 local use (64:ff9b:1::/48)",
        _ if prefix(64, 0x0100_u128 << 112) => "discard-only (100::/64)",
        _ if prefix(32, 0x2001_0db8_u128 << 96) => "documentation (2001:db8::/32)",
        _ if prefix(23, 0x2001_u128 << 112) => "IETF protocol assignments (2001::/23, Teredo)",
        _ if prefix(20, 0x3fff_u128 << 112) => "documentation (3fff::/20)",
        _ if prefix(7, 0xfc00_u128 << 112) => "unique-local (fc00::/7)",
        _ if prefix(10, 0xfe80_u128 << 112) => "link-local (fe80::/10)",
        _ if prefix(10, 0xfec0_u128 << 112) => "site-local (fec0::/10, deprecated)",
        _ if prefix(8, 0xff00_u128 << 112) => "multicast (ff00::/8)",
        _ => return None,
    })
}

#[cfg(test)]
mod tests;
