//! Completion: a batch of attempts recorded, their deliveries moved and each
//! endpoint's failure window moved once, in one transaction.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use keel_store::DeliveryOutcome;
use keel_store::StoreError;
use serde::Serialize;

use crate::backend::SqlBackend;
use crate::dialect::{Dialect, Exec, Field, SqlRow, Value};
use crate::retry::retry;

/// A success at `$2` ends the failure window unless a failure after it
/// already started a new one.
const SUCCESS_SQL: &str = "\
UPDATE keel_webhook_endpoints
   SET last_success_at = CASE WHEN last_success_at IS NULL OR last_success_at < $2
                              THEN $2 ELSE last_success_at END,
       failing_since = CASE WHEN failing_since > $2 THEN failing_since ELSE NULL END
 WHERE id = $1";

/// A failure at `$2` starts the failure window, unless it is running since
/// earlier or a later success was recorded already.
const FAILURE_SQL: &str = "\
UPDATE keel_webhook_endpoints
   SET failing_since = CASE
         WHEN last_success_at IS NOT NULL AND last_success_at >= $2 THEN failing_since
         WHEN failing_since IS NULL OR failing_since > $2 THEN $2
         ELSE failing_since END
 WHERE id = $1";

/// One attempt of a batch, as [`complete`] passes it to the database.
#[derive(Serialize)]
struct StoredAttempt<'a, T> {
    d: i64,
    n: u32,
    at: T,
    url: &'a str,
    h: &'a [(String, String)],
    s: Option<u16>,
    b: Option<&'a str>,
    l: i64,
    e: Option<&'a str>,
}

/// One delivery's move of a batch, as [`complete`] passes it.
#[derive(Serialize)]
struct StoredMove<T> {
    d: i64,
    st: &'static str,
    n: u32,
    next: Option<T>,
    at: T,
}

/// What one batch says about an endpoint's health.
#[derive(Default)]
struct Health {
    /// The latest successful attempt.
    success: Option<DateTime<Utc>>,
    /// The earliest failed attempt after it (what may start the window).
    first_failure: Option<DateTime<Utc>>,
}

/// Per endpoint of a batch: the latest success, and the earliest failure
/// after it (what moves the failure window).
fn health<'a>(
    outcomes: &[DeliveryOutcome],
    owners: &'a HashMap<i64, String>,
) -> HashMap<&'a str, Health> {
    let mut seen: HashMap<&str, (Health, Vec<DateTime<Utc>>)> = HashMap::new();
    for outcome in outcomes {
        let attempt = &outcome.attempt;
        if let Some(endpoint) = owners.get(&attempt.delivery_id) {
            let (health, failures) = seen.entry(endpoint.as_str()).or_default();
            if attempt.succeeded() {
                health.success = health.success.max(Some(attempt.at));
            } else {
                failures.push(attempt.at);
            }
        }
    }
    seen.into_iter()
        .map(|(endpoint, (mut health, failures))| {
            health.first_failure = failures
                .into_iter()
                .filter(|at| health.success.is_none_or(|s| *at > s))
                .min();
            (endpoint, health)
        })
        .collect()
}

/// The statements of [`complete`]: the attempts, then the moves.
fn complete_sql<D: Dialect>() -> (String, String) {
    let attempts = D::json_records(
        "$1",
        "j",
        &[
            ("d", Field::Int),
            ("n", Field::Int),
            ("at", Field::Time),
            ("url", Field::Text),
            ("h", Field::Json),
            ("s", Field::Int),
            ("b", Field::Text),
            ("l", Field::Int),
            ("e", Field::Text),
        ],
    );
    let moves = D::json_records(
        "$1",
        "j",
        &[
            ("d", Field::Int),
            ("st", Field::Text),
            ("n", Field::Int),
            ("next", Field::Time),
            ("at", Field::Time),
        ],
    );
    (
        format!(
            "INSERT INTO keel_webhook_attempts (delivery_id, attempt, at, url, request_headers,
                 response_status, response_body, latency_us, error)
             SELECT j.d, j.n, j.at, j.url, j.h, j.s, j.b, j.l, j.e FROM {attempts}"
        ),
        format!(
            "UPDATE keel_webhook_deliveries AS d
                SET status = j.st, attempts = j.n,
                    next_attempt_at = COALESCE(j.next, d.next_attempt_at),
                    updated_at = j.at, leased_by = NULL, leased_until = NULL
               FROM {moves}
              WHERE d.id = j.d AND d.leased_by = $2 AND d.status = 'pending'"
        ),
    )
}

