//! `keel serve` over HTTP: bad input gets problem+json, retries are
//! replayed, pages walk without gaps, jobs answer 202 then 303, the demo
//! faults end in a dead letter and a stuck saga that operators can fix, and
//! the OpenAPI document lists every route.

use std::process::Command;
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{Value, json};

mod common;

use common::{ACME_KEY, Server, eventually, json_at, order, place, placed_id, serve};
use keel_testkit::services::{ServerLock, Service};

/// The admin token of the tests that use the admin API.
const ADMIN_TOKEN: &str = "serve-test-admin-token-0123";

async fn assert_problem(response: reqwest::Response, status: u16, what: &str) {
    assert_eq!(response.status().as_u16(), status, "{what}");
    let ct = response.headers()["content-type"]
        .to_str()
        .unwrap()
        .to_owned();
    assert_eq!(ct, "application/problem+json", "{what}");
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["status"], status, "{what}: {body}");
    assert!(
        body["detail"].as_str().is_some_and(|d| !d.is_empty()),
        "{what}: {body}"
    );
}

#[tokio::test]
async fn bad_input_is_refused_with_problem_json() {
    let s = serve(&[]);
    let http = reqwest::Client::new();
    let post = |key: Option<&str>, ct: &str, body: Vec<u8>| {
        let mut r = http
            .post(format!("{}/orders", s.url))
            .header("content-type", ct)
            .body(body);
        if let Some(k) = key {
            r = r.header("idempotency-key", k);
        }
        r.send()
    };
    let good = serde_json::to_vec(&order("c1")).unwrap();
    assert_problem(
        post(None, "application/json", good.clone()).await.unwrap(),
        400,
        "no key",
    )
    .await;
    assert_problem(
        post(Some("k-ct"), "text/plain", good.clone())
            .await
            .unwrap(),
        415,
        "not json",
    )
    .await;
    assert_problem(
        post(Some("k-mal"), "application/json", b"{".to_vec())
            .await
            .unwrap(),
        400,
        "malformed",
    )
    .await;
    for (i, bad) in [
        json!({"customerId": "", "currency": "USD", "items": [{"sku": "tea", "qty": 1, "unitPriceCents": 1}]}),
        json!({"customerId": "c", "currency": "usd", "items": [{"sku": "tea", "qty": 1, "unitPriceCents": 1}]}),
        json!({"customerId": "c", "currency": "USD", "items": []}),
        json!({"customerId": "c", "currency": "USD", "items": [{"sku": "tea", "qty": 0, "unitPriceCents": 1}]}),
        json!({"customerId": "c", "currency": "USD", "items": [{"sku": "tea", "qty": 1, "unitPriceCents": -5}]}),
        json!({"customerId": "c", "currency": "USD", "items": [{"sku": "tea", "qty": 1, "unitPriceCents": 1.5}]}),
        json!({"customerId": "c", "currency": "USD", "items": [{"sku": "tea", "qty": 1, "unitPriceCents": 1}], "extra": 1}),
        json!({"customerId": "c", "currency": "USD", "items": vec![json!({"sku": "tea", "qty": 1, "unitPriceCents": 1}); 51]}),
    ]
    .iter()
    .enumerate()
    {
        let key = format!("k-bad-{i}");
        assert_problem(place(&http, &s, &key, bad).await, 422, &format!("invalid order {i}")).await;
    }
    assert_eq!(
        status_of_declared_body(&s, 2 * 1024 * 1024).await,
        413,
        "a body declared over the limit is refused unread"
    );

    for (path, status, what) in [
        ("/orders/not-a-uuid!", 400, "bad id"),
        (
            "/orders/01a2273d-66a4-7662-b439-4d55ca045944",
            404,
            "unknown id",
        ),
        ("/orders?limit=0", 400, "limit 0"),
        ("/orders?limit=1000", 400, "limit too big"),
        ("/orders?cursor=forged", 400, "forged cursor"),
        ("/webhook-endpoints/ep/deliveries?limit=x", 400, "bad limit"),
        (
            "/webhook-endpoints/nope/deliveries",
            404,
            "unknown endpoint",
        ),
    ] {
        let r = http
            .get(format!("{}{path}", s.url))
            .bearer_auth(ACME_KEY)
            .send()
            .await
            .unwrap();
        assert_problem(r, status, what).await;
    }
    for (id, status, what) in [
        ("abc", 400, "bad delivery id"),
        ("424242", 404, "unknown delivery"),
    ] {
        let r = http
            .post(format!("{}/deliveries/{id}/resend", s.url))
            .bearer_auth(ACME_KEY)
            .send()
            .await
            .unwrap();
        assert_problem(r, status, what).await;
    }
    let r = http
        .post(format!("{}/webhook-endpoints", s.url))
        .bearer_auth(ACME_KEY)
        .json(&json!({"url": "http://169.254.169.254/latest"}))
        .send()
        .await
        .unwrap();
    assert_problem(r, 422, "ssrf").await;
    let r = http
        .post(format!("{}/webhooks/inbound/partner", s.url))
        .header("content-type", "application/json")
        .body("{}")
        .send()
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        StatusCode::BAD_REQUEST,
        "unsigned inbound webhook"
    );
    let r = http
        .get(format!("{}/orders", s.url))
        .header("x-request-deadline-unix-ms", "soon")
        .send()
        .await
        .unwrap();
    assert_problem(r, 400, "bad deadline").await;
    // A malformed traceparent starts a new trace (W3C Trace Context): a
    // client's broken tracer never fails its requests.
    let r = http
        .get(format!("{}/orders", s.url))
        .header("traceparent", "nonsense")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK, "bad traceparent ignored");
    assert_eq!(r.headers()["x-trace-id"].len(), 32, "a new trace");
    // PATCH is not an orders method: 405 naming the ones there are, not
    // the idempotency layer's missing-key 400.
    let r = http
        .patch(format!("{}/orders", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(r.headers()["allow"], "GET,HEAD,POST");
    // The server is still fine.
    let livez = http.get(format!("{}/livez", s.url)).send().await.unwrap();
    assert_eq!(livez.status(), StatusCode::OK);
    assert_eq!(
        place(&http, &s, "k-ok", &order("c1")).await.status(),
        StatusCode::CREATED
    );
}

#[tokio::test]
async fn a_retried_order_is_replayed_not_placed_twice() {
    let s = serve(&[]);
    let http = reqwest::Client::new();
    let first = place(&http, &s, "retry-1", &order("c9")).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let first: Value = first.json().await.unwrap();
    let again = place(&http, &s, "retry-1", &order("c9")).await;
    assert_eq!(again.status(), StatusCode::CREATED);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    let again: Value = again.json().await.unwrap();
    assert_eq!(first["id"], again["id"]);
    // The same key for another order is refused.
    let other = place(&http, &s, "retry-1", &order("c8")).await;
    assert_problem(other, 422, "key reuse").await;
    let list: Value = http
        .get(format!("{}/orders?customerId=c9", s.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list["items"].as_array().unwrap().len(), 1);
    let one: Value = http
        .get(format!(
            "{}/orders/{}",
            s.url,
            first["id"].as_str().unwrap()
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(one["totalCents"], 900);
}

/// A process that dies after the order's commit but before the key's
/// response is recorded leaves the key to be taken over; the retry then runs
/// the handler again, which must find the order, not place a second one.
#[tokio::test]
async fn a_retry_after_a_crash_before_the_key_was_recorded_places_nothing_twice() {
    let s = serve(&[]);
    let http = reqwest::Client::new();
    let first = place(&http, &s, "crash-1", &order("c7")).await;
    assert_eq!(first.status(), StatusCode::CREATED);
    let first: Value = first.json().await.unwrap();

    // What the crash and the lock's expiry leave: the order, and no key.
    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(&s.db)
        .busy_timeout(Duration::from_secs(10));
    let mut db = <sqlx::SqliteConnection as sqlx::Connection>::connect_with(&options)
        .await
        .unwrap();
    let forgotten = sqlx::query("DELETE FROM keel_idempotency")
        .execute(&mut db)
        .await
        .unwrap();
    assert_eq!(forgotten.rows_affected(), 1);

    let again = place(&http, &s, "crash-1", &order("c7")).await;
    assert_eq!(again.status(), StatusCode::CREATED);
    assert!(
        again.headers().get("idempotent-replayed").is_none(),
        "the handler ran again"
    );
    let again: Value = again.json().await.unwrap();
    assert_eq!(first["id"], again["id"], "the order placed the first time");
    let list: Value = http
        .get(format!("{}/orders?customerId=c7", s.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        list["items"].as_array().unwrap().len(),
        1,
        "one order, not two"
    );
}

/// The shop's dependencies stand in for services with databases of their
/// own: their ledger and stock levels are in `PATH.dependencies`, not in the
/// system's file, whose one writer they would otherwise queue for.
#[tokio::test]
async fn the_dependencies_keep_their_tables_in_a_file_of_their_own() {
    let s = serve(&[]);
    let http = reqwest::Client::new();
    let id = placed_id(&http, &s, "own-1", &order("c6")).await;
    eventually("the order completes", || async {
        status_of(&http, &s, &id).await == "completed"
    })
    .await;

    let mut own = s.db.clone().into_os_string();
    own.push(".dependencies");
    let count = |file: std::path::PathBuf, sql: &'static str| async move {
        let options = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(file)
            .read_only(true);
        let mut db = <sqlx::SqliteConnection as sqlx::Connection>::connect_with(&options)
            .await
            .unwrap();
        sqlx::query_scalar::<_, i64>(sql)
            .fetch_one(&mut db)
            .await
            .unwrap()
    };
    let effects = "SELECT count(*) FROM shop_effects";
    assert_eq!(
        count(own.clone().into(), effects).await,
        4,
        "capture, reservation, shipment and receipt, in the dependencies' file"
    );
    assert_eq!(
        count(s.db.clone(), effects).await,
        0,
        "none in the system's"
    );
    let tea = "SELECT available FROM shop_stock WHERE sku = 'tea'";
    let left = count(own.into(), tea).await;
    let product: Value = http
        .post(format!("{}/graphql", s.url))
        .json(&json!({
            "query": format!("{{ order(id: \"{id}\") {{ items {{ product {{ available }} }} }} }}")
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        product["data"]["order"]["items"][0]["product"]["available"], left,
        "the API reads stock where the inventory keeps it: {product}"
    );
}

#[tokio::test]
async fn pages_walk_every_order_once_in_order() {
    let s = serve(&[]);
    let http = reqwest::Client::new();
    let mut placed = Vec::new();
    for i in 0..23 {
        let r = place(&http, &s, &format!("page-{i}"), &order("walker")).await;
        assert_eq!(r.status(), StatusCode::CREATED);
        placed.push(
            r.json::<Value>().await.unwrap()["id"]
                .as_str()
                .unwrap()
                .to_owned(),
        );
        // Another customer's orders interleave and must not show up.
        place(&http, &s, &format!("noise-{i}"), &order("other")).await;
    }
    let mut seen = Vec::new();
    let mut next = format!("{}/orders?customerId=walker&limit=5", s.url);
    let mut pages = 0;
    loop {
        let page: Value = http.get(&next).send().await.unwrap().json().await.unwrap();
        pages += 1;
        for o in page["items"].as_array().unwrap() {
            seen.push(o["id"].as_str().unwrap().to_owned());
        }
        match page["nextCursor"].as_str() {
            Some(c) => next = format!("{}/orders?customerId=walker&limit=5&cursor={c}", s.url),
            None => break,
        }
    }
    assert_eq!(pages, 5);
    assert_eq!(seen, placed, "every order once, oldest first");
    // A cursor is bound to its filter.
    let first: Value = http
        .get(format!("{}/orders?customerId=walker&limit=5", s.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let cursor = first["nextCursor"].as_str().unwrap();
    let r = http
        .get(format!(
            "{}/orders?customerId=other&limit=5&cursor={cursor}",
            s.url
        ))
        .send()
        .await
        .unwrap();
    assert_problem(r, 400, "cursor of another filter").await;
}

/// Requests a report with `key` and follows the job to its result: the
/// result's path and the report.
async fn finished_report(http: &reqwest::Client, s: &Server, key: &str) -> (String, Value) {
    let r = http
        .post(format!("{}/reports", s.url))
        .header("idempotency-key", key)
        .json(&json!({"month": "2026-11"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::ACCEPTED);
    let status_url = r.headers()["location"].to_str().unwrap().to_owned();
    let mut done = None;
    for _ in 0..100 {
        let r = http
            .get(format!("{}{status_url}", s.url))
            .send()
            .await
            .unwrap();
        if r.status() == StatusCode::SEE_OTHER {
            done = Some(r.headers()["location"].to_str().unwrap().to_owned());
            break;
        }
        assert_eq!(r.status(), StatusCode::OK);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let result = done.expect("the job finished");
    let report = json_at(http, &format!("{}{result}", s.url)).await;
    (result, report)
}

fn no_redirects() -> reqwest::Client {
    reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
}

#[tokio::test]
async fn a_report_job_answers_202_then_303() {
    let s = serve(&[]);
    let http = no_redirects();
    place(&http, &s, "rep-1", &order("c1")).await;
    let (_, report) = finished_report(&http, &s, "report-1").await;
    assert!(report["ordersByStatus"].is_object(), "{report}");
    let r = http
        .get(format!("{}/jobs/unknown-job", s.url))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
}

/// `--blobs s3://...`: a report lives in the bucket, so another process
/// with the same bucket (here, a fresh one on another database) serves it.
#[tokio::test]
async fn reports_in_an_s3_bucket_are_served_by_any_process() {
    let Some(endpoint) = keel_testkit::services::s3_url() else {
        return;
    };
    let _shared = ServerLock::shared(Service::S3);
    let blobs = format!("s3://keel-test/{}", keel_core::id::new_id().simple());
    let env = [
        ("AWS_ENDPOINT", endpoint.as_str()),
        ("AWS_ALLOW_HTTP", "true"),
        ("AWS_REGION", "us-east-1"),
        ("AWS_ACCESS_KEY_ID", "keel"),
        ("AWS_SECRET_ACCESS_KEY", "keel"),
    ];
    let http = no_redirects();
    let first = common::serve_with_env(&[], &["--blobs", &blobs], &env);
    place(&http, &first, "rep-s3", &order("c1")).await;
    let (result, report) = finished_report(&http, &first, "report-s3").await;
    drop(first);
    let second = common::serve_with_env(&[], &["--blobs", &blobs], &env);
    let again = json_at(&http, &format!("{}{result}", second.url)).await;
    assert_eq!(again, report, "the same report, from the bucket");
}

/// The status `POST /orders` answers to a request that declares a body of
/// `len` bytes and sends none of it: a server that refuses by the declared
/// length answers without waiting. (An HTTP client sending the whole body
/// may instead see the connection closed mid-write, as it should be.)
async fn status_of_declared_body(s: &Server, len: usize) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = s.url.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /orders HTTP/1.1\r\nhost: {addr}\r\nidempotency-key: k-huge\r\n\
         content-type: application/json\r\ncontent-length: {len}\r\n\r\n"
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    let mut answer = vec![0; 1024];
    let read = tokio::time::timeout(Duration::from_secs(10), stream.read(&mut answer))
        .await
        .expect("an answer before the body")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer[..read]);
    answer
        .split(' ')
        .nth(1)
        .and_then(|status| status.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP answer: {answer:?}"))
}

async fn admin(http: &reqwest::Client, s: &Server, path: &str) -> Value {
    http.get(format!("{}/admin/api{path}", s.url))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

async fn status_of(http: &reqwest::Client, s: &Server, id: &str) -> String {
    let o: Value = http
        .get(format!("{}/orders/{id}", s.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    o["status"].as_str().unwrap_or_default().to_owned()
}

/// The history counts the calls of the shop's gRPC dependency (shipping)
/// as it counts the HTTP ones: calls per second beside its breaker.
#[tokio::test]
async fn the_history_counts_the_grpc_dependencys_calls() {
    let s = serve(&["--admin-token", ADMIN_TOKEN, "--history-interval-secs", "1"]);
    let http = reqwest::Client::new();
    place(&http, &s, "hist-grpc", &order("c1")).await;
    eventually("shipping's calls in the history", || async {
        let history = admin(&http, &s, "/history?kind=dependency&name=shipping").await;
        let text = history.to_string();
        let subjects = history["subjects"].as_array().cloned().unwrap_or_default();
        let calls: f64 = subjects
            .iter()
            .filter(|subject| subject["name"] == "shipping")
            .flat_map(|subject| {
                subject["series"]["calls"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default()
            })
            .filter_map(|v| v.as_f64())
            .sum();
        assert!(!text.contains("\"error\""), "{text}");
        calls > 0.0
    })
    .await;
}

#[tokio::test]
async fn demo_faults_end_in_a_dead_letter_and_a_stuck_saga_that_operators_fix() {
    let s = serve(&[
        "--demo-faults",
        "--admin-token",
        ADMIN_TOKEN,
        "--gauge-interval-secs",
        "1",
    ]);
    let http = reqwest::Client::new();
    let faulty = |fault: &'static str, key: &'static str| {
        http.post(format!("{}/orders", s.url))
            .header("idempotency-key", key)
            .header("x-keel-demo-fault", fault)
            .json(&order("ops"))
            .send()
    };
    let dl: Value = faulty("dead-letter", "f-dl")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let st: Value = faulty("stuck-saga", "f-st")
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let (dl_id, st_id) = (dl["id"].as_str().unwrap(), st["id"].as_str().unwrap());

    eventually("a dead letter", || async {
        admin(&http, &s, "/dead-letters").await["items"]
            .as_array()
            .is_some_and(|a| a.len() == 1)
    })
    .await;
    eventually("a stuck saga", || async {
        status_of(&http, &s, st_id).await == "stuck"
    })
    .await;
    assert_eq!(status_of(&http, &s, dl_id).await, "pending");
    // Nobody reads the counts, yet /metrics shows the trouble the shipped
    // alert rules look for, and every metric they name.
    eventually("the trouble on /metrics", || async {
        let text = metrics_text(&http, &s).await;
        series_sum(&text, "keel_dead_letters_pending{") == 1.0
            && series_sum(&text, "keel_sagas{status=\"stuck\"}") == 1.0
    })
    .await;
    let text = metrics_text(&http, &s).await;
    assert!(
        series_sum(
            &text,
            "keel_http_requests_total{method=\"POST\",route=\"/orders\",status=\"2xx\"}"
        ) >= 2.0,
        "requests counted by route"
    );
    assert!(
        text.contains(
            "keel_http_request_duration_seconds_bucket{method=\"POST\",route=\"/orders\""
        ),
        "a latency histogram by route"
    );
    assert!(
        text.contains("keel_client_call_duration_seconds_bucket{dependency=\"payments\"")
            && text.contains("keel_client_attempt_duration_seconds_bucket{dependency=\"payments\""),
        "latency histograms for each outgoing call and attempt, by dependency"
    );
    let named = alert_rule_metrics();
    assert!(named.len() >= 7, "the rules' metrics: {named:?}");
    // Exported only by a configuration this server does not run; checked
    // where it runs: the WAL relay's (`--outbox-relay wal`, PostgreSQL) in
    // tests/scale_out.rs.
    let elsewhere = ["keel_outbox_wal_slot_lag_bytes"];
    for name in named
        .into_iter()
        .filter(|n| !elsewhere.contains(&n.as_str()))
    {
        assert!(
            text.lines()
                .any(|l| l.starts_with(&format!("{name}{{")) || l.starts_with(&format!("{name} "))),
            "the alert rules use {name}, which /metrics does not export"
        );
    }

    let letters = admin(&http, &s, "/dead-letters").await;
    let letter = &letters["items"][0];
    let r = http
        .post(format!(
            "{}/admin/api/dead-letters/{}/replay",
            s.url,
            letter["id"].as_str().unwrap()
        ))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());
    let r = http
        .post(format!("{}/admin/api/sagas/{st_id}/retry", s.url))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success());

    eventually("the replayed order to complete", || async {
        status_of(&http, &s, dl_id).await == "completed"
    })
    .await;
    // Its saga shipped over gRPC.
    let text = metrics_text(&http, &s).await;
    assert!(
        text.contains(
            "keel_grpc_client_duration_seconds_bucket{method=\"/shipping.v1.Shipping/CreateShipment\""
        ),
        "a latency histogram for the gRPC dependency, by method"
    );
    eventually("the retried saga to compensate", || async {
        status_of(&http, &s, st_id).await == "compensated"
    })
    .await;
    eventually("the gauges to come back to zero", || async {
        let text = metrics_text(&http, &s).await;
        series_sum(&text, "keel_dead_letters_pending{") == 0.0
            && series_sum(&text, "keel_sagas{status=\"stuck\"}") == 0.0
    })
    .await;

    // Both orders finished, so the shop's consumer groups are caught up.
    let lag = admin(&http, &s, "/lag").await;
    let fulfilment = lag["gauges"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == "consumer_lag" && g["labels"]["group"] == "fulfilment")
        .unwrap_or_else(|| panic!("the fulfilment group's lag: {lag}"))
        .clone();
    assert_eq!(fulfilment["labels"]["topic"], "orders");
    assert_eq!(fulfilment["value"], 0.0, "{lag}");
}

async fn metrics_text(http: &reqwest::Client, s: &Server) -> String {
    let r = http
        .get(format!("{}/metrics", s.url))
        .bearer_auth(ADMIN_TOKEN)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_success(), "/metrics: {}", r.status());
    r.text().await.unwrap()
}

/// The sum of the Prometheus text's samples whose line starts with `series`.
fn series_sum(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(series))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Every `keel_…` metric the shipped alert rules name.
fn alert_rule_metrics() -> std::collections::BTreeSet<String> {
    let rules = include_str!("../../../deploy/prometheus/keel-alerts.yml");
    rules
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .flat_map(|l| {
            l.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("keel_"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[tokio::test]
async fn openapi_describes_every_route() {
    let s = serve(&[]);
    let doc: Value = reqwest::get(format!("{}/openapi.json", s.url))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    let paths = doc["paths"].as_object().unwrap();
    for (path, method) in [
        ("/orders", "post"),
        ("/orders", "get"),
        ("/orders/{id}", "get"),
        ("/orders/{id}/shipping-quotes", "get"),
        ("/reports", "post"),
        ("/jobs/{id}", "get"),
        ("/updates", "get"),
        ("/stream", "get"),
        ("/ws", "get"),
        ("/webhook-endpoints", "post"),
        ("/webhook-endpoints", "get"),
        ("/webhook-endpoints/{id}", "delete"),
        ("/webhook-endpoints/{id}/deliveries", "get"),
        ("/deliveries/{id}/resend", "post"),
        ("/webhooks/inbound/{source}", "post"),
        ("/livez", "get"),
        ("/readyz", "get"),
        ("/debug/deep", "get"),
        ("/metrics", "get"),
        ("/openapi.json", "get"),
    ] {
        assert!(
            paths.get(path).and_then(|p| p.get(method)).is_some(),
            "{method} {path} missing"
        );
    }
    for schema in [
        "NewOrder",
        "Order",
        "Item",
        "CreateEndpoint",
        "ShippingQuotes",
    ] {
        assert!(
            doc["components"]["schemas"].get(schema).is_some(),
            "schema {schema}"
        );
    }
    let metrics = reqwest::get(format!("{}/metrics", s.url))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(metrics.contains("keel_"), "prometheus text");
}

#[test]
fn bad_configuration_is_refused_before_starting() {
    // `keel serve ARGS` exits with an error; returns what it printed.
    let refused = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_keel"))
            .arg("serve")
            .args(args)
            .env_remove("KEEL_ADMIN_TOKEN")
            .output()
            .unwrap();
        assert!(!out.status.success(), "serve {args:?} started");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    // Nothing listens on port 1: the unreachable server is named.
    assert!(
        refused(&[
            "--database-url",
            "postgres://keel@127.0.0.1:1/keel",
            "--broker",
            "nats://127.0.0.1:1",
            "--listen",
            "127.0.0.1:0",
        ])
        .to_lowercase()
        .contains("postgres")
    );
    let scratch = tempfile::tempdir().unwrap();
    let db = format!("sqlite:{}", scratch.path().join("keel.db").display());
    assert!(
        refused(&[
            "--database-url",
            &db,
            "--broker",
            "nats://127.0.0.1:1",
            "--listen",
            "127.0.0.1:0",
        ])
        .to_lowercase()
        .contains("nats")
    );
    // A public address (TEST-NET, never bound) without an admin token.
    assert!(refused(&["--listen", "192.0.2.1:8080"]).contains("admin-token"));
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("keel.toml");
    std::fs::write(&file, "listen = \"127.0.0.1:0\"\nunknown_setting = 1\n").unwrap();
    assert!(refused(&["--config", file.to_str().unwrap()]).contains("unknown"));
    assert!(refused(&["--leases", "zookeeper://x"]).contains("leases"));
    assert!(refused(&["--leases", "etcd://"]).contains("etcd://host:port"));
    assert!(refused(&["--leases", "etcd://h:1/path"]).contains("etcd://host:port"));
}

/// Serves with `--leases leases` and checks that the deep check pings
/// `dependency` and finds it up.
async fn deep_check_pings(leases: &str, dependency: &str) {
    let s = serve(&["--leases", leases]);
    let deep = json_at(&reqwest::Client::new(), &format!("{}/debug/deep", s.url)).await;
    let pinged = deep["dependencies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|d| d["name"] == dependency)
        .unwrap_or_else(|| panic!("{dependency} is a dependency: {deep}"));
    assert_eq!(pinged["status"], "ok", "{deep}");
}

/// `--leases redis://...`: pruning and retention take their leases on
/// Redis, which the deep check then pings.
#[tokio::test]
async fn leases_on_redis_are_pinged_by_the_deep_check() {
    let Some(redis) = keel_testkit::services::redis_url() else {
        return;
    };
    let _shared = ServerLock::shared(Service::Redis);
    deep_check_pings(&redis, "redis").await;
}

/// `--leases etcd://...`: pruning and retention run on the process that
/// leads their etcd election, which the deep check then pings (a malformed
/// cluster address is refused before starting: above).
#[tokio::test]
async fn leases_on_etcd_are_pinged_by_the_deep_check() {
    let Some(etcd) = keel_testkit::services::etcd_url() else {
        return;
    };
    let _shared = ServerLock::shared(Service::Etcd);
    deep_check_pings(&etcd.replacen("http://", "etcd://", 1), "etcd").await;
}

#[tokio::test]
async fn a_customer_follows_an_order_over_long_poll() {
    let s = serve(&[]);
    let http = reqwest::Client::new();
    let id = placed_id(&http, &s, "lp-1", &order("follower")).await;
    let mut after = 0;
    let mut types = Vec::new();
    for _ in 0..20 {
        let r = http
            .get(format!(
                "{}/updates?customerId=follower&after={after}",
                s.url
            ))
            .send()
            .await
            .unwrap();
        if r.status() == StatusCode::OK {
            let body: Value = r.json().await.unwrap();
            for e in body["events"].as_array().unwrap() {
                assert_eq!(e["data"]["orderId"], id);
                types.push(e["type"].as_str().unwrap_or_default().to_owned());
                after = e["seq"].as_i64().unwrap_or(after);
            }
        }
        if types.iter().any(|t| t == "order.completed") {
            break;
        }
    }
    assert_eq!(
        types,
        ["order.placed", "order.completed"],
        "in order, once each"
    );
    let r = http.get(format!("{}/updates", s.url)).send().await.unwrap();
    assert!(r.status().is_client_error(), "no customer, no stream");
}

#[tokio::test]
async fn an_idle_long_poll_answers_204_before_the_servers_deadline_cap() {
    let s = serve(&[]);
    let http = reqwest::Client::new();
    let poll = |deadline: Option<u64>| {
        let mut request = http.get(format!("{}/updates?customerId=quiet", s.url));
        if let Some(at) = deadline {
            request = request.header("x-request-deadline-unix-ms", at.to_string());
        }
        request.send()
    };
    let started = tokio::time::Instant::now();
    let capped = poll(None).await.unwrap();
    let waited = started.elapsed();
    assert_eq!(
        capped.status(),
        StatusCode::NO_CONTENT,
        "not 504 at the 10 s cap"
    );
    assert!(
        waited >= Duration::from_secs(9) && waited < Duration::from_secs(10),
        "{waited:?}"
    );
    let soon = keel_core::clock::unix_millis() + 2_000;
    let started = tokio::time::Instant::now();
    let own = poll(Some(soon)).await.unwrap();
    assert_eq!(own.status(), StatusCode::NO_CONTENT);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the caller's deadline"
    );
}

#[tokio::test]
async fn a_chaos_experiment_reaches_shipping_only_when_enabled_and_the_estimate_degrades() {
    let http = reqwest::Client::new();
    let estimate = |s: &Server, id: String, marked: bool| {
        let mut request = http.get(format!("{}/orders/{id}", s.url));
        if marked {
            request = request.header("x-chaos-experiment", "shipping-outage");
        }
        async move {
            let order: Value = request.send().await.unwrap().json().await.unwrap();
            order["deliveryEstimate"].clone()
        }
    };
    for (flags, degrades) in [(&[][..], false), (&["--chaos-experiments"][..], true)] {
        let s = serve(flags);
        let id = placed_id(&http, &s, "exp-1", &order("explorer")).await;
        let fresh = estimate(&s, id.clone(), false).await;
        assert!(fresh["days"].as_u64().is_some(), "{fresh}");
        assert!(fresh.get("staleSeconds").is_none(), "{fresh}");
        let marked = estimate(&s, id.clone(), true).await;
        assert_eq!(marked["days"], fresh["days"], "{flags:?}: {marked}");
        assert_eq!(
            marked.get("staleSeconds").is_some(),
            degrades,
            "{flags:?}: shipping fails only inside an enabled experiment: {marked}"
        );
    }
}

#[tokio::test]
async fn shipping_quotes_come_from_the_carriers_that_answer_in_time_and_say_who_is_missing() {
    let s = serve(&[]);
    let http = reqwest::Client::new();
    let id = placed_id(&http, &s, "quotes-1", &order("shopper")).await;
    let url = format!("{}/orders/{id}/shipping-quotes", s.url);
    let mut reasons = Vec::new();
    for _ in 0..20 {
        let started = tokio::time::Instant::now();
        let answer: Value = http.get(&url).send().await.unwrap().json().await.unwrap();
        assert!(
            started.elapsed() < Duration::from_millis(1500),
            "slowboat answers in 2 s; the page did not wait for it"
        );
        assert_eq!(answer["partial"], true, "{answer}");
        let carriers: Vec<&str> = answer["quotes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|q| q["carrier"].as_str().unwrap())
            .collect();
        assert_eq!(carriers, ["fastship", "parcelco"], "{answer}");
        assert_eq!(answer["missing"][0]["carrier"], "slowboat", "{answer}");
        let reason = answer["missing"][0]["reason"].as_str().unwrap().to_owned();
        let open = reason == "circuit_open";
        reasons.push(reason);
        if open {
            break;
        }
    }
    assert_eq!(reasons[0], "too_slow", "{reasons:?}");
    assert_eq!(
        reasons.last().map(String::as_str),
        Some("circuit_open"),
        "slowboat's breaker opened and spared it: {reasons:?}"
    );
    let metrics = http
        .get(format!("{}/metrics", s.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let partial: f64 = metrics
        .lines()
        .filter(|l| l.starts_with("keel_scatter_gather_total{") && l.contains("answer=\"partial\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(partial, reasons.len() as f64, "{metrics}");

    let unknown = format!("{}/orders/{}/shipping-quotes", s.url, "0000-0000");
    assert_problem(
        http.get(unknown).send().await.unwrap(),
        404,
        "unknown order",
    )
    .await;
    let bad = format!("{}/orders/not-an-id/shipping-quotes", s.url);
    assert_problem(http.get(bad).send().await.unwrap(), 400, "malformed id").await;
}

#[tokio::test]
async fn graphql_pages_take_the_rest_cursors_and_bad_bodies_are_problems() {
    let s = serve(&[]);
    let http = reqwest::Client::new();
    for n in 0..3 {
        place(&http, &s, &format!("graphql-{n}"), &order("gq")).await;
    }
    let rest: Value = http
        .get(format!("{}/orders?customerId=gq&limit=1", s.url))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let cursor = rest["nextCursor"].as_str().unwrap();
    let graphql = || http.post(format!("{}/graphql", s.url));
    let query = format!(
        "{{ orders(first: 5, customerId: \"gq\", after: \"{cursor}\") {{ nodes {{ id customer {{ orderCount }} }} }} }}"
    );
    let answer: Value = graphql()
        .json(&json!({ "query": query }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let nodes = answer["data"]["orders"]["nodes"].as_array().unwrap();
    assert_eq!(
        nodes.len(),
        2,
        "the two orders after the REST page: {answer}"
    );
    assert_ne!(nodes[0]["id"], rest["items"][0]["id"]);
    assert_eq!(nodes[0]["customer"]["orderCount"], 3);

    let not_json = graphql()
        .header("content-type", "application/json")
        .body("{ orders")
        .send()
        .await
        .unwrap();
    assert_eq!(not_json.status(), 400);
    assert_eq!(
        not_json.headers()["content-type"],
        "application/problem+json"
    );
    let text = graphql()
        .header("content-type", "text/plain")
        .body("{ orders { nodes { id } } }")
        .send()
        .await
        .unwrap();
    assert_eq!(text.status(), 415);
    let huge = json!({ "query": format!("{{ orders {{ nodes {{ id }} }} }} # {}", "x".repeat(70 * 1024)) });
    let too_big = graphql().json(&huge).send().await.unwrap();
    assert_eq!(too_big.status(), 413);
    // The deadline applies as on REST: one that passed is a 504 problem.
    let late = graphql()
        .header("x-request-deadline-unix-ms", "1000")
        .json(&json!({ "query": "{ orders { nodes { id } } }" }))
        .send()
        .await
        .unwrap();
    assert_eq!(late.status(), 504);
    // A method the route does not serve is a 405 first, whatever the deadline.
    let trace = http
        .request(reqwest::Method::TRACE, format!("{}/graphql", s.url))
        .header("x-request-deadline-unix-ms", "1000")
        .send()
        .await
        .unwrap();
    assert_eq!(trace.status(), 405);
    assert_eq!(trace.headers()["allow"], "POST");

    let sdl = http
        .get(format!("{}/graphql/schema.graphql", s.url))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(sdl, include_str!("../schema.graphql"));
}

/// Webhooks from a partner arriving out of order: each names its entity
/// and version, and one older than (or as old as) what was applied is
/// acknowledged but marked stale, whatever order they came in.
#[tokio::test]
async fn inbound_webhooks_out_of_order_are_applied_newest_first_and_stale_ones_dropped() {
    // `whsec_` and the base64 of 32 bytes, as Standard Webhooks writes it.
    let text = "whsec_MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=";
    let secret = keel_webhooks::signing::Secret::parse(text).unwrap();
    let s = serve(&["--inbound-webhook-secret", text]);
    let http = reqwest::Client::new();
    let send = |id: &'static str, body: Value| {
        let body = body.to_string();
        let at = keel_core::clock::unix_seconds() as i64;
        let signature = keel_webhooks::signing::sign_standard(&secret, id, at, body.as_bytes());
        http.post(format!("{}/webhooks/inbound/partner", s.url))
            .header("content-type", "application/json")
            .header("webhook-id", id)
            .header("webhook-timestamp", at.to_string())
            .header("webhook-signature", signature)
            .body(body)
            .send()
    };
    let shipment = |version: u64, status: &str| json!({"type": "shipment.updated", "data": {"id": "shp-1", "version": version, "status": status}});
    // Sent in order 1, 2, 3; delivered 2, 1, 3, and 2 once more under a
    // new id (a sender's retry that got a new message id).
    for (id, body, stale) in [
        ("msg-2", shipment(2, "in_transit"), false),
        ("msg-1", shipment(1, "created"), true),
        ("msg-2b", shipment(2, "in_transit"), true),
        ("msg-3", shipment(3, "delivered"), false),
    ] {
        let r = send(id, body).await.unwrap();
        assert_eq!(r.status(), StatusCode::OK, "{id}");
        let answer: Value = r.json().await.unwrap();
        assert_eq!(answer["stale"], stale, "{id}: {answer}");
    }
    // Another entity has versions of its own; an unversioned payload is
    // received as before.
    let other = send("msg-x", json!({"subject": "shp-2", "data": {"version": 1}}));
    let other: Value = other.await.unwrap().json().await.unwrap();
    assert_eq!(other["stale"], false, "{other}");
    let plain = send("msg-p", json!({"type": "ping"})).await.unwrap();
    let plain: Value = plain.json().await.unwrap();
    assert_eq!(plain["received"], true);
    assert!(plain.get("stale").is_none(), "{plain}");
}
