//! [`SpanQueue`]: the span processor between the application and a
//! collector that may be slow or gone.
//!
//! Ended spans go into a bounded queue; one thread takes them out in
//! batches and exports them. When the queue is full the span is dropped
//! and counted, never waited for: a dead collector must cost the
//! application nothing but lost spans. The SDK's own batch processor does
//! the same but keeps its drop count to itself; an operator needs it as a
//! metric (`keel_otel_spans_dropped_total`) and a test needs to read it.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, SyncSender};
use std::time::Duration;

use opentelemetry::Context;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter, SpanProcessor};

/// The default queue bound: 2,048 spans, the OpenTelemetry default.
pub const DEFAULT_QUEUE: usize = 2_048;

/// The default largest batch sent at once: 512 spans.
pub const DEFAULT_BATCH: usize = 512;

/// The default wait before a partial batch is sent: 1 s.
pub const DEFAULT_DELAY: Duration = Duration::from_secs(1);

/// How many spans were exported, dropped because the queue was full, and
/// dropped because the collector failed or refused their batch.
#[derive(Debug, Default)]
pub struct SpanCounts {
    exported: AtomicU64,
    queue_full: AtomicU64,
    export_failed: AtomicU64,
}

impl SpanCounts {
    /// Spans the collector accepted.
    pub fn exported(&self) -> u64 {
        self.exported.load(Ordering::Relaxed)
    }

    /// Spans dropped because the queue was full.
    pub fn queue_full(&self) -> u64 {
        self.queue_full.load(Ordering::Relaxed)
    }

    /// Spans dropped because their export failed.
    pub fn export_failed(&self) -> u64 {
        self.export_failed.load(Ordering::Relaxed)
    }

    /// Every span dropped, for whatever reason.
    pub fn dropped(&self) -> u64 {
        self.queue_full() + self.export_failed()
    }

    fn drop_span(&self) {
        self.queue_full.fetch_add(1, Ordering::Relaxed);
        metrics::counter!("keel_otel_spans_dropped_total", "reason" => "queue_full").increment(1);
    }

    fn exported_batch(&self, n: u64) {
        self.exported.fetch_add(n, Ordering::Relaxed);
        metrics::counter!("keel_otel_spans_exported_total").increment(n);
    }

    fn failed_batch(&self, n: u64) {
        self.export_failed.fetch_add(n, Ordering::Relaxed);
        metrics::counter!("keel_otel_spans_dropped_total", "reason" => "export_failed")
            .increment(n);
    }
}

enum Command {
    Span(Box<SpanData>),
    Flush(SyncSender<()>),
    Resource(Resource),
}

/// A span processor with a bounded queue and one export thread. See the
/// [module docs](self).
pub struct SpanQueue {
    queue: SyncSender<Command>,
    counts: Arc<SpanCounts>,
}

impl fmt::Debug for SpanQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SpanQueue")
            .field("counts", &self.counts)
            .finish_non_exhaustive()
    }
}

impl SpanQueue {
    /// A queue of `capacity` spans exported in batches of up to `batch`,
    /// a partial batch after `delay`, by the exporter `make` builds on the
    /// export thread (inside the thread's Tokio runtime, which exporters
    /// such as tonic's need when they are built). If `make` fails, the
    /// error is logged once and every span is dropped and counted.
    pub fn start<E, M>(
        make: M,
        capacity: usize,
        batch: usize,
        delay: Duration,
    ) -> std::io::Result<Self>
    where
        E: SpanExporter + 'static,
        M: FnOnce() -> Result<E, String> + Send + 'static,
    {
        let (queue, commands) = mpsc::sync_channel(capacity.max(1));
        let counts = Arc::new(SpanCounts::default());
        {
            let counts = Arc::clone(&counts);
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            std::thread::Builder::new()
                .name("keel-otel-export".to_owned())
                .spawn(move || {
                    let mut exporter = {
                        let _entered = runtime.enter();
                        make()
                    };
                    if let Err(why) = &exporter {
                        tracing::error!(target: "keel_otel", error = %why,
                            "cannot build the span exporter: spans are dropped");
                    }
                    Worker {
                        commands,
                        counts,
                        batch: batch.max(1),
                        delay,
                    }
                    .run(|job| match (&mut exporter, job) {
                        (Ok(exporter), Job::Export(spans)) => {
                            runtime.block_on(exporter.export(spans))
                        }
                        (Ok(exporter), Job::Resource(resource)) => {
                            exporter.set_resource(&resource);
                            Ok(())
                        }
                        (Err(why), _) => Err(OTelSdkError::InternalFailure(why.clone())),
                    });
                    if let Ok(exporter) = exporter {
                        let _ = exporter.shutdown();
                    }
                })?;
        }
        Ok(Self { queue, counts })
    }

    /// The counts, shared: read them at any time.
    pub fn counts(&self) -> Arc<SpanCounts> {
        Arc::clone(&self.counts)
    }
}

impl SpanProcessor for SpanQueue {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        // Full, or the export thread is gone: either way the span is lost.
        if self.queue.try_send(Command::Span(Box::new(span))).is_err() {
            self.counts.drop_span();
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        let (done, flushed) = mpsc::sync_channel(1);
        self.queue
            .send(Command::Flush(done))
            .map_err(|_| OTelSdkError::AlreadyShutdown)?;
        flushed.recv().map_err(|_| OTelSdkError::AlreadyShutdown)
    }

    fn set_resource(&mut self, resource: &Resource) {
        let _ = self.queue.send(Command::Resource(resource.clone()));
    }

    /// Exports what is queued. The export thread itself ends when the
    /// provider drops this processor, its last sender.
    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        self.force_flush()
    }
}

/// What the worker asks of the exporter.
enum Job {
    Export(Vec<SpanData>),
    Resource(Resource),
}

struct Worker {
    commands: Receiver<Command>,
    counts: Arc<SpanCounts>,
    batch: usize,
    delay: Duration,
}

impl Worker {
    fn run(self, mut export: impl FnMut(Job) -> OTelSdkResult) {
        let mut spans = Vec::with_capacity(self.batch);
        loop {
            let next = if spans.is_empty() {
                self.commands
                    .recv()
                    .map_err(|_| RecvTimeoutError::Disconnected)
            } else {
                self.commands.recv_timeout(self.delay)
            };
            match next {
                Ok(Command::Span(span)) => {
                    spans.push(*span);
                    if spans.len() >= self.batch {
                        self.send(&mut export, &mut spans);
                    }
                }
                Ok(Command::Resource(resource)) => {
                    let _ = export(Job::Resource(resource));
                }
                Ok(Command::Flush(done)) => {
                    self.send(&mut export, &mut spans);
                    let _ = done.send(());
                }
                Err(RecvTimeoutError::Timeout) => self.send(&mut export, &mut spans),
                Err(RecvTimeoutError::Disconnected) => {
                    self.send(&mut export, &mut spans);
                    return;
                }
            }
        }
    }

    fn send(&self, export: &mut impl FnMut(Job) -> OTelSdkResult, spans: &mut Vec<SpanData>) {
        if spans.is_empty() {
            return;
        }
        let n = spans.len() as u64;
        let batch = std::mem::replace(spans, Vec::with_capacity(self.batch));
        match export(Job::Export(batch)) {
            Ok(()) => self.counts.exported_batch(n),
            Err(err) => {
                self.counts.failed_batch(n);
                tracing::debug!(target: "keel_otel", error = %err, spans = n, "span export failed; spans dropped");
            }
        }
    }
}
