//! The command line: subcommands and every option as given by flag or environment (`OUTBOXD_*`); the same
//! names are the `--config` file's keys. Parsing only: the merge with the file is `merge`'s, validation
//! `settings`'.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};

use super::settings::{
    CloudEventsMode, DeliveryGuarantee, ExistingRows, Mode, PollOrder, RecordFormatChoice,
};
use crate::table::TableStyle;

/// Command line of the `outboxd` binary.
#[derive(Debug, Parser)]
#[command(
    name = "outboxd",
    version,
    about = "Transactional Outbox connector: PostgreSQL logical replication to Kafka"
)]
pub struct Cli {
    /// The subcommand to run.
    #[command(subcommand)]
    pub command: Command,
}

/// What `outboxd` is asked to do: migrate, run, replay, status, doctor or audit.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create or upgrade the outbox table, the inbox table and the publication (idempotent; needs no broker).
    Migrate(Options),
    /// Stream committed outbox events to Kafka until stopped (SIGINT/SIGTERM).
    Run(Options),
    /// Re-queue dead-lettered events (they are retried from scratch by the polling path).
    Replay {
        /// Every option; a replay to the live topic needs only the database ones, `--to-topic` the Kafka ones
        /// too.
        #[command(flatten)]
        options: Options,
        /// Re-queue this dead event.
        #[arg(long, group = "which")]
        event_id: Option<uuid::Uuid>,
        /// Re-queue every dead event of this aggregate (with --published: replay this aggregate's events).
        #[arg(long, group = "which")]
        aggregate_id: Option<String>,
        /// Re-queue every dead event.
        #[arg(long, group = "which")]
        all_dead: bool,
        /// Replay events already published (time travel), selected by --since, --until, --aggregate-type,
        /// --aggregate-id, --event-type and --where: to the live topics through the per-aggregate gate, or
        /// to --to-topic. Each record carries an `outboxd-replay: <replay id>` header.
        #[arg(long)]
        published: bool,
        /// Only events of this aggregate type.
        #[arg(long)]
        aggregate_type: Option<String>,
        /// Only events created (dead events: dead-lettered) at or after this time, RFC 3339
        /// (2026-12-01T00:00:00Z) or an age (2h, 7d).
        #[arg(long)]
        since: Option<String>,
        /// Only events created (dead events: dead-lettered) before this time, RFC 3339 or an age; a replay of
        /// published events stops at its start when not given.
        #[arg(long)]
        until: Option<String>,
        /// With --published: only events of this event type.
        #[arg(long)]
        event_type: Option<String>,
        /// With --published: only events this SQL condition over the outbox table's columns holds for
        /// (evaluated by PostgreSQL in a read-only transaction), e.g. "payload->>'currency' = 'EUR'".
        #[arg(long = "where", value_name = "SQL")]
        predicate: Option<String>,
        /// With --published: produce the events to this topic (a new consumer's history) instead of the live
        /// topics, in order per aggregate.
        #[arg(long, value_name = "TOPIC")]
        to_topic: Option<String>,
        /// With --published: at most this many events per second.
        #[arg(long, value_name = "N")]
        rate: Option<f64>,
        /// With --published --to-topic: read the events from this table (retention's --archive-table)
        /// instead of the outbox table.
        #[arg(long, value_name = "TABLE", requires = "to_topic")]
        from_archive: Option<String>,
        /// Go on with an interrupted replay of published events (its id, as printed and in `outboxd status`).
        #[arg(long, value_name = "REPLAY_ID")]
        resume: Option<String>,
        /// Give up a replay of published events: the events it still holds count as published again, as
        /// before it (those it released or sent stay republished).
        #[arg(long, value_name = "REPLAY_ID", conflicts_with = "resume")]
        cancel: Option<String>,
    },
    /// Check everything `run` needs of PostgreSQL and Kafka, and what would hurt it, each with its fix (reads
    /// only). Exit code 0: ok, 1: warnings, 2: a check failed, 3: a check could not be made.
    Doctor {
        /// Every option, as `run` is given them.
        #[command(flatten)]
        options: Options,
        /// Print only JSON on stdout.
        #[arg(long)]
        json: bool,
    },
    /// Show the slot and the backlog (needs no broker).
    Status {
        /// Every option; status needs only the database ones (and `--mode`).
        #[command(flatten)]
        options: Options,
        /// Print only JSON on stdout.
        #[arg(long)]
        json: bool,
        /// When the verdict is WARNING or CRITICAL.
        #[command(flatten)]
        thresholds: Thresholds,
    },
    /// Look at dead-lettered events (reads only); `replay` publishes them again.
    Dead {
        /// `list` or `show`.
        #[command(subcommand)]
        command: DeadCommand,
    },
    /// Check that the topics hold every event the table says was published: on its topic and partition, in
    /// its aggregate's order, and name every record no row explains (reads only). Exit code 0: clean,
    /// 1: findings, 2: could not audit.
    Audit {
        /// Every option, as `run` is given them (the database, the brokers, --topic, --table).
        #[command(flatten)]
        options: Options,
        /// Events created at or after this time: RFC 3339 (2026-12-01T00:00:00Z) or an age (2h, 7d).
        #[arg(long)]
        since: Option<String>,
        /// Events created before this time: RFC 3339 or an age.
        #[arg(long)]
        until: Option<String>,
        /// Only events of this aggregate type.
        #[arg(long)]
        aggregate_type: Option<String>,
        /// Print only JSON on stdout.
        #[arg(long)]
        json: bool,
        /// Write every finding to this file, one JSON object per line.
        #[arg(long)]
        details: Option<PathBuf>,
        /// Count duplicated events as findings (exit code 1); by default they are reported only.
        #[arg(long)]
        fail_on_duplicates: bool,
        /// Hand every missing event back to the polling path, which publishes it again (same event id),
        /// after its aggregate's earlier unpublished events. Without it the audit only reads.
        #[arg(long)]
        heal: bool,
    },
}

