//! [`EtcdElection`] and the [`Leadership`] a won campaign holds.

use std::time::Duration;

use etcd_client::{Client, ConnectOptions, LeaderKey, ProclaimOptions, ResignOptions};
use futures_util::StreamExt as _;
use futures_util::stream::BoxStream;
use keel_core::clock;
use keel_store::{LeadershipDeadline, leadership_deadline};
use tokio::task::JoinHandle;

use crate::keep_alive::keep_alive;

/// How long a leader's lease lasts without a keep-alive, by default: 10 s.
/// A leader cut off from etcd stops leading within this; another is
/// elected no sooner.
pub const DEFAULT_TTL: Duration = Duration::from_secs(10);

/// How long one request to etcd may take, by default: 2 s.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// What went wrong with an election.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EtcdError {
    /// etcd could not be reached or refused the request; the election's
    /// state is what it was (a campaign that fails this way has not won).
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// A setting is out of range.
    #[error("{field} {problem}")]
    Invalid {
        /// The setting.
        field: &'static str,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// etcd answered a campaign without a leader key.
    #[error("etcd answered the campaign without a leader key")]
    NoLeaderKey,
}

/// Builds an [`EtcdElection`]. Defaults: [`DEFAULT_TTL`],
/// [`DEFAULT_REQUEST_TIMEOUT`].
#[derive(Debug, Clone)]
#[must_use]
pub struct EtcdElectionBuilder {
    endpoints: Vec<String>,
    name: String,
    ttl: Duration,
    request_timeout: Duration,
}

impl EtcdElectionBuilder {
    /// The leader's lease (whole seconds, at least 2; default
    /// [`DEFAULT_TTL`]). Shorter elects a new leader sooner after a
    /// crash, and deposes a leader sooner after a blip.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long one request may take (default [`DEFAULT_REQUEST_TIMEOUT`]);
    /// a campaign waits for as long as it takes to win.
    pub fn request_timeout(mut self, timeout: Duration) -> Self {
        self.request_timeout = timeout;
        self
    }

    /// Checks the settings and connects.
    pub async fn build(self) -> Result<EtcdElection, EtcdError> {
        if self.ttl < Duration::from_secs(2) || self.ttl.subsec_nanos() != 0 {
            return Err(EtcdError::Invalid {
                field: "ttl",
                problem: "must be whole seconds, at least 2",
            });
        }
        if self.request_timeout.is_zero() {
            return Err(EtcdError::Invalid {
                field: "request_timeout",
                problem: "must be more than zero",
            });
        }
        let options = ConnectOptions::new()
            .with_connect_timeout(self.request_timeout)
            .with_keep_alive(self.ttl / 3, self.request_timeout);
        let client = Client::connect(&self.endpoints, Some(options)).await?;
        Ok(EtcdElection {
            client,
            name: self.name,
            ttl: self.ttl,
            request_timeout: self.request_timeout,
        })
    }
}

/// One election on etcd: every process campaigning under the same name
/// competes for one leadership. Cheap to clone.
#[derive(Clone)]
pub struct EtcdElection {
    client: Client,
    name: String,
    ttl: Duration,
    request_timeout: Duration,
}

impl std::fmt::Debug for EtcdElection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdElection")
            .field("name", &self.name)
            .field("ttl", &self.ttl)
            .finish_non_exhaustive()
    }
}

