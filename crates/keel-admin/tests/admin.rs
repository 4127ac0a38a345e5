//! The admin API on a real SqliteStore: every route lists, inspects and
//! acts on dead letters, sagas and webhook deliveries seeded through the
//! store traits and the saga orchestrator, and every operator mistake (no
//! token, unknown id, wrong state, bad filter) is a problem+json with the
//! status that says so. Actions are checked in the store, not only in the
//! response: a replay settles the letter *and* writes its outbox row.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use http_body_util::BodyExt;
use keel_admin::{Admin, AdminToken, CSRF_HEADER, Gauge, SESSION_COOKIE};
use keel_core::{BoxError, Classified};
use keel_messaging::dead_letter::REPLAY_OF_HEADER;
use keel_messaging::saga::{Backoff, Jitter, SagaDefinition, SagaOrchestrator, Step, StepContext};
use keel_policy::breaker::{BreakerRegistry, CircuitBreakerConfig};
use keel_sqlite::store::SqliteStore;
use keel_store::broker::Message;
use keel_store::{
    AttemptError, DeadLetter, DeadLetterStatus, DeadLetterStore, DeliveryAttempt, DeliveryOutcome,
    DeliveryStatus, OutboxStore, SagaStatus, Store, WebhookEndpoint, WebhookMessage,
};
use keel_store::{WebhookDeliveryStore, WebhookEndpointStore, WebhookLogStore};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tempfile::TempDir;
use tower::ServiceExt;

const TOKEN: &str = "test-admin-token-0123456789";

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Order {
    order_id: String,
}

/// The shop's order saga, with switches for the faults the console fixes.
#[derive(Default)]
struct Faults {
    reserve_refused: AtomicBool,
    refund_broken: AtomicBool,
    receipt_broken: AtomicBool,
    /// The shipment request's answer is lost: it may have been scheduled.
    shipment_unknown: AtomicBool,
    /// The shipping service refuses the order for good.
    shipment_refused: AtomicBool,
}

fn order_saga(faults: &Arc<Faults>) -> SagaDefinition<Order> {
    let step = |name: &'static str, fails: fn(&Faults) -> &AtomicBool| {
        let faults = faults.clone();
        Step::new(name, move |_ctx: StepContext<Order>| {
            let broken = fails(&faults).load(Ordering::SeqCst);
            async move {
                if broken {
                    return Err::<(), BoxError>(format!("{name} failed").into());
                }
                Ok(())
            }
        })
        .timeout(Duration::from_secs(5))
        .max_attempts(1)
    };
    let refund = faults.clone();
    SagaDefinition::builder("order")
        .step(step("capture_payment", |_| &NEVER).compensate_with(
            move |_ctx: StepContext<Order>| {
                let broken = refund.refund_broken.load(Ordering::SeqCst);
                async move {
                    if broken {
                        return Err::<(), BoxError>("refund failed: payments down".into());
                    }
                    Ok(())
                }
            },
        ))
        .step(
            step("reserve_stock", |f| &f.reserve_refused)
                .compensate_with(|_ctx: StepContext<Order>| async { Ok::<(), BoxError>(()) }),
        )
        .pivot(shipment(faults))
        .step(step("send_receipt", |f| &f.receipt_broken))
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

static NEVER: AtomicBool = AtomicBool::new(false);

/// The pivot: its answer may be lost (an unknown outcome) or a refusal.
fn shipment(faults: &Arc<Faults>) -> Step<Order> {
    let faults = faults.clone();
    Step::new("schedule_shipment", move |_ctx: StepContext<Order>| {
        let unknown = faults.shipment_unknown.load(Ordering::SeqCst);
        let refused = faults.shipment_refused.load(Ordering::SeqCst);
        async move {
            if unknown {
                return Err::<(), BoxError>(Box::new(Classified::outcome_unknown(
                    "shipping: the connection dropped after the request was sent",
                )));
            }
            if refused {
                return Err(Box::new(Classified::permanent(
                    "shipping: no carrier for the address",
                )));
            }
            Ok(())
        }
    })
    .timeout(Duration::from_secs(5))
    .max_attempts(1)
}

struct World {
    _dir: TempDir,
    store: SqliteStore,
    faults: Arc<Faults>,
    saga: SagaDefinition<Order>,
    orchestrator: SagaOrchestrator<SqliteStore>,
    admin: Admin<SqliteStore>,
    app: Router,
}