/// `outboxd dead ...`.
#[derive(Debug, Subcommand)]
pub enum DeadCommand {
    /// The dead events, the most recently dead-lettered first: when, why, after how many attempts, and how
    /// many events of their aggregate are not published yet.
    List {
        /// Every option; needs only the database ones.
        #[command(flatten)]
        options: Options,
        /// Only events of this aggregate type.
        #[arg(long)]
        aggregate_type: Option<String>,
        /// Only events of this aggregate id.
        #[arg(long)]
        aggregate_id: Option<String>,
        /// Dead-lettered at or after this time: RFC 3339 or an age (2h, 7d).
        #[arg(long)]
        since: Option<String>,
        /// At most this many (per table).
        #[arg(long, default_value_t = 50)]
        limit: i64,
        /// Print only JSON on stdout (one array).
        #[arg(long)]
        json: bool,
    },
    /// One dead event: its whole row, the last error, its attempts.
    Show {
        /// Every option; needs only the database ones.
        #[command(flatten)]
        options: Options,
        /// The dead event's id.
        event_id: uuid::Uuid,
        /// Print only JSON on stdout.
        #[arg(long)]
        json: bool,
    },
}

/// When `outboxd status` says WARNING or CRITICAL (exit codes 1 and 2, as monitoring plugins expect).
#[derive(Debug, Clone, Copy, Args)]
pub struct Thresholds {
    /// Slot lag (bytes) above which the verdict is WARNING.
    #[arg(long, default_value_t = 256 * 1024 * 1024)]
    pub warn_lag: i64,
    /// Slot lag (bytes) above which the verdict is CRITICAL.
    #[arg(long, default_value_t = 4 * 1024 * 1024 * 1024)]
    pub crit_lag: i64,
    /// Age (seconds) of the oldest unpublished event above which the verdict is WARNING.
    #[arg(long, default_value_t = 300.0)]
    pub warn_age: f64,
}

