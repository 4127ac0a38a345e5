//! The Store conformance suite: what every messaging [`Store`] backend must
//! do, written once and run against each.
//!
//! The traits in [`keel_store`] describe the behaviour in
//! sentences; these tests are the same sentences as code. They use only the
//! traits (no backend SQL), so the identical suite runs on SQLite today and
//! PostgreSQL tomorrow, and "passes the suite" means the same on both.
//!
//! Run it from a backend's integration tests with
//! [`store_conformance_tests!`](crate::store_conformance_tests), giving an
//! async expression that makes a *fresh, empty* store. It expands into one
//! `#[tokio::test]` per behaviour, so each is reported on its own:
//!
//! ```ignore
//! keel_testkit::store_conformance_tests!(async {
//!     let dir = tempfile::tempdir().expect("temp dir");
//!     let store = SqliteStore::open(dir.path().join("keel.db")).await.expect("open");
//!     // Keep the directory alive for as long as the test uses the store.
//!     keel_testkit::store_suite::Fixture::new(store).keep_alive(dir)
//! });
//! ```
//!
//! The calling crate needs `tokio` with the `macros` and `rt-multi-thread`
//! features: the tests run on a two-thread runtime, so the store is used
//! from several threads at once, as in production.
//!
//! Assumptions the suite makes of a backend: timestamps keep at least
//! millisecond precision (the suite only stores whole milliseconds), and
//! each test gets a store no other test uses.
//!
//! [`Store`]: keel_store::Store

use std::any::Any;
use std::fmt;

use chrono::{DateTime, Utc};

pub mod dead_letter;
pub mod entity_version;
pub mod fence;
pub mod inbox;
pub mod lease;
pub mod outbox;
pub mod outbox_archive;
pub mod outbox_parked;
pub mod saga;

/// A store under test, with whatever must outlive it (a temporary
/// directory, a database container).
pub struct Fixture<S> {
    store: S,
    guards: Vec<Box<dyn Any + Send + Sync>>,
}

impl<S: fmt::Debug> fmt::Debug for Fixture<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Fixture")
            .field("store", &self.store)
            .field("guards", &self.guards.len())
            .finish()
    }
}

impl<S> Fixture<S> {
    /// A fixture of `store` alone.
    pub fn new(store: S) -> Self {
        Self {
            store,
            guards: Vec::new(),
        }
    }

    /// Keeps `guard` alive until the test ends (it is dropped after the
    /// store's last use).
    pub fn keep_alive(mut self, guard: impl Send + Sync + 'static) -> Self {
        self.guards.push(Box::new(guard));
        self
    }

    /// The store.
    pub fn store(&self) -> &S {
        &self.store
    }
}

// Every store is `Clone` and a fixture is not, which is what lets
// `Fixture::from` take a store or a ready fixture alike.
impl<S: Clone> From<S> for Fixture<S> {
    fn from(store: S) -> Self {
        Self::new(store)
    }
}

/// Now, truncated to whole milliseconds (what every backend can store).
pub fn now_ms() -> DateTime<Utc> {
    at_ms(keel_core::clock::utc_now().timestamp_millis())
}

/// The time `ms` milliseconds after the Unix epoch.
pub fn at_ms(ms: i64) -> DateTime<Utc> {
    DateTime::from_timestamp_millis(ms).unwrap_or(DateTime::UNIX_EPOCH)
}

/// Expands into one `#[tokio::test]` per Store behaviour, each run against
/// the store made by `$make` (an async expression yielding a store or a
/// [`Fixture`]). The tests are named `store_conformance::<table>::<behaviour>`.
/// See the [module docs](crate::store_suite).
///
/// With only `$make`, every table's behaviours run (the store is a
/// [`MessagingStore`](keel_store::MessagingStore)); after a `;`, only the tables named (`outbox`,
/// `outbox_parked`, `outbox_archive`, `inbox`, `dead_letter`, `saga`,
/// `fence`, `lease`, `entity_version`), for a backend that implements
/// just those tables' traits.
#[macro_export]
macro_rules! store_conformance_tests {
    ($make:expr) => {
        $crate::store_conformance_tests!(
            $make; outbox, outbox_parked, outbox_archive, inbox, dead_letter, saga, fence, lease, entity_version
        );
    };
    ($make:expr; $($table:ident),+ $(,)?) => {
        mod store_conformance {
            #[allow(unused_imports)]
            use super::*;
            $( $crate::__store_table_tests!($table, $make); )+
        }
    };
}

