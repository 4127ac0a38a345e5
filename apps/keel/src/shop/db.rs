//! The shop's business tables, behind [`ShopDb`], in the same database as
//! Keel's store.
//!
//! They share the database so that the order row and its outbox row, or the
//! inbox row and the saga it starts, commit in one transaction. The SQL is
//! plain and portable (no SQLite-only syntax beyond `AUTOINCREMENT` in the
//! schema), so a PostgreSQL implementation is the same statements with
//! `$n` placeholders.
//!
//! The dependencies' own tables live here too: `shop_stock` (inventory
//! levels) and `shop_effects`, the ledger of every effect a dependency
//! applied (captures, refunds, reservations, releases, shipments,
//! receipts), unique per idempotency key: that uniqueness is what makes a
//! retried capture charge once. `shop_tombstones` holds the action keys a
//! compensation undid (a refund the capture's key, a release the
//! reservation's), written in the compensation's transaction even when
//! there was nothing to undo: an action that arrives later under a
//! tombstoned key is refused, so a request held up in the network cannot
//! charge after its refund. A saga's dependencies must all do this; see
//! `StepContext::action_key`.

use async_trait::async_trait;
use keel_messaging::StoreError;
use keel_messaging::store::Store;
use keel_sqlite::SqliteStore;
use sqlx::Row;

use super::model::{DemoFault, Item, Order, OrderStatus};

/// An order whose fulfilment reached a new state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settled {
    /// The order.
    pub order_id: String,
    /// Its customer (the event-log stream).
    pub customer_id: String,
    /// Its new status.
    pub status: OrderStatus,
}

/// The outcome of a stock reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reservation {
    /// Reserved now, or already by an earlier call with the same key.
    Reserved,
    /// Not enough of this sku: nothing was reserved.
    OutOfStock(String),
    /// The key was released (tombstoned) before this request arrived: a
    /// late request, refused so it cannot land after its undo.
    Undone,
}

/// The outcome of a capture.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Capture {
    /// Charged now (`true`), or already by an earlier call with the same
    /// key (`false`).
    Charged(bool),
    /// The key was refunded (tombstoned) before this request arrived: a
    /// late request, refused so it cannot charge after its refund.
    Undone,
}

/// One effect a dependency applied, in the order they committed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Effect {
    /// The order (and saga) it belongs to.
    pub order_id: String,
    /// The saga step.
    pub step: String,
    /// Whether it undoes the step.
    pub compensation: bool,
    /// Money moved, in cents (captures and refunds), else 0.
    pub amount_cents: i64,
}

/// An order as the invariant check sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditOrder {
    /// The order id.
    pub id: String,
    /// The id of its `orders.placed` event.
    pub event_id: String,
    /// Its total.
    pub total_cents: i64,
    /// Its status.
    pub status: OrderStatus,
}

/// Everything the invariant check reads back from the database.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Audit {
    /// Every order.
    pub orders: Vec<AuditOrder>,
    /// `(event id, handler)` of every applied event, in commit order.
    pub applied: Vec<(String, String)>,
    /// Event ids of published outbox rows.
    pub published: Vec<String>,
    /// Event ids of outbox rows not yet published.
    pub unpublished: u64,
    /// Every dependency effect, in commit order.
    pub effects: Vec<Effect>,
    /// `(saga id, status)` of every saga.
    pub sagas: Vec<(String, String)>,
}

