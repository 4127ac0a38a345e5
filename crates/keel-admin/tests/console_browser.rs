//! The operator console in a real browser: headless Chromium, driven over
//! WebDriver, logs in, replays a dead letter and retries a stuck saga by
//! pressing the page's buttons, and the outcome is checked through the
//! admin API; a change made elsewhere reaches the open page over SSE.
//!
//! Needs Debian's `chromium` and `chromium-driver` (scripts/browser.sh
//! installs them; the path is `KEEL_TEST_CHROMEDRIVER`, default
//! `/usr/bin/chromedriver`). Without them the test is skipped, except in CI
//! (`CI` set), where it fails.
#![cfg(feature = "console")]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::response::IntoResponse;
use fantoccini::{Client, ClientBuilder, Locator};
use keel_admin::console::Console;
use keel_admin::{Admin, AdminToken};
use keel_core::BoxError;
use keel_messaging::saga::{Backoff, Jitter, SagaDefinition, SagaOrchestrator, Step, StepContext};
use keel_sqlite::store::SqliteStore;
use keel_store::broker::Message;
use keel_store::{AttemptError, DeadLetter, DeadLetterStatus, DeadLetterStore, SagaStatus, Store};
use keel_testkit::browser::ChromeDriver;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tempfile::TempDir;

const TOKEN: &str = "browser-test-token-0123456789";

// ------------------------------------------------------------- browser --

/// Chromium under a chromedriver this test started on a free loopback
/// port; both die with it.
struct Browser {
    client: Client,
    _driver: ChromeDriver,
}

/// The browser, or `None` (with a message) when chromedriver is missing
/// and `CI` is not set.
async fn browser() -> Option<Browser> {
    let driver = ChromeDriver::start().await?;
    let mut caps = serde_json::Map::new();
    caps.insert("goog:chromeOptions".to_owned(), driver.chrome_options());
    let client = ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
        .capabilities(caps)
        .connect(&driver.url())
        .await
        .expect("a WebDriver session with headless Chromium");
    Some(Browser {
        client,
        _driver: driver,
    })
}

// ----------------------------------------------------------------- app --

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Order {
    order_id: String,
}

/// An order saga whose stock reservation is refused and whose refund fails
/// until `refund_broken` is cleared: it gets stuck compensating.
fn order_saga(refund_broken: &Arc<AtomicBool>) -> SagaDefinition<Order> {
    let ok = |name: &'static str| {
        Step::new(name, |_ctx: StepContext<Order>| async {
            Ok::<(), BoxError>(())
        })
        .max_attempts(1)
    };
    let refund = refund_broken.clone();
    SagaDefinition::builder("order")
        .step(
            ok("capture_payment").compensate_with(move |_ctx: StepContext<Order>| {
                let broken = refund.load(Ordering::SeqCst);
                async move {
                    if broken {
                        return Err::<(), BoxError>("refund failed: payments down".into());
                    }
                    Ok(())
                }
            }),
        )
        .step(
            Step::new("reserve_stock", |_ctx: StepContext<Order>| async {
                Err::<(), BoxError>("out of stock".into())
            })
            .max_attempts(1),
        )
        .pivot(ok("schedule_shipment"))
        .backoff(
            Backoff::exponential(Duration::from_millis(1), 2.0, Duration::from_millis(4))
                .unwrap()
                .with_jitter(Jitter::None)
                .unwrap(),
        )
        .stuck_after(2)
        // Past the pivot a saga retries forward until this budget runs out,
        // then is stuck for an operator: at once, in these tests.
        .forward_budget(Duration::ZERO)
        .build()
        .unwrap()
}

struct App {
    _dir: TempDir,
    store: SqliteStore,
    base: String,
    http: reqwest::Client,
    refund_broken: Arc<AtomicBool>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn app() -> App {
    app_refusing_streams(0).await
}

/// The console, whose first `refusals` live streams are answered `503`
/// (as by a server restarting behind its load balancer).
async fn app_refusing_streams(refusals: usize) -> App {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("console.db"))
        .await
        .unwrap();
    let refund_broken = Arc::new(AtomicBool::new(true));
    let saga = order_saga(&refund_broken);
    let orchestrator = SagaOrchestrator::builder(store.clone())
        .saga(&saga)
        .poll_interval(Duration::from_millis(50))
        .build()
        .unwrap();

