//! `keel serve` behind a real nginx, configured with the file the README
//! gives (`deploy/nginx/keel.conf`): Server-Sent Events arrive one by one,
//! each before the next exists; a long poll and a WebSocket work through it
//! with Keel's own clients; the deadline and the trace headers reach keel.
//!
//! Needs nginx (scripts/nginx.sh installs Debian's `nginx-light`; the path
//! is `KEEL_TEST_NGINX`, default `/usr/sbin/nginx`). Without it the tests
//! are skipped, except in CI (`CI` set), where they fail.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{Server, eventually, order, otlp_receiver, placed_id, serve};
use keel_client::{KeelSocket, LongPoll, PropagatingClient, SocketMessage, SseClient};

/// How long an event may take to come through nginx once it exists.
const PROMPTLY: Duration = Duration::from_secs(5);

/// nginx on a free loopback port in front of a server, killed when dropped.
struct Nginx {
    child: Child,
    url: String,
    _dir: tempfile::TempDir,
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn nginx_binary() -> Option<PathBuf> {
    let path = std::env::var_os("KEEL_TEST_NGINX")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/sbin/nginx"));
    if path.exists() {
        return Some(path);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "nginx not found at {} (scripts/nginx.sh installs it)",
        path.display()
    );
    eprintln!("skipped: no nginx at {}", path.display());
    None
}

/// The shipped configuration, for `upstream`, listening on `port`.
fn site(upstream: &str, port: u16) -> String {
    let shipped = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/nginx/keel.conf");
    std::fs::read_to_string(shipped)
        .unwrap()
        .replace("@UPSTREAM@", upstream)
        .replace("@LISTEN@", &format!("127.0.0.1:{port}"))
}

fn main_conf(dir: &Path) -> String {
    let d = dir.display();
    format!(
        "daemon off;\nmaster_process off;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
         events {{ worker_connections 256; }}\n\
         http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n  \
         fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n  \
         include {d}/keel.conf;\n}}\n"
    )
}

fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

impl Nginx {
    /// nginx in front of `server`, or `None` without nginx outside CI. A
    /// port taken between choosing it and nginx binding it is chosen again.
    async fn start(server: &Server) -> Option<Self> {
        let binary = nginx_binary()?;
        for _ in 0..5 {
            let dir = tempfile::tempdir().unwrap();
            let port = free_port();
            std::fs::write(dir.path().join("keel.conf"), site(server.host(), port)).unwrap();
            std::fs::write(dir.path().join("nginx.conf"), main_conf(dir.path())).unwrap();
            let mut child = Command::new(&binary)
                .arg("-p")
                .arg(dir.path())
                .arg("-c")
                .arg(dir.path().join("nginx.conf"))
                .arg("-e")
                .arg(dir.path().join("error.log"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("nginx starts");
            for _ in 0..100 {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                if tokio::net::TcpStream::connect(("127.0.0.1", port))
                    .await
                    .is_ok()
                {
                    return Some(Self {
                        child,
                        url: format!("http://127.0.0.1:{port}"),
                        _dir: dir,
                    });
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let log = std::fs::read_to_string(dir.path().join("error.log")).unwrap_or_default();
            let _ = child.kill();
            assert!(
                log.contains("Address already in use"),
                "nginx did not start: {log}"
            );
        }
        panic!("nginx found no free port in 5 tries");
    }
}

async fn started() -> Option<(Server, Nginx)> {
    let server = serve(&[]);
    let nginx = Nginx::start(&server).await?;
    Some((server, nginx))
}

fn client() -> PropagatingClient {
    PropagatingClient::new(reqwest::Client::new())
}

#[tokio::test]
async fn server_sent_events_arrive_one_by_one_through_nginx() {
    let Some((server, nginx)) = started().await else {
        return;
    };
    let http = reqwest::Client::new();
    let url = format!("{}/stream?customerId=watcher", nginx.url);
    let mut stream = SseClient::builder(&client(), url.parse().unwrap()).build();
    // Each order's event comes through on its own, before the next order
    // exists: nothing waits for a buffer to fill.
    for n in 0..3 {
        let id = placed_id(&http, &server, &format!("sse-{n}"), &order("watcher")).await;
        let event = tokio::time::timeout(PROMPTLY, async {
            loop {
                let event = stream.next().await.unwrap();
                if event.data.contains(&id) {
                    return event;
                }
            }
        })
        .await
        .unwrap_or_else(|_| panic!("order {n}'s event did not come through nginx in {PROMPTLY:?}"));
        assert!(event.id.is_some(), "resumable: {event:?}");
    }
}

#[tokio::test]
async fn a_long_poll_and_a_websocket_follow_a_customer_through_nginx() {
    let Some((server, nginx)) = started().await else {
        return;
    };
    let http = reqwest::Client::new();
    let updates = format!("{}/updates?customerId=follower", nginx.url);
    let mut poll = LongPoll::builder(&client(), updates.parse().unwrap()).build();
    let ws = format!(
        "{}/ws?customerId=follower",
        nginx.url.replacen("http", "ws", 1)
    );
    let mut socket = KeelSocket::builder(ws.parse().unwrap())
        .after(0)
        .build()
        .unwrap();
    let id = placed_id(&http, &server, "follow-1", &order("follower")).await;

    let batch = tokio::time::timeout(PROMPTLY, poll.next())
        .await
        .expect("the long poll answered through nginx")
        .unwrap();
    assert!(
        batch.events.iter().any(|e| e.data["orderId"] == id),
        "{:?}",
        batch.events
    );
    let event = tokio::time::timeout(PROMPTLY, async {
        loop {
            if let SocketMessage::Event { data, .. } = socket.next().await.unwrap() {
                return data;
            }
        }
    })
    .await
    .expect("an event over the WebSocket through nginx");
    assert_eq!(event["orderId"], id);
    socket.close().await;
}

const CALLER_TRACE: &str = "0af7651916cd43dd8448eb211c80319c";

#[tokio::test]
async fn the_deadline_and_the_trace_reach_keel_through_nginx() {
    if nginx_binary().is_none() {
        return;
    }
    let (otlp, spans) = otlp_receiver().await;
    let server = serve(&["--otlp-endpoint", &otlp]);
    let nginx = Nginx::start(&server).await.expect("nginx");
    let http = reqwest::Client::new();

    // A deadline that passed: keel answers 504 without doing the work.
    let late = http
        .post(format!("{}/orders", nginx.url))
        .header("idempotency-key", "late-1")
        .header("x-request-deadline-unix-ms", "1000")
        .json(&order("late"))
        .send()
        .await
        .unwrap();
    assert_eq!(late.status(), 504, "the deadline reached keel");

    // The caller's trace: keel's server span is its child.
    let placed = http
        .post(format!("{}/orders", nginx.url))
        .header("idempotency-key", "traced-1")
        .header(
            "traceparent",
            format!("00-{CALLER_TRACE}-b7ad6b7169203331-01"),
        )
        .json(&order("traced"))
        .send()
        .await
        .unwrap();
    assert_eq!(placed.status(), 201);
    eventually("keel's server span in the caller's trace", || async {
        spans.lock().iter().any(|s| {
            s.name == "POST /orders"
                && s.trace_id
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>()
                    == CALLER_TRACE
        })
    })
    .await;
}
