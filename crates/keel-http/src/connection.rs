//! [`ConnectionInfo`]: what a connection knows about its peer, put on each
//! of its requests by Keel's server.

use axum::http::Extensions;

/// What an accepted connection knows about its peer beyond its address
/// (a TLS connection: the client certificate's identity). Keel's server
/// asks once per connection and adds the result to every request's
/// extensions, beside `ConnectInfo<SocketAddr>`.
///
/// A custom listener's stream implements it, usually with the default
/// (nothing to add).
pub trait ConnectionInfo {
    /// Adds what this connection knows to `extensions` (default: nothing).
    fn extend(&self, extensions: &mut Extensions) {
        let _ = extensions;
    }
}

impl ConnectionInfo for tokio::net::TcpStream {}

#[cfg(unix)]
impl ConnectionInfo for tokio::net::UnixStream {}

#[cfg(feature = "health")]
impl<T: ConnectionInfo> ConnectionInfo for keel_lifecycle::DrainStream<T> {
    fn extend(&self, extensions: &mut Extensions) {
        self.get_ref().extend(extensions);
    }
}
