//! [`JobClient`]: the client half of asynchronous jobs (`POST` → `202` +
//! `Location` → poll → `303` → the result), as Keel's jobs server speaks it.
//!
//! - **submit once**: the `POST` carries an `Idempotency-Key` (a fresh one
//!   unless the request has its own), so the retries of a `POST` whose
//!   answer was lost return the same job instead of starting another;
//! - **poll honouring `Retry-After`**: the server says when to look again;
//!   without it the client waits its poll interval (1 s);
//! - **follow the `303`** to the result, whether the `reqwest::Client`
//!   follows redirects itself or not;
//! - **typed ends**: a failed job ([`JobError::Failed`], with the server's
//!   reason: asking succeeded, the job did not), a cancelled one, an
//!   expired one (`410`), an unknown one (`404`);
//! - **giving up waiting is not cancelling**: dropping the future of
//!   [`Job::wait`] (the caller's own timeout, a cancelled request) or a
//!   deadline that leaves no time to wait ends the *waiting* only; the job
//!   goes on, and [`Job::resume`] picks it up again later (another process
//!   may be the one that reads the result). Cancelling is a decision, and
//!   [`Job::cancel`] (`DELETE`) is the explicit call that makes it.
//!
//! Failures on the way (a restarting server, a `503`, a dropped connection)
//! are ridden out with the jittered delays of [`Reconnect`].

use std::time::Duration;

use http::{StatusCode, header};
use serde::Deserialize;

use crate::loop_error::{after_call_failure, after_failed_answer, after_garbage, read_body};
use crate::reconnect::{ReconnectState, sleep_until_within_deadline};
use crate::{HttpCallError, IdempotencyKey, LoopError, PropagatingClient, Reconnect};

/// How long the client waits between status polls when the server sent no
/// `Retry-After`: 1 s.
pub const DEFAULT_JOB_POLL_INTERVAL: Duration = Duration::from_secs(1);

/// How a job ended, when it did not end with its result.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum JobError {
    /// The job ran and failed; asking about it worked.
    #[error("the job failed: {error}")]
    Failed {
        /// The server's reason.
        error: String,
    },
    /// The job was cancelled (by this client or another).
    #[error("the job was cancelled")]
    Cancelled,
    /// The job, or its result, expired (`410 Gone`): submit it again.
    #[error("the job expired (410 Gone); submit it again")]
    Expired,
    /// The server does not know the job (`404`).
    #[error("the server does not know the job (404)")]
    NotFound,
    /// A cancel came after the job had finished (`409`).
    #[error("the job had already finished; there was nothing to cancel")]
    AlreadyFinished,
    /// The conversation with the server failed: see [`LoopError`].
    #[error(transparent)]
    Loop(#[from] LoopError),
}

/// Where a job is, from one look at its status URL.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum JobState {
    /// Queued or running; `retry_after` is when the server suggests to look
    /// again.
    Pending {
        /// `queued` or `running`.
        status: String,
        /// 0 to 100.
        progress: u8,
        /// The server's `Retry-After`.
        retry_after: Option<Duration>,
    },
    /// Done: the result is at this URL.
    Succeeded {
        /// The result's URL.
        result: reqwest::Url,
    },
}

/// Submits jobs and waits for their results. Cheap to clone.
///
/// ```no_run
/// use keel_client::{JobClient, PropagatingClient};
///
/// # async fn run() -> Result<(), keel_client::JobError> {
/// let client = PropagatingClient::new(reqwest::Client::new());
/// let jobs = JobClient::new(&client);
/// let job = jobs
///     .submit(client.inner().post("http://127.0.0.1:8080/reports").json(&serde_json::json!({"month": "2026-09"})))
///     .await?;
/// let report = job.wait().await?;
/// println!("{}", report.text().await.unwrap_or_default());
/// # Ok(()) }
/// ```
#[derive(Debug, Clone)]
pub struct JobClient {
    client: PropagatingClient,
    reconnect: Reconnect,
    poll_interval: Duration,
}

/// One submitted job.
#[derive(Debug, Clone)]
pub struct Job {
    jobs: JobClient,
    status_url: reqwest::Url,
}

#[derive(Debug, Deserialize)]
struct StatusBody {
    status: String,
    #[serde(default)]
    progress: u8,
    #[serde(default)]
    error: Option<String>,
}

