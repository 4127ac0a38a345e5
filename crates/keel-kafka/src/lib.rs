//! Keel's messaging [`Broker`](keel_store::Broker) on Kafka, through
//! `rdkafka` (the librdkafka binding).
//!
//! [`KafkaBroker`] passes the same conformance suite (`keel-testkit`) as
//! the embedded broker, NATS JetStream and RabbitMQ. Topics are logs, so a
//! group created late reads the topic's retained history
//! ([`GroupStart::OldestRetained`](keel_store::broker::GroupStart::OldestRetained)).
//!
//! # How Keel maps onto Kafka
//!
//! - **A Keel topic is a Kafka topic** of the same name, created on first
//!   use with [`partitions`](KafkaBrokerOptions::partitions) partitions,
//!   a [`replication`](KafkaBrokerOptions::replication) factor and
//!   `retention.ms`. A message's key is the record key, so a key always
//!   lands on one partition (murmur2, as Java clients partition).
//! - **Publishes are idempotent and fully acknowledged**: the producer
//!   runs with `enable.idempotence` and `acks=all`, and `publish` returns
//!   once every message was acknowledged; one not acknowledged within
//!   [`publish_timeout`](KafkaBrokerOptions::publish_timeout) is
//!   `OutcomeUnknown` (republishing is safe: see dedupe below).
//! - **A Keel group is a Kafka consumer group** (`<group>@<topic>`) using
//!   the cooperative-sticky assignor. A process has one Kafka consumer per
//!   group, shared by its subscriptions of that group.
//! - **Leases, delayed nacks and per-key holds live in the member** that
//!   holds the records: Kafka has none. A record is handed out under a
//!   lease, taken back when the lease runs out or a nack's delay passes,
//!   and a key's later record waits while an earlier one is unsettled.
//! - **Ack last**: the offset committed for a partition is its oldest
//!   unsettled record's, so a commit never passes a record whose effect
//!   did not commit. Settled offsets are committed every
//!   [`commit_interval`](KafkaBrokerOptions::commit_interval), when a
//!   partition is revoked and when the member leaves; a crash redelivers
//!   what was settled since the last commit, which the idempotent
//!   consumer's inbox drops.
//! - **Rebalances**: a revoked partition's settled offsets are committed
//!   as it goes, and its unsettled records are abandoned to the next
//!   owner (their settles fail with `LeaseLost`).
//! - **Backpressure**: a member holding
//!   [`max_held`](KafkaBrokerOptions::max_held) records pauses its
//!   partitions until it holds half as many.
//! - **Publisher dedupe on arrival**: Kafka's idempotent producer drops a
//!   producer's own retries, not a republish; so a member drops a message
//!   id it saw at another offset within
//!   [`dedupe_window`](KafkaBrokerOptions::dedupe_window) (the same offset
//!   read again is not a duplicate). The window is the member's: a
//!   partition that moves to another member, or a restart, starts it
//!   afresh, and the inbox catches what gets through.
//! - **Delivery counts** are the member's: a record redelivered after a
//!   rebalance or a restart counts from 1 again.
//! - **Dead letters**: a terminated delivery is written to
//!   `<topic>.dead.<group>` (with `keel-dead-letter-group` and
//!   `keel-delivery-count` headers) before it is settled. Keel's consumer
//!   runtime keeps its own dead letters, with the error history, in the
//!   Store.
//! - **CloudEvents**: `ce-*` headers travel as `ce_*` record headers (the
//!   CloudEvents Kafka binding's binary mode), and the id as `event-id`.
//! - **Expiring groups** (request-reply's reply topics) are deleted, with
//!   the topic created for them, by the sweep of the process that
//!   subscribed them; a group left behind by a process that died is
//!   deleted by Kafka itself once its offsets expire
//!   (`offsets.retention.minutes`).
//!
//! # What order holds, and when
//!
//! Messages of one key are delivered to a group in publish order, one at a
//! time, while the partition's owner lives. When a partition moves (a
//! member joins, leaves or dies), the new owner reads from the committed
//! offset: what the old owner had settled is not seen again, and its
//! unsettled records are delivered again, first.

mod broker;
mod envelope;
mod error;
mod held;
mod log;
mod member;
mod names;
mod offsets;
mod options;
mod recent;

pub use broker::KafkaBroker;
pub use options::KafkaBrokerOptions;