impl EtcdElection {
    /// A builder for the election `name` on the etcd cluster at
    /// `endpoints` (`http://host:2379`).
    pub fn builder<E, I>(endpoints: I, name: impl Into<String>) -> EtcdElectionBuilder
    where
        I: IntoIterator<Item = E>,
        E: Into<String>,
    {
        EtcdElectionBuilder {
            endpoints: endpoints.into_iter().map(Into::into).collect(),
            name: name.into(),
            ttl: DEFAULT_TTL,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }

    /// Campaigns as `holder` (its value while it leads) and returns once
    /// it leads. The lease is kept alive from the start, so a campaign may
    /// wait as long as another leads. Dropping the future gives up the
    /// campaign: its lease is no longer kept alive and ends within the TTL.
    pub async fn campaign(&self, holder: &str) -> Result<Leadership, EtcdError> {
        let mut client = self.client.clone();
        let asked = clock::now();
        let ttl_secs = i64::try_from(self.ttl.as_secs()).unwrap_or(i64::MAX);
        let grant = self.timed(client.lease_grant(ttl_secs, None)).await?;
        let lease = grant.id();
        let (renewer, valid_until) = leadership_deadline(asked + self.ttl);
        let keeper = tokio::spawn(keep_alive(client.clone(), lease, self.ttl, renewer));
        let keeper = AbortOnDrop(Some(keeper));
        let won = client.campaign(self.name.as_str(), holder, lease).await?;
        let leader = won.leader().cloned().ok_or(EtcdError::NoLeaderKey)?;
        let token = u64::try_from(leader.rev()).unwrap_or(0);
        tracing::info!(election = %self.name, holder, token, "elected");
        Ok(Leadership {
            client,
            leader,
            lease,
            token,
            valid_until,
            keeper,
            request_timeout: self.request_timeout,
        })
    }

    /// The current leader's value, or `None` when nobody leads.
    pub async fn leader(&self) -> Result<Option<String>, EtcdError> {
        let mut client = self.client.clone();
        match self.timed(client.leader(self.name.as_str())).await {
            Ok(answer) => Ok(answer
                .kv()
                .map(|kv| String::from_utf8_lossy(kv.value()).into_owned())),
            // etcd answers "election: no leader" as an error.
            Err(EtcdError::Etcd(error)) if error.to_string().contains("no leader") => Ok(None),
            Err(error) => Err(error),
        }
    }

    /// Every leader's value from now on, in order, as etcd elects them or
    /// they proclaim a new one (the current leader's first). The stream
    /// starts at once; etcd answers it once there is a leader.
    pub fn observe(&self) -> BoxStream<'static, Result<String, EtcdError>> {
        let (sender, receiver) = tokio::sync::mpsc::channel(16);
        let mut client = self.client.clone();
        let name = self.name.clone();
        tokio::spawn(async move {
            let mut stream = match client.observe(name).await {
                Ok(stream) => stream,
                Err(error) => {
                    let _ = sender.send(Err(EtcdError::Etcd(error))).await;
                    return;
                }
            };
            loop {
                let next = match stream.message().await {
                    Ok(Some(answer)) => match answer.kv() {
                        Some(kv) => Ok(String::from_utf8_lossy(kv.value()).into_owned()),
                        None => continue,
                    },
                    Ok(None) => return,
                    Err(error) => Err(EtcdError::Etcd(error)),
                };
                let failed = next.is_err();
                // Ends when the observer is dropped, or after an error.
                if sender.send(next).await.is_err() || failed {
                    return;
                }
            }
        });
        futures_util::stream::unfold(receiver, |mut receiver| async move {
            receiver.recv().await.map(|item| (item, receiver))
        })
        .boxed()
    }

    /// Asks etcd for its status: the deep health check's ping.
    pub async fn ping(&self) -> Result<(), EtcdError> {
        let mut client = self.client.clone();
        self.timed(client.status()).await.map(drop)
    }

    async fn timed<T>(
        &self,
        request: impl Future<Output = Result<T, etcd_client::Error>>,
    ) -> Result<T, EtcdError> {
        timed(self.request_timeout, request).await
    }
}

async fn timed<T>(
    limit: Duration,
    request: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, EtcdError> {
    match tokio::time::timeout(limit, request).await {
        Ok(answer) => Ok(answer?),
        Err(_) => Err(EtcdError::Etcd(etcd_client::Error::IoError(
            std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer from etcd in time"),
        ))),
    }
}

/// Aborts the keep-alive task when the leadership (or a campaign in
/// progress) is dropped, so a process that stops caring stops renewing.
struct AbortOnDrop(Option<JoinHandle<()>>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// This process leads, for as long as [`is_leader`](Self::is_leader)
/// says. Dropping it stops the keep-alive: etcd ends the leadership when
/// the lease runs out; [`resign`](Self::resign) ends it at once.
pub struct Leadership {
    client: Client,
    leader: LeaderKey,
    lease: i64,
    token: u64,
    valid_until: LeadershipDeadline,
    keeper: AbortOnDrop,
    request_timeout: Duration,
}

impl std::fmt::Debug for Leadership {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leadership")
            .field("token", &self.token)
            .field("lease", &self.lease)
            .field("is_leader", &self.is_leader())
            .finish_non_exhaustive()
    }
}

impl Leadership {
    /// The fencing token: the create revision of the leader key, higher
    /// than every earlier leader's.
    pub fn token(&self) -> u64 {
        self.token
    }

    /// Whether this process still leads by its own clock: the last
    /// answered keep-alive was sent less than a TTL ago.
    pub fn is_leader(&self) -> bool {
        self.valid_until.is_live()
    }

    /// Resolves when leadership ends by this process's clock.
    pub async fn lost(&self) {
        self.valid_until.passed().await;
    }

    /// Announces a new value as the leader's, without another election.
    pub async fn proclaim(&self, value: &str) -> Result<(), EtcdError> {
        let mut client = self.client.clone();
        let options = ProclaimOptions::new().with_leader(self.leader.clone());
        timed(self.request_timeout, client.proclaim(value, Some(options)))
            .await
            .map(drop)
    }

    /// Ends the leadership now: the next campaign wins at once, and the
    /// lease is revoked.
    pub async fn resign(mut self) -> Result<(), EtcdError> {
        self.keeper = AbortOnDrop(None);
        let options = ResignOptions::new().with_leader(self.leader.clone());
        let mut client = self.client.clone();
        timed(self.request_timeout, client.resign(Some(options))).await?;
        timed(self.request_timeout, client.lease_revoke(self.lease)).await?;
        Ok(())
    }
}
