//! A connection that goes silent: the network between Keel and PostgreSQL
//! drops every byte and says nothing (no reset, no refusal), so the server
//! never sees the statement and its `statement_timeout` never fires. The
//! store gives up on its own clock, the statement's timeout plus a margin,
//! and answers with what the silence may mean: nothing committed for a
//! statement inside a transaction, outcome unknown for a `COMMIT`.

#[path = "../../keel-postgres/tests/common/mod.rs"]
mod common;

use std::time::Duration;

use keel_messaging::StoreError;
use keel_messaging::envelope::Envelope;
use keel_messaging::outbox::{Outbox, OutboxError};
use keel_messaging::store::Store;
use keel_postgres::PgStore;
use keel_testkit::netfault::{Condition, FaultProxy};
use sqlx::postgres::PgConnectOptions;

/// The store's statement timeout in this test.
const STATEMENT_TIMEOUT: Duration = Duration::from_secs(1);
/// What the test calls "not hanging": the bound (statement and acquire
/// timeouts plus a 5 s margin, 7 s here) with room to spare; a TCP
/// retransmission gives up after minutes.
const ANSWERED_WITHIN: Duration = Duration::from_secs(20);

/// A store on a fresh schema whose connections all go through `proxy`.
async fn proxied_store() -> Option<(PgStore, FaultProxy, common::ServerLease)> {
    // Only stores with this statement timeout in the process: the bound is
    // the process's longest.
    let url = keel_testkit::services::postgres_url()?;
    let lease = common::ServerLease::take(false);
    let options: PgConnectOptions = url.parse().expect("a PostgreSQL URL");
    let server = (options.get_host().to_owned(), options.get_port());
    let upstream = tokio::net::lookup_host(server)
        .await
        .expect("resolve")
        .next()
        .expect("an address");
    let proxy = FaultProxy::start(upstream).await.expect("a proxy");
    let port = format!(":{}/", options.get_port());
    assert!(url.contains(&port), "{url} names its port");
    let through = url.replacen(&port, &format!(":{}/", proxy.addr().port()), 1);
    let proxied = PgStore::options()
        .schema(common::unique_schema())
        .max_connections(2)
        .acquire_timeout(Duration::from_secs(1))
        .statement_timeout(STATEMENT_TIMEOUT)
        .open(&through)
        .await
        .expect("connect through the proxy");
    Some((proxied, proxy, lease))
}

fn envelope(n: u32) -> Envelope {
    let mut envelope = Envelope::new("/test", "test.black_hole.v1");
    envelope.subject = Some(format!("n{n}"));
    envelope
}

/// Awaits `what`, failing the test if it hangs past [`ANSWERED_WITHIN`].
async fn answered<T>(what: impl Future<Output = T>) -> T {
    tokio::time::timeout(ANSWERED_WITHIN, what)
        .await
        .expect("the store hung on a silent connection")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_on_a_silent_connection_fails_and_nothing_commits() {
    let Some((store, proxy, _lease)) = proxied_store().await else {
        return;
    };
    let outbox = Outbox::new(store.clone());
    let mut tx = store.begin().await.expect("begin");
    proxy.set(Condition::BlackHole);
    let appended = answered(outbox.append(&mut tx, "orders", &envelope(1))).await;
    assert!(
        matches!(
            appended,
            Err(OutboxError::Store(StoreError::Unavailable(_)))
        ),
        "{appended:?}"
    );
    drop(tx);
    // The connection given up on goes back to the pool still waiting for
    // its answer: it must be closed within the bound, not hold its slot
    // until the kernel gives up on the socket.
    let closed = answered(async {
        while store.pool().size() > 0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    let () = closed;
    proxy.set(Condition::Healthy);
    // The pool's search_path names the store's schema.
    let pending: i64 = sqlx::query_scalar("SELECT count(*) FROM keel_outbox")
        .fetch_one(store.pool())
        .await
        .expect("count");
    assert_eq!(pending, 0, "a transaction that never committed left a row");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_on_a_silent_connection_answers_outcome_unknown() {
    let Some((store, proxy, _lease)) = proxied_store().await else {
        return;
    };
    let outbox = Outbox::new(store.clone());
    let mut tx = store.begin().await.expect("begin");
    outbox
        .append(&mut tx, "orders", &envelope(2))
        .await
        .expect("append");
    proxy.set(Condition::BlackHole);
    let committed = answered(store.commit(tx)).await;
    assert!(
        matches!(committed, Err(StoreError::OutcomeUnknown(_))),
        "{committed:?}"
    );
    proxy.set(Condition::Healthy);
}
