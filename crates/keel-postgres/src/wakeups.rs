//! Cross-process wake-ups over PostgreSQL's `LISTEN/NOTIFY`.
//!
//! An outbox (`keel_messaging::outbox::Outbox`) wakes the relay of its own
//! process after a commit; a relay in *another* process would only notice
//! at its next poll. [`PgWakeups`] closes that gap: the store's appends send
//! `pg_notify` inside their transaction (delivered at commit, dropped on
//! rollback), and a `PgWakeups` task in every process listens on the
//! store's channels and calls the handlers registered for them.
//!
//! ```no_run
//! # async fn demo(store: keel_postgres::PgStore) {
//! use std::sync::Arc;
//! use keel_postgres::PgWakeups;
//!
//! // With keel-messaging, the handler is `move || outbox.notify()`.
//! let relay_wake = Arc::new(tokio::sync::Notify::new());
//! let waker = relay_wake.clone();
//! let wakeups = PgWakeups::builder(&store)
//!     .on_outbox(move || waker.notify_one())
//!     .spawn();
//! // ... the relay waits on `relay_wake.notified()` between polls ...
//! # drop(wakeups);
//! # }
//! ```
//!
//! Notifications are not durable: while the listening connection is down,
//! they are lost. So after every reconnect each handler is called once
//! (event-log handlers with `None`: "something may have been missed"), and
//! polling stays the fallback that bounds the delay if even that fails.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use keel_policy::retry::{Backoff, Jitter};

use sqlx::postgres::{PgListener, PgPool};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::store::{Channels, PgStore};

type Callback = Arc<dyn Fn() + Send + Sync>;
type EventLogCallback = Arc<dyn Fn(Option<EventLogWake<'_>>) + Send + Sync>;

/// The longest wait between attempts to reconnect the listener.
const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(5);

/// An event-log append another process committed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventLogWake<'a> {
    /// The stream appended to.
    pub stream: &'a str,
    /// The event's seq.
    pub seq: i64,
}

/// Builds a [`PgWakeups`]: register handlers per channel, then
/// [`spawn`](Self::spawn).
pub struct PgWakeupsBuilder {
    pool: PgPool,
    channels: Channels,
    outbox: Vec<Callback>,
    webhooks: Vec<Callback>,
    sagas: Vec<Callback>,
    event_log: Vec<EventLogCallback>,
}

impl std::fmt::Debug for PgWakeupsBuilder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgWakeupsBuilder")
            .field("channels", &self.channels)
            .finish_non_exhaustive()
    }
}

impl PgWakeupsBuilder {
    /// Calls `wake` when an outbox append commits (e.g. `outbox.notify()`).
    pub fn on_outbox(mut self, wake: impl Fn() + Send + Sync + 'static) -> Self {
        self.outbox.push(Arc::new(wake));
        self
    }

    /// Calls `wake` when webhook deliveries are queued.
    pub fn on_webhooks(mut self, wake: impl Fn() + Send + Sync + 'static) -> Self {
        self.webhooks.push(Arc::new(wake));
        self
    }

    /// Calls `wake` when a saga is created or saved.
    pub fn on_sagas(mut self, wake: impl Fn() + Send + Sync + 'static) -> Self {
        self.sagas.push(Arc::new(wake));
        self
    }

    /// Calls `wake` with the stream and seq of each committed event-log
    /// append, and with `None` after a reconnect (recheck every stream).
    pub fn on_event_log(
        mut self,
        wake: impl Fn(Option<EventLogWake<'_>>) + Send + Sync + 'static,
    ) -> Self {
        self.event_log.push(Arc::new(wake));
        self
    }

    /// Starts listening on a connection of its own (not one of the store's
    /// pool). Must be called inside a Tokio runtime.
    pub fn spawn(self) -> PgWakeups {
        let (state, connected) = watch::channel(false);
        let handlers = Arc::new(Handlers {
            channels: self.channels,
            outbox: self.outbox,
            webhooks: self.webhooks,
            sagas: self.sagas,
            event_log: self.event_log,
        });
        let task = tokio::spawn(listen(self.pool, handlers, state));
        PgWakeups { task, connected }
    }
}

/// The listening task; it stops when dropped. See the [module docs](self).
#[derive(Debug)]
pub struct PgWakeups {
    task: JoinHandle<()>,
    connected: watch::Receiver<bool>,
}

impl PgWakeups {
    /// A builder listening on `store`'s channels, connecting like `store`.
    pub fn builder(store: &PgStore) -> PgWakeupsBuilder {
        let options = store.pool().connect_options();
        let pool = crate::store::pool_options()
            .max_connections(1)
            .idle_timeout(None)
            .max_lifetime(None)
            .acquire_timeout(MAX_RECONNECT_DELAY)
            .connect_lazy_with((*options).clone());
        PgWakeupsBuilder {
            pool,
            channels: store.channels().clone(),
            outbox: Vec::new(),
            webhooks: Vec::new(),
            sagas: Vec::new(),
            event_log: Vec::new(),
        }
    }

    /// Whether the listener is connected and listening right now.
    pub fn is_listening(&self) -> bool {
        *self.connected.borrow()
    }

