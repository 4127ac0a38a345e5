//! Store conformance suite (in progress).