impl JobClient {
    /// Jobs through `client`, with the default [`Reconnect`] and poll
    /// interval ([`DEFAULT_JOB_POLL_INTERVAL`]).
    pub fn new(client: &PropagatingClient) -> Self {
        Self {
            client: client.clone(),
            reconnect: Reconnect::new(),
            poll_interval: DEFAULT_JOB_POLL_INTERVAL,
        }
    }

    /// How failures on the way are ridden out.
    #[must_use]
    pub fn reconnect(mut self, reconnect: Reconnect) -> Self {
        self.reconnect = reconnect;
        self
    }

    /// The wait between polls when the server sends no `Retry-After`.
    #[must_use]
    pub fn poll_interval(mut self, interval: Duration) -> Self {
        self.poll_interval = interval;
        self
    }

    /// Sends the `POST` that starts a job (adding an `Idempotency-Key` if
    /// it has none), retrying it with the same key through failures (a
    /// streaming body, which cannot be sent twice, gets one attempt), and
    /// returns the job its `202` points at.
    ///
    /// # Errors
    ///
    /// [`JobError::Loop`]: a refusal (`400`, `422`…), an answer without
    /// `202` and `Location`, the deadline, or too many failures.
    pub async fn submit(&self, request: reqwest::RequestBuilder) -> Result<Job, JobError> {
        let mut request = request
            .build()
            .map_err(|source| LoopError::Call(HttpCallError::Invalid { source }))?;
        if !request.headers().contains_key("idempotency-key") {
            let key = IdempotencyKey::random();
            if let Ok(value) = key.as_str().parse() {
                request.headers_mut().insert("idempotency-key", value);
            }
        }
        let mut reconnect = self.reconnect.start();
        loop {
            reconnect.ready().await.map_err(LoopError::from)?;
            let Some(attempt) = request.try_clone() else {
                // A streaming body cannot be sent twice: one attempt only.
                let response = self
                    .client
                    .execute(request)
                    .await
                    .map_err(LoopError::Call)?;
                return Ok(self.accepted(&response)?);
            };
            match self.client.execute(attempt).await {
                Ok(response) => {
                    return self
                        .accepted(&response)
                        .map_err(|e| after_garbage(&mut reconnect, e).into());
                }
                Err(error) => after_call_failure(&mut reconnect, error)?,
            }
        }
    }

    fn accepted(&self, response: &reqwest::Response) -> Result<Job, LoopError> {
        if response.status() != StatusCode::ACCEPTED {
            return Err(LoopError::protocol(
                response.url(),
                format!("answered {} to the job's POST, not 202", response.status()),
            ));
        }
        let status_url = location(response)?;
        Ok(Job {
            jobs: self.clone(),
            status_url,
        })
    }
}

/// The `Location` of `response`, resolved against its URL.
fn location(response: &reqwest::Response) -> Result<reqwest::Url, LoopError> {
    let value = response
        .headers()
        .get(header::LOCATION)
        .and_then(|value| value.to_str().ok())
        .ok_or_else(|| LoopError::protocol(response.url(), "no Location header"))?;
    response
        .url()
        .join(value)
        .map_err(|error| LoopError::protocol(response.url(), format!("bad Location: {error}")))
}

impl Job {
    /// The job's status URL (from the `202`'s `Location`).
    pub fn status_url(&self) -> &reqwest::Url {
        &self.status_url
    }

    /// The job as submitted earlier: `status_url` is a saved
    /// [`status_url`](Self::status_url).
    pub fn resume(jobs: &JobClient, status_url: reqwest::Url) -> Self {
        Self {
            jobs: jobs.clone(),
            status_url,
        }
    }

    /// One look at the job's status (no retries, no cancellation).
    ///
    /// # Errors
    ///
    /// The job's end when it did not succeed ([`JobError::Failed`],
    /// [`Cancelled`](JobError::Cancelled), [`Expired`](JobError::Expired),
    /// [`NotFound`](JobError::NotFound)), or the call's failure.
    pub async fn status(&self) -> Result<JobState, JobError> {
        let mut reconnect = Reconnect::new().max_failures(1).start();
        self.look(&mut reconnect).await?.ok_or_else(|| {
            LoopError::GaveUp {
                failures: 1,
                last: "the connection failed while the status was read".into(),
            }
            .into()
        })
    }

