//! Subscribing, and the groups that expire when idle: a member's reads keep
//! its group alive, the sweep deletes the groups nobody read for their
//! expiry and the expiring topics left with no group.

use std::sync::Arc;
use std::time::Duration;

use keel_store::broker::BrokerError;

use super::{Db, WriteTx};
use crate::broker::clock::millis;
use crate::broker::error::db_error;
use crate::broker::topics::Topic;

/// Deletes the unsettled messages of the expired groups (given now). A
/// member marks its group read at most every quarter of the expiry, so a
/// group is due a quarter later than `last_seen_at` alone says: never while
/// a member read it within its expiry.
const DELETE_EXPIRED_PENDING: &str = "\
DELETE FROM keel_broker_pending WHERE group_id IN (
    SELECT group_id FROM keel_broker_groups
     WHERE expire_after_ms IS NOT NULL AND last_seen_at + expire_after_ms + expire_after_ms / 4 <= ?1)";

const DELETE_EXPIRED_GROUPS: &str = "\
DELETE FROM keel_broker_groups
 WHERE expire_after_ms IS NOT NULL AND last_seen_at + expire_after_ms + expire_after_ms / 4 <= ?1";

/// The expiring topics whose last group is gone.
const ORPHANED_TOPICS: &str = "\
SELECT topic_id, name FROM keel_broker_topics t
 WHERE t.expiring = 1
   AND NOT EXISTS (SELECT 1 FROM keel_broker_groups g WHERE g.topic_id = t.topic_id)";

/// Topic ids that still have messages but no topic row: published by a
/// process that had a swept topic cached. A loose index scan of the log's
/// `(topic_id, seq)` index: one probe per distinct topic, not per message.
const ORPHANED_MESSAGE_TOPICS: &str = "\
WITH RECURSIVE ids(id) AS (
    SELECT min(topic_id) FROM keel_broker_messages
    UNION ALL
    SELECT (SELECT min(topic_id) FROM keel_broker_messages WHERE topic_id > ids.id)
      FROM ids WHERE ids.id IS NOT NULL)
SELECT id FROM ids
 WHERE id IS NOT NULL AND id NOT IN (SELECT topic_id FROM keel_broker_topics)";

impl Db {
    /// The topic `name` and the id of its group `group`, both created if
    /// needed, in one transaction (so a sweep never deletes a new expiring
    /// topic before its group exists). A topic created here for an
    /// expiring group is itself expiring. Subscribing again refreshes the
    /// group's expiry and marks it seen.
    pub(in crate::broker) async fn subscribe(
        &self,
        name: &str,
        group: &str,
        expire_after: Option<Duration>,
    ) -> Result<(Arc<Topic>, i64), BrokerError> {
        const OP: &str = "subscribe";
        let mut w = self.begin(OP).await?;
        let ids = create_group(&mut w, name, group, expire_after, self.clock.now_ms())
            .await
            .map_err(|e| db_error(OP, e))?;
        w.commit(OP).await?;
        let (topic_id, group_id) = ids;
        if self.topics.get(name).is_some_and(|t| t.id != topic_id) {
            // Swept and created again since this process cached it.
            self.topics.remove(name);
        }
        Ok((self.topics.insert(name, topic_id), group_id))
    }

    /// Marks an expiring group as read now. `false` when the group no longer
    /// exists: a sweep found it idle for longer than its expiry.
    pub(in crate::broker) async fn touch(&self, group_id: i64) -> Result<bool, BrokerError> {
        let _gate = self.gate.clone().lock_owned().await;
        let done =
            sqlx::query("UPDATE keel_broker_groups SET last_seen_at = ?2 WHERE group_id = ?1")
                .bind(group_id)
                .bind(self.clock.now_ms())
                .execute(&self.pool)
                .await
                .map_err(|e| db_error("touch group", e))?;
        Ok(done.rows_affected() > 0)
    }

