//! JSON log lines carry the trace they were written in.

use std::io::Write;
use std::sync::Arc;

use keel_core::TraceParent;
use keel_otel::WithTraceIds;
use parking_lot::Mutex;
use serde_json::Value;
use tracing_subscriber::fmt::MakeWriter;

#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Write for Lines {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Lines {
    type Writer = Lines;

    fn make_writer(&'a self) -> Self::Writer {
        self.clone()
    }
}

#[tokio::test]
async fn every_json_line_inside_a_trace_names_its_trace_and_span() {
    let lines = Lines::default();
    let subscriber = tracing_subscriber::fmt()
        .json()
        .event_format(WithTraceIds::new(
            tracing_subscriber::fmt::format().json().flatten_event(true),
        ))
        .with_writer(lines.clone())
        .finish();
    let _default = tracing::subscriber::set_default(subscriber);
    let trace: TraceParent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        .parse()
        .unwrap();
    trace
        .scope(async { tracing::info!(order = "A-4471", "order placed") })
        .await;
    tracing::info!("outside any trace");

    let text = String::from_utf8(lines.0.lock().clone()).unwrap();
    let parsed: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    assert_eq!(parsed.len(), 2);
    assert_eq!(parsed[0]["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736");
    assert_eq!(parsed[0]["span_id"], "00f067aa0ba902b7");
    assert_eq!(parsed[0]["message"], "order placed");
    assert_eq!(parsed[0]["order"], "A-4471");
    assert!(parsed[1].get("trace_id").is_none(), "no trace, no ids");
    assert_eq!(parsed[1]["message"], "outside any trace");
}
