//! What deserves another attempt: by default an error's [`ErrorClass`];
//! optionally a predicate on the error, and one on successful results.
//!
//! The default, [`ByClass`], needs no configuration: it retries
//! [`Retryable`](ErrorClass::Retryable) errors and asks the [`Retry`](super::Retry)
//! about [`OutcomeUnknown`](ErrorClass::OutcomeUnknown) ones, which only an
//! idempotent operation may repeat. Refusals of other policies, permanent
//! errors and errors nobody classified ([`Unclassified`](ErrorClass::Unclassified):
//! not known to be safe) are never retried.
//!
//! A tower service answering HTTP returns a `503` as `Ok(response)`, which
//! no error class sees: add `http_verdict` (feature `http`) with
//! [`retry_on_result`](super::RetryBuilder::retry_on_result) to retry those,
//! or `grpc_verdict` for gRPC statuses over a tonic `Channel`.

use std::fmt;
use std::time::Duration;

use keel_core::{Classify, ErrorClass};

/// What to do after one attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Keep this outcome: return it to the caller.
    Accept,
    /// Try again, no sooner than `after` if the dependency asked (`Retry-After`).
    Retry {
        /// How long the dependency asked to wait.
        after: Option<Duration>,
    },
    /// The attempt may or may not have taken effect: try again only if the
    /// policy was marked idempotent ([`RetryBuilder::retry_outcome_unknown`](super::RetryBuilder::retry_outcome_unknown)).
    RetryIfIdempotent {
        /// How long the dependency asked to wait.
        after: Option<Duration>,
    },
}

impl Verdict {
    /// The verdict for an error, from its [`Classify`] class and `Retry-After`.
    pub fn by_class<E: Classify + ?Sized>(error: &E) -> Self {
        match error.class() {
            ErrorClass::Retryable => Self::Retry {
                after: error.retry_after(),
            },
            ErrorClass::OutcomeUnknown => Self::RetryIfIdempotent {
                after: error.retry_after(),
            },
            // Permanent, Rejected, Unclassified: the same failure again, a
            // refusal to respect, or not known to be safe to repeat.
            _ => Self::Accept,
        }
    }

    /// Whether the attempt judged so may have taken effect.
    pub(crate) fn may_have_taken_effect(self) -> bool {
        matches!(self, Self::RetryIfIdempotent { .. })
    }

    /// Try again after at least `after`.
    pub fn retry_after(after: Duration) -> Self {
        Self::Retry { after: Some(after) }
    }
}

impl From<bool> for Verdict {
    /// `true` retries (no `Retry-After`), `false` accepts.
    fn from(retry: bool) -> Self {
        if retry {
            Self::Retry { after: None }
        } else {
            Self::Accept
        }
    }
}

/// The verdict on an HTTP response, for
/// [`retry_on_result`](super::RetryBuilder::retry_on_result):
///
/// - `429 Too Many Requests` and `503 Service Unavailable`: the server did
///   not process the request; retry, no sooner than its `Retry-After`
///   (delay-seconds form; an HTTP-date is not read here);
/// - any other `5xx` (`500`, `502`, `504`): the server, or the one behind a
///   gateway, may have acted before failing; retry only an idempotent call
///   ([`Verdict::RetryIfIdempotent`]);
/// - everything else, `4xx` included: accept (the caller's own fault, or a
///   success).
///
/// ```
/// use keel_policy::retry::{Retry, Verdict, http_verdict};
///
/// let retry = Retry::builder("search")
///     .retry_on_result(http_verdict::<String>)
///     .build()
///     .unwrap();
/// let busy = http::Response::builder().status(503).header("retry-after", "2").body(String::new()).unwrap();
/// assert_eq!(http_verdict(&busy), Verdict::retry_after(std::time::Duration::from_secs(2)));
/// # let _ = retry;
/// ```
#[cfg(feature = "http")]
pub fn http_verdict<B>(response: &http::Response<B>) -> Verdict {
    use http::StatusCode;
    let after = || {
        response
            .headers()
            .get(http::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs)
    };
    match response.status() {
        StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => {
            Verdict::Retry { after: after() }
        }
        status if status.is_server_error() => Verdict::RetryIfIdempotent { after: after() },
        _ => Verdict::Accept,
    }
}