    /// Deletes the expired groups with their unsettled messages, then the
    /// expiring topics they leave without a group, with their messages.
    /// Returns how many groups and topics it deleted.
    pub(in crate::broker) async fn sweep_expired(&self) -> Result<u64, BrokerError> {
        const OP: &str = "sweep expired groups";
        let mut w = self.begin(OP).await?;
        let swept = sweep(&mut w, self.clock.now_ms())
            .await
            .map_err(|e| db_error(OP, e))?;
        w.commit(OP).await?;
        for name in &swept.topics {
            if let Some(topic) = self.topics.remove(name) {
                topic.changed.notify_waiters();
            }
        }
        Ok(swept.groups + swept.topics.len() as u64)
    }

    /// Expires `group` of `topic` at once and sweeps.
    pub(in crate::broker) async fn remove_group(
        &self,
        topic: &str,
        group: &str,
    ) -> Result<u64, BrokerError> {
        {
            let _gate = self.gate.clone().lock_owned().await;
            sqlx::query(
                "UPDATE keel_broker_groups SET expire_after_ms = 0, last_seen_at = 0 \
                 WHERE name = ?2 AND topic_id = \
                       (SELECT topic_id FROM keel_broker_topics WHERE name = ?1)",
            )
            .bind(topic)
            .bind(group)
            .execute(&self.pool)
            .await
            .map_err(|e| db_error("remove group", e))?;
        }
        self.sweep_expired().await
    }
}

async fn create_group(
    w: &mut WriteTx,
    name: &str,
    group: &str,
    expire_after: Option<Duration>,
    now_ms: i64,
) -> Result<(i64, i64), sqlx::Error> {
    sqlx::query(
        "INSERT INTO keel_broker_topics (name, expiring) VALUES (?1, ?2) \
         ON CONFLICT (name) DO NOTHING",
    )
    .bind(name)
    .bind(expire_after.is_some())
    .execute(&mut *w.tx)
    .await?;
    let topic_id: i64 =
        sqlx::query_scalar("SELECT topic_id FROM keel_broker_topics WHERE name = ?1")
            .bind(name)
            .fetch_one(&mut *w.tx)
            .await?;
    let expire_ms = expire_after.map(millis);
    let group_id: i64 = sqlx::query_scalar(
        "INSERT INTO keel_broker_groups \
             (topic_id, name, pulled_seq, created_at, expire_after_ms, last_seen_at) \
         VALUES (?1, ?2, 0, ?3, ?4, ?3) \
         ON CONFLICT (topic_id, name) DO UPDATE \
             SET expire_after_ms = excluded.expire_after_ms, last_seen_at = excluded.last_seen_at \
         RETURNING group_id",
    )
    .bind(topic_id)
    .bind(group)
    .bind(now_ms)
    .bind(expire_ms)
    .fetch_one(&mut *w.tx)
    .await?;
    Ok((topic_id, group_id))
}

/// What one sweep deleted.
struct Swept {
    groups: u64,
    topics: Vec<String>,
}

async fn sweep(w: &mut WriteTx, now_ms: i64) -> Result<Swept, sqlx::Error> {
    sqlx::query(DELETE_EXPIRED_PENDING)
        .bind(now_ms)
        .execute(&mut *w.tx)
        .await?;
    let groups = sqlx::query(DELETE_EXPIRED_GROUPS)
        .bind(now_ms)
        .execute(&mut *w.tx)
        .await?
        .rows_affected();
    let orphaned: Vec<(i64, String)> = sqlx::query_as(ORPHANED_TOPICS)
        .fetch_all(&mut *w.tx)
        .await?;
    for (topic_id, _) in &orphaned {
        sqlx::query("DELETE FROM keel_broker_topics WHERE topic_id = ?1")
            .bind(topic_id)
            .execute(&mut *w.tx)
            .await?;
    }
    let stray: Vec<i64> = sqlx::query_scalar(ORPHANED_MESSAGE_TOPICS)
        .fetch_all(&mut *w.tx)
        .await?;
    for topic_id in stray {
        sqlx::query("DELETE FROM keel_broker_messages WHERE topic_id = ?1")
            .bind(topic_id)
            .execute(&mut *w.tx)
            .await?;
    }
    Ok(Swept {
        groups,
        topics: orphaned.into_iter().map(|(_, name)| name).collect(),
    })
}
