//! Pagination cursors: any text decodes to an error or to a position that
//! was signed under this key and scope; every position round-trips; a
//! cursor of one scope never opens in another.
#![no_main]

use keel_http::pagination::CursorCodec;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let codec = CursorCodec::new(*b"keel-fuzz-cursor-key-0123456789!").expect("a 32-byte key");
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(position) = codec.decode::<Value>("orders", text) {
        let again = codec
            .encode("orders", &position)
            .expect("a decoded position encodes");
        assert_eq!(codec.decode::<Value>("orders", &again).unwrap(), position);
    }
    let Ok(position) = serde_json::from_str::<Value>(text) else {
        return;
    };
    let Ok(cursor) = codec.encode("orders", &position) else {
        return;
    };
    assert!(cursor.len() <= codec.max_len());
    assert_eq!(
        codec
            .decode::<Value>("orders", &cursor)
            .expect("round trip"),
        position
    );
    assert!(
        codec.decode::<Value>("customers", &cursor).is_err(),
        "scopes are bound"
    );
});
