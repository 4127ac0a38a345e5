//! Keel's telemetry: the spans Keel starts, exported over OTLP, and log
//! lines that carry the trace.
//!
//! Keel propagates the W3C trace context itself, across HTTP, gRPC and the
//! broker (`keel_core::trace`). This crate is the other half: it turns the
//! spans Keel starts (server and client calls, the outbox's producer span,
//! the relay's batch, each delivery's consumer span linked to its
//! producer, saga steps, webhook attempts) into OpenTelemetry spans with
//! `tracing-opentelemetry`, and sends them to a collector with the
//! `opentelemetry-otlp` exporter.
//!
//! Three rules make it safe to leave on:
//!
//! - **Off costs nothing.** Without an endpoint nothing is built: no
//!   tracer, no thread, no queue ([`OtlpExport::from_env`] is `None`).
//! - **A dead collector costs spans, not latency.** Spans go through a
//!   bounded [`SpanQueue`]; when it is full they are dropped and counted
//!   (`keel_otel_spans_dropped_total`), never waited for.
//! - **Only spans that say what they are get exported**: those declaring
//!   `otel.kind` ([`exported`]). Spans that only give log lines context
//!   stay in the logs.
//!
//! ```no_run
//! # fn main() -> Result<(), keel_otel::TelemetryError> {
//! use keel_otel::{LogFormat, OtlpExport, Telemetry};
//! let telemetry = Telemetry::builder()
//!     .log_filter("info")
//!     .log_format(LogFormat::Json)
//!     .export(OtlpExport::from_env())
//!     .install()?;
//! // ... serve ...
//! telemetry.shutdown();
//! # Ok(()) }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
pub mod export;
pub mod log;
pub mod queue;

use std::io::IsTerminal;
use std::sync::Arc;

use opentelemetry_sdk::trace::SdkTracer;
use tracing::{Level, Metadata, Subscriber};
use tracing_subscriber::filter::{EnvFilter, filter_fn};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{Layer, Registry};

pub use export::{Exporting, OtlpExport, OtlpProtocol};
pub use log::{LogFormat, WithTraceIds};
pub use queue::{SpanCounts, SpanQueue};

/// Telemetry could not be set up.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TelemetryError {
    /// A setting is invalid; the message says which and what is accepted.
    #[error("telemetry: {0}")]
    Config(String),
    /// The export thread could not start.
    #[error("telemetry: cannot start the span export thread: {0}")]
    Start(String),
    /// Another subscriber is already installed in this process.
    #[error("telemetry: a tracing subscriber is already installed")]
    AlreadyInstalled,
}

/// Whether the OpenTelemetry layer sees `meta`: spans that declare an
/// `otel.kind` (the spans Keel starts, and any of yours that say what they
/// are), and events at `WARN` and above, which become span events.
pub fn exported(meta: &Metadata<'_>) -> bool {
    if meta.is_span() {
        meta.fields().field("otel.kind").is_some()
    } else {
        *meta.level() <= Level::WARN
    }
}

/// The `tracing-opentelemetry` layer for `tracer`, seeing only what
/// [`exported`] lets through, without the per-span thread, code location
/// and busy/idle timings it would otherwise record.
pub fn otel_layer<S>(tracer: SdkTracer) -> impl Layer<S> + Send + Sync + 'static
where
    S: Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
{
    tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_tracked_inactivity(false)
        .with_threads(false)
        .with_location(false)
        .with_filter(filter_fn(exported))
}

/// Installed telemetry: keep it, and [`shutdown`](Self::shutdown) it last,
/// so queued spans are exported.
#[derive(Debug)]
pub struct Telemetry {
    exporting: Option<Exporting>,
}

impl Telemetry {
    /// Text logs at `info`, no export.
    pub fn builder() -> TelemetryBuilder {
        TelemetryBuilder::default()
    }

    /// The export's counts, if spans are exported.
    pub fn counts(&self) -> Option<Arc<SpanCounts>> {
        self.exporting.as_ref().map(Exporting::counts)
    }

    /// Exports what is queued (within the export timeout) and stops.
    /// Blocks: call it outside the runtime or from `spawn_blocking`.
    pub fn shutdown(self) {
        if let Some(exporting) = &self.exporting {
            exporting.shutdown();
        }
    }
}

/// Builds and installs [`Telemetry`].
#[derive(Debug, Clone)]
pub struct TelemetryBuilder {
    filter: String,
    format: LogFormat,
    export: Option<OtlpExport>,
}

impl Default for TelemetryBuilder {
    fn default() -> Self {
        Self {
            filter: "info".to_owned(),
            format: LogFormat::Text,
            export: None,
        }
    }
}

impl TelemetryBuilder {
    /// Which log lines are written, as `RUST_LOG`-style directives. It
    /// does not limit the exported spans.
    pub fn log_filter(mut self, directives: impl Into<String>) -> Self {
        self.filter = directives.into();
        self
    }

    /// How log lines are written.
    pub fn log_format(mut self, format: LogFormat) -> Self {
        self.format = format;
        self
    }

    /// Exports spans as `export` says; `None` exports nothing.
    pub fn export(mut self, export: Option<OtlpExport>) -> Self {
        self.export = export;
        self
    }

    /// Installs the process's subscriber: logs to stderr, and the
    /// OpenTelemetry layer when exporting.
    pub fn install(self) -> Result<Telemetry, TelemetryError> {
        let filter = EnvFilter::try_new(&self.filter)
            .map_err(|e| TelemetryError::Config(format!("log filter `{}`: {e}", self.filter)))?;
        let logs = match self.format {
            LogFormat::Text => tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                // Colours for a terminal only: in a file or a collector's
                // pipe they are escape codes in every line.
                .with_ansi(std::io::stderr().is_terminal())
                .with_filter(filter)
                .boxed(),
            LogFormat::Json => tracing_subscriber::fmt::layer()
                .json()
                .flatten_event(true)
                .event_format(WithTraceIds::new(
                    tracing_subscriber::fmt::format().json().flatten_event(true),
                ))
                .with_writer(std::io::stderr)
                .with_filter(filter)
                .boxed(),
        };
        let mut layers: Vec<Box<dyn Layer<Registry> + Send + Sync>> = vec![logs];
        let exporting = self.export.map(OtlpExport::start).transpose()?;
        if let Some(exporting) = &exporting {
            layers.push(otel_layer(exporting.tracer()).boxed());
        }
        tracing_subscriber::registry()
            .with(layers)
            .try_init()
            .map_err(|_| TelemetryError::AlreadyInstalled)?;
        Ok(Telemetry { exporting })
    }
}
