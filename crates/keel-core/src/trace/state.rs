//! W3C Trace Context's `tracestate`: the vendors' own data that rides with
//! `traceparent`, carried on unchanged by every hop that does not own a
//! member of it.
//!
//! A `tracestate` that breaks the specification's rules (more than 32
//! members, a key or value outside its grammar, a key twice, more than 512
//! characters) is dropped whole, never forwarded in part: the
//! specification forbids passing on what could not be parsed, and the
//! trace itself (`traceparent`) is unaffected.
//!
//! ```
//! use keel_core::trace::TraceState;
//!
//! let state = TraceState::from_values(["rojo=00f067aa0ba902b7", "congo=t61rcWkgMzE"]).unwrap();
//! assert_eq!(state.unwrap().as_str(), "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE");
//! assert!(TraceState::from_values(["Bad Key=1"]).is_err());
//! assert!(TraceState::from_values([""]).unwrap().is_none());
//! ```

use std::fmt;
use std::future::Future;
use std::sync::Arc;

/// The header name.
pub const TRACESTATE_HEADER: &str = "tracestate";

/// The most list members a `tracestate` may hold.
pub const MAX_MEMBERS: usize = 32;

/// The longest `tracestate` Keel carries on, in characters (the length
/// the specification asks every vendor to propagate).
pub const MAX_LEN: usize = 512;

tokio::task_local! {
    static CURRENT: TraceState;
}

/// A validated `tracestate`, its members joined by `,`; cheap to clone.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TraceState(Arc<str>);

/// Why a `tracestate` was dropped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidTraceState {
    /// More than [`MAX_MEMBERS`] list members.
    #[error("tracestate has more than {MAX_MEMBERS} members")]
    TooManyMembers,
    /// Longer than [`MAX_LEN`] characters.
    #[error("tracestate is longer than {MAX_LEN} characters")]
    TooLong,
    /// A member is not `key=value` by the grammar.
    #[error("tracestate member `{0}` is not key=value by the W3C grammar")]
    Member(String),
    /// A key appears twice.
    #[error("tracestate key `{0}` appears twice")]
    DuplicateKey(String),
}

impl TraceState {
    /// The `tracestate` of one or more header values (several are one
    /// list, in order); `None` when they hold no member.
    pub fn from_values<'a>(
        values: impl IntoIterator<Item = &'a str>,
    ) -> Result<Option<Self>, InvalidTraceState> {
        let mut members: Vec<&str> = Vec::new();
        for value in values {
            members.extend(
                value
                    .split(',')
                    .map(|m| m.trim_matches([' ', '\t']))
                    .filter(|m| !m.is_empty()),
            );
        }
        if members.is_empty() {
            return Ok(None);
        }
        if members.len() > MAX_MEMBERS {
            return Err(InvalidTraceState::TooManyMembers);
        }
        let mut keys: Vec<&str> = Vec::with_capacity(members.len());
        for member in &members {
            let key = check_member(member)?;
            if keys.contains(&key) {
                return Err(InvalidTraceState::DuplicateKey(key.to_owned()));
            }
            keys.push(key);
        }
        let joined = members.join(",");
        if joined.len() > MAX_LEN {
            return Err(InvalidTraceState::TooLong);
        }
        Ok(Some(Self(joined.into())))
    }

    /// The `tracestate` of raw header values, as an edge reads them: a
    /// value that is not visible ASCII (`None`) or an invalid list drops
    /// the whole header; `None` also when there is none.
    pub fn from_raw<'a>(values: impl IntoIterator<Item = Option<&'a str>>) -> Option<Self> {
        let values: Option<Vec<&str>> = values.into_iter().collect();
        Self::from_values(values?).ok().flatten()
    }

    /// The header value.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The `tracestate` of the running task, if a [`scope`](Self::scope)
    /// set one.
    pub fn current() -> Option<TraceState> {
        CURRENT.try_with(Clone::clone).ok()
    }

    /// Runs `fut` with this `tracestate` as the current one.
    pub fn scope<F: Future>(self, fut: F) -> impl Future<Output = F::Output> {
        CURRENT.scope(self, fut)
    }

    /// Runs `fut` with `state` as the current `tracestate`, or with none.
    pub async fn scope_option<F: Future>(state: Option<Self>, fut: F) -> F::Output {
        match state {
            Some(state) => state.scope(fut).await,
            None => fut.await,
        }
    }
}

