//! Failpoints that kill `keel serve` outright: `SIGKILL` to itself at the
//! Nth time a failpoint is reached, with nothing flushed, nothing shut down
//! and nothing said to anyone, as a machine that loses its process there
//! would.
//!
//! `keel chaos`'s crashes stop one component at a failpoint and restart the
//! system gracefully, which lets the open group-commit batch commit; these
//! do not. The fault harness (`apps/keel/tests/power_loss.rs`) arms them in
//! a `keel serve` it runs as a separate process, through
//! [`KILL_AT_ENV`]: `KEEL_CHAOS_KILL_AT=keel-sqlite-group-after-commit:3`
//! kills the process the third time a batch's `COMMIT` returns, before any
//! of its callers is answered.

use std::sync::atomic::{AtomicU64, Ordering};

use super::schedule::FAILPOINTS;

/// The environment variable that arms the kills: `FAILPOINT:N`, comma
/// separated.
pub const KILL_AT_ENV: &str = "KEEL_CHAOS_KILL_AT";

/// keel-sqlite's failpoints around a group-commit batch's `COMMIT`, which
/// only a kill of the process can exercise (the batch is in flight).
pub const SQLITE_FAILPOINTS: [&str; 2] = [
    "keel-sqlite-group-before-commit",
    "keel-sqlite-group-after-commit",
];

/// A `KEEL_CHAOS_KILL_AT` that cannot be armed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KillAtError {
    /// An entry is not `FAILPOINT:N` with N at least 1.
    #[error("{KILL_AT_ENV}: `{0}` is not FAILPOINT:N (N from 1)")]
    Malformed(String),
    /// A failpoint Keel does not have.
    #[error("{KILL_AT_ENV}: unknown failpoint `{0}`; the failpoints are: {list}",
        list = FAILPOINTS.iter().chain(&SQLITE_FAILPOINTS).copied().collect::<Vec<_>>().join(", "))]
    UnknownFailpoint(String),
}

/// Parses `spec` (`FAILPOINT:N`, comma separated) into its kills.
pub fn parse(spec: &str) -> Result<Vec<(String, u64)>, KillAtError> {
    spec.split(',')
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .map(|entry| {
            let malformed = || KillAtError::Malformed(entry.to_owned());
            let (name, nth) = entry.split_once(':').ok_or_else(malformed)?;
            let nth = nth
                .parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(malformed)?;
            if !FAILPOINTS.contains(&name) && !SQLITE_FAILPOINTS.contains(&name) {
                return Err(KillAtError::UnknownFailpoint(name.to_owned()));
            }
            Ok((name.to_owned(), nth))
        })
        .collect()
}

/// Arms the kills [`KILL_AT_ENV`] asks for, if it is set; returns how many.
pub fn arm_from_env() -> Result<usize, KillAtError> {
    let Ok(spec) = std::env::var(KILL_AT_ENV) else {
        return Ok(0);
    };
    let kills = parse(&spec)?;
    for (name, nth) in &kills {
        arm(name, *nth);
    }
    Ok(kills.len())
}

/// Kills the process the `nth` time `failpoint` is reached.
fn arm(failpoint: &str, nth: u64) {
    let hits = AtomicU64::new(0);
    let name = failpoint.to_owned();
    let armed = fail::cfg_callback(failpoint, move || {
        if hits.fetch_add(1, Ordering::Relaxed) + 1 == nth {
            eprintln!("keel: failpoint {name} reached {nth} times: SIGKILL");
            let _ = rustix::process::kill_process(
                rustix::process::getpid(),
                rustix::process::Signal::KILL,
            );
        }
    });
    // cfg_callback only fails on a malformed action string; it takes none.
    debug_assert!(armed.is_ok());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_failpoints_with_their_counts() {
        assert_eq!(
            parse("relay-after-publish:2, keel-sqlite-group-after-commit:7").unwrap(),
            vec![
                ("relay-after-publish".to_owned(), 2),
                ("keel-sqlite-group-after-commit".to_owned(), 7)
            ]
        );
        assert_eq!(parse("").unwrap(), vec![]);
    }

    #[test]
    fn refuses_what_it_cannot_arm() {
        assert!(matches!(
            parse("relay-after-publish"),
            Err(KillAtError::Malformed(_))
        ));
        assert!(matches!(
            parse("relay-after-publish:0"),
            Err(KillAtError::Malformed(_))
        ));
        assert!(matches!(
            parse("nowhere:1"),
            Err(KillAtError::UnknownFailpoint(_))
        ));
    }
}
