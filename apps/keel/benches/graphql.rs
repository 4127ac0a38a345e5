//! The orders page two ways, in one run, on a SQLite file holding 50
//! orders of 20 customers:
//!
//! - `rest_page`: what `GET /orders?limit=50` does below HTTP: the page
//!   request, one orders statement, the signed next cursor, the JSON body;
//! - `graphql_page_with_customers`: `orders(first: 50)` with each order's
//!   customer through the per-request loaders: two statements (orders,
//!   then one customer batch), the GraphQL response as JSON;
//! - `graphql_page_orders_only`: the same page without customers (one
//!   statement), to show what the GraphQL execution itself costs.
//!
//! Run: `cargo bench -p keel --bench graphql`

use std::sync::Arc;

use criterion::{Criterion, criterion_group, criterion_main};
use keel::api::graphql::ShopGraphql;
use keel::shop::db::ShopDb;
use keel::shop::model::{Item, Order, OrderStatus};
use keel_http::pagination::{Cursor, CursorCodec, Pagination, list_scope};
use keel_sqlite::SqliteStore;
use keel_store::Store;

const GRAPHQL_ORDERS_ONLY: &str = "{ orders(first: 50) { edges { cursor node { id customerId totalCents status } } \
                                   pageInfo { hasNextPage endCursor } } }";

const GRAPHQL_PAGE: &str = "{ orders(first: 50) { edges { cursor node { id customerId totalCents status \
                            customer { id orderCount totalSpentCents } } } pageInfo { hasNextPage endCursor } } }";

async fn shop(dir: &std::path::Path) -> SqliteStore {
    let store = SqliteStore::open(dir.join("keel.db")).await.expect("store");
    store.migrate_shop().await.expect("shop tables");
    for n in 0..50 {
        let order = Order {
            id: format!("order-{n:04}"),
            customer_id: format!("customer-{:02}", n % 20),
            currency: "USD".to_owned(),
            items: vec![Item::new("tea", 2, 450)],
            total_cents: 900,
            status: OrderStatus::Pending,
            created_at: "2026-12-03T00:00:00Z".to_owned(),
            delivery_estimate: None,
        };
        let mut tx = store.begin().await.expect("begin");
        store
            .insert_order(&mut tx, &order, &format!("placed-{n}"), None)
            .await
            .expect("insert");
        store.commit(tx).await.expect("commit");
    }
    store
}

fn pages(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let dir = tempfile::tempdir().expect("temp dir");
    let store = rt.block_on(shop(dir.path()));
    let pagination = Pagination::new(CursorCodec::new(vec![7_u8; 32]).expect("key"));
    let api = ShopGraphql::new(Arc::new(store.clone()), pagination.clone());

    let mut group = c.benchmark_group("orders_page_50");
    group.bench_function("rest_page", |b| {
        b.to_async(&rt).iter(|| async {
            let page = pagination
                .request::<String, String>(list_scope("/orders", []), Some(50), None)
                .expect("page request");
            let rows = store
                .orders_after(None, None, page.fetch_limit() as usize)
                .await
                .expect("rows");
            let page = page
                .page(rows, |o| Cursor::new(o.id.clone(), o.id.clone()))
                .expect("page");
            serde_json::to_vec(&page).expect("json")
        });
    });
    for (name, query) in [
        ("graphql_page_orders_only", GRAPHQL_ORDERS_ONLY),
        ("graphql_page_with_customers", GRAPHQL_PAGE),
    ] {
        group.bench_function(name, |b| {
            b.to_async(&rt).iter(|| async {
                let response = api.execute(async_graphql::Request::new(query)).await;
                assert!(response.errors.is_empty(), "{:?}", response.errors);
                serde_json::to_vec(&response).expect("json")
            });
        });
    }
    group.finish();
}

criterion_group!(benches, pages);
criterion_main!(benches);
