//! The shop's business SQL, written once for every backend on Keel's SQL
//! core ([`keel_sql`]): [`ShopDb`] for any [`ShopBackend`].
//!
//! The statements are portable; what a backend adds is how it spells a
//! few column types ([`ShopTypes`]), how it migrates when several
//! processes start at once, and how it keeps
//! an action and the compensation that tombstones its key apart
//! ([`ShopBackend::lock_key`]). Several `keel serve` processes can share
//! one PostgreSQL database, so every write here is safe when two of them
//! race: a reservation claims its idempotency key *before* it touches stock
//! (a concurrent retry with the same key waits on the unique index, then
//! finds the key used and reserves nothing), stock only moves through
//! conditional `UPDATE`s, and an order settles only from `pending` or
//! `stuck`, in the transaction that saves its saga's new status under the
//! saga's version check, so one settled order is announced once however
//! many orchestrators race. On SQLite the single writer serializes all of
//! it.

use std::collections::BTreeMap;
use std::future::Future;

use async_trait::async_trait;
use keel_sql::backend::{Row, Tx};
use keel_sql::dialect::Value;
use keel_sql::filter::Filter;
use keel_sql::{Dialect, Exec, SqlBackend, SqlRow};
use keel_store::StoreError;
use keel_store::{OutboxAdminStore, OutboxStore, SagaFilter, SagaStore, Store};

use super::db::{Audit, AuditOrder, Capture, Effect, Reservation, Settled, ShopDb};
use super::model::{Customer, DemoFault, Item, Order, OrderStatus, Product};

mod schema;

pub use schema::{ShopTypes, shop_schema};

/// How many published outbox rows the audit reads at once.
const AUDIT_PAGE: usize = 1_000;

/// What a backend adds to the shop's SQL.
pub trait ShopBackend:
    SqlBackend + Store<Tx = Tx<Self>> + OutboxStore + OutboxAdminStore + SagaStore + Clone
{
    /// How it spells the shop's column types.
    const TYPES: ShopTypes;

    /// Creates the shop's tables ([`shop_schema`]) if missing, safely when
    /// several processes start at once.
    fn create_shop_tables(&self) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Serializes, until `tx` ends, an action under `key` with the
    /// compensation that may tombstone it, so a late action either lands
    /// before the undo (and is undone) or sees the tombstone (and is
    /// refused). SQLite's single writer does this already.
    fn lock_key<'a>(
        &'a self,
        tx: &'a mut Tx<Self>,
        key: &'a str,
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;

    /// A store of their own for the reference shop's dependencies (see
    /// [`ShopDb::dependencies_store`]): none, so they share this one,
    /// unless the backend says otherwise.
    fn dependencies_store(&self) -> impl Future<Output = Result<Option<Self>, StoreError>> + Send {
        std::future::ready(Ok(None))
    }
}

const ORDER_COLUMNS: &str = "id, customer_id, currency, items, total_cents, status, created_at";

fn limit_param(limit: usize) -> i64 {
    i64::try_from(limit).unwrap_or(i64::MAX)
}

fn order_from_row<D: Dialect>(row: &D::Row) -> Result<Order, StoreError> {
    let items = row.text("items")?;
    let status = row.text("status")?;
    Ok(Order {
        id: row.text("id")?,
        customer_id: row.text("customer_id")?,
        currency: row.text("currency")?,
        items: serde_json::from_str(&items).map_err(StoreError::other)?,
        total_cents: row.int("total_cents")?,
        status: OrderStatus::parse(&status)
            .ok_or_else(|| StoreError::other(format!("unknown order status `{status}`")))?,
        created_at: row.text("created_at")?,
        delivery_estimate: None,
    })
}

