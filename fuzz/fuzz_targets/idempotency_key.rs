//! `Idempotency-Key` and the request fingerprint: a key that parses is 1 to
//! 255 visible ASCII characters and parses the same quoted; the fingerprint
//! is stable and tells different bodies apart.
#![no_main]

use http::{HeaderMap, HeaderName, HeaderValue, Request};
use keel_http::idempotency::fuzzing::{fingerprint, parse_key};
use keel_http::idempotency::{IDEMPOTENCY_KEY, MAX_KEY_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut headers = HeaderMap::new();
    for line in data.split(|b| *b == b'\n') {
        if let Ok(value) = HeaderValue::from_bytes(line) {
            headers.append(IDEMPOTENCY_KEY, value);
        }
    }
    if let Ok(Some(key)) = parse_key(&headers) {
        assert!((1..=MAX_KEY_LEN).contains(&key.len()));
        assert!(key.bytes().all(|b| (0x21..=0x7e).contains(&b)));
        let quoted = format!("\"{}\"", key.replace('\\', "\\\\").replace('"', "\\\""));
        let mut again = HeaderMap::new();
        again.insert(IDEMPOTENCY_KEY, HeaderValue::from_str(&quoted).unwrap());
        assert_eq!(parse_key(&again).unwrap().as_deref(), Some(key.as_str()));
    }
    let (parts, ()) = Request::post("/orders?x=1")
        .header("content-type", "application/json")
        .body(())
        .unwrap()
        .into_parts();
    let names = [HeaderName::from_static("content-type")];
    let print = fingerprint(&parts, &names, data);
    assert_eq!(print, fingerprint(&parts, &names, data), "stable");
    let mut longer = data.to_vec();
    longer.push(0);
    assert_ne!(print, fingerprint(&parts, &names, &longer), "another body");
});
