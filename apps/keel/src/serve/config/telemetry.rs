//! `keel serve`'s logs and span export: settled before anything starts,
//! so the first log line is already in the chosen format.

use keel_otel::{LogFormat, OtlpExport, OtlpProtocol, TelemetryBuilder};

use super::{ConfigError, ServeArgs, invalid};

/// The service name spans carry when `OTEL_SERVICE_NAME` is not set.
pub const SERVICE_NAME: &str = "keel";

impl ServeArgs {
    /// The telemetry to install: logs filtered by `KEEL_LOG` (default
    /// `info`) in `--log-format`, and spans exported to `--otlp-endpoint`
    /// or the standard `OTEL_*` variables' collector, if either names one.
    pub fn telemetry(&self) -> Result<TelemetryBuilder, ConfigError> {
        let settings = self.over(&self.file()?)?;
        let format = match settings.log_format {
            Some(f) => f
                .parse::<LogFormat>()
                .map_err(|e| invalid("log-format", e.to_string()))?,
            None => LogFormat::Text,
        };
        let export = match settings.otlp_endpoint {
            Some(url) => Some(OtlpExport::new().endpoint(url)),
            None => OtlpExport::from_env(),
        };
        let export = match (export, settings.otlp_protocol) {
            (Some(export), Some(p)) => Some(
                export.protocol(
                    p.parse::<OtlpProtocol>()
                        .map_err(|e| invalid("otlp-protocol", e.to_string()))?,
                ),
            ),
            (export, _) => export,
        };
        let export = export.map(|e| match std::env::var_os("OTEL_SERVICE_NAME") {
            Some(_) => e,
            None => e.service_name(SERVICE_NAME),
        });
        let filter = std::env::var("KEEL_LOG").unwrap_or_else(|_| "info".to_owned());
        Ok(TelemetryBuilder::default()
            .log_filter(filter)
            .log_format(format)
            .export(export))
    }
}
