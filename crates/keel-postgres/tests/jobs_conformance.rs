//! The jobs conformance suite of keel-testkit against [`PgStore`],
//! each test on a fresh schema of the shared test server (skipped when
//! there is none, except in CI).
//!
//! [`PgStore`]: keel_postgres::PgStore

mod common;

// The suite's tests await this expression; without a server the test
// returns before it makes a store.
keel_testkit::jobs_conformance_tests!(match common::fresh_fixture().await {
    Some(fixture) => std::future::ready(fixture),
    None => return,
});
