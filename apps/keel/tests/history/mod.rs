//! The clients of the crash tests: a workload of orders, each submitted
//! until accepted under its Idempotency-Key, with duplicates, every call
//! recorded in a history as ok, failed or unknown for the demo's checker.
#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use futures_util::StreamExt;
use hdrhistogram::Histogram;
use keel::demo::workload::{History, Outcome, WorkloadResult, order_for, read_answer};

/// Orders per run.
pub const ORDERS: u64 = 200;

/// Submits until accepted or refused, recording every call in `history`
/// as ok, failed or unknown.
pub async fn submit(
    http: &reqwest::Client,
    base_url: &str,
    key: &str,
    body: &[u8],
    history: &History,
) {
    for attempt in 0..300u64 {
        let sent = http
            .post(format!("{base_url}/orders"))
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body.to_vec())
            .send()
            .await;
        let outcome = match sent {
            Ok(response) => read_answer(response).await,
            Err(e) => Outcome::Unknown { why: e.to_string() },
        };
        let done = match &outcome {
            Outcome::Ok { .. } => true,
            Outcome::Failed { status } if *status != 409 => {
                panic!("key {key}: refused with {status}")
            }
            Outcome::Failed { .. } | Outcome::Unknown { .. } => false,
        };
        history.record(key, outcome);
        if done {
            return;
        }
        // A duplicate in flight (409), a 5xx or no connection (a server
        // restarting): the same key again, as a client would.
        tokio::time::sleep(Duration::from_millis(40 * (attempt.min(10) + 1))).await;
    }
}

/// Sends `ORDERS` orders, alternating between the two `urls` (which may be
/// one server's twice); every 5th is
/// sent again to the *other* server after its answer, every 10th to both
/// at once. Returns what the clients saw, as the demo's check wants it.
pub async fn workload(urls: &[String], seed: u64) -> WorkloadResult {
    let http = reqwest::Client::new();
    let history = History::default();
    let mut rng = fastrand::Rng::with_seed(seed);
    let jobs: Vec<(u64, String, Vec<u8>)> = (0..ORDERS)
        .map(|n| {
            let order = order_for(n, &mut rng);
            (
                n,
                format!("so-{seed}-{n}"),
                serde_json::to_vec(&order).unwrap(),
            )
        })
        .collect();
    let duplicates: u64 = futures_util::stream::iter(jobs)
        .map(|(n, key, body)| {
            let (http, history) = (http.clone(), &history);
            let first = urls[(n % 2) as usize].clone();
            let other = urls[((n + 1) % 2) as usize].clone();
            async move {
                let mut duplicates = 0;
                if n % 10 == 9 {
                    tokio::join!(
                        submit(&http, &first, &key, &body, history),
                        submit(&http, &other, &key, &body, history)
                    );
                    duplicates += 1;
                } else {
                    submit(&http, &first, &key, &body, history).await;
                }
                if n % 5 == 4 {
                    submit(&http, &other, &key, &body, history).await;
                    duplicates += 1;
                }
                duplicates
            }
        })
        .buffer_unordered(16)
        .fold(0, |total, d| async move { total + d })
        .await;
    let mut result = history.summarize(Histogram::new(3).unwrap());
    result.duplicates_sent = duplicates;
    eprintln!(
        "client calls: {} ok, {} failed, {} unknown ({} keys with an unknown call)",
        result.calls.ok,
        result.calls.failed,
        result.calls.unknown,
        result.unknown_keys.len()
    );
    result
}
