//! Exchange and queue names, and the shard of a key.

use keel_store::broker::BrokerError;

/// The longest name RabbitMQ accepts (an AMQP short string).
const MAX_NAME: usize = 255;

/// Names of one broker's exchanges and queues, all under its prefix.
#[derive(Debug, Clone)]
pub(crate) struct Names {
    prefix: String,
}

impl Names {
    pub(crate) fn new(prefix: &str) -> Self {
        Self {
            prefix: escape(prefix),
        }
    }

    /// The direct exchange a topic's messages are published to.
    pub(crate) fn exchange(&self, topic: &str) -> String {
        format!("{}/{}", self.prefix, escape(topic))
    }

    /// One shard queue of a group.
    pub(crate) fn queue(&self, topic: &str, group: &str, shard: u16) -> String {
        format!(
            "{}/{}/{}/{shard}",
            self.prefix,
            escape(topic),
            escape(group)
        )
    }

    /// The exchange every group's dead letters go to.
    pub(crate) fn dead_exchange(&self) -> String {
        format!("{}/dead", self.prefix)
    }

    /// The queue keeping a group's dead letters (also their routing key).
    pub(crate) fn dead_queue(&self, topic: &str, group: &str) -> String {
        format!("{}/dead/{}/{}", self.prefix, escape(topic), escape(group))
    }

    /// Refuses a topic no group could ever read: one whose queues could not
    /// be named even for a one-letter group.
    pub(crate) fn check_topic(&self, topic: &str) -> Result<(), BrokerError> {
        self.check(topic, "g")
    }

    /// Refuses a topic or group whose names RabbitMQ could not carry.
    pub(crate) fn check(&self, topic: &str, group: &str) -> Result<(), BrokerError> {
        if topic.is_empty() || group.is_empty() {
            return Err(BrokerError::Invalid(
                "topic and group names must not be empty".into(),
            ));
        }
        let longest = self
            .dead_queue(topic, group)
            .len()
            .max(self.queue(topic, group, u16::MAX).len());
        if longest > MAX_NAME {
            return Err(BrokerError::Invalid(format!(
                "topic {topic:?} with group {group:?} makes a queue name of {longest} bytes; RabbitMQ takes {MAX_NAME}"
            )));
        }
        Ok(())
    }
}

/// The shard a key's messages go to: stable across processes and builds.
pub(crate) fn shard_of(key: &str, shards: u16) -> u16 {
    (crc32fast::hash(key.as_bytes()) % u32::from(shards.max(1))) as u16
}

/// `/` separates the parts of a name, so parts escape it (and `%`).
fn escape(part: &str) -> String {
    part.replace('%', "%25").replace('/', "%2F")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_cannot_run_into_each_other() {
        let names = Names::new("keel");
        assert_ne!(names.queue("a/b", "c", 0), names.queue("a", "b/c", 0));
        assert_eq!(names.queue("a/b", "c", 3), "keel/a%2Fb/c/3");
    }

    #[test]
    fn a_key_always_lands_in_the_same_shard() {
        assert_eq!(shard_of("order-42", 8), shard_of("order-42", 8));
        assert!((0..1000).all(|i| shard_of(&format!("k-{i}"), 8) < 8));
        let used: std::collections::BTreeSet<u16> =
            (0..1000).map(|i| shard_of(&format!("k-{i}"), 8)).collect();
        assert_eq!(used.len(), 8, "keys spread over every shard");
    }

    #[test]
    fn names_too_long_for_rabbitmq_are_refused() {
        let names = Names::new("keel");
        assert!(names.check("orders", "billing").is_ok());
        assert!(matches!(names.check("", "g"), Err(BrokerError::Invalid(_))));
        assert!(matches!(
            names.check(&"t".repeat(200), &"g".repeat(60)),
            Err(BrokerError::Invalid(_))
        ));
    }
}
