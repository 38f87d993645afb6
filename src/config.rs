//! Options from flags, environment (`OUTBOXD_*`) and a TOML file (`--config`), merged in that order of
//! precedence, then validated into typed settings with errors that name the setting and the fix.
//! Owns parsing and validation only; nothing here connects anywhere.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::table::{OutboxTable, TableName, TableStyle};
use crate::topic::{TemplateError, TopicTemplate};

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

/// What `outboxd` is asked to do: migrate, run, replay or status.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create or upgrade the outbox table, the inbox table and the publication (idempotent; needs no broker).
    Migrate(Options),
    /// Stream committed outbox events to Kafka until stopped (SIGINT/SIGTERM).
    Run(Options),
    /// Re-queue dead-lettered events (they are retried from scratch by the polling path).
    Replay {
        /// Every option; replay needs only the database ones.
        #[command(flatten)]
        options: Options,
        /// Re-queue this dead event.
        #[arg(long, group = "which")]
        event_id: Option<uuid::Uuid>,
        /// Re-queue every dead event of this aggregate.
        #[arg(long, group = "which")]
        aggregate_id: Option<String>,
        /// Re-queue every dead event.
        #[arg(long, group = "which")]
        all_dead: bool,
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

/// Every option, as given by flag, environment or file. The same names are the TOML keys (kebab-case). A new
/// option is a field here (and its validation in [`Options::run`] or [`Options::database`]): the merge of
/// flags and environment over the file goes by these names, field by field (see `Options::or`).
#[derive(Debug, Clone, Default, Args, Deserialize, Serialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Options {
    /// TOML file with any of these options as keys (flags and environment win over it).
    #[arg(long, env = "OUTBOXD_CONFIG")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// PostgreSQL URL for ordinary SQL, e.g. postgres://user:pass@host:5432/db.
    #[arg(long, env = "OUTBOXD_DATABASE_URL")]
    pub database_url: Option<String>,
    /// PostgreSQL URL for the replication connection (default: --database-url); lets it bypass a pooler.
    #[arg(long, env = "OUTBOXD_REPLICATION_URL")]
    pub replication_url: Option<String>,
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
    /// Publication name [default: outboxd].
    #[arg(long, env = "OUTBOXD_PUBLICATION")]
    pub publication: Option<String>,
    /// librdkafka property passed through, key=value (repeatable), e.g. security.protocol=SASL_SSL.
    /// Several in one value are separated by commas; a comma inside a value stays (see `split_kafka_options`).
    #[arg(long, env = "OUTBOXD_KAFKA_OPTION")]
    pub kafka_option: Option<Vec<String>>,
    /// Partitions of topics outboxd creates [default: 6].
    #[arg(long, env = "OUTBOXD_TOPIC_PARTITIONS")]
    pub topic_partitions: Option<i32>,
    /// Replication factor of topics outboxd creates [default: the broker's default].
    #[arg(long, env = "OUTBOXD_TOPIC_REPLICATION_FACTOR")]
    pub topic_replication_factor: Option<i32>,
    /// Never create topics; a missing topic is an error.
    #[arg(long, env = "OUTBOXD_NO_CREATE_TOPICS")]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub no_create_topics: bool,
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
    /// Most events handed to the broker but not yet finished [default: 10000].
    #[arg(long, env = "OUTBOXD_MAX_IN_FLIGHT_EVENTS")]
    pub max_in_flight_events: Option<usize>,
    /// Most payload bytes in flight [default: 16MiB, written in bytes].
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
    /// Address of /metrics, /healthz and /readyz, or `off` [default: 127.0.0.1:9187].
    #[arg(long, env = "OUTBOXD_METRICS_ADDR")]
    pub metrics_addr: Option<String>,
    /// Log format: text or json [default: text]. Filter with RUST_LOG (e.g. RUST_LOG=outboxd=debug).
    #[arg(long, env = "OUTBOXD_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
}

