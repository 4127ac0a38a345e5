//! HTTPS for the edge: a rustls server configuration from PEM files, client
//! certificates, reloading without a restart, and a listener that
//! handshakes many clients at once.
//!
//! # Service-to-service identity (mTLS)
//!
//! [`TlsFiles::client_ca`] makes the server verify client certificates
//! against a CA: [`ClientAuth::Required`] refuses the handshake of a client
//! without one, [`ClientAuth::Optional`] lets it in (public routes stay
//! open) and leaves the decision to the routes. Either way a verified
//! client's [`PeerIdentity`] (the DNS and URI names of its certificate, a
//! SPIFFE ID among them) is put on each of its requests by Keel's server,
//! and [`RequirePeerLayer`] admits to a group of routes only the peers on
//! its allow-list, refusing the others with a `403` problem.
//!
//! # Reloading
//!
//! Certificates are short-lived now (a mesh's rotate daily), so a server
//! that must restart to take a new one drops connections every day.
//! [`ServerTls::watching`] re-reads the files when they change (checked
//! every [`RELOAD_CHECK_INTERVAL`]) and hands new handshakes the new
//! configuration; a file that does not load keeps the last good one and is
//! counted in `keel_http_tls_reloads_total{outcome="failed"}`. Open
//! connections keep the certificate they were made with.
//!
//! The handshake is where a naive TLS server is easiest to stall: done
//! inside `accept`, one client that opens a connection and sends nothing
//! holds every other client at the door. [`TlsListener`] runs each
//! handshake as a task of its own, bounded in number
//! ([`TlsListener::max_handshakes`], 256), per client address
//! ([`TlsListener::max_handshakes_per_address`], 16: one address that
//! opens connections and never starts TLS holds no more than its share) and
//! in time ([`TlsListener::handshake_timeout`], 10 s), and hands out only
//! connections whose handshake finished; failed and timed-out handshakes
//! are counted in `keel_http_tls_handshake_failures_total{reason}`. It is
//! an axum [`Listener`], so [`Drain`](crate::health::Drain) and the
//! connection limits work on it unchanged.
//!
//! ```no_run
//! # async fn serve(router: axum::Router) -> Result<(), Box<dyn std::error::Error>> {
//! use keel_http::tls::{TlsListener, server_config};
//!
//! let config = server_config("tls/cert.pem", "tls/key.pem")?;
//! let tcp = tokio::net::TcpListener::bind("0.0.0.0:8443").await?;
//! axum::serve(TlsListener::new(tcp, config), router).await?;
//! # Ok(()) }
//! ```

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::serve::Listener;
pub use rustls::ServerConfig;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use crate::slots::ConnectionSlots;

mod peer;
mod reload;

pub use peer::{PeerIdentity, RequirePeer, RequirePeerLayer};
pub use reload::{RELOAD_CHECK_INTERVAL, ServerTls};

/// Handshakes in progress at once, by default.
const DEFAULT_MAX_HANDSHAKES: usize = 256;
/// Handshakes in progress from one client address, by default.
const DEFAULT_HANDSHAKES_PER_ADDRESS: usize = 16;

/// The certificate or key could not be used; the message names the file.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A file is missing, unreadable, or not PEM of the expected kind.
    #[error("{path}: {reason}")]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// rustls refused the pair (the key does not match the certificate, or
    /// an unsupported key type).
    #[error("the certificate and key cannot be used together: {0}")]
    Refused(#[from] rustls::Error),
    /// The client CA file holds no usable CA certificate.
    #[error("{path}: no usable CA certificate to verify clients with: {reason}")]
    ClientCa {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
}

/// Whether clients must present a certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum ClientAuth {
    /// A client without a certificate is let in, with no [`PeerIdentity`];
    /// one with a certificate the CA did not sign is refused (default).
    #[default]
    Optional,
    /// A client without a certificate the CA signed fails the handshake.
    Required,
}

