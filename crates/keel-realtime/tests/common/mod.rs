//! What the transports' tests share: a real SqliteStore on a temporary
//! file, the test's authentication, and one user's stream.

use axum::Router;
use axum::http::request::Parts;
use axum::routing::MethodRouter;
use keel_realtime::{EventLog, Realtime, RealtimeBuilder, RealtimeOptions, StreamId};
use keel_sqlite::SqliteStore;
use tokio::sync::watch;

/// A transport mounted on a router, with what its tests look at.
pub(crate) struct Fixture {
    pub(crate) log: EventLog<SqliteStore>,
    pub(crate) realtime: Realtime<SqliteStore>,
    pub(crate) app: Router,
    pub(crate) drain: watch::Sender<bool>,
    _dir: tempfile::TempDir,
}

/// `x-user: alice` authenticates as stream `user:alice` (the application's
/// auth middleware would do this for real).
pub(crate) fn authenticate(parts: &Parts) -> Option<StreamId> {
    let user = parts.headers.get("x-user")?.to_str().ok()?;
    StreamId::new(format!("user:{user}")).ok()
}

pub(crate) fn alice() -> StreamId {
    StreamId::new("user:alice").expect("stream id")
}

/// A transport at `path`, made by `mount` from a `Realtime` that
/// `configure` finished building (with `options` and a drain already set).
pub(crate) async fn fixture(
    options: RealtimeOptions,
    path: &str,
    configure: impl FnOnce(RealtimeBuilder<SqliteStore>) -> RealtimeBuilder<SqliteStore>,
    mount: impl FnOnce(&Realtime<SqliteStore>) -> MethodRouter,
) -> Fixture {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("keel.db"))
        .await
        .expect("open store");
    let log = EventLog::new(store);
    let (drain, drain_rx) = watch::channel(false);
    let builder = Realtime::builder(log.clone(), authenticate)
        .options(options)
        .drain(drain_rx);
    let realtime = configure(builder).build().expect("valid options");
    let app = Router::new().route(path, mount(&realtime));
    Fixture {
        log,
        realtime,
        app,
        drain,
        _dir: dir,
    }
}