    /// Waits until the listener is listening (notifications committed
    /// before that are not seen).
    pub async fn listening(&self) {
        let mut connected = self.connected.clone();
        // An Err means the task ended: nothing to wait for any more.
        let _ = connected.wait_for(|up| *up).await;
    }

    /// Stops listening.
    pub fn stop(&self) {
        self.task.abort();
    }
}

impl Drop for PgWakeups {
    fn drop(&mut self) {
        self.task.abort();
    }
}

struct Handlers {
    channels: Channels,
    outbox: Vec<Callback>,
    webhooks: Vec<Callback>,
    sagas: Vec<Callback>,
    event_log: Vec<EventLogCallback>,
}

impl Handlers {
    fn names(&self) -> Vec<&str> {
        let mut names = Vec::new();
        let wanted = [
            (&self.channels.outbox, !self.outbox.is_empty()),
            (&self.channels.webhooks, !self.webhooks.is_empty()),
            (&self.channels.sagas, !self.sagas.is_empty()),
            (&self.channels.event_log, !self.event_log.is_empty()),
        ];
        for (name, used) in wanted {
            if used {
                names.push(name.as_str());
            }
        }
        names
    }

    fn dispatch(&self, channel: &str, payload: &str) {
        if channel == self.channels.outbox {
            self.outbox.iter().for_each(|wake| wake());
        } else if channel == self.channels.webhooks {
            self.webhooks.iter().for_each(|wake| wake());
        } else if channel == self.channels.sagas {
            self.sagas.iter().for_each(|wake| wake());
        } else if channel == self.channels.event_log {
            let wake = parse_event_log(payload);
            self.event_log.iter().for_each(|handler| handler(wake));
        }
    }

    /// After a reconnect: anything may have been missed.
    fn wake_all(&self) {
        self.outbox.iter().for_each(|wake| wake());
        self.webhooks.iter().for_each(|wake| wake());
        self.sagas.iter().for_each(|wake| wake());
        self.event_log.iter().for_each(|handler| handler(None));
    }
}

/// `<seq> <stream>` (the stream may contain spaces; the seq cannot).
fn parse_event_log(payload: &str) -> Option<EventLogWake<'_>> {
    let (seq, stream) = payload.split_once(' ')?;
    Some(EventLogWake {
        stream,
        seq: seq.parse().ok()?,
    })
}

async fn listen(pool: PgPool, handlers: Arc<Handlers>, state: watch::Sender<bool>) {
    let names = handlers.names();
    if names.is_empty() {
        return;
    }
    let mut failures: u32 = 0;
    let mut connected_before = false;
    while !pool.is_closed() {
        let mut listener = match subscribe(&pool, &names).await {
            Ok(listener) => listener,
            Err(err) => {
                failures = failures.saturating_add(1);
                let delay = reconnect_delay(failures);
                tracing::warn!(error = %err, ?delay, "postgres LISTEN failed; retrying");
                tokio::time::sleep(delay).await;
                continue;
            }
        };
        failures = 0;
        state.send_replace(true);
        if connected_before {
            tracing::info!("postgres LISTEN reconnected; waking every handler once");
            metrics::counter!("keel_postgres_listen_reconnects_total").increment(1);
            handlers.wake_all();
        }
        connected_before = true;
        loop {
            match listener.try_recv().await {
                Ok(Some(notification)) => {
                    handlers.dispatch(notification.channel(), notification.payload());
                }
                Ok(None) => {
                    tracing::info!("postgres LISTEN connection lost and re-established");
                    handlers.wake_all();
                }
                Err(err) => {
                    tracing::warn!(error = %err, "postgres LISTEN connection lost");
                    break;
                }
            }
        }
        state.send_replace(false);
    }
}

async fn subscribe(pool: &PgPool, names: &[&str]) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen_all(names.iter().copied()).await?;
    Ok(listener)
}

/// 100 ms × 2ⁿ after the n-th failure in a row, at most
/// [`MAX_RECONNECT_DELAY`], equal jitter: every process's listener lost
/// the same server at once, and should not all come back at once.
fn reconnect_delay(failures: u32) -> Duration {
    static BACKOFF: LazyLock<Backoff> = LazyLock::new(|| {
        Backoff::exponential(Duration::from_millis(100), 2.0, MAX_RECONNECT_DELAY)
            .and_then(|backoff| backoff.with_jitter(Jitter::Equal))
            .expect("constant, valid bounds")
    });
    BACKOFF.delay(failures).unwrap_or(MAX_RECONNECT_DELAY)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_log_payloads_parse() {
        assert_eq!(
            parse_event_log("42 user 7"),
            Some(EventLogWake {
                stream: "user 7",
                seq: 42
            })
        );
        assert_eq!(parse_event_log("x y"), None);
        assert_eq!(parse_event_log(""), None);
    }

    #[test]
    fn reconnect_delay_is_bounded() {
        let first = reconnect_delay(1);
        assert!((Duration::from_millis(100)..=Duration::from_millis(200)).contains(&first));
        let late = reconnect_delay(30);
        assert!((MAX_RECONNECT_DELAY / 2..=MAX_RECONNECT_DELAY).contains(&late));
    }
}
