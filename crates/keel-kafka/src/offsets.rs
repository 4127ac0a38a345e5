//! A group's lag, read from the cluster: what the contract's backlog and
//! the `/metrics` gauge count.

use std::sync::Arc;
use std::time::Duration;

use keel_store::broker::BrokerError;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::error::KafkaResult;
use rdkafka::{Offset, TopicPartitionList};

use crate::broker::{Inner, client_config};
use crate::error::{broker_error, task_failed};
use crate::log::ClientLog;
use crate::member::Member;
use crate::names;

/// A group's lag on a topic.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Lag {
    /// Whether the group committed an offset on any partition (a group
    /// that never did may not exist).
    pub(crate) committed: bool,
    /// Messages not committed past, summed over partitions (a partition
    /// never committed counts from its oldest retained message).
    pub(crate) total: u64,
}

/// The lag of `group`'s Kafka group on `topic`; `None` when the topic
/// does not exist.
pub(crate) async fn lag(
    inner: &Arc<Inner>,
    topic: &str,
    group: &str,
    member: Option<Arc<Member>>,
) -> Result<Option<Lag>, BrokerError> {
    let timeout = inner.options.request_timeout;
    let topic = topic.to_owned();
    let config = {
        let mut config = client_config(&inner.options);
        config
            .set("group.id", names::group_id(&topic, group))
            .set("enable.auto.commit", "false");
        config
    };
    let consumer = member.and_then(|member| member.consumer());
    tokio::task::spawn_blocking(move || match consumer {
        Some(consumer) => lag_of(consumer.as_ref(), &topic, timeout),
        None => {
            let consumer: BaseConsumer<ClientLog> = config.create_with_context(ClientLog)?;
            lag_of(&consumer, &topic, timeout)
        }
    })
    .await
    .map_err(task_failed)?
    .map_err(broker_error)
}

fn lag_of<C: ConsumerContext, K: Consumer<C>>(
    consumer: &K,
    topic: &str,
    timeout: Duration,
) -> KafkaResult<Option<Lag>> {
    let metadata = consumer.fetch_metadata(Some(topic), timeout)?;
    let Some(found) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Ok(None);
    };
    let mut partitions = TopicPartitionList::new();
    for partition in found.partitions() {
        partitions.add_partition(topic, partition.id());
    }
    let committed = consumer.committed_offsets(partitions, timeout)?;
    let mut committed_any = false;
    let mut total = 0u64;
    for element in committed.elements() {
        let (low, high) = consumer.fetch_watermarks(topic, element.partition(), timeout)?;
        let from = match element.offset() {
            Offset::Offset(at) => {
                committed_any = true;
                at
            }
            _ => low,
        };
        total += u64::try_from(high - from.max(low)).unwrap_or(0);
    }
    Ok(Some(Lag {
        committed: committed_any,
        total,
    }))
}
