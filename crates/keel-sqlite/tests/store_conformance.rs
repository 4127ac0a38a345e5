//! The storage contracts' conformance suites (Store, and the edge's tables
//! each behind its feature) against [`SqliteStore`], each test on a fresh
//! database file in its own temporary directory.

use keel_sqlite::store::SqliteStore;
use keel_testkit::store_suite::Fixture;

async fn fresh_store() -> Fixture<SqliteStore> {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("keel.db"))
        .await
        .expect("open store");
    Fixture::new(store).keep_alive(dir)
}

keel_testkit::store_conformance_tests!(fresh_store());

#[cfg(feature = "event-log")]
keel_testkit::event_log_conformance_tests!(fresh_store());

#[cfg(feature = "idempotency")]
keel_testkit::idempotency_conformance_tests!(fresh_store());

#[cfg(feature = "jobs")]
keel_testkit::jobs_conformance_tests!(fresh_store());

#[cfg(feature = "webhooks")]
keel_testkit::webhook_conformance_tests!(fresh_store());
