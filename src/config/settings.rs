//! Validated settings: what `run` and the other commands use, every default filled in and every value
//! checked (by `validate`). The choices a setting can take (`Mode`, `PollOrder`, `ExistingRows`) live here
//! with the settings that hold them.

use std::time::Duration;

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use crate::record::RecordFormat;
use crate::table::{OutboxTable, TableName, TableSpec, TableStyle};
use crate::topic::TopicTemplate;

/// Which path moves events: the slot (cdc), the table (poll), or the slot when the server allows it (auto).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// The slot when the server allows logical replication, else polling.
    #[default]
    Auto,
    /// The replication slot only.
    Cdc,
    /// The outbox table only (polling).
    Poll,
}

/// What a reader of the topics may count on (`--delivery`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize, Serialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum DeliveryGuarantee {
    /// Every committed event at least once; a crash can repeat up to one in-flight window.
    #[default]
    AtLeastOnce,
    /// CDC events in Kafka transactions with a progress record: `read_committed` readers see each once.
    ExactlyOnce,
}

/// The record format (`--format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize, Serialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum RecordFormatChoice {
    /// The payload as the value; event id, type, aggregate type, created_at and header columns as headers.
    #[default]
    Outboxd,
    /// CloudEvents 1.0 in the Kafka protocol binding (see --cloudevents-mode).
    Cloudevents,
}

/// The CloudEvents content mode (`--cloudevents-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize, Serialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum CloudEventsMode {
    /// Attributes as `ce_` headers, the payload as the value with its `content-type`.
    #[default]
    Binary,
    /// The whole event as one JSON object in the value (`application/cloudevents+json`).
    Structured,
}

/// What `migrate --add-polling-columns` makes of the rows a table already holds when it gains `published_at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize, Serialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum ExistingRows {
    /// Already sent (by another relay, or by outboxd's CDC path): marked published before outboxd
    /// (`published_at = '-infinity'`), never claimed, not backlog, removed by retention.
    #[default]
    Published,
    /// Never sent: the polling path publishes them all, oldest first.
    Unpublished,
}

/// Ordering rule of the polling path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize, Serialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum PollOrder {
    /// Never publish an event while an earlier event of its aggregate is unpublished (and not dead).
    #[default]
    PerAggregate,
    /// The pattern's plain claim query: fastest, no ordering guarantee.
    None,
}

/// `--max-in-flight-events` unless set.
pub const DEFAULT_MAX_IN_FLIGHT_EVENTS: usize = 10_000;

/// Settings every command needs. `T`: the outbox tables as configured ([`TableSpec`], what validation
/// gives), or as the database has them ([`OutboxTable`], what a running pipeline uses; see
/// [`DatabaseSettings::inspected`]).
#[derive(Debug, Clone)]
pub struct DatabaseSettings<T = OutboxTable> {
    /// `--database-url`: connection for ordinary SQL (migrations, polling, status, the leadership lock).
    pub database_url: crate::pg::url::PgUrl,
    /// `--replication-url`: connection for the replication stream (`--database-url` unless given).
    pub replication_url: crate::pg::url::PgUrl,
    /// Every outbox table, in --table order; all share the slot and the publication.
    pub tables: Vec<T>,
    /// `--table-style`: the preset column names and topic template.
    pub style: TableStyle,
    /// `--add-polling-columns`: migrate adds the polling columns to an existing table.
    pub add_polling_columns: bool,
    /// `--existing-rows`: what migrate makes of the rows a table already holds when it gains `published_at`.
    pub existing_rows: ExistingRows,
    /// `--slot`: the logical replication slot's name (a valid slot name).
    pub slot: String,
    /// `--publication`: the publication's name (a valid identifier).
    pub publication: String,
    /// Not `--no-failover-slot`: the slot is a failover slot on PostgreSQL 17+.
    pub failover_slot: bool,
    /// `--standby-url`: physical standbys whose copy of the failover slot is reported on.
    pub standby_urls: Vec<crate::pg::url::PgUrl>,
}

