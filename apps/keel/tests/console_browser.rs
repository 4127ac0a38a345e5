//! `keel serve`'s operator console in headless Chromium: two orders are
//! placed with demo faults (one dead-lettered, one whose saga gets stuck
//! refunding), an operator replays the dead letter and retries the saga by
//! pressing the console's buttons, and the API shows the first order
//! completed and the second compensated.
//!
//! Needs Debian's `chromium` and `chromium-driver` (scripts/browser.sh
//! installs them; the path is `KEEL_TEST_CHROMEDRIVER`, default
//! `/usr/bin/chromedriver`). Without them the test is skipped, except in CI
//! (`CI` set), where it fails.
//!
//! The browser is driven over the W3C WebDriver protocol with a small
//! client on reqwest (this crate's HTTP client), the same protocol
//! fantoccini speaks in keel-http's console test.

use std::process::Stdio;
use std::time::Duration;

use keel_testkit::browser::ChromeDriver;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const TOKEN: &str = "serve-browser-token-0123456789";
const LISTENING: &str = "keel: listening on ";
/// How long the shop may take to dead-letter a message or stick a saga
/// (consumer retries with backoff, saga retries with backoff).
const SETTLE: Duration = Duration::from_secs(90);

// ---------------------------------------------------------- WebDriver --

/// The key under which WebDriver returns an element reference.
const ELEMENT: &str = "element-6066-11e4-a52e-4f735466cecf";

/// A WebDriver session with headless Chromium under a chromedriver this
/// test started on a free loopback port; both die with it.
struct Browser {
    http: reqwest::Client,
    session: String,
    _driver: ChromeDriver,
}

