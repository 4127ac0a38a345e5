//! The shop's storage behaviours, written once and run against every
//! backend's [`ShopDb`] (SQLite in `db.rs`'s tests, PostgreSQL in `pg.rs`'s).

use super::db::{Capture, Reservation, ShopDb};
use super::model::{Item, Order, OrderStatus};

fn item(sku: &str, qty: u32) -> Item {
    Item::new(sku, qty, 100)
}

/// A store seeded with 10 `tea` and 1 `rare`.
pub(crate) async fn seeded<S: ShopDb>(store: S) -> S {
    store.migrate_shop().await.unwrap();
    store
        .seed_stock(&[("tea".into(), 10), ("rare".into(), 1)])
        .await
        .unwrap();
    store
}

pub(crate) async fn reservations_are_all_or_nothing_and_deduped_by_key<S: ShopDb>(store: &S) {
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

pub(crate) async fn a_capture_is_charged_once_and_refunded_once<S: ShopDb>(store: &S) {
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

pub(crate) async fn a_late_action_after_its_compensation_is_refused_by_the_tombstone<S: ShopDb>(
    store: &S,
) {
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

/// Places a pending order `id` of customer `c1`, committed.
pub(crate) async fn place<S: ShopDb>(store: &S, id: &str) {
    let order = Order {
        id: id.into(),
        customer_id: "c1".into(),
        currency: "USD".into(),
        items: vec![item("tea", 1)],
        total_cents: 100,
        status: OrderStatus::Pending,
        created_at: super::db::now_rfc3339(),
        delivery_estimate: None,
    };
    let mut tx = store.begin().await.unwrap();
    store
        .insert_order(&mut tx, &order, &format!("evt-{id}"), None)
        .await
        .unwrap();
    store.commit(tx).await.unwrap();
}

async fn settle<S: ShopDb>(store: &S, id: &str, status: OrderStatus) -> Option<OrderStatus> {
    let mut tx = store.begin().await.unwrap();
    let settled = store.settle_order(&mut tx, id, status).await.unwrap();
    store.commit(tx).await.unwrap();
    settled.map(|s| {
        assert_eq!((s.order_id.as_str(), s.customer_id.as_str()), (id, "c1"));
        s.status
    })
}

/// An order settles from `pending` or `stuck` only, once per new status:
/// a repeated or late change announces nothing.
pub(crate) async fn an_order_settles_once_per_status<S: ShopDb>(store: &S) {
    use OrderStatus::{Cancelled, Completed, Stuck};
    place(store, "o1").await;
    assert_eq!(settle(store, "o1", Stuck).await, Some(Stuck));
    assert_eq!(settle(store, "o1", Stuck).await, None, "no change, no news");
    assert_eq!(
        settle(store, "o1", Completed).await,
        Some(Completed),
        "an operator's retry finished it"
    );
    assert_eq!(settle(store, "o1", Completed).await, None);
    assert_eq!(
        settle(store, "o1", Cancelled).await,
        None,
        "finished is final"
    );
    assert_eq!(store.order("o1").await.unwrap().unwrap().status, Completed);
    assert_eq!(settle(store, "o404", Completed).await, None);

    place(store, "o2").await;
    let mut tx = store.begin().await.unwrap();
    assert!(
        store
            .settle_order(&mut tx, "o2", Completed)
            .await
            .unwrap()
            .is_some()
    );
    store.rollback(tx).await.unwrap();
    assert_eq!(
        store.order("o2").await.unwrap().unwrap().status,
        OrderStatus::Pending,
        "it moves with its transaction"
    );
}
