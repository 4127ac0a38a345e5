//! The DataLoaders: each batches the keys one request asks for into ONE
//! query, and they are built PER REQUEST ([`Loaders::for_request`]).
//!
//! Why per request: a loader caches what it loaded, and a
//! process-wide loader would hand one caller's cached rows to the next,
//! whoever they are: a data leak, and stale reads besides. The only way to
//! run a query is [`ShopGraphql::execute`](super::ShopGraphql::execute),
//! which builds a fresh set each time, so the per-request rule is the easy
//! path rather than a convention.
//!
//! A batch answers with an entry for EVERY key it was asked, `None` for a
//! key the store does not know, so a miss is cached like a hit and never
//! asked again; async-graphql hands every caller the value of its own key,
//! whatever order the store returned rows in.
//!
//! A page primes the loaders with all of its keys at once
//! ([`Loaders::prime_page`]): the loader's own batching collects the keys
//! that arrive within a 1 ms window, so on a busy machine a page's keys
//! could land in two batches; primed, a page costs one statement per kind
//! whatever the timing, and each order's resolver reads from the cache.

use std::collections::HashMap;
use std::sync::Arc;

use async_graphql::dataloader::{DataLoader, HashMapCache, Loader};
use async_trait::async_trait;
use keel_store::SagaRecord;
use keel_store::StoreError;

use crate::shop::ShopStore;
use crate::shop::model::{Customer, Order, Product};

/// When this many keys wait, the loader runs their batch at once instead
/// of waiting out its collection window (a primed page's keys go in one
/// batch however many there are).
pub const MAX_BATCH: usize = 100;

/// What the GraphQL API reads, type-erased so its resolvers are not
/// generic over the store.
#[async_trait]
pub trait ShopReads: Send + Sync + 'static {
    /// A page of orders (see [`ShopDb::orders_after`](crate::shop::db::ShopDb::orders_after)).
    async fn orders_after(
        &self,
        after: Option<&str>,
        customer: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Order>, StoreError>;
    /// Orders by id, in one statement.
    async fn orders(&self, ids: &[String]) -> Result<Vec<Order>, StoreError>;
    /// Customers by id, in one statement.
    async fn customers(&self, ids: &[String]) -> Result<Vec<Customer>, StoreError>;
    /// Products by SKU, in one statement.
    async fn products(&self, skus: &[String]) -> Result<Vec<Product>, StoreError>;
    /// Sagas by id, in one statement.
    async fn sagas(&self, ids: &[String]) -> Result<Vec<SagaRecord>, StoreError>;
}

#[async_trait]
impl<S: ShopStore> ShopReads for S {
    async fn orders_after(
        &self,
        after: Option<&str>,
        customer: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Order>, StoreError> {
        crate::shop::db::ShopDb::orders_after(self, after, customer, limit).await
    }

    async fn orders(&self, ids: &[String]) -> Result<Vec<Order>, StoreError> {
        crate::shop::db::ShopDb::orders_by_id(self, ids).await
    }

    async fn customers(&self, ids: &[String]) -> Result<Vec<Customer>, StoreError> {
        crate::shop::db::ShopDb::customers(self, ids).await
    }

    async fn products(&self, skus: &[String]) -> Result<Vec<Product>, StoreError> {
        crate::shop::db::ShopDb::products(self, skus).await
    }

    async fn sagas(&self, ids: &[String]) -> Result<Vec<SagaRecord>, StoreError> {
        keel_store::SagaStore::saga_get_many(self, ids).await
    }
}

/// The shop's reads, with its products (their stock levels) read where
/// the inventory keeps them.
pub struct ShopView<S> {
    /// Orders, customers and sagas.
    pub shop: S,
    /// Stock levels.
    pub inventory: S,
}

#[async_trait]
impl<S: ShopStore> ShopReads for ShopView<S> {
    async fn orders_after(
        &self,
        after: Option<&str>,
        customer: Option<&str>,
        limit: usize,
    ) -> Result<Vec<Order>, StoreError> {
        ShopReads::orders_after(&self.shop, after, customer, limit).await
    }

    async fn orders(&self, ids: &[String]) -> Result<Vec<Order>, StoreError> {
        ShopReads::orders(&self.shop, ids).await
    }

    async fn customers(&self, ids: &[String]) -> Result<Vec<Customer>, StoreError> {
        ShopReads::customers(&self.shop, ids).await
    }

    async fn products(&self, skus: &[String]) -> Result<Vec<Product>, StoreError> {
        ShopReads::products(&self.inventory, skus).await
    }

    async fn sagas(&self, ids: &[String]) -> Result<Vec<SagaRecord>, StoreError> {
        ShopReads::sagas(&self.shop, ids).await
    }
}

/// Loads orders by id.
pub struct OrderLoader(Arc<dyn ShopReads>);
/// Loads customers by id.
pub struct CustomerLoader(Arc<dyn ShopReads>);
/// Loads products by SKU.
pub struct ProductLoader(Arc<dyn ShopReads>);
/// Loads an order's saga by the order id (the saga's id).
pub struct SagaLoader(Arc<dyn ShopReads>);

/// A store failure, shared by every key of the failed batch.
pub type LoadError = Arc<StoreError>;

/// Every key asked, with what was found under it (`None` when nothing).
fn answer<V>(
    keys: &[String],
    found: Vec<V>,
    key: impl Fn(&V) -> &str,
) -> HashMap<String, Option<V>> {
    let mut answers: HashMap<String, Option<V>> = keys.iter().map(|k| (k.clone(), None)).collect();
    for value in found {
        answers.insert(key(&value).to_owned(), Some(value));
    }
    answers
}

impl Loader<String> for OrderLoader {
    type Value = Option<Order>;
    type Error = LoadError;