/// The verdict on a gRPC call's response head, for
/// [`retry_on_result`](super::RetryBuilder::retry_on_result) over a tonic
/// `Channel`: a trailers-only answer's `grpc-status` is judged by
/// [`GrpcCode::class`](keel_core::status::GrpcCode::class) (`UNAVAILABLE`
/// and `RESOURCE_EXHAUSTED` retry; `DEADLINE_EXCEEDED`, `CANCELLED` and
/// `INTERNAL` retry only an idempotent call; the rest are accepted), waiting
/// at least the server's `grpc-retry-pushback-ms`. A pushback that is not a
/// number, or negative, means "do not retry", as gRFC A6 says. A head
/// without `grpc-status` is a call under way: accepted. A head that is not
/// HTTP `200` came from a proxy and is judged by [`http_verdict`].
///
/// ```
/// use keel_policy::retry::{Verdict, grpc_verdict};
///
/// let busy = http::Response::builder()
///     .header("grpc-status", "14")
///     .header("grpc-retry-pushback-ms", "250")
///     .body(())
///     .unwrap();
/// assert_eq!(grpc_verdict(&busy), Verdict::retry_after(std::time::Duration::from_millis(250)));
/// ```
#[cfg(feature = "http")]
pub fn grpc_verdict<B>(response: &http::Response<B>) -> Verdict {
    use keel_core::status::{GRPC_STATUS_HEADER, GrpcCode, RETRY_PUSHBACK_HEADER};
    if response.status() != http::StatusCode::OK {
        return http_verdict(response);
    }
    let Some(status) = response.headers().get(GRPC_STATUS_HEADER) else {
        return Verdict::Accept;
    };
    let code = GrpcCode::from_header(status.as_bytes());
    if code == GrpcCode::Ok {
        return Verdict::Accept;
    }
    let after = match response.headers().get(RETRY_PUSHBACK_HEADER) {
        None => None,
        Some(value) => match keel_core::status::parse_retry_pushback(value.as_bytes()) {
            Some(after) => Some(after),
            None => return Verdict::Accept,
        },
    };
    match code.class() {
        ErrorClass::Retryable => Verdict::Retry { after },
        ErrorClass::OutcomeUnknown => Verdict::RetryIfIdempotent { after },
        _ => Verdict::Accept,
    }
}

/// Decides, after each attempt, whether it is worth another.
///
/// Implement it for full control; the builder's
/// [`retry_if`](super::RetryBuilder::retry_if) and
/// [`retry_on_result`](super::RetryBuilder::retry_on_result) cover the usual cases.
pub trait RetryPolicy<T, E> {
    /// The verdict on an attempt that failed with `error`.
    fn check_error(&self, error: &E) -> Verdict;

    /// The verdict on an attempt that succeeded with `value` (by default,
    /// accept it).
    fn check_ok(&self, value: &T) -> Verdict {
        let _ = value;
        Verdict::Accept
    }

    /// Whether a failed attempt's `error` settles what became of the whole
    /// call, earlier attempts included: the dependency's own final answer
    /// under the call's idempotency key does ([`ErrorClass::Permanent`]); a
    /// refusal to send the attempt, or an answer that only this attempt
    /// did nothing, does not. After an attempt whose outcome is unknown
    /// ([`Verdict::RetryIfIdempotent`]), a later failure that does not
    /// settle the call is not returned: the unknown outcome is, since that
    /// attempt may have taken effect. By default no error settles it.
    fn settles(&self, error: &E) -> bool {
        let _ = error;
        false
    }
}

/// The default policy: retries by the error's [`ErrorClass`] and honours its
/// `Retry-After`; accepts every success.
#[derive(Debug, Clone, Copy, Default)]
pub struct ByClass;

impl<T, E: Classify> RetryPolicy<T, E> for ByClass {
    #[inline]
    fn check_error(&self, error: &E) -> Verdict {
        Verdict::by_class(error)
    }

    fn settles(&self, error: &E) -> bool {
        error.class() == ErrorClass::Permanent
    }
}

/// Retries the errors a predicate picks, instead of classifying them. The
/// predicate returns a `bool` or a [`Verdict`].
#[derive(Clone)]
pub struct RetryIf<F> {
    predicate: F,
}

impl<F> RetryIf<F> {
    pub(crate) fn new(predicate: F) -> Self {
        Self { predicate }
    }
}

impl<T, E, F, V> RetryPolicy<T, E> for RetryIf<F>
where
    F: Fn(&E) -> V,
    V: Into<Verdict>,
{
    fn check_error(&self, error: &E) -> Verdict {
        (self.predicate)(error).into()
    }
}

impl<F> fmt::Debug for RetryIf<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("RetryIf")
    }
}

/// Adds a predicate on successful results (retry a `503` response) to
/// another policy, which still decides about errors.
#[derive(Clone)]
pub struct RetryOnResult<P, F> {
    errors: P,
    predicate: F,
}

impl<P, F> RetryOnResult<P, F> {
    pub(crate) fn new(errors: P, predicate: F) -> Self {
        Self { errors, predicate }
    }
}

impl<T, E, P, F, V> RetryPolicy<T, E> for RetryOnResult<P, F>
where
    P: RetryPolicy<T, E>,
    F: Fn(&T) -> V,
    V: Into<Verdict>,
{
    fn check_error(&self, error: &E) -> Verdict {
        self.errors.check_error(error)
    }

    fn check_ok(&self, value: &T) -> Verdict {
        (self.predicate)(value).into()
    }

    fn settles(&self, error: &E) -> bool {
        self.errors.settles(error)
    }
}

impl<P: fmt::Debug, F> fmt::Debug for RetryOnResult<P, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryOnResult")
            .field("errors", &self.errors)
            .finish_non_exhaustive()
    }
}
