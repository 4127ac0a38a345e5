//! Keel's messaging Broker on NATS JetStream.
