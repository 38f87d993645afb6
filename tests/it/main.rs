//! The integration tests, one binary (the support code compiles once): each module is one area, run
//! against a real PostgreSQL (of `OUTBOXD_PG_MAJOR`, see tests/support/env.sh) and a real Apache Kafka that
//! `support` starts (and stops) per test.
//! `cargo test --test it cdc::` runs one area; `cargo test --test it cdc::name` one test.

#[path = "../support/mod.rs"]
mod support;

mod architecture;
mod audit;
mod cdc;
mod chaos;
mod cloudevents;
mod docker;
mod doctor;
mod errors;
mod exactly_once;
mod failover;
mod fit;
mod fleet;
mod inbox;
mod java_order_service;
mod kafka_security;
mod kubernetes;
mod managed;
mod migrate;
mod operate;
mod poll;
mod refusals;
mod replay;
mod retention;
mod security;
mod sink;
mod soak;
mod tls;
mod transactions;
