//! [`ApiKeys`]: callers that are tenants, and the layer that names them.

use std::future::Ready;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::http::{HeaderMap, HeaderValue, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::future::Either;
use subtle::ConstantTimeEq;
use tower_layer::Layer;
use tower_service::Service;

use super::{FailureThrottle, client_ip, digest};
use crate::problem::Problem;

/// The shortest API key accepted, in characters.
const MIN_KEY_LEN: usize = 16;

/// The longest tenant name, in characters.
const MAX_TENANT_LEN: usize = 64;

/// Who a request acts for: the tenant whose API key it presented. Handlers
/// behind [`ApiKeyLayer`] read it with `Extension<Tenant>` and scope every
/// read and write to it.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tenant(Arc<str>);

impl Tenant {
    /// The tenant's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for Tenant {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// An API key setting could not be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ApiKeysError {
    /// Not `tenant:key`.
    #[error("an API key is written `tenant:key`; got one without the colon")]
    Format,
    /// The tenant name is not 1 to 64 of `a-z`, `0-9`, `_`, `-`.
    #[error("tenant {0:?} must be 1 to 64 characters of a-z, 0-9, '_' or '-'")]
    Tenant(String),
    /// The key is too short or not visible ASCII.
    #[error("the API key of tenant {0:?} must be at least {MIN_KEY_LEN} visible ASCII characters")]
    Key(String),
    /// Two tenants share a key, or a tenant has two.
    #[error("tenant {0:?} is listed twice, or shares its key with another tenant")]
    Duplicate(String),
}

/// The tenants' API keys. Only SHA-256 digests are kept, and a presented
/// key is compared with every one of them in constant time, so neither the
/// keys nor which tenant matched leak through timing. Its `Debug` output
/// lists tenants, never keys.
///
/// ```
/// use axum::http::{HeaderMap, HeaderValue, header};
/// use keel_http::access::ApiKeys;
///
/// let keys = ApiKeys::parse(["acme:acme-key-0123456789", "globex:globex-key-0123456789"]).unwrap();
/// let mut headers = HeaderMap::new();
/// headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer globex-key-0123456789"));
/// assert_eq!(keys.authenticate(&headers).unwrap().as_str(), "globex");
/// ```
#[derive(Clone, Default)]
pub struct ApiKeys {
    keys: Arc<Vec<(Tenant, [u8; 32])>>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.keys.iter().map(|(t, _)| t.as_str()))
            .finish()
    }
}

impl ApiKeys {
    /// Keys written `tenant:key`.
    pub fn parse<I, T>(entries: I) -> Result<Self, ApiKeysError>
    where
        I: IntoIterator<Item = T>,
        T: AsRef<str>,
    {
        let mut keys: Vec<(Tenant, [u8; 32])> = Vec::new();
        for entry in entries {
            let (tenant, key) = entry
                .as_ref()
                .trim()
                .split_once(':')
                .ok_or(ApiKeysError::Format)?;
            let valid_tenant = !tenant.is_empty()
                && tenant.len() <= MAX_TENANT_LEN
                && tenant.bytes().all(|b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-'
                });
            if !valid_tenant {
                return Err(ApiKeysError::Tenant(tenant.to_owned()));
            }
            if key.len() < MIN_KEY_LEN || !key.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(ApiKeysError::Key(tenant.to_owned()));
            }
            let hashed = digest(key);
            if keys
                .iter()
                .any(|(t, d)| t.as_str() == tenant || *d == hashed)
            {
                return Err(ApiKeysError::Duplicate(tenant.to_owned()));
            }
            keys.push((Tenant(tenant.into()), hashed));
        }
        Ok(Self {
            keys: Arc::new(keys),
        })
    }

    /// Whether no key is configured (every request is then refused).
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// The tenants, in the order given.
    pub fn tenants(&self) -> impl Iterator<Item = &Tenant> {
        self.keys.iter().map(|(t, _)| t)
    }

    /// The tenant whose key `Authorization: Bearer` carries, if any.
    pub fn authenticate(&self, headers: &HeaderMap) -> Option<Tenant> {
        let presented = digest(bearer(headers)?);
        let mut found = None;
        for (tenant, key) in self.keys.iter() {
            if bool::from(key.ct_eq(&presented)) {
                found = Some(tenant.clone());
            }
        }
        found
    }
}

