//! [`OtlpExport`]: where the spans go, configured as every OpenTelemetry
//! SDK is (the `OTEL_*` variables) or in code.

use std::sync::Arc;
use std::time::Duration;

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};

use crate::TelemetryError;
use crate::queue::{DEFAULT_BATCH, DEFAULT_DELAY, DEFAULT_QUEUE, SpanCounts, SpanQueue};

/// The default time one export may take: 5 s.
pub const DEFAULT_EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// The wire protocol to the collector.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OtlpProtocol {
    /// Protobuf over HTTP (`http/protobuf`, port 4318): the OpenTelemetry
    /// default.
    #[default]
    HttpProtobuf,
    /// gRPC (`grpc`, port 4317).
    Grpc,
}

impl std::str::FromStr for OtlpProtocol {
    type Err = TelemetryError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "http/protobuf" => Ok(Self::HttpProtobuf),
            "grpc" => Ok(Self::Grpc),
            other => Err(TelemetryError::Config(format!(
                "OTLP protocol `{other}` is not supported; use `http/protobuf` or `grpc`"
            ))),
        }
    }
}

/// Span export over OTLP, off unless built: see [`from_env`](Self::from_env).
///
/// | setting | default | variable |
/// |---|---|---|
/// | [`endpoint`](Self::endpoint) | `http://localhost:4318` (HTTP), `http://localhost:4317` (gRPC) | `OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` |
/// | [`protocol`](Self::protocol) | `http/protobuf` | `OTEL_EXPORTER_OTLP_PROTOCOL`, `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` |
/// | [`service_name`](Self::service_name) | `unknown_service` | `OTEL_SERVICE_NAME` |
/// | sampler | parent-based, always on | `OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG` |
/// | [`queue`](Self::queue) | 2,048 spans, dropped (and counted) beyond | |
/// | [`timeout`](Self::timeout) | 5 s per export | |
///
/// Code wins over the variables. The exporter is plain text (no TLS):
/// point it at a collector or agent beside the process.
#[derive(Debug, Clone)]
pub struct OtlpExport {
    endpoint: Option<String>,
    protocol: Option<OtlpProtocol>,
    service_name: Option<String>,
    queue: usize,
    batch: usize,
    delay: Duration,
    timeout: Duration,
}

impl Default for OtlpExport {
    fn default() -> Self {
        Self {
            endpoint: None,
            protocol: None,
            service_name: None,
            queue: DEFAULT_QUEUE,
            batch: DEFAULT_BATCH,
            delay: DEFAULT_DELAY,
            timeout: DEFAULT_EXPORT_TIMEOUT,
        }
    }
}

impl OtlpExport {
    /// An export to the endpoint the variables name, or the default one.
    pub fn new() -> Self {
        Self::default()
    }

