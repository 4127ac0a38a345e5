//! Keel's first-contact programs. Each is one file in `examples/`, runs on
//! its own (no server to install: it starts what it calls on loopback) and
//! shows one thing:
//!
//! - `dependency_with_policies`: a call to another service behind a
//!   timeout, a retry and a circuit breaker, with the deadline and trace
//!   context sent along (`cargo run -p keel-examples --example
//!   dependency_with_policies`);
//! - `outbox_in_axum_sqlite`: an axum handler that writes an order and the
//!   event announcing it in one SQLite transaction, a relay that publishes
//!   the event, and an idempotent consumer that applies it (`cargo run -p
//!   keel-examples --example outbox_in_axum_sqlite`).
//!
//! The test suite builds every example, so they cannot rot.
