//! The Broker conformance suite: the executable meaning of the
//! [`Broker`](keel_store::Broker) contract.
//!
//! The contract's sentences (at-least-once, every group sees every message,
//! per-key order, publisher dedupe, leases) are easy to write and easy to
//! half-implement. Every backend, the embedded SQLite broker and NATS
//! JetStream alike, runs these same scenarios, so "passes on SQLite" and
//! "passes on JetStream" mean the same thing and code written against one
//! moves to the other unchanged.
//!
//! The scenarios test only contract-level behaviour, each on a fresh,
//! uniquely named topic, in real time with short leases (a paused tokio
//! clock cannot pause an external broker); each takes well under a few
//! seconds. Where a slow machine could turn a timing check into a false
//! failure, the check is one-sided: "not redelivered *before* the delay" is
//! measured from a clock read before the settle was sent.
//!
//! All subscriptions of one group in a scenario ask for the same lease (on
//! JetStream the ack wait belongs to the consumer, that is the group); a
//! consumer that must keep a message longer extends its lease, as real
//! consumers do.
//!
//! Run them all with [`broker_conformance_tests!`](crate::broker_conformance_tests),
//! which expands into one `#[tokio::test]` per scenario:
//!
//! ```ignore
//! async fn make_broker() -> MyBroker { MyBroker::connect("...").await.unwrap() }
//!
//! keel_testkit::broker_conformance_tests!(async { make_broker().await });
//! ```
//!
//! The calling crate needs `tokio` with the `macros` and `rt-multi-thread`
//! features among its dev-dependencies.
//!
//! [`OrderChecker`] is the invariant checker the interleaved scenario uses;
//! other tests (consumer runtimes, fault injection) can use it too.

mod basics;
mod checker;
mod expiry;
mod ordering;
mod outage;
mod redelivery;
mod reply_topics;
mod support;

use std::future::Future;
use std::time::Duration;

pub use basics::{
    ack_means_never_again, backlog_counts_what_the_group_has_not_finished,
    deliveries_say_when_the_broker_received_them, every_group_gets_every_message,
    group_members_split_the_work, late_group_receives_retained_messages, ping_answers,
    publish_then_receive, publisher_dedupes_on_message_id, receive_respects_max,
    receive_waits_then_returns_empty, receive_wakes_on_publish, terminate_means_never_again,
    the_broker_says_how_long_it_keeps_messages,
};
pub use checker::OrderChecker;
pub use expiry::{
    an_expiring_group_in_use_is_kept, an_idle_expiring_group_is_swept_with_its_topic,
    remove_group_deletes_at_once,
};
pub use ordering::{
    a_blocked_key_does_not_block_other_keys, many_keys_interleaved_keep_order,
    per_key_order_under_lease_expiry, per_key_order_under_nack,
};
pub use outage::an_outage_under_load_loses_nothing;
pub use redelivery::{
    extend_lease_keeps_it_invisible, lease_expiry_redelivers,
    nack_with_delay_redelivers_after_the_delay, nack_without_delay_redelivers_promptly,
    settle_after_lease_loss_is_lease_lost,
};
pub use reply_topics::a_restarted_requester_leaves_nothing_behind;

/// The longest any scenario may run before it counts as hung.
pub const SCENARIO_TIMEOUT: Duration = Duration::from_secs(90);

/// Runs one scenario, failing it if it takes longer than
/// [`SCENARIO_TIMEOUT`] (a hang is a failure, not a stuck CI job).
pub async fn run_scenario(name: &str, scenario: impl Future<Output = ()>) {
    if tokio::time::timeout(SCENARIO_TIMEOUT, scenario)
        .await
        .is_err()
    {
        panic!("broker conformance scenario {name} hung for {SCENARIO_TIMEOUT:?}");
    }
}

/// Expands into a module `broker_conformance` with one `#[tokio::test]` per
/// scenario of the [Broker conformance suite](crate::broker_suite).
///
/// The argument is an expression evaluated afresh in every test, producing
/// a future of the broker under test (any `B: Broker`); it is evaluated
/// inside the generated module, which imports the caller's module with
/// `use super::*`:
///
/// ```ignore
/// async fn make_broker() -> SqliteBroker { /* a fresh broker */ }
///
/// keel_testkit::broker_conformance_tests!(async { make_broker().await });
/// ```
///
/// `broker_conformance_tests!(@without_topic_deletion $make;)` leaves out
/// the two scenarios that delete topics, for a test server that cannot
/// delete one topic without harming others' (run them with a broker of
/// their own: [`an_idle_expiring_group_is_swept_with_its_topic`] and
/// [`remove_group_deletes_at_once`]).
#[macro_export]
macro_rules! broker_conformance_tests {
    ($make:expr) => {
        $crate::broker_conformance_tests!(@without_topic_deletion $make;
            an_idle_expiring_group_is_swept_with_its_topic,
            remove_group_deletes_at_once,
        );
    };
    // Every scenario but the two that delete a topic, plus `$extra`: for a
    // server whose topic deletion cannot share it with other tests (tansu
    // 0.6.0 deletes every topic of its cluster), which runs those two on
    // a server of their own.
    (@without_topic_deletion $make:expr; $($extra:ident),* $(,)?) => {
        $crate::broker_conformance_tests!(@scenarios $make;
            publish_then_receive,
            deliveries_say_when_the_broker_received_them,
            the_broker_says_how_long_it_keeps_messages,
            every_group_gets_every_message,
            group_members_split_the_work,
            ack_means_never_again,
            terminate_means_never_again,
            publisher_dedupes_on_message_id,
            receive_waits_then_returns_empty,
            receive_wakes_on_publish,
            receive_respects_max,
            late_group_receives_retained_messages,
            ping_answers,
            backlog_counts_what_the_group_has_not_finished,
            nack_with_delay_redelivers_after_the_delay,
            nack_without_delay_redelivers_promptly,
            lease_expiry_redelivers,
            extend_lease_keeps_it_invisible,
            settle_after_lease_loss_is_lease_lost,
            per_key_order_under_nack,
            per_key_order_under_lease_expiry,
            a_blocked_key_does_not_block_other_keys,
            many_keys_interleaved_keep_order,
            an_expiring_group_in_use_is_kept,
            $($extra,)*
        );
    };
    (@scenarios $make:expr; $($scenario:ident),* $(,)?) => {
        mod broker_conformance {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[::tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    let broker = ($make).await;
                    $crate::broker_suite::run_scenario(
                        ::core::stringify!($scenario),
                        $crate::broker_suite::$scenario(broker),
                    )
                    .await;
                }
            )*
        }
    };
}
