use axum::http::{HeaderMap, HeaderValue};

use super::key::{IDEMPOTENCY_KEY, IdempotencyRejection, parse_key};

fn key(value: &[u8]) -> Result<Option<String>, IdempotencyRejection> {
    let mut headers = HeaderMap::new();
    headers.insert(
        IDEMPOTENCY_KEY,
        HeaderValue::from_bytes(value).expect("header value"),
    );
    parse_key(&headers)
}

#[test]
fn bare_and_quoted_keys_are_accepted() {
    assert_eq!(key(b"abc-123").unwrap().as_deref(), Some("abc-123"));
    assert_eq!(key(b"\"abc-123\"").unwrap().as_deref(), Some("abc-123"));
    assert_eq!(key(br#""a\"b\\c""#).unwrap().as_deref(), Some(r#"a"b\c"#));
    assert_eq!(parse_key(&HeaderMap::new()).unwrap(), None);
}

#[test]
fn key_length_is_bounded_at_255() {
    let max = "k".repeat(255);
    assert_eq!(key(max.as_bytes()).unwrap().as_deref(), Some(max.as_str()));
    let over = "k".repeat(256);
    assert_eq!(
        key(over.as_bytes()),
        Err(IdempotencyRejection::KeyTooLong { len: 256 })
    );
    assert!(matches!(
        key(b"\"\""),
        Err(IdempotencyRejection::InvalidKey(_))
    ));
}

#[test]
fn malformed_keys_are_refused() {
    for bad in [
        &b"caf\xc3\xa9"[..],
        b"has space",
        b"\"unterminated",
        b"\"bad\\escape\"",
        b"\"in\"side\"",
        b"tab\there",
    ] {
        assert!(
            matches!(key(bad), Err(IdempotencyRejection::InvalidKey(_))),
            "{:?} must be refused",
            String::from_utf8_lossy(bad)
        );
    }
    let mut two = HeaderMap::new();
    two.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
    two.append(IDEMPOTENCY_KEY, HeaderValue::from_static("b"));
    assert_eq!(parse_key(&two), Err(IdempotencyRejection::MultipleKeys));
}

#[test]
fn every_refusal_has_its_status() {
    use axum::http::StatusCode;
    use std::time::Duration;
    let cases = [
        (IdempotencyRejection::MissingKey, StatusCode::BAD_REQUEST),
        (
            IdempotencyRejection::KeyTooLong { len: 300 },
            StatusCode::BAD_REQUEST,
        ),
        (
            IdempotencyRejection::BodyTooLarge { limit: 1 },
            StatusCode::PAYLOAD_TOO_LARGE,
        ),
        (
            IdempotencyRejection::InFlight {
                retry_after: Duration::from_secs(1),
            },
            StatusCode::CONFLICT,
        ),
        (
            IdempotencyRejection::KeyReused,
            StatusCode::UNPROCESSABLE_ENTITY,
        ),
        (
            IdempotencyRejection::LockLost {
                retry_after: Duration::from_secs(1),
            },
            StatusCode::SERVICE_UNAVAILABLE,
        ),
        (
            IdempotencyRejection::NotRecorded {
                retry_after: Duration::from_secs(1),
            },
            StatusCode::SERVICE_UNAVAILABLE,
        ),
    ];
    for (rejection, status) in cases {
        assert_eq!(rejection.to_problem().status, status.as_u16());
    }
}
