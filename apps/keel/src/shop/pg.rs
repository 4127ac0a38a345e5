//! The shop's business tables on PostgreSQL: [`ShopDb`] for
//! [`PgStore`], in the store's own schema.
//!
//! The statements are the SQLite ones with `$n` placeholders; what differs
//! is concurrency. Several `keel serve` processes share one database, so
//! every write is safe when two of them race: the schema is created under
//! an advisory lock, a reservation claims its idempotency key *before* it
//! touches stock (a concurrent retry with the same key waits on the unique
//! index, then finds the key used and reserves nothing), stock only moves
//! through conditional `UPDATE`s, and the projection claims the orders it
//! settles with `FOR UPDATE SKIP LOCKED`, so one settled order is announced
//! once however many projections run. An action and the compensation that
//! tombstones its key take the same transaction-scoped advisory lock on
//! that key first, so a late action either lands before the undo (and is
//! undone) or sees the tombstone (and is refused), never slips between.
//! Ids are compared with the `C` collation, so keyset pages sort exactly as
//! on SQLite.

use std::collections::BTreeMap;

use async_trait::async_trait;
use keel_messaging::StoreError;
use keel_messaging::store::Store;
use keel_postgres::PgStore;
use sqlx::Row;
use sqlx::postgres::{PgConnection, PgRow};

use super::db::{Audit, AuditOrder, Capture, Effect, Reservation, Settled, ShopDb};
use super::model::{DemoFault, Item, Order, OrderStatus};

