//! Keyset pagination over a real SQLite table: walking every page returns
//! every row once and in order (both directions), no next cursor at the
//! end, stability under concurrent inserts, and a `400` problem for every
//! bad cursor and limit.
#![cfg(feature = "pagination")]

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering as AtomicOrdering};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{FromRef, Query, State};
use axum::http::{HeaderMap, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use keel_http::pagination::{Cursor, CursorCodec, Order, Page, PageRequest, Pagination, Seek};
use keel_http::problem::{PROBLEM_JSON, Problem};
use keel_sqlite::SqliteStore;
use serde::{Deserialize, Serialize};
use sqlx::SqlitePool;
use tempfile::TempDir;
use tower::ServiceExt;

const KEY: [u8; 32] = *b"pagination-test-key-32-bytes-ok!";

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, sqlx::FromRow)]
#[serde(rename_all = "camelCase")]
struct Row {
    id: i64,
    created_at: i64,
}

#[derive(Clone)]
struct AppState {
    pagination: Pagination,
    pool: SqlitePool,
}

impl FromRef<AppState> for Pagination {
    fn from_ref(state: &AppState) -> Self {
        state.pagination.clone()
    }
}

#[derive(Deserialize)]
struct Sort {
    order: Option<Order>,
}

/// `GET /orders?order=asc|desc&limit=&cursor=`: a keyset seek.
async fn list_orders(
    State(state): State<AppState>,
    Query(sort): Query<Sort>,
    page: PageRequest<i64, i64>,
) -> Result<Page<Row>, Response> {
    let seek = Seek::new("created_at", "id", sort.order.unwrap_or_default())
        .map_err(|e| Problem::internal(e).into_response())?;
    let rows: Vec<Row> = match page.after() {
        Some(after) => {
            let sql = format!(
                "SELECT id, created_at FROM orders WHERE {} ORDER BY {} LIMIT ?3",
                seek.predicate("?1", "?2"),
                seek.order_by()
            );
            sqlx::query_as(sqlx::AssertSqlSafe(sql.as_str()))
                .bind(after.sort)
                .bind(after.id)
                .bind(page.fetch_limit())
                .fetch_all(&state.pool)
                .await
        }
        None => {
            let sql = format!(
                "SELECT id, created_at FROM orders ORDER BY {} LIMIT ?1",
                seek.order_by()
            );
            sqlx::query_as(sqlx::AssertSqlSafe(sql.as_str()))
                .bind(page.fetch_limit())
                .fetch_all(&state.pool)
                .await
        }
    }
    .map_err(|e| Problem::internal(e).into_response())?;
    page.page(rows, |row| Cursor::new(row.created_at, row.id))
        .map_err(IntoResponse::into_response)
}

struct Fixture {
    app: Router,
    pool: SqlitePool,
    _store: SqliteStore,
    _dir: TempDir,
}

/// A table of `rows` orders with ids shuffled against their timestamps and
/// three orders per timestamp (so the id must break ties).
async fn fixture(rows: i64) -> Fixture {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("shop.db"))
        .await
        .expect("open store");
    let pool = store.pool().clone();
    sqlx::query("CREATE TABLE orders (id INTEGER PRIMARY KEY, created_at INTEGER NOT NULL)")
        .execute(&pool)
        .await
        .expect("create table");
    sqlx::query("CREATE INDEX orders_seek ON orders (created_at, id)")
        .execute(&pool)
        .await
        .expect("create index");
    let mut ids: Vec<i64> = (1..=rows).map(|i| i * 10).collect();
    fastrand::Rng::with_seed(7).shuffle(&mut ids);
    for (i, id) in ids.into_iter().enumerate() {
        insert(&pool, id, 1_000 + i as i64 / 3).await;
    }
    let state = AppState {
        pagination: Pagination::new(CursorCodec::new(KEY).expect("key")),
        pool: pool.clone(),
    };
    let app = Router::new()
        .route("/orders", get(list_orders))
        .route("/customers", get(list_orders))
        .with_state(state);
    Fixture {
        app,
        pool,
        _store: store,
        _dir: dir,
    }
}

