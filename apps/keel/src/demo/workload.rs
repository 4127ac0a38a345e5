//! The demo's workload: orders from a mix of customers and skus, sent with
//! bounded concurrency over HTTP, some twice on purpose with the same
//! Idempotency-Key (once after the first answer, as a client whose
//! response was lost would; once concurrently, as a double click would).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub use super::history::{History, Outcome, OutcomeCounts};
use std::time::Duration;

use futures_util::StreamExt;
use hdrhistogram::Histogram;
use parking_lot::Mutex;
use serde::Serialize;

use crate::shop::model::{Item, NewOrder};

/// What to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkloadConfig {
    /// Distinct orders (keys).
    pub orders: u64,
    /// Requests in flight at most.
    pub concurrency: usize,
    /// Every n-th order is sent again after its answer (0: never).
    pub retry_every: u64,
    /// Every n-th order is sent twice at once (0: never).
    pub concurrent_every: u64,
    /// Seeds the choice of customers and skus.
    pub seed: u64,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        Self {
            orders: 1000,
            concurrency: 32,
            retry_every: 10,
            concurrent_every: 25,
            seed: 7,
        }
    }
}

/// An order the API accepted.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Accepted {
    /// The Idempotency-Key it was sent with.
    pub key: String,
    /// The order id in the answer.
    pub order_id: String,
    /// Its total.
    pub total_cents: i64,
}

/// Progress counters, shared with the progress line.
#[derive(Debug, Default)]
pub struct Progress {
    /// Submissions answered (duplicates included).
    pub answered: AtomicU64,
    /// Orders accepted.
    pub accepted: AtomicU64,
}

/// What the workload saw.
#[derive(Debug)]
pub struct WorkloadResult {
    /// One entry per key that was accepted.
    pub accepted: Vec<Accepted>,
    /// Keys whose calls got two order ids, or two fresh (not replayed)
    /// answers (must be none).
    pub conflicting_keys: Vec<String>,
    /// Every key sent.
    pub sent_keys: Vec<String>,
    /// Keys with at least one call whose outcome the client could not know.
    pub unknown_keys: Vec<String>,
    /// Every call, counted as ok, failed or unknown.
    pub calls: OutcomeCounts,
    /// Duplicate submissions sent.
    pub duplicates_sent: u64,
    /// Duplicate submissions answered with the first response
    /// (`Idempotent-Replayed: true`).
    pub duplicates_absorbed: u64,
    /// Calls refused with a 4xx other than 409 (must be none).
    pub rejected: u64,
    /// Keys never accepted after every retry.
    pub failed: Vec<String>,
    /// `409 in flight` answers (a concurrent duplicate arrived first).
    pub in_flight_conflicts: u64,
    /// Request latency in microseconds (every submission).
    pub latency_us: Histogram<u64>,
}

impl WorkloadResult {
    /// Nothing seen yet.
    pub fn empty(latency_us: Histogram<u64>) -> Self {
        Self {
            accepted: Vec::new(),
            conflicting_keys: Vec::new(),
            sent_keys: Vec::new(),
            unknown_keys: Vec::new(),
            calls: OutcomeCounts::default(),
            duplicates_sent: 0,
            duplicates_absorbed: 0,
            rejected: 0,
            failed: Vec::new(),
            in_flight_conflicts: 0,
            latency_us,
        }
    }
}

/// The order for the `n`-th key: 50 customers, everyday skus, and a few
/// orders of skus that run out (which the saga must compensate).
pub fn order_for(n: u64, rng: &mut fastrand::Rng) -> NewOrder {
    const SKUS: [&str; 6] = ["tea", "coffee", "mug", "kettle", "filter", "grinder"];
    let lines = rng.usize(1..=3);
    let mut items: Vec<Item> = (0..lines)
        .map(|_| {
            Item::new(
                SKUS[rng.usize(..SKUS.len())],
                rng.u32(1..=4),
                rng.i64(199..=4_999),
            )
        })
        .collect();
    match rng.u32(0..100) {
        0..=3 => items.push(Item::new("rare-vinyl", 1, 2_999)),
        4..=5 => items.push(Item::new("rare-teapot", 1, 8_900)),
        _ => {}
    }
    NewOrder {
        customer_id: format!("cust-{:02}", n % 50),
        currency: "USD".into(),
        items,
    }
}

