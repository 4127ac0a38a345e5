//! A call to another service behind Keel's policies: a 2 s total timeout,
//! 700 ms per attempt, two attempts, and a circuit breaker, with the
//! deadline (`X-Request-Deadline-Unix-Ms`) and `traceparent` sent along.
//!
//! The program starts a flaky "payments" service on loopback (every other
//! request fails with `503`) and a dead one (always `503`), then:
//!
//! 1. charges through the flaky one: the retry hides the failures;
//! 2. hammers the dead one: the breaker opens, and from then on calls are
//!    refused at once without reaching the service, which is what protects
//!    it while it recovers.
//!
//! Run: `cargo run -p keel-examples --example dependency_with_policies`

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::http::StatusCode;
use axum::routing::post;
use keel_client::{HttpCallError, PropagatingClient};

/// A service on loopback that answers `503` whenever `fails(n)` says so for
/// its n-th request; returns its URL and its request counter.
async fn service(fails: fn(u64) -> bool) -> anyhow::Result<(String, Arc<AtomicU64>)> {
    let seen = Arc::new(AtomicU64::new(0));
    let counter = seen.clone();
    let app = Router::new().route(
        "/charges",
        post(move || {
            let n = counter.fetch_add(1, Ordering::SeqCst);
            async move {
                if fails(n) {
                    StatusCode::SERVICE_UNAVAILABLE
                } else {
                    StatusCode::CREATED
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/charges", listener.local_addr()?);
    tokio::spawn(async move { axum::serve(listener, app).await });
    Ok((url, seen))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    run().await
}

/// The whole example; the test below runs it too.
async fn run() -> anyhow::Result<()> {
    let client = PropagatingClient::new(reqwest::Client::new());

    // 1. Flaky: every other request fails, and the retry hides it.
    let (flaky_url, _) = service(|n| n % 2 == 0).await?;
    let payments = client.dependency("payments").build()?;
    for order in 1..=3 {
        let response = payments
            .send(|http| http.post(&flaky_url).body(format!("{{\"order\":{order}}}")))
            .await?;
        println!("order {order}: charged ({})", response.status());
    }

    // 2. Dead: the breaker opens and stops the calls.
    let (dead_url, reached) = service(|_| true).await?;
    let ledger = client.dependency("ledger").build()?;
    let (mut failed, mut refused) = (0, 0);
    for _ in 0..60 {
        match ledger.send(|http| http.post(&dead_url)).await {
            Err(HttpCallError::Rejected(_)) => refused += 1,
            Err(_) => failed += 1,
            Ok(response) => println!("unexpected answer {}", response.status()),
        }
    }
    println!(
        "ledger: {failed} calls failed, {refused} refused by the open breaker; \
         the service saw {} requests for 60 calls",
        reached.load(Ordering::SeqCst)
    );
    Ok(())
}

keel_examples::runs_to_the_end_test!();
