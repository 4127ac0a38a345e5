//! The verified client's identity, and the layer that admits only the
//! peers on an allow-list.

use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::{Extensions, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::future::{Either, Ready, ready};
use rustls::pki_types::CertificateDer;
use tokio_rustls::server::TlsStream;
use tower_layer::Layer;
use tower_service::Service;

use crate::connection::ConnectionInfo;
use crate::problem::Problem;

/// Who a client proved to be with its certificate: the DNS and URI names
/// of its subject alternative names (a SPIFFE ID is a URI name). Put on
/// each request of a connection whose client presented a certificate the
/// server's client CA verified; absent otherwise.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerIdentity {
    dns_names: Vec<String>,
    uris: Vec<String>,
}

impl PeerIdentity {
    /// The identity in a (verified) leaf certificate; `None` if it cannot
    /// be parsed.
    pub fn from_certificate(leaf: &CertificateDer<'_>) -> Option<Self> {
        let cert = webpki::EndEntityCert::try_from(leaf).ok()?;
        Some(Self {
            dns_names: cert
                .valid_dns_names()
                .map(str::to_ascii_lowercase)
                .collect(),
            uris: cert.valid_uri_names().map(str::to_owned).collect(),
        })
    }

    /// Its DNS names, lowercase.
    pub fn dns_names(&self) -> &[String] {
        &self.dns_names
    }

    /// Its URI names (`spiffe://cluster.local/ns/shop/sa/orders`).
    pub fn uris(&self) -> &[String] {
        &self.uris
    }

    /// Whether one of its names is `name`: a DNS name compared without
    /// regard to case, a URI exactly. Wildcard names in the certificate
    /// are matched literally: `*.internal` admits only the entry
    /// `*.internal`, not every host under it.
    pub fn has_name(&self, name: &str) -> bool {
        self.uris.iter().any(|uri| uri == name)
            || self
                .dns_names
                .iter()
                .any(|dns| dns.eq_ignore_ascii_case(name))
    }
}

impl<IO> ConnectionInfo for TlsStream<IO> {
    fn extend(&self, extensions: &mut Extensions) {
        let identity = self
            .get_ref()
            .1
            .peer_certificates()
            .and_then(<[_]>::first)
            .and_then(PeerIdentity::from_certificate);
        if let Some(identity) = identity {
            extensions.insert(identity);
        }
    }
}

/// Admits a request only from a peer whose certificate carries one of the
/// allowed names; see [`RequirePeer`].
///
/// ```
/// use axum::{Router, routing::post};
/// use keel_http::tls::RequirePeerLayer;
///
/// // Only the billing service may settle invoices; the rest of the
/// // router stays open to anyone who finished the handshake.
/// let settle = Router::new()
///     .route("/invoices/{id}/settle", post(|| async { "settled" }))
///     .layer(RequirePeerLayer::new(["spiffe://keel.local/billing"]));
/// let app = Router::new().merge(settle);
/// # let _: Router = app;
/// ```
#[derive(Debug, Clone)]
pub struct RequirePeerLayer {
    allowed: Arc<[String]>,
}

impl RequirePeerLayer {
    /// Admits peers with any of the names in `allowed` (DNS names or URIs,
    /// as [`PeerIdentity::has_name`] compares them). An empty list admits
    /// nobody.
    pub fn new<S: Into<String>>(allowed: impl IntoIterator<Item = S>) -> Self {
        Self {
            allowed: allowed.into_iter().map(Into::into).collect(),
        }
    }
}

impl<S> Layer<S> for RequirePeerLayer {
    type Service = RequirePeer<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequirePeer {
            inner,
            allowed: self.allowed.clone(),
        }
    }
}

/// Answers `403` (a problem, `urn:keel:problem:client_certificate_required`
/// or `urn:keel:problem:peer_not_allowed`) to a request without a
/// [`PeerIdentity`], or with one that has none of the allowed names;
/// passes the others on. Refusals are counted in
/// `keel_http_peer_refused_total{reason}`.
#[derive(Debug, Clone)]
pub struct RequirePeer<S> {
    inner: S,
    allowed: Arc<[String]>,
}

impl<S, B> Service<Request<B>> for RequirePeer<S>
where
    S: Service<Request<B>, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Either<Ready<Result<Response, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        let refusal = match request.extensions().get::<PeerIdentity>() {
            None => Some((
                "client_certificate_required",
                "this route needs a client certificate signed by the server's client CA".to_owned(),
            )),
            Some(peer) if !self.allowed.iter().any(|name| peer.has_name(name)) => Some((
                "peer_not_allowed",
                format!(
                    "the client certificate's names ({}) are not allowed on this route",
                    peer.dns_names
                        .iter()
                        .chain(&peer.uris)
                        .map(String::as_str)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            )),
            Some(_) => None,
        };
        match refusal {
            None => Either::Right(self.inner.call(request)),
            Some((reason, detail)) => {
                metrics::counter!("keel_http_peer_refused_total", "reason" => reason).increment(1);
                tracing::debug!(reason, "refused a peer");
                let problem = Problem::new(StatusCode::FORBIDDEN, detail).typed(reason);
                Either::Left(ready(Ok(problem.into_response())))
            }
        }
    }
}