/// An option that cannot be used as given; the message names the setting and, where it helps, the fix.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The `--config` file cannot be read.
    #[error("cannot read --config file {path}: {source}")]
    ReadFile {
        /// The `--config` path as given.
        path: PathBuf,
        /// Why reading it failed.
        source: std::io::Error,
    },
    /// The `--config` file is not valid TOML, or holds an unknown key or a value of the wrong type.
    #[error("invalid --config file {path}: {message}")]
    ParseFile {
        /// The `--config` path as given.
        path: PathBuf,
        /// The TOML parser's message (it names the key at fault).
        message: String,
    },
    /// Any other invalid setting, with the message to show.
    #[error("{0}")]
    Invalid(String),
    /// An invalid `--topic` template.
    #[error(transparent)]
    Topic(#[from] TemplateError),
}

fn invalid(message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid(message.into())
}

/// Settings every command needs.
#[derive(Debug, Clone)]
pub struct DatabaseSettings {
    /// `--database-url`: connection for ordinary SQL (migrations, polling, status, the leadership lock).
    pub database_url: crate::pg::url::PgUrl,
    /// `--replication-url`: connection for the replication stream (`--database-url` unless given).
    pub replication_url: crate::pg::url::PgUrl,
    /// Every outbox table, in --table order; all share the slot and the publication.
    pub tables: Vec<OutboxTable>,
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
}

/// Settings of `outboxd run`.
#[derive(Debug, Clone)]
pub struct RunSettings {
    /// Connections, outbox tables, slot and publication.
    pub database: DatabaseSettings,
    /// `--brokers`: Kafka bootstrap servers, a comma-separated host:port list (never empty).
    pub brokers: String,
    /// `--topic`, parsed (the table style's default topic unless given).
    pub topic: TopicTemplate,
    /// `--kafka-option` pairs (property, value), passed to librdkafka in the order given.
    pub kafka_options: Vec<(String, String)>,
    /// `--topic-partitions`: partitions of the topics outboxd creates (at least 1).
    pub topic_partitions: i32,
    /// `--topic-replication-factor`; `None`: the broker's default.
    pub topic_replication_factor: Option<i32>,
    /// False with `--no-create-topics`: a missing topic is then an error.
    pub create_topics: bool,
    /// `--startup-timeout`: how long to retry unreachable PostgreSQL or brokers at first start.
    pub startup_timeout: Duration,
    /// `--reconnect-timeout`: how long a running outboxd waits for its database to come back.
    pub reconnect_timeout: Duration,
    /// `--shutdown-timeout`: how long to drain in-flight events on SIGINT/SIGTERM.
    pub shutdown_timeout: Duration,
    /// `--max-in-flight-events`: most events handed to the broker but not yet finished (at least 1).
    pub max_in_flight_events: usize,
    /// `--max-in-flight-bytes`: most payload bytes in flight (at least 1024).
    pub max_in_flight_bytes: usize,
    /// `--status-interval`: how often standby status updates go out (1ms to 20s).
    pub status_interval: Duration,
    /// `--mode`: which path moves events.
    pub mode: Mode,
    /// Settings of the polling path.
    pub poll: PollSettings,
    /// `None`: `--metrics-addr off`.
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// `None`: no `--retention`, published rows are kept.
    pub retention: Option<Retention>,
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

impl Options {
    /// Fills every option not given by flag or environment from the `--config` file.
    pub fn with_file(self) -> Result<Options, ConfigError> {
        let Some(path) = self.config.clone() else {
            return Ok(self);
        };
        let file = Options::from_file(&path)?;
        self.or(file)
    }

