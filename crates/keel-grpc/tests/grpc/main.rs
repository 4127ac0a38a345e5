//! keel-grpc against a real tonic server and client over loopback.

mod deadline;
mod health;
mod policies;
mod streams;
mod support;
