//! `keel.v1` WebSocket client messages: a frame is a `send` with a usable
//! id, a `resume` at a sequence number, or answered with an `error` that is
//! itself valid JSON; never a panic.
#![no_main]

use keel_realtime::MAX_CLIENT_ID_LEN;
use keel_realtime::ws::protocol::fuzz_read;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    match fuzz_read(text) {
        Ok(Ok(id)) => {
            assert!((1..=MAX_CLIENT_ID_LEN).contains(&id.len()), "{id:?}");
            assert!(!id.chars().any(char::is_control), "{id:?}");
        }
        Ok(Err(after)) => assert!(after >= 0),
        Err(answer) => {
            let answer: Value = serde_json::from_str(&answer).expect("the error answer is JSON");
            assert_eq!(answer["type"], "error");
            assert!(answer["detail"].is_string());
        }
    }
});