    fn from_file(path: &Path) -> Result<Options, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::ReadFile {
            path: path.into(),
            source,
        })?;
        toml::from_str(&text).map_err(|e| ConfigError::ParseFile {
            path: path.into(),
            message: e.to_string(),
        })
    }

    /// `self` (flags and environment) over `file`, option by option: a flag left unset (`None`, or a switch
    /// left off) takes the file's value.
    fn or(self, file: Options) -> Result<Options, ConfigError> {
        let table = |options: &Options| {
            toml::Table::try_from(options)
                .map_err(|e| invalid(format!("cannot merge the options: {e}")))
        };
        let mut merged = table(&file)?;
        merged.extend(table(&self)?);
        // What a struct serialised reads back as itself; the error would quote a value (maybe a URL with its
        // password), so it is not repeated.
        let mut options: Options = merged.try_into().map_err(|_| {
            invalid("cannot merge the options given by flag or environment with the file")
        })?;
        options.config = self.config;
        Ok(options)
    }

    /// The settings every command needs, validated; errors name the option at fault.
    pub fn database(&self) -> Result<DatabaseSettings, ConfigError> {
        let url = self.database_url.as_deref().ok_or_else(|| {
            invalid("--database-url is required (or OUTBOXD_DATABASE_URL), e.g. postgres://user:pass@localhost:5432/app")
        })?;
        let database_url = parse_postgres_url("--database-url", url)?;
        let replication_url = match &self.replication_url {
            Some(url) => parse_postgres_url("--replication-url", url)?,
            None => database_url.clone(),
        };
        let style = self.table_style.unwrap_or_default();
        let overrides = crate::table::parse_column_overrides(self.column.as_deref().unwrap_or(&[]))
            .map_err(invalid)?;
        for column in &overrides {
            parse_identifier("--column", &column.value.1)?;
        }
        let header_columns =
            crate::table::parse_header_columns(self.header_column.as_deref().unwrap_or(&[]));
        for column in &header_columns {
            parse_identifier("--header-column", &column.value)?;
        }
        let names = match &self.table {
            Some(names) if !names.is_empty() => names.clone(),
            _ => vec!["public.outbox_event".to_string()],
        };
        let names = names
            .iter()
            .map(|name| parse_table(name.trim()))
            .collect::<Result<Vec<_>, _>>()?;
        // `TABLE:` prefixes must name a --table; unprefixed values apply to every table.
        let applies_to = |setting: &str, table: &Option<String>, name: &TableName| {
            let Some(table) = table else {
                return Ok(true);
            };
            let target = parse_table(table)?;
            if names.contains(&target) {
                Ok(&target == name)
            } else {
                Err(invalid(format!(
                    "{setting} {table}:...: {table} is not one of the --table values"
                )))
            }
        };
        let mut tables: Vec<OutboxTable> = Vec::with_capacity(names.len());
        for name in &names {
            if tables.iter().any(|t| &t.name == name) {
                return Err(invalid(format!("--table {name} is given twice")));
            }
            let mut own_overrides = Vec::new();
            for o in &overrides {
                if applies_to("--column", &o.table, name)? {
                    own_overrides.push(o.value.clone());
                }
            }
            let mut own_headers = Vec::new();
            for h in &header_columns {
                if applies_to("--header-column", &h.table, name)? {
                    own_headers.push(h.value.clone());
                }
            }
            tables.push(OutboxTable::new(
                name.clone(),
                style,
                &own_overrides,
                own_headers,
            ));
        }
        Ok(DatabaseSettings {
            database_url,
            replication_url,
            tables,
            style,
            add_polling_columns: self.add_polling_columns,
            existing_rows: self.existing_rows.unwrap_or_default(),
            slot: parse_slot_name(self.slot.as_deref().unwrap_or("outboxd"))?,
            publication: parse_identifier(
                "--publication",
                self.publication.as_deref().unwrap_or("outboxd"),
            )?,
        })
    }

    /// The settings of `outboxd run`, validated, with every default filled in.
    // Long: one validation per option of `run`, in the order of `Options`; each names its option.
    pub fn run(&self) -> Result<RunSettings, ConfigError> {
        let database = self.database()?;
        let brokers = self
            .brokers
            .clone()
            .filter(|b| !b.trim().is_empty())
            .ok_or_else(|| {
                invalid("--brokers is required (or OUTBOXD_BROKERS), e.g. localhost:9092")
            })?;
        let topic = TopicTemplate::parse(
            self.topic
                .as_deref()
                .unwrap_or(database.style.default_topic()),
        )?;
        let kafka_options = split_kafka_options(self.kafka_option.iter().flatten())?;
        let topic_partitions = self.topic_partitions.unwrap_or(6);
        if topic_partitions < 1 {
            return Err(invalid(format!(
                "--topic-partitions must be at least 1, got {topic_partitions}"
            )));
        }
        if let Some(rf) = self.topic_replication_factor {
            if rf < 1 {
                return Err(invalid(format!(
                    "--topic-replication-factor must be at least 1, got {rf}"
                )));
            }
        }
        let max_in_flight_events = self
            .max_in_flight_events
            .unwrap_or(DEFAULT_MAX_IN_FLIGHT_EVENTS);
        if max_in_flight_events == 0 {
            return Err(invalid("--max-in-flight-events must be at least 1"));
        }
        let max_in_flight_bytes = self.max_in_flight_bytes.unwrap_or(16 * 1024 * 1024);
        if max_in_flight_bytes < 1024 {
            return Err(invalid("--max-in-flight-bytes must be at least 1024"));
        }
        let status_interval = parse_duration(
            "--status-interval",
            self.status_interval.as_deref().unwrap_or("1s"),
        )?;
        if status_interval.is_zero() || status_interval > Duration::from_secs(20) {
            return Err(invalid(
                "--status-interval must be between 1ms and 20s (well under wal_sender_timeout/2)",
            ));
        }
        let poll = self.poll()?;
        let metrics_addr = match self.metrics_addr.as_deref().unwrap_or("127.0.0.1:9187") {
            "off" => None,
            addr => Some(addr.parse().map_err(|_| {
                invalid(format!(
                    "--metrics-addr {addr:?} is not host:port (e.g. 0.0.0.0:9187) or off"
                ))
            })?),
        };
        let retention = match &self.retention {
            None => {
                if self.archive_table.is_some() {
                    return Err(invalid(
                        "--archive-table needs --retention (e.g. --retention 7d)",
                    ));
                }
                None
            }
            Some(keep) => Some(Retention {
                keep: parse_duration("--retention", keep)?,
                archive_table: self
                    .archive_table
                    .as_deref()
                    .map(|t| {
                        parse_table(t).map_err(|_| {
                            invalid(format!("--archive-table {t:?} is not a valid table name"))
                        })
                    })
                    .transpose()?,
                interval: parse_duration(
                    "--retention-interval",
                    self.retention_interval.as_deref().unwrap_or("1m"),
                )?,
            }),
        };
        Ok(RunSettings {
            retention,
            metrics_addr,
            mode: self.mode.unwrap_or_default(),
            poll,
            database,
            brokers,
            topic,
            kafka_options,
            topic_partitions,
            topic_replication_factor: self.topic_replication_factor,
            create_topics: !self.no_create_topics,
            startup_timeout: parse_duration(
                "--startup-timeout",
                self.startup_timeout.as_deref().unwrap_or("60s"),
            )?,
            reconnect_timeout: parse_duration(
                "--reconnect-timeout",
                self.reconnect_timeout.as_deref().unwrap_or("10m"),
            )?,
            shutdown_timeout: parse_duration(
                "--shutdown-timeout",
                self.shutdown_timeout.as_deref().unwrap_or("30s"),
            )?,
            max_in_flight_events,
            max_in_flight_bytes,
            status_interval,
        })
    }
}

