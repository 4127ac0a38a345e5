//! The WebhookStore conformance suite against [`SqliteStore`], each test on
//! a fresh database file in its own temporary directory.
#![cfg(feature = "webhooks")]

use keel_sqlite::store::SqliteStore;
use keel_testkit::store_suite::Fixture;

async fn fresh_store() -> Fixture<SqliteStore> {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("keel.db"))
        .await
        .expect("open store");
    Fixture::new(store).keep_alive(dir)
}

keel_testkit::webhook_conformance_tests!(fresh_store());
