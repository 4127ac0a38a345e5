//! How topics, groups and keys become JetStream stream names, subjects,
//! consumer names and cursor keys.
//!
//! Keel's names are free text; NATS tokens may not contain `.`, `*`, `>` or
//! whitespace, and stream names must also avoid path separators. Every name
//! is therefore escaped *injectively*: ASCII letters, digits and `-` stay as
//! they are, every other byte becomes `_XX` (upper-case hex). Two different
//! names never share a token, so two keys never share a subject and never
//! wait for each other.

use keel_store::broker::BrokerError;

/// The longest escaped token this crate creates; JetStream's limit on stream
/// names is 255 bytes and the prefix and separators need some of it.
const MAX_TOKEN: usize = 200;

/// `name` escaped into a NATS token (see the module docs); the empty name
/// becomes `_`, which no escaped non-empty name can produce.
pub(crate) fn token(name: &str) -> String {
    if name.is_empty() {
        return "_".to_owned();
    }
    let mut out = String::with_capacity(name.len());
    for byte in name.bytes() {
        if byte.is_ascii_alphanumeric() || byte == b'-' {
            out.push(char::from(byte));
        } else {
            out.push('_');
            out.push_str(&format!("{byte:02X}"));
        }
    }
    out
}

/// Reverses [`token`]; `None` for text `token` never produces.
pub(crate) fn untoken(token: &str) -> Option<String> {
    if token == "_" {
        return Some(String::new());
    }
    let bytes = token.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'_' {
            let hex = token.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

/// A topic or group name as a token, refusing empty and overlong names.
pub(crate) fn checked_token(what: &str, name: &str) -> Result<String, BrokerError> {
    if name.is_empty() {
        return Err(BrokerError::Invalid(format!("the {what} name is empty")));
    }
    let escaped = token(name);
    if escaped.len() > MAX_TOKEN {
        return Err(BrokerError::Invalid(format!(
            "the {what} name {name:?} is too long for NATS ({} bytes escaped, at most {MAX_TOKEN})",
            escaped.len()
        )));
    }
    Ok(escaped)
}

/// The names of one topic's JetStream objects under a prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TopicNames {
    /// The escaped topic.
    pub(crate) topic_token: String,
    /// The stream holding the topic: `<prefix>_<topic>`.
    pub(crate) stream: String,
    /// `<prefix>.<topic>`; message subjects are `<base>.k.<key>`.
    base: String,
}

impl TopicNames {
    /// The names for `topic` under `prefix` (already validated).
    pub(crate) fn new(prefix: &str, topic: &str) -> Result<Self, BrokerError> {
        let topic_token = checked_token("topic", topic)?;
        Ok(Self {
            stream: format!("{prefix}_{topic_token}"),
            base: format!("{prefix}.{topic_token}"),
            topic_token,
        })
    }

    /// The subjects the stream captures.
    pub(crate) fn stream_subjects(&self) -> String {
        format!("{}.k.>", self.base)
    }

    /// The subject of messages with `key`.
    pub(crate) fn subject(&self, key: &str) -> String {
        format!("{}.k.{}", self.base, token(key))
    }

    /// The escaped key of a message subject, or `None` for a foreign one.
    pub(crate) fn key_token<'a>(&self, subject: &'a str) -> Option<&'a str> {
        subject
            .strip_prefix(self.base.as_str())?
            .strip_prefix(".k.")
            .filter(|rest| !rest.is_empty() && !rest.contains('.'))
    }

    /// The cursor-bucket key of `group_token`'s position in `key_token`.
    pub(crate) fn cursor_key(&self, group_token: &str, key_token: &str) -> String {
        format!("{}.{group_token}.{key_token}", self.topic_token)
    }
}

/// Checks a stream-name prefix: a non-empty NATS token usable in stream and
/// bucket names.
pub(crate) fn check_prefix(prefix: &str) -> Result<(), BrokerError> {
    let valid = !prefix.is_empty()
        && prefix.len() <= 32
        && prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if valid {
        Ok(())
    } else {
        Err(BrokerError::Invalid(format!(
            "the stream prefix {prefix:?} must be 1-32 ASCII letters, digits, '-' or '_'"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_injective_and_reversible() {
        let names = ["", "a", "a.b", "a_b", "a_2Eb", "é", "x y*>", "order-7"];
        let tokens: Vec<String> = names.iter().map(|n| token(n)).collect();
        for (i, a) in tokens.iter().enumerate() {
            assert!(!a.contains('.') && !a.contains('*') && !a.contains('>'));
            assert_eq!(untoken(a).as_deref(), Some(names[i]));
            for b in &tokens[i + 1..] {
                assert_ne!(a, b);
            }
        }
    }

    #[test]
    fn subjects_round_trip_their_key() {
        let names = TopicNames::new("KEEL", "orders.v1").expect("valid");
        assert_eq!(names.stream, "KEEL_orders_2Ev1");
        let subject = names.subject("customer.42");
        assert_eq!(names.key_token(&subject), Some("customer_2E42"));
        assert_eq!(names.key_token("KEEL.other.k.x"), None);
    }

    #[test]
    fn bad_names_are_refused() {
        assert!(TopicNames::new("KEEL", "").is_err());
        assert!(TopicNames::new("KEEL", &"x".repeat(300)).is_err());
        assert!(check_prefix("a.b").is_err());
        assert!(check_prefix("").is_err());
        assert!(check_prefix("T0123_x-y").is_ok());
    }
}