/// The shop's tables. `CREATE ... IF NOT EXISTS` alone races between
/// processes starting at once, hence the advisory lock in `migrate_shop`.
const SCHEMA: &str = r#"
CREATE TABLE IF NOT EXISTS shop_orders (
    id          TEXT COLLATE "C" PRIMARY KEY,
    customer_id TEXT COLLATE "C" NOT NULL,
    currency    TEXT    NOT NULL,
    items       TEXT    NOT NULL,
    total_cents BIGINT  NOT NULL,
    status      TEXT    NOT NULL,
    event_id    TEXT    NOT NULL UNIQUE,
    demo_fault  TEXT,
    created_at  TEXT    NOT NULL
);
CREATE INDEX IF NOT EXISTS shop_orders_customer ON shop_orders (customer_id, id);
CREATE INDEX IF NOT EXISTS shop_orders_status ON shop_orders (status);
CREATE TABLE IF NOT EXISTS shop_applied (
    seq      BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id TEXT   NOT NULL,
    handler  TEXT   NOT NULL
);
CREATE TABLE IF NOT EXISTS shop_stock (
    sku       TEXT   PRIMARY KEY,
    available BIGINT NOT NULL CHECK (available >= 0)
);
CREATE TABLE IF NOT EXISTS shop_effects (
    seq          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    idem_key     TEXT    NOT NULL UNIQUE,
    order_id     TEXT    NOT NULL,
    step         TEXT    NOT NULL,
    compensation BOOLEAN NOT NULL,
    amount_cents BIGINT  NOT NULL,
    detail       TEXT    NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS shop_effects_order ON shop_effects (order_id, step);
CREATE TABLE IF NOT EXISTS shop_tombstones (
    idem_key  TEXT PRIMARY KEY,
    undone_by TEXT NOT NULL
);
"#;

/// The advisory lock key serializing `migrate_shop` across processes
/// (per schema: it is hashed with the schema name).
const MIGRATE_LOCK: &str = "keel-shop-migrate";

/// SQLSTATEs after which running the work again may succeed: serialization
/// failure, deadlock, and the server shutting down, starting up or out of
/// connections.
const TRANSIENT_STATES: [&str; 6] = ["40001", "40P01", "57P01", "57P02", "57P03", "53300"];

/// Maps a statement's error: connection problems and transaction conflicts
/// are [`StoreError::Unavailable`] (retry), everything else is permanent.
fn db(err: sqlx::Error) -> StoreError {
    let transient = match &err {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        sqlx::Error::Database(e) => e.code().is_some_and(|code| {
            code.starts_with("08") || TRANSIENT_STATES.contains(&code.as_ref())
        }),
        _ => false,
    };
    if transient {
        StoreError::Unavailable(err.into())
    } else {
        StoreError::other(err)
    }
}

fn limit_param(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

fn order_from_row(row: &PgRow) -> Result<Order, StoreError> {
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

/// One row of `shop_effects`; `false` if `key` was already used. A
/// concurrent transaction holding the same key makes this wait for its
/// outcome, so two racing callers never both see `true`.
async fn insert_effect(
    conn: &mut PgConnection,
    key: &str,
    order_id: &str,
    step: &str,
    compensation: bool,
    amount: i64,
    detail: &str,
) -> Result<bool, StoreError> {
    let done = sqlx::query(
        "INSERT INTO shop_effects (idem_key, order_id, step, compensation, amount_cents, detail)
         VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (idem_key) DO NOTHING",
    )
    .bind(key)
    .bind(order_id)
    .bind(step)
    .bind(compensation)
    .bind(amount)
    .bind(detail)
    .execute(conn)
    .await
    .map_err(db)?;
    Ok(done.rows_affected() == 1)
}

/// Serializes an action with the compensation that may tombstone its key
/// (until the end of the transaction).
async fn lock_key(conn: &mut PgConnection, action_key: &str) -> Result<(), StoreError> {
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('keel-shop-key:' || $1))")
        .bind(action_key)
        .execute(conn)
        .await
        .map_err(db)?;
    Ok(())
}

/// Tombstones `action_key` (undone by `key`), under its lock; idempotent.
async fn tombstone(conn: &mut PgConnection, action_key: &str, key: &str) -> Result<(), StoreError> {
    lock_key(conn, action_key).await?;
    sqlx::query(
        "INSERT INTO shop_tombstones (idem_key, undone_by) VALUES ($1, $2)
         ON CONFLICT (idem_key) DO NOTHING",
    )
    .bind(action_key)
    .bind(key)
    .execute(conn)
    .await
    .map_err(db)?;
    Ok(())
}

/// Whether `key` is tombstoned; takes its lock first.
async fn tombstoned(conn: &mut PgConnection, key: &str) -> Result<bool, StoreError> {
    lock_key(conn, key).await?;
    let row = sqlx::query("SELECT 1 FROM shop_tombstones WHERE idem_key = $1")
        .bind(key)
        .fetch_optional(conn)
        .await
        .map_err(db)?;
    Ok(row.is_some())
}

/// The effect of `step`'s action for `order_id`, if it happened: its amount.
async fn action_amount(
    conn: &mut PgConnection,
    order_id: &str,
    step: &str,
) -> Result<Option<i64>, StoreError> {
    let row = sqlx::query(
        "SELECT amount_cents FROM shop_effects
         WHERE order_id = $1 AND step = $2 AND NOT compensation",
    )
    .bind(order_id)
    .bind(step)
    .fetch_optional(conn)
    .await
    .map_err(db)?;
    row.map(|r| r.try_get::<i64, _>(0).map_err(db)).transpose()
}

/// Quantities per sku, summed over the items (one `UPDATE` per sku, in sku
/// order, so two reservations never lock stock rows in opposite orders).
fn wanted(items: &[Item]) -> BTreeMap<&str, i64> {
    let mut wanted: BTreeMap<&str, i64> = BTreeMap::new();
    for item in items {
        *wanted.entry(item.sku.as_str()).or_default() += i64::from(item.qty);
    }
    wanted
}

#[async_trait]
impl ShopDb for PgStore {
    fn connections_free(&self) -> usize {
        PgStore::connections_free(self)
    }

    async fn migrate_shop(&self) -> Result<(), StoreError> {
        let mut tx = self.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext(current_schema() || $1))")
            .bind(MIGRATE_LOCK)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        for statement in SCHEMA.split(';').filter(|s| !s.trim().is_empty()) {
            sqlx::query(statement).execute(&mut *tx).await.map_err(db)?;
        }
        self.commit_resolved(tx).await
    }

    async fn insert_order(
        &self,
        tx: &mut Self::Tx,
        order: &Order,
        event_id: &str,
        fault: Option<DemoFault>,
    ) -> Result<(), StoreError> {
        let items = serde_json::to_string(&order.items).map_err(StoreError::other)?;
        let fault = fault.and_then(|f| {
            serde_json::to_value(f)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
        });
        sqlx::query(
            "INSERT INTO shop_orders (id, customer_id, currency, items, total_cents, status, event_id, demo_fault, created_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(&order.id)
        .bind(&order.customer_id)
        .bind(&order.currency)
        .bind(items)
        .bind(order.total_cents)
        .bind(order.status.as_str())
        .bind(event_id)
        .bind(fault)
        .bind(&order.created_at)
        .execute(&mut **tx)
        .await
        .map_err(db)?;
        Ok(())
    }

    async fn order(&self, id: &str) -> Result<Option<Order>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {ORDER_COLUMNS} FROM shop_orders WHERE id = $1"
        ))
        .bind(id)
        .fetch_optional(self.pool())
        .await
        .map_err(db)?;
        row.as_ref().map(order_from_row).transpose()
    }

    async fn order_by_event(&self, event_id: &str) -> Result<Option<Order>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {ORDER_COLUMNS} FROM shop_orders WHERE event_id = $1"
        ))
        .bind(event_id)
        .fetch_optional(self.pool())
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
        let sql = if customer.is_some() {
            format!(
                "SELECT {ORDER_COLUMNS} FROM shop_orders WHERE id > $1 AND customer_id = $3
                 ORDER BY id LIMIT $2"
            )
        } else {
            format!("SELECT {ORDER_COLUMNS} FROM shop_orders WHERE id > $1 ORDER BY id LIMIT $2")
        };
        let mut query = sqlx::query(&sql)
            .bind(after.unwrap_or(""))
            .bind(limit_param(limit));
        if let Some(customer) = customer {
            query = query.bind(customer);
        }
        let rows = query.fetch_all(self.pool()).await.map_err(db)?;
        rows.iter().map(order_from_row).collect()
    }

    async fn order_counts(&self) -> Result<Vec<(OrderStatus, u64)>, StoreError> {
        let rows = sqlx::query("SELECT status, COUNT(*) FROM shop_orders GROUP BY status")
            .fetch_all(self.pool())
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
        sqlx::query("INSERT INTO shop_applied (event_id, handler) VALUES ($1, $2)")
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
        // SKIP LOCKED: another process's projection settling the same
        // orders right now keeps them; after it commits, the re-checked
        // status no longer matches, so nothing is announced twice.
        let rows = sqlx::query(
            "SELECT o.id, o.customer_id, s.status FROM shop_orders o JOIN keel_sagas s ON s.id = o.id
             WHERE o.status IN ('pending', 'stuck')
               AND s.status IN ('completed', 'compensated', 'stuck', 'cancelled')
               AND s.status <> o.status
             LIMIT $1
             FOR UPDATE OF o SKIP LOCKED",
        )
        .bind(limit_param(limit))
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
            sqlx::query("UPDATE shop_orders SET status = $1 WHERE id = $2")
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

    /// Stocks the skus not stocked yet. Unlike SQLite's single process, a
    /// shared database is seeded by the first process; one joining later
    /// must not restock what the others already sold.
    async fn seed_stock(&self, stock: &[(String, i64)]) -> Result<(), StoreError> {
        let mut tx = self.begin().await?;
        for (sku, available) in stock {
            sqlx::query(
                "INSERT INTO shop_stock (sku, available) VALUES ($1, $2)
                 ON CONFLICT (sku) DO NOTHING",
            )
            .bind(sku)
            .bind(available)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        }
        self.commit_resolved(tx).await
    }

    async fn capture(&self, key: &str, order_id: &str, amount: i64) -> Result<Capture, StoreError> {
        let mut tx = self.begin().await?;
        if tombstoned(&mut tx, key).await? {
            self.rollback(tx).await?;
            return Ok(Capture::Undone);
        }
        let new =
            insert_effect(&mut tx, key, order_id, "capture_payment", false, amount, "").await?;
        self.commit_resolved(tx).await?;
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
                insert_effect(&mut tx, key, order_id, "capture_payment", true, -amount, "").await?
            }
            None => false,
        };
        self.commit_resolved(tx).await?;
        Ok(refunded)
    }

    async fn reserve(
        &self,
        key: &str,
        order_id: &str,
        items: &[Item],
    ) -> Result<Reservation, StoreError> {
        let wanted = wanted(items);
        let detail = serde_json::to_string(&wanted).map_err(StoreError::other)?;
        let mut tx = self.begin().await?;
        if tombstoned(&mut tx, key).await? {
            self.rollback(tx).await?;
            return Ok(Reservation::Undone);
        }
        // The key first: a concurrent call with the same key waits here
        // until this one commits (then reserves nothing) or rolls back.
        if !insert_effect(&mut tx, key, order_id, "reserve_stock", false, 0, &detail).await? {
            self.rollback(tx).await?;
            return Ok(Reservation::Reserved);
        }
        for (sku, qty) in &wanted {
            let done = sqlx::query(
                "UPDATE shop_stock SET available = available - $1 WHERE sku = $2 AND available >= $1",
            )
            .bind(qty)
            .bind(sku)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
            if done.rows_affected() == 0 {
                self.rollback(tx).await?;
                return Ok(Reservation::OutOfStock((*sku).to_owned()));
            }
        }
        self.commit_resolved(tx).await?;
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
            "SELECT detail FROM shop_effects
             WHERE order_id = $1 AND step = 'reserve_stock' AND NOT compensation",
        )
        .bind(order_id)
        .fetch_optional(&mut *tx)
        .await
        .map_err(db)?;
        let Some(row) = row else {
            // Nothing to release, but the tombstone stands.
            self.commit_resolved(tx).await?;
            return Ok(false);
        };
        if !insert_effect(&mut tx, key, order_id, "reserve_stock", true, 0, "").await? {
            self.commit_resolved(tx).await?;
            return Ok(false);
        }
        let detail: String = row.try_get(0).map_err(db)?;
        let reserved: BTreeMap<String, i64> =
            serde_json::from_str(&detail).map_err(StoreError::other)?;
        for (sku, qty) in reserved {
            sqlx::query("UPDATE shop_stock SET available = available + $1 WHERE sku = $2")
                .bind(qty)
                .bind(sku)
                .execute(&mut *tx)
                .await
                .map_err(db)?;
        }
        self.commit_resolved(tx).await?;
        Ok(true)
    }

    async fn record_effect(
        &self,
        key: &str,
        order_id: &str,
        step: &str,
    ) -> Result<bool, StoreError> {
        let mut conn = self.pool().acquire().await.map_err(db)?;
        insert_effect(&mut conn, key, order_id, step, false, 0, "").await
    }

    async fn audit(&self) -> Result<Audit, StoreError> {
        let pool = self.pool();
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
        for row in sqlx::query("SELECT event_id, published_at IS NOT NULL FROM keel_outbox")
            .fetch_all(pool)
            .await
            .map_err(db)?
        {
            if row.try_get::<bool, _>(1).map_err(db)? {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A store on a fresh schema of the test server, or `None` (skipped)
    /// without one.
    async fn store() -> Option<PgStore> {
        let url = keel_testkit::services::postgres_url()?;
        let schema = format!("keel_shop_t_{}", uuid::Uuid::now_v7().simple());
        let store = PgStore::builder(url)
            .schema(schema)
            .max_connections(8)
            .connect()
            .await
            .unwrap();
        store.migrate_shop().await.unwrap();
        store
            .seed_stock(&[("tea".into(), 10), ("rare".into(), 1)])
            .await
            .unwrap();
        Some(store)
    }

    fn item(sku: &str, qty: u32) -> Item {
        Item::new(sku, qty, 100)
    }

    async fn available(store: &PgStore, sku: &str) -> i64 {
        sqlx::query_scalar("SELECT available FROM shop_stock WHERE sku = $1")
            .bind(sku)
            .fetch_one(store.pool())
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn reservations_are_all_or_nothing_and_deduped_by_key() {
        let Some(store) = store().await else { return };
        let r = store
            .reserve("o1:reserve_stock", "o1", &[item("tea", 2), item("tea", 1)])
            .await
            .unwrap();
        assert_eq!(r, Reservation::Reserved);
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
        assert_eq!(available(&store, "tea").await, 7);
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
        assert_eq!(available(&store, "tea").await, 10);
        // Seeding again (a second process starting) keeps the levels.
        store
            .reserve("o3:reserve_stock", "o3", &[item("tea", 4)])
            .await
            .unwrap();
        store.seed_stock(&[("tea".into(), 10)]).await.unwrap();
        assert_eq!(available(&store, "tea").await, 6);
        store.migrate_shop().await.unwrap();
    }

    #[tokio::test]
    async fn racing_calls_with_one_key_take_effect_once() {
        let Some(store) = store().await else { return };
        let mut calls = Vec::new();
        for _ in 0..8 {
            let s = store.clone();
            calls.push(tokio::spawn(async move {
                let reserved = s.reserve("o1:reserve_stock", "o1", &[item("tea", 3)]).await;
                let captured = s.capture("o1:capture_payment", "o1", 500).await;
                (reserved.unwrap(), captured.unwrap())
            }));
        }
        let mut captures = 0;
        for call in calls {
            let (reserved, captured) = call.await.unwrap();
            assert_eq!(reserved, Reservation::Reserved);
            captures += usize::from(captured == Capture::Charged(true));
        }
        assert_eq!(captures, 1);
        assert_eq!(available(&store, "tea").await, 7);
        // The last unit of `rare`, wanted by many orders: sold once.
        let mut calls = Vec::new();
        for n in 0..8 {
            let s = store.clone();
            calls.push(tokio::spawn(async move {
                s.reserve(
                    &format!("r{n}:reserve_stock"),
                    &format!("r{n}"),
                    &[item("rare", 1)],
                )
                .await
                .unwrap()
            }));
        }
        let mut sold = 0;
        for call in calls {
            sold += usize::from(call.await.unwrap() == Reservation::Reserved);
        }
        assert_eq!(sold, 1);
        assert_eq!(available(&store, "rare").await, 0);
    }

    #[tokio::test]
    async fn a_late_action_racing_its_compensation_is_refunded_or_refused_never_left_standing() {
        let Some(store) = store().await else { return };
        for n in 0..16 {
            let o = format!("late{n}");
            let (s1, s2) = (store.clone(), store.clone());
            let (o1, o2) = (o.clone(), o.clone());
            let capture = tokio::spawn(async move {
                s1.capture(&format!("{o1}:capture_payment"), &o1, 500)
                    .await
                    .unwrap()
            });
            let refund = tokio::spawn(async move {
                let (key, action) = (
                    format!("{o2}:undo:capture_payment"),
                    format!("{o2}:capture_payment"),
                );
                s2.refund(&key, &o2, &action).await.unwrap()
            });
            let (captured, refunded) = (capture.await.unwrap(), refund.await.unwrap());
            match captured {
                Capture::Charged(true) => assert!(refunded, "{o}: charged after its refund"),
                Capture::Undone => assert!(!refunded, "{o}: refunded a charge that never was"),
                Capture::Charged(false) => panic!("{o}: first capture seen as a repeat"),
            }
            // Once refunded, the key stays refused.
            let again = store
                .capture(&format!("{o}:capture_payment"), &o, 500)
                .await
                .unwrap();
            assert_ne!(again, Capture::Charged(true), "{o}");
        }
        let audit = store.audit().await.unwrap();
        let money: i64 = audit.effects.iter().map(|e| e.amount_cents).sum();
        assert_eq!(money, 0, "no charge left without its refund");
        // A late reservation after its release is refused too.
        assert!(
            !store
                .release("o9:undo:reserve_stock", "o9", "o9:reserve_stock")
                .await
                .unwrap()
        );
        let r = store
            .reserve("o9:reserve_stock", "o9", &[item("tea", 1)])
            .await
            .unwrap();
        assert_eq!(r, Reservation::Undone);
    }

    #[tokio::test]
    async fn a_capture_is_charged_once_and_refunded_once_and_audited() {
        let Some(store) = store().await else { return };
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
        assert!(audit.effects[1].compensation);
    }

    async fn place(store: &PgStore, id: &str, saga_status: &str) {
        let mut tx = store.begin().await.unwrap();
        let order = Order {
            id: id.into(),
            customer_id: "c1".into(),
            currency: "USD".into(),
            items: vec![item("tea", 1)],
            total_cents: 100,
            status: OrderStatus::Pending,
            created_at: crate::shop::db::now_rfc3339(),
        };
        store
            .insert_order(&mut tx, &order, &format!("evt-{id}"), None)
            .await
            .unwrap();
        sqlx::query(
            "INSERT INTO keel_sagas (id, kind, status, step, data, attempts, next_attempt_at,
                                     created_at, updated_at, version)
             VALUES ($1, 'fulfilment', $2, 0, '{}', 0, now(), now(), now(), 1)",
        )
        .bind(id)
        .bind(saga_status)
        .execute(&mut *tx)
        .await
        .unwrap();
        store.commit(tx).await.unwrap();
    }

    #[tokio::test]
    async fn an_order_is_settled_by_one_projection_at_a_time() {
        let Some(store) = store().await else { return };
        place(&store, "o1", "completed").await;
        place(&store, "o2", "running").await;
        let mut first = store.begin().await.unwrap();
        let settled = store.settle_orders(&mut first, 10).await.unwrap();
        assert_eq!(settled.len(), 1);
        assert_eq!(settled[0].order_id, "o1");
        assert_eq!(settled[0].status, OrderStatus::Completed);
        // Another process's projection, meanwhile: o1 is taken.
        let mut second = store.begin().await.unwrap();
        assert!(
            store
                .settle_orders(&mut second, 10)
                .await
                .unwrap()
                .is_empty()
        );
        store.rollback(second).await.unwrap();
        store.commit(first).await.unwrap();
        let mut third = store.begin().await.unwrap();
        assert!(
            store
                .settle_orders(&mut third, 10)
                .await
                .unwrap()
                .is_empty()
        );
        store.rollback(third).await.unwrap();
        let order = store.order("o1").await.unwrap().unwrap();
        assert_eq!(order.status, OrderStatus::Completed);
    }

    #[tokio::test]
    async fn orders_page_by_id_and_customer() {
        let Some(store) = store().await else { return };
        let mut tx = store.begin().await.unwrap();
        for (id, customer) in [("a-2", "c1"), ("a-10", "c2"), ("a_1", "c1"), ("B", "c1")] {
            let order = Order {
                id: id.into(),
                customer_id: customer.into(),
                currency: "USD".into(),
                items: vec![item("tea", 1)],
                total_cents: 100,
                status: OrderStatus::Pending,
                created_at: crate::shop::db::now_rfc3339(),
            };
            store
                .insert_order(
                    &mut tx,
                    &order,
                    &format!("evt-{id}"),
                    Some(DemoFault::DeadLetter),
                )
                .await
                .unwrap();
        }
        store.commit(tx).await.unwrap();
        let ids = |orders: Vec<Order>| orders.into_iter().map(|o| o.id).collect::<Vec<_>>();
        // Byte order, as on SQLite.
        assert_eq!(
            ids(store.orders_after(None, None, 10).await.unwrap()),
            ["B", "a-10", "a-2", "a_1"]
        );
        assert_eq!(
            ids(store
                .orders_after(Some("a-10"), Some("c1"), 1)
                .await
                .unwrap()),
            ["a-2"]
        );
        assert_eq!(store.order("a_1").await.unwrap().unwrap().customer_id, "c1");
        assert!(store.order("zz").await.unwrap().is_none());
        assert_eq!(
            store.order_counts().await.unwrap(),
            vec![(OrderStatus::Pending, 4)]
        );
    }
}