async fn insert(pool: &SqlitePool, id: i64, created_at: i64) {
    sqlx::query("INSERT INTO orders (id, created_at) VALUES (?1, ?2)")
        .bind(id)
        .bind(created_at)
        .execute(pool)
        .await
        .expect("insert");
}

async fn all_rows(pool: &SqlitePool, order: Order) -> Vec<Row> {
    let sql = format!(
        "SELECT id, created_at FROM orders ORDER BY created_at {0}, id {0}",
        order.keyword()
    );
    sqlx::query_as(sqlx::AssertSqlSafe(sql.as_str()))
        .fetch_all(pool)
        .await
        .expect("select")
}

async fn get_raw(app: &Router, uri: &str) -> (StatusCode, HeaderMap, Bytes) {
    let request = Request::get(uri).body(Body::empty()).expect("request");
    let response = app.clone().oneshot(request).await.expect("infallible");
    let (parts, body) = response.into_parts();
    let body = axum::body::to_bytes(body, usize::MAX).await.expect("body");
    (parts.status, parts.headers, body)
}

async fn get_page(app: &Router, uri: &str) -> Page<Row> {
    let (status, _, body) = get_raw(app, uri).await;
    assert_eq!(
        status,
        StatusCode::OK,
        "{uri}: {}",
        String::from_utf8_lossy(&body)
    );
    serde_json::from_slice(&body).expect("page json")
}

fn with_cursor(base: &str, cursor: &str) -> String {
    let sep = if base.contains('?') { '&' } else { '?' };
    format!("{base}{sep}cursor={cursor}")
}

/// Follows `nextCursor` from the first page to the end; checks every page's
/// size on the way.
async fn walk(app: &Router, base: &str, limit: usize) -> Vec<Row> {
    let mut seen = Vec::new();
    let mut uri = base.to_owned();
    for _ in 0..10_000 {
        let page = get_page(app, &uri).await;
        assert!(page.items.len() <= limit, "page over the limit");
        seen.extend(page.items.iter().copied());
        match page.next_cursor {
            Some(cursor) => {
                assert_eq!(page.items.len(), limit, "only the last page is short");
                uri = with_cursor(base, &cursor);
            }
            None => return seen,
        }
    }
    panic!("pagination did not end");
}

fn assert_problem(status: StatusCode, headers: &HeaderMap, body: &Bytes, needle: &str) {
    assert_eq!(
        status,
        StatusCode::BAD_REQUEST,
        "{}",
        String::from_utf8_lossy(body)
    );
    assert_eq!(headers[header::CONTENT_TYPE], PROBLEM_JSON);
    let problem: serde_json::Value = serde_json::from_slice(body).expect("problem json");
    let detail = problem["detail"].as_str().expect("detail");
    assert!(
        detail.contains(needle),
        "{detail:?} should mention {needle:?}"
    );
}

#[tokio::test]
async fn walking_all_pages_returns_every_row_once_in_order() {
    let fx = fixture(95).await;
    for (order, query) in [(Order::Desc, ""), (Order::Asc, "order=asc&")] {
        let expected = all_rows(&fx.pool, order).await;
        assert_eq!(expected.len(), 95);
        for limit in [1_usize, 7, 20, 94, 95, 100] {
            let base = format!("/orders?{query}limit={limit}");
            let seen = walk(&fx.app, &base, limit).await;
            assert_eq!(seen, expected, "{order:?}, limit {limit}");
        }
    }
    // Without `limit`: pages of 20.
    let first = get_page(&fx.app, "/orders").await;
    assert_eq!(first.items.len(), 20);
    assert_eq!(walk(&fx.app, "/orders", 20).await.len(), 95);
}

