//! A message's predecessor on its key, proven by the server.
//!
//! Handing a message out needs proof that every earlier message of its key
//! is finished (see [`crate::cursor`]). Asking the stream for the key's
//! first message after the cursor costs a round trip per delivery. So Keel's
//! publisher states which message it expects to be the last one on the
//! key's subject (`Nats-Expected-Last-Subject-Sequence`): JetStream refuses
//! the publish unless that is so, checked atomically with storing it, and
//! keeps the header on the stored message. A first delivery whose stated
//! predecessor is at or behind its key's cursor is the key's head, with no
//! round trip.
//!
//! The publisher learns each subject's last sequence from its own PubAcks
//! (a bounded memory, see the `recent` module) and guesses "none" for a
//! subject it has not published to: right for a new key, the common case of
//! an event stream. A wrong guess costs one republish without the
//! expectation (deduplicated on the message id). Such a message, like one
//! published by anyone else without an expectation, gets its head check
//! from the stream.
//!
//! A key twice in one publish is sent in rounds (see `broker.rs`): its
//! second message only once its first is stored, stating the first's
//! sequence. Sent together, a reconnect that lost the first on its way
//! would have let the second be stored ahead of it, with nothing to refuse
//! it.

use async_nats::HeaderMap;
use async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE;
use parking_lot::Mutex;

use crate::recent::Recent;

/// The header naming another subject for the expectation (nats-server
/// 2.11): a sequence checked against another subject proves nothing about
/// this one.
const EXPECTATION_SUBJECT: &str = "Nats-Expected-Last-Subject-Sequence-Subject";

/// The header JetStream puts on a message it copied from another stream.
const STREAM_SOURCE: &str = "Nats-Stream-Source";

/// How many subjects a generation of [`LastSequences`] holds. A forgotten
/// subject costs one refused guess on its next publish.
const REMEMBERED: usize = 16_384;

/// Per subject, the highest stream sequence this process saw stored: its
/// guess at the subject's last message.
#[derive(Debug)]
pub(crate) struct LastSequences {
    known: Mutex<Recent<u64>>,
}

impl Default for LastSequences {
    fn default() -> Self {
        Self {
            known: Mutex::new(Recent::new(REMEMBERED)),
        }
    }
}

impl LastSequences {
    /// The sequence to expect as `subject`'s last message: 0 (no message)
    /// for a subject not seen.
    pub(crate) fn guess(&self, subject: &str) -> u64 {
        self.known.lock().get(subject).unwrap_or(0)
    }

    /// Records that a message on `subject` was stored at `sequence`.
    pub(crate) fn stored(&self, subject: &str, sequence: u64) {
        let mut known = self.known.lock();
        let last = known.get(subject).unwrap_or(0).max(sequence);
        known.insert(subject, last);
    }
}

/// The predecessor the server checked when it stored a message with
/// `headers`: the sequence of the last message on the message's own
/// subject at that moment (0: none). `None` when the message carries no
/// such proof: published without an expectation, with the expectation
/// checked against another subject, or copied from another stream (whose
/// sequences are not this stream's).
pub(crate) fn verified(headers: Option<&HeaderMap>) -> Option<u64> {
    let headers = headers?;
    if headers.get(EXPECTATION_SUBJECT).is_some() || headers.get(STREAM_SOURCE).is_some() {
        return None;
    }
    headers
        .get(NATS_EXPECTED_LAST_SUBJECT_SEQUENCE)?
        .as_str()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_subject_not_seen_is_guessed_empty_and_the_highest_store_wins() {
        let last = LastSequences::default();
        assert_eq!(last.guess("t.k"), 0);
        last.stored("t.k", 7);
        last.stored("t.k", 5);
        assert_eq!(last.guess("t.k"), 7);
        assert_eq!(last.guess("t.other"), 0);
    }

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, *value);
        }
        map
    }

    #[test]
    fn only_an_expectation_on_the_message_s_own_subject_is_proof() {
        let own = headers(&[("Nats-Expected-Last-Subject-Sequence", "41")]);
        assert_eq!(verified(Some(&own)), Some(41));
        let empty = headers(&[("Nats-Expected-Last-Subject-Sequence", "0")]);
        assert_eq!(verified(Some(&empty)), Some(0));
        let other_subject = headers(&[
            ("Nats-Expected-Last-Subject-Sequence", "0"),
            (EXPECTATION_SUBJECT, "t.other"),
        ]);
        assert_eq!(verified(Some(&other_subject)), None);
        let sourced = headers(&[
            ("Nats-Expected-Last-Subject-Sequence", "3"),
            (STREAM_SOURCE, "origin 3 > >"),
        ]);
        assert_eq!(verified(Some(&sourced)), None);
        let garbled = headers(&[("Nats-Expected-Last-Subject-Sequence", "x")]);
        assert_eq!(verified(Some(&garbled)), None);
        assert_eq!(verified(Some(&headers(&[]))), None);
        assert_eq!(verified(None), None);
    }
}
