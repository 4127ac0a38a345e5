//! Receiving: pull new messages into the group's pending set, lease the
//! visible heads.

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use keel_store::broker::{BrokerError, Headers, Message};
use sqlx::Row;

use super::{Db, GroupRef, LeaseBatch, Leased, WriteTx, to_i64};
use crate::broker::clock::millis;
use crate::broker::error::db_error;

impl Db {
    /// Leases up to `max` deliverable messages of `group` for `lease`.
    pub(in crate::broker) async fn lease(
        &self,
        group: &GroupRef,
        max: usize,
        lease: Duration,
        pull_batch: u32,
    ) -> Result<LeaseBatch, BrokerError> {
        const OP: &str = "receive";
        let mut w = self.begin(OP).await?;
        let now = self.clock.now_ms();
        let until = now.saturating_add(millis(lease));
        let mut leased = lease_heads(&mut w, group.group_id, now, until, max).await?;
        let mut pulled = false;
        if leased.len() < max {
            let want = (max - leased.len()).max(usize::try_from(pull_batch).unwrap_or(256));
            pulled = pull(&mut w, group, want).await?;
            if pulled {
                let more =
                    lease_heads(&mut w, group.group_id, now, until, max - leased.len()).await?;
                leased.extend(more);
            }
        }
        let batch = if leased.is_empty() {
            LeaseBatch {
                leased: Vec::new(),
                next_visible_ms: next_visible(&mut w, group.group_id).await?,
                pulled,
            }
        } else {
            LeaseBatch {
                leased: load_messages(&mut w, group, leased).await?,
                next_visible_ms: None,
                pulled,
            }
        };
        w.commit(OP).await?;
        Ok(batch)
    }
}

/// When the group's next invisible head (leased or nacked) becomes visible.
async fn next_visible(w: &mut WriteTx, group_id: i64) -> Result<Option<i64>, BrokerError> {
    sqlx::query_scalar(
        "SELECT min(visible_at) FROM keel_broker_pending \
         INDEXED BY keel_broker_pending_heads WHERE group_id = ?1 AND head = 1",
    )
    .bind(group_id)
    .fetch_one(&mut *w.tx)
    .await
    .map_err(|e| db_error("receive", e))
}

/// Leases up to `max` visible heads of the group, in sequence order.
async fn lease_heads(
    w: &mut WriteTx,
    group_id: i64,
    now: i64,
    until: i64,
    max: usize,
) -> Result<Vec<(i64, i64)>, BrokerError> {
    if max == 0 {
        return Ok(Vec::new());
    }
    let rows = sqlx::query(
        "UPDATE keel_broker_pending \
         SET leased = 1, delivery_count = delivery_count + 1, visible_at = ?3 \
         WHERE group_id = ?1 AND seq IN ( \
             SELECT seq FROM keel_broker_pending INDEXED BY keel_broker_pending_heads \
             WHERE group_id = ?1 AND head = 1 AND visible_at <= ?2 \
             ORDER BY seq LIMIT ?4) \
         RETURNING seq, delivery_count",
    )
    .bind(group_id)
    .bind(now)
    .bind(until)
    .bind(to_i64(max))
    .fetch_all(&mut *w.tx)
    .await
    .map_err(|e| db_error("receive", e))?;
    let mut leased: Vec<(i64, i64)> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    leased.sort_unstable();
    Ok(leased)
}

