//! Who may call what: the building blocks the admin API, the console and
//! the webhook management routes share.
//!
//! - [`AllowedHosts`]: the `Host` names a listener answers to. A browser
//!   tricked by DNS rebinding sends the attacker's name, so a server that
//!   trusts its loopback address must still refuse names it does not know.
//! - [`FailureThrottle`]: failed logins and bearer attempts per client
//!   address, so a token cannot be guessed at network speed.
//! - [`ApiKeys`] and [`ApiKeyLayer`]: callers that are tenants, each with
//!   its own key; the layer puts the [`Tenant`] in the request so handlers
//!   scope every read and write to it.
//! - [`client_ip`]: the peer address hyper accepted the connection from,
//!   and [`is_forwarded`]: whether that peer is a proxy;
//!   [`bearer`] and [`digest`]: the presented token and what is compared.

mod api_keys;
mod hosts;
mod throttle;

use std::net::{IpAddr, SocketAddr};

use axum::extract::ConnectInfo;
use axum::http::Extensions;

pub use api_keys::bearer;
pub use api_keys::{ApiKeyLayer, ApiKeys, ApiKeysError, RequireApiKey, Tenant};
pub use hosts::{AllowedHosts, InvalidHost};
pub use throttle::{DEFAULT_FAILURE_WINDOW, DEFAULT_MAX_FAILURES, FailureThrottle, Throttled};

/// The SHA-256 digest of a credential: what is kept and compared, in
/// constant time, instead of the credential.
pub fn digest(value: &str) -> [u8; 32] {
    use sha2::Digest as _;
    sha2::Sha256::digest(value.as_bytes()).into()
}

/// Whether a proxy forwarded the request (`Forwarded`, `X-Forwarded-For`
/// or `X-Real-IP`): its peer address is then the proxy's, not the
/// client's, and a loopback peer says nothing about who is calling.
pub fn is_forwarded(headers: &axum::http::HeaderMap) -> bool {
    ["forwarded", "x-forwarded-for", "x-real-ip"]
        .iter()
        .any(|name| headers.contains_key(*name))
}

/// The address of the peer the request came from, when the server recorded
/// it (`ConnectInfo<SocketAddr>`, which Keel's server and
/// `into_make_service_with_connect_info` insert).
pub fn client_ip(extensions: &Extensions) -> Option<IpAddr> {
    extensions
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(addr)| addr.ip())
}
