//! Keel's messaging [`Broker`](keel_store::Broker) on NATS JetStream,
//! and request-reply over core NATS.
//!
//! When one machine is no longer enough, [`NatsBroker`] replaces the
//! embedded SQLite broker without changing a line of consumer code: both
//! pass the same conformance suite (`keel-testkit`).
//!
//! # How Keel maps onto JetStream
//!
//! - **A stream per topic**, `<prefix>_<topic>` (names escaped into NATS
//!   tokens), capturing `<prefix>.<topic>.k.>`, file storage, limits
//!   retention ([`NatsBrokerOptions::retention`]), direct get enabled.
//! - **Publisher dedupe**: every message carries its id as `Nats-Msg-Id`;
//!   JetStream drops a repeat within the duplicate window
//!   ([`NatsBrokerOptions::duplicate_window`]). `publish` returns once every
//!   PubAck arrived; a missing ack is `OutcomeUnknown`, and republishing is
//!   safe because of the dedupe. A message also states its key's last
//!   stored sequence (`Nats-Expected-Last-Subject-Sequence`), guessed from
//!   this process's own PubAcks; a wrong guess is refused by the server
//!   and the message sent again without it.
//! - **A durable pull consumer per group** (deliver all, explicit ack,
//!   `ack_wait` = the subscription's lease, unlimited deliveries). Members of
//!   a group pull from the same consumer and so split the work. Keel's
//!   consumer runtime counts deliveries and dead-letters into the Store, so
//!   JetStream's `max_deliver` is unlimited on purpose.
//! - **Per-key order**: each key is its own subject (`…k.<key>`), and a
//!   delivery is handed out only when it is the first unfinished message of
//!   its subject for the group, judged by a per-group, per-key cursor in a
//!   JetStream key-value bucket (`<prefix>_cursors`). See [`cursor`] for
//!   why, and the trade-offs below.
//! - **Settles**: ack = move the key cursor (a confirmed key-value write:
//!   the commit), then `+ACK`, not waited for (a lost one only means a
//!   redelivery that the cursor acks on arrival); nack(delay) = `-NAK` with
//!   the delay and extend = `+WPI` (in-progress), both confirmed by the
//!   server, extend repeated by a background task when the requested lease
//!   is longer than the ack wait; terminate = cursor, then `+TERM`. A settle
//!   after the client-side lease deadline is [`LeaseLost`] and sends nothing.
//!
//! [`LeaseLost`]: keel_store::broker::BrokerError::LeaseLost
//!
//! # Per-key order: the trade-off
//!
//! The NATS-recommended alternative, deterministic subject partitioning
//! (hash the key into N partitions, one consumer per partition with
//! `max_ack_pending = 1`), lets keys that share a partition block each other,
//! like Kafka partitions: with 20 keys on 64 partitions two keys collide
//! more often than not, so a nack with a long delay stalls an innocent key.
//! Keel's contract says keys are independent, so this crate keeps the exact
//! per-key rule instead, at a price:
//!
//! - a key-value write per ack or terminate, and a head check per
//!   delivery (is it the key's first unfinished message?). The check is
//!   free when the message names its key's previous message and the server
//!   verified that at publish (see [`predecessor`]), which Keel's `publish`
//!   arranges for every key that occurs once in a call; otherwise it costs
//!   a direct-get round trip;
//! - messages pulled behind a busy key are *parked* in the subscription
//!   (kept alive with in-progress acks while `receive` is called) and count
//!   against the group's `max_ack_pending`
//!   ([`NatsBrokerOptions::max_ack_pending`]); a single key with more
//!   unfinished messages than that can hold back others;
//! - cursors are kept for [`NatsBrokerOptions::retention`], as long as the
//!   messages they order.
//!
//! ```no_run
//! use keel_store::broker::{Broker, Message, SubscribeOptions};
//! use keel_nats::NatsBroker;
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let broker = NatsBroker::open("nats://127.0.0.1:4222").await?;
//! broker.publish(&[Message::new("evt-1", "orders", "order-7", "placed")]).await?;
//! let mut sub = broker.subscribe(SubscribeOptions::new("orders", "billing")).await?;
//! for delivery in sub.receive(16, std::time::Duration::from_secs(1)).await? {
//!     // ... commit the effect, then:
//!     delivery.ack().await?;
//! }
//! # Ok(()) }
//! ```

#![cfg_attr(docsrs, feature(doc_cfg))]
mod broker;
pub mod cursor;
mod delivery;
mod error;
mod expiry;
mod names;
mod options;
pub mod predecessor;
mod recent;
pub mod reply;
mod subscription;

pub use broker::NatsBroker;
pub use options::NatsBrokerOptions;
pub use reply::{NatsReply, NatsRequest, NatsRequester, NatsResponder, ReplyError};

/// JetStream's publisher-dedupe header; it carries the message id.
pub const MESSAGE_ID_HEADER: &str = "Nats-Msg-Id";

/// The header carrying the message's partition key verbatim (the subject
/// holds it escaped).
pub const KEY_HEADER: &str = "Keel-Key";
