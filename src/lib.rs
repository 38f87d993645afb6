//! outboxd: delivers Transactional Outbox events from PostgreSQL to Kafka, at least once and in order per
//! aggregate. The data flows wire -> decode -> publish -> acknowledge -> backfill -> confirm; each step has
//! its own module (see DESIGN.md's map).

pub mod audit;
pub mod backoff;
pub mod config;
pub mod dead;
pub mod doctor;
pub mod error;
pub mod event;
pub mod failover;
pub mod http;
pub mod inbox;
pub mod kafka;
pub mod logging;
pub mod lsn;
pub mod metrics;
pub mod pg;
pub mod pipeline;
pub mod progress;
pub mod record;
pub mod replay;
pub mod retention;
pub mod sink;
pub mod stats;
pub mod status;
pub mod table;
pub mod topic;

pub use error::{Error, Result};
