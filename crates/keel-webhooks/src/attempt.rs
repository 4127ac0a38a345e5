//! One delivery attempt over HTTP: a signed `POST`, redirects followed by
//! hand and re-checked, the response read up to a cap, all under one timeout.

use std::time::Duration;

use axum::http::{HeaderMap, StatusCode, header};
use bytes::Bytes;
use keel_core::clock;
use reqwest::Url;

use super::ssrf::{SsrfError, SsrfGuard};

/// The bounds of one attempt.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Limits {
    /// For the whole attempt, every redirect hop and the response body
    /// included.
    pub(crate) timeout: Duration,
    /// Redirect hops followed before giving up.
    pub(crate) max_redirects: usize,
    /// Response body bytes kept for the log.
    pub(crate) max_response_body: usize,
}

/// What happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct AttemptResult {
    /// The URL of the last request made.
    pub(crate) url: String,
    /// The final response's status, if one came.
    pub(crate) status: Option<u16>,
    /// The start of its body.
    pub(crate) body: Option<String>,
    /// Its `Retry-After`, if any.
    pub(crate) retry_after: Option<Duration>,
    /// What went wrong, if no usable response came.
    pub(crate) error: Option<String>,
    /// Whether the SSRF guard refused a hop.
    pub(crate) refused: bool,
    /// From the first byte sent to the last byte read.
    pub(crate) latency: Duration,
}

impl AttemptResult {
    pub(crate) fn failed(url: &str, error: String) -> Self {
        Self {
            url: url.to_owned(),
            status: None,
            body: None,
            retry_after: None,
            error: Some(error),
            refused: false,
            latency: Duration::ZERO,
        }
    }
}

enum HopError {
    Refused(SsrfError),
    Http(reqwest::Error),
    TooManyRedirects(usize),
    BadLocation(String),
    CrossOrigin(String),
}

/// The final (not followed) response of an attempt.
struct Answer {
    status: StatusCode,
    retry_after: Option<Duration>,
    body: String,
}

/// POSTs `body` with `headers` to `url`, following up to
/// `limits.max_redirects` redirects, each hop checked by `guard` before it
/// is requested (and its name resolved through the guard by the client).
pub(crate) async fn post(
    client: &reqwest::Client,
    guard: &SsrfGuard,
    url: &str,
    headers: &HeaderMap,
    body: Bytes,
    limits: Limits,
    now_unix_ms: i64,
) -> AttemptResult {
    let started = clock::now();
    let mut current = match Url::parse(url) {
        Ok(url) => url,
        Err(err) => return AttemptResult::failed(url, format!("invalid URL: {err}")),
    };
    let hops = follow_redirects(
        client,
        guard,
        &mut current,
        headers,
        &body,
        limits,
        now_unix_ms,
    );
    let result = tokio::time::timeout(limits.timeout, hops).await;
    let latency = clock::now().saturating_duration_since(started);
    // `current` is where the hops got to, also when they failed or timed out.
    let mut out = AttemptResult::failed(current.as_str(), String::new());
    out.latency = latency;
    match result {
        Ok(Ok(answer)) => {
            out.status = Some(answer.status.as_u16());
            out.retry_after = answer.retry_after;
            out.body = Some(answer.body);
            out.error = None;
        }
        Ok(Err(err)) => {
            let (refused, error) = describe_hop_error(err);
            out.refused = refused;
            out.error = Some(error);
        }
        Err(_) => {
            out.error = Some(format!("timed out after {:?}", limits.timeout));
        }
    }
    out
}

/// Requests `current`, following redirects hop by hop; `current` is left at
/// the last URL requested (or refused).
async fn follow_redirects(
    client: &reqwest::Client,
    guard: &SsrfGuard,
    current: &mut Url,
    headers: &HeaderMap,
    body: &Bytes,
    limits: Limits,
    now_unix_ms: i64,
) -> Result<Answer, HopError> {
    for hop in 0..=limits.max_redirects {
        check_hop(guard, current).await?;
        let response = client
            .post(current.clone())
            .headers(headers.clone())
            .body(body.clone())
            .send()
            .await
            .map_err(HopError::Http)?;
        let status = response.status();
        if is_followed_redirect(status)
            && let Some(location) = response
                .headers()
                .get(header::LOCATION)
                .and_then(|v| v.to_str().ok())
        {
            if hop == limits.max_redirects {
                return Err(HopError::TooManyRedirects(limits.max_redirects));
            }
            *current = redirect_target(current, location)?;
            tracing::debug!(to = %current, status = status.as_u16(), "following webhook redirect");
            continue;
        }
        let retry_after = response
            .headers()
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, now_unix_ms));
        let body = read_capped(response, limits.max_response_body).await;
        return Ok(Answer {
            status,
            retry_after,
            body,
        });
    }
    Err(HopError::TooManyRedirects(limits.max_redirects))
}

