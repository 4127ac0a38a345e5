//! The GraphQL types over the shop: orders as a keyset-paginated
//! connection, each order's customer, items, products and saga.

use std::sync::Arc;

use async_graphql::connection::{Connection, Edge};
use async_graphql::{ComplexObject, Context, Enum, ID, Object, Result, SimpleObject};
use keel_http::pagination::{Cursor, Pagination, list_scope};
use keel_store::SagaRecord;

use super::errors::{page_error, store_error};
use super::loaders::{Loaders, PageWants, ShopReads};
use crate::shop::model::{self, Order};

/// The path whose cursors the `orders` connection shares with REST.
const ORDERS_PATH: &str = "/orders";

/// What one `order(id:)` adds to a query's complexity: a store read (the
/// loader batches them, a hundred at a time), ten times a plain field, so
/// that a query of a thousand aliases is refused before it runs.
const ORDER_READ_COST: usize = 10;

/// The root of every query.
pub struct Query;

#[Object]
impl Query {
    /// Orders, oldest first, `first` at a time (1 to 100, default 20),
    /// after the `after` cursor: the same signed cursors as `GET /orders`
    /// with the same `customerId` filter.
    #[graphql(complexity = "first.unwrap_or(20).clamp(1, 100) as usize * child_complexity")]
    async fn orders(
        &self,
        ctx: &Context<'_>,
        first: Option<i64>,
        after: Option<String>,
        customer_id: Option<String>,
    ) -> Result<Connection<String, OrderNode>> {
        let pagination = ctx.data::<Pagination>()?;
        let reads = ctx.data::<Arc<dyn ShopReads>>()?;
        let filters = customer_id
            .iter()
            .map(|id| ("customerId".to_owned(), id.clone()));
        let page = pagination
            .request::<String, String>(list_scope(ORDERS_PATH, filters), first, after.as_deref())
            .map_err(|rejection| page_error(&rejection))?;
        let rows = reads
            .orders_after(
                page.after().map(|c| c.id.as_str()),
                customer_id.as_deref(),
                page.fetch_limit() as usize,
            )
            .await
            .map_err(|e| store_error(&e))?;
        let more = rows.len() > page.limit() as usize;
        let rows: Vec<Order> = rows.into_iter().take(page.limit() as usize).collect();
        ctx.data::<Loaders>()?
            .prime_page(&rows, page_wants(ctx))
            .await
            .map_err(|e| store_error(&e))?;
        let mut connection = Connection::new(page.after().is_some(), more);
        for order in rows {
            let position = Cursor::new(order.id.clone(), order.id.clone());
            let cursor = pagination
                .codec()
                .encode(page.scope(), &position)
                .map_err(|e| async_graphql::Error::new(e.to_string()))?;
            connection
                .edges
                .push(Edge::new(cursor, OrderNode::from(order)));
        }
        Ok(connection)
    }

    /// One order by id, or `null`. Every `order` of a query (under as many
    /// aliases as it likes) is read in one batch, and each counts as a
    /// store read in the query's complexity.
    #[graphql(complexity = "ORDER_READ_COST + child_complexity")]
    async fn order(&self, ctx: &Context<'_>, id: ID) -> Result<Option<OrderNode>> {
        let loaders = ctx.data::<Loaders>()?;
        loaders.prime_orders(|| top_level_order_ids(ctx)).await;
        let order = loaders
            .orders
            .load_one(id.to_string())
            .await
            .map_err(|e| store_error(&e))?;
        Ok(order.flatten().map(OrderNode::from))
    }
}

/// The ids of the operation's top-level `order(id:)` fields, written
/// inline or as variables (those under fragments load one by one, in the
/// DataLoader's own batches).
fn top_level_order_ids(ctx: &Context<'_>) -> Vec<String> {
    use async_graphql::Value;
    use async_graphql::parser::types::Selection;
    let env = &ctx.query_env;
    env.operation
        .node
        .selection_set
        .node
        .items
        .iter()
        .filter_map(|selection| match &selection.node {
            Selection::Field(field) if field.node.name.node == "order" => {
                field.node.get_argument("id")
            }
            _ => None,
        })
        .filter_map(|id| {
            let variable = |name| env.variables.get(&name).cloned().ok_or(());
            match id.node.clone().into_const_with(variable) {
                Ok(Value::String(id)) => Some(id),
                _ => None,
            }
        })
        .collect()
}

/// What the query asks of each order of the page, whether through `edges
/// { node }` or `nodes`.
fn page_wants(ctx: &Context<'_>) -> PageWants {
    let look = ctx.look_ahead();
    let asks = |field: &str, then: Option<&str>| {
        [look.field("edges").field("node"), look.field("nodes")]
            .iter()
            .any(|order| match then {
                Some(inner) => order.field(field).field(inner).exists(),
                None => order.field(field).exists(),
            })
    };
    PageWants {
        customers: asks("customer", None),
        products: asks("items", Some("product")),
        sagas: asks("saga", None),
    }
}

/// Where an order's fulfilment is.
#[derive(Enum, Copy, Clone, Eq, PartialEq)]
#[graphql(remote = "crate::shop::model::OrderStatus")]
pub enum OrderStatus {
    /// Accepted; fulfilment runs.
    Pending,
    /// Reserved, charged and shipped.
    Completed,
    /// Fulfilment failed and was undone.
    Compensated,
    /// Needs an operator.
    Stuck,
    /// Cancelled by an operator.
    Cancelled,
}

