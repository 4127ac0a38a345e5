//! The GraphQL API over a real SQLite store: statements counted from
//! sqlx's own query log, loaders per request, cursors, limits and errors.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use parking_lot::Mutex;

use async_trait::async_trait;
use keel_http::pagination::{CursorCodec, Pagination};
use keel_sqlite::SqliteStore;
use keel_store::StoreError;
use keel_store::{SagaRecord, SagaStatus, SagaStore, Store};
use serde_json::{Value, json};
use tracing_subscriber::layer::SubscriberExt;

use super::ShopGraphql;
use super::loaders::ShopReads;
use crate::shop::db::ShopDb;
use crate::shop::model::{Customer, Item, Order, OrderStatus, Product};

/// Every SQL statement sqlx ran in this process (its `sqlx::query` log),
/// for as long as the test's process lives (nextest runs each test in a
/// process of its own).
fn statements() -> &'static Mutex<Vec<String>> {
    static STATEMENTS: OnceLock<Mutex<Vec<String>>> = OnceLock::new();
    STATEMENTS.get_or_init(|| {
        struct Statements;
        impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Statements {
            fn on_event(
                &self,
                event: &tracing::Event<'_>,
                _ctx: tracing_subscriber::layer::Context<'_, S>,
            ) {
                if event.metadata().target() != "sqlx::query" {
                    return;
                }
                struct Sql(Option<String>);
                impl tracing::field::Visit for Sql {
                    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
                        if field.name() == "db.statement" {
                            self.0 = Some(value.to_owned());
                        }
                    }
                    fn record_debug(
                        &mut self,
                        field: &tracing::field::Field,
                        value: &dyn std::fmt::Debug,
                    ) {
                        if field.name() == "db.statement" {
                            self.0 = Some(format!("{value:?}"));
                        }
                    }
                }
                let mut sql = Sql(None);
                event.record(&mut sql);
                if let (Some(sql), Some(log)) = (sql.0, STATEMENTS.get()) {
                    log.lock().push(sql);
                }
            }
        }
        let subscriber = tracing_subscriber::registry().with(Statements);
        tracing::subscriber::set_global_default(subscriber).expect("the only subscriber");
        Mutex::new(Vec::new())
    })
}

fn pagination() -> Pagination {
    Pagination::new(CursorCodec::new(vec![7_u8; 32]).expect("a long enough key"))
}

async fn shop() -> SqliteStore {
    let store = SqliteStore::open_in_memory().await.expect("store");
    store.migrate_shop().await.expect("shop tables");
    store
        .seed_stock(&[("tea".to_owned(), 40), ("cup".to_owned(), 7)])
        .await
        .expect("stock");
    store
}

static ORDERS: AtomicUsize = AtomicUsize::new(0);