    for id in ["billing:a", "billing:b"] {
        put_letter(&store, id).await;
    }
    let mut tx = store.begin().await.unwrap();
    let order = Order {
        order_id: "order-7".into(),
    };
    orchestrator
        .start(&mut tx, &saga, "order-7", &order)
        .await
        .unwrap();
    store.commit(tx).await.unwrap();
    let mut status = SagaStatus::Running;
    for _ in 0..500 {
        status = orchestrator.drive("order-7").await.unwrap().status;
        if status == SagaStatus::Stuck {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(status, SagaStatus::Stuck, "the seeded saga is stuck");

    let admin = Admin::builder(store.clone())
        .token(AdminToken::new(TOKEN).unwrap())
        .sagas(orchestrator.clone())
        .build();
    let refusals = Arc::new(std::sync::atomic::AtomicUsize::new(refusals));
    let refuse_streams = axum::middleware::from_fn(
        move |request: axum::extract::Request, next: axum::middleware::Next| {
            let refusals = Arc::clone(&refusals);
            async move {
                let refused = request.uri().path() == "/console/events"
                    && refusals
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                        .is_ok();
                if refused {
                    return axum::http::StatusCode::SERVICE_UNAVAILABLE.into_response();
                }
                next.run(request).await
            }
        },
    );
    let router = admin
        .router()
        .merge(
            Console::new(admin)
                .refresh_interval(Duration::from_millis(200))
                .router(),
        )
        .layer(refuse_streams);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let shutdown = async {
            let _ = stopped.await;
        };
        tokio::select! {
            _ = axum::serve(listener, router) => {}
            () = orchestrator.run(shutdown) => {}
        }
    });
    App {
        _dir: dir,
        store,
        base,
        http: reqwest::Client::new(),
        refund_broken,
        _stop: stop,
    }
}

async fn put_letter(store: &SqliteStore, id: &str) {
    let message = Message::new(
        format!("msg-{id}"),
        "orders",
        "order-7",
        "{\"order\":\"order-7\"}",
    );
    let letter = DeadLetter {
        id: id.to_owned(),
        message,
        group: "billing".to_owned(),
        error_kind: "too_many_attempts".to_owned(),
        attempts: (1..=3)
            .map(|attempt| AttemptError {
                attempt,
                error: format!("<b>ledger</b> timeout #{attempt}"),
                at: keel_core::clock::utc_now(),
            })
            .collect(),
        dead_at: keel_core::clock::utc_now(),
        status: DeadLetterStatus::Pending,
    };
    store.dead_letter_put(&letter).await.unwrap();
}

impl App {
    async fn api(&self, method: reqwest::Method, path: &str) -> Value {
        let response = self
            .http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        assert!(
            response.status().is_success(),
            "{path}: {}",
            response.status()
        );
        response.json().await.unwrap()
    }

