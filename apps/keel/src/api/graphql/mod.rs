//! `POST /graphql`: the shop's orders, customers, items, products and
//! sagas over GraphQL (async-graphql), with DataLoaders built per request.
//!
//! # What it promises
//!
//! - **one query per kind, per request**: a page of 50 orders with their
//!   customers costs one orders query and one customer query, not 51; the
//!   loaders ([`loaders`]) batch what the resolvers ask for, `order(id:)`
//!   under any number of aliases included;
//! - **loaders per request**: [`ShopGraphql::execute`] is the only way to
//!   run a query, and it builds a fresh set of loaders each time, so no
//!   cached row ever crosses from one request (or customer) to another;
//! - **the same cursors as REST**: `orders(first, after, customerId)` takes
//!   and gives the signed cursors of `GET /orders?customerId=`, and its
//!   page size is bounded the same way (1 to 100);
//! - **bounded queries**: depth at most [`MAX_DEPTH`], complexity at most
//!   [`MAX_COMPLEXITY`] (a page counts `first ×` what each order asks for,
//!   an `order(id:)` ten, so a thousand aliases are refused),
//!   the body at most 64 KiB like every route;
//! - **nothing internal shown**: a saga's `lastError` is a stable code,
//!   never the error's text (which names internal services);
//! - **errors with Keel's classes**: every error's `extensions` has
//!   `class` (`retryable`, `permanent`, …), `type` and `status`, from the
//!   same problem mapping as REST, plus `retryAfterMs` when to come back;
//!   a query that does not parse is a GraphQL error too, never a 500;
//! - **deadline and trace as on REST**: the route sits behind the same
//!   deadline and trace layers, so a query stops with its deadline.
//!
//! The schema's SDL is served at `GET /graphql/schema.graphql` and checked
//! into the repository (`apps/keel/schema.graphql`); a test keeps the two
//! equal.

mod errors;
pub mod loaders;
mod schema;

use std::sync::Arc;

use async_graphql::{EmptyMutation, EmptySubscription, Schema, SchemaBuilder};
use axum::Json;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use keel_http::pagination::Pagination;

pub use errors::INVALID_QUERY;
use loaders::{Loaders, ShopReads};
pub use schema::Query;

/// The deepest a query may nest.
pub const MAX_DEPTH: usize = 10;

/// The most a query may cost: each field 1, a page of orders `first ×` its
/// orders' fields.
pub const MAX_COMPLEXITY: usize = 2_000;

/// The shop's schema.
pub type ShopSchema = Schema<Query, EmptyMutation, EmptySubscription>;

/// The GraphQL API over a store. Cheap to clone.
#[derive(Clone)]
pub struct ShopGraphql {
    schema: ShopSchema,
    reads: Arc<dyn ShopReads>,
}

impl std::fmt::Debug for ShopGraphql {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShopGraphql").finish_non_exhaustive()
    }
}

fn builder() -> SchemaBuilder<Query, EmptyMutation, EmptySubscription> {
    Schema::build(Query, EmptyMutation, EmptySubscription)
        .limit_depth(MAX_DEPTH)
        .limit_complexity(MAX_COMPLEXITY)
}

impl ShopGraphql {
    /// The API over `reads`, with the REST list's cursor signing.
    pub fn new(reads: Arc<dyn ShopReads>, pagination: Pagination) -> Self {
        let schema = builder().data(pagination).data(Arc::clone(&reads)).finish();
        Self { schema, reads }
    }

    /// The schema in SDL.
    pub fn sdl() -> String {
        builder().finish().sdl()
    }

    /// Runs one request with loaders of its own.
    pub async fn execute(&self, request: async_graphql::Request) -> async_graphql::Response {
        let request = request.data(Loaders::for_request(&self.reads));
        let mut response = self.schema.execute(request).await;
        response
            .errors
            .iter_mut()
            .for_each(errors::classify_query_error);
        let outcome = if response.errors.is_empty() {
            "ok"
        } else {
            "errors"
        };
        metrics::counter!("keel_graphql_requests_total", "outcome" => outcome).increment(1);
        response
    }

    /// `POST /graphql`, for any router state.
    pub fn query_route<St: Clone + Send + Sync + 'static>(&self) -> MethodRouter<St> {
        post(graphql).with_state(self.clone())
    }

    /// `GET /graphql/schema.graphql`: the SDL.
    pub fn sdl_route<St: Clone + Send + Sync + 'static>() -> MethodRouter<St> {
        get(sdl)
    }
}

/// A JSON GraphQL request (`{"query", "variables", "operationName"}`):
/// `200` with `data` and `errors`; a body that is not JSON is a `400` or
/// `415` problem, as on every route.
async fn graphql(State(api): State<ShopGraphql>, headers: HeaderMap, body: Bytes) -> Response {
    match keel_http::problem::parse_json::<async_graphql::Request>(&headers, &body) {
        Ok(request) => Json(api.execute(request).await).into_response(),
        Err(problem) => problem.into_response(),
    }
}

async fn sdl() -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        ShopGraphql::sdl(),
    )
        .into_response()
}

#[cfg(test)]
mod tests;
