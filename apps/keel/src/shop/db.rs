//! The shop's business tables, behind [`ShopDb`], in the same database as
//! Keel's store.
//!
//! They share the database so that the order row and its outbox row, or the
//! inbox row and the saga it starts, commit in one transaction. The SQL is
//! written once, in `sql.rs`, on Keel's SQL core; this file holds the
//! contract and SQLite's part of [`ShopBackend`] (`pg.rs` has
//! PostgreSQL's).
//!
//! The dependencies' own tables are in the same schema: `shop_stock`
//! (inventory levels) and `shop_effects`, the ledger of every effect a
//! dependency applied (captures, refunds, reservations, releases,
//! shipments, receipts), unique per idempotency key: that uniqueness is
//! what makes a retried capture charge once. `shop_tombstones` holds the
//! action keys a compensation undid (a refund the capture's key, a release
//! the reservation's), written in the compensation's transaction even when
//! there was nothing to undo: an action that arrives later under a
//! tombstoned key is refused, so a request held up in the network cannot
//! charge after its refund. A saga's dependencies must all do this; see
//! `StepContext::action_key`. The demo and the chaos run keep them in the
//! system's own database, where one audit reads everything back; `keel
//! serve` on a SQLite file gives them a file of their own
//! ([`ShopDb::dependencies_store`]), as a deployment would give them
//! databases of their own.

use async_trait::async_trait;
use keel_sql::Dialect;
use keel_sqlite::SqliteStore;
use keel_sqlite::store::SqliteDialect;
use keel_store::Store;
use keel_store::StoreError;

use super::model::{Customer, DemoFault, Item, Order, OrderStatus, Product};
use super::sql::{ShopBackend, ShopTypes, shop_schema};

/// An order whose fulfilment reached a new state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settled {
    /// The order.
    pub order_id: String,
    /// Its customer (the event-log stream).
    pub customer_id: String,
    /// Its new status.
    pub status: OrderStatus,
    /// When it was placed (`created_at`, RFC 3339), for the time from
    /// intake to settled.
    pub placed_at: String,
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
    /// Every dependency effect, in commit order.
    pub effects: Vec<Effect>,
    /// `(saga id, status)` of every saga.
    pub sagas: Vec<(String, String)>,
}

/// The shop's SQL, implemented once for every [`ShopBackend`].
#[async_trait]
pub trait ShopDb: Store {
    /// Connections free in the store's pool (readiness: pool exhaustion).
    fn connections_free(&self) -> usize;
    /// Creates the shop's tables if missing.
    async fn migrate_shop(&self) -> Result<(), StoreError>;
    /// A store of their own for the reference shop's dependencies
    /// (payments, inventory, shipping, notifications) when they run beside
    /// the system, as `keel serve` runs them: in a deployment they are
    /// services with databases of their own. A SQLite file store opens a
    /// file next to it, `PATH.dependencies`, so that their writes do not
    /// queue for the system's one writer; `None` (any other store) means
    /// they share this one.
    async fn dependencies_store(&self) -> Result<Option<Self>, StoreError>
    where
        Self: Sized;
    /// Inserts an accepted order in the caller's transaction; `false` (and
    /// nothing written) when an order with this `event_id` exists already,
    /// so a retry learns that from its insert instead of reading first.
    async fn insert_order(
        &self,
        tx: &mut Self::Tx,
        order: &Order,
        event_id: &str,
        fault: Option<DemoFault>,
    ) -> Result<bool, StoreError>;
    /// One order.
    async fn order(&self, id: &str) -> Result<Option<Order>, StoreError>;
    /// The orders with these ids, in one statement (a DataLoader's batch);
    /// unknown ids are left out.
    async fn orders_by_id(&self, ids: &[String]) -> Result<Vec<Order>, StoreError>;
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
    /// The customers with these ids, as their orders describe them, in one
    /// statement (a DataLoader's batch); ids without orders are left out.
    async fn customers(&self, ids: &[String]) -> Result<Vec<Customer>, StoreError>;
    /// The products (stock rows) with these SKUs, in one statement; unknown
    /// SKUs are left out.
    async fn products(&self, skus: &[String]) -> Result<Vec<Product>, StoreError>;
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
    /// Moves a pending (or stuck) order to `status`, in `tx`; `None` if it
    /// is not waiting for that (already there, finished, or unknown).
    async fn settle_order(
        &self,
        tx: &mut Self::Tx,
        order_id: &str,
        status: OrderStatus,
    ) -> Result<Option<Settled>, StoreError>;
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

impl ShopBackend for SqliteStore {
    const TYPES: ShopTypes = ShopTypes {
        key: "TEXT",
        seq: "INTEGER PRIMARY KEY AUTOINCREMENT",
        int: "INTEGER",
        flag: "INTEGER",
    };

    async fn create_shop_tables(&self) -> Result<(), StoreError> {
        sqlx::raw_sql(sqlx::AssertSqlSafe(shop_schema(&Self::TYPES)))
            .execute(self.pool())
            .await
            .map_err(<SqliteDialect as Dialect>::error)?;
        Ok(())
    }

    async fn dependencies_store(&self) -> Result<Option<Self>, StoreError> {
        let Some(file) = self.file() else {
            return Ok(None);
        };
        let mut own = file.as_os_str().to_owned();
        own.push(".dependencies");
        SqliteStore::open(std::path::PathBuf::from(own))
            .await
            .map(Some)
    }

    /// Nothing to take: the store's single writer runs one transaction at
    /// a time.
    async fn lock_key(
        &self,
        _tx: &mut keel_sql::backend::Tx<Self>,
        _key: &str,
    ) -> Result<(), StoreError> {
        Ok(())
    }
}

/// The time now as stored in `created_at`.
pub fn now_rfc3339() -> String {
    keel_core::clock::utc_now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shop::behaviours;

    async fn store() -> SqliteStore {
        behaviours::seeded(SqliteStore::open_in_memory().await.unwrap()).await
    }

    #[tokio::test]
    async fn reservations_are_all_or_nothing_and_deduped_by_key() {
        behaviours::reservations_are_all_or_nothing_and_deduped_by_key(&store().await).await;
    }

    #[tokio::test]
    async fn an_order_settles_once_per_status() {
        behaviours::an_order_settles_once_per_status(&store().await).await;
    }

    #[tokio::test]
    async fn a_capture_is_charged_once_and_refunded_once() {
        behaviours::a_capture_is_charged_once_and_refunded_once(&store().await).await;
    }

    #[tokio::test]
    async fn a_late_action_after_its_compensation_is_refused_by_the_tombstone() {
        behaviours::a_late_action_after_its_compensation_is_refused_by_the_tombstone(
            &store().await,
        )
        .await;
    }
}
