//! [`ServerTls`]: the configuration new handshakes get, reloaded from its
//! files when they change.

use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};
use rustls::ServerConfig;
use sha2::{Digest, Sha256};

use super::{TlsError, TlsFiles};

/// How often [`ServerTls::watching`] checks its files by default: 10 s.
pub const RELOAD_CHECK_INTERVAL: Duration = Duration::from_secs(10);

/// The TLS configuration each new handshake uses: fixed, or reloaded from
/// its files. Cheap to clone; clones share it.
#[derive(Clone)]
pub struct ServerTls {
    shared: Arc<Shared>,
}

struct Shared {
    current: RwLock<Arc<ServerConfig>>,
    files: Option<Watched>,
}

struct Watched {
    files: TlsFiles,
    /// The digest of the files' bytes the current configuration was
    /// loaded from: a change is noticed by content, whatever the
    /// filesystem's timestamp resolution.
    loaded_from: Mutex<[u8; 32]>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls")
            .field("files", &self.shared.files.as_ref().map(|w| &w.files))
            .finish_non_exhaustive()
    }
}

impl From<Arc<ServerConfig>> for ServerTls {
    fn from(config: Arc<ServerConfig>) -> Self {
        Self {
            shared: Arc::new(Shared {
                current: RwLock::new(config),
                files: None,
            }),
        }
    }
}

impl ServerTls {
    /// Loads `files` now, failing if they do not load, then checks them
    /// every `interval` and reloads them when their contents change, for
    /// as long as a clone of the handle lives. Call it inside a Tokio
    /// runtime.
    pub fn watching(files: TlsFiles, interval: Duration) -> Result<Self, TlsError> {
        let digest = digest(&files);
        let config = files.load()?;
        let shared = Arc::new(Shared {
            current: RwLock::new(config),
            files: Some(Watched {
                files,
                loaded_from: Mutex::new(digest),
            }),
        });
        tokio::spawn(watch(Arc::downgrade(&shared), interval));
        Ok(Self { shared })
    }

    /// The configuration a handshake starting now uses.
    pub fn current(&self) -> Arc<ServerConfig> {
        self.shared.current.read().clone()
    }

    /// Re-reads the files now if their contents changed (a `SIGHUP`, a
    /// deploy hook): `Ok(true)` if a new configuration is in use. On an
    /// error the last good configuration stays. A fixed configuration has
    /// nothing to reload: `Ok(false)`.
    pub fn reload(&self) -> Result<bool, TlsError> {
        self.shared.reload()
    }
}

impl Shared {
    fn reload(&self) -> Result<bool, TlsError> {
        let Some(watched) = &self.files else {
            return Ok(false);
        };
        let digest = digest(&watched.files);
        if *watched.loaded_from.lock() == digest {
            return Ok(false);
        }
        match watched.files.load() {
            Ok(config) => {
                *self.current.write() = config;
                *watched.loaded_from.lock() = digest;
                metrics::counter!("keel_http_tls_reloads_total", "outcome" => "ok").increment(1);
                tracing::info!(cert = %watched.files.cert.display(), "TLS files changed: reloaded");
                Ok(true)
            }
            Err(error) => {
                metrics::counter!("keel_http_tls_reloads_total", "outcome" => "failed")
                    .increment(1);
                tracing::error!(%error, "TLS files changed but do not load: keeping the last good ones");
                Err(error)
            }
        }
    }
}

async fn watch(shared: Weak<Shared>, interval: Duration) {
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let Some(shared) = shared.upgrade() else {
            return;
        };
        // Small files, read rarely: blocking reads cost less than a hop
        // to the blocking pool. A failure is logged and counted inside.
        let _ = shared.reload();
    }
}

/// The digest of every file's bytes (a missing file counts as empty, so
/// its return is a change).
fn digest(files: &TlsFiles) -> [u8; 32] {
    let mut hash = Sha256::new();
    for path in files.paths() {
        let bytes = std::fs::read(path).unwrap_or_default();
        hash.update((bytes.len() as u64).to_le_bytes());
        hash.update(&bytes);
    }
    hash.finalize().into()
}
