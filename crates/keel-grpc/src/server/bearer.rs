//! A credential on a gRPC service: `authorization: Bearer <token>` on every
//! call, compared in constant time, else `UNAUTHENTICATED`.

use std::sync::Arc;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tonic::service::Interceptor;
use tonic::{Request, Status};

/// The interceptor that asks every call for the token (or, built with
/// `None`, lets every call through: a service on loopback that its operator
/// chose to leave open). Cheap to clone.
#[derive(Clone)]
pub struct RequireBearer {
    /// The SHA-256 of `Bearer <token>`: digests of equal length are compared,
    /// so the time taken says nothing about the token, not even its length.
    expected: Option<Arc<[u8; 32]>>,
}

impl std::fmt::Debug for RequireBearer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RequireBearer")
            .field("required", &self.expected.is_some())
            .finish()
    }
}

impl RequireBearer {
    /// Calls must carry `token` (`None`: no credential asked for).
    pub fn new(token: Option<&str>) -> Self {
        Self {
            expected: token.map(|t| Arc::new(digest(format!("Bearer {t}").as_bytes()))),
        }
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

impl Interceptor for RequireBearer {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let Some(expected) = &self.expected else {
            return Ok(request);
        };
        let presented = request
            .metadata()
            .get("authorization")
            .map(|v| v.as_bytes())
            .unwrap_or_default();
        if bool::from(digest(presented).ct_eq(expected.as_slice())) {
            return Ok(request);
        }
        metrics::counter!("keel_grpc_server_calls_total", "outcome" => "unauthenticated")
            .increment(1);
        Err(Status::unauthenticated(
            "this service needs `authorization: Bearer <token>`",
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(interceptor: &mut RequireBearer, header: Option<&str>) -> Result<(), tonic::Code> {
        let mut request = Request::new(());
        if let Some(value) = header {
            request
                .metadata_mut()
                .insert("authorization", value.parse().unwrap());
        }
        interceptor.call(request).map(drop).map_err(|s| s.code())
    }

    #[test]
    fn only_the_token_passes() {
        let mut required = RequireBearer::new(Some("s3cret-s3cret-s3cret"));
        assert_eq!(
            call(&mut required, Some("Bearer s3cret-s3cret-s3cret")),
            Ok(())
        );
        for wrong in [None, Some("Bearer nope"), Some("s3cret-s3cret-s3cret")] {
            assert_eq!(
                call(&mut required, wrong),
                Err(tonic::Code::Unauthenticated)
            );
        }
        let mut open = RequireBearer::new(None);
        assert_eq!(call(&mut open, None), Ok(()));
    }
}
