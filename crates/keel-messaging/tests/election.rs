//! The election contract's conformance suite on leases: SQLite, and
//! PostgreSQL (the suite's server; skipped without one, except in CI).
//! keel-redis and keel-etcd run the same suite on theirs.

use std::time::Duration;

use keel_messaging::election::LeaseElection;
use keel_sqlite::store::SqliteStore;
use keel_testkit::store_suite::Fixture;

/// The lease each suite's election uses: short, so a dead leader is
/// replaced within the suite's patience.
const TTL: Duration = Duration::from_secs(2);

async fn on_sqlite() -> Fixture<LeaseElection<SqliteStore>> {
    let dir = tempfile::tempdir().expect("temp dir");
    let store = SqliteStore::open(dir.path().join("keel.db"))
        .await
        .expect("open");
    Fixture::new(LeaseElection::new(store, "report", TTL)).keep_alive(dir)
}

mod sqlite {
    keel_testkit::election_conformance_tests!(crate::on_sqlite());
}

#[path = "../../keel-postgres/tests/common/mod.rs"]
mod common;

mod postgres {
    use super::*;

    keel_testkit::election_conformance_tests!(match crate::common::fresh_store().await {
        Some((store, lease)) => std::future::ready(
            Fixture::new(LeaseElection::new(store, "report", TTL)).keep_alive(lease),
        ),
        None => return,
    });
}