/// Where a server's certificate, key and (for mTLS) client CA live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain, PEM, leaf first.
    pub cert: PathBuf,
    /// Its private key, PEM.
    pub key: PathBuf,
    /// The CA certificates (PEM) client certificates must chain to; none
    /// for one-way TLS.
    pub client_ca: Option<PathBuf>,
    /// Whether a client certificate is required (with `client_ca`).
    pub client_auth: ClientAuth,
}

impl TlsFiles {
    /// One-way TLS with `cert` and `key`.
    pub fn new(cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        Self {
            cert: cert.into(),
            key: key.into(),
            client_ca: None,
            client_auth: ClientAuth::default(),
        }
    }

    /// Verifies client certificates against the CAs in `ca`.
    #[must_use]
    pub fn client_ca(mut self, ca: impl Into<PathBuf>, auth: ClientAuth) -> Self {
        self.client_ca = Some(ca.into());
        self.client_auth = auth;
        self
    }

    /// Reads the files and builds the configuration (TLS 1.2/1.3, ring,
    /// HTTP/1.1 by ALPN).
    pub fn load(&self) -> Result<Arc<ServerConfig>, TlsError> {
        let chain = read_chain(&self.cert)?;
        if chain.is_empty() {
            return Err(file_error(
                &self.cert,
                "holds no PEM certificate".to_owned(),
            ));
        }
        let key = PrivateKeyDer::from_pem_file(&self.key)
            .map_err(|e| file_error(&self.key, e.to_string()))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                builder.with_client_cert_verifier(client_verifier(ca, self.client_auth, provider)?)
            }
        };
        let mut config = builder.with_single_cert(chain, key)?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }

    /// The files, for reloading.
    pub(crate) fn paths(&self) -> impl Iterator<Item = &Path> {
        [Some(&self.cert), Some(&self.key), self.client_ca.as_ref()]
            .into_iter()
            .flatten()
            .map(PathBuf::as_path)
    }
}

fn file_error(path: &Path, reason: String) -> TlsError {
    TlsError::File {
        path: path.to_owned(),
        reason,
    }
}

fn read_chain(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(path, e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_error(path, e.to_string()))
}

fn client_verifier(
    ca: &Path,
    auth: ClientAuth,
    provider: Arc<rustls::crypto::CryptoProvider>,
) -> Result<Arc<dyn rustls::server::danger::ClientCertVerifier>, TlsError> {
    let ca_error = |reason: String| TlsError::ClientCa {
        path: ca.to_owned(),
        reason,
    };
    let mut roots = rustls::RootCertStore::empty();
    for cert in read_chain(ca)? {
        roots.add(cert).map_err(|e| ca_error(e.to_string()))?;
    }
    let builder =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
    let builder = match auth {
        ClientAuth::Optional => builder.allow_unauthenticated(),
        ClientAuth::Required => builder,
    };
    builder.build().map_err(|e| ca_error(e.to_string()))
}

/// A one-way TLS 1.2/1.3 server configuration (ring, HTTP/1.1 by ALPN)
/// from a PEM certificate chain (leaf first) and its PEM private key; see
/// [`TlsFiles`] for client certificates.
pub fn server_config(
    cert: impl AsRef<Path>,
    key: impl AsRef<Path>,
) -> Result<Arc<ServerConfig>, TlsError> {
    TlsFiles::new(cert.as_ref(), key.as_ref()).load()
}

/// A finished handshake's connection, if it succeeded.
type Handshake<L> = Option<(TlsStream<<L as Listener>::Io>, <L as Listener>::Addr)>;

/// A listener address that may name the client's IP (a TCP peer does), so
/// that each client address gets only its share of the handshakes.
pub trait ClientAddress {
    /// The client's IP, if the address has one.
    fn client_ip(&self) -> Option<IpAddr>;
}

impl ClientAddress for SocketAddr {
    fn client_ip(&self) -> Option<IpAddr> {
        Some(self.ip())
    }
}

/// A [`Listener`] that answers TLS on top of another one; see the
/// [module docs](self).
pub struct TlsListener<L: Listener> {
    inner: L,
    config: ServerTls,
    handshakes: JoinSet<Handshake<L>>,
    handshake_timeout: Duration,
    max_handshakes: usize,
    max_per_address: usize,
    /// Each client address's share of the handshakes; a handshake's task
    /// holds its slot, so the share is given back however the task ends.
    per_address: ConnectionSlots,
}

