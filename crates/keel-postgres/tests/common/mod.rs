//! What every PostgreSQL test shares: a fresh, empty store per test, in a
//! schema of its own on the one server `scripts/services.sh` runs.
#![allow(dead_code, unreachable_pub)]

use keel_postgres::PgStore;
use keel_testkit::services::{ServerLock, Service};
use keel_testkit::store_suite::Fixture;

/// A unique schema name for one test (`keel_t_<uuidv7>`).
pub fn unique_schema() -> String {
    format!("keel_t_{}", uuid::Uuid::now_v7().simple())
}

/// Held for a whole test: shared by ordinary tests, exclusive for a test
/// that restarts the server, so a restart never hits another test of this
/// crate (they run in parallel processes against one server).
#[derive(Debug)]
pub struct ServerLease(#[allow(dead_code)] ServerLock);

impl ServerLease {
    pub fn take(exclusive: bool) -> Self {
        Self(if exclusive {
            ServerLock::exclusive(Service::Postgres)
        } else {
            ServerLock::shared(Service::Postgres)
        })
    }
}

/// A store on a new, empty schema with a shared [`ServerLease`], or `None`
/// when no server is available (skipped locally; `postgres_url` panics in
/// CI).
pub async fn fresh_store() -> Option<(PgStore, ServerLease)> {
    let url = keel_testkit::services::postgres_url()?;
    let lease = ServerLease::take(false);
    Some((store_in(&url, &unique_schema()).await, lease))
}

/// Like [`fresh_store`], but no other test of this crate runs meanwhile.
pub async fn fresh_store_alone() -> Option<(PgStore, ServerLease)> {
    let url = keel_testkit::services::postgres_url()?;
    let lease = ServerLease::take(true);
    Some((store_in(&url, &unique_schema()).await, lease))
}

/// A store on `schema` (another pool on the same schema when it exists).
pub async fn store_in(url: &str, schema: &str) -> PgStore {
    PgStore::options()
        .schema(schema)
        .max_connections(8)
        .open(url)
        .await
        .expect("connect to the test PostgreSQL")
}

/// [`fresh_store`] as a conformance-suite fixture.
pub async fn fresh_fixture() -> Option<Fixture<PgStore>> {
    let (store, lease) = fresh_store().await?;
    Some(Fixture::new(store).keep_alive(lease))
}