/// Settings of `outboxd run`; `T` as for [`DatabaseSettings`].
#[derive(Debug, Clone)]
pub struct RunSettings<T = OutboxTable> {
    /// Connections, outbox tables, slot and publication.
    pub database: DatabaseSettings<T>,
    /// `--topic`, parsed (the table style's default topic unless given).
    pub topic: TopicTemplate,
    /// The brokers and the producer.
    pub kafka: KafkaSettings,
    /// `--startup-timeout`: how long to retry unreachable PostgreSQL or brokers at first start.
    pub startup_timeout: Duration,
    /// `--reconnect-timeout`: how long a running outboxd waits for its database to come back.
    pub reconnect_timeout: Duration,
    /// `--shutdown-timeout`: how long to drain in-flight events on SIGINT/SIGTERM.
    pub shutdown_timeout: Duration,
    /// `--auto-drop-slot-after`: how long `auto` polls before it drops the slot nothing consumes; `None`:
    /// never.
    pub auto_drop_slot_after: Option<Duration>,
    /// Settings of the CDC path.
    pub cdc: CdcSettings,
    /// `--mode`: which path moves events.
    pub mode: Mode,
    /// Settings of the polling path.
    pub poll: PollSettings,
    /// `None`: `--metrics-addr off`.
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// `None`: no `--retention`, published rows are kept.
    pub retention: Option<Retention>,
    /// `--audit-interval`: how often `run` audits the events of the last interval; `None`: it does not.
    pub audit_interval: Option<Duration>,
}

impl DatabaseSettings<TableSpec> {
    /// The same settings with the tables as the database has them (`tables` in the same order).
    pub fn inspected(self, tables: Vec<OutboxTable>) -> DatabaseSettings {
        DatabaseSettings {
            database_url: self.database_url,
            replication_url: self.replication_url,
            tables,
            style: self.style,
            add_polling_columns: self.add_polling_columns,
            existing_rows: self.existing_rows,
            slot: self.slot,
            publication: self.publication,
            failover_slot: self.failover_slot,
            standby_urls: self.standby_urls,
        }
    }
}

impl RunSettings<TableSpec> {
    /// The settings a pipeline runs with: the tables as the database has them, and the mode start-up
    /// chose (`auto` becomes `cdc` where the tables cannot be polled).
    pub fn inspected(self, tables: Vec<OutboxTable>, mode: Mode) -> RunSettings {
        RunSettings {
            database: self.database.inspected(tables),
            topic: self.topic,
            kafka: self.kafka,
            startup_timeout: self.startup_timeout,
            reconnect_timeout: self.reconnect_timeout,
            shutdown_timeout: self.shutdown_timeout,
            auto_drop_slot_after: self.auto_drop_slot_after,
            cdc: self.cdc,
            mode,
            poll: self.poll,
            metrics_addr: self.metrics_addr,
            retention: self.retention,
            audit_interval: self.audit_interval,
        }
    }
}

/// Deleting (or archiving) published rows by age.
#[derive(Debug, Clone)]
pub struct Retention {
    /// `--retention`: published rows older than this are deleted (or archived).
    pub keep: Duration,
    /// `--archive-table`: where old published rows are moved; `None`: they are deleted.
    pub archive_table: Option<TableName>,
    /// `--retention-interval`: how often retention runs.
    pub interval: Duration,
}

/// The brokers and the producer. Its `Debug` never shows a secret option's value.
#[derive(Clone)]
pub struct KafkaSettings {
    /// `--brokers`: Kafka bootstrap servers, a comma-separated host:port list (never empty).
    pub brokers: String,
    /// `--kafka-option` pairs (property, value), passed to librdkafka in the order given.
    pub options: Vec<(String, String)>,
    /// `--topic-partitions`: partitions of the topics outboxd creates (at least 1).
    pub topic_partitions: i32,
    /// `--topic-replication-factor`; `None`: the broker's default.
    pub topic_replication_factor: Option<i32>,
    /// False with `--no-create-topics`: a missing topic is then an error.
    pub create_topics: bool,
    /// `--max-topics`: the most distinct topics one process publishes events to (at least 1).
    pub max_topics: usize,
    /// `--delivery exactly-once`: how the CDC path's Kafka transactions are made; `None`: at least once.
    pub exactly_once: Option<ExactlyOnceSettings>,
    /// `--format` and its CloudEvents options: what a record's headers and value hold.
    pub format: RecordFormat,
}