impl Browser {
    /// The browser, or `None` (with a message) when chromedriver is missing
    /// and `CI` is not set.
    async fn start() -> Option<Self> {
        let driver = ChromeDriver::start().await?;
        let caps = json!({ "capabilities": { "alwaysMatch": {
            "browserName": "chrome", "goog:chromeOptions": driver.chrome_options() } } });
        let http = reqwest::Client::new();
        let created: Value = http
            .post(format!("{}/session", driver.url()))
            .json(&caps)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        let id = created["value"]["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no WebDriver session: {created}"));
        Some(Self {
            http,
            session: format!("{}/session/{id}", driver.url()),
            _driver: driver,
        })
    }

    async fn command(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Value,
    ) -> Result<Value, String> {
        let request = self.http.request(method, format!("{}{path}", self.session));
        let request = if body.is_null() {
            request
        } else {
            request.json(&body)
        };
        let reply: Value = request
            .send()
            .await
            .map_err(|e| e.to_string())?
            .json()
            .await
            .map_err(|e| e.to_string())?;
        let value = reply["value"].clone();
        match value.get("error") {
            Some(error) => Err(format!("{error}: {}", value["message"])),
            None => Ok(value),
        }
    }

    /// Runs `script` in the page; it ends by calling its last argument.
    async fn run_async(&self, script: &str) -> Value {
        self.command(
            reqwest::Method::POST,
            "/execute/async",
            json!({ "script": script, "args": [] }),
        )
        .await
        .unwrap()
    }

    async fn goto(&self, url: &str) {
        self.command(reqwest::Method::POST, "/url", json!({ "url": url }))
            .await
            .unwrap();
    }

    async fn current_url(&self) -> String {
        let url = self
            .command(reqwest::Method::GET, "/url", Value::Null)
            .await
            .unwrap();
        url.as_str().unwrap_or_default().to_owned()
    }

    async fn find_all(&self, css: &str) -> Vec<String> {
        let body = json!({ "using": "css selector", "value": css });
        let found = self
            .command(reqwest::Method::POST, "/elements", body)
            .await
            .unwrap_or_else(|e| panic!("finding `{css}`: {e}"));
        found
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|e| e[ELEMENT].as_str().map(str::to_owned))
            .collect()
    }

    /// The first element matching `css`, waiting up to `within`.
    async fn wait_for(&self, css: &str, within: Duration) -> String {
        let tries = within.as_millis() / 100;
        for _ in 0..tries.max(1) {
            if let Some(element) = self.find_all(css).await.into_iter().next() {
                return element;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!(
            "no `{css}` on {} after {within:?}",
            self.current_url().await
        );
    }

    async fn gone(&self, css: &str, within: Duration) {
        let tries = within.as_millis() / 100;
        for _ in 0..tries.max(1) {
            if self.find_all(css).await.is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("`{css}` is still on the page after {within:?}");
    }

    /// Clicks `css`, finding it again if the live stream swapped it out.
    async fn click(&self, css: &str) {
        for _ in 0..20 {
            let element = self.wait_for(css, Duration::from_secs(10)).await;
            let path = format!("/element/{element}/click");
            if self
                .command(reqwest::Method::POST, &path, json!({}))
                .await
                .is_ok()
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("could not click `{css}`");
    }

    async fn type_into(&self, css: &str, text: &str) {
        let element = self.wait_for(css, Duration::from_secs(10)).await;
        let path = format!("/element/{element}/value");
        self.command(reqwest::Method::POST, &path, json!({ "text": text }))
            .await
            .unwrap();
    }

    /// The text of `css`, found again if the live stream swapped it out.
    async fn text(&self, css: &str) -> String {
        for _ in 0..20 {
            let element = self.wait_for(css, Duration::from_secs(10)).await;
            let path = format!("/element/{element}/text");
            if let Ok(text) = self.command(reqwest::Method::GET, &path, Value::Null).await {
                return text.as_str().unwrap_or_default().to_owned();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("could not read `{css}`");
    }

    /// The text of `css` once it starts with `prefix`. A click on a form
    /// button returns before the page it posts to has loaded on a busy
    /// machine, so the notice read right after it can still be the last
    /// page's.
    async fn notice_starting(&self, css: &str, prefix: &str) -> String {
        let mut text = String::new();
        for _ in 0..100 {
            text = self.text(css).await;
            if text.starts_with(prefix) {
                return text;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("`{css}` still reads {text:?}, not {prefix:?}...");
    }

    /// What `expression` evaluates to in the page.
    async fn eval(&self, expression: &str) -> Value {
        self.run_async(&format!(
            "const done = arguments[arguments.length - 1]; done({expression});"
        ))
        .await
    }

    /// Waits up to `within` for `expression` to be true in the page.
    async fn until(&self, expression: &str, within: Duration) {
        let tries = within.as_millis() / 200;
        for _ in 0..tries.max(1) {
            if self.eval(expression).await == Value::Bool(true) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!(
            "`{expression}` never held on {} within {within:?}",
            self.current_url().await
        );
    }

    /// The page as a PNG, base64, in a window of `width` by `height`.
    async fn screenshot(&self, width: u32, height: u32) -> String {
        let rect = json!({ "width": width, "height": height });
        self.command(reqwest::Method::POST, "/window/rect", rect)
            .await
            .unwrap();
        let shot = self
            .command(reqwest::Method::GET, "/screenshot", Value::Null)
            .await
            .unwrap();
        shot.as_str().unwrap_or_default().to_owned()
    }

    async fn quit(self) {
        let _ = self.http.delete(&self.session).send().await;
    }
}

// -------------------------------------------------------------- server --

/// `keel serve` on a free loopback port, killed when dropped.
struct Server {
    base: String,
    http: reqwest::Client,
    _process: Child,
    _dir: tempfile::TempDir,
}

async fn serve() -> Server {
    serve_with(&[]).await
}

/// `keel serve` with `extra` flags.
async fn serve_with(extra: &[&str]) -> Server {
    let dir = tempfile::tempdir().unwrap();
    let database = format!("sqlite:{}", dir.path().join("keel.db").display());
    let mut process = Command::new(env!("CARGO_BIN_EXE_keel"))
        .args(["serve", "--listen", "127.0.0.1:0", "--database-url"])
        .arg(&database)
        .args(["--admin-token", TOKEN, "--demo-faults"])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("keel serve starts");
    let mut lines = BufReader::new(process.stdout.take().unwrap()).lines();
    let address = tokio::time::timeout(Duration::from_secs(60), async {
        while let Some(line) = lines.next_line().await.unwrap() {
            if let Some(address) = line.strip_prefix(LISTENING) {
                return address.trim().to_owned();
            }
        }
        panic!("keel serve exited without printing `{LISTENING}http://ADDR`");
    })
    .await
    .expect("keel serve says where it listens within 60 s");
    // Keep reading stdout, so a chatty server never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    Server {
        base: address,
        http: reqwest::Client::new(),
        _process: process,
        _dir: dir,
    }
}

impl Server {
    async fn place_order(&self, fault: &str) -> String {
        self.place_keyed_order(&format!("browser-{fault}"), fault)
            .await
    }

    async fn place_keyed_order(&self, key: &str, fault: &str) -> String {
        let response = self
            .http
            .post(format!("{}/orders", self.base))
            .header("Idempotency-Key", key)
            .header("X-Keel-Demo-Fault", fault)
            .json(&json!({
                "customerId": "cust-01",
                "currency": "USD",
                "items": [{ "sku": "tea", "qty": 1, "unitPriceCents": 450 }],
            }))
            .send()
            .await
            .unwrap();
        let status = response.status();
        let body: Value = response.json().await.unwrap();
        assert_eq!(status, reqwest::StatusCode::CREATED, "{body}");
        body["id"].as_str().unwrap().to_owned()
    }

    async fn get(&self, path: &str) -> Value {
        let response = self
            .http
            .get(format!("{}{path}", self.base))
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

    /// Polls `path` until `check` finds what it looks for.
    async fn eventually<T>(&self, path: &str, check: impl Fn(&Value) -> Option<T>) -> T {
        let mut last = Value::Null;
        let tries = SETTLE.as_millis() / 200;
        for _ in 0..tries {
            last = self.get(path).await;
            if let Some(found) = check(&last) {
                return found;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        panic!("{path} never got there within {SETTLE:?}; last: {last}");
    }
}

/// The page's own origin may open `/ws` (the default allow-list), and the
/// socket carries the customer's events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_of_the_server_follows_a_customer_over_its_websocket() {
    let Some(browser) = Browser::start().await else {
        return;
    };
    let server = serve().await;
    browser.goto(&format!("{}/livez", server.base)).await;
    let ws = server.base.replacen("http://", "ws://", 1);
    let opened = browser
        .run_async(&format!(
            "const done = arguments[arguments.length - 1];
             const ws = new WebSocket('{ws}/ws?customerId=cust-01', 'keel.v1');
             window.keelSocket = ws; window.keelFrames = [];
             ws.onmessage = (m) => window.keelFrames.push(m.data);
             ws.onopen = () => done('open');
             ws.onclose = (c) => done('closed ' + c.code);"
        ))
        .await;
    assert_eq!(opened, "open", "the server's own origin is allowed");
    server.place_order("none").await;
    let mut frames = Value::Null;
    for _ in 0..150 {
        frames = browser
            .run_async("arguments[arguments.length - 1](window.keelFrames)")
            .await;
        if frames.as_array().is_some_and(|f| {
            f.iter()
                .any(|frame| frame.as_str().is_some_and(|t| t.contains("\"seq\"")))
        }) {
            browser.quit().await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("no event reached the page's socket: {frames}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_fixes_a_dead_letter_and_a_stuck_saga_of_keel_serve_in_the_browser() {
    let Some(browser) = Browser::start().await else {
        return;
    };
    let server = serve().await;
    let dead = server.place_order("dead-letter").await;
    let stuck = server.place_order("stuck-saga").await;

    let letter = server
        .eventually("/admin/api/dead-letters", |list| {
            list["items"].as_array()?.iter().find_map(|l| {
                let payload = l["payload"].as_str()?;
                payload
                    .contains(&dead)
                    .then(|| l["id"].as_str().map(str::to_owned))?
            })
        })
        .await;
    server
        .eventually(&format!("/admin/api/sagas/{stuck}"), |s| {
            (s["status"] == "stuck").then_some(())
        })
        .await;

    // Log in.
    browser.goto(&format!("{}/console", server.base)).await;
    browser.type_into("#login input[name=token]", TOKEN).await;
    browser.click("button[data-action=login]").await;
    browser
        .wait_for("#live[data-live=true]", Duration::from_secs(10))
        .await;

    // Replay the dead letter; the order goes through.
    browser
        .click(&format!(
            "button[data-action=replay][data-dead-letter-id='{letter}']"
        ))
        .await;
    let notice = browser
        .notice_starting("#notice", &format!("Replayed dead letter {letter}"))
        .await;
    assert_eq!(notice, format!("Replayed dead letter {letter}"));
    server
        .eventually(&format!("/orders/{dead}"), |o| {
            (o["status"] == "completed").then_some(())
        })
        .await;
    let replayed = server
        .get(&format!("/admin/api/dead-letters/{letter}"))
        .await;
    assert_eq!(replayed["status"], "replayed");

    // Retry the stuck saga; its refund now succeeds and the order is
    // compensated.
    browser
        .click(&format!(
            "button[data-action=retry][data-saga-id='{stuck}']"
        ))
        .await;
    browser
        .notice_starting("#notice", &format!("Retried saga {stuck}"))
        .await;
    server
        .eventually(&format!("/admin/api/sagas/{stuck}"), |s| {
            (s["status"] == "compensated").then_some(())
        })
        .await;
    server
        .eventually(&format!("/orders/{stuck}"), |o| {
            (o["status"] == "compensated").then_some(())
        })
        .await;
    browser
        .gone(
            &format!("tr[data-saga-id='{stuck}']"),
            Duration::from_secs(10),
        )
        .await;
    browser.quit().await;
}

/// A sparkline's points as numbers (an unknown point is skipped).
const POINTS: &str = "(sel) => { const el = document.querySelector(sel); \
    return el ? el.dataset.points.split(',').filter(p => p !== '').map(Number) : []; }";

/// The chaos of a payments outage and a poison message, watched from the
/// console: the payments breaker's timeline shows its open band and then
/// closes, the fulfilment group's lag sparkline rises while the poison
/// message waits for redelivery and falls once it is dead-lettered, and the
/// dependency's detail page draws the same history large.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_graphs_a_breaker_opening_and_closing_and_the_lag_rising_and_falling() {
    let Some(browser) = Browser::start().await else {
        return;
    };
    let server = serve_with(&[
        "--demo-payments-outage-secs",
        "4",
        "--history-interval-secs",
        "1",
        "--gauge-interval-secs",
        "1",
    ])
    .await;
    browser.goto(&format!("{}/console", server.base)).await;
    browser.type_into("#login input[name=token]", TOKEN).await;
    browser.click("button[data-action=login]").await;
    browser
        .wait_for("#live[data-live=true]", Duration::from_secs(10))
        .await;

    // Poison first: it stays in the backlog for about 4 s of redeliveries.
    server.place_order("dead-letter").await;
    // Orders through the outage: their captures fail until the breaker
    // opens, then are refused until a probe finds payments back.
    let mut placed = Vec::new();
    for n in 0..30 {
        placed.push(
            server
                .place_keyed_order(&format!("graph-{n}"), "none")
                .await,
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let payments = "tr[data-dependency=payments] svg.timeline";
    browser
        .until(
            &format!("document.querySelector(\"{payments} rect[data-state=open]\") !== null"),
            SETTLE,
        )
        .await;
    // Closed again: the newest band is closed, and so is the breaker.
    browser
        .until(
            &format!(
                "(() => {{ const bands = document.querySelectorAll('{payments} rect'); \
                 return bands.length > 1 && bands[bands.length - 1].dataset.state === 'closed' \
                 && document.querySelector('tr[data-breaker=payments][data-state=closed]') !== null; }})()"
            ),
            SETTLE,
        )
        .await;
    let transitions = browser
        .eval(&format!(
            "Number(document.querySelector('{payments}').dataset.transitions)"
        ))
        .await;
    assert!(
        transitions.as_f64().unwrap_or_default() >= 2.0,
        "opened and closed at least: {transitions}"
    );

    // The lag rose above zero and came back down to it.
    let lag = "tr[data-group=fulfilment] svg[data-series=lag]";
    browser
        .until(
            &format!(
                "(() => {{ const p = ({POINTS})('{lag}'); \
                 const peak = p.indexOf(Math.max(...p)); \
                 return p.length > 0 && p[peak] > 0 && p.slice(peak).includes(0) && p[p.length - 1] === 0; }})()"
            ),
            SETTLE,
        )
        .await;
    let screenshot = browser.screenshot(1400, 1500).await;
    let path = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("console-under-load.png");
    {
        use base64::Engine as _;
        let png = base64::engine::general_purpose::STANDARD
            .decode(screenshot)
            .unwrap();
        std::fs::write(&path, png).unwrap();
    }

    // Every order settled once payments came back.
    for order in &placed {
        server
            .eventually(&format!("/orders/{order}"), |o| {
                (o["status"] == "completed").then_some(())
            })
            .await;
    }

    // The detail page draws the same history large, and stays live.
    browser
        .click("a[data-detail=dependency][href$='/payments']")
        .await;
    browser
        .wait_for("#detail svg.timeline rect[data-state=open]", SETTLE)
        .await;
    let updates = browser
        .eval("Number(document.body.dataset.updates || 0)")
        .await;
    browser
        .until(
            &format!("Number(document.body.dataset.updates || 0) > {updates}"),
            Duration::from_secs(10),
        )
        .await;
    browser.quit().await;
}