async fn world() -> World {
    let dir = tempfile::tempdir().unwrap();
    let store = SqliteStore::open(dir.path().join("admin.db"))
        .await
        .unwrap();
    let faults = Arc::new(Faults::default());
    let saga = order_saga(&faults);
    let orchestrator = SagaOrchestrator::builder(store.clone())
        .saga(&saga)
        .build()
        .unwrap();
    let breakers = BreakerRegistry::new(CircuitBreakerConfig::default()).unwrap();
    breakers.get("payments");
    let admin = Admin::builder(store.clone())
        .token(AdminToken::new(TOKEN).unwrap())
        .sagas(orchestrator.clone())
        .breakers(breakers)
        .gauges_fn(|| {
            vec![
                Gauge::new("consumer_lag", 3.0)
                    .label("group", "billing")
                    .unit("messages"),
            ]
        })
        .build();
    World {
        _dir: dir,
        store,
        faults,
        saga,
        orchestrator,
        app: admin.router(),
        admin,
    }
}

struct Reply {
    status: StatusCode,
    content_type: String,
    body: Value,
}

impl World {
    async fn call(&self, method: Method, path: &str) -> Reply {
        self.call_with(method, path, Some(&format!("Bearer {TOKEN}")))
            .await
    }

    async fn call_with(&self, method: Method, path: &str, auth: Option<&str>) -> Reply {
        let mut request = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, "127.0.0.1:8080");
        if let Some(auth) = auth {
            request = request.header(header::AUTHORIZATION, auth);
        }
        let response = self
            .app
            .clone()
            .oneshot(request.body(Body::empty()).unwrap())
            .await
            .unwrap();
        let status = response.status();
        let content_type = response
            .headers()
            .get(header::CONTENT_TYPE)
            .map(|v| v.to_str().unwrap().to_owned())
            .unwrap_or_default();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Reply {
            status,
            content_type,
            body,
        }
    }

    async fn letter(&self, id: &str, topic: &str, errors: &[&str]) {
        let message = Message::new(
            format!("msg-{id}"),
            topic,
            format!("key-{id}"),
            format!("{{\"order\":\"{id}\"}}"),
        );
        let letter = DeadLetter {
            id: id.to_owned(),
            message,
            group: "billing".to_owned(),
            error_kind: "too_many_attempts".to_owned(),
            attempts: errors
                .iter()
                .enumerate()
                .map(|(i, e)| AttemptError {
                    attempt: i as u32 + 1,
                    error: (*e).to_owned(),
                    at: keel_core::clock::utc_now(),
                })
                .collect(),
            dead_at: keel_core::clock::utc_now(),
            status: DeadLetterStatus::Pending,
        };
        self.store.dead_letter_put(&letter).await.unwrap();
    }

    async fn start(&self, id: &str) {
        let mut tx = self.store.begin().await.unwrap();
        let order = Order {
            order_id: id.to_owned(),
        };
        self.orchestrator
            .start(&mut tx, &self.saga, id, &order)
            .await
            .unwrap();
        self.store.commit(tx).await.unwrap();
    }

    async fn settle(&self, id: &str) -> SagaStatus {
        for _ in 0..500 {
            let record = self.orchestrator.drive(id).await.unwrap();
            if record.status.is_terminal() || record.status == SagaStatus::Stuck {
                return record.status;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        panic!("saga {id} did not settle");
    }

    /// One failed delivery to a receiver that answered 500, with its log.
    async fn failed_delivery(&self) -> i64 {
        let now = keel_core::clock::utc_now();
        let endpoint = WebhookEndpoint {
            description: "partner".to_owned(),
            ..WebhookEndpoint::registered(
                "ep_partner",
                "https://hooks.example.com/partner",
                "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
                now,
            )
        };
        self.store.webhook_endpoint_create(&endpoint).await.unwrap();
        let mut tx = self.store.begin().await.unwrap();
        let message = WebhookMessage {
            event_id: "evt_1".to_owned(),
            event_type: "order.placed".to_owned(),
            payload: "{}".into(),
            traceparent: None,
        };
        self.store
            .webhook_enqueue(&mut tx, &[message], now)
            .await
            .unwrap();
        self.store.commit(tx).await.unwrap();
        let claimed = self
            .store
            .webhook_claim_due(
                "w1",
                keel_core::clock::utc_now(),
                10,
                10,
                Duration::from_secs(30),
            )
            .await
            .unwrap();
        let delivery = &claimed[0].delivery;
        let outcome = DeliveryOutcome {
            attempt: DeliveryAttempt {
                delivery_id: delivery.id,
                attempt: 1,
                at: keel_core::clock::utc_now(),
                url: endpoint.url.clone(),
                request_headers: Vec::new(),
                response_status: Some(500),
                response_body: Some("boom".to_owned()),
                latency: Duration::from_millis(12),
                error: None,
            },
            status: DeliveryStatus::Failed,
            next_attempt_at: None,
        };
        self.store.webhook_complete("w1", &[outcome]).await.unwrap();
        delivery.id
    }
}

fn assert_problem(reply: &Reply, status: StatusCode, says: &str) {
    assert_eq!(reply.status, status, "{}", reply.body);
    assert_eq!(reply.content_type, "application/problem+json");
    assert_eq!(reply.body["status"], status.as_u16());
    let detail = reply.body["detail"].as_str().unwrap_or_default();
    assert!(detail.contains(says), "`{detail}` should say `{says}`");
}

#[tokio::test]
async fn without_the_token_every_route_is_401_and_a_wrong_one_too() {
    let w = world().await;
    for (method, path) in [
        (Method::GET, "/admin/api/summary"),
        (Method::GET, "/admin/api/dead-letters"),
        (Method::POST, "/admin/api/dead-letters/x/replay"),
        (Method::POST, "/admin/api/sagas/x/retry"),
        (Method::GET, "/admin/api/lag"),
    ] {
        let reply = w.call_with(method.clone(), path, None).await;
        assert_problem(&reply, StatusCode::UNAUTHORIZED, "admin token");
        let wrong = w
            .call_with(method, path, Some("Bearer not-the-token-at-all"))
            .await;
        assert_eq!(wrong.status, StatusCode::UNAUTHORIZED, "{path}");
    }
    let forged = Request::get("/admin/api/summary")
        .header(header::HOST, "127.0.0.1:8080")
        .header(header::COOKIE, format!("{SESSION_COOKIE}=forged"))
        .body(Body::empty())
        .unwrap();
    let response = w.app.clone().oneshot(forged).await.unwrap();
    assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn a_session_reads_but_changes_nothing_without_its_csrf_token_or_from_another_site() {
    let w = world().await;
    let (session, value) = w.admin.access().sessions().issue();
    let cookie = format!("{SESSION_COOKIE}={value}");
    let get = Request::get("/admin/api/summary")
        .header(header::HOST, "127.0.0.1:8080")
        .header(header::COOKIE, &cookie)
        .body(Body::empty())
        .unwrap();
    assert_eq!(
        w.app.clone().oneshot(get).await.unwrap().status(),
        StatusCode::OK
    );
    w.letter("billing:1", "orders", &["boom"]).await;
    let discard = |origin: &str, csrf: Option<&str>| {
        let mut post = Request::post("/admin/api/dead-letters/billing:1/discard")
            .header(header::COOKIE, &cookie)
            .header(header::HOST, "127.0.0.1:8080")
            .header(header::ORIGIN, origin);
        if let Some(csrf) = csrf {
            post = post.header(CSRF_HEADER, csrf);
        }
        w.app.clone().oneshot(post.body(Body::empty()).unwrap())
    };
    let cross_site = discard("http://evil.example", Some(&session.csrf))
        .await
        .unwrap();
    assert_eq!(cross_site.status(), StatusCode::FORBIDDEN);
    let no_csrf = discard("http://127.0.0.1:8080", None).await.unwrap();
    assert_eq!(no_csrf.status(), StatusCode::FORBIDDEN);
    let wrong_csrf = discard("http://127.0.0.1:8080", Some("0123"))
        .await
        .unwrap();
    assert_eq!(wrong_csrf.status(), StatusCode::FORBIDDEN);
    let letter = w.store.dead_letter_get("billing:1").await.unwrap().unwrap();
    assert_eq!(
        letter.status,
        DeadLetterStatus::Pending,
        "nothing was discarded"
    );
    let meant = discard("http://127.0.0.1:8080", Some(&session.csrf))
        .await
        .unwrap();
    assert_eq!(meant.status(), StatusCode::OK);
    w.admin.access().sessions().revoke(&session);
    let get = Request::get("/admin/api/summary")
        .header(header::HOST, "127.0.0.1:8080")
        .header(header::COOKIE, &cookie)
        .body(Body::empty())
        .unwrap();
    let after_logout = w.app.clone().oneshot(get).await.unwrap();
    assert_eq!(after_logout.status(), StatusCode::UNAUTHORIZED, "revoked");
}

#[tokio::test]
async fn an_unknown_host_is_refused_even_with_the_token() {
    let w = world().await;
    let request = Request::get("/admin/api/summary")
        .header(header::HOST, "rebind.evil.example:8080")
        .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"))
        .body(Body::empty())
        .unwrap();
    let response = w.app.clone().oneshot(request).await.unwrap();
    assert_eq!(response.status(), StatusCode::FORBIDDEN);
    assert_eq!(response.headers()[header::CACHE_CONTROL], "no-store");
    assert_eq!(response.headers()[header::X_FRAME_OPTIONS], "DENY");
}

#[tokio::test]
async fn wrong_bearer_tokens_are_throttled() {
    let w = world().await;
    for _ in 0..keel_http::access::DEFAULT_MAX_FAILURES {
        let reply = w
            .call_with(
                Method::GET,
                "/admin/api/summary",
                Some("Bearer guess-guess-guess-guess"),
            )
            .await;
        assert_eq!(reply.status, StatusCode::UNAUTHORIZED);
    }
    let reply = w.call(Method::GET, "/admin/api/summary").await;
    assert_eq!(
        reply.status,
        StatusCode::TOO_MANY_REQUESTS,
        "even the right token waits once the address has guessed too often"
    );
}

#[tokio::test]
async fn a_public_address_without_a_token_is_refused() {
    let addr = "0.0.0.0:8080".parse().unwrap();
    let err = AdminToken::require_for(addr, None).unwrap_err();
    assert!(err.to_string().contains("without a token"), "{err}");
}

#[tokio::test]
async fn dead_letters_are_listed_inspected_with_history_and_filtered() {
    let w = world().await;
    w.letter("billing:a", "orders", &["timeout", "timeout", "refused"])
        .await;
    w.letter("billing:b", "payments", &["boom"]).await;
    w.store
        .failure_record(
            "billing",
            "msg-billing:a",
            &AttemptError {
                attempt: 4,
                error: "redelivered and failed again".to_owned(),
                at: keel_core::clock::utc_now(),
            },
        )
        .await
        .unwrap();

    let all = w.call(Method::GET, "/admin/api/dead-letters").await;
    assert_eq!(all.status, StatusCode::OK);
    assert_eq!(all.body["count"], 2);
    let only = w
        .call(
            Method::GET,
            "/admin/api/dead-letters?topic=payments&limit=5",
        )
        .await;
    assert_eq!(only.body["count"], 1);
    assert_eq!(only.body["items"][0]["id"], "billing:b");
    assert_eq!(only.body["items"][0]["last_error"], "boom");

    let one = w
        .call(Method::GET, "/admin/api/dead-letters/billing:a")
        .await;
    assert_eq!(one.status, StatusCode::OK);
    let history: Vec<&str> = one.body["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a["error"].as_str().unwrap())
        .collect();
    assert_eq!(history, ["timeout", "timeout", "refused"]);
    assert_eq!(
        one.body["later_failures"][0]["error"],
        "redelivered and failed again"
    );
    assert_eq!(one.body["payload"], "{\"order\":\"billing:a\"}");

    let summary = w.call(Method::GET, "/admin/api/summary").await;
    assert_eq!(summary.body["dead_letters_pending"]["too_many_attempts"], 2);

    for bad in [
        "/admin/api/dead-letters?limit=0",
        "/admin/api/dead-letters?limit=many",
        "/admin/api/dead-letters?status=lost",
        "/admin/api/dead-letters?topick=orders",
    ] {
        let reply = w.call(Method::GET, bad).await;
        assert_eq!(reply.status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(reply.content_type, "application/problem+json", "{bad}");
    }
    let missing = w.call(Method::GET, "/admin/api/dead-letters/nope").await;
    assert_problem(&missing, StatusCode::NOT_FOUND, "nope");
}

#[tokio::test]
async fn a_replay_settles_the_letter_and_writes_its_outbox_row_once() {
    let w = world().await;
    w.letter("billing:a", "orders", &["boom"]).await;
    w.letter("billing:b", "orders", &["boom"]).await;

    let replay = w
        .call(Method::POST, "/admin/api/dead-letters/billing:a/replay")
        .await;
    assert_eq!(replay.status, StatusCode::OK, "{}", replay.body);
    assert_eq!(replay.body["action"], "replayed");
    let letter = w.store.dead_letter_get("billing:a").await.unwrap().unwrap();
    assert_eq!(letter.status, DeadLetterStatus::Replayed);
    let rows = w
        .store
        .outbox_claim("test", 10, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].record.topic, "orders");
    assert_eq!(rows[0].record.headers[REPLAY_OF_HEADER], "billing:a");

    let again = w
        .call(Method::POST, "/admin/api/dead-letters/billing:a/replay")
        .await;
    assert_problem(&again, StatusCode::CONFLICT, "already replayed");
    let discard = w
        .call(Method::POST, "/admin/api/dead-letters/billing:a/discard")
        .await;
    assert_problem(&discard, StatusCode::CONFLICT, "already replayed");
    assert_eq!(w.store.outbox_stats().await.unwrap().unpublished, 1);

    let discard = w
        .call(Method::POST, "/admin/api/dead-letters/billing:b/discard")
        .await;
    assert_eq!(discard.status, StatusCode::OK);
    let letter = w.store.dead_letter_get("billing:b").await.unwrap().unwrap();
    assert_eq!(letter.status, DeadLetterStatus::Discarded);
    let pending = w.call(Method::GET, "/admin/api/dead-letters").await;
    assert_eq!(pending.body["count"], 0);
    let any = w
        .call(Method::GET, "/admin/api/dead-letters?status=any")
        .await;
    assert_eq!(any.body["count"], 2);

    let unknown = w
        .call(Method::POST, "/admin/api/dead-letters/nope/replay")
        .await;
    assert_problem(&unknown, StatusCode::NOT_FOUND, "nope");
}

#[tokio::test]
async fn replay_matching_replays_only_the_filtered_letters() {
    let w = world().await;
    w.letter("billing:a", "orders", &["boom"]).await;
    w.letter("billing:b", "orders", &["boom"]).await;
    w.letter("billing:c", "payments", &["boom"]).await;
    let reply = w
        .call(
            Method::POST,
            "/admin/api/dead-letters/replay-matching?topic=orders",
        )
        .await;
    assert_eq!(reply.status, StatusCode::OK, "{}", reply.body);
    assert_eq!(reply.body["affected"], 2);
    assert_eq!(w.store.outbox_stats().await.unwrap().unpublished, 2);
    let left = w.call(Method::GET, "/admin/api/dead-letters").await;
    assert_eq!(left.body["items"][0]["id"], "billing:c");
}

#[tokio::test]
async fn a_saga_stuck_in_compensation_is_retried_and_compensates() {
    let w = world().await;
    w.faults.reserve_refused.store(true, Ordering::SeqCst);
    w.faults.refund_broken.store(true, Ordering::SeqCst);
    w.start("order-1").await;
    assert_eq!(w.settle("order-1").await, SagaStatus::Stuck);

    let stuck = w.call(Method::GET, "/admin/api/sagas?status=stuck").await;
    assert_eq!(stuck.body["count"], 1);
    let saga = &stuck.body["items"][0];
    assert_eq!(saga["id"], "order-1");
    assert_eq!(saga["step_name"], "capture_payment");
    assert!(
        saga["last_error"]
            .as_str()
            .unwrap()
            .contains("refund failed")
    );
    let one = w.call(Method::GET, "/admin/api/sagas/order-1").await;
    assert_eq!(one.body["status"], "stuck");
    assert_eq!(one.body["step_name"], "capture_payment");

    w.faults.refund_broken.store(false, Ordering::SeqCst);
    let retried = w.call(Method::POST, "/admin/api/sagas/order-1/retry").await;
    assert_eq!(retried.status, StatusCode::OK, "{}", retried.body);
    assert_eq!(retried.body["status"], "compensating");
    assert_eq!(w.settle("order-1").await, SagaStatus::Compensated);
    let done = w.call(Method::GET, "/admin/api/sagas/order-1").await;
    assert_eq!(done.body["status"], "compensated");

    let again = w.call(Method::POST, "/admin/api/sagas/order-1/retry").await;
    assert_problem(&again, StatusCode::CONFLICT, "not stuck");
    let cancel = w
        .call(Method::POST, "/admin/api/sagas/order-1/cancel")
        .await;
    assert_problem(&cancel, StatusCode::CONFLICT, "already finished");
}

#[tokio::test]
async fn past_the_pivot_cancel_is_refused_and_retry_finishes_the_saga() {
    let w = world().await;
    w.faults.receipt_broken.store(true, Ordering::SeqCst);
    w.start("order-2").await;
    assert_eq!(w.settle("order-2").await, SagaStatus::Stuck);
    let cancel = w
        .call(Method::POST, "/admin/api/sagas/order-2/cancel")
        .await;
    assert_problem(&cancel, StatusCode::CONFLICT, "pivot");
    w.faults.receipt_broken.store(false, Ordering::SeqCst);
    let retry = w.call(Method::POST, "/admin/api/sagas/order-2/retry").await;
    assert_eq!(retry.body["status"], "running");
    assert_eq!(w.settle("order-2").await, SagaStatus::Completed);

    w.start("order-3").await;
    let cancel = w
        .call(Method::POST, "/admin/api/sagas/order-3/cancel")
        .await;
    assert_eq!(cancel.status, StatusCode::OK, "{}", cancel.body);
    assert_eq!(cancel.body["status"], "cancelled");
    let counts = w.call(Method::GET, "/admin/api/summary").await;
    assert_eq!(counts.body["sagas"]["completed"], 1);
    assert_eq!(counts.body["sagas"]["cancelled"], 1);

    let missing = w.call(Method::POST, "/admin/api/sagas/nope/retry").await;
    assert_problem(&missing, StatusCode::NOT_FOUND, "nope");
    let missing = w.call(Method::GET, "/admin/api/sagas/nope").await;
    assert_eq!(missing.status, StatusCode::NOT_FOUND);
    let bad = w
        .call(Method::GET, "/admin/api/sagas?status=sleeping")
        .await;
    assert_problem(&bad, StatusCode::BAD_REQUEST, "sleeping");
    let bad = w.call(Method::GET, "/admin/api/sagas?idle_secs=-4").await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
}

/// A pivot whose answer was lost may have shipped: the saga only goes
/// forward, so cancel is refused, and once its forward budget runs out it is
/// stuck. An operator who checked that the shipment does not exist says so;
/// the saga runs the pivot again, which now refuses, and compensates.
#[tokio::test]
async fn an_operator_confirms_a_maybe_applied_pivot_did_not_happen_and_it_compensates() {
    let w = world().await;
    w.faults.shipment_unknown.store(true, Ordering::SeqCst);
    w.start("order-9").await;
    assert_eq!(w.settle("order-9").await, SagaStatus::Stuck);
    let saga = w.call(Method::GET, "/admin/api/sagas/order-9").await;
    assert_eq!(saga.body["outcome_unknown"], true, "{}", saga.body);
    let cancel = w
        .call(Method::POST, "/admin/api/sagas/order-9/cancel")
        .await;
    assert_eq!(cancel.status, StatusCode::CONFLICT, "{}", cancel.body);

    w.faults.shipment_unknown.store(false, Ordering::SeqCst);
    w.faults.shipment_refused.store(true, Ordering::SeqCst);
    let confirmed = w
        .call(Method::POST, "/admin/api/sagas/order-9/confirm-not-applied")
        .await;
    assert_eq!(confirmed.status, StatusCode::OK, "{}", confirmed.body);
    assert_eq!(
        confirmed.body["outcome_unknown"], false,
        "{}",
        confirmed.body
    );
    assert_eq!(w.settle("order-9").await, SagaStatus::Compensated);

    let again = w
        .call(Method::POST, "/admin/api/sagas/order-9/confirm-not-applied")
        .await;
    assert_eq!(
        again.status,
        StatusCode::CONFLICT,
        "only a stuck saga: {}",
        again.body
    );
}

#[tokio::test]
async fn webhook_deliveries_show_their_attempts_and_are_resent() {
    let w = world().await;
    let id = w.failed_delivery().await;
    let list = w
        .call(
            Method::GET,
            "/admin/api/webhook-deliveries?endpoint=ep_partner&status=failed",
        )
        .await;
    assert_eq!(list.body["count"], 1);
    assert_eq!(list.body["items"][0]["id"], id);
    let one = w
        .call(Method::GET, &format!("/admin/api/webhook-deliveries/{id}"))
        .await;
    assert_eq!(one.body["attempt_log"][0]["response_status"], 500);
    assert_eq!(one.body["attempt_log"][0]["response_body"], "boom");

    let resend = w
        .call(
            Method::POST,
            &format!("/admin/api/webhook-deliveries/{id}/resend"),
        )
        .await;
    assert_eq!(resend.status, StatusCode::OK, "{}", resend.body);
    let delivery = w.store.webhook_delivery_get(id).await.unwrap().unwrap();
    assert_eq!(
        (delivery.status, delivery.attempts),
        (DeliveryStatus::Pending, 0)
    );

    let missing = w
        .call(Method::POST, "/admin/api/webhook-deliveries/999/resend")
        .await;
    assert_problem(&missing, StatusCode::NOT_FOUND, "999");
    let bad = w
        .call(Method::POST, "/admin/api/webhook-deliveries/abc/resend")
        .await;
    assert_problem(&bad, StatusCode::BAD_REQUEST, "abc");
    let bad = w
        .call(Method::GET, "/admin/api/webhook-deliveries?status=lost")
        .await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn breakers_and_lag_report_what_the_process_knows() {
    let w = world().await;
    let breakers = w.call(Method::GET, "/admin/api/breakers").await;
    assert_eq!(breakers.body["items"][0]["dependency"], "payments");
    assert_eq!(breakers.body["items"][0]["state"], "closed");
    w.letter("billing:a", "orders", &["boom"]).await;
    w.call(Method::POST, "/admin/api/dead-letters/billing:a/replay")
        .await;
    let lag = w.call(Method::GET, "/admin/api/lag").await;
    assert_eq!(lag.body["outbox"]["unpublished"], 1);
    assert_eq!(lag.body["gauges"][0]["name"], "consumer_lag");
    assert_eq!(lag.body["gauges"][0]["labels"]["group"], "billing");
}

#[tokio::test]
async fn broker_lag_reports_each_groups_unfinished_messages() {
    use keel_admin::BrokerLag;
    use keel_store::broker::{Broker, SubscribeOptions};
    let w = world().await;
    let broker = Arc::new(
        keel_sqlite::SqliteBroker::open(w._dir.path().join("broker.db"))
            .await
            .unwrap(),
    );
    let mut billing = broker
        .subscribe(SubscribeOptions::new("orders", "billing"))
        .await
        .unwrap();
    let messages: Vec<Message> = (0..3)
        .map(|n| Message::new(format!("m-{n}"), "orders", format!("k-{n}"), "{}"))
        .collect();
    broker.publish(&messages).await.unwrap();
    let held = billing.receive(1, Duration::from_secs(1)).await.unwrap();
    assert_eq!(held.len(), 1);
    let lag = BrokerLag::new(broker)
        .group("orders", "billing")
        .group("orders", "never-subscribed");
    let app = Admin::builder(w.store.clone())
        .token(AdminToken::new(TOKEN).unwrap())
        .gauges(lag)
        .build()
        .router();
    let response = app
        .oneshot(
            Request::get("/admin/api/lag")
                .header(header::HOST, "127.0.0.1:8080")
                .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"))
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .unwrap();
    let body: Value = serde_json::from_slice(
        &axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap(),
    )
    .unwrap();
    let gauges = body["gauges"].as_array().unwrap();
    assert_eq!(gauges.len(), 2, "the unknown group is left out: {body}");
    assert_eq!(gauges[0]["name"], "consumer_lag");
    assert_eq!(gauges[0]["value"], 3.0);
    assert_eq!(gauges[0]["labels"]["group"], "billing");
    assert_eq!(gauges[0]["labels"]["topic"], "orders");
    assert_eq!(gauges[1]["name"], "consumer_lag_in_flight");
    assert_eq!(gauges[1]["value"], 1.0);
}

#[tokio::test]
async fn without_an_orchestrator_sagas_are_listed_and_actions_are_501() {
    let w = world().await;
    w.start("order-9").await;
    let bare = Admin::builder(w.store.clone())
        .token(AdminToken::new(TOKEN).unwrap())
        .build()
        .router();
    let call = |method: Method, path: &str| {
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header(header::HOST, "127.0.0.1:8080")
            .header(header::AUTHORIZATION, format!("Bearer {TOKEN}"))
            .body(Body::empty())
            .unwrap();
        bare.clone().oneshot(request)
    };
    let list = call(Method::GET, "/admin/api/sagas").await.unwrap();
    assert_eq!(list.status(), StatusCode::OK);
    let retry = call(Method::POST, "/admin/api/sagas/order-9/retry")
        .await
        .unwrap();
    assert_eq!(retry.status(), StatusCode::NOT_IMPLEMENTED);
}

// ------------------------------------------------ parked outbox rows --

/// Appends events for `keys` (in one transaction) and parks the rows of
/// `poison`, as a relay does when the broker refuses them; returns the
/// row ids of every event, in order.
async fn park_outbox_rows(store: &SqliteStore, keys: &[&str], poison: &str) -> Vec<i64> {
    use keel_store::OutboxRecord;
    let records: Vec<OutboxRecord> = keys
        .iter()
        .enumerate()
        .map(|(i, key)| {
            let message = Message::new(format!("evt-{i}"), "orders", *key, "{}");
            OutboxRecord {
                event_id: message.id,
                topic: message.topic,
                partition_key: message.key,
                headers: message.headers,
                payload: message.payload,
            }
        })
        .collect();
    let mut tx = store.begin().await.unwrap();
    store.outbox_append(&mut tx, &records).await.unwrap();
    store.commit(tx).await.unwrap();
    let claimed = store
        .outbox_claim("relay-1", 100, Duration::from_secs(30))
        .await
        .unwrap();
    let mut first_poison = true;
    for row in &claimed {
        if row.record.partition_key == poison && first_poison {
            first_poison = false;
            store
                .outbox_park(
                    row.id,
                    "broker refused the request: key contains a line break",
                )
                .await
                .unwrap();
        } else {
            store.outbox_release("relay-1", &[row.id]).await.unwrap();
        }
    }
    claimed.iter().map(|r| r.id).collect()
}

#[tokio::test]
async fn parked_outbox_rows_are_listed_inspected_replayed_and_discarded() {
    let w = world().await;
    let ids = park_outbox_rows(&w.store, &["A", "bad\nkey", "B", "bad\nkey"], "bad\nkey").await;
    let parked = ids[1];

    for (method, path) in [
        (Method::GET, "/admin/api/outbox/parked".to_owned()),
        (Method::GET, format!("/admin/api/outbox/parked/{parked}")),
        (
            Method::POST,
            format!("/admin/api/outbox/parked/{parked}/replay"),
        ),
        (
            Method::POST,
            format!("/admin/api/outbox/parked/{parked}/discard"),
        ),
    ] {
        let reply = w.call_with(method, &path, None).await;
        assert_problem(&reply, StatusCode::UNAUTHORIZED, "admin token");
    }

    let list = w.call(Method::GET, "/admin/api/outbox/parked").await;
    assert_eq!(list.status, StatusCode::OK, "{}", list.body);
    assert_eq!(list.body["count"], 1);
    let row = &list.body["items"][0];
    assert_eq!(row["id"], parked);
    assert_eq!(row["event_id"], "evt-1");
    assert_eq!(row["key"], "bad\nkey");
    assert_eq!(row["attempts"], 1);
    assert_eq!(row["held_back"], 1, "the later event of its key waits");
    assert!(row["last_error"].as_str().unwrap().contains("line break"));
    let other_topic = w
        .call(Method::GET, "/admin/api/outbox/parked?topic=payments")
        .await;
    assert_eq!(other_topic.body["count"], 0);
    let one = w
        .call(Method::GET, &format!("/admin/api/outbox/parked/{parked}"))
        .await;
    assert_eq!(one.body["payload"], "{}");

    let summary = w.call(Method::GET, "/admin/api/summary").await;
    assert_eq!(summary.body["outbox"]["parked"], 1);
    assert_eq!(summary.body["outbox"]["unpublished"], 3);

    let replay = w
        .call(
            Method::POST,
            &format!("/admin/api/outbox/parked/{parked}/replay"),
        )
        .await;
    assert_eq!(replay.status, StatusCode::OK, "{}", replay.body);
    assert_eq!(replay.body["action"], "replayed");
    let claimed = w
        .store
        .outbox_claim("relay-2", 100, Duration::from_secs(30))
        .await
        .unwrap();
    let events: Vec<&str> = claimed.iter().map(|r| r.record.event_id.as_str()).collect();
    assert_eq!(
        events,
        ["evt-0", "evt-1", "evt-2", "evt-3"],
        "the replayed row is claimable again, before its key's next event"
    );
    assert_eq!(claimed[1].attempts, 0, "its attempts start again");
    let again = w
        .call(
            Method::POST,
            &format!("/admin/api/outbox/parked/{parked}/replay"),
        )
        .await;
    assert_problem(&again, StatusCode::NOT_FOUND, "no parked outbox row");

    // The broker refuses it again; this time the operator discards it.
    w.store
        .outbox_release("relay-2", &claimed.iter().map(|r| r.id).collect::<Vec<_>>())
        .await
        .unwrap();
    assert!(w.store.outbox_park(parked, "refused again").await.unwrap());
    let discard = w
        .call(
            Method::POST,
            &format!("/admin/api/outbox/parked/{parked}/discard"),
        )
        .await;
    assert_eq!(discard.status, StatusCode::OK, "{}", discard.body);
    assert_eq!(discard.body["action"], "discarded");
    let gone = w
        .call(Method::GET, &format!("/admin/api/outbox/parked/{parked}"))
        .await;
    assert_problem(&gone, StatusCode::NOT_FOUND, "no parked outbox row");
    let claimed = w
        .store
        .outbox_claim("relay-2", 100, Duration::from_secs(30))
        .await
        .unwrap();
    let events: Vec<&str> = claimed.iter().map(|r| r.record.event_id.as_str()).collect();
    assert_eq!(
        events,
        ["evt-0", "evt-2", "evt-3"],
        "discarded for good; its key flows"
    );

    let bad = w
        .call(Method::POST, "/admin/api/outbox/parked/seven/replay")
        .await;
    assert_problem(&bad, StatusCode::BAD_REQUEST, "whole numbers");
    let bad_limit = w
        .call(Method::GET, "/admin/api/outbox/parked?limit=0")
        .await;
    assert_problem(&bad_limit, StatusCode::BAD_REQUEST, "limit");
}

/// A choreographed flow left stuck by its watch is in the same list as the
/// orchestrated sagas, with its reason; the orchestrator's retry is not
/// for it, and says so instead of failing.
#[tokio::test]
async fn a_stuck_choreographed_flow_shows_with_the_sagas() {
    use keel_messaging::outbox::Outbox;
    use keel_messaging::saga::flow::{Flow, FlowWatch};
    use keel_store::envelope::Envelope;

    let w = world().await;
    let flow = Flow::builder("checkout", Duration::from_millis(100))
        .step("shop.order.placed.v1")
        .step("ship.scheduled.v1")
        .build()
        .unwrap();
    let placed = Envelope::new("/services/orders", "shop.order.placed.v1");
    let mut tx = w.store.begin().await.unwrap();
    flow.reached(&w.store, &mut tx, &placed).await.unwrap();
    w.store.commit(tx).await.unwrap();
    let watch = FlowWatch::builder(
        w.store.clone(),
        Outbox::new(w.store.clone()),
        "/services/orders",
        "flows",
    )
    .flow(&flow)
    .build();
    tokio::time::sleep(Duration::from_millis(150)).await;
    assert_eq!(watch.tick().await.unwrap(), 1);

    let stuck = w.call(Method::GET, "/admin/api/sagas?status=stuck").await;
    assert_eq!(stuck.body["count"], 1, "{}", stuck.body);
    let item = &stuck.body["items"][0];
    assert_eq!(item["id"], flow.record_id(&placed.id).as_str());
    assert_eq!(item["kind"], "checkout");
    assert!(
        item["last_error"]
            .as_str()
            .unwrap()
            .contains("with nothing to undo: an operator decides"),
        "{item}"
    );
    let counts = w.call(Method::GET, "/admin/api/summary").await;
    assert_eq!(counts.body["sagas"]["stuck"], 1, "{}", counts.body);
    let id = flow.record_id(&placed.id);
    let retry = w
        .call(Method::POST, &format!("/admin/api/sagas/{id}/retry"))
        .await;
    assert_problem(&retry, StatusCode::CONFLICT, "checkout");
}
