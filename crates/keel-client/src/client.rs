//! [`PropagatingClient`]: a `reqwest::Client` that carries the deadline and
//! the trace on, and will not start a call that cannot finish in time.

use std::time::Duration;

use http::HeaderValue;
use keel_core::deadline::{DEADLINE_HEADER, MIN_TIME_TO_START};
use keel_core::trace::{TRACEPARENT_HEADER, TRACESTATE_HEADER};
use keel_core::{Deadline, Rejected};
use keel_policy::chaos::{ChaosExperiment, EXPERIMENT_HEADER};
use tracing::Instrument as _;

use crate::dependency::DependencyBuilder;
use crate::error::{HttpCallError, parse_retry_after};
use crate::recycle::{ClientPool, ConnectionRecycling};

/// The client's own time limit per request when none is set: 10 s. The
/// current deadline shortens it.
pub const DEFAULT_CLIENT_TIMEOUT: Duration = Duration::from_secs(10);

/// The most of an error response's body kept in
/// [`HttpCallError::Status`]: 4 KiB.
pub const ERROR_BODY_LIMIT: usize = 4 * 1024;

/// A `reqwest::Client` that propagates the request's deadline and trace on
/// every call. Cheap to clone.
///
/// For each request it:
///
/// 1. refuses with [`Rejected::DeadlineExceeded`] if no more than
///    [`min_time_to_start`](Self::min_time_to_start) (50 ms) is left before
///    the current [`Deadline`]: nothing is sent;
/// 2. sets the request timeout to `min(own timeout, time left)`, and sends
///    the deadline that makes, `X-Request-Deadline-Unix-Ms`, so the
///    dependency stops when we stop waiting;
/// 3. sends `traceparent` as a new child span of the current
///    [`TraceParent`](keel_core::TraceParent) (a new trace without one), and the chaos experiment
///    the request belongs to, if any (`x-chaos-experiment`);
/// 4. turns an error status into [`HttpCallError::Status`], with its
///    `Retry-After` and the start of its body.
///
/// The deadline and trace headers overwrite any the request already has.
/// Behind a load balancer, give its connections a bounded life with
/// [`recycling`](Self::recycling), so new backends get traffic.
///
/// ```no_run
/// use keel_client::PropagatingClient;
///
/// # async fn pricing() -> Result<(), keel_client::HttpCallError> {
/// let client = PropagatingClient::new(reqwest::Client::new());
/// // Inside a handler behind `DeadlineLayer` and `TraceContextLayer`:
/// let price = client.send(client.inner().get("http://127.0.0.1:8081/price")).await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct PropagatingClient {
    client: ClientPool,
    timeout: Duration,
    min_time_to_start: Duration,
}

impl PropagatingClient {
    /// Wraps `client`, with the default timeout of 10 s and a minimum of
    /// 50 ms left to start a call.
    pub fn new(client: reqwest::Client) -> Self {
        Self::over(ClientPool::fixed(client))
    }

    /// A client whose connections retire by `recycling`: `make` builds
    /// each fresh `reqwest::Client` (with the same settings every time).
    ///
    /// ```
    /// use std::time::Duration;
    /// use keel_client::{ConnectionRecycling, PropagatingClient};
    ///
    /// let client = PropagatingClient::recycling(
    ///     reqwest::Client::new,
    ///     ConnectionRecycling::after(Duration::from_secs(120)).or_after_requests(10_000),
    /// );
    /// # let _ = client;
    /// ```
    pub fn recycling(
        make: impl Fn() -> reqwest::Client + Send + Sync + 'static,
        recycling: ConnectionRecycling,
    ) -> Self {
        Self::over(ClientPool::recycling(std::sync::Arc::new(make), recycling))
    }

    fn over(client: ClientPool) -> Self {
        Self {
            client,
            timeout: DEFAULT_CLIENT_TIMEOUT,
            min_time_to_start: MIN_TIME_TO_START,
        }
    }

