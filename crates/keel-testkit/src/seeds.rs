//! Which seeds a seeded fault test runs.

use std::ops::RangeInclusive;

/// The environment variable naming the seeds: `7`, or `1-50`.
pub const FAULT_SEEDS: &str = "KEEL_FAULT_SEEDS";

/// The seeds [`FAULT_SEEDS`] names, else `default`: CI runs the default
/// few, `scripts/reliability.sh` many, and a failing seed is replayed
/// alone.
///
/// # Panics
///
/// When the variable is set but is not `N` or `N-M`: a test run that
/// silently ran other seeds than asked would prove nothing.
pub fn fault_seeds(default: RangeInclusive<u64>) -> RangeInclusive<u64> {
    let Ok(spec) = std::env::var(FAULT_SEEDS) else {
        return default;
    };
    let (first, last) = spec.split_once('-').unwrap_or((&spec, &spec));
    let parse = |s: &str| {
        s.trim()
            .parse::<u64>()
            .unwrap_or_else(|_| panic!("{FAULT_SEEDS}: `{spec}` is not N or N-M"))
    };
    let (first, last) = (parse(first), parse(last));
    assert!(first <= last, "{FAULT_SEEDS}: `{spec}` names no seed");
    first..=last
}
