//! The conformance scenarios that delete topics, each on a tansu of its
//! own: on the shared server, tansu 0.6.0's topic deletion would delete
//! every other test's topics too (see `common`).

mod common;

use keel_testkit::broker_suite::{
    an_idle_expiring_group_is_swept_with_its_topic, remove_group_deletes_at_once, run_scenario,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_expiring_group_is_swept_with_its_topic_on_kafka() {
    let Some((broker, _tansu)) = common::private_broker().await else {
        return;
    };
    run_scenario(
        "an_idle_expiring_group_is_swept_with_its_topic",
        an_idle_expiring_group_is_swept_with_its_topic(broker),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remove_group_deletes_at_once_on_kafka() {
    let Some((broker, _tansu)) = common::private_broker().await else {
        return;
    };
    run_scenario(
        "remove_group_deletes_at_once",
        remove_group_deletes_at_once(broker),
    )
    .await;
}
