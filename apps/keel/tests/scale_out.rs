//! Two `keel serve` processes on one PostgreSQL and one NATS JetStream
//! share the shop's work, and nothing is done twice, also when both
//! servers restart, or crash (immediate shutdown, SIGKILL), mid-run.
//!
//! Each test has a PostgreSQL schema and a NATS stream prefix of its own,
//! so tests running in parallel on one server never see each other. The
//! invariants are judged by the demo's own check (the keel-testkit ledger
//! plus money conservation), reading the shared schema from here.

#![cfg(all(feature = "postgres", feature = "nats"))]

mod cluster;

use std::time::Duration;

use cluster::{Cluster, ORDERS, ServerLease, verdict, workload};
use keel::metrics_report::Totals;
use keel_testkit::services::{self, Service};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_servers_share_the_work_and_do_nothing_twice() {
    let Some(cluster) = Cluster::new() else {
        return;
    };
    let _lease = ServerLease::take(false);
    let a = cluster.serve("a").await;
    let b = cluster.serve("b").await;
    let result = workload(&[&a, &b], 11).await;
    assert!(result.failed.is_empty(), "failed keys: {:?}", result.failed);
    assert!(
        result.conflicting_keys.is_empty(),
        "keys answered with two orders or two fresh answers: {:?}",
        result.conflicting_keys
    );
    assert_eq!(result.accepted.len() as u64, ORDERS);
    assert!(result.duplicates_absorbed >= ORDERS / 5);

    let store = cluster.store().await;
    let (_, dead) = verdict(&store, &result).await;
    assert_eq!(dead, 0);

    // The work was shared: each process's consumer applied some of the
    // orders and its relay published some, and together exactly once each.
    let http = reqwest::Client::new();
    let (ta, tb) = (a.totals(&http).await, b.totals(&http).await);
    let applied = |t: &Totals| t.get("keel_consumer_applied_total");
    let published = |t: &Totals| t.get("keel_outbox_published_total");
    assert!(
        applied(&ta) > 0 && applied(&tb) > 0,
        "applied: a {} b {}",
        applied(&ta),
        applied(&tb)
    );
    assert_eq!(
        applied(&ta) + applied(&tb),
        ORDERS,
        "each order applied once in all"
    );
    assert_eq!(
        published(&ta) + published(&tb),
        ORDERS,
        "each event published once: the two relays never take each other's claims"
    );
    eprintln!(
        "shared: a applied {} published {}, b applied {} published {}",
        applied(&ta),
        published(&ta),
        applied(&tb),
        published(&tb)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarting_postgres_and_nats_mid_run_loses_and_duplicates_nothing() {
    outage_mid_run(services::restart, "restarting").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashing_postgres_and_nats_mid_run_loses_and_duplicates_nothing() {
    outage_mid_run(services::crash, "crashing").await;
}

/// Runs the two-server workload while `outage` hits PostgreSQL and
/// nats-server, once per seed (`KEEL_FAULT_SEEDS`, else seed 1): the seed
/// draws which goes first and the pause before each. Every order must
/// settle once, with nothing lost.
async fn outage_mid_run(outage: fn(Service) -> Result<(), services::ServiceError>, what: &str) {
    for seed in keel_testkit::seeds::fault_seeds(1..=1) {
        if !outage_with_seed(outage, what, seed).await {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashing_postgres_and_nats_under_wal_relays_loses_and_duplicates_nothing() {
    for seed in keel_testkit::seeds::fault_seeds(1..=1) {
        // A cluster (schema, slot) per seed: one seed's processes, killed,
        // leave nothing the next one's must wait for.
        let Some(cluster) = Cluster::new() else {
            return;
        };
        let cluster = cluster.on_the_wal();
        run_outage(&cluster, services::crash, "crashing (WAL relays)", seed).await;
        cluster.drop_wal_slot().await;
    }
}

/// The shop on PostgreSQL and RabbitMQ (`--broker amqp://`), both killed
/// (SIGKILL) mid-run under two servers: every order settles once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashing_postgres_and_rabbitmq_loses_and_duplicates_nothing() {
    for seed in keel_testkit::seeds::fault_seeds(1..=1) {
        let Some(cluster) = Cluster::new().and_then(Cluster::on_rabbitmq) else {
            return;
        };
        run_outage(&cluster, services::crash, "crashing (RabbitMQ)", seed).await;
    }
}

/// The shop on PostgreSQL and Kafka (`--broker kafka://`, tansu in the
/// tests), both killed (SIGKILL) mid-run under two servers: every order
/// settles once.
#[cfg(feature = "kafka")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashing_postgres_and_kafka_loses_and_duplicates_nothing() {
    for seed in keel_testkit::seeds::fault_seeds(1..=1) {
        let Some(cluster) = Cluster::new().and_then(Cluster::on_kafka) else {
            return;
        };
        run_outage(&cluster, services::crash, "crashing (Kafka)", seed).await;
    }
}

/// One seeded run of [`outage_mid_run`]; `false` when no servers run.
async fn outage_with_seed(
    outage: fn(Service) -> Result<(), services::ServiceError>,
    what: &str,
    seed: u64,
) -> bool {
    let Some(cluster) = Cluster::new() else {
        return false;
    };
    run_outage(&cluster, outage, what, seed).await;
    true
}

/// Two servers of `cluster` under the workload while `outage` hits
/// PostgreSQL and the cluster's broker in the order and after the pauses `seed`
/// draws; every order must settle once, with nothing lost.
async fn run_outage(
    cluster: &Cluster,
    outage: fn(Service) -> Result<(), services::ServiceError>,
    what: &str,
    seed: u64,
) {
    let _lease = ServerLease::take(true);
    let a = cluster.serve("a").await;
    let b = cluster.serve("b").await;
    tokio::time::sleep(cluster.settle).await;
    let servers = [&a, &b];
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut order = [Service::Postgres, cluster.broker];
    if rng.bool() {
        order.reverse();
    }
    let pauses = [rng.u64(200..1_500), rng.u64(200..1_500)];
    let run = workload(&servers, 12);
    let faults = async {
        for (service, pause) in order.into_iter().zip(pauses) {
            tokio::time::sleep(Duration::from_millis(pause)).await;
            tokio::task::spawn_blocking(move || outage(service))
                .await
                .unwrap()
                .unwrap_or_else(|e| panic!("{what} {service:?}: {e}"));
        }
    };
    let (result, ()) = tokio::join!(run, faults);
    assert!(result.failed.is_empty(), "failed keys: {:?}", result.failed);
    assert!(
        result.conflicting_keys.is_empty(),
        "keys answered with two orders or two fresh answers: {:?}",
        result.conflicting_keys
    );
    assert_eq!(result.accepted.len() as u64, ORDERS);
    let store = cluster.store().await;
    let (invariants, dead) = verdict(&store, &result).await;
    eprintln!(
        "after {what} both servers (seed {seed}: {order:?} after {pauses:?} ms): {dead} dead \
         letters, 0 lost, 0 duplicated, 0 unexpected, {} recovered",
        invariants.recovered
    );
    if cluster.serve_args.iter().any(|arg| arg == "wal") {
        // The slot carried the events, not only the table's sweep.
        let http = reqwest::Client::new();
        let streamed = |t: &Totals| t.get("keel_outbox_wal_rows_total");
        let (ta, tb) = (a.totals(&http).await, b.totals(&http).await);
        assert!(
            streamed(&ta) + streamed(&tb) > 0,
            "no outbox row came through the slot"
        );
    }
}

/// A key in flight when its server is killed (`SIGKILL`: nothing completes
/// or releases it) is taken over by a retry on another server within
/// seconds, about one 10 s lock, not after a five-minute one; the order is
/// placed once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_in_flight_when_its_server_is_killed_is_taken_over_within_seconds() {
    let Some(cluster) = Cluster::new() else {
        return;
    };
    let _lease = ServerLease::take(false);
    let mut a = cluster.serve("a").await;
    let store = cluster.store().await;
    let body = br#"{"customerId":"killed-1","currency":"USD","items":[{"sku":"tea","qty":1,"unitPriceCents":450}]}"#;

    // Hold the orders table, so the request stops inside its handler with
    // its key recorded in flight.
    let mut held = store.pool().begin().await.expect("begin");
    sqlx::query("LOCK TABLE shop_orders IN ACCESS EXCLUSIVE MODE")
        .execute(&mut *held)
        .await
        .expect("lock the orders table");
    let http = reqwest::Client::new();
    let stuck = tokio::spawn({
        let (http, url) = (http.clone(), a.base_url.clone());
        async move {
            http.post(format!("{url}/orders"))
                .header("idempotency-key", "killed-key")
                .header("content-type", "application/json")
                .body(body.to_vec())
                .send()
                .await
        }
    });
    let mut in_flight = false;
    for _ in 0..100 {
        let state: Option<String> =
            sqlx::query_scalar("SELECT state FROM keel_idempotency WHERE idem_key = 'killed-key'")
                .fetch_optional(store.pool())
                .await
                .expect("read the key");
        if state.as_deref() == Some("in_flight") {
            in_flight = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(in_flight, "the request never recorded its key");

    a.child.kill().await.expect("SIGKILL server a");
    let killed = tokio::time::Instant::now();
    assert!(
        stuck.await.expect("task").is_err(),
        "server a died mid-request"
    );
    held.rollback().await.expect("release the table");

    let b = cluster.serve("b").await;
    let mut refused = 0;
    let placed = loop {
        let response = http
            .post(format!("{}/orders", b.base_url))
            .header("idempotency-key", "killed-key")
            .header("content-type", "application/json")
            .body(body.to_vec())
            .send()
            .await
            .expect("POST /orders to server b");
        match response.status().as_u16() {
            201 => break response.json::<serde_json::Value>().await.expect("order"),
            409 => refused += 1,
            other => panic!("unexpected {other}"),
        }
        assert!(
            killed.elapsed() < Duration::from_secs(30),
            "still locked after 30 s"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let took = killed.elapsed();
    eprintln!("taken over {took:?} after the kill, after {refused} answers of 409");
    assert!(took < Duration::from_secs(15), "took {took:?}");
    let orders: i64 =
        sqlx::query_scalar("SELECT count(*) FROM shop_orders WHERE customer_id = 'killed-1'")
            .fetch_one(store.pool())
            .await
            .expect("count orders");
    assert_eq!(orders, 1, "placed once: {placed}");
}

/// The realtime backplane: a customer following its orders over SSE on one
/// server sees every event of an order placed through the other, once
/// each and in order, within seconds (PostgreSQL's notifications wake the
/// other process's stream; nothing polls).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_customer_streaming_from_one_server_follows_an_order_placed_on_the_other() {
    let Some(cluster) = Cluster::new() else {
        return;
    };
    let _lease = ServerLease::take(false);
    let a = cluster.serve("a").await;
    let b = cluster.serve("b").await;
    let http = reqwest::Client::new();
    let mut stream = http
        .get(format!("{}/stream?customerId=backplane", b.base_url))
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), 200);
    let placed: serde_json::Value = http
        .post(format!("{}/orders", a.base_url))
        .header("idempotency-key", "backplane-1")
        .json(
            &serde_json::json!({"customerId": "backplane", "currency": "USD",
            "items": [{"sku": "tea", "qty": 2, "unitPriceCents": 450}]}),
        )
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let order_id = placed["id"].as_str().unwrap().to_owned();
    let mut text = String::new();
    let mut events = Vec::new();
    let followed = tokio::time::timeout(Duration::from_secs(20), async {
        while !events.iter().any(|e: &String| e == "order.completed") {
            let chunk = stream.chunk().await.unwrap().expect("the stream goes on");
            text.push_str(&String::from_utf8_lossy(&chunk));
            while let Some(end) = text.find("\n\n") {
                let frame: String = text.drain(..end + 2).collect();
                let kind = frame.lines().find_map(|l| l.strip_prefix("event: "));
                let data = frame.lines().find_map(|l| l.strip_prefix("data: "));
                if let (Some(kind), Some(data)) = (kind, data) {
                    assert!(data.contains(&order_id), "another order's event: {data}");
                    events.push(kind.to_owned());
                }
            }
        }
    })
    .await;
    assert!(followed.is_ok(), "events seen on b within 20 s: {events:?}");
    assert_eq!(
        events,
        ["order.placed", "order.completed"],
        "once each, in order"
    );
}
