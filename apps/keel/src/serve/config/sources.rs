//! Where the settings' values come from: a value or a file's first line,
//! flags or the TOML file, and the edge's limits with their defaults.

use std::path::PathBuf;
use std::time::Duration;

use keel_http::access::ApiKeys;
use keel_http::health::{
    ConnectionLimits, DEFAULT_BODY_READ_TIMEOUT, DEFAULT_HEADER_READ_TIMEOUT, DEFAULT_IDLE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_CONNECTIONS_PER_ADDRESS,
};

use super::{ConfigError, invalid};

/// A secret given as a value (flag, environment or file setting), else
/// read from the file at `path`.
pub(super) fn secret(
    value: Option<String>,
    path: Option<PathBuf>,
    setting: &'static str,
) -> Result<Option<String>, ConfigError> {
    match value {
        Some(value) => Ok(Some(value)),
        None => path.map(|path| first_line(setting, &path)).transpose(),
    }
}

/// The tenants' keys: `given`, then one `tenant:key` per line of `path`
/// (blank lines and `#` comments skipped).
pub(super) fn api_keys(
    mut given: Vec<String>,
    path: Option<PathBuf>,
) -> Result<ApiKeys, ConfigError> {
    if let Some(path) = path {
        let text = read_bounded(&path)
            .map_err(|e| invalid("api-keys-file", format!("{}: {e}", path.display())))?;
        given.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(str::to_owned),
        );
    }
    ApiKeys::parse(&given).map_err(|e| invalid("api-key", e.to_string()))
}

/// The edge's limits, each defaulted; the idle timeout must outlast a
/// quiet long poll.
/// The connection settings as given (flag, else file); unset ones take
/// keel-http's defaults.
#[derive(Debug, Default)]
pub(super) struct ConnectionSettings {
    pub max_connections: Option<usize>,
    pub max_connections_per_address: Option<usize>,
    pub header_read_secs: Option<u64>,
    pub body_read_secs: Option<u64>,
    pub idle_secs: Option<u64>,
}

pub(super) fn connection_limits(
    settings: ConnectionSettings,
) -> Result<ConnectionLimits, ConfigError> {
    let secs = |value: Option<u64>, default| value.map_or(default, Duration::from_secs);
    let limits = ConnectionLimits::new()
        .max_connections(settings.max_connections.unwrap_or(DEFAULT_MAX_CONNECTIONS))
        .max_connections_per_address(
            settings
                .max_connections_per_address
                .unwrap_or(DEFAULT_MAX_CONNECTIONS_PER_ADDRESS),
        )
        .header_read_timeout(secs(settings.header_read_secs, DEFAULT_HEADER_READ_TIMEOUT))
        .body_read_timeout(secs(settings.body_read_secs, DEFAULT_BODY_READ_TIMEOUT))
        .idle_timeout(secs(settings.idle_secs, DEFAULT_IDLE_TIMEOUT))
        .validate()
        .map_err(|e| invalid("connection limits", e.to_string()))?;
    let poll = keel_realtime::DEFAULT_POLL_TIMEOUT;
    if limits.idle() <= poll {
        return Err(invalid(
            "idle-timeout-secs",
            format!(
                "must be more than the long poll's {} s wait, or every quiet poll is cut off",
                poll.as_secs()
            ),
        ));
    }
    Ok(limits)
}

/// The first line of a secret's file, trimmed.
fn first_line(setting: &'static str, path: &std::path::Path) -> Result<String, ConfigError> {
    let text =
        read_bounded(path).map_err(|e| invalid(setting, format!("{}: {e}", path.display())))?;
    let line = text.lines().next().unwrap_or_default().trim().to_owned();
    if line.is_empty() {
        return Err(invalid(setting, format!("{} is empty", path.display())));
    }
    Ok(line)
}

/// The most a file the configuration names (itself, a secret, the API keys)
/// may hold: far more than any of them needs, and a bound on what a wrong
/// path (`/dev/zero`, a log file) can make the process read.
const MAX_FILE_BYTES: u64 = 1024 * 1024;

/// The text of `path`, refused past [`MAX_FILE_BYTES`] or if not UTF-8.
pub(super) fn read_bounded(path: &std::path::Path) -> Result<String, String> {
    use std::io::Read;
    let file = std::fs::File::open(path).map_err(|e| e.to_string())?;
    let mut text = String::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_string(&mut text)
        .map_err(|e| e.to_string())?;
    if text.len() as u64 > MAX_FILE_BYTES {
        return Err(format!(
            "is larger than {} KiB, more than any configuration, key or secret needs; check the path",
            MAX_FILE_BYTES / 1024
        ));
    }
    Ok(text)
}
