//! A client in another language calls `keel serve`'s shipping service:
//! Python's standard gRPC (grpcio), its stubs compiled from the checked-in
//! proto by grpcio-tools, the way any Python client calls `GetShipment`.
//! Nothing Keel-only is needed to talk to it: health, deadlines as
//! `grpc-timeout`, a unary call made twice, a refusal for too little time,
//! codes for bad input, a client stream, a bidirectional stream with
//! acknowledgements, and a server stream dropped and resumed.
//!
//! grpcio comes from PyPI (`scripts/grpc_python.sh` installs it; its python
//! is `KEEL_TEST_GRPC_PYTHON`). Without it the test is skipped, except in CI
//! (`CI` set), where it fails.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::serve;
use serde_json::Value;

fn python() -> Option<PathBuf> {
    let path = std::env::var_os("KEEL_TEST_GRPC_PYTHON").map(PathBuf::from);
    match path.filter(|p| p.exists()) {
        Some(path) => Some(path),
        None if std::env::var_os("CI").is_some() => {
            panic!("KEEL_TEST_GRPC_PYTHON must name grpcio's python in CI (scripts/grpc_python.sh)")
        }
        None => {
            eprintln!("skipped: set KEEL_TEST_GRPC_PYTHON (scripts/grpc_python.sh installs it)");
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pythons_standard_grpc_client_calls_every_shipping_method() {
    let Some(python) = python() else {
        return;
    };
    let s = serve(&[]);
    let address = s.grpc.trim_start_matches("http://").to_owned();
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let script = here.join("tests/interop/shipping_client.py");
    let proto = here.join("proto");
    let output = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .arg(script)
            .arg(address)
            .arg(proto)
            .output()
            .expect("python runs")
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "the Python client failed:\n{stdout}\n{stderr}\nserver log:\n{}",
        s.log()
    );
    let result: Value = serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}"));
    assert_eq!(result["ok"], true, "{result}");
    assert_eq!(result["seen"]["too_late"], "DEADLINE_EXCEEDED", "{result}");
    assert_eq!(result["seen"]["health"], "SERVING", "{result}");
}
