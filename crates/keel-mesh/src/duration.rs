//! Durations as Istio writes them: `2s`, `700ms`, `1m`, `1.5s`, `1h30m`.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A duration read from or written to an Istio resource.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct IstioDuration(pub Duration);

impl IstioDuration {
    /// Parses `2s`, `700ms`, `1.5s`, `1m30s` (units `h`, `m`, `s`, `ms`,
    /// `us`, `µs`, `ns`).
    pub fn parse(text: &str) -> Result<Self, String> {
        let text = text.trim();
        if text.is_empty() {
            return Err("an empty duration".to_owned());
        }
        let mut total = Duration::ZERO;
        let mut rest = text;
        while !rest.is_empty() {
            let number_end = rest
                .find(|c: char| !(c.is_ascii_digit() || c == '.'))
                .ok_or_else(|| format!("`{text}` has a number without a unit (say `{rest}s`)"))?;
            let (number, tail) = rest.split_at(number_end);
            let unit_end = tail
                .find(|c: char| c.is_ascii_digit() || c == '.')
                .unwrap_or(tail.len());
            let (unit, tail) = tail.split_at(unit_end);
            let value: f64 = number
                .parse()
                .map_err(|_| format!("`{number}` in `{text}` is not a number"))?;
            let seconds = match unit {
                "h" => 3600.0,
                "m" => 60.0,
                "s" => 1.0,
                "ms" => 1e-3,
                "us" | "µs" => 1e-6,
                "ns" => 1e-9,
                other => return Err(format!("`{other}` in `{text}` is not a unit (h, m, s, ms)")),
            };
            total = Duration::try_from_secs_f64(value * seconds)
                .ok()
                .and_then(|part| total.checked_add(part))
                .ok_or_else(|| format!("`{text}` is out of range"))?;
            rest = tail;
        }
        Ok(Self(total))
    }
}

impl fmt::Display for IstioDuration {
    /// Whole seconds as `2s`, anything finer as `700ms` (or `us`, `ns`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = self.0;
        if d.subsec_nanos() == 0 {
            write!(f, "{}s", d.as_secs())
        } else if d.as_nanos().is_multiple_of(1_000_000) {
            write!(f, "{}ms", d.as_millis())
        } else if d.as_nanos().is_multiple_of(1_000) {
            write!(f, "{}us", d.as_micros())
        } else {
            write!(f, "{}ns", d.as_nanos())
        }
    }
}

impl Serialize for IstioDuration {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for IstioDuration {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Self::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn istio_durations_parse_and_print_back() {
        for (text, millis, printed) in [
            ("2s", 2000, "2s"),
            ("700ms", 700, "700ms"),
            ("1.5s", 1500, "1500ms"),
            ("1m30s", 90_000, "90s"),
            ("1h", 3_600_000, "3600s"),
            ("0s", 0, "0s"),
        ] {
            let d = IstioDuration::parse(text).unwrap();
            assert_eq!(d.0, Duration::from_millis(millis), "{text}");
            assert_eq!(d.to_string(), printed);
        }
    }

    #[test]
    fn malformed_durations_say_what_is_wrong() {
        assert!(
            IstioDuration::parse("700")
                .unwrap_err()
                .contains("without a unit")
        );
        assert!(IstioDuration::parse("5 parsecs").is_err());
        assert!(IstioDuration::parse("").is_err());
        assert!(IstioDuration::parse("1e400s").is_err());
        let huge = "10000000000000000000s10000000000000000000s";
        assert!(
            IstioDuration::parse(huge)
                .unwrap_err()
                .contains("out of range")
        );
    }
}
