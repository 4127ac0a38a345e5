//! RabbitMQ killed (`SIGKILL`: nothing flushed, nothing said to clients)
//! and started again while a publisher and a consumer run.

mod common;

use std::sync::Arc;
use std::time::Duration;

use keel_rabbitmq::RabbitBroker;
use keel_store::broker::{Broker, SubscribeOptions};
use keel_testkit::services::{self, Service};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_server_loses_and_duplicates_nothing() {
    let Some(url) = services::rabbitmq_url() else {
        return;
    };
    let _exclusive =
        tokio::task::spawn_blocking(|| services::ServerLock::exclusive(Service::RabbitMq))
            .await
            .expect("the lock task panicked");
    let broker = Arc::new(
        RabbitBroker::connect(common::test_options(&url))
            .await
            .expect("connect"),
    );
    // RabbitMQ 3.10 can lose a quorum queue's Raft metadata written within
    // about a second before a SIGKILL: the queue comes back without a
    // leader, and every call on it waits (RELIABILITY.md). A deployment's
    // groups exist long before a crash; so do this test's.
    broker
        .declare_group(&SubscribeOptions::new("ledger", "effects"))
        .await
        .expect("declare the group");
    tokio::time::sleep(Duration::from_secs(3)).await;
    let crash = || services::crash(Service::RabbitMq).expect("crash rabbitmq-server");
    let publish_errors =
        keel_testkit::broker_suite::an_outage_under_load_loses_nothing(broker, crash).await;
    eprintln!("publish retries across the crash: {publish_errors}");
}