/// Copies up to `want` messages published after the group's cursor into its
/// pending set. A copied message is a head when no earlier message of its key
/// is pending. Returns whether anything was copied.
async fn pull(w: &mut WriteTx, group: &GroupRef, want: usize) -> Result<bool, BrokerError> {
    let fail = |e| db_error("receive", e);
    let (pulled, last): (i64, Option<i64>) = sqlx::query_as(
        "SELECT g.pulled_seq, (SELECT max(seq) FROM (SELECT seq FROM keel_broker_messages \
                               WHERE topic_id = ?2 AND seq > g.pulled_seq ORDER BY seq LIMIT ?3)) \
         FROM keel_broker_groups g WHERE g.group_id = ?1",
    )
    .bind(group.group_id)
    .bind(group.topic.id)
    .bind(to_i64(want))
    .fetch_one(&mut *w.tx)
    .await
    .map_err(fail)?;
    let Some(last) = last else {
        return Ok(false);
    };
    // SQLite evaluates the whole SELECT before inserting when it reads the
    // target table, so the NOT EXISTS sees only rows pending before this
    // pull; `rn = 1` handles several messages of one key within it.
    sqlx::query(
        "INSERT INTO keel_broker_pending \
         (group_id, seq, msg_key, head, leased, visible_at, delivery_count) \
         SELECT ?1, n.seq, n.msg_key, \
                n.rn = 1 AND NOT EXISTS (SELECT 1 FROM keel_broker_pending e \
                                         WHERE e.group_id = ?1 AND e.msg_key = n.msg_key), \
                0, 0, 0 \
         FROM (SELECT seq, msg_key, \
                      row_number() OVER (PARTITION BY msg_key ORDER BY seq) AS rn \
               FROM keel_broker_messages \
               WHERE topic_id = ?2 AND seq > ?3 AND seq <= ?4) AS n",
    )
    .bind(group.group_id)
    .bind(group.topic.id)
    .bind(pulled)
    .bind(last)
    .execute(&mut *w.tx)
    .await
    .map_err(fail)?;
    sqlx::query("UPDATE keel_broker_groups SET pulled_seq = ?2 WHERE group_id = ?1")
        .bind(group.group_id)
        .bind(last)
        .execute(&mut *w.tx)
        .await
        .map_err(fail)?;
    Ok(true)
}

/// Reads the leased messages. A pending row whose message is gone (which
/// pruning never causes) is dropped rather than leased forever.
async fn load_messages(
    w: &mut WriteTx,
    group: &GroupRef,
    leased: Vec<(i64, i64)>,
) -> Result<Vec<Leased>, BrokerError> {
    let fail = |e| db_error("receive", e);
    let seqs = serde_json::to_string(&leased.iter().map(|(seq, _)| *seq).collect::<Vec<_>>())
        .unwrap_or_else(|_| "[]".to_owned());
    let rows = sqlx::query(
        "SELECT seq, message_id, msg_key, headers, payload, published_at FROM keel_broker_messages \
         WHERE seq IN (SELECT value FROM json_each(?1))",
    )
    .bind(seqs)
    .fetch_all(&mut *w.tx)
    .await
    .map_err(fail)?;
    let mut by_seq: HashMap<i64, (Message, i64)> = HashMap::with_capacity(rows.len());
    for row in rows {
        let headers_json: &str = row.get(3);
        let headers = serde_json::from_str::<Headers>(headers_json).unwrap_or_else(|error| {
            tracing::warn!(%error, "broker message with unreadable headers; delivering without them");
            Headers::new()
        });
        let payload: Vec<u8> = row.get(4);
        by_seq.insert(
            row.get(0),
            (
                Message {
                    id: row.get(1),
                    topic: group.topic.name.to_string(),
                    key: row.get(2),
                    headers,
                    payload: Bytes::from(payload),
                },
                row.get(5),
            ),
        );
    }
    let mut out = Vec::with_capacity(leased.len());
    for (seq, delivery_count) in leased {
        match by_seq.remove(&seq) {
            Some((message, published_at)) => out.push(Leased {
                seq,
                delivery_count,
                message,
                published_at,
            }),
            None => {
                tracing::warn!(seq, group = %group.name, "pending message vanished; dropping it");
                sqlx::query("DELETE FROM keel_broker_pending WHERE group_id = ?1 AND seq = ?2")
                    .bind(group.group_id)
                    .bind(seq)
                    .execute(&mut *w.tx)
                    .await
                    .map_err(fail)?;
            }
        }
    }
    Ok(out)
}
