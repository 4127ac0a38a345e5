//! What the `cloudevents` fuzz target found, kept as tests: the envelope
//! reader is lossless, and binary mode carries the same event or refuses it.

use keel_store::envelope::{Envelope, EnvelopeError};

fn read(json: &str) -> Envelope {
    Envelope::from_json(json.as_bytes()).expect("a valid event")
}

fn binary_round_trip(event: &Envelope) -> Result<Envelope, EnvelopeError> {
    let (headers, body) = event.to_binary()?;
    let pairs = headers.iter().map(|(k, v)| (k.as_str(), v.as_str()));
    Envelope::from_binary(pairs, &body)
}

const BASE: &str =
    r#""specversion":"1.0","id":"e-1","source":"/shop","type":"shop.order.placed.v1""#;

#[test]
fn a_number_read_and_written_again_is_the_same_number() {
    let event = read(&format!(r#"{{{BASE},"amount":4442e+44}}"#));
    let again = Envelope::from_json(&event.to_json().unwrap()).unwrap();
    assert_eq!(again, event);
}

#[test]
fn a_time_finer_than_a_millisecond_survives_binary_mode() {
    let event = read(&format!(r#"{{{BASE},"time":"2026-12-04T00:00:00.0007Z"}}"#));
    assert_eq!(binary_round_trip(&event).unwrap(), event);
    let millis = read(&format!(r#"{{{BASE},"time":"2026-12-04T00:00:00.123Z"}}"#));
    let (headers, _) = millis.to_binary().unwrap();
    let time = headers.iter().find(|(k, _)| k == "ce-time").unwrap();
    assert_eq!(
        time.1, "2026-12-04T00:00:00.123Z",
        "Keel's own events keep their format"
    );
}

#[test]
fn an_extension_name_binary_mode_cannot_carry_is_refused_not_changed() {
    let event = read(&format!(
        r#"{{{BASE},"datacontenttXpe":"application/json"}}"#
    ));
    assert!(
        event.extensions.contains_key("datacontenttXpe"),
        "read tolerantly"
    );
    let refused = binary_round_trip(&event).unwrap_err();
    assert!(refused.to_string().contains("lowercase"), "{refused}");
    assert!(
        event.validate().is_err(),
        "and never produced by the outbox"
    );
}