    async fn load(&self, keys: &[String]) -> Result<HashMap<String, Option<Order>>, LoadError> {
        let found = self.0.orders(keys).await.map_err(Arc::new)?;
        Ok(answer(keys, found, |o| &o.id))
    }
}

impl Loader<String> for CustomerLoader {
    type Value = Option<Customer>;
    type Error = LoadError;

    async fn load(&self, keys: &[String]) -> Result<HashMap<String, Option<Customer>>, LoadError> {
        let found = self.0.customers(keys).await.map_err(Arc::new)?;
        Ok(answer(keys, found, |c| &c.id))
    }
}

impl Loader<String> for ProductLoader {
    type Value = Option<Product>;
    type Error = LoadError;

    async fn load(&self, keys: &[String]) -> Result<HashMap<String, Option<Product>>, LoadError> {
        let found = self.0.products(keys).await.map_err(Arc::new)?;
        Ok(answer(keys, found, |p| &p.sku))
    }
}

impl Loader<String> for SagaLoader {
    type Value = Option<SagaRecord>;
    type Error = LoadError;

    async fn load(
        &self,
        keys: &[String],
    ) -> Result<HashMap<String, Option<SagaRecord>>, LoadError> {
        let found = self.0.sagas(keys).await.map_err(Arc::new)?;
        Ok(answer(keys, found, |s| &s.id))
    }
}

/// One request's loaders. Not `Clone`, and built only by
/// [`for_request`](Self::for_request): a set never outlives its request.
pub struct Loaders {
    /// Orders by id (every `order(id:)` of a query, aliases included).
    pub orders: DataLoader<OrderLoader, HashMapCache>,
    /// Set once the query's top-level `order(id:)` fields were loaded in
    /// one batch ([`prime_orders`](Self::prime_orders)).
    orders_primed: tokio::sync::OnceCell<()>,
    /// Customers by id.
    pub customers: DataLoader<CustomerLoader, HashMapCache>,
    /// Products by SKU.
    pub products: DataLoader<ProductLoader, HashMapCache>,
    /// Sagas by order id.
    pub sagas: DataLoader<SagaLoader, HashMapCache>,
}

impl Loaders {
    /// A fresh set, with empty caches, for one request.
    pub fn for_request(reads: &Arc<dyn ShopReads>) -> Self {
        fn loader<L: Loader<String>>(loader: L) -> DataLoader<L, HashMapCache> {
            DataLoader::with_cache(loader, tokio::spawn, HashMapCache::default())
                .max_batch_size(MAX_BATCH)
        }
        Self {
            orders: loader(OrderLoader(Arc::clone(reads))),
            orders_primed: tokio::sync::OnceCell::new(),
            customers: loader(CustomerLoader(Arc::clone(reads))),
            products: loader(ProductLoader(Arc::clone(reads))),
            sagas: loader(SagaLoader(Arc::clone(reads))),
        }
    }

    /// Loads every id in `ids` into the orders loader's cache in one batch
    /// (of up to [`MAX_BATCH`]), once per request: the first `order(id:)`
    /// field to ask does it for its siblings, which wait for it and then
    /// read the cache. The DataLoader's own batching collects keys for a
    /// millisecond, which a loaded machine can miss; this cannot. A failed
    /// load is left to each field's own.
    pub async fn prime_orders(&self, ids: impl FnOnce() -> Vec<String>) {
        self.orders_primed
            .get_or_init(|| async {
                let _ = self.orders.load_many(ids()).await;
            })
            .await;
    }

    /// Loads, for a page of `orders`, what the query asks of them (`wants`),
    /// each kind in one batch with all of the page's keys, the kinds
    /// concurrently.
    pub async fn prime_page(&self, orders: &[Order], wants: PageWants) -> Result<(), LoadError> {
        let keys = |of: &dyn Fn(&Order) -> Vec<String>| -> Vec<String> {
            let mut keys: Vec<String> = orders.iter().flat_map(of).collect();
            keys.sort();
            keys.dedup();
            keys
        };
        let customers = keys(&|o| vec![o.customer_id.clone()]);
        let products = keys(&|o| o.items.iter().map(|i| i.sku.clone()).collect());
        let sagas = keys(&|o| vec![o.id.clone()]);
        let (c, p, s) = tokio::join!(
            async {
                if wants.customers {
                    self.customers.load_many(customers).await.map(drop)
                } else {
                    Ok(())
                }
            },
            async {
                if wants.products {
                    self.products.load_many(products).await.map(drop)
                } else {
                    Ok(())
                }
            },
            async {
                if wants.sagas {
                    self.sagas.load_many(sagas).await.map(drop)
                } else {
                    Ok(())
                }
            },
        );
        c.and(p).and(s)
    }
}

/// What a page's query asks of each order, beyond its own columns.
#[derive(Debug, Clone, Copy, Default)]
pub struct PageWants {
    /// `customer`.
    pub customers: bool,
    /// `items { product }`.
    pub products: bool,
    /// `saga`.
    pub sagas: bool,
}
