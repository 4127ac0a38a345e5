//! The client's side of mTLS: a certificate presented on every connection,
//! re-read from its files as connections are recycled.
//!
//! A service that calls another behind mTLS presents its own certificate
//! (its identity, a SPIFFE ID or a DNS name, is what the server's
//! allow-list checks) and trusts the server's CA. Certificates rotate, so
//! [`PropagatingClient::with_identity`](crate::PropagatingClient::with_identity)
//! reads the files again each time [`ConnectionRecycling`] retires the
//! connections: a rotated certificate is in use within one recycling
//! period, with no restart and no call cut off. Files that fail to load
//! then keep the last good client and are counted in
//! `keel_client_identity_reloads_total{outcome="failed"}`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::client::PropagatingClient;
use crate::recycle::ConnectionRecycling;

/// A client certificate file could not be used; the message names it.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {reason}")]
pub struct IdentityError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong with it.
    pub reason: String,
}

/// Where the client's certificate, key and trusted server CA live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdentityFiles {
    /// The client certificate chain, PEM, leaf first.
    pub cert: PathBuf,
    /// Its private key, PEM.
    pub key: PathBuf,
    /// The CA (PEM) the servers' certificates chain to, trusted besides
    /// the system's roots; none to trust only those.
    pub server_ca: Option<PathBuf>,
}

impl IdentityFiles {
    /// The certificate in `cert`, its key in `key`.
    pub fn new(cert: impl Into<PathBuf>, key: impl Into<PathBuf>) -> Self {
        Self {
            cert: cert.into(),
            key: key.into(),
            server_ca: None,
        }
    }

    /// Trusts the CA in `ca` for the servers' certificates.
    #[must_use]
    pub fn server_ca(mut self, ca: impl Into<PathBuf>) -> Self {
        self.server_ca = Some(ca.into());
        self
    }

    /// Reads the files into `builder`: the identity, and the server CA if
    /// any.
    pub fn apply(
        &self,
        builder: reqwest::ClientBuilder,
    ) -> Result<reqwest::ClientBuilder, IdentityError> {
        let mut pem = read(&self.cert)?;
        pem.extend_from_slice(b"\n");
        pem.extend_from_slice(&read(&self.key)?);
        let identity = reqwest::Identity::from_pem(&pem).map_err(|e| IdentityError {
            path: self.cert.clone(),
            reason: format!("not a PEM certificate and key: {e}"),
        })?;
        let mut builder = builder.use_rustls_tls().identity(identity);
        if let Some(ca) = &self.server_ca {
            let root = reqwest::Certificate::from_pem(&read(ca)?).map_err(|e| IdentityError {
                path: ca.clone(),
                reason: format!("not a PEM CA certificate: {e}"),
            })?;
            builder = builder.add_root_certificate(root);
        }
        Ok(builder)
    }
}

fn read(path: &Path) -> Result<Vec<u8>, IdentityError> {
    std::fs::read(path).map_err(|e| IdentityError {
        path: path.to_owned(),
        reason: e.to_string(),
    })
}

impl PropagatingClient {
    /// A client that presents the certificate in `files` on every
    /// connection and reads the files again each time `recycling` retires
    /// its connections (see the [module docs](crate::identity)). `configure`
    /// sets everything else on each fresh `reqwest::ClientBuilder`.
    ///
    /// Fails if the files do not load now.
    ///
    /// ```no_run
    /// use std::time::Duration;
    /// use keel_client::{ConnectionRecycling, PropagatingClient};
    /// use keel_client::identity::IdentityFiles;
    ///
    /// # fn run() -> Result<(), Box<dyn std::error::Error>> {
    /// let files = IdentityFiles::new("tls/orders.pem", "tls/orders-key.pem").server_ca("tls/ca.pem");
    /// let client = PropagatingClient::with_identity(
    ///     files,
    ///     ConnectionRecycling::after(Duration::from_secs(300)),
    ///     |builder| builder.pool_max_idle_per_host(16),
    /// )?;
    /// # Ok(()) }
    /// ```
    pub fn with_identity(
        files: IdentityFiles,
        recycling: ConnectionRecycling,
        configure: impl Fn(reqwest::ClientBuilder) -> reqwest::ClientBuilder + Send + Sync + 'static,
    ) -> Result<Self, IdentityError> {
        let build = move || -> Result<reqwest::Client, IdentityError> {
            files
                .apply(configure(reqwest::Client::builder()))?
                .build()
                .map_err(|e| IdentityError {
                    path: files.cert.clone(),
                    reason: e.to_string(),
                })
        };
        let first = build()?;
        let last_good = Arc::new(Mutex::new(first.clone()));
        // The pool asks for its first client at once: that is the one just
        // built, not a reload.
        let first = Mutex::new(Some(first));
        Ok(Self::recycling(
            move || match first.lock().take().map_or_else(&build, Ok) {
                Ok(client) => {
                    metrics::counter!("keel_client_identity_reloads_total", "outcome" => "ok")
                        .increment(1);
                    *last_good.lock() = client.clone();
                    client
                }
                Err(error) => {
                    metrics::counter!("keel_client_identity_reloads_total", "outcome" => "failed")
                        .increment(1);
                    tracing::error!(%error, "client certificate files do not load: keeping the last good ones");
                    last_good.lock().clone()
                }
            },
            recycling,
        ))
    }
}
