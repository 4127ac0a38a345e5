//! What a successful response says about the dependency's health, for the
//! tower layer.
//!
//! A tower service's errors are classified by their [`ErrorClass`](keel_core::ErrorClass)
//! (see [`Outcome::from_class`]). But an HTTP client answers a `503` with
//! `Ok(response)`: judged by its errors alone, a dependency answering nothing
//! but `500`s looks perfectly healthy and the breaker never opens. A
//! [`ClassifyResponse`] looks at the `Ok` side:
//!
//! - [`Answered`] (the default): every response is a success; for services
//!   whose failures are errors.
//! - `HttpStatus` (feature `http`): `5xx` and `429 Too Many Requests` are
//!   failures, every other status (`2xx`, `3xx`, `4xx` such as `404` or
//!   `422`: the caller's own fault) a success.
//! - `GrpcStatus` (feature `http`): a gRPC call's status, from a
//!   trailers-only answer's `grpc-status`, judged by
//!   [`GrpcCode::class`](keel_core::status::GrpcCode::class).
//! - any closure `Fn(&Response) -> Outcome`, for everything else (a
//!   `{"error": ...}` envelope).

use super::Outcome;

/// Decides what a response (the `Ok` side of a call) says about the
/// dependency's health. Set it with
/// [`CircuitBreakerLayer::classify_response`](super::CircuitBreakerLayer::classify_response).
pub trait ClassifyResponse<T> {
    /// The outcome of a call that returned `response`.
    fn classify(&self, response: &T) -> Outcome;
}

/// Every response counts as a success: the dependency answered. The default
/// for services whose failures are errors.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Answered;

impl<T> ClassifyResponse<T> for Answered {
    #[inline(always)]
    fn classify(&self, _response: &T) -> Outcome {
        Outcome::Success
    }
}

impl<T, F> ClassifyResponse<T> for F
where
    F: Fn(&T) -> Outcome,
{
    #[inline]
    fn classify(&self, response: &T) -> Outcome {
        self(response)
    }
}

/// HTTP responses by status: `5xx` (the server failed) and `429` (it is
/// overloaded and said so) count as failures; every other status is a
/// success, including `4xx` such as `404` or `422`, which are the caller's
/// own fault and say the dependency is up and answering.
#[cfg(feature = "http")]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HttpStatus;

#[cfg(feature = "http")]
impl HttpStatus {
    /// The outcome of a response with `status`.
    pub fn outcome(status: http::StatusCode) -> Outcome {
        if status.is_server_error() || status == http::StatusCode::TOO_MANY_REQUESTS {
            Outcome::Failure
        } else {
            Outcome::Success
        }
    }
}

#[cfg(feature = "http")]
impl<B> ClassifyResponse<http::Response<B>> for HttpStatus {
    #[inline]
    fn classify(&self, response: &http::Response<B>) -> Outcome {
        Self::outcome(response.status())
    }
}

/// gRPC calls by status, for a breaker over a tonic `Channel`: a call a
/// server refused or failed is answered "trailers-only", its `grpc-status`
/// in the response head, and this reads it. `UNAVAILABLE`,
/// `RESOURCE_EXHAUSTED`, `DEADLINE_EXCEEDED`, `INTERNAL`, `UNKNOWN` and the
/// like count as failures; the caller's own faults (`INVALID_ARGUMENT`,
/// `NOT_FOUND`, ...) and `OK` as successes
/// ([`GrpcCode::class`](keel_core::status::GrpcCode::class) decides).
///
/// A response head without `grpc-status` is a call under way, its status
/// still to come in the trailers: a success for the breaker (a stream that
/// fails after its first message is not seen here). A head that is not
/// HTTP `200` came from something other than a gRPC server (a proxy) and is
/// judged as [`HttpStatus`] judges it.
#[cfg(feature = "http")]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GrpcStatus;

#[cfg(feature = "http")]
impl GrpcStatus {
    /// The gRPC code in a response head, if the call ended in it.
    pub fn code<B>(response: &http::Response<B>) -> Option<keel_core::status::GrpcCode> {
        let value = response
            .headers()
            .get(keel_core::status::GRPC_STATUS_HEADER)?;
        Some(keel_core::status::GrpcCode::from_header(value.as_bytes()))
    }
}

#[cfg(feature = "http")]
impl<B> ClassifyResponse<http::Response<B>> for GrpcStatus {
    #[inline]
    fn classify(&self, response: &http::Response<B>) -> Outcome {
        if response.status() != http::StatusCode::OK {
            return HttpStatus::outcome(response.status());
        }
        match Self::code(response) {
            Some(code) if code != keel_core::status::GrpcCode::Ok => {
                Outcome::from_class(code.class())
            }
            _ => Outcome::Success,
        }
    }
}

#[cfg(all(test, feature = "http"))]
mod tests {
    use super::*;

    #[test]
    fn server_errors_and_429_fail_client_errors_succeed() {
        let outcome = |code: u16| {
            let response = http::Response::builder().status(code).body(()).unwrap();
            HttpStatus.classify(&response)
        };
        for code in [500, 502, 503, 504, 429] {
            assert_eq!(outcome(code), Outcome::Failure, "{code}");
        }
        for code in [200, 201, 204, 304, 400, 401, 404, 409, 422] {
            assert_eq!(outcome(code), Outcome::Success, "{code}");
        }
    }

    #[test]
    fn grpc_statuses_in_the_head_are_judged_by_their_class() {
        let outcome = |grpc: Option<&str>| {
            let mut response = http::Response::builder().status(200);
            if let Some(code) = grpc {
                response = response.header("grpc-status", code);
            }
            GrpcStatus.classify(&response.body(()).unwrap())
        };
        for failed in ["14", "8", "4", "13", "2", "garbage"] {
            assert_eq!(outcome(Some(failed)), Outcome::Failure, "{failed}");
        }
        for fine in ["0", "3", "5", "9", "16"] {
            assert_eq!(outcome(Some(fine)), Outcome::Success, "{fine}");
        }
        assert_eq!(outcome(None), Outcome::Success, "status still to come");
        let proxy = http::Response::builder().status(502).body(()).unwrap();
        assert_eq!(GrpcStatus.classify(&proxy), Outcome::Failure);
    }
}
