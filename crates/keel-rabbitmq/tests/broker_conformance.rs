//! The Broker conformance suite (keel-testkit) against [`RabbitBroker`] on
//! the test server, each scenario under a prefix of its own (skipped when
//! there is no server, except in CI).

mod common;

// The suite's tests await this expression; without a server the test
// returns before it makes a broker.
keel_testkit::broker_conformance_tests!(match common::fresh_broker().await {
    Some(broker) => std::future::ready(broker),
    None => return,
});