/// One row of `shop_effects`; `false` if `key` was already used. A
/// concurrent transaction holding the same key makes this wait for its
/// outcome, so two racing callers never both see `true`.
async fn insert_effect<B: ShopBackend>(
    on: Exec<'_, B::Dialect>,
    key: &str,
    order_id: &str,
    step: &str,
    compensation: bool,
    amount: i64,
    detail: &str,
) -> Result<bool, StoreError> {
    let params = effect_params(key, order_id, step, compensation, amount, detail);
    Ok(B::Dialect::execute(on, INSERT_EFFECT, &params).await? == 1)
}

const INSERT_EFFECT: &str = "\
INSERT INTO shop_effects (idem_key, order_id, step, compensation, amount_cents, detail)
VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (idem_key) DO NOTHING";

fn effect_params<'a>(
    key: &'a str,
    order_id: &'a str,
    step: &'a str,
    compensation: bool,
    amount: i64,
    detail: &'a str,
) -> [Value<'a>; 6] {
    [
        key.into(),
        order_id.into(),
        step.into(),
        compensation.into(),
        amount.into(),
        detail.into(),
    ]
}

/// Tombstones `action_key` (undone by `key`), under its lock; idempotent.
async fn tombstone<B: ShopBackend>(
    store: &B,
    tx: &mut Tx<B>,
    action_key: &str,
    key: &str,
) -> Result<(), StoreError> {
    store.lock_key(tx, action_key).await?;
    B::Dialect::execute(
        Exec::Tx(tx),
        "INSERT INTO shop_tombstones (idem_key, undone_by) VALUES ($1, $2)
         ON CONFLICT (idem_key) DO NOTHING",
        &[action_key.into(), key.into()],
    )
    .await?;
    Ok(())
}

/// What an action found: its effect applied (`false`: already, under the
/// same key) or its key tombstoned by a compensation.
enum Acted {
    Applied(bool),
    Undone,
}

/// The effect of an action under `key`, unless a compensation tombstoned
/// `key`; takes the key's lock first. The tombstone check rides in the
/// insert, so a new action is one statement; only an insert that changed
/// nothing asks which of the two stopped it.
async fn act<B: ShopBackend>(
    store: &B,
    tx: &mut Tx<B>,
    key: &str,
    order_id: &str,
    step: &str,
    amount: i64,
    detail: &str,
) -> Result<Acted, StoreError> {
    store.lock_key(tx, key).await?;
    let params = effect_params(key, order_id, step, false, amount, detail);
    if B::Dialect::execute(Exec::Tx(tx), INSERT_ACTION, &params).await? == 1 {
        return Ok(Acted::Applied(true));
    }
    let tombstone = B::Dialect::fetch_optional(
        Exec::Tx(tx),
        "SELECT idem_key FROM shop_tombstones WHERE idem_key = $1",
        &[key.into()],
    )
    .await?;
    Ok(match tombstone {
        Some(_) => Acted::Undone,
        None => Acted::Applied(false),
    })
}

const INSERT_ACTION: &str = "\
INSERT INTO shop_effects (idem_key, order_id, step, compensation, amount_cents, detail)
SELECT $1, $2, $3, $4, $5, $6
 WHERE NOT EXISTS (SELECT 1 FROM shop_tombstones WHERE idem_key = $1)
ON CONFLICT (idem_key) DO NOTHING";