/// The shop's SQL. Implemented for [`SqliteStore`]; a PostgreSQL store
/// implements the same methods.
#[async_trait]
pub trait ShopDb: Store {
    /// Connections free in the store's pool (readiness: pool exhaustion).
    fn connections_free(&self) -> usize;
    /// Creates the shop's tables if missing.
    async fn migrate_shop(&self) -> Result<(), StoreError>;
    /// Inserts an accepted order in the caller's transaction.
    async fn insert_order(
        &self,
        tx: &mut Self::Tx,
        order: &Order,
        event_id: &str,
        fault: Option<DemoFault>,
    ) -> Result<(), StoreError>;
    /// One order.
    async fn order(&self, id: &str) -> Result<Option<Order>, StoreError>;
    /// The order whose `orders.placed` event has this id.
    async fn order_by_event(&self, event_id: &str) -> Result<Option<Order>, StoreError>;
    /// Up to `limit` orders with ids after `after`, oldest first,
    /// optionally of one customer.
    async fn orders_after(
        &self,
        after: Option<&str>,
        customer: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Order>, StoreError>;
    /// Orders counted by status.
    async fn order_counts(&self) -> Result<Vec<(OrderStatus, u64)>, StoreError>;
    /// Records, in the consumer's transaction, that `handler` applied
    /// `event_id` (the fact the "applied once" invariant is checked on).
    async fn record_applied(
        &self,
        tx: &mut Self::Tx,
        event_id: &str,
        handler: &str,
    ) -> Result<(), StoreError>;
    /// Moves orders whose saga reached a new state to that state, in `tx`.
    async fn settle_orders(
        &self,
        tx: &mut Self::Tx,
        limit: usize,
    ) -> Result<Vec<Settled>, StoreError>;
    /// Stocks the skus not stocked yet; never resets a level, so a restart
    /// keeps what orders reserved.
    async fn seed_stock(&self, stock: &[(String, i64)]) -> Result<(), StoreError>;
    /// Records a capture under `key`, unless a refund tombstoned the key.
    async fn capture(&self, key: &str, order_id: &str, amount: i64) -> Result<Capture, StoreError>;
    /// Refunds the order's capture, if there was one, under `key`, and
    /// tombstones the capture's key `action_key` in the same transaction
    /// (also when there was nothing to refund: the capture may be late).
    async fn refund(&self, key: &str, order_id: &str, action_key: &str)
    -> Result<bool, StoreError>;
    /// Reserves the items under `key`, all or nothing, unless a release
    /// tombstoned the key.
    async fn reserve(
        &self,
        key: &str,
        order_id: &str,
        items: &[Item],
    ) -> Result<Reservation, StoreError>;
    /// Releases the order's reservation, if there was one, under `key`, and
    /// tombstones the reservation's key `action_key`.
    async fn release(
        &self,
        key: &str,
        order_id: &str,
        action_key: &str,
    ) -> Result<bool, StoreError>;
    /// Records a plain effect (shipment, receipt) under `key`.
    async fn record_effect(
        &self,
        key: &str,
        order_id: &str,
        step: &str,
    ) -> Result<bool, StoreError>;
    /// Reads back everything the invariant check needs.
    async fn audit(&self) -> Result<Audit, StoreError>;
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS shop_orders (
    id          TEXT    PRIMARY KEY,
    customer_id TEXT    NOT NULL,
    currency    TEXT    NOT NULL,
    items       TEXT    NOT NULL,
    total_cents INTEGER NOT NULL,
    status      TEXT    NOT NULL,
    event_id    TEXT    NOT NULL UNIQUE,
    demo_fault  TEXT,
    created_at  TEXT    NOT NULL
);
CREATE INDEX IF NOT EXISTS shop_orders_customer ON shop_orders (customer_id, id);
CREATE INDEX IF NOT EXISTS shop_orders_status ON shop_orders (status);
CREATE TABLE IF NOT EXISTS shop_applied (
    seq      INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id TEXT    NOT NULL,
    handler  TEXT    NOT NULL
);
CREATE TABLE IF NOT EXISTS shop_stock (
    sku       TEXT    PRIMARY KEY,
    available INTEGER NOT NULL CHECK (available >= 0)
);
CREATE TABLE IF NOT EXISTS shop_effects (
    seq          INTEGER PRIMARY KEY AUTOINCREMENT,
    idem_key     TEXT    NOT NULL UNIQUE,
    order_id     TEXT    NOT NULL,
    step         TEXT    NOT NULL,
    compensation INTEGER NOT NULL,
    amount_cents INTEGER NOT NULL,
    detail       TEXT    NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS shop_effects_order ON shop_effects (order_id, step);
CREATE TABLE IF NOT EXISTS shop_tombstones (
    idem_key  TEXT PRIMARY KEY,
    undone_by TEXT NOT NULL
);
";

fn db(err: sqlx::Error) -> StoreError {
    StoreError::other(err)
}

fn order_from_row(row: &sqlx::sqlite::SqliteRow) -> Result<Order, StoreError> {
    let items: String = row.try_get("items").map_err(db)?;
    let status: String = row.try_get("status").map_err(db)?;
    Ok(Order {
        id: row.try_get("id").map_err(db)?,
        customer_id: row.try_get("customer_id").map_err(db)?,
        currency: row.try_get("currency").map_err(db)?,
        items: serde_json::from_str(&items).map_err(StoreError::other)?,
        total_cents: row.try_get("total_cents").map_err(db)?,
        status: OrderStatus::parse(&status)
            .ok_or_else(|| StoreError::other(format!("unknown order status `{status}`")))?,
        created_at: row.try_get("created_at").map_err(db)?,
    })
}

const ORDER_COLUMNS: &str = "id, customer_id, currency, items, total_cents, status, created_at";

async fn insert_effect(
    conn: &mut sqlx::SqliteConnection,
    key: &str,
    order_id: &str,
    step: &str,
    compensation: bool,
    amount: i64,
) -> Result<bool, StoreError> {
    let done = sqlx::query(
        "INSERT INTO shop_effects (idem_key, order_id, step, compensation, amount_cents)
         VALUES (?, ?, ?, ?, ?) ON CONFLICT (idem_key) DO NOTHING",
    )
    .bind(key)
    .bind(order_id)
    .bind(step)
    .bind(compensation)
    .bind(amount)
    .execute(conn)
    .await
    .map_err(db)?;
    Ok(done.rows_affected() == 1)
}

async fn key_used(conn: &mut sqlx::SqliteConnection, key: &str) -> Result<bool, StoreError> {
    let row = sqlx::query("SELECT 1 FROM shop_effects WHERE idem_key = ?")
        .bind(key)
        .fetch_optional(conn)
        .await
        .map_err(db)?;
    Ok(row.is_some())
}

/// Tombstones `action_key` (undone by `key`); idempotent.
async fn tombstone(
    conn: &mut sqlx::SqliteConnection,
    action_key: &str,
    key: &str,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO shop_tombstones (idem_key, undone_by) VALUES (?, ?)
         ON CONFLICT (idem_key) DO NOTHING",
    )
    .bind(action_key)
    .bind(key)
    .execute(conn)
    .await
    .map_err(db)?;
    Ok(())
}

async fn tombstoned(conn: &mut sqlx::SqliteConnection, key: &str) -> Result<bool, StoreError> {
    let row = sqlx::query("SELECT 1 FROM shop_tombstones WHERE idem_key = ?")
        .bind(key)
        .fetch_optional(conn)
        .await
        .map_err(db)?;
    Ok(row.is_some())
}

/// The effect of `step`'s action for `order_id`, if it happened: its amount.
async fn action_amount(
    conn: &mut sqlx::SqliteConnection,
    order_id: &str,
    step: &str,
) -> Result<Option<i64>, StoreError> {
    let row = sqlx::query(
        "SELECT amount_cents FROM shop_effects WHERE order_id = ? AND step = ? AND compensation = 0",
    )
    .bind(order_id)
    .bind(step)
    .fetch_optional(conn)
    .await
    .map_err(db)?;
    row.map(|r| r.try_get::<i64, _>(0).map_err(db)).transpose()
}

#[async_trait]
impl ShopDb for SqliteStore {
    fn connections_free(&self) -> usize {
        SqliteStore::connections_free(self)
    }

    async fn migrate_shop(&self) -> Result<(), StoreError> {
        sqlx::raw_sql(SCHEMA)
            .execute(self.pool())
            .await
            .map_err(db)?;
        Ok(())
    }

    async fn insert_order(
        &self,
        tx: &mut Self::Tx,
        order: &Order,
        event_id: &str,
        fault: Option<DemoFault>,
    ) -> Result<(), StoreError> {
        let items = serde_json::to_string(&order.items).map_err(StoreError::other)?;
        let fault = fault.map(|f| {
            serde_json::to_value(f)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
        });
        sqlx::query(
            "INSERT INTO shop_orders (id, customer_id, currency, items, total_cents, status, event_id, demo_fault, created_at)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&order.id)
        .bind(&order.customer_id)
        .bind(&order.currency)
        .bind(items)
        .bind(order.total_cents)
        .bind(order.status.as_str())
        .bind(event_id)
        .bind(fault.flatten())
        .bind(&order.created_at)
        .execute(&mut **tx)
        .await
        .map_err(db)?;
        Ok(())
    }

    async fn order(&self, id: &str) -> Result<Option<Order>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {ORDER_COLUMNS} FROM shop_orders WHERE id = ?"
        ))
        .bind(id)
        .fetch_optional(self.read_pool())
        .await
        .map_err(db)?;
        row.as_ref().map(order_from_row).transpose()
    }

