//! From [`Options`] to settings: every default filled in, every value checked, each error naming the
//! option at fault (and, where it helps, the fix).

use std::time::Duration;

use super::cli::Options;
use super::parse::{
    parse_duration, parse_identifier, parse_postgres_url, parse_slot_name, parse_table,
    split_kafka_options,
};
use super::settings::{
    CdcSettings, CloudEventsMode, DatabaseSettings, DeliveryGuarantee, ExactlyOnceSettings,
    KafkaSettings, Mode, PollSettings, RecordFormatChoice, Retention, RunSettings,
    DEFAULT_MAX_IN_FLIGHT_EVENTS,
};
use super::{invalid, ConfigError};
use crate::record::{self, CloudEventsFormat, ContentMode, RecordFormat, SourceTemplate};
use crate::table::{TableName, TableSpec};
use crate::topic::TopicTemplate;

impl Options {
    /// The settings every command needs, validated; errors name the option at fault.
    pub fn database(&self) -> Result<DatabaseSettings<TableSpec>, ConfigError> {
        let url = self.database_url.as_deref().ok_or_else(|| {
            invalid("--database-url is required (or OUTBOXD_DATABASE_URL), e.g. postgres://user:pass@localhost:5432/app")
        })?;
        let password_command = self
            .database_password_command
            .as_deref()
            .map(crate::pg::password_command::PasswordCommand::parse)
            .transpose()
            .map_err(invalid)?;
        let with_command = |setting: &str, mut url: crate::pg::url::PgUrl| {
            if password_command.is_some() && url.config.get_password().is_some() {
                return Err(invalid(format!("{setting} holds a password and --database-password-command is given: remove the password from the URL (the command's output is used)")));
            }
            url.password_command = password_command.clone();
            Ok(url)
        };
        let database_url =
            with_command("--database-url", parse_postgres_url("--database-url", url)?)?;
        let replication_url = match &self.replication_url {
            Some(url) => with_command(
                "--replication-url",
                parse_postgres_url("--replication-url", url)?,
            )?,
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
        let mut tables: Vec<TableSpec> = Vec::with_capacity(names.len());
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
            tables.push(TableSpec::new(
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
            failover_slot: !self.no_failover_slot,
            standby_urls: self
                .standby_url
                .iter()
                .flatten()
                .map(|url| with_command("--standby-url", parse_postgres_url("--standby-url", url)?))
                .collect::<Result<_, _>>()?,
        })
    }

    /// The settings of `outboxd run`, validated, with every default filled in.
    // Long: one validation per option of `run`, in the order of `Options`; each names its option.
    pub fn run(&self) -> Result<RunSettings<TableSpec>, ConfigError> {
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
        if topic.starts_with_row_value() && !self.allow_unprefixed_topic {
            return Err(invalid(
                "--topic starts with {aggregate_type} or {event_type}: the rows would choose the whole topic name, any topic outboxd may write (another service's, Kafka Connect's configuration); start it with a fixed prefix (e.g. outbox.{aggregate_type}), or pass --allow-unprefixed-topic",
            ));
        }
        let max_topics = self.max_topics.unwrap_or(1000);
        if max_topics < 1 {
            return Err(invalid("--max-topics must be at least 1, got 0"));
        }
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
        let exactly_once = self.exactly_once(&kafka_options)?;
        let format = self.record_format(&database)?;
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
        let audit_interval = self
            .audit_interval
            .as_deref()
            .map(|every| parse_duration("--audit-interval", every))
            .transpose()?;
        if audit_interval.is_some_and(|every| every < Duration::from_secs(10)) {
            return Err(invalid(
                "--audit-interval must be at least 10s: each audit reads the topics since the interval began",
            ));
        }
        Ok(RunSettings {
            audit_interval,
            retention,
            metrics_addr,
            mode: self.mode.unwrap_or_default(),
            poll,
            database,
            topic,
            kafka: KafkaSettings {
                brokers,
                options: kafka_options,
                topic_partitions,
                topic_replication_factor: self.topic_replication_factor,
                create_topics: !self.no_create_topics,
                max_topics,
                exactly_once,
                format,
            },
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
            auto_drop_slot_after: match self.auto_drop_slot_after.as_deref().unwrap_or("10m") {
                "never" => None,
                after => Some(parse_duration("--auto-drop-slot-after", after)?),
            },
            cdc: CdcSettings {
                max_in_flight_events,
                max_in_flight_bytes,
                status_interval,
            },
        })
    }
}

impl Options {
    fn record_format(
        &self,
        database: &DatabaseSettings<TableSpec>,
    ) -> Result<RecordFormat, ConfigError> {
        let headers = || database.tables.iter().flat_map(|t| &t.header_columns);
        let cloudevents = self.format.unwrap_or_default() == RecordFormatChoice::Cloudevents;
        let (reserved, names): (&[&str], &str) = if cloudevents {
            (&record::CLOUDEVENTS_RESERVED, "a CloudEvents attribute")
        } else {
            (&record::OUTBOXD_HEADERS, "a header outboxd sets")
        };
        if let Some(column) = headers().find(|c| reserved.contains(&c.as_str())) {
            return Err(invalid(format!(
                "--header-column {column:?} would overwrite {names} of the same name with a row's value; rename the column in a view or leave it out (taken: {})",
                reserved.join(", ")
            )));
        }
        if !cloudevents {
            for (flag, given) in [
                ("--cloudevents-mode", self.cloudevents_mode.is_some()),
                ("--cloudevents-source", self.cloudevents_source.is_some()),
            ] {
                if given {
                    return Err(invalid(format!(
                        "{flag} needs --format cloudevents (without it nothing uses it)"
                    )));
                }
            }
            return Ok(RecordFormat::Outboxd);
        }
        let source = match &self.cloudevents_source {
            Some(template) => {
                SourceTemplate::parse(template).map_err(|e| invalid(e.to_string()))?
            }
            None => SourceTemplate::default(),
        };
        if let Some(column) = headers().find(|c| !record::is_attribute_name(c)) {
            return Err(invalid(format!(
                "--header-column {column:?}: with --format cloudevents a header column becomes an extension attribute (ce_{column}), whose name must be lower-case letters and digits only; rename the column, or use --format outboxd"
            )));
        }
        Ok(RecordFormat::CloudEvents(CloudEventsFormat {
            mode: match self.cloudevents_mode.unwrap_or_default() {
                CloudEventsMode::Binary => ContentMode::Binary,
                CloudEventsMode::Structured => ContentMode::Structured,
            },
            source,
        }))
    }