    /// Polls the admin API until `check` holds (at most 10 s).
    async fn eventually(&self, path: &str, check: impl Fn(&Value) -> bool) -> Value {
        let mut last = Value::Null;
        for _ in 0..100 {
            last = self.api(reqwest::Method::GET, path).await;
            if check(&last) {
                return last;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("{path} never reached the expected state; last: {last}");
    }
}

async fn click(client: &Client, css: &str) {
    // The live stream may swap a section between finding and clicking.
    for _ in 0..20 {
        let found = client
            .wait()
            .at_most(Duration::from_secs(10))
            .for_element(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("no `{css}` on the page: {e}"));
        if found.click().await.is_ok() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("could not click `{css}`");
}

/// The outer HTML of `css`, found afresh when the live stream replaced it
/// between finding and reading (a stale element reference).
async fn html_of(client: &Client, css: &str) -> String {
    for _ in 0..20 {
        let found = client
            .wait()
            .at_most(Duration::from_secs(10))
            .for_element(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("no `{css}` on the page: {e}"));
        if let Ok(html) = found.html(false).await {
            return html;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("could not read `{css}`");
}

/// The notice once it starts with `prefix`. A click on a form button
/// returns before the page it posts to has loaded on a busy machine, so the
/// notice read right after it can still be the last page's.
async fn notice_starting(client: &Client, prefix: &str) -> String {
    let mut text = String::new();
    for _ in 0..100 {
        let found = client
            .wait()
            .at_most(Duration::from_secs(10))
            .for_element(Locator::Css("#notice"))
            .await
            .expect("a notice after the action");
        // A stale element (the page was replaced meanwhile) reads as an error.
        text = found.text().await.unwrap_or_default();
        if text.starts_with(prefix) {
            return text;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the notice still reads {text:?}, not {prefix:?}...");
}

async fn gone(client: &Client, css: &str) {
    for _ in 0..100 {
        if client.find_all(Locator::Css(css)).await.unwrap().is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("`{css}` is still on the page after 10 s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_replays_a_dead_letter_and_retries_a_stuck_saga_in_the_browser() {
    let app = app().await;
    let Some(browser) = browser().await else {
        return;
    };
    let c = &browser.client;

    // Not logged in: the console sends the browser to the login form.
    c.goto(&format!("{}/console", app.base)).await.unwrap();
    let token = c
        .wait()
        .at_most(Duration::from_secs(10))
        .for_element(Locator::Css("#login input[name=token]"))
        .await
        .unwrap();
    token.send_keys("not-the-admin-token").await.unwrap();
    click(c, "button[data-action=login]").await;
    let error = c
        .wait()
        .at_most(Duration::from_secs(10))
        .for_element(Locator::Css("#login-error"))
        .await
        .unwrap();
    assert!(error.text().await.unwrap().contains("not the admin token"));
    let token = c
        .find(Locator::Css("#login input[name=token]"))
        .await
        .unwrap();
    token.send_keys(TOKEN).await.unwrap();
    click(c, "button[data-action=login]").await;

    // The console, live, with the error history rendered as text.
    c.wait()
        .at_most(Duration::from_secs(10))
        .for_element(Locator::Css("#live[data-live=true]"))
        .await
        .expect("the live stream connects");
    let html = html_of(c, "tr[data-dead-letter-id='billing:a']").await;
    assert!(
        html.contains("&lt;b&gt;ledger&lt;/b&gt; timeout #3"),
        "{html}"
    );
    c.find(Locator::Css(
        "tr[data-saga-id='order-7'][data-status=stuck]",
    ))
    .await
    .expect("the stuck saga is listed");

    // Replay the dead letter.
    click(
        c,
        "button[data-action=replay][data-dead-letter-id='billing:a']",
    )
    .await;
    assert_eq!(
        notice_starting(c, "Replayed dead letter").await,
        "Replayed dead letter billing:a"
    );
    gone(c, "tr[data-dead-letter-id='billing:a']").await;
    let letter = app
        .api(reqwest::Method::GET, "/admin/api/dead-letters/billing:a")
        .await;
    assert_eq!(letter["status"], "replayed");
    let lag = app.api(reqwest::Method::GET, "/admin/api/lag").await;
    assert_eq!(
        lag["outbox"]["unpublished"], 1,
        "the replay is in the outbox"
    );

    // The refund works again: retry the stuck saga; it compensates.
    app.refund_broken.store(false, Ordering::SeqCst);
    click(c, "button[data-action=retry][data-saga-id='order-7']").await;
    notice_starting(c, "Retried saga order-7").await;
    app.eventually("/admin/api/sagas/order-7", |s| s["status"] == "compensated")
        .await;
    gone(c, "tr[data-saga-id='order-7']").await;

    // A change made elsewhere reaches the open page without a reload.
    let before = c.current_url().await.unwrap();
    app.api(
        reqwest::Method::POST,
        "/admin/api/dead-letters/billing:b/discard",
    )
    .await;
    gone(c, "tr[data-dead-letter-id='billing:b']").await;
    assert_eq!(c.current_url().await.unwrap(), before, "no navigation");
    let stored = app
        .store
        .dead_letter_get("billing:b")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(stored.status, DeadLetterStatus::Discarded);

    browser.client.close().await.unwrap();
}

/// The browser gives an `EventSource` up for good when the server answers
/// with an error; the console's script opens a new one after a jittered
/// wait, so the page comes back live by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_view_comes_back_after_the_browser_gives_up_on_its_stream() {
    let app = app_refusing_streams(2).await;
    let Some(browser) = browser().await else {
        return;
    };
    let c = &browser.client;
    c.goto(&format!("{}/console", app.base)).await.unwrap();
    let token = c
        .wait()
        .at_most(Duration::from_secs(10))
        .for_element(Locator::Css("#login input[name=token]"))
        .await
        .unwrap();
    token.send_keys(TOKEN).await.unwrap();
    click(c, "button[data-action=login]").await;
    // Two streams refused with 503: waits of at most 1 s, then 2 s.
    c.wait()
        .at_most(Duration::from_secs(20))
        .for_element(Locator::Css("#live[data-live=true]"))
        .await
        .expect("the live stream is opened again after it was refused");
}
