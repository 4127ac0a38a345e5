//! `traceparent` and `tracestate`: whatever parses formats back to a value
//! that parses to the same; a kept `tracestate` stays within the W3C limits.
#![no_main]

use keel_core::TraceParent;
use keel_core::trace::{MAX_LEN, MAX_MEMBERS, TraceState};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(parent) = text.parse::<TraceParent>() {
        let formatted = parent.to_string();
        assert_eq!(formatted.len(), 55, "{formatted}");
        let again: TraceParent = formatted.parse().expect("a formatted traceparent parses");
        assert_eq!(again, parent);
    }
    // Several header values, one per line, as a request may carry them.
    if let Some(state) = TraceState::from_raw(text.split('\n').map(Some)) {
        let kept = state.as_str();
        assert!(kept.len() <= MAX_LEN, "{} chars", kept.len());
        assert!(kept.split(',').count() <= MAX_MEMBERS);
        let again = TraceState::from_raw([Some(kept)]).expect("a kept tracestate parses");
        assert_eq!(again.as_str(), kept);
    }
});