impl Options {
    fn poll(&self) -> Result<PollSettings, ConfigError> {
        let duration = |flag: &str, value: &Option<String>, default: &str| {
            parse_duration(flag, value.as_deref().unwrap_or(default))
        };
        let interval = duration("--poll-interval", &self.poll_interval, "200ms")?;
        let lease = duration("--lease", &self.lease, "30s")?;
        let retry_base = duration("--retry-base", &self.retry_base, "1s")?;
        let retry_cap = duration("--retry-cap", &self.retry_cap, "5m")?;
        let batch_size = self.poll_batch_size.unwrap_or(500);
        let max_attempts = self.max_attempts.unwrap_or(10);
        if interval.is_zero() {
            return Err(invalid("--poll-interval must be above zero, e.g. 200ms"));
        }
        if lease < Duration::from_secs(2) {
            return Err(invalid(
                "--lease must be at least 2s (it must outlast a normal send)",
            ));
        }
        if !(1..=100_000).contains(&batch_size) {
            return Err(invalid(format!(
                "--poll-batch-size must be between 1 and 100000, got {batch_size}"
            )));
        }
        if max_attempts < 1 {
            return Err(invalid(format!(
                "--max-attempts must be at least 1, got {max_attempts}"
            )));
        }
        if retry_cap < retry_base {
            return Err(invalid("--retry-cap must not be shorter than --retry-base"));
        }
        if let Some(topic) = &self.dead_letter_topic {
            TopicTemplate::parse(topic)
                .map_err(|e| invalid(format!("--dead-letter-topic: {e}")))?;
        }
        Ok(PollSettings {
            interval,
            batch_size,
            lease,
            order: self.poll_order.unwrap_or_default(),
            retry_base,
            retry_cap,
            max_attempts,
            dead_letter_topic: self.dead_letter_topic.clone(),
            notify: self.poll_notify,
        })
    }
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

/// Parses a duration written like `500ms`, `5s`, `7d`, naming the setting on error.
pub fn parse_duration(setting: &str, text: &str) -> Result<Duration, ConfigError> {
    humantime::parse_duration(text.trim()).map_err(|e| {
        invalid(format!(
            "{setting} {text:?} is not a duration ({e}); write it like 500ms, 5s, 10m or 7d"
        ))
    })
}

/// Parses a libpq-style URL or key=value string. The error never repeats the URL (it may hold a password).
pub fn parse_postgres_url(setting: &str, url: &str) -> Result<crate::pg::url::PgUrl, ConfigError> {
    crate::pg::url::PgUrl::parse(setting, url).map_err(invalid)
}

/// Identifiers outboxd splices into SQL: letters, digits, `_`, `$`, not starting with a digit or `$`, ≤ 63 bytes.
pub fn parse_identifier(setting: &str, name: &str) -> Result<String, ConfigError> {
    let mut chars = name.chars();
    let valid_start = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    if valid_start
        && name.len() <= 63
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$')
    {
        Ok(name.to_string())
    } else {
        Err(invalid(format!(
            "{setting} {name:?} is not a valid identifier: use up to 63 letters, digits and underscores, starting with a letter or underscore"
        )))
    }
}

/// Replication slot names: lower-case letters, digits and underscores only (PostgreSQL's rule).
pub fn parse_slot_name(name: &str) -> Result<String, ConfigError> {
    if !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        Ok(name.to_string())
    } else {
        Err(invalid(format!(
            "--slot {name:?} is not a valid replication slot name: use up to 63 lower-case letters, digits and underscores"
        )))
    }
}

