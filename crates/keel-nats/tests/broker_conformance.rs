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

/// Request-reply's reply topics, as streams: a crashed requester's goes
/// after its expiry (the server deletes the idle consumer, the restarted
/// requester's sweep the stream), a stopped one's at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_requester_leaves_nothing_behind() {
    use futures_util::TryStreamExt;
    let Some(broker) = common::fresh_broker().await else {
        return;
    };
    let nats = broker.broker.clone();
    let reply_topics = || async {
        let context = async_nats::jetstream::new(nats.client().clone());
        let names: Vec<String> = context
            .stream_names()
            .try_collect()
            .await
            .expect("list streams");
        let mut topics: Vec<String> = names
            .iter()
            .filter_map(|stream| nats.topic_of_stream(stream))
            .filter(|topic| topic.starts_with(keel_store::broker::reply::REPLY_TOPIC_PREFIX))
            .collect();
        topics.sort();
        topics
    };
    keel_testkit::broker_suite::a_restarted_requester_leaves_nothing_behind(broker, reply_topics)
        .await;
}