#[tokio::test]
async fn a_full_last_page_has_no_next_cursor() {
    let fx = fixture(40).await;
    let first = get_page(&fx.app, "/orders?limit=20").await;
    let cursor = first.next_cursor.expect("a second page");
    let last = get_page(&fx.app, &with_cursor("/orders?limit=20", &cursor)).await;
    assert_eq!(last.items.len(), 20, "the last page is full");
    assert_eq!(last.next_cursor, None, "and still says it is the last");
    let everything = get_page(&fx.app, "/orders?limit=40").await;
    assert_eq!((everything.items.len(), everything.next_cursor), (40, None));

    let empty = fixture(0).await;
    let page = get_page(&empty.app, "/orders").await;
    assert_eq!((page.items.len(), page.next_cursor), (0, None));
    let (_, _, body) = get_raw(&empty.app, "/orders").await;
    assert_eq!(body.as_ref(), br#"{"items":[],"nextCursor":null}"#);
}

#[tokio::test]
async fn pages_are_stable_under_inserts_between_pages() {
    let fx = fixture(60).await;
    for order in [Order::Desc, Order::Asc] {
        let initial = all_rows(&fx.pool, order).await;
        let base = format!("/orders?order={}&limit=10", order.keyword().to_lowercase());
        let mut seen: Vec<Row> = Vec::new();
        let mut uri = base.clone();
        let mut next_id = 1_000_001 + if order == Order::Asc { 10_000 } else { 0 };
        loop {
            let page = get_page(&fx.app, &uri).await;
            seen.extend(page.items.iter().copied());
            let Some(cursor) = page.next_cursor else {
                break;
            };
            // Between pages, rows arrive everywhere: newest, oldest, and
            // tied with the cursor's own timestamp on either side of its id.
            let last = *seen.last().expect("rows");
            for created_at in [5_000, 10, last.created_at, last.created_at] {
                insert(&fx.pool, next_id, created_at).await;
                next_id += 1;
            }
            // And one tied on the timestamp with an id just below.
            sqlx::query("INSERT OR IGNORE INTO orders (id, created_at) VALUES (?1, ?2)")
                .bind(last.id - 1)
                .bind(last.created_at)
                .execute(&fx.pool)
                .await
                .expect("insert");
            uri = with_cursor(&base, &cursor);
        }
        let mut unique = HashSet::new();
        for row in &seen {
            assert!(unique.insert(row.id), "{row:?} seen twice");
        }
        for row in &initial {
            assert!(
                unique.contains(&row.id),
                "{row:?} existed at the start and was skipped"
            );
        }
        for pair in seen.windows(2) {
            let (a, b) = (
                (pair[0].created_at, pair[0].id),
                (pair[1].created_at, pair[1].id),
            );
            match order {
                Order::Desc => assert!(a > b, "out of order: {a:?} then {b:?}"),
                Order::Asc => assert!(a < b, "out of order: {a:?} then {b:?}"),
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_are_stable_while_another_task_inserts() {
    let fx = fixture(200).await;
    let initial: HashMap<i64, Row> = all_rows(&fx.pool, Order::Desc)
        .await
        .into_iter()
        .map(|r| (r.id, r))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let inserted = Arc::new(AtomicI64::new(0));
    let writer = tokio::spawn({
        let (pool, stop, inserted) = (fx.pool.clone(), stop.clone(), inserted.clone());
        async move {
            let mut rng = fastrand::Rng::with_seed(42);
            let mut id = 2_000_000;
            while !stop.load(AtomicOrdering::Relaxed) {
                id += 1;
                insert(&pool, id, rng.i64(900..1_200)).await;
                inserted.fetch_add(1, AtomicOrdering::Relaxed);
                tokio::task::yield_now().await;
            }
        }
    });
    let seen = walk(&fx.app, "/orders?limit=7", 7).await;
    stop.store(true, AtomicOrdering::Relaxed);
    writer.await.expect("writer");
    assert!(
        inserted.load(AtomicOrdering::Relaxed) > 0,
        "the writer ran during the walk"
    );

    let mut unique = HashSet::new();
    for row in &seen {
        assert!(unique.insert(row.id), "{row:?} seen twice");
    }
    for id in initial.keys() {
        assert!(
            unique.contains(id),
            "row {id} existed at the start and was skipped"
        );
    }
    assert!(
        seen.windows(2)
            .all(|w| (w[0].created_at, w[0].id) > (w[1].created_at, w[1].id)),
        "pages stay in order"
    );
}

#[tokio::test]
async fn tampered_truncated_foreign_and_wrong_version_cursors_are_400() {
    let fx = fixture(30).await;
    let first = get_page(&fx.app, "/orders?limit=10").await;
    let cursor = first.next_cursor.expect("next");
    let ok = get_page(&fx.app, &with_cursor("/orders?limit=10", &cursor)).await;
    assert_eq!(ok.items.len(), 10);

    let bytes = URL_SAFE_NO_PAD.decode(&cursor).expect("base64url");
    let mut tampered = bytes.clone();
    // Change the position: `[1009,` -> `[1008,`-like edit of one digit.
    let digit = tampered.iter().position(u8::is_ascii_digit).expect("digit");
    tampered[digit] = if tampered[digit] == b'1' { b'2' } else { b'1' };
    let mut wrong_version = bytes.clone();
    wrong_version[0] = 2;
    let other_key = CursorCodec::new(*b"another-key-of-thirty-two-bytes!").expect("key");
    let forged = other_key
        .encode("/orders", &Cursor::new(1_005_i64, 10_i64))
        .expect("encode");

    let cases = [
        (URL_SAFE_NO_PAD.encode(&tampered), "signature"),
        (cursor[..cursor.len() - 5].to_owned(), "invalid cursor"),
        (cursor[..10].to_owned(), "invalid cursor"),
        (URL_SAFE_NO_PAD.encode(&wrong_version), "version 2"),
        (forged, "signature"),
        ("%25%25%25".to_owned(), "base64"),
        ("A".repeat(600), "limit is 512"),
    ];
    for (bad, needle) in cases {
        let (status, headers, body) =
            get_raw(&fx.app, &with_cursor("/orders?limit=10", &bad)).await;
        assert_problem(status, &headers, &body, needle);
        assert!(String::from_utf8_lossy(&body).contains("invalid cursor"));
    }

    // A genuine cursor of another list (path, or filters and sort) is refused.
    for other in ["/customers?limit=10", "/orders?limit=10&order=asc"] {
        let (status, headers, body) = get_raw(&fx.app, &with_cursor(other, &cursor)).await;
        assert_problem(status, &headers, &body, "another list");
    }
    // An empty cursor is the first page.
    let again = get_page(&fx.app, "/orders?limit=10&cursor=").await;
    assert_eq!(again.items, first.items);
}

#[tokio::test]
async fn limits_outside_1_to_100_are_400() {
    let fx = fixture(120).await;
    for (limit, needle) in [
        ("0", "out of range"),
        ("101", "out of range"),
        ("-5", "out of range"),
        ("99999999999999999999", "whole number"),
        ("abc", "whole number"),
        ("1.5", "whole number"),
        ("", "whole number"),
    ] {
        let (status, headers, body) = get_raw(&fx.app, &format!("/orders?limit={limit}")).await;
        assert_problem(status, &headers, &body, needle);
    }
    let (status, headers, body) = get_raw(&fx.app, "/orders?limit=5&limit=6").await;
    assert_problem(status, &headers, &body, "more than once");
    assert_eq!(get_page(&fx.app, "/orders?limit=1").await.items.len(), 1);
    assert_eq!(
        get_page(&fx.app, "/orders?limit=100").await.items.len(),
        100
    );
}
