//! The settings of a [`NatsBroker`](crate::NatsBroker), with their defaults.

use std::time::Duration;

use keel_store::broker::BrokerError;

use crate::NatsBroker;

/// How a [`NatsBroker`](crate::NatsBroker) lays out and uses JetStream.
///
/// The defaults suit a production server; tests give every scenario its own
/// [`stream_prefix`](Self::stream_prefix) so that parallel tests on one
/// server never see each other's streams.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NatsBrokerOptions {
    /// Prefix of every stream name (`<prefix>_<topic>`), subject
    /// (`<prefix>.<topic>.k.<key>`) and of the cursor bucket
    /// (`<prefix>_cursors`). Default `KEEL`.
    pub stream_prefix: String,
    /// How long JetStream remembers message ids for publisher dedupe
    /// (`Nats-Msg-Id`). A republish after this window is stored again.
    /// Default 10 minutes.
    pub duplicate_window: Duration,
    /// How long a topic retains messages (`max_age`); zero keeps them until
    /// other limits apply. Key cursors live as long. Default 7 days.
    pub retention: Duration,
    /// The most deliveries a group may have unacked at once, the ones held
    /// back behind an earlier message of their key included. Default 4,096.
    pub max_ack_pending: i64,
    /// How long a JetStream API call (and a publish's ack) may take before it
    /// counts as failed. Default 5 s.
    pub request_timeout: Duration,
    /// Whether streams keep messages on disk (`true`, the default) or in
    /// memory.
    pub file_storage: bool,
    /// How many servers of a JetStream cluster keep each stream and the
    /// key-cursor bucket (`num_replicas`, 1 to 5). Default 1, the only
    /// value a single server accepts; a cluster should use 3, since a
    /// single replica loses what its one server loses (see
    /// [`NatsBroker::durability_warnings`](crate::NatsBroker::durability_warnings)).
    pub replicas: usize,
}

impl Default for NatsBrokerOptions {
    fn default() -> Self {
        Self {
            stream_prefix: "KEEL".to_owned(),
            duplicate_window: Duration::from_secs(600),
            retention: Duration::from_secs(7 * 24 * 3600),
            max_ack_pending: 4096,
            request_timeout: Duration::from_secs(5),
            file_storage: true,
            replicas: 1,
        }
    }
}

impl NatsBrokerOptions {
    /// Opens the broker on the NATS server at `url` (e.g.
    /// `nats://127.0.0.1:4222`, or a cluster's servers separated by commas)
    /// with these options. The client reconnects on its own after a server
    /// restart.
    pub async fn open(self, url: &str) -> Result<NatsBroker, BrokerError> {
        NatsBroker::connect(url, self).await
    }

    /// The defaults.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets [`stream_prefix`](Self::stream_prefix).
    pub fn stream_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.stream_prefix = prefix.into();
        self
    }

    /// Sets [`duplicate_window`](Self::duplicate_window).
    pub fn duplicate_window(mut self, window: Duration) -> Self {
        self.duplicate_window = window;
        self
    }

    /// Sets [`retention`](Self::retention).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.retention = retention;
        self
    }

    /// Sets [`max_ack_pending`](Self::max_ack_pending).
    pub fn max_ack_pending(mut self, max: i64) -> Self {
        self.max_ack_pending = max;
        self
    }

    /// Sets [`request_timeout`](Self::request_timeout).
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Sets [`replicas`](Self::replicas).
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// What these options leave exposed to losing a message the broker
    /// acknowledged, one sentence each (empty when nothing is).
    ///
    /// JetStream acknowledges a publish once the stream's replicas stored
    /// it in their page cache; by default a server fsyncs every two minutes
    /// (`sync_interval`). With one replica, a machine crash or power loss
    /// loses the acknowledged messages not yet synced, and a lost disk loses
    /// them all; with three, a message is lost only if a majority of
    /// machines fail together before syncing. Memory storage loses
    /// everything with a server restart.
    pub fn durability_warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        if !self.file_storage {
            warnings.push(
                "streams are kept in memory: a NATS server restart loses every message; \
                 use file storage"
                    .to_owned(),
            );
        }
        if self.replicas < 3 {
            warnings.push(format!(
                "streams have {} replica(s): a crash or power loss of the NATS server's machine \
                 loses acknowledged messages not yet fsynced (every 2 minutes unless the server \
                 sets sync_interval: always); run a cluster with 3 replicas",
                self.replicas
            ));
        }
        warnings
    }

    /// Sets [`file_storage`](Self::file_storage).
    pub fn file_storage(mut self, on_disk: bool) -> Self {
        self.file_storage = on_disk;
        self
    }
}