impl<L: Listener> std::fmt::Debug for TlsListener<L> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsListener")
            .field("handshaking", &self.handshakes.len())
            .field("handshake_timeout", &self.handshake_timeout)
            .field("max_handshakes", &self.max_handshakes)
            .field("max_handshakes_per_address", &self.max_per_address)
            .finish_non_exhaustive()
    }
}

impl<L> TlsListener<L>
where
    L: Listener,
    L::Addr: ClientAddress + 'static,
{
    /// TLS with `config` on `inner`'s connections: a fixed
    /// `Arc<ServerConfig>`, or a [`ServerTls`] that reloads.
    pub fn new(inner: L, config: impl Into<ServerTls>) -> Self {
        Self {
            inner,
            config: config.into(),
            handshakes: JoinSet::new(),
            handshake_timeout: Duration::from_secs(10),
            max_handshakes: DEFAULT_MAX_HANDSHAKES,
            max_per_address: DEFAULT_HANDSHAKES_PER_ADDRESS,
            per_address: ConnectionSlots::new(
                DEFAULT_MAX_HANDSHAKES,
                DEFAULT_HANDSHAKES_PER_ADDRESS,
            ),
        }
    }

    /// The most handshakes in progress from one client address (default
    /// 16); past it, that address's new connections are closed at once.
    #[must_use]
    pub fn max_handshakes_per_address(mut self, max: usize) -> Self {
        self.max_per_address = max.max(1);
        self.per_address = ConnectionSlots::new(self.max_handshakes, self.max_per_address);
        self
    }

    /// The longest a client may take to finish its handshake (default
    /// 10 s); then its connection is closed.
    #[must_use]
    pub fn handshake_timeout(mut self, timeout: Duration) -> Self {
        self.handshake_timeout = timeout;
        self
    }

    /// The most handshakes in progress at once (default 256); past it,
    /// new connections wait in the kernel's backlog.
    #[must_use]
    pub fn max_handshakes(mut self, max: usize) -> Self {
        self.max_handshakes = max.max(1);
        self.per_address = ConnectionSlots::new(self.max_handshakes, self.max_per_address);
        self
    }

    fn start_handshake(&mut self, io: L::Io, peer: L::Addr) {
        let slot = match peer.client_ip() {
            Some(ip) => match self.per_address.try_take(ip) {
                Some(slot) => Some(slot),
                None => {
                    metrics::counter!("keel_http_tls_handshake_failures_total", "reason" => "address_share")
                        .increment(1);
                    tracing::debug!(%ip, "TLS handshakes of one address at its share: closed");
                    return;
                }
            },
            None => None,
        };
        let acceptor = TlsAcceptor::from(self.config.current());
        let timeout = self.handshake_timeout;
        self.handshakes.spawn(async move {
            let _slot = slot;
            let reason = match tokio::time::timeout(timeout, acceptor.accept(io)).await {
                Ok(Ok(stream)) => return Some((stream, peer)),
                Ok(Err(error)) => {
                    tracing::debug!(%error, "TLS handshake failed");
                    "failed"
                }
                Err(_) => "timeout",
            };
            metrics::counter!("keel_http_tls_handshake_failures_total", "reason" => reason)
                .increment(1);
            None
        });
    }
}

impl<L> Listener for TlsListener<L>
where
    L: Listener,
    L::Addr: ClientAddress + 'static,
{
    type Io = TlsStream<L::Io>;
    type Addr = L::Addr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let room = self.handshakes.len() < self.max_handshakes;
            tokio::select! {
                // The inner accept is cancel-safe: a connection is either
                // returned or left in the kernel's queue.
                (io, peer) = self.inner.accept(), if room => self.start_handshake(io, peer),
                Some(done) = self.handshakes.join_next(), if !self.handshakes.is_empty() => {
                    if let Ok(Some(connection)) = done {
                        return connection;
                    }
                }
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.inner.local_addr()
    }
}
