//! Keel's messaging [`Broker`](keel_store::Broker) on RabbitMQ (AMQP 0.9.1,
//! through the `lapin` client).
//!
//! [`RabbitBroker`] passes the same conformance suite (`keel-testkit`) as
//! the embedded broker and NATS JetStream, with one difference it declares
//! ([`GroupStart::Creation`](keel_store::broker::GroupStart::Creation)):
//! a RabbitMQ topic is not a log, so a group receives what is published
//! after it was created, not the topic's history.
//!
//! # How Keel maps onto RabbitMQ
//!
//! - **A durable direct exchange per topic**, `<prefix>/<topic>`; a message
//!   is routed to shard `crc32(key) % shards`
//!   ([`RabbitBrokerOptions::shards`]), recorded on the exchange so a
//!   process configured otherwise is refused.
//! - **A quorum queue per group and shard**, `<prefix>/<topic>/<group>/<n>`
//!   (replicated and durable), with **single active consumer**: one member
//!   of the group reads a shard at a time and the others stand by, taking
//!   over in order when it goes. That is what keeps a key's order across
//!   competing consumers, which RabbitMQ does not give by itself.
//! - **Publishes are persistent and confirmed**: `publish` returns once
//!   RabbitMQ confirmed every message (it is on disk in a quorum of
//!   replicas); a missing confirm is `OutcomeUnknown`, a nack
//!   `Unavailable`.
//! - **Leases, delayed nacks and per-key holds live in the member** holding
//!   the deliveries: RabbitMQ has no per-delivery lease or delayed requeue,
//!   and a requeue would let a key's later message overtake its nacked one.
//!   An ack is sent after the consumer's effect committed. A lease that
//!   runs out means the member is stuck, so it hands its shards over: it
//!   closes its channel, RabbitMQ returns what it held to the front of the
//!   queue (`x-delivery-count` one higher) and activates the next member. A
//!   crashed member's connection closing does the same. A member whose
//!   process hangs with its runtime stopped keeps its shards until
//!   RabbitMQ's `consumer_timeout` (30 minutes by default) closes its
//!   channel. Local nacks do not count towards the delivery count after a
//!   hand-over: the count is RabbitMQ's returns plus this member's
//!   deliveries.
//! - **Every AMQP call is bounded** (10 s; a publish's confirms by
//!   [`publish_timeout`](RabbitBrokerOptions::publish_timeout)): a server
//!   can accept a connection and leave a call unanswered.
//! - **Publisher dedupe on arrival**: RabbitMQ has none, so a member drops
//!   a message id it saw within [`RabbitBrokerOptions::dedupe_window`].
//!   The window does not survive a fail-over; the idempotent consumer's
//!   inbox catches what gets through.
//! - **Dead letters**: a terminated delivery is rejected into the group's
//!   dead-letter queue `<prefix>/dead/<topic>/<group>` (kept
//!   [`dead_letter_ttl`](RabbitBrokerOptions::dead_letter_ttl), with
//!   RabbitMQ's `x-death` history), and so is a message returned more than
//!   [`delivery_limit`](RabbitBrokerOptions::delivery_limit) times
//!   (`x-delivery-limit`), a poison message that kills every process that
//!   reads it. Keel's consumer runtime keeps its own dead letters, with the
//!   error history, in the Store.
//! - **Expiring groups** (request-reply's reply topics) are queues with
//!   `x-expires`: RabbitMQ deletes them once unused for that long.
//! - **CloudEvents**: `ce-*` headers travel as `cloudEvents:*` AMQP
//!   headers, the id as the AMQP `message-id`.
//! - **Request-reply**: `keel_messaging::reply` works as on every broker;
//!   [`RabbitRequester`] waits for replies on RabbitMQ's direct reply-to
//!   instead of a reply queue (see [`reply`](crate::RabbitRequester)).
//!   `reply-to` and `correlation-id` are the AMQP properties, and a
//!   request's deadline is its `expiration`.
//!
//! # What order holds, and when
//!
//! Messages of one key are delivered to a group in publish order, one at a
//! time, while the shard's active member lives. When it dies, RabbitMQ
//! returns its unsettled deliveries to the queue and the next member reads
//! them first; a message the dead member had acked is not seen again. Keys
//! sharing a shard do not block each other (holds are per key), but a
//! member holds at most [`prefetch`](RabbitBrokerOptions::prefetch)
//! deliveries per shard, so a key held back long with many messages behind
//! it slows its shard.
//!
//! # What a deployment must do
//!
//! Create every group before the first publish to its topic
//! ([`Broker::declare_group`](keel_store::Broker::declare_group), or subscribe): a message published to
//! a topic with no group is dropped, as RabbitMQ drops what no queue is
//! bound for. `keel serve` declares its groups before its outbox relays
//! start.

mod broker;
mod envelope;
mod error;
mod link;
mod names;
mod options;
mod recent;
mod reply;
mod subscription;

pub use broker::RabbitBroker;
pub use keel_store::broker::reply::{Reply, ReplyError};
pub use options::RabbitBrokerOptions;
pub use reply::{DIRECT_REPLY_TO, RabbitRequester};
