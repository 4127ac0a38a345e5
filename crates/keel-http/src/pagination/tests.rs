use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;

use super::*;

const KEY: &[u8; 32] = b"0123456789abcdef0123456789abcdef";
const OTHER_KEY: &[u8; 32] = b"fedcba9876543210fedcba9876543210";

fn codec() -> CursorCodec {
    CursorCodec::new(*KEY).expect("key")
}

#[test]
fn round_trips_and_is_opaque() {
    let cursor = codec()
        .encode("/orders", &Cursor::new(1_700_000_000_123_i64, "A-4471"))
        .expect("encode");
    assert!(
        cursor
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    );
    let back: Cursor<i64, String> = codec().decode("/orders", &cursor).expect("decode");
    assert_eq!(back, Cursor::new(1_700_000_000_123, "A-4471".to_owned()));
}

#[test]
fn every_altered_byte_is_refused() {
    let cursor = codec()
        .encode("/orders", &Cursor::new(5_i64, 9_i64))
        .expect("encode");
    let bytes = URL_SAFE_NO_PAD.decode(&cursor).expect("base64");
    for i in 1..bytes.len() {
        let mut changed = bytes.clone();
        changed[i] ^= 0x01;
        let err = codec()
            .decode::<Cursor<i64, i64>>("/orders", &URL_SAFE_NO_PAD.encode(&changed))
            .expect_err("altered");
        assert_eq!(err, CursorError::BadSignature, "byte {i}");
    }
    for len in 0..bytes.len() {
        let err = codec()
            .decode::<Cursor<i64, i64>>("/orders", &URL_SAFE_NO_PAD.encode(&bytes[..len]))
            .expect_err("truncated");
        assert!(
            matches!(err, CursorError::Truncated | CursorError::BadSignature),
            "len {len}: {err:?}"
        );
    }
}

#[test]
fn version_scope_key_and_size_are_checked() {
    let cursor = codec()
        .encode("/orders", &Cursor::new(5_i64, 9_i64))
        .expect("encode");
    let mut bytes = URL_SAFE_NO_PAD.decode(&cursor).expect("base64");
    bytes[0] = 2;
    assert_eq!(
        codec().decode::<Cursor<i64, i64>>("/orders", &URL_SAFE_NO_PAD.encode(&bytes)),
        Err(CursorError::UnsupportedVersion(2))
    );
    assert_eq!(
        codec().decode::<Cursor<i64, i64>>("/customers", &cursor),
        Err(CursorError::BadSignature)
    );
    let other = CursorCodec::new(*OTHER_KEY).expect("key");
    assert_eq!(
        other.decode::<Cursor<i64, i64>>("/orders", &cursor),
        Err(CursorError::BadSignature)
    );
    let rotated = other.with_previous_key(*KEY).expect("key");
    assert_eq!(
        rotated.decode::<Cursor<i64, i64>>("/orders", &cursor),
        Ok(Cursor::new(5, 9))
    );
    assert_eq!(
        codec().decode::<Cursor<i64, i64>>("/orders", "not base64!"),
        Err(CursorError::NotBase64)
    );
    let long = "A".repeat(DEFAULT_MAX_CURSOR_LEN + 1);
    assert!(matches!(
        codec().decode::<Cursor<i64, i64>>("/orders", &long),
        Err(CursorError::TooLong { .. })
    ));
    assert_eq!(
        codec().decode::<Cursor<String, i64>>("/orders", &cursor),
        Err(CursorError::Position)
    );
    assert_eq!(
        CursorCodec::new(vec![0_u8; 31]).err(),
        Some(CursorKeyError { len: 31 })
    );
}

#[test]
fn seek_sql_for_both_directions() {
    let desc = Seek::new("created_at", "id", Order::Desc).expect("seek");
    assert_eq!(desc.predicate("$1", "$2"), "(created_at, id) < ($1, $2)");
    assert_eq!(desc.order_by(), "created_at DESC, id DESC");
    assert_eq!(
        desc.predicate_expanded("?1", "?2"),
        "(created_at < ?1 OR (created_at = ?1 AND id < ?2))"
    );
    let asc = desc.reversed();
    assert_eq!(asc.predicate("?1", "?2"), "(created_at, id) > (?1, ?2)");
    assert_eq!(asc.order_by(), "created_at ASC, id ASC");
    assert!(Seek::new("o.created_at", "o.id", Order::Asc).is_ok());
    for bad in ["", "1abc", "id; DROP TABLE x", "a.b.c", "name\"", "a b"] {
        assert!(Seek::new(bad, "id", Order::Asc).is_err(), "{bad:?}");
    }
}

#[test]
fn limits_are_validated() {
    let p = Pagination::new(codec());
    assert!(p.clone().with_limits(0, 10).is_err());
    assert!(p.clone().with_limits(11, 10).is_err());
    assert!(p.with_limits(10, 10).is_ok());
}