/// Refuses a hop the SSRF guard denies. Denied sockets pair an address with
/// a port, so while there are any, a host name is resolved and checked with
/// the hop's port before the request is sent.
async fn check_hop(guard: &SsrfGuard, url: &Url) -> Result<(), HopError> {
    guard.check_url(url).map_err(HopError::Refused)?;
    if guard.denies_sockets()
        && let Some(host) = url.host_str()
        && !host.starts_with('[')
        && host.parse::<std::net::IpAddr>().is_err()
    {
        let port = url.port_or_known_default().unwrap_or(0);
        guard.resolve(host, port).await.map_err(HopError::Refused)?;
    }
    Ok(())
}

/// Where a redirect from `current` to `location` goes, if it stays within
/// `current`'s origin.
fn redirect_target(current: &Url, location: &str) -> Result<Url, HopError> {
    let next = current
        .join(location)
        .map_err(|e| HopError::BadLocation(format!("{location:?}: {e}")))?;
    if next.origin() != current.origin() {
        return Err(HopError::CrossOrigin(next.origin().ascii_serialization()));
    }
    Ok(next)
}

/// Whether the SSRF guard refused the hop, and the error for the delivery
/// log.
fn describe_hop_error(err: HopError) -> (bool, String) {
    match err {
        HopError::Refused(err) => (true, format!("refused by the SSRF guard: {err}")),
        HopError::Http(err) => match keel_core::error::find_cause::<SsrfError>(&err) {
            Some(ssrf) => (true, format!("refused by the SSRF guard: {ssrf}")),
            None => (false, keel_core::error::report(&err)),
        },
        HopError::TooManyRedirects(limit) => (false, format!("more than {limit} redirects")),
        HopError::CrossOrigin(to) => (
            false,
            format!(
                "redirect to another origin ({to}) not followed: the signed request goes only to \
                 the endpoint's own origin; update the endpoint's URL instead"
            ),
        ),
        HopError::BadLocation(detail) => {
            (false, format!("redirect to an invalid location {detail}"))
        }
    }
}

/// The redirects a webhook follows, within the endpoint's own origin only
/// (scheme, host and port): the signature and payload are the endpoint
/// owner's, so another host never receives them. The same signed `POST` is
/// sent to the new location for all of them: a webhook turned into a `GET` would lose
/// its payload, so even `301`/`302`/`303` keep the method (like curl's
/// `--post301 --post302 --post303`).
fn is_followed_redirect(status: StatusCode) -> bool {
    matches!(status.as_u16(), 301 | 302 | 303 | 307 | 308)
}

/// Reads at most `cap` bytes of the body (the rest is not downloaded) as
/// lossy UTF-8.
async fn read_capped(mut response: reqwest::Response, cap: usize) -> String {
    let mut kept: Vec<u8> = Vec::new();
    while let Ok(Some(chunk)) = response.chunk().await {
        let room = cap.saturating_sub(kept.len());
        kept.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if kept.len() >= cap {
            break;
        }
    }
    String::from_utf8_lossy(&kept).into_owned()
}

/// The longest `Retry-After` in seconds parsed (about 31 years); longer
/// values are clamped by the worker's bound anyway.
const MAX_RETRY_AFTER_DIGITS: usize = 10;

/// `Retry-After` as delay-seconds or an HTTP-date (relative to `now`).
pub(crate) fn parse_retry_after(value: &str, now_unix_ms: i64) -> Option<Duration> {
    let value = value.trim();
    if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        if value.len() > MAX_RETRY_AFTER_DIGITS {
            return Some(Duration::from_secs(
                10u64.pow(MAX_RETRY_AFTER_DIGITS as u32),
            ));
        }
        return value.parse().ok().map(Duration::from_secs);
    }
    let at = chrono::DateTime::parse_from_rfc2822(value).ok()?;
    let ms = at.timestamp_millis().saturating_sub(now_unix_ms).max(0);
    Some(Duration::from_millis(u64::try_from(ms).unwrap_or(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_parses_seconds_and_dates() {
        assert_eq!(parse_retry_after("120", 0), Some(Duration::from_secs(120)));
        assert_eq!(parse_retry_after(" 0 ", 0), Some(Duration::ZERO));
        let now = chrono::DateTime::parse_from_rfc2822("Sun, 06 Nov 1994 08:49:37 GMT")
            .unwrap()
            .timestamp_millis();
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:51:37 GMT", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:00:00 GMT", now),
            Some(Duration::ZERO)
        );
        assert!(parse_retry_after("99999999999999999999", 0).is_some());
        for bad in ["", "soon", "-5", "1.5"] {
            assert_eq!(parse_retry_after(bad, 0), None, "{bad:?}");
        }
    }
}
