//! Memory per idle SSE connection: a loopback server with N idle streams
//! (one user each), measured by the server process's resident set size.
//!
//! ```text
//! cargo bench -p keel-realtime --bench sse
//! KEEL_SSE_BENCH_CONNECTIONS=2000 cargo bench ... --bench sse   # fewer
//! ```
//!
//! The clients run in a child process (this binary again, told so by an
//! environment variable), so their sockets and buffers do not count. The
//! server reads its RSS from `/proc/self/statm` after one warm-up
//! connection, then again once all N streams are open and idle, and prints
//! the difference per connection. Needs N + a few file descriptors in each
//! process (`ulimit -n`). Linux only.

use std::io::{BufRead, Write};
use std::net::SocketAddr;
use std::process::{Command, Stdio};
use std::time::Duration;

use axum::Router;
use axum::http::request::Parts;
use keel_realtime::{EventLog, Realtime, StreamId};
use keel_sqlite::SqliteStore;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CLIENT_ENV: &str = "KEEL_SSE_BENCH_CLIENT";
const COUNT_ENV: &str = "KEEL_SSE_BENCH_CONNECTIONS";
const DEFAULT_CONNECTIONS: usize = 10_000;

fn main() {
    if let Ok(addr) = std::env::var(CLIENT_ENV) {
        client(addr.parse().expect("address"));
    } else {
        server();
    }
}

/// Resident set size of this process, in bytes.
fn rss() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm (Linux)");
    let pages: usize = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .expect("resident pages");
    pages * 4096
}

fn connections() -> usize {
    std::env::var(COUNT_ENV)
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(DEFAULT_CONNECTIONS)
}

fn authenticate(parts: &Parts) -> Option<StreamId> {
    let user = parts.headers.get("x-user")?.to_str().ok()?;
    StreamId::new(format!("user:{user}")).ok()
}

/// Opens one SSE stream and waits for its first frame.
async fn open(addr: SocketAddr, user: usize) -> TcpStream {
    let mut socket = TcpStream::connect(addr).await.expect("connect");
    let request = format!("GET /stream HTTP/1.1\r\nHost: 127.0.0.1\r\nx-user: u{user}\r\n\r\n");
    socket.write_all(request.as_bytes()).await.expect("write");
    let mut seen = Vec::new();
    let mut chunk = [0; 512];
    while !seen.windows(7).any(|w| w == b"retry: ") {
        let n = socket.read(&mut chunk).await.expect("read");
        assert!(n > 0, "server closed the stream");
        seen.extend_from_slice(&chunk[..n]);
    }
    socket
}

fn server() {
    let n = connections();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let dir = tempfile::tempdir().expect("temp dir");
        let store = SqliteStore::open(dir.path().join("keel.db"))
            .await
            .expect("store");
        let log = EventLog::new(store);
        let realtime = Realtime::builder(log, authenticate)
            .build()
            .expect("options");
        let app = if std::env::var("KEEL_SSE_BENCH_BASELINE").is_ok() {
            // What axum and hyper alone cost: a stream that sends one frame
            // and then nothing, with no log, producer or queue behind it.
            let counted = realtime.clone();
            Router::new().route(
                "/stream",
                axum::routing::get(move || {
                    let guard = counted.clone();
                    async move {
                        let first = futures_util::stream::once(async {
                            Ok::<_, std::convert::Infallible>(axum::body::Bytes::from_static(
                                b"retry: 1000\n\n",
                            ))
                        });
                        let rest = futures_util::stream::once(async move {
                            let _keep = guard;
                            std::future::pending::<
                                Result<axum::body::Bytes, std::convert::Infallible>,
                            >()
                            .await
                        });
                        axum::body::Body::from_stream(futures_util::StreamExt::chain(first, rest))
                    }
                }),
            )
        } else {
            Router::new().route("/stream", realtime.sse())
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move { axum::serve(listener, app).await });

        // Warm up: one stream end to end, so lazily built pools, runtime
        // structures and the allocator's first arenas are in the baseline.
        let warm = open(addr, usize::MAX).await;
        drop(warm);
        tokio::time::sleep(Duration::from_millis(300)).await;
        let before = rss();

        let mut child = Command::new(std::env::current_exe().expect("exe"))
            .env(CLIENT_ENV, addr.to_string())
            .env(COUNT_ENV, n.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("client process");
        let mut ready = String::new();
        let stdout = child.stdout.take().expect("stdout");
        let mut stdout = std::io::BufReader::new(stdout);
        tokio::task::block_in_place(|| stdout.read_line(&mut ready)).expect("client ready");
        assert_eq!(ready.trim(), "ready", "client said {ready:?}");
        let baseline = std::env::var("KEEL_SSE_BENCH_BASELINE").is_ok();
        while !baseline && realtime.stats().sse_connections < n as u64 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let after = rss();

        let per = (after.saturating_sub(before)) as f64 / n as f64;
        println!(
            "idle SSE connections: {n}, server RSS before {:.1} MiB, after {:.1} MiB, \
             {:.2} KiB per connection (goal <= 10 KB)",
            before as f64 / 1048576.0,
            after as f64 / 1048576.0,
            per / 1024.0
        );
        let mut stdin = child.stdin.take().expect("stdin");
        let _ = stdin.write_all(b"done\n");
        drop(stdin);
        let _ = child.wait();
    });
}

fn client(addr: SocketAddr) {
    let n = connections();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let mut streams = Vec::with_capacity(n);
        for user in 0..n {
            streams.push(open(addr, user).await);
        }
        println!("ready");
        std::io::stdout().flush().expect("flush");
        // Hold the streams until the server says it has measured.
        let mut line = String::new();
        let _ = std::io::stdin().read_line(&mut line);
        drop(streams);
    });
}