    /// The export the standard variables ask for: `Some` when an OTLP
    /// endpoint is set, unless `OTEL_SDK_DISABLED=true` or
    /// `OTEL_TRACES_EXPORTER=none`. Without one, nothing is exported and
    /// nothing is paid for.
    pub fn from_env() -> Option<Self> {
        let set = |name: &str| std::env::var(name).is_ok_and(|v| !v.trim().is_empty());
        let endpoint =
            set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
        let disabled = std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.trim() == "true")
            || std::env::var("OTEL_TRACES_EXPORTER").is_ok_and(|v| v.trim() == "none");
        (endpoint && !disabled).then(Self::new)
    }

    /// The collector's base URL (`http://collector:4318`); for HTTP,
    /// `/v1/traces` is appended unless the URL already ends with it.
    pub fn endpoint(mut self, url: impl Into<String>) -> Self {
        self.endpoint = Some(url.into());
        self
    }

    /// The wire protocol.
    pub fn protocol(mut self, protocol: OtlpProtocol) -> Self {
        self.protocol = Some(protocol);
        self
    }

    /// The `service.name` resource attribute.
    pub fn service_name(mut self, name: impl Into<String>) -> Self {
        self.service_name = Some(name.into());
        self
    }

    /// The most spans waiting for export; beyond it spans are dropped and
    /// counted, never waited for.
    pub fn queue(mut self, spans: usize) -> Self {
        self.queue = spans.max(1);
        self
    }

    /// The longest one export may take.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Starts the export thread and the tracer provider.
    pub fn start(self) -> Result<Exporting, TelemetryError> {
        let protocol = match self.protocol {
            Some(p) => p,
            None => env_protocol()?.unwrap_or_default(),
        };
        let endpoint = self.endpoint.clone().map(|e| match protocol {
            OtlpProtocol::HttpProtobuf if !e.trim_end_matches('/').ends_with("/v1/traces") => {
                format!("{}/v1/traces", e.trim_end_matches('/'))
            }
            _ => e,
        });
        let timeout = self.timeout;
        // Validate on this thread so a bad endpoint is an error at start,
        // not a silent export thread.
        if let Some(url) = &endpoint {
            url.parse::<http::Uri>().map_err(|e| {
                TelemetryError::Config(format!("OTLP endpoint `{url}` is not a URL: {e}"))
            })?;
        }
        let make = move || build_exporter(protocol, endpoint.as_deref(), timeout);
        let queue = SpanQueue::start(make, self.queue, self.batch, self.delay)
            .map_err(|e| TelemetryError::Start(e.to_string()))?;
        let counts = queue.counts();
        let mut resource = Resource::builder();
        if let Some(name) = self.service_name {
            resource = resource.with_service_name(name);
        }
        let provider = SdkTracerProvider::builder()
            .with_resource(resource.build())
            .with_span_processor(queue)
            .build();
        Ok(Exporting { provider, counts })
    }
}

fn env_protocol() -> Result<Option<OtlpProtocol>, TelemetryError> {
    [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ]
    .iter()
    .find_map(|name| std::env::var(name).ok().filter(|v| !v.trim().is_empty()))
    .map(|v| v.trim().parse())
    .transpose()
}

/// The exporter; an error (logged once by the queue) drops every span.
fn build_exporter(
    protocol: OtlpProtocol,
    endpoint: Option<&str>,
    timeout: Duration,
) -> Result<opentelemetry_otlp::SpanExporter, String> {
    let built = match protocol {
        OtlpProtocol::HttpProtobuf => {
            let mut b = opentelemetry_otlp::SpanExporter::builder()
                .with_http()
                .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                .with_timeout(timeout);
            if let Some(url) = endpoint {
                b = b.with_endpoint(url);
            }
            b.build()
        }
        OtlpProtocol::Grpc => {
            let mut b = opentelemetry_otlp::SpanExporter::builder()
                .with_tonic()
                .with_timeout(timeout);
            if let Some(url) = endpoint {
                b = b.with_endpoint(url);
            }
            b.build()
        }
    };
    built.map_err(|e| e.to_string())
}

/// Spans export through it; a [`SpanQueue`] owns it and reports its
/// counts.
#[derive(Debug)]
pub struct Exporting {
    provider: SdkTracerProvider,
    counts: Arc<SpanCounts>,
}

impl Exporting {
    /// A tracer for the `tracing-opentelemetry` layer.
    pub fn tracer(&self) -> SdkTracer {
        self.provider.tracer("keel")
    }

    /// The provider, for code that uses OpenTelemetry directly.
    pub fn provider(&self) -> &SdkTracerProvider {
        &self.provider
    }

    /// Exported and dropped span counts.
    pub fn counts(&self) -> Arc<SpanCounts> {
        Arc::clone(&self.counts)
    }

    /// Exports what is queued and stops. Blocks: call it outside the
    /// runtime, or from `spawn_blocking`.
    pub fn shutdown(&self) {
        let _ = self.provider.shutdown();
    }
}
