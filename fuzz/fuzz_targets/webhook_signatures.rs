//! Webhook signatures, Standard Webhooks and `t=…,v1=…`: any headers are
//! answered without a panic and never accepted for a body they do not
//! sign; what Keel signs verifies, and one changed byte does not.
#![no_main]

use http::{HeaderMap, HeaderName, HeaderValue};
use keel_webhooks::signing::{Secret, SignatureScheme, Verifier, signature_headers};
use libfuzzer_sys::fuzz_target;

const NOW: i64 = 1_767_225_600;

fuzz_target!(|data: &[u8]| {
    let secret = Secret::from_key(b"keel-fuzz-webhook-secret-key-32b").expect("a key");
    let (head, body) = data.split_at(data.len() / 2);
    for scheme in [
        SignatureScheme::StandardWebhooks,
        SignatureScheme::timestamped_hex(),
    ] {
        let verifier = Verifier::new([secret.clone()]).scheme(scheme.clone());
        // Arbitrary headers: one `name: value` per line.
        let mut headers = HeaderMap::new();
        for line in head.split(|b| *b == b'\n') {
            let Some(colon) = line.iter().position(|b| *b == b':') else {
                continue;
            };
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(&line[..colon]),
                HeaderValue::from_bytes(line[colon + 1..].trim_ascii()),
            ) {
                headers.append(name, value);
            }
        }
        let _ = verifier.verify(&headers, body, NOW);

        let signed =
            signature_headers(&scheme, [&secret], "msg_fuzz", NOW, body).expect("a valid id signs");
        let signed: HeaderMap = signed.into_iter().collect();
        verifier
            .verify(&signed, body, NOW)
            .expect("what Keel signs verifies");
        if let Some((first, rest)) = body.split_first() {
            let mut changed = vec![first ^ 1];
            changed.extend_from_slice(rest);
            assert!(
                verifier.verify(&signed, &changed, NOW).is_err(),
                "a changed body"
            );
        }
    }
});
