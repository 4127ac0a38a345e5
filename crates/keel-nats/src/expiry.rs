//! Expiring groups on JetStream: the server deletes an idle consumer by
//! itself (`inactive_threshold`); a stream created for expiring groups says
//! so in its metadata, and the sweep deletes it once it has no consumer and
//! nothing was published to it for its expiry, with its key cursors.

use std::time::{Duration, UNIX_EPOCH};

use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::stream::{self, ConsumerErrorKind};
use futures_util::TryStreamExt;
use keel_store::broker::BrokerError;

use crate::NatsBroker;
use crate::error::unavailable;

/// The stream metadata entry of a topic created for expiring groups: the
/// groups' expiry, in milliseconds.
pub(crate) const EXPIRES_AFTER_MS: &str = "keel-expire-after-idle-ms";

/// The expiry recorded on a stream, if it was created for expiring groups.
fn expiry_of(config: &stream::Config) -> Option<Duration> {
    let ms = config.metadata.get(EXPIRES_AFTER_MS)?.parse().ok()?;
    Some(Duration::from_millis(ms))
}

/// Whether an expiring stream is due: no consumer, and neither created nor
/// published to within its expiry.
fn is_due(info: &stream::Info, idle: Duration) -> bool {
    let now = keel_core::clock::system_now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i128::try_from(d.as_nanos()).unwrap_or(i128::MAX));
    let last = info
        .created
        .unix_timestamp_nanos()
        .max(info.state.last_timestamp.unix_timestamp_nanos());
    let idle = i128::try_from(idle.as_nanos()).unwrap_or(i128::MAX);
    info.state.consumer_count == 0 && now.saturating_sub(last) >= idle
}

impl NatsBroker {
    /// Deletes this broker's expiring streams that are due (see
    /// [`is_due`]); returns how many.
    pub(crate) async fn sweep_streams(&self) -> Result<u64, BrokerError> {
        let prefix = format!("{}_", self.options().stream_prefix);
        let infos: Vec<stream::Info> = self
            .context()
            .streams()
            .try_collect()
            .await
            .map_err(|e| unavailable("listing streams", e))?;
        let mut swept = 0;
        for info in infos {
            let Some(topic_token) = info.config.name.strip_prefix(&prefix) else {
                continue;
            };
            if expiry_of(&info.config).is_some_and(|idle| is_due(&info, idle)) {
                self.delete_topic(&info.config.name, topic_token).await?;
                swept += 1;
            }
        }
        Ok(swept)
    }

    /// Deletes a group's consumer and key cursors, then its stream when that
    /// was created for expiring groups and has no consumer left.
    pub(crate) async fn delete_group(
        &self,
        stream_name: &str,
        topic_token: &str,
        group_token: &str,
    ) -> Result<(), BrokerError> {
        let stream = match self.context().get_stream(stream_name).await {
            Ok(stream) => stream,
            Err(e) if stream_not_found(&e) => return Ok(()),
            Err(e) => return Err(unavailable("opening a stream to remove a group", e)),
        };
        if let Err(e) = stream.delete_consumer(group_token).await
            && !matches!(e.kind(), ConsumerErrorKind::JetStream(j) if j.error_code() == ErrorCode::CONSUMER_NOT_FOUND)
        {
            return Err(unavailable("deleting a consumer group", e));
        }
        self.purge_cursors(&format!("{topic_token}.{group_token}.>"))
            .await?;
        let mut stream = stream;
        let info = stream
            .info()
            .await
            .map_err(|e| unavailable("reading a stream's consumers", e))?;
        if expiry_of(&info.config).is_some() && info.state.consumer_count == 0 {
            self.delete_topic(stream_name, topic_token).await?;
        }
        Ok(())
    }

    async fn delete_topic(&self, stream_name: &str, topic_token: &str) -> Result<(), BrokerError> {
        match self.context().delete_stream(stream_name).await {
            Ok(_) => {}
            Err(e) if stream_not_found(&e) => {}
            Err(e) => return Err(unavailable("deleting an expired stream", e)),
        }
        self.forget_stream(stream_name);
        self.purge_cursors(&format!("{topic_token}.>")).await?;
        tracing::debug!(stream = stream_name, "deleted an expired topic's stream");
        Ok(())
    }

    /// Deletes the key cursors matching `filter` (a key pattern).
    async fn purge_cursors(&self, filter: &str) -> Result<(), BrokerError> {
        let store = self.cursor_store().await?;
        store
            .stream
            .purge()
            .filter(format!("{}{filter}", store.prefix))
            .await
            .map_err(|e| unavailable("purging a group's key cursors", e))?;
        Ok(())
    }
}

/// A stream that is already gone is what a sweep wanted: another process
/// (or an earlier pass) swept it first.
fn stream_not_found(e: &async_nats::jetstream::context::GetStreamError) -> bool {
    matches!(e.kind(), GetStreamErrorKind::JetStream(j) if j.error_code() == ErrorCode::STREAM_NOT_FOUND)
}
