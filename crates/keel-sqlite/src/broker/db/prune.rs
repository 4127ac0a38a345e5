//! Retention: delete what every group settled, oldest first, in bounded
//! batches.

use keel_store::broker::BrokerError;

use super::{Db, PruneOutcome, WriteTx};
use crate::broker::error::db_error;

impl Db {
    /// Deletes, per topic, up to `batch` messages that every group of the
    /// topic has settled and that were published before `cutoff_ms`.
    pub(in crate::broker) async fn prune(
        &self,
        batch: u32,
        cutoff_ms: i64,
    ) -> Result<PruneOutcome, BrokerError> {
        const OP: &str = "prune";
        let topic_ids: Vec<i64> = sqlx::query_scalar("SELECT topic_id FROM keel_broker_topics")
            .fetch_all(&self.pool)
            .await
            .map_err(|e| db_error(OP, e))?;
        let mut outcome = PruneOutcome::default();
        for topic_id in topic_ids {
            let mut w = self.begin(OP).await?;
            let deleted = prune_topic(&mut w, topic_id, batch, cutoff_ms)
                .await
                .map_err(|e| db_error(OP, e))?;
            w.commit(OP).await?;
            outcome.deleted += deleted;
            outcome.more |= deleted >= u64::from(batch);
        }
        Ok(outcome)
    }
}

/// Deletes up to `batch` of the topic's oldest messages that lie below every
/// group's ack floor (the lowest sequence the group still has pending, or
/// its cursor) and were published before `cutoff_ms`.
async fn prune_topic(
    w: &mut WriteTx,
    topic_id: i64,
    batch: u32,
    cutoff_ms: i64,
) -> Result<u64, sqlx::Error> {
    let floor: Option<i64> = sqlx::query_scalar(
        "SELECT min(coalesce((SELECT min(p.seq) FROM keel_broker_pending p \
                              WHERE p.group_id = g.group_id), g.pulled_seq + 1)) \
         FROM keel_broker_groups g WHERE g.topic_id = ?1",
    )
    .bind(topic_id)
    .fetch_one(&mut *w.tx)
    .await?;
    let done = sqlx::query(
        "DELETE FROM keel_broker_messages WHERE seq IN ( \
             SELECT seq FROM (SELECT seq, published_at FROM keel_broker_messages \
                              WHERE topic_id = ?1 AND seq < ?2 ORDER BY seq LIMIT ?3) \
             WHERE published_at < ?4)",
    )
    .bind(topic_id)
    .bind(floor.unwrap_or(i64::MAX))
    .bind(i64::from(batch))
    .bind(cutoff_ms)
    .execute(&mut *w.tx)
    .await?;
    Ok(done.rows_affected())
}
