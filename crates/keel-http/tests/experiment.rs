//! Chaos experiments at the edge: only requests naming the experiment, from
//! a client allowed to, on the configured route, get the fault; everything
//! else is served as usual; and the experiment follows the request to the
//! dependencies it calls.
#![cfg(all(feature = "chaos", feature = "client"))]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::ConnectInfo;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::routing::get;
use http_body_util::BodyExt;
use keel_client::PropagatingClient;
use keel_http::experiment::{ExperimentLayer, ExperimentLayerBuilder};
use keel_policy::chaos::{ChaosExperiment, EXPERIMENT_HEADER, FaultInjection};
use parking_lot::Mutex;
use tower::ServiceExt;

const OUTAGE: &str = "shipping-outage";

fn outage() -> FaultInjection {
    FaultInjection::builder("shipping")
        .experiment(OUTAGE)
        .abort(100.0)
        .enabled(true)
        .build()
        .unwrap()
}

fn app(layer: ExperimentLayerBuilder) -> Router {
    Router::new()
        .route("/estimates/{customer}", get(|| async { "3 days" }))
        .route(
            "/whoami",
            get(|| async {
                ChaosExperiment::current().map_or("none".to_owned(), |e| e.to_string())
            }),
        )
        .layer(layer.build())
}

async fn send(
    app: &Router,
    path: &str,
    experiment: Option<&str>,
    peer: [u8; 4],
) -> (StatusCode, String) {
    let mut request = Request::builder()
        .uri(path)
        .extension(ConnectInfo(SocketAddr::from((peer, 40000))));
    if let Some(name) = experiment {
        request = request.header(EXPERIMENT_HEADER, name);
    }
    let response = app
        .clone()
        .oneshot(request.body(Body::empty()).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&body).into_owned())
}

const LOOPBACK: [u8; 4] = [127, 0, 0, 1];
const OUTSIDE: [u8; 4] = [203, 0, 113, 7];

#[tokio::test]
async fn only_the_experiments_requests_on_its_route_get_the_fault() {
    let app = app(ExperimentLayer::builder()
        .enabled(true)
        .fault("/estimates/{customer}", outage()));
    let (status, body) = send(&app, "/estimates/c-1", Some(OUTAGE), LOOPBACK).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(body.contains("chaos_fault_injected"), "{body}");
    assert_eq!(
        send(&app, "/estimates/c-1", None, LOOPBACK).await.0,
        StatusCode::OK,
        "ordinary traffic"
    );
    assert_eq!(
        send(&app, "/estimates/c-1", Some("another-one"), LOOPBACK)
            .await
            .0,
        StatusCode::OK,
        "another experiment"
    );
    assert_eq!(
        send(&app, "/whoami", Some(OUTAGE), LOOPBACK).await,
        (StatusCode::OK, OUTAGE.to_owned()),
        "another route runs, inside the experiment"
    );
    assert_eq!(send(&app, "/whoami", None, LOOPBACK).await.1, "none");
}

#[tokio::test]
async fn off_by_default_and_refused_from_outside_unless_trusted() {
    let off = app(ExperimentLayer::builder().fault("/estimates/{customer}", outage()));
    assert_eq!(
        send(&off, "/estimates/c-1", Some(OUTAGE), LOOPBACK).await.0,
        StatusCode::OK
    );
    assert_eq!(
        send(&off, "/whoami", Some(OUTAGE), LOOPBACK).await.1,
        "none",
        "not even scoped"
    );

    let on = app(ExperimentLayer::builder()
        .enabled(true)
        .fault("/estimates/{customer}", outage()));
    let (status, body) = send(&on, "/estimates/c-1", Some(OUTAGE), OUTSIDE).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    assert!(body.contains("chaos_experiment_refused"), "{body}");
    assert_eq!(
        send(&on, "/estimates/c-1", None, OUTSIDE).await.0,
        StatusCode::OK,
        "without the header"
    );

    let trusting = app(ExperimentLayer::builder()
        .enabled(true)
        .trust_any_client()
        .abort_status(StatusCode::BAD_GATEWAY)
        .fault("*", outage()));
    assert_eq!(
        send(&trusting, "/estimates/c-1", Some(OUTAGE), OUTSIDE)
            .await
            .0,
        StatusCode::BAD_GATEWAY
    );
}

#[tokio::test]
async fn a_loopback_peer_that_forwards_for_someone_else_is_not_trusted() {
    // A reverse proxy on this machine: the peer is loopback, the client
    // is not.
    let on = app(ExperimentLayer::builder()
        .enabled(true)
        .fault("/estimates/{customer}", outage()));
    for header in ["x-forwarded-for", "forwarded", "x-real-ip"] {
        let request = Request::builder()
            .uri("/estimates/c-1")
            .header(EXPERIMENT_HEADER, OUTAGE)
            .header(header, "for=203.0.113.7")
            .extension(ConnectInfo(SocketAddr::from((LOOPBACK, 40000))))
            .body(Body::empty())
            .unwrap();
        let response = on.clone().oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::FORBIDDEN, "{header}");
    }
}

#[tokio::test]
async fn a_malformed_experiment_name_is_a_400() {
    let on = app(ExperimentLayer::builder().enabled(true));
    for name in ["Shipping", "a b", "", &"x".repeat(65)] {
        assert_eq!(
            send(&on, "/whoami", Some(name), LOOPBACK).await.0,
            StatusCode::BAD_REQUEST,
            "{name:?}"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_delay_fault_holds_the_request_before_the_handler() {
    let slow = FaultInjection::builder("shipping")
        .experiment("shipping-latency")
        .delay(100.0, Duration::from_secs(5))
        .enabled(true)
        .build()
        .unwrap();
    let app = app(ExperimentLayer::builder()
        .enabled(true)
        .fault("/estimates/{customer}", slow));
    let started = tokio::time::Instant::now();
    assert_eq!(
        send(&app, "/estimates/c-1", Some("shipping-latency"), LOOPBACK)
            .await
            .0,
        StatusCode::OK
    );
    assert!(started.elapsed() >= Duration::from_secs(5));
}

#[tokio::test]
async fn the_experiment_follows_the_request_to_its_dependencies() {
    // The dependency records the experiment header of each call.
    let seen: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
    let record = Arc::clone(&seen);
    let dependency = Router::new().route(
        "/estimates",
        get(move |headers: HeaderMap| {
            let record = Arc::clone(&record);
            async move {
                let experiment = headers
                    .get(EXPERIMENT_HEADER)
                    .map(|v| v.to_str().unwrap().to_owned());
                record.lock().push(experiment);
                "3 days"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/estimates", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, dependency).await });

    let client = PropagatingClient::new(reqwest::Client::new());
    let edge = Router::new()
        .route(
            "/orders/{id}",
            get(move || {
                let (client, url) = (client.clone(), url.clone());
                async move {
                    client
                        .send(client.inner().get(url))
                        .await
                        .unwrap()
                        .text()
                        .await
                        .unwrap()
                }
            }),
        )
        .layer(ExperimentLayer::builder().enabled(true).build());
    assert_eq!(
        send(&edge, "/orders/A-1", Some(OUTAGE), LOOPBACK).await.1,
        "3 days"
    );
    assert_eq!(send(&edge, "/orders/A-1", None, LOOPBACK).await.1, "3 days");
    assert_eq!(*seen.lock(), [Some(OUTAGE.to_owned()), None]);
}