async fn place(store: &SqliteStore, customer: &str, skus: &[&str]) -> Order {
    let n = ORDERS.fetch_add(1, Ordering::SeqCst);
    let order = Order {
        id: format!("order-{n:04}"),
        customer_id: customer.to_owned(),
        currency: "USD".to_owned(),
        items: skus.iter().map(|sku| Item::new(*sku, 1, 450)).collect(),
        total_cents: 450 * skus.len() as i64,
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
    order
}

async fn start_saga(store: &SqliteStore, order: &Order) {
    start_saga_failing(store, order, None).await;
}

async fn start_saga_failing(store: &SqliteStore, order: &Order, last_error: Option<&str>) {
    let at = keel_core::clock::utc_now();
    let saga = SagaRecord {
        id: order.id.clone(),
        kind: "order_fulfilment".to_owned(),
        status: SagaStatus::Running,
        step: 1,
        data: json!({}),
        attempts: 0,
        outcome_unknown: false,
        first_attempt_at: None,
        last_error: last_error.map(str::to_owned),
        next_attempt_at: at,
        created_at: at,
        updated_at: at,
        version: 1,
        traceparent: None,
    };
    let mut tx = store.begin().await.expect("begin");
    store.saga_insert(&mut tx, &saga).await.expect("saga");
    store.commit(tx).await.expect("commit");
}

async fn run(api: &ShopGraphql, query: &str) -> Value {
    let response = api.execute(async_graphql::Request::new(query)).await;
    serde_json::to_value(&response).expect("a JSON response")
}

fn api(store: &SqliteStore) -> ShopGraphql {
    ShopGraphql::new(Arc::new(store.clone()), pagination())
}

/// On the multi-threaded runtime a server runs on: the page primes its
/// loaders with all of its keys, so the count does not hang on the loader's
/// 1 ms collection window (a CI run on a busy machine split a batch in two
/// when it did).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_of_fifty_orders_with_customers_costs_one_customer_query() {
    let log = statements();
    let store = shop().await;
    let mut placed = Vec::new();
    for n in 0..50 {
        let order = place(&store, &format!("c{:02}", n % 20), &["tea", "gone"]).await;
        if n < 10 {
            start_saga(&store, &order).await;
        }
        placed.push(order);
    }
    let api = api(&store);
    log.lock().clear();
    let answer = run(
        &api,
        "{ orders(first: 50) { edges { node { id customerId customer { id orderCount } \
           items { sku product { sku available } } saga { status step } } } \
           pageInfo { hasNextPage } } }",
    )
    .await;
    let ran = log.lock().clone();

    assert_eq!(answer["errors"], Value::Null, "{answer}");
    let edges = answer["data"]["orders"]["edges"].as_array().expect("edges");
    assert_eq!(edges.len(), 50);
    for (edge, order) in edges.iter().zip(&placed) {
        let node = &edge["node"];
        assert_eq!(node["id"], order.id.as_str());
        // Every order gets its own customer, whatever order the rows came in.
        assert_eq!(node["customer"]["id"], node["customerId"]);
        assert_eq!(
            node["customer"]["orderCount"],
            if order.customer_id.as_str() < "c10" {
                3
            } else {
                2
            }
        );
        assert_eq!(
            node["items"][0]["product"],
            json!({"sku": "tea", "available": 40})
        );
        assert_eq!(node["items"][1]["sku"], "gone");
        assert_eq!(
            node["items"][1]["product"],
            Value::Null,
            "a missing key is null"
        );
    }
    assert_eq!(
        edges[0]["node"]["saga"],
        json!({"status": "running", "step": 1})
    );
    assert_eq!(edges[10]["node"]["saga"], Value::Null);
    assert_eq!(answer["data"]["orders"]["pageInfo"]["hasNextPage"], false);

    let of = |table: &str| ran.iter().filter(|sql| sql.contains(table)).count();
    assert_eq!(
        of("GROUP BY customer_id"),
        1,
        "one customer query: {ran:#?}"
    );
    assert_eq!(of("shop_stock"), 1, "one product query: {ran:#?}");
    assert_eq!(of("keel_sagas"), 1, "one saga query: {ran:#?}");
    assert_eq!(ran.len(), 4, "orders, customers, products, sagas: {ran:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn aliased_orders_by_id_cost_one_query_and_a_thousand_are_refused() {
    let log = statements();
    let store = shop().await;
    let mut placed = Vec::new();
    for n in 0..30 {
        placed.push(place(&store, &format!("a{n:02}"), &["tea"]).await);
    }
    let api = api(&store);
    let aliased = |ids: &[&str]| {
        let fields: Vec<String> = ids
            .iter()
            .enumerate()
            .map(|(n, id)| format!("o{n}: order(id: \"{id}\") {{ id customerId }}"))
            .collect();
        format!("{{ {} }}", fields.join(" "))
    };
    let mut ids: Vec<&str> = placed.iter().map(|o| o.id.as_str()).collect();
    ids.push("no-such-order");
    log.lock().clear();
    let answer = run(&api, &aliased(&ids)).await;
    let ran = log.lock().clone();
    assert_eq!(answer["errors"], Value::Null, "{answer}");
    for (n, order) in placed.iter().enumerate() {
        assert_eq!(answer["data"][format!("o{n}")]["id"], order.id.as_str());
    }
    assert_eq!(answer["data"][format!("o{}", placed.len())], Value::Null);
    let reads = ran.iter().filter(|sql| sql.contains("shop_orders")).count();
    assert_eq!(reads, 1, "31 aliases, one orders query: {ran:#?}");

    let thousand: Vec<&str> = (0..990).map(|_| ids[0]).collect();
    let answer = run(&api, &aliased(&thousand)).await;
    assert!(
        answer["errors"][0]["message"]
            .as_str()
            .expect("message")
            .contains("too complex"),
        "990 store reads in one query: {answer}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sagas_last_error_is_a_code_never_an_internal_address() {
    let store = shop().await;
    let order = place(&store, "leak", &["tea"]).await;
    let internal = "http://127.0.0.1:41234/reservations answered 409";
    start_saga_failing(&store, &order, Some(internal)).await;
    let api = api(&store);
    let query = format!(
        "{{ order(id: \"{}\") {{ saga {{ lastError }} }} }}",
        order.id
    );
    let answer = run(&api, &query).await;
    assert_eq!(
        answer["data"]["order"]["saga"]["lastError"], "step_failed",
        "{answer}"
    );
    assert!(!answer.to_string().contains("127.0.0.1"), "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loaders_are_per_request_so_no_cached_value_crosses_requests() {
    let store = shop().await;
    place(&store, "ada", &["tea"]).await;
    place(&store, "bob", &["cup"]).await;
    let api = api(&store);
    let count = |customer: &str| {
        format!(
            "{{ orders(customerId: \"{customer}\") {{ nodes {{ customer {{ id orderCount }} }} }} }}"
        )
    };
    let (for_ada, for_bob) = (count("ada"), count("bob"));
    let (ada, bob) = tokio::join!(run(&api, &for_ada), run(&api, &for_bob));
    assert_eq!(
        ada["data"]["orders"]["nodes"],
        json!([{"customer": {"id": "ada", "orderCount": 1}}])
    );
    assert_eq!(
        bob["data"]["orders"]["nodes"],
        json!([{"customer": {"id": "bob", "orderCount": 1}}])
    );

    // A process-wide loader would still answer 1 from its cache.
    place(&store, "ada", &["tea"]).await;
    let again = run(&api, &count("ada")).await;
    let nodes = again["data"]["orders"]["nodes"].as_array().expect("nodes");
    assert_eq!(nodes.len(), 2);
    assert!(
        nodes
            .iter()
            .all(|n| n["customer"] == json!({"id": "ada", "orderCount": 2}))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_walk_with_signed_cursors_bound_to_the_filter() {
    let store = shop().await;
    for customer in ["ada", "ada", "ada", "bob"] {
        place(&store, customer, &["tea"]).await;
    }
    let api = api(&store);
    let page = |after: &str| {
        format!(
            "{{ orders(first: 2, customerId: \"ada\"{after}) {{ nodes {{ customerId }} \
               pageInfo {{ hasNextPage endCursor }} }} }}"
        )
    };
    let first = run(&api, &page("")).await;
    assert_eq!(first["data"]["orders"]["pageInfo"]["hasNextPage"], true);
    let cursor = first["data"]["orders"]["pageInfo"]["endCursor"]
        .as_str()
        .expect("cursor")
        .to_owned();
    let second = run(&api, &page(&format!(", after: \"{cursor}\""))).await;
    assert_eq!(
        second["data"]["orders"]["nodes"],
        json!([{"customerId": "ada"}])
    );
    assert_eq!(second["data"]["orders"]["pageInfo"]["hasNextPage"], false);

    // The cursor of Ada's list is refused by the unfiltered list.
    let other = run(
        &api,
        &format!("{{ orders(after: \"{cursor}\") {{ nodes {{ id }} }} }}"),
    )
    .await;
    let error = &other["errors"][0];
    assert_eq!(error["extensions"]["class"], "permanent");
    assert_eq!(error["extensions"]["status"], 400);
    assert!(
        error["extensions"]["type"]
            .as_str()
            .expect("type")
            .contains("pagination:invalid_cursor"),
        "{error}"
    );
    assert_eq!(other["data"], Value::Null);
}

#[tokio::test]
async fn the_page_size_depth_and_complexity_are_bounded() {
    let store = shop().await;
    let api = api(&store);
    for first in [0, 101] {
        let answer = run(
            &api,
            &format!("{{ orders(first: {first}) {{ nodes {{ id }} }} }}"),
        )
        .await;
        let error = &answer["errors"][0];
        assert_eq!(error["extensions"]["class"], "permanent", "{answer}");
        assert!(
            error["extensions"]["type"]
                .as_str()
                .expect("type")
                .contains("pagination:invalid_limit"),
            "{answer}"
        );
    }

    let deep = "{ __schema { types { fields { type { ofType { ofType { ofType { ofType { ofType { ofType { name } } } } } } } } } } }";
    let answer = run(&api, deep).await;
    assert!(
        answer["errors"][0]["message"]
            .as_str()
            .expect("message")
            .contains("nested too deep"),
        "{answer}"
    );
    assert_eq!(
        answer["errors"][0]["extensions"]["type"],
        super::INVALID_QUERY
    );

    let costly = "{ orders(first: 100) { edges { cursor node { id customerId currency totalCents status createdAt \
                  customer { id orderCount totalSpentCents } items { sku qty unitPriceCents product { sku available } } \
                  saga { id status step attempts outcomeUnknown lastError updatedAt } } } } }";
    let answer = run(&api, costly).await;
    assert!(
        answer["errors"][0]["message"]
            .as_str()
            .expect("message")
            .contains("too complex"),
        "{answer}"
    );
    assert_eq!(answer["errors"][0]["extensions"]["class"], "permanent");
}

#[tokio::test]
async fn a_query_that_does_not_parse_or_names_nothing_is_a_graphql_error() {
    let store = shop().await;
    let api = api(&store);
    let nested = format!("{}{}", "{ a ".repeat(5_000), "}".repeat(5_000));
    for query in ["{ orders(", "{ nothing }", "", nested.as_str()] {
        let answer = run(&api, query).await;
        let error = &answer["errors"][0];
        assert_eq!(
            error["extensions"]["class"], "permanent",
            "{query}: {answer}"
        );
        assert_eq!(error["extensions"]["status"], 400, "{query}: {answer}");
    }
}

/// A store that is down.
struct Down;

#[async_trait]
impl ShopReads for Down {
    async fn orders_after(
        &self,
        _: Option<&str>,
        _: Option<&str>,
        _: usize,
    ) -> Result<Vec<Order>, StoreError> {
        Err(StoreError::Unavailable("the pool is closed".into()))
    }
    async fn orders(&self, _: &[String]) -> Result<Vec<Order>, StoreError> {
        Err(StoreError::Unavailable("the pool is closed".into()))
    }
    async fn customers(&self, _: &[String]) -> Result<Vec<Customer>, StoreError> {
        Err(StoreError::Unavailable("the pool is closed".into()))
    }
    async fn products(&self, _: &[String]) -> Result<Vec<Product>, StoreError> {
        Err(StoreError::Unavailable("the pool is closed".into()))
    }
    async fn sagas(&self, _: &[String]) -> Result<Vec<SagaRecord>, StoreError> {
        Err(StoreError::Unavailable("the pool is closed".into()))
    }
}

#[tokio::test]
async fn a_store_failure_is_a_retryable_error_with_its_retry_after() {
    let api = ShopGraphql::new(Arc::new(Down), pagination());
    let answer = run(&api, "{ order(id: \"x\") { id } }").await;
    let extensions = &answer["errors"][0]["extensions"];
    assert_eq!(extensions["class"], "retryable", "{answer}");
    assert_eq!(extensions["status"], 503);
    assert_eq!(extensions["retryAfterMs"], 1000);
    assert!(
        extensions["type"]
            .as_str()
            .expect("type")
            .contains("store_unavailable")
    );
}

/// Set `KEEL_WRITE_SCHEMA=1` and run this test to write the file after
/// a change to the schema.
#[test]
fn the_checked_in_schema_matches_the_code() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/schema.graphql");
    let sdl = ShopGraphql::sdl();
    if std::env::var_os("KEEL_WRITE_SCHEMA").is_some() {
        std::fs::write(path, &sdl).expect("write the schema");
    }
    let checked_in = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        checked_in == sdl,
        "apps/keel/schema.graphql is not the schema the code serves; \
         run this test with KEEL_WRITE_SCHEMA=1 to update it"
    );
}