/// [`WebhookDeliveryStore::webhook_complete`](keel_store::WebhookDeliveryStore::webhook_complete).
pub async fn complete<B: SqlBackend>(
    store: &B,
    worker: &str,
    outcomes: &[DeliveryOutcome],
) -> Result<u64, StoreError> {
    if outcomes.is_empty() {
        return Ok(0);
    }
    let attempts: Vec<StoredAttempt<'_, <B::Dialect as Dialect>::JsonInstant>> = outcomes
        .iter()
        .map(|o| {
            let a = &o.attempt;
            StoredAttempt {
                d: a.delivery_id,
                n: a.attempt,
                at: B::Dialect::json_instant(a.at),
                url: &a.url,
                h: &a.request_headers,
                s: a.response_status,
                b: a.response_body.as_deref(),
                l: i64::try_from(a.latency.as_micros()).unwrap_or(i64::MAX),
                e: a.error.as_deref(),
            }
        })
        .collect();
    let moves: Vec<StoredMove<<B::Dialect as Dialect>::JsonInstant>> = outcomes
        .iter()
        .map(|o| StoredMove {
            d: o.attempt.delivery_id,
            st: o.status.as_str(),
            n: o.attempt.attempt,
            next: o.next_attempt_at.map(B::Dialect::json_instant),
            at: B::Dialect::json_instant(o.attempt.at),
        })
        .collect();
    let attempts = serde_json::to_string(&attempts).map_err(StoreError::other)?;
    let moves = serde_json::to_string(&moves).map_err(StoreError::other)?;
    let ids: Vec<i64> = outcomes.iter().map(|o| o.attempt.delivery_id).collect();
    let (insert_attempts, apply_moves) = complete_sql::<B::Dialect>();
    let owners_sql = format!(
        "SELECT id, endpoint_id FROM keel_webhook_deliveries WHERE {}",
        B::Dialect::any_of("id", "$1")
    );
    retry::<B::Dialect, _, _, _>("webhook_complete", || async {
        let mut tx = store.begin_own().await?;
        let owners: HashMap<i64, String> =
            B::Dialect::fetch_all(Exec::Tx(&mut tx), &owners_sql, &[Value::Ids(&ids)])
                .await?
                .iter()
                .map(|row| Ok((row.int("id")?, row.text("endpoint_id")?)))
                .collect::<Result<_, StoreError>>()?;
        B::Dialect::execute(
            Exec::Tx(&mut tx),
            &insert_attempts,
            &[Value::Json(&attempts)],
        )
        .await?;
        let applied = B::Dialect::execute(
            Exec::Tx(&mut tx),
            &apply_moves,
            &[Value::Json(&moves), worker.into()],
        )
        .await?;
        for (endpoint, health) in health(outcomes, &owners) {
            if let Some(success) = health.success {
                let params = [endpoint.into(), success.into()];
                B::Dialect::execute(Exec::Tx(&mut tx), SUCCESS_SQL, &params).await?;
            }
            if let Some(failure) = health.first_failure {
                let params = [endpoint.into(), failure.into()];
                B::Dialect::execute(Exec::Tx(&mut tx), FAILURE_SQL, &params).await?;
            }
        }
        store.commit_own(tx).await?;
        Ok(applied)
    })
    .await
}
