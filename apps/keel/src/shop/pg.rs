//! The shop's business tables on PostgreSQL, in the store's own schema:
//! PostgreSQL's part of [`ShopBackend`] (the SQL itself is `sql.rs`).
//!
//! Several `keel serve` processes share one database, so the schema is
//! created under an advisory lock, and an action and the compensation that
//! tombstones its key take the same transaction-scoped advisory lock on
//! that key first, so a late action either lands before the undo (and is
//! undone) or sees the tombstone (and is refused), never slips between.
//! Ids are compared with the `C` collation, so keyset pages sort exactly as
//! on SQLite.

use keel_postgres::PgStore;
use keel_postgres::store::PgDialect;
use keel_sql::Dialect;
use keel_store::Store;
use keel_store::StoreError;

use super::sql::{ShopBackend, ShopTypes, shop_schema};

/// The advisory lock key serializing `migrate_shop` across processes
/// (per schema: it is hashed with the schema name).
const MIGRATE_LOCK: &str = "keel-shop-migrate";

impl ShopBackend for PgStore {
    const TYPES: ShopTypes = ShopTypes {
        key: r#"TEXT COLLATE "C""#,
        seq: "BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY",
        int: "BIGINT",
        flag: "BOOLEAN",
    };

    /// `CREATE ... IF NOT EXISTS` alone races between processes starting
    /// at once, hence the advisory lock.
    async fn create_shop_tables(&self) -> Result<(), StoreError> {
        let mut tx = self.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext(current_schema() || $1))")
            .bind(MIGRATE_LOCK)
            .execute(&mut *tx)
            .await
            .map_err(db)?;
        let schema = shop_schema(&Self::TYPES);
        for statement in schema.split(';').filter(|s| !s.trim().is_empty()) {
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(&mut *tx)
                .await
                .map_err(db)?;
        }
        self.commit_resolved(tx).await
    }

    /// A transaction-scoped advisory lock on the key.
    async fn lock_key(
        &self,
        tx: &mut keel_sql::backend::Tx<Self>,
        key: &str,
    ) -> Result<(), StoreError> {
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('keel-shop-key:' || $1))")
            .bind(key)
            .execute(&mut **tx)
            .await
            .map_err(db)?;
        Ok(())
    }
}

fn db(err: sqlx::Error) -> StoreError {
    <PgDialect as Dialect>::error(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shop::behaviours;
    use crate::shop::db::{Capture, Reservation, ShopDb};
    use crate::shop::model::{DemoFault, Item, Order, OrderStatus};

    /// A store on a fresh schema of the test server, or `None` (skipped)
    /// without one.
    async fn store() -> Option<PgStore> {
        let url = keel_testkit::services::postgres_url()?;
        let schema = format!("keel_shop_t_{}", uuid::Uuid::now_v7().simple());
        let store = PgStore::options()
            .schema(schema)
            .max_connections(8)
            .open(&url)
            .await
            .unwrap();
        Some(behaviours::seeded(store).await)
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
        behaviours::reservations_are_all_or_nothing_and_deduped_by_key(&store).await;
    }

    #[tokio::test]
    async fn seeding_again_keeps_the_stock_levels() {
        let Some(store) = store().await else { return };
        store
            .reserve("o3:reserve_stock", "o3", &[item("tea", 4)])
            .await
            .unwrap();
        // A second process starting seeds again: the levels stay.
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
    async fn a_capture_is_charged_once_and_refunded_once() {
        let Some(store) = store().await else { return };
        behaviours::a_capture_is_charged_once_and_refunded_once(&store).await;
    }

    #[tokio::test]
    async fn a_late_action_after_its_compensation_is_refused_by_the_tombstone() {
        let Some(store) = store().await else { return };
        behaviours::a_late_action_after_its_compensation_is_refused_by_the_tombstone(&store).await;
    }

    #[tokio::test]
    async fn an_order_settles_once_per_status() {
        let Some(store) = store().await else { return };
        behaviours::an_order_settles_once_per_status(&store).await;
    }

    /// Two transactions settling one order at once: the second waits for
    /// the first's row lock, then finds the order already settled.
    #[tokio::test]
    async fn an_order_is_announced_once_when_two_settle_it_at_once() {
        let Some(store) = store().await else { return };
        behaviours::place(&store, "o1").await;
        let mut first = store.begin().await.unwrap();
        let settled = store
            .settle_order(&mut first, "o1", OrderStatus::Completed)
            .await
            .unwrap();
        assert!(settled.is_some());
        let racer = store.clone();
        let second = tokio::spawn(async move {
            let mut tx = racer.begin().await.unwrap();
            let settled = racer
                .settle_order(&mut tx, "o1", OrderStatus::Completed)
                .await
                .unwrap();
            racer.commit(tx).await.unwrap();
            settled
        });
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        assert!(!second.is_finished(), "the second waits on the row");
        store.commit(first).await.unwrap();
        assert_eq!(second.await.unwrap(), None);
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
                delivery_estimate: None,
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
