//! Broker conformance suite (in progress).
