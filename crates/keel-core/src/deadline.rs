//! The time by which a request must be answered, propagated end to end.
//!
//! A timeout says how long *this* hop may wait; a deadline says when the
//! *whole* request stops mattering. Carried from the edge into every call
//! below it, a deadline lets each hop refuse work that would finish too late,
//! instead of doing it slowly for nobody.
//!
//! - [`Deadline::current`] reads the deadline of the running task, set with
//!   [`Deadline::scope`]. Scopes nest and only ever tighten.
//! - [`Deadline::from_inbound`] trusts a caller's `X-Request-Deadline-Unix-Ms`
//!   but caps it at a local maximum: a caller must not be able to pin our
//!   resources for an hour with one header.
//! - [`Deadline::check_start`] refuses to start a call with less than a
//!   minimum left ([`MIN_TIME_TO_START`], 50 ms by default).
//! - [`grpc_timeout`] encodes and decodes gRPC's `grpc-timeout` header.
//!
//! ```
//! use std::time::Duration;
//! use keel_core::Deadline;
//!
//! # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
//! let deadline = Deadline::after(Duration::from_secs(2));
//! deadline.scope(async {
//!     let current = Deadline::current().unwrap();
//!     assert!(current.remaining() <= Duration::from_secs(2));
//!     assert!(current.check_start(keel_core::deadline::MIN_TIME_TO_START).is_ok());
//! }).await;
//! assert!(Deadline::current().is_none());
//! # });
//! ```

use std::future::Future;
use std::time::Duration;

use crate::clock::{self, Instant};
use crate::error::Rejected;

/// The HTTP header that carries a deadline as Unix milliseconds.
pub const DEADLINE_HEADER: &str = "x-request-deadline-unix-ms";

/// The gRPC header that carries a relative timeout.
pub const GRPC_TIMEOUT_HEADER: &str = "grpc-timeout";

/// The least time that must remain for a call to be worth starting.
pub const MIN_TIME_TO_START: Duration = Duration::from_millis(50);

mod scope;

pub use scope::Scoped;

/// An instant by which a request must be answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Deadline {
    at: Instant,
}

/// A deadline header that could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InvalidDeadline {
    /// The header was empty.
    #[error("the deadline header is empty; send Unix milliseconds, e.g. `1767225600000`")]
    Empty,
    /// The header was not a whole number of milliseconds.
    #[error(
        "the deadline header `{0}` is not a whole number of Unix milliseconds (digits only, at most 253402300799999)"
    )]
    NotANumber(String),
    /// A `grpc-timeout` value was malformed.
    #[error(
        "the grpc-timeout `{0}` is malformed: expected 1 to 8 digits then one unit of H, M, S, m, u or n"
    )]
    GrpcTimeout(String),
}

/// The latest deadline the header may name: 9999-12-31T23:59:59.999Z.
pub const MAX_UNIX_MILLIS: u64 = 253_402_300_799_999;

impl Deadline {
    /// A deadline at the given instant.
    pub fn at(at: Instant) -> Self {
        Self { at }
    }

    /// A deadline `timeout` from now.
    pub fn after(timeout: Duration) -> Self {
        let now = clock::now();
        Self {
            at: now.checked_add(timeout).unwrap_or_else(|| far_future(now)),
        }
    }

    /// The instant of the deadline.
    pub fn instant(&self) -> Instant {
        self.at
    }

    /// Time left until the deadline; zero once it has passed.
    pub fn remaining(&self) -> Duration {
        self.at.saturating_duration_since(clock::now())
    }

    /// Whether the deadline has passed.
    pub fn is_expired(&self) -> bool {
        clock::now() >= self.at
    }

    /// Whether less than `min` remains, so starting a call is pointless.
    pub fn too_late_to_start(&self, min: Duration) -> bool {
        self.remaining() <= min
    }

    /// The time left, or [`Rejected::DeadlineExceeded`] if no more than
    /// `min` remains.
    pub fn check_start(&self, min: Duration) -> Result<Duration, Rejected> {
        let remaining = self.remaining();
        if remaining <= min {
            Err(Rejected::DeadlineExceeded)
        } else {
            Ok(remaining)
        }
    }

    /// The earlier of this deadline and `other`.
    pub fn min_with(self, other: Option<Deadline>) -> Self {
        match other {
            Some(o) if o < self => o,
            _ => self,
        }
    }

    /// This deadline, moved earlier if needed so that it is at most `max`
    /// from now.
    pub fn capped(self, max: Duration) -> Self {
        self.min_with(Some(Self::after(max)))
    }

    /// The deadline of the running task, if a [`scope`](Self::scope) set one.
    #[inline]
    pub fn current() -> Option<Deadline> {
        scope::current()
    }

    /// The time left before the current task's deadline, if it has one.
    pub fn current_remaining() -> Option<Duration> {
        Self::current().map(|d| d.remaining())
    }

    /// Runs `fut` with this deadline as the current one. A scope inside
    /// another never extends it: the earlier deadline wins.
    pub fn scope<F: Future>(self, fut: F) -> Scoped<F> {
        Scoped::new(self.min_with(Self::current()), fut)
    }