    /// Polls until the job ends and returns the result's response.
    ///
    /// Dropping this future before the job ended, or the deadline leaving
    /// no time to wait, stops the waiting and nothing else: the job runs
    /// on (call [`cancel`](Self::cancel) to stop it).
    ///
    /// # Errors
    ///
    /// As [`status`](Self::status), after riding out failures.
    pub async fn wait(&self) -> Result<reqwest::Response, JobError> {
        let mut reconnect = self.jobs.reconnect.start();
        loop {
            reconnect.ready().await.map_err(LoopError::from)?;
            match self.look(&mut reconnect).await? {
                None => {}
                Some(JobState::Succeeded { result }) => {
                    return self.fetch_result(result, &mut reconnect).await;
                }
                Some(JobState::Pending { retry_after, .. }) => {
                    reconnect.succeeded();
                    let wait = retry_after.unwrap_or(self.jobs.poll_interval);
                    sleep_until_within_deadline(tokio::time::Instant::now() + wait)
                        .await
                        .map_err(LoopError::from)?;
                }
            }
        }
    }

    /// One status request: the state, or `None` for a failure to ride out
    /// (already counted in `reconnect`).
    async fn look(&self, reconnect: &mut ReconnectState) -> Result<Option<JobState>, JobError> {
        let client = &self.jobs.client;
        let request = client.inner().get(self.status_url.clone());
        let response = match client.send(request).await {
            Ok(response) => response,
            Err(error) => return ended(error, reconnect).map(|()| None),
        };
        if response.status() == StatusCode::SEE_OTHER {
            return Ok(Some(JobState::Succeeded {
                result: location(&response).map_err(|e| after_garbage(reconnect, e))?,
            }));
        }
        if response.url() != &self.status_url {
            // The client followed the 303 itself: this is the result.
            return Ok(Some(JobState::Succeeded {
                result: response.url().clone(),
            }));
        }
        let retry_after = crate::parse_retry_after(response.headers());
        let url = response.url().clone();
        let Some(body) = read_body(response).await? else {
            return Ok(after_failed_answer(reconnect).map(|()| None)?);
        };
        let body: StatusBody = serde_json::from_slice(&body).map_err(|error| {
            after_garbage(
                reconnect,
                LoopError::protocol(&url, format!("not a job status: {error}")),
            )
        })?;
        match body.status.as_str() {
            "queued" | "running" => Ok(Some(JobState::Pending {
                status: body.status,
                progress: body.progress,
                retry_after,
            })),
            "failed" => Err(JobError::Failed {
                error: body.error.unwrap_or_default(),
            }),
            "cancelled" => Err(JobError::Cancelled),
            other => Err(after_garbage(
                reconnect,
                LoopError::protocol(url, format!("a job status of {other:?} without a 303")),
            )
            .into()),
        }
    }

    async fn fetch_result(
        &self,
        result: reqwest::Url,
        reconnect: &mut ReconnectState,
    ) -> Result<reqwest::Response, JobError> {
        let client = &self.jobs.client;
        loop {
            match client.send(client.inner().get(result.clone())).await {
                Ok(response) => return Ok(response),
                Err(error) => ended(error, reconnect)?,
            }
            reconnect.ready().await.map_err(LoopError::from)?;
        }
    }

    /// Asks the server to cancel the job (`DELETE`). Cancelling a job that
    /// was cancelled before succeeds.
    ///
    /// # Errors
    ///
    /// [`JobError::AlreadyFinished`] when it had succeeded or failed, the
    /// job's absence, or the call's failure.
    pub async fn cancel(&self) -> Result<(), JobError> {
        let client = &self.jobs.client;
        let mut reconnect = self.jobs.reconnect.start();
        loop {
            reconnect.ready().await.map_err(LoopError::from)?;
            match client
                .send(client.inner().delete(self.status_url.clone()))
                .await
            {
                Ok(_) => return Ok(()),
                Err(error) if error.status() == Some(StatusCode::CONFLICT) => {
                    return Err(JobError::AlreadyFinished);
                }
                Err(error) => ended(error, &mut reconnect)?,
            }
        }
    }
}

/// A failed call about the job: its end (`404`, `410`), or the loop's rule.
fn ended(error: HttpCallError, reconnect: &mut ReconnectState) -> Result<(), JobError> {
    match error.status() {
        Some(StatusCode::NOT_FOUND) => Err(JobError::NotFound),
        Some(StatusCode::GONE) => Err(JobError::Expired),
        _ => Ok(after_call_failure(reconnect, error)?),
    }
}
