//! Connection recycling against a real server that sees each call's
//! connection: keep-alive reuses one connection for ever; recycling retires
//! it after its requests or its lifetime, so a new backend behind the same
//! address would get traffic.

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{ConnectInfo, State};
use axum::routing::get;
use keel_client::{ConnectionRecycling, PropagatingClient};
use parking_lot::Mutex;

type Peers = Arc<Mutex<Vec<SocketAddr>>>;

/// A server that records the client address (so the connection) of every
/// call.
async fn server() -> (String, Peers) {
    let peers = Peers::default();
    let app = Router::new()
        .route(
            "/",
            get(
                |State(peers): State<Peers>, ConnectInfo(peer): ConnectInfo<SocketAddr>| async move {
                    peers.lock().push(peer);
                    "ok"
                },
            ),
        )
        .with_state(Arc::clone(&peers));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/", listener.local_addr().unwrap());
    tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .await
        .unwrap();
    });
    (url, peers)
}

async fn call(client: &PropagatingClient, url: &str, times: usize) {
    for _ in 0..times {
        let response = client.send(client.inner().get(url)).await.unwrap();
        assert_eq!(response.text().await.unwrap(), "ok");
    }
}

/// The most calls any one connection served.
fn most_calls_on_one_connection(peers: &Peers) -> usize {
    let seen = peers.lock();
    seen.iter()
        .map(|p| seen.iter().filter(|q| *q == p).count())
        .max()
        .unwrap_or(0)
}

#[tokio::test]
async fn without_recycling_keep_alive_keeps_using_a_connection() {
    let (url, peers) = server().await;
    let client = PropagatingClient::new(reqwest::Client::new());
    call(&client, &url, 12).await;
    assert!(
        most_calls_on_one_connection(&peers) > 4,
        "{:?}",
        peers.lock()
    );
}

#[tokio::test]
async fn connections_retire_after_their_requests() {
    let (url, peers) = server().await;
    let client = PropagatingClient::recycling(
        reqwest::Client::new,
        ConnectionRecycling::default().or_after_requests(4),
    );
    call(&client, &url, 12).await;
    assert!(
        most_calls_on_one_connection(&peers) <= 4,
        "{:?}",
        peers.lock()
    );
}

#[tokio::test]
async fn connections_retire_after_their_lifetime() {
    let (url, peers) = server().await;
    let client = PropagatingClient::recycling(
        reqwest::Client::new,
        ConnectionRecycling::after(Duration::from_millis(200)),
    );
    call(&client, &url, 3).await;
    let before: BTreeSet<_> = peers.lock().iter().copied().collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    call(&client, &url, 3).await;
    let after: BTreeSet<_> = peers.lock()[3..].iter().copied().collect();
    assert!(
        before.is_disjoint(&after),
        "no connection outlives 200 ms: {before:?} then {after:?}"
    );
}
