//! The demo's workload: orders from a mix of customers and skus, sent with
//! bounded concurrency over HTTP, some twice on purpose with the same
//! Idempotency-Key (once after the first answer, as a client whose
//! response was lost would; once concurrently, as a double click would).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// Keys whose submissions got different order ids (must be none).
    pub conflicting_keys: Vec<String>,
    /// Duplicate submissions sent.
    pub duplicates_sent: u64,
    /// Duplicate submissions answered with the first response
    /// (`Idempotent-Replayed: true`).
    pub duplicates_absorbed: u64,
    /// Submissions refused with a 4xx other than 409 (must be none).
    pub rejected: u64,
    /// Keys never accepted after every retry.
    pub failed: Vec<String>,
    /// `409 in flight` answers (a concurrent duplicate arrived first).
    pub in_flight_conflicts: u64,
    /// Request latency in microseconds (every submission).
    pub latency_us: Histogram<u64>,
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

enum Answer {
    Accepted {
        order_id: String,
        total: i64,
        replayed: bool,
    },
    Rejected,
    Failed,
}

struct Shared {
    client: reqwest::Client,
    url: String,
    latency: Mutex<Histogram<u64>>,
    in_flight: AtomicU64,
    progress: Arc<Progress>,
}

async fn submit(shared: &Shared, key: &str, body: &[u8]) -> Answer {
    for attempt in 0..200u32 {
        let started = keel_core::clock::now();
        let sent = shared
            .client
            .post(&shared.url)
            .header("idempotency-key", key)
            .header("content-type", "application/json")
            .body(body.to_vec())
            .send()
            .await;
        let took = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
        let _ = shared.latency.lock().record(took.max(1));
        let response = match sent {
            Ok(r) => r,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let status = response.status();
        let replayed = response
            .headers()
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true");
        if status.as_u16() == 201 {
            let Ok(order) = response.json::<serde_json::Value>().await else {
                continue;
            };
            shared.progress.answered.fetch_add(1, Ordering::Relaxed);
            if !replayed {
                shared.progress.accepted.fetch_add(1, Ordering::Relaxed);
            }
            return Answer::Accepted {
                order_id: order["id"].as_str().unwrap_or_default().to_owned(),
                total: order["totalCents"].as_i64().unwrap_or_default(),
                replayed,
            };
        }
        if status.as_u16() == 409 {
            shared.in_flight.fetch_add(1, Ordering::Relaxed);
        } else if status.is_client_error() {
            shared.progress.answered.fetch_add(1, Ordering::Relaxed);
            return Answer::Rejected;
        }
        // 409 (a duplicate in flight) and 5xx: retry with the same key.
        let pause = 20 * u64::from(attempt.min(10) + 1);
        tokio::time::sleep(Duration::from_millis(pause)).await;
    }
    Answer::Failed
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
        in_flight: AtomicU64::new(0),
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
    let answers: Vec<(String, Vec<Answer>)> = futures_util::stream::iter(jobs)
        .map(|(n, key, body)| {
            let shared = Arc::clone(&shared);
            async move {
                let twice = concurrent_every > 0 && n % concurrent_every == concurrent_every - 1;
                let mut answers = if twice {
                    let (a, b) =
                        tokio::join!(submit(&shared, &key, &body), submit(&shared, &key, &body));
                    vec![a, b]
                } else {
                    vec![submit(&shared, &key, &body).await]
                };
                if retry_every > 0 && n % retry_every == retry_every - 1 {
                    answers.push(submit(&shared, &key, &body).await);
                }
                (key, answers)
            }
        })
        .buffer_unordered(config.concurrency.max(1))
        .collect()
        .await;
    Ok(summarize(answers, &shared))
}

fn summarize(answers: Vec<(String, Vec<Answer>)>, shared: &Shared) -> WorkloadResult {
    let mut result = WorkloadResult {
        accepted: Vec::new(),
        conflicting_keys: Vec::new(),
        duplicates_sent: 0,
        duplicates_absorbed: 0,
        rejected: 0,
        failed: Vec::new(),
        in_flight_conflicts: shared.in_flight.load(Ordering::Relaxed),
        latency_us: shared.latency.lock().clone(),
    };
    for (key, answers) in answers {
        result.duplicates_sent += answers.len() as u64 - 1;
        let mut ids: HashMap<String, i64> = HashMap::new();
        let mut first_original = 0;
        for answer in answers {
            match answer {
                Answer::Accepted {
                    order_id,
                    total,
                    replayed,
                } => {
                    if replayed {
                        result.duplicates_absorbed += 1;
                    } else {
                        first_original += 1;
                    }
                    ids.insert(order_id, total);
                }
                Answer::Rejected => result.rejected += 1,
                Answer::Failed => result.failed.push(key.clone()),
            }
        }
        if ids.len() > 1 || first_original > 1 {
            result.conflicting_keys.push(key.clone());
        }
        if let Some((order_id, total_cents)) = ids.into_iter().next() {
            result.accepted.push(Accepted {
                key,
                order_id,
                total_cents,
            });
        }
    }
    result
}