/// The token of `Authorization: Bearer <token>`, if present.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// A tower layer that lets through only requests with a tenant's API key,
/// putting the [`Tenant`] in the request's extensions; others get `401`
/// problem+json, and an address that failed too often `429` with
/// `Retry-After`.
#[derive(Debug, Clone)]
pub struct ApiKeyLayer {
    keys: ApiKeys,
    throttle: FailureThrottle,
}

impl ApiKeyLayer {
    /// Demands one of `keys`, throttling failures with `throttle`.
    pub fn new(keys: ApiKeys, throttle: FailureThrottle) -> Self {
        Self { keys, throttle }
    }

    /// Names the request's tenant, or answers why not.
    fn refusal<B>(&self, request: &mut Request<B>) -> Option<Response> {
        let ip = client_ip(request.extensions());
        if let Err(throttled) = self.throttle.check(ip) {
            return Some(
                Problem::new(StatusCode::TOO_MANY_REQUESTS, throttled.to_string())
                    .with_retry_after(throttled.retry_after)
                    .into_response(),
            );
        }
        match self.keys.authenticate(request.headers()) {
            Some(tenant) => {
                request.extensions_mut().insert(tenant);
                None
            }
            None => {
                if bearer(request.headers()).is_some() {
                    tracing::warn!(client = ?ip, "request with an unknown API key refused");
                    self.throttle.fail(ip);
                }
                let mut response = Problem::new(
                    StatusCode::UNAUTHORIZED,
                    "send your API key: `Authorization: Bearer <key>`",
                )
                .typed("api_key_required")
                .into_response();
                response.headers_mut().insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"keel\""),
                );
                Some(response)
            }
        }
    }
}

impl<Svc> Layer<Svc> for ApiKeyLayer {
    type Service = RequireApiKey<Svc>;

    fn layer(&self, inner: Svc) -> Self::Service {
        RequireApiKey {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service made by [`ApiKeyLayer`].
#[derive(Debug, Clone)]
pub struct RequireApiKey<Svc> {
    inner: Svc,
    layer: ApiKeyLayer,
}

impl<Svc, B> Service<Request<B>> for RequireApiKey<Svc>
where
    Svc: Service<Request<B>, Response = Response>,
{
    type Response = Response;
    type Error = Svc::Error;
    type Future = Either<Svc::Future, Ready<Result<Response, Svc::Error>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut request: Request<B>) -> Self::Future {
        match self.layer.refusal(&mut request) {
            None => Either::Left(self.inner.call(request)),
            Some(refused) => Either::Right(std::future::ready(Ok(refused))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_bearer(token: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {token}")).unwrap(),
        );
        headers
    }

    #[test]
    fn each_key_names_its_tenant_and_bad_settings_are_refused() {
        let keys =
            ApiKeys::parse(["acme:acme-key-0123456789", "globex:globex-key-0123456789"]).unwrap();
        assert!(!format!("{keys:?}").contains("key-0123"));
        assert_eq!(
            keys.authenticate(&with_bearer("acme-key-0123456789"))
                .map(|t| t.to_string()),
            Some("acme".into())
        );
        assert_eq!(keys.authenticate(&with_bearer("acme-key-012345678")), None);
        assert_eq!(keys.authenticate(&HeaderMap::new()), None);
        assert_eq!(
            ApiKeys::parse(["nocolon"]).unwrap_err(),
            ApiKeysError::Format
        );
        assert!(matches!(
            ApiKeys::parse(["Acme:acme-key-0123456789"]),
            Err(ApiKeysError::Tenant(_))
        ));
        assert!(matches!(
            ApiKeys::parse(["acme:short"]),
            Err(ApiKeysError::Key(_))
        ));
        assert!(matches!(
            ApiKeys::parse(["a:same-key-0123456789", "b:same-key-0123456789"]),
            Err(ApiKeysError::Duplicate(_))
        ));
    }
}
