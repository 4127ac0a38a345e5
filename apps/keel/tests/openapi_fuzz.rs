//! The OpenAPI document says what the server enforces: Schemathesis, a
//! schema-driven fuzzer, runs every check it has against a real `keel
//! serve` (valid requests must pass, invalid ones must be refused with
//! `4xx`, every status, header and body must be the documented one,
//! undeclared methods must answer `405` with a true `Allow`).
//!
//! Schemathesis comes from PyPI (`scripts/schemathesis.sh` installs it; its
//! path is `KEEL_TEST_SCHEMATHESIS`). Without it the test is skipped, except
//! in CI (`CI` set), where it fails. Its configuration and hooks are in
//! `tests/fuzz/`; the seed is `KEEL_FUZZ_SEED` (default 1) and the examples
//! per operation `KEEL_FUZZ_EXAMPLES` (default 100), so a soak run is
//! `KEEL_FUZZ_SEED=$n cargo nextest run -p keel --test openapi_fuzz`.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{ACME_KEY, serve};
use serde_json::Value;

fn schemathesis() -> Option<PathBuf> {
    let path = std::env::var_os("KEEL_TEST_SCHEMATHESIS").map(PathBuf::from);
    match path.filter(|p| p.exists()) {
        Some(path) => Some(path),
        None if std::env::var_os("CI").is_some() => {
            panic!("KEEL_TEST_SCHEMATHESIS must name schemathesis in CI (scripts/schemathesis.sh)")
        }
        None => {
            eprintln!("skipped: set KEEL_TEST_SCHEMATHESIS (scripts/schemathesis.sh installs it)");
            None
        }
    }
}

fn setting(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schema_driven_fuzzer_finds_the_server_doing_what_its_openapi_says() {
    let Some(schemathesis) = schemathesis() else {
        return;
    };
    let s = serve(&[]);
    let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fuzz");
    let workdir = tempfile::tempdir().expect("a working directory");
    let seed = setting("KEEL_FUZZ_SEED", "1");
    let examples = setting("KEEL_FUZZ_EXAMPLES", "100");
    let run = tokio::task::spawn_blocking({
        let url = s.url.clone();
        move || {
            Command::new(schemathesis)
                .current_dir(workdir.path())
                .env("SCHEMATHESIS_HOOKS", "hooks")
                .env("PYTHONPATH", &fuzz)
                .env("NO_COLOR", "1")
                .arg("--config-file")
                .arg(fuzz.join("schemathesis.toml"))
                .args(["run", &format!("{url}/openapi.json"), "--url", &url])
                .args(["--exclude-tag", "realtime", "--seed", &seed])
                .args(["--max-examples", &examples, "--workers", "1"])
                .args(["-H", &format!("Authorization: Bearer {ACME_KEY}")])
                .output()
                .expect("run schemathesis")
        }
    })
    .await
    .expect("schemathesis task");
    let report = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "schemathesis found the server and its document disagreeing:\n{report}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );

    // Valid orders made of the document's rules alone got through.
    let placed: Value = reqwest::get(format!("{}/orders?limit=100", s.url))
        .await
        .expect("GET /orders")
        .json()
        .await
        .expect("a page");
    let orders = placed["items"].as_array().map_or(0, Vec::len);
    assert!(orders > 0, "no fuzzed order was accepted:\n{report}");
    let lines: Vec<&str> = report.lines().collect();
    eprintln!("{}", lines[lines.len().saturating_sub(12)..].join("\n"));
}