/// Parses `--table` text, `schema.name` or `name` (in `public`), checking both parts as identifiers.
pub fn parse_table(text: &str) -> Result<TableName, ConfigError> {
    let (schema, name) = text.split_once('.').unwrap_or(("public", text));
    Ok(TableName {
        schema: parse_identifier("--table", schema)?,
        name: parse_identifier("--table", name)?,
    })
}

/// A URL with its password replaced, for logs and status output.
pub fn redact_url(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) => match rest.split_once('@') {
            Some((userinfo, host)) => {
                let user = userinfo.split_once(':').map_or(userinfo, |(user, _)| user);
                format!("{scheme}://{user}:***@{host}")
            }
            None => url.to_string(),
        },
        None => "(key=value connection string)".to_string(),
    }
}

/// `--max-in-flight-events` unless set.
pub const DEFAULT_MAX_IN_FLIGHT_EVENTS: usize = 10_000;

/// `--kafka-option` values as (property, value). One value may hold several options separated by commas
/// (`OUTBOXD_KAFKA_OPTION=acks=all,linger.ms=5`); a comma starts a new option only where a property name and
/// `=` follow, so values with commas (passwords, JAAS configurations) stay whole. Errors never repeat what
/// was given: it may be a secret.
fn split_kafka_options<'a>(
    values: impl Iterator<Item = &'a String>,
) -> Result<Vec<(String, String)>, ConfigError> {
    let is_property = |s: &str| {
        s.split_once('=').is_some_and(|(key, _)| {
            !key.is_empty()
                && key
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        })
    };
    let mut options: Vec<(String, String)> = Vec::new();
    for (n, value) in values.enumerate() {
        let mut parts = value.split(',');
        let first = parts.next().unwrap_or_default();
        let Some((key, v)) = first
            .split_once('=')
            .filter(|_| is_property(first.trim_start()))
        else {
            return Err(ConfigError::Invalid(format!(
                "--kafka-option number {} is not property=value (e.g. compression.type=lz4); its text is not shown, as it may hold a secret",
                n + 1
            )));
        };
        options.push((key.trim().to_string(), v.to_string()));
        for part in parts {
            match part
                .split_once('=')
                .filter(|_| is_property(part.trim_start()))
            {
                Some((key, v)) => options.push((key.trim().to_string(), v.to_string())),
                None => {
                    // A comma inside the previous option's value.
                    let last = options.last_mut().expect("an option was pushed above");
                    last.1.push(',');
                    last.1.push_str(part);
                }
            }
        }
    }
    Ok(options)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(args: &[&str]) -> Options {
        let mut argv = vec!["outboxd", "run"];
        argv.extend_from_slice(args);
        match Cli::try_parse_from(argv).unwrap().command {
            Command::Run(options) => options,
            _ => unreachable!(),
        }
    }

    #[test]
    fn defaults_fill_everything_but_urls() {
        let run = options(&[
            "--database-url",
            "postgres://u:p@localhost/db",
            "--brokers",
            "b:9092",
        ])
        .run()
        .unwrap();
        assert_eq!(
            run.database.tables[0].name,
            TableName {
                schema: "public".into(),
                name: "outbox_event".into()
            }
        );
        assert_eq!(run.database.slot, "outboxd");
        assert_eq!(run.database.publication, "outboxd");
        assert_eq!(run.topic_partitions, 6);
        assert_eq!(run.topic_replication_factor, None);
        assert!(run.create_topics);
        assert_eq!(run.startup_timeout, Duration::from_secs(60));
        assert_eq!(run.reconnect_timeout, Duration::from_secs(600));
        assert_eq!(run.shutdown_timeout, Duration::from_secs(30));
        assert_eq!(
            run.topic.render(&run.database.tables[0].name, "Order", "x"),
            "outbox.Order"
        );
    }

    #[test]
    fn missing_required_options_are_named() {
        let err = options(&["--brokers", "b:9092"])
            .run()
            .unwrap_err()
            .to_string();
        assert!(err.contains("--database-url"), "{err}");
        let err = options(&["--database-url", "postgres://localhost/db"])
            .run()
            .unwrap_err()
            .to_string();
        assert!(err.contains("--brokers"), "{err}");
    }

    #[test]
    fn rejects_invalid_names_and_injection() {
        for (flag, value) in [
            ("--slot", "Bad-Slot"),
            ("--slot", "x\"; DROP TABLE t; --"),
            ("--publication", "pub'; drop"),
            ("--table", "public.outbox event"),
            ("--table", "a.b.c"),
        ] {
            let err = options(&[
                "--database-url",
                "postgres://localhost/db",
                "--brokers",
                "b",
                flag,
                value,
            ])
            .run()
            .unwrap_err()
            .to_string();
            assert!(err.contains(flag), "{flag} {value}: {err}");
        }
    }

    #[test]
    fn parses_durations_and_names_the_setting() {
        assert_eq!(
            parse_duration("--x", "500ms").unwrap(),
            Duration::from_millis(500)
        );
        assert_eq!(
            parse_duration("--x", "7d").unwrap(),
            Duration::from_secs(7 * 86400)
        );
        let err = parse_duration("--startup-timeout", "soon")
            .unwrap_err()
            .to_string();
        assert!(err.contains("--startup-timeout"), "{err}");
    }

    #[test]
    fn bad_url_error_hides_the_password() {
        let err = parse_postgres_url("--database-url", "postgres://u:secret@host:notaport/db")
            .unwrap_err()
            .to_string();
        assert!(err.contains("--database-url"), "{err}");
        assert!(!err.contains("secret"), "{err}");
        assert_eq!(
            redact_url("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
    }

    #[test]
    fn kafka_options_must_be_key_value() {
        let run = options(&[
            "--database-url",
            "postgres://h/db",
            "--brokers",
            "b",
            "--kafka-option",
            "linger.ms=5",
        ])
        .run()
        .unwrap();
        assert_eq!(
            run.kafka_options,
            vec![("linger.ms".to_string(), "5".to_string())]
        );
        let err = options(&[
            "--database-url",
            "postgres://h/db",
            "--brokers",
            "b",
            "--kafka-option",
            "nonsense",
        ])
        .run()
        .unwrap_err()
        .to_string();
        assert!(err.contains("--kafka-option"), "{err}");
        assert!(!err.contains("nonsense"), "the text is never echoed: {err}");
    }

    #[test]
    fn kafka_option_values_keep_their_commas() {
        let given = [
            "sasl.password=p,ss w=rd,,x".to_string(),
            "acks=all,linger.ms=5".to_string(),
            "sasl.jaas.config=x required user=\"u\",pw".to_string(),
        ];
        assert_eq!(
            split_kafka_options(given.iter()).unwrap(),
            [
                ("sasl.password", "p,ss w=rd,,x"),
                ("acks", "all"),
                ("linger.ms", "5"),
                ("sasl.jaas.config", "x required user=\"u\",pw"),
            ]
            .map(|(k, v)| (k.to_string(), v.to_string()))
        );
        let secret = ["hunter2,sasl.username=me".to_string()];
        let err = split_kafka_options(secret.iter()).unwrap_err().to_string();
        assert!(!err.contains("hunter2"), "{err}");
    }

    /// Every option a file can set, each with a value no default has.
    const EVERY_OPTION: &str = r#"
database-url = "postgres://file/db"
replication-url = "postgres://file-replication/db"
brokers = "file:9092"
topic = "file.{aggregate_type}"
table = ["file.outbox"]
table-style = "debezium"
column = ["event_id=eid"]
header-column = ["trace"]
add-polling-columns = true
existing-rows = "unpublished"
slot = "file_slot"
publication = "file_publication"
kafka-option = ["acks=all"]
topic-partitions = 9
topic-replication-factor = 3
no-create-topics = true
startup-timeout = "61s"
reconnect-timeout = "11m"
shutdown-timeout = "31s"
max-in-flight-events = 1234
max-in-flight-bytes = 4096
status-interval = "2s"
mode = "poll"
poll-interval = "300ms"
poll-batch-size = 77
lease = "31s"
poll-order = "none"
retry-base = "2s"
retry-cap = "6m"
max-attempts = 11
poll-notify = true
dead-letter-topic = "file.dead"
retention = "8d"
archive-table = "file.archive"
retention-interval = "2m"
metrics-addr = "127.0.0.1:9999"
log-format = "json"
"#;

    /// Every option, as a TOML table (how the merge sees it).
    fn as_table(options: &Options) -> toml::Table {
        toml::Table::try_from(options).unwrap()
    }

    #[test]
    fn the_file_fills_every_option_and_flags_win_over_every_one() {
        let file: Options = toml::from_str(EVERY_OPTION).unwrap();
        let from_file = as_table(&file);
        assert_eq!(
            from_file.len(),
            EVERY_OPTION.lines().filter(|l| l.contains('=')).count(),
            "every option of the file is read: {from_file:?}"
        );
        // Nothing given by flag or environment: the file's value, for every option.
        let merged = Options::default().or(file.clone()).unwrap();
        assert_eq!(as_table(&merged), from_file);
        // Everything given: the flag's value, for every option.
        let flags: Options = toml::from_str(
            &EVERY_OPTION
                .replace("file", "flag")
                .replace("= 9\n", "= 8\n")
                .replace("= 3\n", "= 2\n"),
        )
        .unwrap();
        let merged = flags.clone().or(file).unwrap();
        assert_eq!(as_table(&merged), as_table(&flags));
    }

    #[test]
    fn file_fills_gaps_and_flags_win() {
        let dir = std::env::temp_dir().join(format!("outboxd-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("outboxd.toml");
        std::fs::write(
            &path,
            "brokers = \"file:9092\"\nslot = \"from_file\"\nkafka-option = [\"acks=all\"]\n",
        )
        .unwrap();
        let merged = options(&[
            "--config",
            path.to_str().unwrap(),
            "--slot",
            "from_flag",
            "--database-url",
            "postgres://h/db",
        ])
        .with_file()
        .unwrap();
        assert_eq!(merged.brokers.as_deref(), Some("file:9092"));
        assert_eq!(merged.slot.as_deref(), Some("from_flag"));
        assert_eq!(merged.kafka_option, Some(vec!["acks=all".to_string()]));

        std::fs::write(&path, "brokers = \"b\"\nbogus-key = 1\n").unwrap();
        let err = options(&["--config", path.to_str().unwrap()])
            .with_file()
            .unwrap_err()
            .to_string();
        assert!(err.contains("bogus-key"), "{err}");
        std::fs::write(&path, "topic-partitions = \"six\"\n").unwrap();
        let err = options(&["--config", path.to_str().unwrap()])
            .with_file()
            .unwrap_err()
            .to_string();
        assert!(err.contains("topic-partitions"), "{err}");
        // One table or a list of tables.
        for (text, expected) in [
            ("table = \"app.outbox\"\n", 1),
            ("table = [\"a.outbox\", \"b.outbox\"]\n", 2),
        ] {
            std::fs::write(&path, text).unwrap();
            let merged = options(&["--config", path.to_str().unwrap()])
                .with_file()
                .unwrap();
            assert_eq!(merged.table.map(|t| t.len()), Some(expected), "{text}");
        }
        std::fs::write(
            &path,
            "column = \"event_id=id\"\nheader-column = [\"a\", \"b\"]\n",
        )
        .unwrap();
        let merged = options(&["--config", path.to_str().unwrap()])
            .with_file()
            .unwrap();
        assert_eq!(merged.column, Some(vec!["event_id=id".to_string()]));
        assert_eq!(merged.header_column.map(|h| h.len()), Some(2));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn table_mapping_options() {
        let base = ["--database-url", "postgres://h/db", "--brokers", "b:9092"];
        let run = options(
            &[
                &base[..],
                &[
                    "--table",
                    "orders.outboxevent",
                    "--table",
                    "billing.outboxevent",
                    "--table-style",
                    "debezium",
                    "--column",
                    "billing.outboxevent:created_at=occurred_at",
                    "--header-column",
                    "traceparent",
                ],
            ]
            .concat(),
        )
        .run()
        .unwrap();
        let tables = &run.database.tables;
        assert_eq!(tables.len(), 2);
        assert_eq!(tables[1].name.schema, "billing");
        assert_eq!(tables[0].required(crate::table::Role::EventId), "id");
        assert_eq!(
            tables[1].column(crate::table::Role::CreatedAt),
            Some("occurred_at")
        );
        assert_eq!(
            tables[0].column(crate::table::Role::CreatedAt),
            Some("created_at"),
            "a TABLE: prefix maps that table only"
        );
        assert_eq!(tables[0].header_columns, vec!["traceparent".to_string()]);
        assert_eq!(
            run.topic.render(&tables[0].name, "Order", "x"),
            "outbox.event.Order"
        );
        for (flag, value, expected) in [
            ("--column", "event_id", "ROLE=COLUMN"),
            ("--column", "key=id", "unknown role"),
            ("--column", "payload=bo dy", "not a valid identifier"),
            ("--header-column", "x\"y", "not a valid identifier"),
            ("--table", "public.outbox_event,outbox_event", "given twice"),
            (
                "--column",
                "other:payload=body",
                "not one of the --table values",
            ),
        ] {
            let err = options(&[&base[..], &[flag, value]].concat())
                .run()
                .unwrap_err()
                .to_string();
            assert!(err.contains(expected), "{flag} {value}: {err}");
        }
    }
}