/// Format of the log lines written to stderr (`--log-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Every option, as given by flag, environment or file. The same names are the TOML keys (kebab-case). A new
/// option is a field here (and its validation in [`Options::run`] or [`Options::database`]): the merge of
/// flags and environment over the file goes by these names, field by field (see `Options::or`).
#[derive(Clone, Default, Args, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Options {
    /// TOML file with any of these options as keys (flags and environment win over it).
    #[arg(long, env = "OUTBOXD_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// PostgreSQL URL for ordinary SQL, e.g. postgres://user:pass@host:5432/db.
    #[arg(long, env = "OUTBOXD_DATABASE_URL", hide_env_values = true)]
    pub database_url: Option<String>,
    /// PostgreSQL URL for the replication connection (default: --database-url); lets it bypass a pooler.
    #[arg(long, env = "OUTBOXD_REPLICATION_URL", hide_env_values = true)]
    pub replication_url: Option<String>,
    /// A physical standby of the primary (repeatable): status, doctor and /metrics report whether it holds a
    /// usable copy of the failover slot (PostgreSQL 17+) and how far behind it is.
    #[arg(long, env = "OUTBOXD_STANDBY_URL", hide_env_values = true)]
    #[serde(default, deserialize_with = "one_or_many")]
    pub standby_url: Option<Vec<String>>,
    /// A program run before every PostgreSQL connection (SQL, replication, standbys) whose output is the
    /// password: IAM / Entra tokens that expire. Split on whitespace, run without a shell; its output is
    /// never logged. The URLs then carry no password.
    #[arg(
        long,
        env = "OUTBOXD_DATABASE_PASSWORD_COMMAND",
        hide_env_values = true
    )]
    pub database_password_command: Option<String>,
    /// Kafka bootstrap servers, comma-separated host:port list.
    #[arg(long, env = "OUTBOXD_BROKERS")]
    pub brokers: Option<String>,
    /// Topic template; placeholders {aggregate_type}, {event_type}, {schema} and {table} (of the outbox
    /// table) [default: outbox.{aggregate_type}; debezium style: outbox.event.{aggregate_type}].
    #[arg(long, env = "OUTBOXD_TOPIC")]
    pub topic: Option<String>,
    /// Outbox table, optionally schema-qualified; repeatable (or comma-separated) for several tables
    /// streamed through one slot and publication [default: public.outbox_event].
    #[arg(long, env = "OUTBOXD_TABLE", value_delimiter = ',')]
    #[serde(default, deserialize_with = "one_or_many")]
    pub table: Option<Vec<String>>,
    /// Preset column names: standard (outboxd's table) or debezium (id, aggregatetype, aggregateid, type,
    /// payload; `id` header; topic outbox.event.{aggregate_type}) [default: standard].
    #[arg(long, env = "OUTBOXD_TABLE_STYLE", value_enum)]
    pub table_style: Option<TableStyle>,
    /// Column playing a role, [TABLE:]ROLE=COLUMN (repeatable); roles: event_id, aggregate_type,
    /// aggregate_id, event_type, payload, created_at. Every --table, or only TABLE when prefixed.
    #[arg(long, env = "OUTBOXD_COLUMN", value_delimiter = ',')]
    #[serde(default, deserialize_with = "one_or_many")]
    pub column: Option<Vec<String>>,
    /// Column copied to a Kafka header of the same name, [TABLE:]COLUMN (repeatable), e.g. traceparent;
    /// NULL: no header.
    #[arg(long, env = "OUTBOXD_HEADER_COLUMN", value_delimiter = ',')]
    #[serde(default, deserialize_with = "one_or_many")]
    pub header_column: Option<Vec<String>>,
    /// migrate: add the polling columns (published_at, leases, position, dead letters) to an existing
    /// table; without them outboxd runs CDC only.
    #[arg(long, env = "OUTBOXD_ADD_POLLING_COLUMNS")]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub add_polling_columns: bool,
    /// migrate --add-polling-columns: whether the rows the table already holds were sent before
    /// (`published`, the default) or must be published now (`unpublished`).
    #[arg(long, env = "OUTBOXD_EXISTING_ROWS", value_enum)]
    pub existing_rows: Option<ExistingRows>,
    /// Logical replication slot name [default: outboxd].
    #[arg(long, env = "OUTBOXD_SLOT")]
    pub slot: Option<String>,
    /// Do not make the slot a failover slot. By default, on PostgreSQL 17+, outboxd creates its slot with
    /// `failover = true` (and turns it on for an existing slot), so standbys with `sync_replication_slots`
    /// keep a copy that survives a promotion.
    #[arg(long, env = "OUTBOXD_NO_FAILOVER_SLOT")]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_failover_slot: bool,
    /// Publication name [default: outboxd].
    #[arg(long, env = "OUTBOXD_PUBLICATION")]
    pub publication: Option<String>,
    /// librdkafka property passed through, key=value (repeatable), e.g. security.protocol=SASL_SSL.
    /// Several in one value are separated by commas; a comma inside a value stays (see `split_kafka_options`).
    #[arg(long, env = "OUTBOXD_KAFKA_OPTION", hide_env_values = true)]
    #[serde(default, deserialize_with = "one_or_many")]
    pub kafka_option: Option<Vec<String>>,
    /// Partitions of topics outboxd creates [default: 6].
    #[arg(long, env = "OUTBOXD_TOPIC_PARTITIONS")]
    pub topic_partitions: Option<i32>,
    /// Replication factor of topics outboxd creates [default: the broker's default].
    #[arg(long, env = "OUTBOXD_TOPIC_REPLICATION_FACTOR")]
    pub topic_replication_factor: Option<i32>,
    /// at-least-once, or exactly-once: the CDC path writes whole transactions into Kafka transactions with
    /// a progress record, so `read_committed` readers see each event once [default: at-least-once].
    #[arg(long, env = "OUTBOXD_DELIVERY", value_enum)]
    pub delivery: Option<DeliveryGuarantee>,
    /// Record format: outboxd (the payload as the value, the event's fields as headers) or cloudevents
    /// (CloudEvents 1.0 in the Kafka protocol binding) [default: outboxd].
    #[arg(long, env = "OUTBOXD_FORMAT", value_enum)]
    pub format: Option<RecordFormatChoice>,
    /// With --format cloudevents: binary (attributes as ce_ headers, the payload as the value) or
    /// structured (the whole event as JSON in the value) [default: binary].
    #[arg(long, env = "OUTBOXD_CLOUDEVENTS_MODE", value_enum)]
    pub cloudevents_mode: Option<CloudEventsMode>,
    /// With --format cloudevents: the events' source, a URI reference; placeholders {schema}, {table},
    /// {aggregate_type} [default: /{schema}/{table}].
    #[arg(long, env = "OUTBOXD_CLOUDEVENTS_SOURCE")]
    pub cloudevents_source: Option<String>,
    /// With --delivery exactly-once: the compacted topic holding each slot's progress (created if missing)
    /// [default: outboxd.progress].
    #[arg(long, env = "OUTBOXD_PROGRESS_TOPIC")]
    pub progress_topic: Option<String>,
    /// With --delivery exactly-once: how long a Kafka transaction collects events before it commits;
    /// readers see events only after the commit [default: 100ms].
    #[arg(long, env = "OUTBOXD_TRANSACTION_INTERVAL")]
    pub transaction_interval: Option<String>,
    /// Never create topics; a missing topic is an error.
    #[arg(long, env = "OUTBOXD_NO_CREATE_TOPICS")]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_create_topics: bool,
    /// The most distinct topics one process publishes events to; an event bound for one more is refused
    /// like a topic Kafka refuses [default: 1000].
    #[arg(long, env = "OUTBOXD_MAX_TOPICS")]
    pub max_topics: Option<usize>,
    /// Allow a --topic template that starts with {aggregate_type} or {event_type}: the rows then choose the
    /// whole topic name, any topic outboxd may write.
    #[arg(long, env = "OUTBOXD_ALLOW_UNPREFIXED_TOPIC")]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_unprefixed_topic: bool,
    /// How long to retry unreachable PostgreSQL or brokers at first start [default: 60s].
    #[arg(long, env = "OUTBOXD_STARTUP_TIMEOUT")]
    pub startup_timeout: Option<String>,
    /// How long a running outboxd waits for its database to come back after a failover, restore or
    /// switchover (unreachable, database missing, server still in recovery) before it gives up [default: 10m].
    #[arg(long, env = "OUTBOXD_RECONNECT_TIMEOUT")]
    pub reconnect_timeout: Option<String>,
    /// How long to drain in-flight events on SIGINT/SIGTERM [default: 30s].
    #[arg(long, env = "OUTBOXD_SHUTDOWN_TIMEOUT")]
    pub shutdown_timeout: Option<String>,
    /// `--mode auto`: how long to poll (replication unavailable) before dropping the slot nothing consumes,
    /// which keeps WAL on the server; `never` keeps it [default: 10m].
    #[arg(long, env = "OUTBOXD_AUTO_DROP_SLOT_AFTER")]
    pub auto_drop_slot_after: Option<String>,
    /// Most events handed to the broker but not yet finished [default: 10000].
    #[arg(long, env = "OUTBOXD_MAX_IN_FLIGHT_EVENTS")]
    pub max_in_flight_events: Option<usize>,
    /// Most payload bytes in flight, 16 MiB by default [default: 16777216].
    #[arg(long, env = "OUTBOXD_MAX_IN_FLIGHT_BYTES")]
    pub max_in_flight_bytes: Option<usize>,
    /// Interval of standby status updates; keep it well under wal_sender_timeout/2 [default: 1s].
    #[arg(long, env = "OUTBOXD_STATUS_INTERVAL")]
    pub status_interval: Option<String>,
    /// auto (slot when the server allows it, else polling), cdc (slot only) or poll (table only) [default: auto].
    #[arg(long, env = "OUTBOXD_MODE", value_enum)]
    pub mode: Option<Mode>,
    /// Polling interval; doubles while idle up to 16x [default: 200ms].
    #[arg(long, env = "OUTBOXD_POLL_INTERVAL")]
    pub poll_interval: Option<String>,
    /// Rows claimed per polling round [default: 500].
    #[arg(long, env = "OUTBOXD_POLL_BATCH_SIZE")]
    pub poll_batch_size: Option<i64>,
    /// How long a claimed row is leased to one worker; renewed while a slow send is in flight [default: 30s].
    #[arg(long, env = "OUTBOXD_LEASE")]
    pub lease: Option<String>,
    /// Polling order: per-aggregate or none [default: per-aggregate].
    #[arg(long, env = "OUTBOXD_POLL_ORDER", value_enum)]
    pub poll_order: Option<PollOrder>,
    /// First retry delay after a failed publish; doubles per attempt, with jitter [default: 1s].
    #[arg(long, env = "OUTBOXD_RETRY_BASE")]
    pub retry_base: Option<String>,
    /// Longest retry delay [default: 5m].
    #[arg(long, env = "OUTBOXD_RETRY_CAP")]
    pub retry_cap: Option<String>,
    /// Attempts before an event is dead-lettered [default: 10].
    #[arg(long, env = "OUTBOXD_MAX_ATTEMPTS")]
    pub max_attempts: Option<i32>,
    /// Wake the polling path with LISTEN/NOTIFY (migrate: install the statement-level trigger). NOTIFY
    /// serialises committing transactions: use it only with --mode poll and a modest insert rate.
    #[arg(long, env = "OUTBOXD_POLL_NOTIFY")]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub poll_notify: bool,
    /// Also produce dead-lettered events to this topic (with an `error` header).
    #[arg(long, env = "OUTBOXD_DEAD_LETTER_TOPIC")]
    pub dead_letter_topic: Option<String>,
    /// Delete published rows older than this (e.g. 7d), in small batches; off by default.
    #[arg(long, env = "OUTBOXD_RETENTION")]
    pub retention: Option<String>,
    /// With --retention: move old published rows to this table instead of deleting them.
    #[arg(long, env = "OUTBOXD_ARCHIVE_TABLE")]
    pub archive_table: Option<String>,
    /// How often retention runs [default: 1m].
    #[arg(long, env = "OUTBOXD_RETENTION_INTERVAL")]
    pub retention_interval: Option<String>,
    /// Audit the events created in each past interval against the topics (as `outboxd audit` does), and
    /// export the outboxd_audit_* metrics; off by default (e.g. 10m).
    #[arg(long, env = "OUTBOXD_AUDIT_INTERVAL")]
    pub audit_interval: Option<String>,
    /// Address of /metrics, /healthz and /readyz, or `off` [default: 127.0.0.1:9187].
    #[arg(long, env = "OUTBOXD_METRICS_ADDR")]
    pub metrics_addr: Option<String>,
    /// Log format: text or json [default: text]. Filter with RUST_LOG (e.g. RUST_LOG=outboxd=debug).
    #[arg(long, env = "OUTBOXD_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
}

/// A TOML value that may be one string or a list of strings (`table = "a"` or `table = ["a", "b"]`).
fn one_or_many<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Vec<String>>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(Some(match OneOrMany::deserialize(deserializer)? {
        OneOrMany::One(one) => vec![one],
        OneOrMany::Many(many) => many,
    }))
}

/// Every option given, by its `--config` name, but the URLs (they may hold a password) and the values of
/// secret Kafka options: a `Debug` of the options never shows a secret (security review L4).
impl std::fmt::Debug for Options {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Ok(mut table) = toml::Table::try_from(self) else {
            return f.write_str("Options { .. }");
        };
        for url in ["database-url", "replication-url"] {
            if let Some(value) = table.get_mut(url) {
                *value = toml::Value::String("<not shown>".into());
            }
        }
        if let Some(toml::Value::Array(options)) = table.get_mut("kafka-option") {
            // One value may hold several options: any mention of a secret hides all of it.
            for option in options.iter_mut() {
                if option.as_str().is_some_and(super::holds_secret) {
                    *option = toml::Value::String("<not shown: holds a secret>".into());
                }
            }
        }
        write!(f, "Options {table:?}")
    }
}