/// An accepted order.
#[derive(SimpleObject)]
#[graphql(complex, name = "Order")]
pub(super) struct OrderNode {
    /// The order id.
    id: ID,
    /// Who ordered.
    customer_id: String,
    /// The currency of every amount.
    currency: String,
    /// The sum of `qty × unitPriceCents`.
    total_cents: i64,
    /// Where fulfilment is.
    status: OrderStatus,
    /// When it was accepted (RFC 3339).
    created_at: String,
    #[graphql(skip)]
    items: Vec<model::Item>,
}

impl From<Order> for OrderNode {
    fn from(order: Order) -> Self {
        Self {
            id: ID(order.id),
            customer_id: order.customer_id,
            currency: order.currency,
            total_cents: order.total_cents,
            status: order.status.into(),
            created_at: order.created_at,
            items: order.items,
        }
    }
}

#[ComplexObject]
impl OrderNode {
    /// Who ordered (one customer query for the whole page).
    async fn customer(&self, ctx: &Context<'_>) -> Result<Option<CustomerNode>> {
        let loaders = ctx.data::<Loaders>()?;
        let customer = loaders
            .customers
            .load_one(self.customer_id.clone())
            .await
            .map_err(|e| store_error(&e))?;
        Ok(customer.flatten().map(CustomerNode::from))
    }

    /// The lines of the order.
    async fn items(&self) -> Vec<ItemNode> {
        self.items.iter().map(ItemNode::from).collect()
    }

    /// The fulfilment saga, once it started.
    async fn saga(&self, ctx: &Context<'_>) -> Result<Option<SagaNode>> {
        let loaders = ctx.data::<Loaders>()?;
        let saga = loaders
            .sagas
            .load_one(self.id.to_string())
            .await
            .map_err(|e| store_error(&e))?;
        Ok(saga.flatten().as_ref().map(SagaNode::from))
    }
}

/// A line of an order.
#[derive(SimpleObject)]
#[graphql(complex, name = "OrderItem")]
pub(super) struct ItemNode {
    /// The SKU.
    sku: String,
    /// How many units.
    qty: u32,
    /// The price of one unit, in cents.
    unit_price_cents: i64,
}

impl From<&model::Item> for ItemNode {
    fn from(item: &model::Item) -> Self {
        Self {
            sku: item.sku.clone(),
            qty: item.qty,
            unit_price_cents: item.unit_price_cents,
        }
    }
}

#[ComplexObject]
impl ItemNode {
    /// The product, or `null` when the SKU is not stocked.
    async fn product(&self, ctx: &Context<'_>) -> Result<Option<ProductNode>> {
        let loaders = ctx.data::<Loaders>()?;
        let product = loaders
            .products
            .load_one(self.sku.clone())
            .await
            .map_err(|e| store_error(&e))?;
        Ok(product.flatten().map(|p| ProductNode {
            sku: p.sku,
            available: p.available,
        }))
    }
}

/// A product.
#[derive(SimpleObject)]
#[graphql(name = "Product")]
pub(super) struct ProductNode {
    /// Its SKU.
    sku: String,
    /// Units in stock.
    available: i64,
}

/// A customer, as their orders describe them.
#[derive(SimpleObject)]
#[graphql(name = "Customer")]
pub(super) struct CustomerNode {
    /// The customer's id.
    id: ID,
    /// How many orders they placed.
    order_count: i64,
    /// The sum of their orders' totals, in cents.
    total_spent_cents: i64,
}

impl From<model::Customer> for CustomerNode {
    fn from(customer: model::Customer) -> Self {
        Self {
            id: ID(customer.id),
            order_count: customer.order_count,
            total_spent_cents: customer.total_spent_cents,
        }
    }
}

/// An order's fulfilment saga.
#[derive(SimpleObject)]
#[graphql(name = "Saga")]
pub(super) struct SagaNode {
    /// The saga's id (the order's).
    id: ID,
    /// `running`, `compensating`, `completed`, `compensated`, `stuck` or
    /// `cancelled`.
    status: String,
    /// The step it is at.
    step: u32,
    /// Attempts of that step so far.
    attempts: u32,
    /// Whether the last attempt's outcome is unknown.
    outcome_unknown: bool,
    /// What the last error was, as a stable code: `outcome_unknown` (the
    /// last attempt may have taken effect) or `step_failed`; `null` if none.
    /// Never the error's text, which names internal services and addresses:
    /// operators read it in the admin API and the logs.
    last_error: Option<String>,
    /// When it last changed (RFC 3339).
    updated_at: String,
}

impl From<&SagaRecord> for SagaNode {
    fn from(saga: &SagaRecord) -> Self {
        Self {
            id: ID(saga.id.clone()),
            status: saga.status.as_str().to_owned(),
            step: saga.step,
            attempts: saga.attempts,
            outcome_unknown: saga.outcome_unknown,
            last_error: saga.last_error.as_ref().map(|_| {
                if saga.outcome_unknown {
                    "outcome_unknown".to_owned()
                } else {
                    "step_failed".to_owned()
                }
            }),
            updated_at: saga.updated_at.to_rfc3339(),
        }
    }
}