    /// Runs `f` synchronously with this deadline as the current one (the
    /// earlier deadline wins): for a tower service's `call`, which builds the
    /// outgoing request before any poll.
    pub fn sync_scope<R>(self, f: impl FnOnce() -> R) -> R {
        let _restore = scope::enter(self.min_with(Self::current()));
        f()
    }

    /// The deadline for an inbound request: the caller's header if present,
    /// never later than `max` from now; `max` from now without a header.
    ///
    /// ```
    /// # tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap().block_on(async {
    /// use std::time::Duration;
    /// use keel_core::Deadline;
    /// // A caller asking for an hour gets our maximum of 2 s.
    /// let hour_ahead = keel_core::clock::unix_millis() + 3_600_000;
    /// let d = Deadline::from_inbound(Some(&hour_ahead.to_string()), Duration::from_secs(2)).unwrap();
    /// assert!(d.remaining() <= Duration::from_secs(2));
    /// assert!(Deadline::from_inbound(Some("soon"), Duration::from_secs(2)).is_err());
    /// # });
    /// ```
    pub fn from_inbound(header: Option<&str>, max: Duration) -> Result<Self, InvalidDeadline> {
        match header {
            Some(value) => Ok(Self::parse_header(value)?.capped(max)),
            None => Ok(Self::after(max)),
        }
    }

    /// Parses an `X-Request-Deadline-Unix-Ms` value (the caller's clock):
    /// decimal digits only, at most [`MAX_UNIX_MILLIS`] (the last
    /// millisecond of the year 9999), so an API document can state the
    /// grammar exactly: an integer from 0 to that bound.
    pub fn parse_header(value: &str) -> Result<Self, InvalidDeadline> {
        let value = value.trim();
        if value.is_empty() {
            return Err(InvalidDeadline::Empty);
        }
        let ms = Some(value)
            .filter(|v| v.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|ms| *ms <= MAX_UNIX_MILLIS)
            .ok_or_else(|| InvalidDeadline::NotANumber(truncate(value)))?;
        Ok(Self::from_unix_millis(ms))
    }

    /// A deadline at a wall-clock time in Unix milliseconds.
    pub fn from_unix_millis(ms: u64) -> Self {
        Self {
            at: clock::instant_from_unix_millis(ms),
        }
    }

    /// The deadline as wall-clock Unix milliseconds, for the header.
    pub fn to_unix_millis(&self) -> u64 {
        clock::unix_millis_from_instant(self.at)
    }

    /// The `X-Request-Deadline-Unix-Ms` header value for this deadline.
    pub fn to_header_value(&self) -> String {
        self.to_unix_millis().to_string()
    }

    /// The `grpc-timeout` header value for the time left.
    pub fn to_grpc_timeout(&self) -> String {
        grpc_timeout::encode(self.remaining())
    }
}

fn far_future(now: Instant) -> Instant {
    now + Duration::from_secs(86_400 * 365 * 30)
}

fn truncate(value: &str) -> String {
    value.chars().take(64).collect()
}

/// gRPC's `grpc-timeout` header: up to 8 digits and a unit
/// (`H`ours, `M`inutes, `S`econds, `m`illis, `u`micros, `n`anos).
pub mod grpc_timeout {
    use super::{Duration, InvalidDeadline, truncate};

    const MAX_VALUE: u64 = 99_999_999;

    /// Parses a `grpc-timeout` value.
    ///
    /// ```
    /// use std::time::Duration;
    /// use keel_core::deadline::grpc_timeout;
    /// assert_eq!(grpc_timeout::decode("300m").unwrap(), Duration::from_millis(300));
    /// assert!(grpc_timeout::decode("123456789S").is_err());
    /// ```
    pub fn decode(value: &str) -> Result<Duration, InvalidDeadline> {
        let bad = || InvalidDeadline::GrpcTimeout(truncate(value));
        let (digits, unit) = value
            .split_at_checked(value.len().wrapping_sub(1))
            .ok_or_else(bad)?;
        if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let n: u64 = digits.parse().map_err(|_| bad())?;
        Ok(match unit {
            "H" => Duration::from_secs(n * 3600),
            "M" => Duration::from_secs(n * 60),
            "S" => Duration::from_secs(n),
            "m" => Duration::from_millis(n),
            "u" => Duration::from_micros(n),
            "n" => Duration::from_nanos(n),
            _ => return Err(bad()),
        })
    }

