//! librdkafka's log lines as `tracing` events, at levels an operator can
//! live with.
//!
//! While a broker restarts, librdkafka logs every refused reconnect
//! (facility `FAIL`) as an error, hundreds in a few seconds (966 in one
//! scale-out test run). librdkafka retries them itself, and what matters
//! reaches the caller anyway (a publish's timeout, a failed `ping` on
//! `/debug/deep`), so they are debug events here; librdkafka's other
//! errors stay errors.

use rdkafka::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::ConsumerContext;

/// Emits one librdkafka log line.
pub(crate) fn emit(level: RDKafkaLogLevel, facility: &str, line: &str) {
    use RDKafkaLogLevel as Level;
    if facility == "FAIL" {
        tracing::debug!(target: "librdkafka", facility, "{line}");
        return;
    }
    match level {
        Level::Emerg | Level::Alert | Level::Critical | Level::Error => {
            tracing::error!(target: "librdkafka", facility, "{line}");
        }
        Level::Warning => tracing::warn!(target: "librdkafka", facility, "{line}"),
        Level::Notice | Level::Info => tracing::info!(target: "librdkafka", facility, "{line}"),
        Level::Debug => tracing::debug!(target: "librdkafka", facility, "{line}"),
    }
}

/// The context of every client but the members' consumers: only the log.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ClientLog;

impl ClientContext for ClientLog {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, line: &str) {
        emit(level, facility, line);
    }
}

impl ConsumerContext for ClientLog {}
