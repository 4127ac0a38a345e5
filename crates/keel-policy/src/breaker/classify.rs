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
//! - any closure `Fn(&Response) -> Outcome`, for everything else (a gRPC
//!   status in a body, a `{"error": ...}` envelope).

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
}
