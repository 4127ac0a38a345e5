//! A Keel server (realtime + jobs over a SQLite file) that a test can kill
//! and restart on the same address.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::Path;
use axum::http::request::Parts;
use axum::routing::{get, post};
use keel_http::jobs::{Jobs, JobsOptions};
use keel_messaging::outbox::Outbox;
use keel_realtime::{EventLog, Realtime, RealtimeOptions, SendMessage, StreamId};
use keel_sqlite::SqliteStore;
use parking_lot::Mutex;
use serde_json::json;

pub(crate) const ORIGIN: &str = "https://shop.example";
pub(crate) const USER: &str = "ada";

/// What the application's WebSocket handler saw, across restarts.
#[derive(Debug, Default)]
pub(crate) struct Effects {
    /// How many times each message id was handled.
    pub(crate) handled: Mutex<HashMap<String, usize>>,
    /// The first `{"stall": true}` message never finishes (the server is
    /// killed while it runs); later ones are handled at once.
    pub(crate) stalled_once: AtomicBool,
}

pub(crate) struct Server {
    pub(crate) addr: SocketAddr,
    pub(crate) effects: Arc<Effects>,
    path: PathBuf,
    runtime: Option<tokio::runtime::Runtime>,
    _dir: tempfile::TempDir,
}

fn authenticate(parts: &Parts) -> Option<StreamId> {
    let user = parts.headers.get("x-user")?.to_str().ok()?;
    StreamId::new(format!("user:{user}")).ok()
}

pub(crate) fn stream() -> StreamId {
    StreamId::new(format!("user:{USER}")).expect("stream id")
}

pub(crate) fn jobs_options() -> JobsOptions {
    JobsOptions::new("report")
        .accepted_retry_after(Duration::from_secs(1))
        .poll_retry_after(Duration::from_secs(1))
}

impl Server {
    pub(crate) async fn start() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("keel.db");
        let mut server = Self {
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            effects: Arc::new(Effects::default()),
            path,
            runtime: None,
            _dir: dir,
        };
        server.restart().await;
        server
    }

    /// Drops every connection and task of the server at once.
    pub(crate) fn kill(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }

    /// Starts the server again on the same address and file.
    pub(crate) async fn restart(&mut self) {
        self.kill();
        let (addr, path, effects) = (self.addr, self.path.clone(), Arc::clone(&self.effects));
        // A runtime of its own, built and started off this one's thread.
        let (runtime, addr) = tokio::task::spawn_blocking(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("server runtime");
            let addr = runtime.block_on(async move {
                let app = app(&path, effects).await;
                let listener = bind(addr).await;
                let addr = listener.local_addr().expect("addr");
                tokio::spawn(async move { axum::serve(listener, app).await });
                addr
            });
            (runtime, addr)
        })
        .await
        .expect("server thread");
        self.addr = addr;
        self.runtime = Some(runtime);
    }

    pub(crate) fn url(&self, path: &str) -> reqwest::Url {
        format!("http://{}{path}", self.addr).parse().expect("url")
    }

    /// The log, opened by the test itself: what it publishes reaches the
    /// server's clients only when they read the file (no wake-up).
    pub(crate) async fn log(&self) -> EventLog<SqliteStore> {
        EventLog::new(self.store().await)
    }

    pub(crate) async fn jobs(&self) -> Jobs<SqliteStore> {
        Jobs::new(Outbox::new(self.store().await), jobs_options()).expect("jobs options")
    }

    async fn store(&self) -> SqliteStore {
        SqliteStore::open(&self.path).await.expect("open store")
    }

    /// The scenario every client loop must survive, after events 1 to 3:
    /// the server killed, events 4 to 6 published straight into its file
    /// while it is down, the server restarted, events 7 to 9 published
    /// through it.
    pub(crate) async fn publish_while_down_then_restart(&mut self) {
        self.kill();
        let log = self.log().await;
        for n in 4..=6 {
            log.publish(&stream(), "tick", &json!({ "n": n }))
                .await
                .expect("publish");
        }
        self.restart().await;
        for n in 7..=9 {
            self.publish(n).await;
        }
    }

    /// Publishes through the server, which wakes its waiting clients.
    pub(crate) async fn publish(&self, n: i64) -> i64 {
        let response = reqwest::Client::new()
            .post(self.url(&format!("/publish/{n}")))
            .send()
            .await
            .expect("publish");
        assert!(
            response.status().is_success(),
            "publish answered {}",
            response.status()
        );
        response.json().await.expect("seq")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Binds `addr`, retrying while the old listener's port is being released.
async fn bind(addr: SocketAddr) -> tokio::net::TcpListener {
    for _ in 0..100 {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(listener) => return listener,
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
    panic!("could not bind {addr} again");
}

async fn app(path: &std::path::Path, effects: Arc<Effects>) -> Router {
    let store = SqliteStore::open(path).await.expect("open store");
    let log = EventLog::new(store.clone());
    let on_send = move |_stream: StreamId, message: SendMessage| {
        let effects = Arc::clone(&effects);
        async move {
            if message.body.get("stall").is_some()
                && !effects.stalled_once.swap(true, Ordering::SeqCst)
            {
                std::future::pending::<()>().await;
            }
            *effects.handled.lock().entry(message.id).or_default() += 1;
            Ok(())
        }
    };
    let realtime = Realtime::builder(log.clone(), authenticate)
        .options(
            RealtimeOptions::new()
                .allowed_origins([ORIGIN])
                .poll_timeout(Duration::from_secs(2)),
        )
        .on_send(on_send)
        .build()
        .expect("realtime options");
    let jobs = Jobs::new(Outbox::new(store), jobs_options()).expect("jobs options");
    let publish = move |Path(n): Path<i64>| {
        let log = log.clone();
        async move {
            let seq = log
                .publish(&stream(), "tick", &json!({ "n": n }))
                .await
                .expect("publish");
            axum::Json(seq)
        }
    };
    Router::new()
        .route("/updates", realtime.long_poll())
        .route("/stream", realtime.sse())
        .route("/ws", realtime.websocket())
        .route("/publish/{n}", post(publish))
        .route("/reports", jobs.create_route())
        .route(
            "/reports/{id}",
            get(|Path(id): Path<String>| async move { format!("report {id}") }),
        )
        .merge(jobs.routes())
}