/// The effect of `step`'s action for `order_id`, if it happened, with its
/// amount and detail.
async fn action<B: ShopBackend>(
    tx: &mut Tx<B>,
    order_id: &str,
    step: &str,
) -> Result<Option<Row<B>>, StoreError> {
    B::Dialect::fetch_optional(
        Exec::Tx(tx),
        "SELECT amount_cents, detail FROM shop_effects
         WHERE order_id = $1 AND step = $2 AND NOT compensation",
        &[order_id.into(), step.into()],
    )
    .await
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
impl<B: ShopBackend> ShopDb for B {
    fn connections_free(&self) -> usize {
        keel_sql::backend::connections_free(self.writer())
    }

    async fn migrate_shop(&self) -> Result<(), StoreError> {
        self.create_shop_tables().await
    }

    async fn dependencies_store(&self) -> Result<Option<Self>, StoreError> {
        ShopBackend::dependencies_store(self).await
    }

    async fn insert_order(
        &self,
        tx: &mut Self::Tx,
        order: &Order,
        event_id: &str,
        fault: Option<DemoFault>,
    ) -> Result<bool, StoreError> {
        let items = serde_json::to_string(&order.items).map_err(StoreError::other)?;
        let fault = fault.and_then(|f| {
            serde_json::to_value(f)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
        });
        let params = [
            order.id.as_str().into(),
            order.customer_id.as_str().into(),
            order.currency.as_str().into(),
            items.as_str().into(),
            order.total_cents.into(),
            order.status.as_str().into(),
            event_id.into(),
            fault.as_deref().into(),
            order.created_at.as_str().into(),
        ];
        let inserted = B::Dialect::execute(
            Exec::Tx(tx),
            "INSERT INTO shop_orders (id, customer_id, currency, items, total_cents, status,
                                      event_id, demo_fault, created_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
             ON CONFLICT (event_id) DO NOTHING",
            &params,
        )
        .await?;
        Ok(inserted == 1)
    }

    async fn order(&self, id: &str) -> Result<Option<Order>, StoreError> {
        let sql = format!("SELECT {ORDER_COLUMNS} FROM shop_orders WHERE id = $1");
        let row = self.read_optional(&sql, &[id.into()]).await?;
        row.as_ref().map(order_from_row::<B::Dialect>).transpose()
    }

    async fn orders_by_id(&self, ids: &[String]) -> Result<Vec<Order>, StoreError> {
        let mut filter = Filter::new();
        filter.and_in("id", ids.iter().map(String::as_str));
        let sql = format!(
            "SELECT {ORDER_COLUMNS} FROM shop_orders {}",
            filter.where_clause()
        );
        let rows = self.read_all(&sql, filter.params()).await?;
        rows.iter().map(order_from_row::<B::Dialect>).collect()
    }

    async fn order_by_event(&self, event_id: &str) -> Result<Option<Order>, StoreError> {
        let sql = format!("SELECT {ORDER_COLUMNS} FROM shop_orders WHERE event_id = $1");
        let row = self.read_optional(&sql, &[event_id.into()]).await?;
        row.as_ref().map(order_from_row::<B::Dialect>).transpose()
    }

    async fn orders_after(
        &self,
        after: Option<&str>,
        customer: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Order>, StoreError> {
        let mut conditions = Filter::new();
        conditions
            .and("id >", Some(after.unwrap_or("")))
            .and("customer_id =", customer);
        let limit = conditions.param(limit_param(limit));
        let sql = format!(
            "SELECT {ORDER_COLUMNS} FROM shop_orders {} ORDER BY id LIMIT {limit}",
            conditions.where_clause()
        );
        let rows = self.read_all(&sql, conditions.params()).await?;
        rows.iter().map(order_from_row::<B::Dialect>).collect()
    }

    async fn customers(&self, ids: &[String]) -> Result<Vec<Customer>, StoreError> {
        let mut filter = Filter::new();
        filter.and_in("customer_id", ids.iter().map(String::as_str));
        // SUM of a BIGINT is NUMERIC on PostgreSQL: cast it back.
        let sql = format!(
            "SELECT customer_id, COUNT(*) AS orders, CAST(SUM(total_cents) AS BIGINT) AS spent
             FROM shop_orders {} GROUP BY customer_id",
            filter.where_clause()
        );
        let rows = self.read_all(&sql, filter.params()).await?;
        rows.iter()
            .map(|row| {
                Ok(Customer {
                    id: row.text("customer_id")?,
                    order_count: row.int("orders")?,
                    total_spent_cents: row.int("spent")?,
                })
            })
            .collect()
    }

    async fn products(&self, skus: &[String]) -> Result<Vec<Product>, StoreError> {
        let mut filter = Filter::new();
        filter.and_in("sku", skus.iter().map(String::as_str));
        let sql = format!(
            "SELECT sku, available FROM shop_stock {}",
            filter.where_clause()
        );
        let rows = self.read_all(&sql, filter.params()).await?;
        rows.iter()
            .map(|row| {
                Ok(Product {
                    sku: row.text("sku")?,
                    available: row.int("available")?,
                })
            })
            .collect()
    }

    async fn order_counts(&self) -> Result<Vec<(OrderStatus, u64)>, StoreError> {
        let rows = self
            .read_all(
                "SELECT status, COUNT(*) AS n FROM shop_orders GROUP BY status",
                &[],
            )
            .await?;
        let mut counts = Vec::new();
        for row in rows {
            if let Some(status) = OrderStatus::parse(&row.text("status")?) {
                counts.push((status, u64::try_from(row.int("n")?).unwrap_or(0)));
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
        B::Dialect::execute(
            Exec::Tx(tx),
            "INSERT INTO shop_applied (event_id, handler) VALUES ($1, $2)",
            &[event_id.into(), handler.into()],
        )
        .await?;
        Ok(())
    }

    async fn settle_order(
        &self,
        tx: &mut Self::Tx,
        order_id: &str,
        status: OrderStatus,
    ) -> Result<Option<Settled>, StoreError> {
        let row = B::Dialect::fetch_optional(
            Exec::Tx(tx),
            "UPDATE shop_orders SET status = $1
              WHERE id = $2 AND status IN ('pending', 'stuck') AND status <> $1
              RETURNING customer_id, created_at",
            &[status.as_str().into(), order_id.into()],
        )
        .await?;
        row.map(|row| {
            Ok(Settled {
                order_id: order_id.to_owned(),
                customer_id: row.text("customer_id")?,
                status,
                placed_at: row.text("created_at")?,
            })
        })
        .transpose()
    }

    /// Stocks the skus not stocked yet: a shared database is seeded by the
    /// first process, and one joining later must not restock what the
    /// others already sold.
    async fn seed_stock(&self, stock: &[(String, i64)]) -> Result<(), StoreError> {
        let mut tx = self.begin_own().await?;
        for (sku, available) in stock {
            B::Dialect::execute(
                Exec::Tx(&mut tx),
                "INSERT INTO shop_stock (sku, available) VALUES ($1, $2)
                 ON CONFLICT (sku) DO NOTHING",
                &[sku.as_str().into(), (*available).into()],
            )
            .await?;
        }
        self.commit_own(tx).await
    }

    async fn capture(&self, key: &str, order_id: &str, amount: i64) -> Result<Capture, StoreError> {
        let mut tx = self.begin_own().await?;
        match act(self, &mut tx, key, order_id, "capture_payment", amount, "").await? {
            Acted::Undone => {
                self.rollback(tx).await?;
                Ok(Capture::Undone)
            }
            Acted::Applied(new) => {
                self.commit_own(tx).await?;
                Ok(Capture::Charged(new))
            }
        }
    }

    async fn refund(
        &self,
        key: &str,
        order_id: &str,
        action_key: &str,
    ) -> Result<bool, StoreError> {
        let mut tx = self.begin_own().await?;
        tombstone(self, &mut tx, action_key, key).await?;
        let refunded = match action::<B>(&mut tx, order_id, "capture_payment").await? {
            Some(capture) => {
                let amount = capture.int("amount_cents")?;
                insert_effect::<B>(
                    Exec::Tx(&mut tx),
                    key,
                    order_id,
                    "capture_payment",
                    true,
                    -amount,
                    "",
                )
                .await?
            }
            None => false,
        };
        self.commit_own(tx).await?;
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
        let mut tx = self.begin_own().await?;
        // The key first: a concurrent call with the same key waits here
        // until this one commits (then reserves nothing) or rolls back.
        match act(self, &mut tx, key, order_id, "reserve_stock", 0, &detail).await? {
            Acted::Applied(true) => {}
            Acted::Applied(false) => {
                self.rollback(tx).await?;
                return Ok(Reservation::Reserved);
            }
            Acted::Undone => {
                self.rollback(tx).await?;
                return Ok(Reservation::Undone);
            }
        }
        for (sku, qty) in &wanted {
            let taken = B::Dialect::execute(
                Exec::Tx(&mut tx),
                "UPDATE shop_stock SET available = available - $1 WHERE sku = $2 AND available >= $1",
                &[(*qty).into(), (*sku).into()],
            )
            .await?;
            if taken == 0 {
                self.rollback(tx).await?;
                return Ok(Reservation::OutOfStock((*sku).to_owned()));
            }
        }
        self.commit_own(tx).await?;
        Ok(Reservation::Reserved)
    }

    async fn release(
        &self,
        key: &str,
        order_id: &str,
        action_key: &str,
    ) -> Result<bool, StoreError> {
        let mut tx = self.begin_own().await?;
        tombstone(self, &mut tx, action_key, key).await?;
        let Some(reservation) = action::<B>(&mut tx, order_id, "reserve_stock").await? else {
            // Nothing to release, but the tombstone stands.
            self.commit_own(tx).await?;
            return Ok(false);
        };
        let undo = Exec::Tx(&mut tx);
        if !insert_effect::<B>(undo, key, order_id, "reserve_stock", true, 0, "").await? {
            self.commit_own(tx).await?;
            return Ok(false);
        }
        let reserved: BTreeMap<String, i64> =
            serde_json::from_str(&reservation.text("detail")?).map_err(StoreError::other)?;
        for (sku, qty) in reserved {
            B::Dialect::execute(
                Exec::Tx(&mut tx),
                "UPDATE shop_stock SET available = available + $1 WHERE sku = $2",
                &[qty.into(), sku.as_str().into()],
            )
            .await?;
        }
        self.commit_own(tx).await?;
        Ok(true)
    }

    async fn record_effect(
        &self,
        key: &str,
        order_id: &str,
        step: &str,
    ) -> Result<bool, StoreError> {
        // `write`, not the writer pool: on SQLite it joins the group commit.
        let params = effect_params(key, order_id, step, false, 0, "");
        Ok(self.write(INSERT_EFFECT, &params).await? == 1)
    }

    async fn audit(&self) -> Result<Audit, StoreError> {
        let mut audit = Audit::default();
        let orders = "SELECT id, event_id, total_cents, status FROM shop_orders ORDER BY id";
        for row in self.read_all(orders, &[]).await? {
            audit.orders.push(AuditOrder {
                id: row.text("id")?,
                event_id: row.text("event_id")?,
                total_cents: row.int("total_cents")?,
                status: OrderStatus::parse(&row.text("status")?).unwrap_or(OrderStatus::Pending),
            });
        }
        let applied = "SELECT event_id, handler FROM shop_applied ORDER BY seq";
        for row in self.read_all(applied, &[]).await? {
            audit
                .applied
                .push((row.text("event_id")?, row.text("handler")?));
        }
        let mut after = 0;
        loop {
            let page = self.outbox_published(after, AUDIT_PAGE).await?;
            audit
                .published
                .extend(page.iter().map(|p| p.event_id.clone()));
            match page.last() {
                Some(last) if page.len() == AUDIT_PAGE => after = last.id,
                _ => break,
            }
        }
        let effects =
            "SELECT order_id, step, compensation, amount_cents FROM shop_effects ORDER BY seq";
        for row in self.read_all(effects, &[]).await? {
            audit.effects.push(Effect {
                order_id: row.text("order_id")?,
                step: row.text("step")?,
                compensation: row.flag("compensation")?,
                amount_cents: row.int("amount_cents")?,
            });
        }
        let all = SagaFilter {
            limit: Some(usize::MAX),
            ..SagaFilter::default()
        };
        for saga in self.saga_list(&all).await? {
            audit.sagas.push((saga.id, saga.status.as_str().to_owned()));
        }
        Ok(audit)
    }
}
