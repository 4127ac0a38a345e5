//! Load shedding at the edge, with real concurrency: handlers blocked on a
//! gate hold the slots while more requests arrive.
#![cfg(feature = "shed")]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use axum::response::Response;
use axum::routing::get;
use keel_core::deadline::DEADLINE_HEADER;
use keel_core::{Deadline, clock};
use keel_http::problem::PROBLEM_JSON;
use keel_http::shed::HttpLoadShedLayer;
use keel_policy::shed::LoadShed;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tower::ServiceExt;

/// An app whose handler counts its start and then waits for a permit.
struct Gated {
    app: Router,
    gate: Arc<Semaphore>,
    started: Arc<AtomicUsize>,
    layer: HttpLoadShedLayer,
}

impl Gated {
    fn new(layer: HttpLoadShedLayer) -> Self {
        let gate = Arc::new(Semaphore::new(0));
        let started = Arc::new(AtomicUsize::new(0));
        let app = Router::new()
            .route(
                "/work",
                get({
                    let (gate, started) = (Arc::clone(&gate), Arc::clone(&started));
                    move || async move {
                        started.fetch_add(1, Ordering::SeqCst);
                        gate.acquire().await.unwrap().forget();
                        "done"
                    }
                }),
            )
            .layer(layer.clone());
        Self {
            app,
            gate,
            started,
            layer,
        }
    }

    fn spawn(&self, request: Request<Body>) -> JoinHandle<Response> {
        let app = self.app.clone();
        tokio::spawn(async move { app.oneshot(request).await.unwrap() })
    }

    fn started(&self) -> usize {
        self.started.load(Ordering::SeqCst)
    }