    /// Encodes a duration as a `grpc-timeout` value, in the finest unit whose
    /// value fits in 8 digits (rounding up, so a deadline is never shortened
    /// to zero). Durations beyond 99,999,999 hours saturate.
    ///
    /// ```
    /// use std::time::Duration;
    /// use keel_core::deadline::grpc_timeout;
    /// assert_eq!(grpc_timeout::encode(Duration::from_millis(300)), "300000u");
    /// assert_eq!(grpc_timeout::encode(Duration::from_secs(3600 * 1000)), "3600000S");
    /// ```
    pub fn encode(timeout: Duration) -> String {
        let nanos = timeout.as_nanos();
        let units: [(u128, char); 6] = [
            (1, 'n'),
            (1_000, 'u'),
            (1_000_000, 'm'),
            (1_000_000_000, 'S'),
            (60_000_000_000, 'M'),
            (3_600_000_000_000, 'H'),
        ];
        for (per, unit) in units {
            let value = nanos.div_ceil(per);
            if value <= u128::from(MAX_VALUE) {
                return format!("{value}{unit}");
            }
        }
        format!("{MAX_VALUE}H")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[tokio::test(start_paused = true)]
    async fn scopes_only_tighten() {
        let outer = Deadline::after(Duration::from_secs(1));
        outer
            .scope(async move {
                Deadline::after(Duration::from_secs(10))
                    .scope(async move { assert_eq!(Deadline::current(), Some(outer)) })
                    .await;
                let inner = Deadline::after(Duration::from_millis(100));
                inner
                    .scope(async move { assert_eq!(Deadline::current(), Some(inner)) })
                    .await;
            })
            .await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_scope_only_tightens_the_current_deadline() {
        let outer = Deadline::after(Duration::from_secs(1));
        outer
            .scope(async move {
                let later = Deadline::after(Duration::from_secs(10));
                later
                    .scope(async move { assert_eq!(Deadline::current(), Some(outer)) })
                    .await;
                let sooner = Deadline::after(Duration::from_millis(100));
                sooner
                    .scope(async move { assert_eq!(Deadline::current(), Some(sooner)) })
                    .await;
            })
            .await;
        let alone = Deadline::after(Duration::from_secs(3));
        alone
            .scope(async move { assert_eq!(Deadline::current(), Some(alone)) })
            .await;
    }

    #[tokio::test(start_paused = true)]
    async fn too_late_to_start_below_the_minimum() {
        let d = Deadline::after(Duration::from_millis(120));
        assert!(d.check_start(MIN_TIME_TO_START).is_ok());
        tokio::time::advance(Duration::from_millis(70)).await;
        assert_eq!(
            d.check_start(MIN_TIME_TO_START),
            Err(Rejected::DeadlineExceeded)
        );
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(d.is_expired());
        assert_eq!(d.remaining(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn inbound_header_is_capped() {
        let far = clock::unix_millis() + 3_600_000;
        let d = Deadline::from_inbound(Some(&far.to_string()), Duration::from_secs(2)).unwrap();
        assert!(d.remaining() <= Duration::from_secs(2));
        let near = clock::unix_millis() + 500;
        let d = Deadline::from_inbound(Some(&near.to_string()), Duration::from_secs(2)).unwrap();
        assert!(d.remaining() <= Duration::from_millis(500));
        assert!(d.remaining() >= Duration::from_millis(400));
        let none = Deadline::from_inbound(None, Duration::from_secs(2)).unwrap();
        assert_eq!(none.remaining(), Duration::from_secs(2));
    }

    #[test]
    fn malformed_headers_are_errors() {
        assert_eq!(Deadline::parse_header(""), Err(InvalidDeadline::Empty));
        assert!(matches!(
            Deadline::parse_header("-5"),
            Err(InvalidDeadline::NotANumber(_))
        ));
        assert!(matches!(
            Deadline::parse_header("1.5"),
            Err(InvalidDeadline::NotANumber(_))
        ));
        for bad in ["+5", "253402300800000", "0x10", "1_000"] {
            assert!(
                matches!(
                    Deadline::parse_header(bad),
                    Err(InvalidDeadline::NotANumber(_))
                ),
                "{bad}"
            );
        }
        assert!(
            Deadline::parse_header("253402300799999").is_ok(),
            "the bound itself"
        );
        assert!(matches!(
            Deadline::parse_header("99999999999999999999999"),
            Err(InvalidDeadline::NotANumber(_))
        ));
        for bad in ["", "m", "5", "5x", "123456789m", "-1m", "1.5S", "ééé"] {
            assert!(
                grpc_timeout::decode(bad).is_err(),
                "{bad:?} must be rejected"
            );
        }
    }

    #[tokio::test(start_paused = true)]
    async fn header_round_trip() {
        let d = Deadline::after(Duration::from_millis(1500));
        let back = Deadline::parse_header(&d.to_header_value()).unwrap();
        let diff = back.remaining().abs_diff(d.remaining());
        assert!(diff <= Duration::from_millis(2), "{diff:?}");
    }

    proptest! {
        #[test]
        fn grpc_timeout_round_trip_never_shortens(nanos in 0u64..u64::MAX / 4) {
            let d = Duration::from_nanos(nanos);
            let back = grpc_timeout::decode(&grpc_timeout::encode(d)).unwrap();
            prop_assert!(back >= d);
        }

        #[test]
        fn arbitrary_headers_never_panic(s in ".{0,40}") {
            let _ = grpc_timeout::decode(&s);
            let _ = Deadline::parse_header(&s);
        }
    }
}