    fn exactly_once(
        &self,
        kafka_options: &[(String, String)],
    ) -> Result<Option<ExactlyOnceSettings>, ConfigError> {
        if self.delivery.unwrap_or_default() != DeliveryGuarantee::ExactlyOnce {
            for (flag, given) in [
                ("--progress-topic", self.progress_topic.is_some()),
                (
                    "--transaction-interval",
                    self.transaction_interval.is_some(),
                ),
            ] {
                if given {
                    return Err(invalid(format!(
                        "{flag} needs --delivery exactly-once (without it nothing uses it)"
                    )));
                }
            }
            return Ok(None);
        }
        if self.mode == Some(Mode::Poll) {
            return Err(invalid(
                "--delivery exactly-once covers the CDC path: use --mode cdc or auto (the polling path is at least once)",
            ));
        }
        if let Some((key, _)) = kafka_options
            .iter()
            .find(|(key, _)| key == "transactional.id" || key == "enable.idempotence")
        {
            return Err(invalid(format!(
                "--kafka-option {key} cannot be set with --delivery exactly-once: outboxd derives the transactional id from the slot and the progress topic (so that a new leader fences the old one) and needs idempotence; remove the option"
            )));
        }
        let progress_topic = self
            .progress_topic
            .clone()
            .unwrap_or_else(|| crate::progress::DEFAULT_PROGRESS_TOPIC.into());
        if progress_topic.is_empty()
            || progress_topic.len() > 249
            || !progress_topic
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
        {
            return Err(invalid(format!(
                "--progress-topic {progress_topic:?} is not a valid Kafka topic name (letters, digits, '.', '_', '-'; at most 249)"
            )));
        }
        let transaction_interval = parse_duration(
            "--transaction-interval",
            self.transaction_interval.as_deref().unwrap_or("100ms"),
        )?;
        if transaction_interval.is_zero() || transaction_interval > Duration::from_secs(10) {
            return Err(invalid(
                "--transaction-interval must be between 1ms and 10s (well under transaction.timeout.ms)",
            ));
        }
        Ok(Some(ExactlyOnceSettings {
            progress_topic,
            transaction_interval,
        }))
    }

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
            let template = TopicTemplate::parse(topic)
                .map_err(|e| invalid(format!("--dead-letter-topic: {e}")))?;
            // One topic for every dead letter, as Kafka Connect's errors.deadletterqueue.topic.name: the
            // record's headers say which table and aggregate it came from.
            if !template.is_literal() {
                return Err(invalid(format!(
                    "--dead-letter-topic {topic:?} has a placeholder, but it names one topic for every dead letter (its headers say where each came from): give a fixed name, e.g. outbox.dead-letters"
                )));
            }
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
