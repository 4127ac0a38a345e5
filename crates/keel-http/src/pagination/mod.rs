//! Keyset pagination: pages that cost the same at row 10 and row 10
//! million, and never show a row twice or skip one while rows are inserted.
//!
//! `OFFSET` pagination makes the database count and throw away every row
//! before the page, and when a row is inserted while a client pages,
//! everything shifts by one: the client sees an item twice, or never. A
//! *seek* instead continues after the last row seen: `WHERE
//! (created_at, id) < (?, ?) ORDER BY created_at DESC, id DESC LIMIT ?`,
//! which an index on `(created_at, id)` answers directly, and which is
//! unaffected by rows inserted before or after the position.
//!
//! - [`Cursor`]: the position, a `(sort key, id)` pair; the id breaks ties.
//! - [`CursorCodec`]: makes a cursor opaque and tamper-evident: versioned,
//!   base64url, HMAC-SHA256-signed with a server key (verified in constant
//!   time), bound to the list it was issued for. Clients cannot build one,
//!   so the index choice never becomes a public API.
//! - [`PageRequest`]: the axum extractor for `?limit=&cursor=` (limit
//!   default 20, 1 to 100), every violation a `400` problem.
//! - [`Seek`]: the SQL predicate and `ORDER BY` for either direction.
//! - [`Page`]: `{"items": [...], "nextCursor": ...}`, with no next cursor
//!   at the end (one extra row is fetched to know).
//!
//! ```
//! use axum::{Router, body::Body, extract::State, http::Request, routing::get};
//! use keel_http::pagination::{Cursor, CursorCodec, CursorError, Page, PageRequest, Pagination};
//! use tower::ServiceExt;
//!
//! // Rows as (created_at, id), newest first: what
//! // `SELECT ... WHERE (created_at, id) < (?, ?) ORDER BY created_at DESC, id DESC`
//! // returns. A real handler runs that query with `page.fetch_limit()`.
//! async fn list(page: PageRequest<i64, i64>) -> Result<Page<(i64, i64)>, CursorError> {
//!     let all: Vec<(i64, i64)> = (1..=5).rev().map(|i| (1_000 + i, i)).collect();
//!     let rows = all
//!         .into_iter()
//!         .filter(|&(t, id)| page.after().is_none_or(|c| (t, id) < (c.sort, c.id)))
//!         .take(page.fetch_limit() as usize)
//!         .collect();
//!     page.page(rows, |&(t, id)| Cursor::new(t, id))
//! }
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
//! let codec = CursorCodec::new(*b"0123456789abcdef0123456789abcdef")?;
//! let app = Router::new()
//!     .route("/orders", get(list))
//!     .with_state(Pagination::new(codec));
//!
//! let response = app.clone().oneshot(Request::get("/orders?limit=3").body(Body::empty())?).await?;
//! let body = axum::body::to_bytes(response.into_body(), 1 << 20).await?;
//! let first: Page<(i64, i64)> = serde_json::from_slice(&body)?;
//! assert_eq!(first.items, [(1005, 5), (1004, 4), (1003, 3)]);
//!
//! let next = format!("/orders?limit=3&cursor={}", first.next_cursor.expect("more rows"));
//! let response = app.oneshot(Request::get(next).body(Body::empty())?).await?;
//! let body = axum::body::to_bytes(response.into_body(), 1 << 20).await?;
//! let last: Page<(i64, i64)> = serde_json::from_slice(&body)?;
//! assert_eq!(last.items, [(1002, 2), (1001, 1)]);
//! assert_eq!(last.next_cursor, None);
//! # Ok(()) }
//! ```

mod cursor;
mod request;
mod seek;

pub use cursor::{
    CURSOR_VERSION, Cursor, CursorCodec, CursorError, CursorKeyError, DEFAULT_MAX_CURSOR_LEN,
    MIN_KEY_LEN,
};
pub use request::{
    CURSOR_PARAM, DEFAULT_LIMIT, DEFAULT_MAX_LIMIT, InvalidLimits, LIMIT_PARAM, Page,
    PageRejection, PageRequest, Pagination, list_scope,
};
pub use seek::{InvalidColumn, Order, Seek};

#[cfg(test)]
mod tests;