impl std::fmt::Debug for KafkaSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let options: Vec<(&str, &str)> = self
            .options
            .iter()
            .map(|(key, value)| {
                let shown = if super::holds_secret(key) {
                    "<not shown>"
                } else {
                    value.as_str()
                };
                (key.as_str(), shown)
            })
            .collect();
        f.debug_struct("KafkaSettings")
            .field("brokers", &self.brokers)
            .field("options", &options)
            .field("topic_partitions", &self.topic_partitions)
            .field("topic_replication_factor", &self.topic_replication_factor)
            .field("create_topics", &self.create_topics)
            .field("max_topics", &self.max_topics)
            .field("exactly_once", &self.exactly_once)
            .field("format", &self.format)
            .finish()
    }
}

/// librdkafka's default `transaction.timeout.ms`.
const DEFAULT_TRANSACTION_TIMEOUT: Duration = Duration::from_secs(60);

impl KafkaSettings {
    /// `transaction.timeout.ms` as given last by `--kafka-option`, else librdkafka's default: how long
    /// the broker lets a Kafka transaction stay open before it aborts it.
    pub fn transaction_timeout(&self) -> Duration {
        self.options
            .iter()
            .rev()
            .find(|(key, _)| key == "transaction.timeout.ms")
            .and_then(|(_, value)| value.trim().parse::<u64>().ok())
            .map_or(DEFAULT_TRANSACTION_TIMEOUT, Duration::from_millis)
    }
}

/// Settings of `--delivery exactly-once`.
#[derive(Debug, Clone)]
pub struct ExactlyOnceSettings {
    /// `--progress-topic`: the compacted topic of progress records (created if missing).
    pub progress_topic: String,
    /// `--transaction-interval`: how long a Kafka transaction collects events before it commits (1ms to
    /// 10s); readers see events only once it committed.
    pub transaction_interval: Duration,
}

/// Settings of the CDC path.
#[derive(Debug, Clone)]
pub struct CdcSettings {
    /// `--max-in-flight-events`: most events handed to the broker but not yet finished (at least 1).
    pub max_in_flight_events: usize,
    /// `--max-in-flight-bytes`: most payload bytes in flight (at least 1024).
    pub max_in_flight_bytes: usize,
    /// `--status-interval`: how often standby status updates go out (1ms to 20s).
    pub status_interval: Duration,
}

/// Settings of the polling path.
#[derive(Debug, Clone)]
pub struct PollSettings {
    /// `--poll-interval`: pause between polling rounds; doubles while idle, up to 16x.
    pub interval: Duration,
    /// `--poll-batch-size`: rows claimed per polling round (1 to 100000).
    pub batch_size: i64,
    /// `--lease`: how long a claimed row is leased to one worker (at least 2s).
    pub lease: Duration,
    /// `--poll-order`: the ordering rule of the claim query.
    pub order: PollOrder,
    /// `--retry-base`: first retry delay after a failed publish; doubles per attempt, with jitter.
    pub retry_base: Duration,
    /// `--retry-cap`: longest retry delay (not shorter than `retry_base`).
    pub retry_cap: Duration,
    /// `--max-attempts`: attempts before an event is dead-lettered (at least 1).
    pub max_attempts: i32,
    /// `--dead-letter-topic`: where dead-lettered events are also produced; `None`: nowhere.
    pub dead_letter_topic: Option<String>,
    /// `--poll-notify`: wake the polling path with LISTEN/NOTIFY.
    pub notify: bool,
}
