//! Log lines that carry the trace: JSON lines with the `trace_id` and
//! `span_id` of the span Keel is running in, so a log search and a trace
//! view meet on the same ids.

use std::fmt;

use keel_core::TraceParent;
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum LogFormat {
    /// Human-readable lines (the span's fields show the trace id).
    #[default]
    Text,
    /// One JSON object per line, with top-level `trace_id` and `span_id`
    /// whenever the line was written inside a trace.
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = crate::TelemetryError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => Err(crate::TelemetryError::Config(format!(
                "log format `{other}` is not known; use `text` or `json`"
            ))),
        }
    }
}

/// Wraps a JSON event format: the trace's ids go first on the line.
#[derive(Debug, Clone)]
pub struct WithTraceIds<F> {
    inner: F,
}

impl<F> WithTraceIds<F> {
    /// Adds the ids to the lines `inner` writes (a JSON object per line).
    pub fn new(inner: F) -> Self {
        Self { inner }
    }
}

impl<S, N, F> FormatEvent<S, N> for WithTraceIds<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let Some(trace) = TraceParent::current() else {
            return self.inner.format_event(ctx, writer, event);
        };
        let mut line = String::with_capacity(256);
        self.inner
            .format_event(ctx, Writer::new(&mut line), event)?;
        match line.strip_prefix('{') {
            Some(rest) => write!(
                writer,
                r#"{{"trace_id":"{}","span_id":"{}",{rest}"#,
                trace.trace_id_hex(),
                trace.parent_id_hex()
            ),
            None => writer.write_str(&line),
        }
    }
}
