//! The Broker conformance suite (keel-testkit) against `KafkaBroker` on the
//! shared test server (tansu), each scenario on topics of its own (skipped
//! when there is no server, except in CI).
//!
//! Every scenario but the two that delete topics, which
//! `topic_deletion.rs` runs on a tansu of its own (see `common`).

mod common;

// The suite's tests await this expression; without a server the test
// returns before it makes a broker.
keel_testkit::broker_conformance_tests!(@without_topic_deletion match common::fresh_broker().await {
    Some(broker) => std::future::ready(broker),
    None => return,
};);