    /// The longest a request may take when the deadline allows more
    /// (default [`DEFAULT_CLIENT_TIMEOUT`]). Zero is replaced by the default.
    #[must_use]
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = if timeout.is_zero() {
            DEFAULT_CLIENT_TIMEOUT
        } else {
            timeout
        };
        self
    }

    /// Refuses to start a call when no more than this is left before the
    /// deadline (default [`MIN_TIME_TO_START`], 50 ms).
    #[must_use]
    pub fn min_time_to_start(mut self, min: Duration) -> Self {
        self.min_time_to_start = min;
        self
    }

    /// The wrapped client (the current one, when recycling), to build
    /// requests with. Calls go through [`send`](Self::send) or
    /// [`execute`](Self::execute), which pick the client that sends them.
    pub fn inner(&self) -> reqwest::Client {
        self.client.peek()
    }

    /// A [`Dependency`](super::Dependency) named `name` that calls through
    /// this client, to configure and build.
    pub fn dependency(&self, name: &str) -> DependencyBuilder {
        DependencyBuilder::new(name, self.clone())
    }

    /// Builds and sends a request; see [`execute`](Self::execute).
    pub async fn send(
        &self,
        builder: reqwest::RequestBuilder,
    ) -> Result<reqwest::Response, HttpCallError> {
        let request = builder
            .build()
            .map_err(|source| HttpCallError::Invalid { source })?;
        self.execute(request).await
    }

    /// Sends `request` with the deadline and trace headers, or refuses it
    /// if too little time is left; an error status is an error.
    pub async fn execute(
        &self,
        mut request: reqwest::Request,
    ) -> Result<reqwest::Response, HttpCallError> {
        let current = Deadline::current();
        let mut allowed = self.timeout;
        if let Some(deadline) = current {
            let remaining = deadline.remaining();
            if remaining <= self.min_time_to_start {
                metrics::counter!("keel_http_client_refused_total", "reason" => "deadline")
                    .increment(1);
                tracing::debug!(
                    url = %request.url(),
                    ?remaining,
                    "too little time left before the deadline: call not started"
                );
                return Err(HttpCallError::Rejected(Rejected::DeadlineExceeded));
            }
            allowed = allowed.min(remaining);
        }
        if let Some(&own) = request.timeout() {
            allowed = allowed.min(own);
        }
        *request.timeout_mut() = Some(allowed);
        let deadline = Deadline::after(allowed).min_with(current);
        let client_span = client_span(&request);
        let (span, state) = keel_core::trace::span::outgoing(&client_span);
        let headers = request.headers_mut();
        if let Ok(value) = HeaderValue::from_str(&deadline.to_header_value()) {
            headers.insert(DEADLINE_HEADER, value);
        }
        if let Ok(value) = HeaderValue::from_str(&span.to_string()) {
            headers.insert(TRACEPARENT_HEADER, value);
        }
        if let Some(state) = state
            && let Ok(value) = HeaderValue::from_str(state.as_str())
        {
            headers.insert(TRACESTATE_HEADER, value);
        }
        // The experiment follows the request downstream, as the trace does.
        if let Some(experiment) = ChaosExperiment::current()
            && let Ok(value) = HeaderValue::from_str(&experiment)
        {
            headers.insert(EXPERIMENT_HEADER, value);
        }
        self.transmit(request, allowed)
            .instrument(client_span)
            .await
    }

    async fn transmit(
        &self,
        request: reqwest::Request,
        allowed: Duration,
    ) -> Result<reqwest::Response, HttpCallError> {
        let url = request.url().clone();
        let sent = self.client.for_call().execute(request).await;
        let response = sent.map_err(|source| {
            tracing::Span::current().record("otel.status_code", "ERROR");
            HttpCallError::from_reqwest(source, allowed)
        })?;
        let status = response.status();
        let span = tracing::Span::current();
        span.record("http.response.status_code", i64::from(status.as_u16()));
        if status.is_client_error() || status.is_server_error() {
            span.record("otel.status_code", "ERROR");
            let retry_after = parse_retry_after(response.headers());
            let body = body_excerpt(response).await;
            tracing::debug!(%url, %status, ?retry_after, "dependency answered with an error status");
            return Err(HttpCallError::Status {
                status,
                url: url.to_string(),
                retry_after,
                body,
            });
        }
        Ok(response)
    }
}

/// The client span, with the OpenTelemetry HTTP client conventions
/// attributes.
fn client_span(request: &reqwest::Request) -> tracing::Span {
    let method = request.method().as_str();
    let url = request.url();
    tracing::info_span!(
        "http.client",
        otel.name = %method,
        otel.kind = "client",
        otel.status_code = tracing::field::Empty,
        "http.request.method" = %method,
        "server.address" = url.host_str().unwrap_or_default(),
        "server.port" = i64::from(url.port_or_known_default().unwrap_or_default()),
        "url.full" = %url,
        "http.response.status_code" = tracing::field::Empty,
    )
}

/// The start of a response body, at most [`ERROR_BODY_LIMIT`] bytes; what
/// cannot be read in time is left out.
async fn body_excerpt(mut response: reqwest::Response) -> String {
    let mut bytes = Vec::new();
    while bytes.len() < ERROR_BODY_LIMIT {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                let room = ERROR_BODY_LIMIT - bytes.len();
                bytes.extend_from_slice(&chunk[..chunk.len().min(room)]);
            }
            Ok(None) | Err(_) => break,
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}