    /// Waits until the policy holds `in_flight` and `queued` requests.
    async fn until(&self, in_flight: usize, queued: usize) {
        tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                let stats = self.layer.stats().policy;
                if stats.in_flight == in_flight && stats.queued == queued {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
        .await
        .unwrap_or_else(|_| {
            panic!(
                "never reached {in_flight} in flight, {queued} queued: {:?}",
                self.layer.stats()
            )
        });
    }
}

fn work() -> Request<Body> {
    Request::get("/work").body(Body::empty()).unwrap()
}

fn policy(max_in_flight: usize, max_queued: usize, latency_target: Duration) -> LoadShed {
    LoadShed::builder("edge")
        .max_in_flight(max_in_flight)
        .latency_target(latency_target, Duration::from_millis(1))
        .max_queued(max_queued)
        .build()
        .unwrap()
}

async fn problem_of(response: Response) -> serde_json::Value {
    assert_eq!(response.headers()[header::CONTENT_TYPE], PROBLEM_JSON);
    let body = axum::body::to_bytes(response.into_body(), 64 * 1024)
        .await
        .unwrap();
    serde_json::from_slice(&body).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_past_slots_and_queue_gets_503_at_once_and_queued_ones_proceed() {
    const SLOTS: usize = 2;
    const QUEUE: usize = 2;
    let gated = Gated::new(HttpLoadShedLayer::new(policy(
        SLOTS,
        QUEUE,
        Duration::from_secs(30),
    )));

    let admitted: Vec<_> = (0..SLOTS + QUEUE).map(|_| gated.spawn(work())).collect();
    gated.until(SLOTS, QUEUE).await;
    assert_eq!(gated.started(), SLOTS, "queued requests wait for a slot");

    // The (N + queue + 1)th request is refused at once.
    let started = clock::now();
    let refused = gated.app.clone().oneshot(work()).await.unwrap();
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "shed fast, not after a wait"
    );
    assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(refused.headers()[header::RETRY_AFTER], "1");
    let problem = problem_of(refused).await;
    assert_eq!(problem["type"], "urn:keel:problem:overloaded");
    assert_eq!(problem["status"], 503);
    assert_eq!(gated.layer.stats().overloaded, 1);

    // One slot frees: one queued request starts.
    gated.gate.add_permits(1);
    gated.until(SLOTS, QUEUE - 1).await;
    assert_eq!(gated.started(), SLOTS + 1);

    // The rest finish; every admitted request was answered by its handler.
    gated.gate.add_permits(SLOTS + QUEUE);
    for handle in admitted {
        let response = handle.await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
    let stats = gated.layer.stats();
    assert_eq!((stats.overloaded, stats.expired), (1, 0));
    assert_eq!(stats.policy.shed, 1, "the policy counted the same one");
    assert_eq!((stats.policy.in_flight, stats.policy.queued), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_is_shed_and_counted_exactly() {
    let gated = Gated::new(HttpLoadShedLayer::new(policy(
        3,
        2,
        Duration::from_secs(30),
    )));
    let burst: Vec<_> = (0..20).map(|_| gated.spawn(work())).collect();
    // 5 admitted (3 running, 2 queued); 15 answered at once.
    gated.until(3, 2).await;
    tokio::time::timeout(Duration::from_secs(5), async {
        while gated.layer.stats().overloaded < 15 {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
    .unwrap();
    gated.gate.add_permits(5);
    let mut statuses = Vec::new();
    for handle in burst {
        let response = handle.await.unwrap();
        if response.status() == StatusCode::SERVICE_UNAVAILABLE {
            assert_eq!(response.headers()[header::RETRY_AFTER], "1");
        }
        statuses.push(response.status());
    }
    let ok = statuses.iter().filter(|s| **s == StatusCode::OK).count();
    let shed = statuses
        .iter()
        .filter(|s| **s == StatusCode::SERVICE_UNAVAILABLE)
        .count();
    assert_eq!((ok, shed), (5, 15));
    assert_eq!(gated.layer.stats().overloaded, 15);
    assert_eq!(gated.started(), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_whose_deadline_passes_while_queued_is_dropped_with_504() {
    let gated = Gated::new(HttpLoadShedLayer::new(policy(
        1,
        4,
        Duration::from_secs(30),
    )));
    let first = gated.spawn(work());
    gated.until(1, 0).await;

    let soon = clock::unix_millis() + 150;
    let late = Request::get("/work")
        .header(DEADLINE_HEADER, soon.to_string())
        .body(Body::empty())
        .unwrap();
    let started = clock::now();
    let response = gated.app.clone().oneshot(late).await.unwrap();
    let waited = started.elapsed();
    assert_eq!(response.status(), StatusCode::GATEWAY_TIMEOUT);
    assert!(
        waited >= Duration::from_millis(100) && waited < Duration::from_secs(2),
        "{waited:?}"
    );
    let problem = problem_of(response).await;
    assert_eq!(problem["type"], "urn:keel:problem:deadline_exceeded");
    assert_eq!(gated.started(), 1, "the expired request never ran");
    let stats = gated.layer.stats();
    assert_eq!((stats.overloaded, stats.expired), (0, 1));
    assert_eq!(stats.policy.expired, 1);

    gated.gate.add_permits(1);
    assert_eq!(first.await.unwrap().status(), StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_current_deadline_bounds_the_wait_too() {
    let layer = HttpLoadShedLayer::new(policy(1, 4, Duration::from_secs(30))).deadline_header(None);
    let gated = Gated::new(layer);
    // A deadline set by an outer layer (as `DeadlineLayer` does).
    let app = gated.app.clone().layer(axum::middleware::from_fn(
        |request: Request<Body>, next: axum::middleware::Next| {
            Deadline::after(Duration::from_millis(150)).scope(next.run(request))
        },
    ));
    let first = gated.spawn(work());
    gated.until(1, 0).await;
    let response = app.oneshot(work()).await.unwrap();
    assert_eq!(response.status(), StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(gated.layer.stats().expired, 1);
    gated.gate.add_permits(1);
    first.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_longer_than_the_latency_target_is_shed() {
    let gated = Gated::new(HttpLoadShedLayer::new(policy(
        1,
        4,
        Duration::from_millis(100),
    )));
    let first = gated.spawn(work());
    gated.until(1, 0).await;
    let response = gated.app.clone().oneshot(work()).await.unwrap();
    assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(response.headers()[header::RETRY_AFTER], "1");
    assert_eq!(gated.layer.stats().overloaded, 1);
    gated.gate.add_permits(1);
    first.await.unwrap();
}
