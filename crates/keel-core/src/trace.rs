//! W3C Trace Context: the `traceparent` and `tracestate` headers.
//!
//! A trace only stays whole if every hop carries it on, HTTP calls and broker
//! messages alike: without it the trace stops dead at every queue.
//! [`TraceParent`] parses and validates the header by the specification,
//! formats it, and makes child spans; [`TraceParent::current`] and
//! [`TraceParent::scope`] carry it through a task.
//!
//! ```
//! use keel_core::TraceParent;
//! let tp: TraceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01".parse().unwrap();
//! assert!(tp.sampled());
//! let child = tp.child();
//! assert_eq!(child.trace_id(), tp.trace_id());
//! assert_ne!(child.parent_id(), tp.parent_id());
//! assert!("00-00000000000000000000000000000000-00f067aa0ba902b7-01".parse::<TraceParent>().is_err());
//! ```

pub mod span;
mod state;

pub use state::{InvalidTraceState, MAX_LEN, MAX_MEMBERS, TRACESTATE_HEADER, TraceState};

use std::fmt;
use std::future::Future;
use std::str::FromStr;

/// The header name.
pub const TRACEPARENT_HEADER: &str = "traceparent";

tokio::task_local! {
    static CURRENT: TraceParent;
}

/// A parsed `traceparent`: trace id, parent span id and flags.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    trace_id: [u8; 16],
    parent_id: [u8; 8],
    flags: u8,
}

/// Why a `traceparent` value was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidTraceParent {
    /// Not of the form `version-traceid-parentid-flags` with the right lengths.
    #[error("traceparent must look like `00-<32 hex>-<16 hex>-<2 hex>`")]
    Format,
    /// Contains characters other than lowercase hex digits.
    #[error("traceparent fields must be lowercase hexadecimal")]
    NotLowercaseHex,
    /// Version `ff` is forbidden by the specification.
    #[error("traceparent version ff is invalid")]
    ForbiddenVersion,
    /// The trace id or parent id is all zeros.
    #[error("traceparent trace-id and parent-id must not be all zeros")]
    ZeroId,
}

impl TraceParent {
    /// Builds a trace parent from its parts.
    pub fn new(trace_id: [u8; 16], parent_id: [u8; 8], sampled: bool) -> Self {
        Self {
            trace_id,
            parent_id,
            flags: u8::from(sampled),
        }
    }

    /// A new trace, with random ids, sampled.
    pub fn new_root() -> Self {
        Self {
            trace_id: nonzero_random::<16>(),
            parent_id: nonzero_random::<8>(),
            flags: 1,
        }
    }

    /// A child of this span: the same trace, a new span id.
    pub fn child(&self) -> Self {
        Self {
            parent_id: nonzero_random::<8>(),
            ..*self
        }
    }

    /// A new trace for work this span caused but is not part of (a
    /// message's consumer): new ids, the same sampling decision. Link the
    /// new trace to this span; do not nest it under this one, or one
    /// producer's trace swallows every consumer's retries and delays.
    pub fn linked_root(&self) -> Self {
        Self {
            trace_id: nonzero_random::<16>(),
            parent_id: nonzero_random::<8>(),
            flags: self.flags,
        }
    }

    /// The 16-byte trace id.
    pub fn trace_id(&self) -> [u8; 16] {
        self.trace_id
    }

    /// The trace id as 32 lowercase hex digits, for log lines.
    pub fn trace_id_hex(&self) -> String {
        hex(&self.trace_id)
    }

    /// The 8-byte id of the parent span.
    pub fn parent_id(&self) -> [u8; 8] {
        self.parent_id
    }

    /// The parent span id as 16 lowercase hex digits.
    pub fn parent_id_hex(&self) -> String {
        hex(&self.parent_id)
    }

    /// The trace flags byte.
    pub fn flags(&self) -> u8 {
        self.flags
    }

    /// Whether the caller sampled this trace.
    pub fn sampled(&self) -> bool {
        self.flags & 1 == 1
    }

    /// The trace context of the running task, if a [`scope`](Self::scope)
    /// set one.
    pub fn current() -> Option<TraceParent> {
        CURRENT.try_with(|t| *t).ok()
    }

    /// Runs `fut` with this trace context as the current one.
    pub fn scope<F: Future>(self, fut: F) -> impl Future<Output = F::Output> {
        CURRENT.scope(self, fut)
    }
}

