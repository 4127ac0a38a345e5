//! Settling leases by token: acks and terminates delete, nacks and
//! extensions update; a stale token matches nothing.

use std::collections::HashSet;

use keel_store::broker::BrokerError;
use sqlx::Row;
use sqlx::sqlite::Sqlite;

use super::{Db, SettleAction, SettleRequest};
use crate::broker::clock::millis;
use crate::broker::error::db_error;

impl Db {
    /// Applies settles atomically: at most two statements (the acks and
    /// terminates as one delete, the nacks and extensions as one update),
    /// in a transaction only when both are needed. For each request: whether
    /// its lease was still held (and so whether it took effect).
    pub(in crate::broker) async fn settle(
        &self,
        requests: &[&SettleRequest],
    ) -> Result<Vec<bool>, BrokerError> {
        const OP: &str = "settle";
        let now = self.clock.now_ms();
        let mut finishing = Vec::new();
        let mut updating = Vec::new();
        for r in requests {
            match r.action {
                SettleAction::Ack | SettleAction::Terminate => {
                    finishing.push([r.group_id, r.seq, r.lease_token]);
                }
                SettleAction::Nack(delay) => {
                    updating.push([
                        r.group_id,
                        r.seq,
                        r.lease_token,
                        0,
                        now.saturating_add(millis(delay)),
                    ]);
                }
                SettleAction::Extend(lease) => {
                    updating.push([
                        r.group_id,
                        r.seq,
                        r.lease_token,
                        1,
                        now.saturating_add(millis(lease)),
                    ]);
                }
            }
        }
        let mut held = HashSet::new();
        if !finishing.is_empty() && !updating.is_empty() {
            let mut w = self.begin(OP).await?;
            held.extend(
                finish_leases(&mut *w.tx, &finishing)
                    .await
                    .map_err(|e| db_error(OP, e))?,
            );
            held.extend(
                update_leases(&mut *w.tx, &updating)
                    .await
                    .map_err(|e| db_error(OP, e))?,
            );
            w.commit(OP).await?;
        } else {
            let _gate = self.gate.clone().lock_owned().await;
            let done = if finishing.is_empty() {
                update_leases(&self.pool, &updating).await
            } else {
                finish_leases(&self.pool, &finishing).await
            };
            held.extend(done.map_err(|e| db_error(OP, e))?);
        }
        Ok(requests
            .iter()
            .map(|r| held.contains(&(r.group_id, r.seq, r.lease_token)))
            .collect())
    }
}

/// Deletes the pending rows of `[group_id, seq, lease_token]` leases that
/// are still held (the promote trigger moves each key's head on). Returns
/// the (group, seq, lease token) triples that matched.
async fn finish_leases<'e, E>(
    executor: E,
    leases: &[[i64; 3]],
) -> Result<Vec<(i64, i64, i64)>, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = Sqlite>,
{
    let rows = sqlx::query(
        "DELETE FROM keel_broker_pending \
         WHERE leased = 1 AND (group_id, seq, delivery_count) IN \
               (SELECT value ->> 0, value ->> 1, value ->> 2 FROM json_each(?1)) \
         RETURNING group_id, seq, delivery_count",
    )
    .bind(serde_json::to_string(leases).unwrap_or_else(|_| "[]".to_owned()))
    .fetch_all(executor)
    .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect())
}

/// Nacks (`leased` 0) or extends (`leased` 1) the still-held leases of
/// `[group_id, seq, lease_token, leased, visible_at]`. Returns the
/// (group, seq, lease token) triples that matched.
async fn update_leases<'e, E>(
    executor: E,
    leases: &[[i64; 5]],
) -> Result<Vec<(i64, i64, i64)>, sqlx::Error>
where
    E: sqlx::Executor<'e, Database = Sqlite>,
{
    let rows = sqlx::query(
        "UPDATE keel_broker_pending SET leased = j.leased, visible_at = j.visible_at \
         FROM (SELECT value ->> 0 AS group_id, value ->> 1 AS seq, value ->> 2 AS token, \
                      value ->> 3 AS leased, value ->> 4 AS visible_at \
               FROM json_each(?1)) AS j \
         WHERE keel_broker_pending.group_id = j.group_id AND keel_broker_pending.seq = j.seq \
           AND keel_broker_pending.delivery_count = j.token AND keel_broker_pending.leased = 1 \
         RETURNING group_id, seq, delivery_count",
    )
    .bind(serde_json::to_string(leases).unwrap_or_else(|_| "[]".to_owned()))
    .fetch_all(executor)
    .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect())
}