/// One table's behaviours, for [`store_conformance_tests!`]; not for
/// direct use.
#[doc(hidden)]
#[macro_export]
macro_rules! __store_table_tests {
    (outbox, $make:expr) => {
        $crate::__store_tests!(outbox, $make;
            committed_append_is_claimable,
            rolled_back_append_is_never_claimable,
            claims_in_id_order,
            lease_excludes_other_relays,
            relay_reclaims_its_own_lease,
            expired_lease_is_claimable_again,
            a_stale_release_leaves_the_new_claim,
            per_key_order_holds_across_relays,
            published_rows_are_not_claimed_and_leave_stats,
            stats_report_relay_lag,
            prune_deletes_in_bounded_batches,
            duplicate_event_id_is_a_conflict,
            late_commit_of_lower_id_is_not_skipped,
            published_rows_are_listed_in_id_order,
        );
    };
    (outbox_parked, $make:expr) => {
        $crate::__store_tests!(outbox_parked, $make;
            parked_row_holds_back_only_its_key,
            unparked_row_is_claimed_first_in_its_key,
            discarded_row_frees_its_key,
            parked_list_filters_by_topic_and_limit,
            failed_release_counts_attempts,
        );
    };
    (outbox_archive, $make:expr) => {
        $crate::__store_tests!(outbox_archive, $make;
            archive_moves_published_rows_in_bounded_batches,
        );
    };
    (inbox, $make:expr) => {
        $crate::__store_tests!(inbox, $make;
            records_once_per_event_and_handler,
            two_handlers_each_process_the_same_event,
            rolled_back_record_can_be_recorded_again,
            prune_deletes_in_bounded_batches,
        );
    };
    (dead_letter, $make:expr) => {
        $crate::__store_tests!(dead_letter, $make;
            put_then_get_round_trips,
            list_filters_and_orders_oldest_first,
            settles_only_once,
            settle_rolls_back_with_its_transaction,
            counts_pending_by_error_kind,
            failure_history_is_per_group_and_message,
        );
    };
    (saga, $make:expr) => {
        $crate::__store_tests!(saga, $make;
            get_many_returns_the_existing_ones,
            insert_is_idempotent,
            rolled_back_insert_leaves_nothing,
            save_is_optimistic_on_version,
            due_returns_unfinished_due_sagas_oldest_first,
            list_filters_by_status_and_age,
            counts_by_status,
            unknown_outcome_and_first_attempt_round_trip,
            an_unknown_outcome_survives_an_orchestrator_restart,
            save_in_lands_with_its_transaction,
            a_hook_writes_with_the_status_change,
        );
    };
    (fence, $make:expr) => {
        $crate::__store_tests!(fence, $make;
            tokens_strictly_increase,
            tokens_stay_distinct_and_ordered_under_concurrency,
        );
    };
    (lease, $make:expr) => {
        $crate::__store_tests!(lease, $make;
            a_lease_is_one_holders_until_it_runs_out,
            release_ends_a_lease_and_tokens_keep_growing,
            racing_holders_get_one_lease,
        );
    };
    (entity_version, $make:expr) => {
        $crate::__store_tests!(entity_version, $make;
            only_a_newer_version_advances,
            a_rolled_back_advance_leaves_nothing,
            racing_advances_serialize,
            the_guard_drops_events_that_arrive_late,
        );
    };
}

/// The tests of one table; not for direct use.
#[doc(hidden)]
#[macro_export]
macro_rules! __store_tests {
    ($module:ident, $make:expr; $($test:ident),* $(,)?) => {
        mod $module {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $test() {
                    let fixture = $crate::store_suite::Fixture::from($make.await);
                    $crate::store_suite::$module::$test(fixture.store()).await;
                }
            )*
        }
    };
}
