//! The Broker conformance suite (keel-testkit) against [`NatsBroker`] on
//! the test server, each scenario under its own stream prefix (skipped when
//! there is no server, except in CI).
//!
//! [`NatsBroker`]: keel_nats::NatsBroker

mod common;

// The suite's tests await this expression; without a server the test
// returns before it makes a broker.
keel_testkit::broker_conformance_tests!(match common::fresh_broker().await {
    Some(broker) => std::future::ready(broker),
    None => return,
});
