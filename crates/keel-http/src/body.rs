//! Reading a request body whole, within a limit.

use axum::body::{Body, Bytes};
use axum::http::{HeaderMap, header};
use http_body_util::{BodyExt, LengthLimitError, Limited};

/// Why a body could not be read whole.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BodyError {
    /// The body (or its declared `Content-Length`) is over the limit: answer
    /// `413` and say the limit.
    #[error("the body is larger than {limit} bytes")]
    TooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The connection failed or the client stopped sending mid-body.
    #[error("the body could not be read: {0}")]
    Unreadable(String),
}

/// Reads the whole body, refusing one over `limit` bytes: by its declared
/// `Content-Length` before reading anything, and otherwise as soon as more
/// than `limit` bytes arrived, so an oversized body is never buffered.
pub async fn read_limited(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<Bytes, BodyError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(BodyError::TooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(err) if err.downcast_ref::<LengthLimitError>().is_some() => {
            Err(BodyError::TooLarge { limit })
        }
        Err(err) => Err(BodyError::Unreadable(err.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bodies_over_the_limit_are_refused_declared_or_not() {
        let mut headers = HeaderMap::new();
        let read = read_limited(&headers, Body::from("12345"), 5).await;
        assert_eq!(read.unwrap(), "12345");
        let read = read_limited(&headers, Body::from("123456"), 5).await;
        assert_eq!(read.unwrap_err(), BodyError::TooLarge { limit: 5 });
        headers.insert(header::CONTENT_LENGTH, "6".parse().unwrap());
        let read = read_limited(&headers, Body::empty(), 5).await;
        assert_eq!(read.unwrap_err(), BodyError::TooLarge { limit: 5 });
    }
}
