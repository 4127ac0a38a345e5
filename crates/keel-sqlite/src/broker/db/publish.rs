//! Appending to the log: multi-row inserts, deduped on (topic, message id).

use std::sync::OnceLock;

use keel_store::broker::{BrokerError, Message};
use sqlx::sqlite::Sqlite;

use super::Db;
use crate::broker::error::db_error;

/// The most rows one insert statement carries (6 parameters each).
const MAX_INSERT_ROWS: usize = 256;

/// The multi-row insert for `rows` rows, a power of two up to
/// [`MAX_INSERT_ROWS`]: a batch is padded up to the next size by repeating
/// its last row, which the dedupe index then drops. So at most nine
/// statements are ever prepared, and a batch of up to 256 messages is one
/// statement: atomic on its own, with no BEGIN and COMMIT round trips.
fn insert_sql(rows: usize) -> &'static str {
    static SQL: OnceLock<Vec<String>> = OnceLock::new();
    let all = SQL.get_or_init(|| {
        (0..=MAX_INSERT_ROWS.trailing_zeros())
            .map(|power| {
                let values = vec!["(?, ?, ?, ?, ?, ?)"; 1 << power].join(", ");
                format!(
                    "INSERT INTO keel_broker_messages \
                     (topic_id, message_id, msg_key, headers, payload, published_at) \
                     VALUES {values} ON CONFLICT (topic_id, message_id) DO NOTHING"
                )
            })
            .collect()
    });
    let power = rows
        .next_power_of_two()
        .min(MAX_INSERT_ROWS)
        .trailing_zeros();
    &all[power as usize]
}

impl Db {
    /// Appends `messages` (each with its topic id) atomically. Returns how
    /// many were new; the rest were duplicates of ids already on their topic.
    pub(in crate::broker) async fn publish(
        &self,
        messages: &[(i64, &Message)],
    ) -> Result<u64, BrokerError> {
        const OP: &str = "publish";
        let headers = messages
            .iter()
            .map(|(_, m)| serde_json::to_string(&m.headers))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| BrokerError::Invalid(format!("headers do not serialize: {e}")))?;
        let rows = PublishRows {
            messages,
            headers: &headers,
            published_at: self.clock.now_ms(),
        };
        if messages.len() <= MAX_INSERT_ROWS {
            let _gate = self.gate.clone().lock_owned().await;
            return rows
                .insert(&self.pool, 0..messages.len())
                .await
                .map_err(|e| db_error(OP, e));
        }
        let mut w = self.begin(OP).await?;
        let mut inserted = 0;
        for start in (0..messages.len()).step_by(MAX_INSERT_ROWS) {
            let end = (start + MAX_INSERT_ROWS).min(messages.len());
            inserted += rows
                .insert(&mut *w.tx, start..end)
                .await
                .map_err(|e| db_error(OP, e))?;
        }
        w.commit(OP).await?;
        Ok(inserted)
    }
}

/// A publish batch, ready to bind.
struct PublishRows<'a> {
    messages: &'a [(i64, &'a Message)],
    headers: &'a [String],
    published_at: i64,
}

impl PublishRows<'_> {
    /// Inserts `range` (at most [`MAX_INSERT_ROWS`]) in one statement,
    /// padded with copies of its last row. Returns the rows inserted.
    async fn insert<'e, E>(
        &self,
        executor: E,
        range: std::ops::Range<usize>,
    ) -> Result<u64, sqlx::Error>
    where
        E: sqlx::Executor<'e, Database = Sqlite>,
    {
        let size = range.len().next_power_of_two();
        let mut query = sqlx::query(insert_sql(size));
        for slot in 0..size {
            let i = (range.start + slot).min(range.end - 1);
            let (topic_id, message) = self.messages[i];
            query = query
                .bind(topic_id)
                .bind(message.id.as_str())
                .bind(message.key.as_str())
                .bind(self.headers[i].as_str())
                .bind(message.payload.as_ref())
                .bind(self.published_at);
        }
        Ok(query.execute(executor).await?.rows_affected())
    }
}