impl fmt::Display for TraceState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Checks `key=value` by the W3C grammar; returns the key.
fn check_member(member: &str) -> Result<&str, InvalidTraceState> {
    let bad = || InvalidTraceState::Member(member.chars().take(64).collect());
    let (key, value) = member.split_once('=').ok_or_else(bad)?;
    if !valid_key(key) || !valid_value(value) {
        return Err(bad());
    }
    Ok(key)
}

fn key_char(c: u8) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'_' | b'-' | b'*' | b'/')
}

/// `simple-key`, or `tenant-id@system-id` (multi-tenant).
fn valid_key(key: &str) -> bool {
    let b = key.as_bytes();
    match key.split_once('@') {
        None => {
            (1..=256).contains(&b.len())
                && b[0].is_ascii_lowercase()
                && b.iter().all(|&c| key_char(c))
        }
        Some((tenant, system)) => {
            let (t, s) = (tenant.as_bytes(), system.as_bytes());
            (1..=241).contains(&t.len())
                && (t[0].is_ascii_lowercase() || t[0].is_ascii_digit())
                && t.iter().all(|&c| key_char(c))
                && (1..=14).contains(&s.len())
                && s[0].is_ascii_lowercase()
                && s.iter().all(|&c| key_char(c))
        }
    }
}

/// Up to 256 printable characters other than `,` and `=`, not ending in a
/// space.
fn valid_value(value: &str) -> bool {
    let b = value.as_bytes();
    (1..=256).contains(&b.len())
        && b.iter()
            .all(|&c| (0x20..=0x7e).contains(&c) && c != b',' && c != b'=')
        && b[b.len() - 1] != b' '
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_are_checked_by_the_grammar() {
        for good in ["a=1", "a1_-*/b=x y", "tenant@sys=v", "0t@s=v", "k=~!\"#"] {
            assert!(TraceState::from_values([good]).unwrap().is_some(), "{good}");
        }
        for bad in [
            "A=1", "1a=1", "a", "a=", "@s=1", "t@=1", "t@S=1", "a=b=c", "a=\u{e9}",
        ] {
            let parsed = TraceState::from_values([bad]);
            assert!(
                !matches!(parsed, Ok(Some(_))),
                "{bad:?} must not parse as a whole member: {parsed:?}"
            );
        }
    }

    #[test]
    fn limits_and_duplicates_drop_the_whole_header() {
        let many: Vec<String> = (0..33).map(|i| format!("k{i}=v")).collect();
        assert_eq!(
            TraceState::from_values([many.join(",").as_str()]),
            Err(InvalidTraceState::TooManyMembers)
        );
        let long = format!("a={}", "x".repeat(256));
        let twice = [
            long.as_str(),
            &long.replace("a=", "b="),
            &long.replace("a=", "c="),
        ];
        assert_eq!(
            TraceState::from_values(twice),
            Err(InvalidTraceState::TooLong)
        );
        assert_eq!(
            TraceState::from_values(["a=1", "a=2"]),
            Err(InvalidTraceState::DuplicateKey("a".into()))
        );
    }

    #[test]
    fn several_values_are_one_list_and_blanks_are_skipped() {
        let state = TraceState::from_values(["a=1 , ,b=2", " c=3"])
            .unwrap()
            .unwrap();
        assert_eq!(state.as_str(), "a=1,b=2,c=3");
    }

    #[tokio::test]
    async fn the_current_state_is_scoped_to_a_task() {
        assert_eq!(TraceState::current(), None);
        let state = TraceState::from_values(["a=1"]).unwrap().unwrap();
        let seen = state.clone().scope(async { TraceState::current() }).await;
        assert_eq!(seen, Some(state));
    }
}
