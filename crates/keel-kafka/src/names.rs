//! Kafka names for Keel's topics and groups.
//!
//! A Keel topic is a Kafka topic of the same name, so other Kafka clients
//! read and write it as it is. A Keel group reads one topic, while a Kafka
//! consumer group may read many; the Kafka group id is therefore the group
//! and its topic (`<group>@<topic>`): groups of the same name on different
//! topics never rebalance each other.

use keel_store::broker::BrokerError;

/// Kafka's longest topic name.
const MAX_TOPIC_LEN: usize = 249;

/// The Kafka consumer group id of Keel's `group` on `topic`.
pub(crate) fn group_id(topic: &str, group: &str) -> String {
    format!("{group}@{topic}")
}

/// Where `group`'s terminated messages of `topic` go.
pub(crate) fn dead_letter_topic(topic: &str, group: &str) -> String {
    format!("{topic}.dead.{group}")
}

/// Refuses a topic name Kafka would refuse (characters other than ASCII
/// letters, digits, `.`, `_` and `-`; longer than 249; `.` or `..`).
pub(crate) fn check_topic(topic: &str) -> Result<(), BrokerError> {
    let legal = topic
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if topic.is_empty() || topic.len() > MAX_TOPIC_LEN || !legal || topic == "." || topic == ".." {
        return Err(BrokerError::Invalid(format!(
            "`{topic}` is not a Kafka topic name: use 1 to {MAX_TOPIC_LEN} ASCII letters, digits, `.`, `_` or `-`"
        )));
    }
    Ok(())
}

/// Refuses a group whose dead-letter topic Kafka would refuse.
pub(crate) fn check_group(topic: &str, group: &str) -> Result<(), BrokerError> {
    check_topic(topic)?;
    check_topic(&dead_letter_topic(topic, group)).map_err(|_| {
        BrokerError::Invalid(format!(
            "`{group}` cannot name a group of `{topic}` on Kafka: its dead-letter topic `{}` is not a topic name",
            dead_letter_topic(topic, group)
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kafka_names_are_checked_before_use() {
        assert!(check_topic("orders.placed_v2-eu").is_ok());
        for bad in ["", ".", "..", "a b", "ordres/1", "é", &"x".repeat(250)] {
            assert!(
                matches!(check_topic(bad), Err(BrokerError::Invalid(_))),
                "{bad:?}"
            );
        }
        assert!(check_group("orders", "billing").is_ok());
        assert!(matches!(
            check_group("orders", "bill ing"),
            Err(BrokerError::Invalid(_))
        ));
    }

    #[test]
    fn groups_of_one_name_on_two_topics_are_two_kafka_groups() {
        assert_ne!(group_id("a", "g"), group_id("b", "g"));
    }
}