/// `fut` carrying the running task's trace context (`traceparent`,
/// `tracestate` and the `tracing` span), for work a request hands to a
/// task of its own: a spawned task starts with none, and what it writes
/// (an outbox row, a log line) would fall out of the request's trace.
///
/// ```
/// # async fn demo() {
/// let work = keel_core::trace::carried(async { keel_core::TraceParent::current() });
/// let _ = tokio::spawn(work).await;
/// # }
/// ```
pub fn carried<F: Future>(fut: F) -> impl Future<Output = F::Output> {
    use tracing::Instrument as _;
    let parent = TraceParent::current();
    let state = TraceState::current();
    let fut = TraceState::scope_option(state, fut).instrument(tracing::Span::current());
    async move {
        match parent {
            Some(parent) => parent.scope(fut).await,
            None => fut.await,
        }
    }
}

impl FromStr for TraceParent {
    type Err = InvalidTraceParent;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim_matches([' ', '\t']);
        let b = s.as_bytes();
        if b.len() < 55 || b[2] != b'-' || b[35] != b'-' || b[52] != b'-' {
            return Err(InvalidTraceParent::Format);
        }
        let version = parse_hex::<1>(&b[0..2])?[0];
        if version == 0xff {
            return Err(InvalidTraceParent::ForbiddenVersion);
        }
        // Version 00 is exactly 55 characters; later versions may append
        // fields after a dash, which we must ignore.
        if (version == 0 && b.len() != 55) || (b.len() > 55 && b[55] != b'-') {
            return Err(InvalidTraceParent::Format);
        }
        let trace_id = parse_hex::<16>(&b[3..35])?;
        let parent_id = parse_hex::<8>(&b[36..52])?;
        let flags = parse_hex::<1>(&b[53..55])?[0];
        if trace_id == [0; 16] || parent_id == [0; 8] {
            return Err(InvalidTraceParent::ZeroId);
        }
        Ok(Self {
            trace_id,
            parent_id,
            flags,
        })
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{}-{}-{:02x}",
            hex(&self.trace_id),
            hex(&self.parent_id),
            self.flags
        )
    }
}

fn parse_hex<const N: usize>(digits: &[u8]) -> Result<[u8; N], InvalidTraceParent> {
    let mut out = [0u8; N];
    for (i, pair) in digits.chunks_exact(2).enumerate() {
        out[i] = nibble(pair[0])? << 4 | nibble(pair[1])?;
    }
    Ok(out)
}

fn nibble(c: u8) -> Result<u8, InvalidTraceParent> {
    match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        _ => Err(InvalidTraceParent::NotLowercaseHex),
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    s
}

fn nonzero_random<const N: usize>() -> [u8; N] {
    loop {
        let mut out = [0u8; N];
        out.iter_mut().for_each(|b| *b = fastrand::u8(..));
        if out != [0; N] {
            return out;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SPEC_EXAMPLE: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn round_trips_the_spec_example() {
        let tp: TraceParent = SPEC_EXAMPLE.parse().unwrap();
        assert_eq!(tp.to_string(), SPEC_EXAMPLE);
        assert_eq!(tp.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
    }

    #[test]
    fn rejects_what_the_spec_rejects() {
        let cases = [
            ("", InvalidTraceParent::Format),
            (
                "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                InvalidTraceParent::ForbiddenVersion,
            ),
            (
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
                InvalidTraceParent::NotLowercaseHex,
            ),
            (
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                InvalidTraceParent::ZeroId,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                InvalidTraceParent::ZeroId,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
                InvalidTraceParent::Format,
            ),
            (
                "00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                InvalidTraceParent::Format,
            ),
        ];
        for (input, want) in cases {
            assert_eq!(input.parse::<TraceParent>(), Err(want), "{input:?}");
        }
    }

    #[test]
    fn future_versions_ignore_extra_fields() {
        let tp: TraceParent =
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-the-future-holds"
                .parse()
                .unwrap();
        assert_eq!(tp.to_string(), SPEC_EXAMPLE);
    }

    #[tokio::test]
    async fn scope_sets_current() {
        assert!(TraceParent::current().is_none());
        let root = TraceParent::new_root();
        root.scope(async move { assert_eq!(TraceParent::current(), Some(root)) })
            .await;
    }

    proptest! {
        #[test]
        fn never_panics(s in "\\PC{0,80}") {
            let _ = s.parse::<TraceParent>();
        }

        #[test]
        fn formatted_values_parse(t in any::<[u8; 16]>(), p in any::<[u8; 8]>(), f in any::<u8>()) {
            prop_assume!(t != [0; 16] && p != [0; 8]);
            let tp = TraceParent { trace_id: t, parent_id: p, flags: f };
            prop_assert_eq!(tp.to_string().parse::<TraceParent>(), Ok(tp));
        }
    }
}