struct Shared {
    client: reqwest::Client,
    url: String,
    latency: Mutex<Histogram<u64>>,
    history: History,
    progress: Arc<Progress>,
}

/// Sends one order until it is accepted or refused, recording every call.
async fn submit(shared: &Shared, key: &str, body: &[u8]) {
    for attempt in 0..200u32 {
        let started = keel_core::clock::now();
        let outcome = call(shared, key, body).await;
        let took = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        let _ = shared.latency.lock().record(took.max(1));
        let done = match &outcome {
            Outcome::Ok { replayed, .. } => {
                shared.progress.answered.fetch_add(1, Ordering::Relaxed);
                if !replayed {
                    shared.progress.accepted.fetch_add(1, Ordering::Relaxed);
                }
                true
            }
            Outcome::Failed { status } if *status != 409 => {
                shared.progress.answered.fetch_add(1, Ordering::Relaxed);
                true
            }
            // 409 (a duplicate in flight) and unknown outcomes: the same key
            // again, as a client would.
            Outcome::Failed { .. } | Outcome::Unknown { .. } => false,
        };
        shared.history.record(key, outcome);
        if done {
            return;
        }
        let pause = 20 * u64::from(attempt.min(10) + 1);
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
}

async fn call(shared: &Shared, key: &str, body: &[u8]) -> Outcome {
    let sent = shared
        .client
        .post(&shared.url)
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body.to_vec())
        .send()
        .await;
    match sent {
        Ok(response) => read_answer(response).await,
        Err(e) => Outcome::Unknown { why: e.to_string() },
    }
}

/// What an answer to `POST /orders` says happened.
pub async fn read_answer(response: reqwest::Response) -> Outcome {
    let status = response.status().as_u16();
    let replayed = response
        .headers()
        .get("idempotent-replayed")
        .is_some_and(|v| v == "true");
    if status != 201 {
        return Outcome::of_status(status);
    }
    match response.json::<serde_json::Value>().await {
        Ok(order) => Outcome::Ok {
            order_id: order["id"].as_str().unwrap_or_default().to_owned(),
            total_cents: order["totalCents"].as_i64().unwrap_or_default(),
            replayed,
        },
        Err(e) => Outcome::Unknown {
            why: format!("201 with an unreadable body: {e}"),
        },
    }
}

/// Sends the workload to `base_url` and reports what it saw.
pub async fn run(
    base_url: &str,
    config: &WorkloadConfig,
    progress: Arc<Progress>,
) -> Result<WorkloadResult, hdrhistogram::CreationError> {
    let latency = Histogram::new_with_bounds(1, 120_000_000, 3)?;
    let shared = Arc::new(Shared {
        client: reqwest::Client::builder()
            .pool_max_idle_per_host(config.concurrency)
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap_or_default(),
        url: format!("{base_url}/orders"),
        latency: Mutex::new(latency),
        history: History::default(),
        progress: Arc::clone(&progress),
    });
    let mut rng = fastrand::Rng::with_seed(config.seed);
    let jobs: Vec<(u64, String, Vec<u8>)> = (0..config.orders)
        .map(|n| {
            let order = order_for(n, &mut rng);
            let key = format!("demo-{}-{n}", config.seed);
            (n, key, serde_json::to_vec(&order).unwrap_or_default())
        })
        .collect();
    let retry_every = config.retry_every;
    let concurrent_every = config.concurrent_every;
    let sent = futures_util::stream::iter(jobs)
        .map(|(n, key, body)| {
            let shared = Arc::clone(&shared);
            async move {
                let twice = concurrent_every > 0 && n % concurrent_every == concurrent_every - 1;
                let mut sent = 1;
                if twice {
                    tokio::join!(submit(&shared, &key, &body), submit(&shared, &key, &body));
                    sent += 1;
                } else {
                    submit(&shared, &key, &body).await;
                }
                if retry_every > 0 && n % retry_every == retry_every - 1 {
                    submit(&shared, &key, &body).await;
                    sent += 1;
                }
                sent - 1
            }
        })
        .buffer_unordered(config.concurrency.max(1))
        .fold(0u64, |total, duplicates| async move { total + duplicates })
        .await;
    let latency = shared.latency.lock().clone();
    let mut result = shared.history.summarize(latency);
    result.duplicates_sent = sent;
    Ok(result)
}
