//! `X-Request-Deadline-Unix-Ms` and `grpc-timeout`: a parsed value encodes
//! back to a valid header, a deadline near now survives the round trip, and
//! re-encoding a timeout never shortens it.
#![no_main]

use keel_core::Deadline;
use keel_core::deadline::{MAX_UNIX_MILLIS, grpc_timeout};
use libfuzzer_sys::fuzz_target;

const DAY_MS: u64 = 86_400_000;

/// How far a deadline near now may move in a round trip. Each conversion
/// between the wall clock and the monotonic clock reads both clocks (so it
/// follows wall-clock steps) and truncates to the millisecond: a round trip
/// moves it by a millisecond or two, more only if the thread is preempted
/// between two clock reads. A unit or offset bug moves it by far more.
const DRIFT_MS: u64 = 1_000;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(deadline) = Deadline::parse_header(text) {
        let ms: u64 = text.trim().parse().expect("only digits parse");
        assert!(ms <= MAX_UNIX_MILLIS);
        let header = deadline.to_header_value();
        let again = Deadline::parse_header(&header).expect("an encoded deadline parses");
        let now = keel_core::clock::unix_millis();
        if ms.abs_diff(now) < DAY_MS {
            let back = again.to_unix_millis();
            assert!(back.abs_diff(ms) <= DRIFT_MS, "{ms} came back as {back}");
        }
    }
    if let Ok(timeout) = grpc_timeout::decode(text) {
        let encoded = grpc_timeout::encode(timeout);
        assert!(encoded.len() <= 9, "{encoded}");
        let back = grpc_timeout::decode(&encoded).expect("an encoded timeout parses");
        assert!(back >= timeout, "{text} re-encoded as {encoded} is shorter");
    }
});
