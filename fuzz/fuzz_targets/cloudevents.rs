//! CloudEvents envelopes: the tolerant reader is lossless (parse, re-emit,
//! parse gives the same event, unknown attributes included), and binary
//! mode carries the same event (extension values as text, as CloudEvents'
//! HTTP binding has them) or refuses it.
#![no_main]

use keel_messaging::envelope::Envelope;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|data: &[u8]| {
    let Ok(event) = Envelope::from_json(data) else {
        return;
    };
    let emitted = event
        .to_json_limited(usize::MAX)
        .expect("a read event re-emits");
    let again = Envelope::from_json(&emitted).expect("a re-emitted event reads");
    assert_eq!(again, event, "structured mode is lossless");
    let Ok((headers, body)) = event.to_binary() else {
        return;
    };
    let pairs = headers.iter().map(|(k, v)| (k.as_str(), v.as_str()));
    let binary = Envelope::from_binary(pairs, &body).expect("a binary event reads");
    let mut as_text = event.clone();
    for value in as_text.extensions.values_mut() {
        if !value.is_string() {
            *value = Value::String(value.to_string());
        }
    }
    assert_eq!(binary, as_text, "binary mode carries the same event");
});