    async fn order_by_event(&self, event_id: &str) -> Result<Option<Order>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {ORDER_COLUMNS} FROM shop_orders WHERE event_id = ?"
        ))
        .bind(event_id)
        .fetch_optional(self.read_pool())
        .await
        .map_err(db)?;
        row.as_ref().map(order_from_row).transpose()
    }

    async fn orders_after(
        &self,
        after: Option<&str>,
        customer: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Order>, StoreError> {
        let mut sql = format!("SELECT {ORDER_COLUMNS} FROM shop_orders WHERE id > ?");
        if customer.is_some() {
            sql.push_str(" AND customer_id = ?");
        }
        sql.push_str(" ORDER BY id LIMIT ?");
        let mut query = sqlx::query(&sql).bind(after.unwrap_or(""));
        if let Some(customer) = customer {
            query = query.bind(customer);
        }
        let rows = query
            .bind(i64::try_from(limit).unwrap_or(i64::MAX))
            .fetch_all(self.read_pool())
            .await
            .map_err(db)?;
        rows.iter().map(order_from_row).collect()
    }

    async fn order_counts(&self) -> Result<Vec<(OrderStatus, u64)>, StoreError> {
        let rows = sqlx::query("SELECT status, COUNT(*) FROM shop_orders GROUP BY status")
            .fetch_all(self.read_pool())
            .await
            .map_err(db)?;
        let mut counts = Vec::new();
        for row in rows {
            let status: String = row.try_get(0).map_err(db)?;
            let n: i64 = row.try_get(1).map_err(db)?;
            if let Some(status) = OrderStatus::parse(&status) {
                counts.push((status, u64::try_from(n).unwrap_or(0)));
            }
        }
        Ok(counts)
    }

    async fn record_applied(
        &self,
        tx: &mut Self::Tx,
        event_id: &str,
        handler: &str,
    ) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO shop_applied (event_id, handler) VALUES (?, ?)")
            .bind(event_id)
            .bind(handler)
            .execute(&mut **tx)
            .await
            .map_err(db)?;
        Ok(())
    }

    async fn settle_orders(
        &self,
        tx: &mut Self::Tx,
        limit: usize,
    ) -> Result<Vec<Settled>, StoreError> {
        let rows = sqlx::query(
            "SELECT o.id, o.customer_id, s.status FROM shop_orders o JOIN keel_sagas s ON s.id = o.id
             WHERE o.status IN ('pending', 'stuck')
               AND s.status IN ('completed', 'compensated', 'stuck', 'cancelled')
               AND s.status <> o.status
             LIMIT ?",
        )
        .bind(i64::try_from(limit).unwrap_or(i64::MAX))
        .fetch_all(&mut **tx)
        .await
        .map_err(db)?;
        let mut settled = Vec::with_capacity(rows.len());
        for row in rows {
            let status: String = row.try_get(2).map_err(db)?;
            let Some(status) = OrderStatus::parse(&status) else {
                continue;
            };
            let order_id: String = row.try_get(0).map_err(db)?;
            sqlx::query("UPDATE shop_orders SET status = ? WHERE id = ?")
                .bind(status.as_str())
                .bind(&order_id)
                .execute(&mut **tx)
                .await
                .map_err(db)?;
            settled.push(Settled {
                order_id,
                customer_id: row.try_get(1).map_err(db)?,
                status,
            });
        }
        Ok(settled)
    }

    async fn seed_stock(&self, stock: &[(String, i64)]) -> Result<(), StoreError> {
        let mut tx = self.begin().await?;
        for (sku, available) in stock {
            sqlx::query(
                "INSERT INTO shop_stock (sku, available) VALUES (?, ?)
                 ON CONFLICT (sku) DO NOTHING",
            )
            .bind(sku)
            .bind(available)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        }
        self.commit(tx).await
    }

    async fn capture(&self, key: &str, order_id: &str, amount: i64) -> Result<Capture, StoreError> {
        // One transaction (the store's single writer serializes it with a
        // refund), so the tombstone check and the charge are one step.
        let mut tx = self.begin().await?;
        if tombstoned(&mut tx, key).await? {
            self.rollback(tx).await?;
            return Ok(Capture::Undone);
        }
        let new = insert_effect(&mut tx, key, order_id, "capture_payment", false, amount).await?;
        self.commit(tx).await?;
        Ok(Capture::Charged(new))
    }

    async fn refund(
        &self,
        key: &str,
        order_id: &str,
        action_key: &str,
    ) -> Result<bool, StoreError> {
        let mut tx = self.begin().await?;
        tombstone(&mut tx, action_key, key).await?;
        let refunded = match action_amount(&mut tx, order_id, "capture_payment").await? {
            Some(amount) => {
                insert_effect(&mut tx, key, order_id, "capture_payment", true, -amount).await?
            }
            None => false,
        };
        self.commit(tx).await?;
        Ok(refunded)
    }

    async fn reserve(
        &self,
        key: &str,
        order_id: &str,
        items: &[Item],
    ) -> Result<Reservation, StoreError> {
        let mut tx = self.begin().await?;
        if key_used(&mut tx, key).await? {
            self.rollback(tx).await?;
            return Ok(Reservation::Reserved);
        }
        if tombstoned(&mut tx, key).await? {
            self.rollback(tx).await?;
            return Ok(Reservation::Undone);
        }
        let mut wanted: std::collections::BTreeMap<&str, i64> = Default::default();
        for item in items {
            *wanted.entry(item.sku.as_str()).or_default() += i64::from(item.qty);
        }
        for (sku, qty) in &wanted {
            let done = sqlx::query(
                "UPDATE shop_stock SET available = available - ? WHERE sku = ? AND available >= ?",
            )
            .bind(qty)
            .bind(sku)
            .bind(qty)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
            if done.rows_affected() == 0 {
                self.rollback(tx).await?;
                return Ok(Reservation::OutOfStock((*sku).to_owned()));
            }
        }
        let detail = serde_json::to_string(&wanted).map_err(StoreError::other)?;
        insert_effect(&mut tx, key, order_id, "reserve_stock", false, 0).await?;
        sqlx::query("UPDATE shop_effects SET detail = ? WHERE idem_key = ?")
            .bind(detail)
            .bind(key)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        self.commit(tx).await?;
        Ok(Reservation::Reserved)
    }

    async fn release(
        &self,
        key: &str,
        order_id: &str,
        action_key: &str,
    ) -> Result<bool, StoreError> {
        let mut tx = self.begin().await?;
        tombstone(&mut tx, action_key, key).await?;
        let row = sqlx::query(
            "SELECT detail FROM shop_effects WHERE order_id = ? AND step = 'reserve_stock' AND compensation = 0",
        )
        .bind(order_id)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db)?;
        let Some(row) = row else {
            // Nothing to release, but the tombstone stands.
            self.commit(tx).await?;
            return Ok(false);
        };
        if !insert_effect(&mut tx, key, order_id, "reserve_stock", true, 0).await? {
            self.commit(tx).await?;
            return Ok(false);
        }
        let detail: String = row.try_get(0).map_err(db)?;
        let reserved: std::collections::BTreeMap<String, i64> =
            serde_json::from_str(&detail).map_err(StoreError::other)?;
        for (sku, qty) in reserved {
            sqlx::query("UPDATE shop_stock SET available = available + ? WHERE sku = ?")
                .bind(qty)
                .bind(sku)
                .execute(&mut *tx)
                .await
                .map_err(db)?;
        }
        self.commit(tx).await?;
        Ok(true)
    }

    async fn record_effect(
        &self,
        key: &str,
        order_id: &str,
        step: &str,
    ) -> Result<bool, StoreError> {
        let mut conn = self.pool().acquire().await.map_err(db)?;
        insert_effect(&mut conn, key, order_id, step, false, 0).await
    }

    async fn audit(&self) -> Result<Audit, StoreError> {
        let pool = self.read_pool();
        let mut audit = Audit::default();
        for row in
            sqlx::query("SELECT id, event_id, total_cents, status FROM shop_orders ORDER BY id")
                .fetch_all(pool)
                .await
                .map_err(db)?
        {
            let status: String = row.try_get(3).map_err(db)?;
            audit.orders.push(AuditOrder {
                id: row.try_get(0).map_err(db)?,
                event_id: row.try_get(1).map_err(db)?,
                total_cents: row.try_get(2).map_err(db)?,
                status: OrderStatus::parse(&status).unwrap_or(OrderStatus::Pending),
            });
        }
        for row in sqlx::query("SELECT event_id, handler FROM shop_applied ORDER BY seq")
            .fetch_all(pool)
            .await
            .map_err(db)?
        {
            audit
                .applied
                .push((row.try_get(0).map_err(db)?, row.try_get(1).map_err(db)?));
        }
        for row in sqlx::query("SELECT event_id, published_at FROM keel_outbox")
            .fetch_all(pool)
            .await
            .map_err(db)?
        {
            let published: Option<i64> = row.try_get(1).map_err(db)?;
            if published.is_some() {
                audit.published.push(row.try_get(0).map_err(db)?);
            } else {
                audit.unpublished += 1;
            }
        }
        for row in sqlx::query(
            "SELECT order_id, step, compensation, amount_cents FROM shop_effects ORDER BY seq",
        )
        .fetch_all(pool)
        .await
        .map_err(db)?
        {
            audit.effects.push(Effect {
                order_id: row.try_get(0).map_err(db)?,
                step: row.try_get(1).map_err(db)?,
                compensation: row.try_get(2).map_err(db)?,
                amount_cents: row.try_get(3).map_err(db)?,
            });
        }
        for row in sqlx::query("SELECT id, status FROM keel_sagas")
            .fetch_all(pool)
            .await
            .map_err(db)?
        {
            audit
                .sagas
                .push((row.try_get(0).map_err(db)?, row.try_get(1).map_err(db)?));
        }
        Ok(audit)
    }
}

/// The time now as stored in `created_at`.
pub fn now_rfc3339() -> String {
    keel_core::clock::utc_now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn store() -> SqliteStore {
        let store = SqliteStore::open_in_memory().await.unwrap();
        store.migrate_shop().await.unwrap();
        store
            .seed_stock(&[("tea".into(), 10), ("rare".into(), 1)])
            .await
            .unwrap();
        store
    }

    fn item(sku: &str, qty: u32) -> Item {
        Item::new(sku, qty, 100)
    }

    #[tokio::test]
    async fn reservations_are_all_or_nothing_and_deduped_by_key() {
        let store = store().await;
        let r = store
            .reserve("o1:reserve_stock", "o1", &[item("tea", 2), item("tea", 1)])
            .await
            .unwrap();
        assert_eq!(r, Reservation::Reserved);
        // The same key again: no second reservation.
        let r = store
            .reserve("o1:reserve_stock", "o1", &[item("tea", 3)])
            .await
            .unwrap();
        assert_eq!(r, Reservation::Reserved);
        let r = store
            .reserve("o2:reserve_stock", "o2", &[item("tea", 1), item("rare", 2)])
            .await
            .unwrap();
        assert_eq!(r, Reservation::OutOfStock("rare".into()));
        // Nothing of o2 stuck: tea is back to 10 - 3.
        let r = store
            .reserve("o3:reserve_stock", "o3", &[item("tea", 7)])
            .await
            .unwrap();
        assert_eq!(r, Reservation::Reserved);
        let release = |o: &'static str| {
            let store = store.clone();
            async move {
                let (key, action) = (
                    format!("{o}:undo:reserve_stock"),
                    format!("{o}:reserve_stock"),
                );
                store.release(&key, o, &action).await.unwrap()
            }
        };
        assert!(release("o1").await);
        assert!(!release("o1").await);
        assert!(!release("o2").await);
        let r = store
            .reserve("o4:reserve_stock", "o4", &[item("tea", 3)])
            .await
            .unwrap();
        assert_eq!(r, Reservation::Reserved);
    }

    #[tokio::test]
    async fn a_capture_is_charged_once_and_refunded_once() {
        let store = store().await;
        let capture = |o: &'static str| {
            let store = store.clone();
            async move {
                store
                    .capture(&format!("{o}:capture_payment"), o, 500)
                    .await
                    .unwrap()
            }
        };
        let refund = |o: &'static str| {
            let store = store.clone();
            async move {
                let (key, action) = (
                    format!("{o}:undo:capture_payment"),
                    format!("{o}:capture_payment"),
                );
                store.refund(&key, o, &action).await.unwrap()
            }
        };
        assert_eq!(capture("o1").await, Capture::Charged(true));
        assert_eq!(capture("o1").await, Capture::Charged(false));
        assert!(refund("o1").await);
        assert!(!refund("o1").await);
        assert!(!refund("o2").await);
        let audit = store.audit().await.unwrap();
        let money: i64 = audit.effects.iter().map(|e| e.amount_cents).sum();
        assert_eq!(money, 0);
        assert_eq!(audit.effects.len(), 2);
    }

    #[tokio::test]
    async fn a_late_action_after_its_compensation_is_refused_by_the_tombstone() {
        let store = store().await;
        // The capture's request is held up; the saga gives up and refunds:
        // nothing to refund, but the capture's key is tombstoned.
        assert!(
            !store
                .refund("o1:undo:capture_payment", "o1", "o1:capture_payment")
                .await
                .unwrap()
        );
        assert_eq!(
            store
                .capture("o1:capture_payment", "o1", 500)
                .await
                .unwrap(),
            Capture::Undone,
            "the late capture is refused"
        );
        // The same for a reservation released before it arrived.
        assert!(
            !store
                .release("o1:undo:reserve_stock", "o1", "o1:reserve_stock")
                .await
                .unwrap()
        );
        assert_eq!(
            store
                .reserve("o1:reserve_stock", "o1", &[item("tea", 4)])
                .await
                .unwrap(),
            Reservation::Undone
        );
        let audit = store.audit().await.unwrap();
        assert!(audit.effects.is_empty(), "{:?}", audit.effects);
        // Stock untouched: another order can take all ten.
        let r = store
            .reserve("o2:reserve_stock", "o2", &[item("tea", 10)])
            .await
            .unwrap();
        assert_eq!(r, Reservation::Reserved);
    }
}
