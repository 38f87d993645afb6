//! `outboxd audit`: proves that Kafka holds every event the table says was published, on the topic and
//! partition it belongs on and in its aggregate's order, and names every record no row explains.
//!
//! Memory stays flat however big the range: the published rows of the range are copied into a temporary
//! table by PostgreSQL itself, each topic's records are streamed into another with binary COPY (topic,
//! partition, offset, key, event id, timestamp), and the comparison is SQL over the two, so PostgreSQL sorts
//! and joins, spilling to disk as it needs. The findings come back through a portal, [`FINDINGS_PER_FETCH`]
//! rows at a time, so a million missing events cost no more memory than one. Temporary tables are
//! session-local and not WAL-logged: nothing reaches a standby or the replication slot. Topics are read with
//! a plain consumer (no group, nothing committed), `read_committed`, from their first offset to their end
//! when the read began.
//!
//! It owns the reading and comparing; the counts, verdict and rendering are [`report`]'s, the partitioner
//! [`partitioner`]'s. It writes nothing to the outbox table.

pub mod continuous;
pub mod partitioner;
pub mod report;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use rdkafka::config::FromClientConfigAndContext;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};
use tokio_postgres::binary_copy::BinaryCopyInWriter;
use tokio_postgres::types::Type;
use tokio_postgres::{Client, Portal, Row, Transaction};
use uuid::Uuid;

use crate::config::RunSettings;
use crate::error::{Error, Result};
use crate::kafka::secrets::RedactingContext;
use crate::table::TableSpec;
use crate::table::{OutboxTable, Role};
use report::{Finding, Kind, Summary};

/// Which published events are audited.
#[derive(Debug, Clone, Default)]
pub struct Range {
    /// Created at or after (the table's `created_at`, or `published_at` where it has none).
    pub since: Option<SystemTime>,
    /// Created before.
    pub until: Option<SystemTime>,
    /// Of this aggregate type only.
    pub aggregate_type: Option<String>,
    /// `--heal`: hand every missing event back to the polling path, which publishes it again.
    pub heal: bool,
    /// Read each topic only from its records of this time on (by their timestamps), not from its first:
    /// for a range of recent events (`run --audit-interval`), earlier than any of them was published.
    pub read_since: Option<SystemTime>,
}

/// The start of a heal's id in the `outboxd-replay` header: a healed copy makes its event present (it was
/// missing), while a replay's copy (`replay-...`) does not (a replay republishes what the topic had).
pub const HEAL_PREFIX: &str = "heal-";

/// How long a metadata or watermark request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// A topic read that gets no record for this long, short of its end, fails the audit.
const READ_STALL: Duration = Duration::from_secs(60);
/// How often a long read says how far it got.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);
/// The audit consumer's fetches, at most (more where `message.max.bytes` is more).
const AUDIT_FETCH_MAX_BYTES: u64 = 4 * 1024 * 1024;
/// Rows of a result (findings, absent events) outboxd holds at a time.
const FINDINGS_PER_FETCH: i32 = 1_000;

/// Audits the range against the topics; every finding goes to `details` (one JSON object per line) as it is
/// found. Errors mean the audit could not be made (exit code 2).
pub async fn audit(
    settings: RunSettings<TableSpec>,
    range: &Range,
    mut details: Option<&mut (dyn Write + Send)>,
) -> Result<Summary> {
    let mut sql = crate::pg::connect(&settings.database.database_url).await?;
    let tables = crate::pg::slot::inspect_all(&sql, &settings.database.tables).await?;
    let mode = settings.mode;
    let settings = settings.inspected(tables, mode);
    let db = &settings.database;
    for table in &db.tables {
        if !table.marks_published {
            return Err(Error::setup(
                format!("{} has no published_at column: nothing records which events were published, so there is nothing to audit", table.name),
                "run `outboxd migrate --add-polling-columns` (outboxd then records each event it publishes)",
            ));
        }
        if range.heal && !table.polling {
            return Err(Error::setup(
                format!("{} has no polling columns: --heal hands missing events to the polling path, which this table lacks", table.name),
                "run `outboxd migrate --add-polling-columns`, or audit without --heal",
            ));
        }
    }
    create_scratch_tables(&sql).await?;
    let mut summary = Summary::default();
    for (index, table) in db.tables.iter().enumerate() {
        copy_published_rows(&sql, index, table, range).await?;
    }
    let topics = assign_topics(&sql, &settings).await?;
    summary.topics = topics.len() as u64;
    for (topic, &partitions) in &topics {
        summary.records += read_topic(&sql, &settings, topic, partitions, range.read_since).await?;
    }
    sql.batch_execute(
        "CREATE INDEX ON outboxd_audit_record (event_id);
         CREATE INDEX ON outboxd_audit_expected (event_id);
         ANALYZE outboxd_audit_expected; ANALYZE outboxd_audit_record;",
    )
    .await?;
    let mut report = |finding: Finding| -> Result<()> {
        if let Some(out) = details.as_deref_mut() {
            let line = serde_json::to_string(&finding).map_err(|e| Error::bug(e.to_string()))?;
            writeln!(out, "{line}").map_err(|e| {
                Error::setup(
                    format!("cannot write the details file: {e}"),
                    "give --details a writable path",
                )
            })?;
        }
        Ok(())
    };
    let comparison = sql.transaction().await?;
    compare(
        &comparison,
        &db.tables,
        range.read_since.is_none(),
        &mut summary,
        &mut report,
    )
    .await?;
    comparison.commit().await?;
    if range.heal {
        let replay_id = crate::replay::new_replay_id(SystemTime::now());
        let heal_id = replay_id.replacen("replay-", HEAL_PREFIX, 1);
        for (index, table) in db.tables.iter().enumerate() {
            summary.healed += heal(&mut sql, index, table, &heal_id).await?;
        }
    }
    Ok(summary)
}

/// Hands the missing events of `table` (not the expired ones) back to the polling path, 1,000 per
/// transaction, under `heal_id` (their records carry it in the `outboxd-replay` header); returns how many.
async fn heal(sql: &mut Client, index: usize, table: &OutboxTable, heal_id: &str) -> Result<u64> {
    let index = index as i32;
    let mut healed = 0;
    loop {
        let ids: Vec<Uuid> = sql
            .query(
                "DELETE FROM outboxd_audit_absent WHERE ctid = ANY(ARRAY(
                     SELECT ctid FROM outboxd_audit_absent WHERE tbl = $1 AND NOT expired LIMIT 1000))
                 RETURNING event_id",
                &[&index],
            )
            .await?
            .iter()
            .map(|row| row.get(0))
            .collect();
        if ids.is_empty() {
            break;
        }
        healed += crate::pg::outbox::hand_back_published(sql, table, &ids, heal_id, false).await?;
    }
    if healed > 0 {
        tracing::info!(table = %table.name, events = healed, "handed the missing events back to the polling path: outboxd publishes them again, each after its aggregate's earlier unpublished events");
    }
    Ok(healed)
}

async fn create_scratch_tables(sql: &Client) -> Result<()> {
    sql.batch_execute(
        "CREATE TEMP TABLE outboxd_audit_expected (
             tbl int NOT NULL, event_id uuid NOT NULL, aggregate_type text, aggregate_id text NOT NULL,
             event_type text, position bigint, published_at timestamptz NOT NULL, topic text);
         CREATE TEMP TABLE outboxd_audit_record (
             topic text NOT NULL, partition int NOT NULL, \"offset\" bigint NOT NULL, key text,
             event_id uuid, ts timestamptz, wrong_partition bool NOT NULL, replay_id text);
         CREATE TEMP TABLE outboxd_audit_topic (
             topic text PRIMARY KEY, partitions int NOT NULL, retention_ms bigint);
         CREATE TEMP TABLE outboxd_audit_partition (
             topic text NOT NULL, partition int NOT NULL, low bigint NOT NULL, PRIMARY KEY (topic, partition));",
    )
    .await?;
    Ok(())
}

/// The published rows of `table` in the range, copied by PostgreSQL into `outboxd_audit_expected`.
async fn copy_published_rows(
    sql: &Client,
    index: usize,
    table: &OutboxTable,
    range: &Range,
) -> Result<()> {
    let created = table
        .column(Role::CreatedAt)
        .map(|c| format!("\"{c}\""))
        .unwrap_or_else(|| "published_at".into());
    let position = if table.polling {
        "position"
    } else {
        "NULL::bigint"
    };
    // A replayed or healed event was first published when the table of replayed events says (the polling
    // path marked it published again when it republished it): its age, for the topic's retention, is that.
    let replayed = crate::table::replay_tables(&table.name).replayed;
    let readable = crate::pg::may_read(sql, &replayed).await?;
    let first_published = if readable {
        format!(
            "coalesce((SELECT r.published_at FROM {replayed} r WHERE r.event_id = o.{}), o.published_at)",
            table.col(Role::EventId)
        )
    } else {
        "o.published_at".into()
    };
    let statement = format!(
        "INSERT INTO outboxd_audit_expected
         SELECT $1, {event_id}, {aggregate_type}, {aggregate_id}::text, {event_type}, {position}, {first_published}
         FROM {name} o
         WHERE published_at IS NOT NULL AND published_at > '-infinity'
           AND ($2::timestamptz IS NULL OR {created} >= $2)
           AND ($3::timestamptz IS NULL OR {created} < $3)
           AND ($4::text IS NULL OR {aggregate_type} = $4)",
        event_id = table.col(Role::EventId),
        aggregate_type = table.text_expr(Role::AggregateType, "NULL::text"),
        aggregate_id = table.col(Role::AggregateId),
        event_type = table.text_expr(Role::EventType, "NULL::text"),
        name = table.name.quoted(),
    );
    let index = index as i32;
    let copied = sql
        .execute(
            &statement,
            &[&index, &range.since, &range.until, &range.aggregate_type],
        )
        .await?;
    tracing::info!(table = %table.name, published_events = copied, "published events of the range");
    Ok(())
}

/// Gives each row its topic (by `--topic`, as the publisher renders it) and records each topic's partition
/// count and `retention.ms` (in `outboxd_audit_topic`); returns the partition counts. A topic that does not
/// exist has no partition.
async fn assign_topics(sql: &Client, settings: &RunSettings) -> Result<BTreeMap<String, i32>> {
    let kinds = sql
        .query(
            "SELECT DISTINCT tbl, aggregate_type, event_type FROM outboxd_audit_expected",
            &[],
        )
        .await?;
    let mut topics = BTreeSet::new();
    for row in kinds {
        let (index, aggregate_type, event_type): (i32, Option<String>, Option<String>) =
            (row.get(0), row.get(1), row.get(2));
        let table = &settings.database.tables[index as usize];
        let topic = settings.topic.render(
            &table.name,
            aggregate_type.as_deref().unwrap_or_default(),
            event_type.as_deref().unwrap_or_default(),
        );
        sql.execute(
            "UPDATE outboxd_audit_expected SET topic = $4
             WHERE tbl = $1 AND aggregate_type IS NOT DISTINCT FROM $2 AND event_type IS NOT DISTINCT FROM $3",
            &[&index, &aggregate_type, &event_type, &topic],
        )
        .await?;
        topics.insert(topic);
    }
    let config = crate::kafka::client_config(settings);
    let admin = rdkafka::admin::AdminClient::from_config_and_context(
        &config,
        RedactingContext::for_config(&config),
    )
    .map_err(crate::kafka::config_error)?;
    let metadata =
        tokio::task::block_in_place(|| admin.inner().fetch_metadata(None, REQUEST_TIMEOUT))
            .map_err(|e| kafka_error(format!("cannot read the brokers' metadata: {e}")))?;
    let mut facts = BTreeMap::new();
    for topic in &topics {
        let partitions = metadata
            .topics()
            .iter()
            .find(|t| t.name() == topic)
            .map_or(0, |t| t.partitions().len() as i32);
        let retention_ms = if partitions > 0 {
            retention_ms(&admin, topic).await?
        } else {
            tracing::warn!(
                topic,
                "the topic does not exist: every event published to it counts as missing"
            );
            None
        };
        sql.execute(
            "INSERT INTO outboxd_audit_topic VALUES ($1, $2, $3)",
            &[topic, &partitions, &retention_ms],
        )
        .await?;
        facts.insert(topic.clone(), partitions);
    }
    Ok(facts)
}

async fn retention_ms(
    admin: &rdkafka::admin::AdminClient<RedactingContext>,
    topic: &str,
) -> Result<Option<i64>> {
    let described = admin
        .describe_configs(
            &[rdkafka::admin::ResourceSpecifier::Topic(topic)],
            &rdkafka::admin::AdminOptions::new().request_timeout(Some(REQUEST_TIMEOUT)),
        )
        .await
        .map_err(|e| kafka_error(format!("cannot describe topic {topic}: {e}")))?;
    Ok(described
        .into_iter()
        .next()
        .and_then(|result| result.ok())
        .and_then(|resource| {
            resource
                .get("retention.ms")
                .and_then(|entry| entry.value.as_deref())
                .and_then(|value| value.parse::<i64>().ok())
        })
        .filter(|ms| *ms >= 0))
}

/// Streams every record of `topic`, first offset to the end when the read began, into
/// `outboxd_audit_record`; returns how many.
async fn read_topic(
    sql: &Client,
    settings: &RunSettings,
    topic: &str,
    partitions: i32,
    read_since: Option<SystemTime>,
) -> Result<u64> {
    if partitions == 0 {
        return Ok(0);
    }
    let mut config = crate::kafka::client_config(settings);
    // librdkafka refuses a fetch.max.bytes below message.max.bytes (which --kafka-option may raise).
    let fetch_max_bytes = config
        .get("message.max.bytes")
        .and_then(|bytes| bytes.parse::<u64>().ok())
        .unwrap_or_default()
        .max(AUDIT_FETCH_MAX_BYTES);
    config
        .set("group.id", "outboxd-audit")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("enable.partition.eof", "true")
        .set("isolation.level", "read_committed")
        // librdkafka prefetches up to 64 MiB, in fetches of up to 50 MiB, by default: most of the audit's
        // memory once a topic holds more. Measured (outboxd-bench --only audit), peak RSS from 100k to 10M
        // records: 16 MiB queued in 8 MiB fetches, 69 to 94 MiB; 8 MiB in 4 MiB fetches, 47 to 53 MiB at the
        // same rate (10M: 55 MiB); 4 MiB in 2 MiB fetches, 35 MiB flat but a third slower.
        .set("queued.max.messages.kbytes", "8192")
        .set("fetch.max.bytes", fetch_max_bytes.to_string());
    let consumer: StreamConsumer<RedactingContext> = config
        .create_with_context(RedactingContext::for_config(&config))
        .map_err(crate::kafka::config_error)?;
    // The end of each partition when the read began (for read_committed: the last stable offset).
    let mut ends: HashMap<i32, i64> = HashMap::new();
    let mut assignment = TopicPartitionList::new();
    for partition in 0..partitions {
        let (low, high) = tokio::task::block_in_place(|| {
            consumer.fetch_watermarks(topic, partition, REQUEST_TIMEOUT)
        })
        .map_err(|e| {
            kafka_error(format!(
                "cannot read the offsets of {topic} [{partition}]: {e}"
            ))
        })?;
        sql.execute(
            "INSERT INTO outboxd_audit_partition VALUES ($1, $2, $3)",
            &[&topic, &partition, &low],
        )
        .await?;
        let start = match read_since {
            Some(since) => first_offset_since(&consumer, topic, partition, since)?.max(low),
            None => low,
        };
        if high > start {
            ends.insert(partition, high);
            assignment
                .add_partition_offset(topic, partition, Offset::Offset(start))
                .map_err(|e| Error::bug(e.to_string()))?;
        }
    }
    if ends.is_empty() {
        return Ok(0);
    }
    consumer
        .assign(&assignment)
        .map_err(|e| kafka_error(format!("cannot read {topic}: {e}")))?;
    let event_id_header = settings.database.style.event_id_header();
    let sink = sql
        .copy_in(
            "COPY outboxd_audit_record (topic, partition, \"offset\", key, event_id, ts, wrong_partition, replay_id)
             FROM STDIN BINARY",
        )
        .await?;
    let writer = BinaryCopyInWriter::new(
        sink,
        &[
            Type::TEXT,
            Type::INT4,
            Type::INT8,
            Type::TEXT,
            Type::UUID,
            Type::TIMESTAMPTZ,
            Type::BOOL,
            Type::TEXT,
        ],
    );
    let mut writer = std::pin::pin!(writer);
    let mut read = 0u64;
    let mut last_progress = Instant::now();
    while !ends.is_empty() {
        let message = match tokio::time::timeout(READ_STALL, consumer.recv()).await {
            Err(_) => {
                return Err(kafka_error(format!(
                    "reading {topic} stalled for {READ_STALL:?} short of its end (partitions left: {:?})",
                    ends.keys().collect::<Vec<_>>()
                )))
            }
            Ok(Err(KafkaError::PartitionEOF(partition))) => {
                ends.remove(&partition);
                continue;
            }
            Ok(Err(error)) => return Err(kafka_error(format!("cannot read {topic}: {error}"))),
            Ok(Ok(message)) => message,
        };
        let partition = message.partition();
        let Some(&end) = ends.get(&partition) else {
            continue;
        };
        if message.offset() >= end {
            ends.remove(&partition);
            continue;
        }
        if message.offset() + 1 >= end {
            ends.remove(&partition);
        }
        let key = message
            .key()
            .map(|k| String::from_utf8_lossy(k).into_owned());
        let wrong_partition = message
            .key()
            .is_some_and(|k| partitioner::partition_of(k, partitions) != partition);
        let event_id = event_id_of(&message, event_id_header);
        let replay_id = header_text(&message, crate::record::REPLAY_HEADER);
        let ts = message
            .timestamp()
            .to_millis()
            .and_then(|ms| u64::try_from(ms).ok())
            .map(|ms| UNIX_EPOCH + Duration::from_millis(ms));
        writer
            .as_mut()
            .write(&[
                &topic,
                &partition,
                &message.offset(),
                &key,
                &event_id,
                &ts,
                &wrong_partition,
                &replay_id,
            ])
            .await?;
        read += 1;
        if last_progress.elapsed() >= PROGRESS_EVERY {
            tracing::info!(topic, records = read, "reading the topic");
            last_progress = Instant::now();
        }
    }
    writer.finish().await?;
    tracing::info!(topic, records = read, "read the topic");
    Ok(read)
}

/// The first offset of `topic [partition]` whose record's timestamp is `since` or later (the partition's end
/// when none is).
fn first_offset_since(
    consumer: &StreamConsumer<RedactingContext>,
    topic: &str,
    partition: i32,
    since: SystemTime,
) -> Result<i64> {
    let millis = since
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as i64;
    let mut wanted = TopicPartitionList::new();
    wanted
        .add_partition_offset(topic, partition, Offset::Offset(millis))
        .map_err(|e| Error::bug(e.to_string()))?;
    let found = tokio::task::block_in_place(|| consumer.offsets_for_times(wanted, REQUEST_TIMEOUT))
        .map_err(|e| {
            kafka_error(format!(
                "cannot find the offsets of {topic} [{partition}] by time: {e}"
            ))
        })?;
    Ok(
        match found.find_partition(topic, partition).map(|p| p.offset()) {
            Some(Offset::Offset(offset)) => offset,
            _ => i64::MAX,
        },
    )
}

/// The text of header `name`, if the record has it.
fn header_text<M: Message>(message: &M, name: &str) -> Option<String> {
    message
        .headers()?
        .iter()
        .find(|header| header.key == name)
        .and_then(|header| header.value)
        .map(|value| String::from_utf8_lossy(value).into_owned())
}

/// The event id a record carries: outboxd's header (by `--table-style`), a CloudEvent's `ce_id` header, or
/// the `id` of a structured CloudEvent; `None` when it has none that is a uuid.
fn event_id_of<M: Message>(message: &M, event_id_header: &str) -> Option<Uuid> {
    if let Some(headers) = message.headers() {
        for header in headers.iter() {
            if header.key == event_id_header || header.key == "ce_id" {
                if let Some(id) = header
                    .value
                    .and_then(|v| std::str::from_utf8(v).ok())
                    .and_then(|v| Uuid::parse_str(v).ok())
                {
                    return Some(id);
                }
            }
        }
    }
    let value: serde_json::Value = serde_json::from_slice(message.payload()?).ok()?;
    value
        .get("specversion")
        .and(value.get("id"))
        .and_then(|id| id.as_str())
        .and_then(|id| Uuid::parse_str(id).ok())
}

/// The comparison, each kind of finding one query; counts go to `summary`, findings to `report`.
async fn compare(
    sql: &Transaction<'_>,
    tables: &[OutboxTable],
    read_from_start: bool,
    summary: &mut Summary,
    report: &mut impl FnMut(Finding) -> Result<()>,
) -> Result<()> {
    summary.checked = count(sql, "SELECT count(*) FROM outboxd_audit_expected").await?;
    // Present: a copy outboxd published, or a heal's; a replay's copy alone does not make up for a loss.
    sql.batch_execute(&format!(
        "CREATE TEMP TABLE outboxd_audit_absent AS
         SELECT e.tbl, e.event_id, e.topic, e.aggregate_id, e.published_at, t.partitions, t.retention_ms IS NOT NULL
                AND e.published_at < now() - t.retention_ms * interval '1 millisecond' AS expired
         FROM outboxd_audit_expected e JOIN outboxd_audit_topic t USING (topic)
         WHERE NOT EXISTS (SELECT FROM outboxd_audit_record r WHERE r.event_id = e.event_id
                           AND (r.replay_id IS NULL OR starts_with(r.replay_id, '{HEAL_PREFIX}')))"
    ))
    .await?;
    // Old enough for the topic's retention to have taken it is not enough: the broker must have removed
    // records from the partition its key hashes to (its first offset past 0), and, where the read began at
    // that first offset, the first record it kept must be younger than the event. An old event absent from a
    // partition that never lost a record, or that still holds records older than it, is missing.
    let first_offsets: HashMap<(String, i32), i64> = sql
        .query(
            "SELECT topic, partition, low FROM outboxd_audit_partition",
            &[],
        )
        .await?
        .iter()
        .map(|row| ((row.get(0), row.get(1)), row.get(2)))
        .collect();
    let first_kept: HashMap<(String, i32), Option<SystemTime>> = if read_from_start {
        sql.query(
            "SELECT DISTINCT ON (topic, partition) topic, partition, ts FROM outboxd_audit_record
             ORDER BY topic, partition, \"offset\"",
            &[],
        )
        .await?
        .iter()
        .map(|row| ((row.get(0), row.get(1)), row.get(2)))
        .collect()
    } else {
        HashMap::new()
    };
    sql.batch_execute("CREATE INDEX ON outboxd_audit_absent (event_id)")
        .await?;
    let mut absent = Batches::open(
        sql,
        "SELECT event_id, topic, expired, aggregate_id, partitions, published_at, tbl FROM outboxd_audit_absent",
    )
    .await?;
    while let Some(rows) = absent.next().await? {
        // (table index, event id): an event id may be in two tables, expired in one only.
        let (mut not_expired_tables, mut not_expired) = (Vec::<i32>::new(), Vec::new());
        for row in rows {
            let (event_id, topic, old_enough, key, partitions, published_at): (
                Uuid,
                String,
                bool,
                String,
                i32,
                SystemTime,
            ) = (
                row.get(0),
                row.get(1),
                row.get(2),
                row.get(3),
                row.get(4),
                row.get(5),
            );
            let partition = (
                topic.clone(),
                partitioner::partition_of(key.as_bytes(), partitions.max(1)),
            );
            let removed_before_it = first_offsets.get(&partition).is_some_and(|low| *low > 0)
                && match first_kept.get(&partition) {
                    Some(Some(kept)) => published_at < *kept,
                    _ => true,
                };
            let expired = old_enough && partitions > 0 && removed_before_it;
            if old_enough && !expired {
                not_expired_tables.push(row.get(6));
                not_expired.push(event_id);
            }
            let (kind, detail) = if expired {
                summary.expired += 1;
                (
                    Kind::Expired,
                    "published before the topic's retention.ms could keep it",
                )
            } else {
                summary.missing += 1;
                (Kind::Missing, "published, but the topic does not hold it")
            };
            report(Finding {
                kind,
                event_id: Some(event_id.to_string()),
                topic: Some(topic),
                partition: None,
                offset: None,
                detail: detail.into(),
            })?;
        }
        // The portal reads the table as it was when it opened: these updates never come back through it.
        sql.execute(
            "UPDATE outboxd_audit_absent a SET expired = false
             FROM unnest($1::int[], $2::uuid[]) AS n (tbl, event_id)
             WHERE a.tbl = n.tbl AND a.event_id = n.event_id",
            &[&not_expired_tables, &not_expired],
        )
        .await?;
    }
    summary.present = summary
        .checked
        .saturating_sub(summary.missing + summary.expired);

    summary.replayed = count(
        sql,
        "SELECT count(*) FROM outboxd_audit_record WHERE replay_id IS NOT NULL",
    )
    .await?;
    let mut duplicated = Batches::open(
        sql,
        "SELECT r.event_id, count(*) FROM outboxd_audit_record r
         JOIN outboxd_audit_expected e USING (event_id)
         WHERE r.replay_id IS NULL
         GROUP BY r.event_id HAVING count(*) > 1",
    )
    .await?;
    while let Some(rows) = duplicated.next().await? {
        for row in rows {
            let (event_id, copies): (Uuid, i64) = (row.get(0), row.get(1));
            summary.duplicated += 1;
            summary.extra_copies += copies as u64 - 1;
            report(Finding {
                kind: Kind::Duplicated,
                event_id: Some(event_id.to_string()),
                topic: None,
                partition: None,
                offset: None,
                detail: format!("{copies} copies"),
            })?;
        }
    }

    let mut misplaced = Batches::open(
        sql,
        "SELECT r.event_id, r.topic, r.partition, r.\"offset\", e.topic, r.wrong_partition
         FROM outboxd_audit_record r JOIN outboxd_audit_expected e USING (event_id)
         WHERE r.topic <> e.topic OR r.wrong_partition",
    )
    .await?;
    while let Some(rows) = misplaced.next().await? {
        for row in rows {
            let (event_id, topic, partition, offset, expected, wrong_partition): (
                Uuid,
                String,
                i32,
                i64,
                String,
                bool,
            ) = (
                row.get(0),
                row.get(1),
                row.get(2),
                row.get(3),
                row.get(4),
                row.get(5),
            );
            summary.misplaced += 1;
            let detail = if topic != expected {
                format!("on topic {topic}, not {expected}")
            } else if wrong_partition {
                "on another partition than its key hashes to (murmur2)".to_string()
            } else {
                String::new()
            };
            report(Finding {
                kind: Kind::Misplaced,
                event_id: Some(event_id.to_string()),
                topic: Some(topic),
                partition: Some(partition),
                offset: Some(offset),
                detail,
            })?;
        }
    }

    // Each event's first copy on its own topic (republished copies aside), in offset order per partition and key; an
    // event is reordered when an event of its aggregate inserted after it came before it.
    let mut reordered = Batches::open(
        sql,
            "WITH firsts AS (
                 SELECT DISTINCT ON (r.event_id) r.event_id, r.topic, r.partition, r.\"offset\", r.key, e.position
                 FROM outboxd_audit_record r JOIN outboxd_audit_expected e USING (event_id)
                 WHERE r.topic = e.topic AND e.position IS NOT NULL AND r.replay_id IS NULL
                 ORDER BY r.event_id, r.\"offset\"),
             ordered AS (
                 SELECT *, max(position) OVER (PARTITION BY topic, partition, key ORDER BY \"offset\"
                                               ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS later_before
                 FROM firsts)
             SELECT event_id, topic, partition, \"offset\" FROM ordered WHERE position < later_before",
    )
    .await?;
    while let Some(rows) = reordered.next().await? {
        for row in rows {
            summary.reordered += 1;
            report(Finding {
                kind: Kind::Reordered,
                event_id: Some(row.get::<_, Uuid>(0).to_string()),
                topic: Some(row.get(1)),
                partition: Some(row.get(2)),
                offset: Some(row.get(3)),
                detail: "after an event of its aggregate inserted later".into(),
            })?;
        }
    }

    unexplained(sql, tables, summary, report).await
}

/// Records no row of the range explains: without an event id, or with one no table has a row of (older than
/// the tables' oldest published row: deleted by retention; else another producer or a row deleted by hand).
async fn unexplained(
    sql: &Transaction<'_>,
    tables: &[OutboxTable],
    summary: &mut Summary,
    report: &mut impl FnMut(Finding) -> Result<()>,
) -> Result<()> {
    let mut oldest: Option<SystemTime> = None;
    let mut no_row = String::new();
    for table in tables {
        let first: Option<SystemTime> = sql
            .query_opt(
                &format!(
                    "SELECT published_at FROM {} WHERE published_at > '-infinity' ORDER BY published_at LIMIT 1",
                    table.name.quoted()
                ),
                &[],
            )
            .await?
            .map(|row| row.get(0));
        oldest = match (oldest, first) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        no_row.push_str(&format!(
            " AND NOT EXISTS (SELECT FROM {} t WHERE t.{} = r.event_id)",
            table.name.quoted(),
            table.col(Role::EventId)
        ));
    }
    // Two branches, not one OR: each NOT EXISTS is then an anti-join PostgreSQL hashes or merges, where
    // under an OR it ran a sub-plan per record (an audit of a million events never ended).
    let statement = format!(
        "SELECT r.topic, r.partition, r.\"offset\", r.event_id, r.ts FROM outboxd_audit_record r
         WHERE r.event_id IS NULL
         UNION ALL
         SELECT r.topic, r.partition, r.\"offset\", r.event_id, r.ts FROM outboxd_audit_record r
         WHERE r.event_id IS NOT NULL
           AND NOT EXISTS (SELECT FROM outboxd_audit_expected e WHERE e.event_id = r.event_id){no_row}"
    );
    let mut records = Batches::open(sql, &statement).await?;
    while let Some(rows) = records.next().await? {
        for row in rows {
            let (topic, partition, offset, event_id, ts): (
                String,
                i32,
                i64,
                Option<Uuid>,
                Option<SystemTime>,
            ) = (row.get(0), row.get(1), row.get(2), row.get(3), row.get(4));
            let detail = match (event_id, ts, oldest) {
                (None, _, _) => {
                    summary.unexplained_without_id += 1;
                    "no event id: written by another producer".to_string()
                }
                (Some(_), Some(ts), Some(oldest)) if ts < oldest => {
                    summary.unexplained_deleted += 1;
                    "no row: older than the table's oldest published row (deleted by retention)"
                        .to_string()
                }
                (Some(_), _, _) => {
                    summary.unexplained_foreign += 1;
                    "no row has this event id: another producer, or a row deleted by hand"
                        .to_string()
                }
            };
            let kind = Kind::Unexplained;
            report(Finding {
                kind,
                event_id: event_id.map(|id| id.to_string()),
                topic: Some(topic),
                partition: Some(partition),
                offset: Some(offset),
                detail,
            })?;
        }
    }
    Ok(())
}

/// A result read through a portal, [`FINDINGS_PER_FETCH`] rows at a time (within the transaction).
struct Batches<'t, 'c> {
    sql: &'t Transaction<'c>,
    portal: Portal,
}

impl<'t, 'c> Batches<'t, 'c> {
    async fn open(sql: &'t Transaction<'c>, statement: &str) -> Result<Self> {
        let portal = sql.bind(statement, &[]).await?;
        Ok(Self { sql, portal })
    }

    /// The next rows; `None` once the result is read.
    async fn next(&mut self) -> Result<Option<Vec<Row>>> {
        let rows = self
            .sql
            .query_portal(&self.portal, FINDINGS_PER_FETCH)
            .await?;
        Ok((!rows.is_empty()).then_some(rows))
    }
}

async fn count(sql: &Transaction<'_>, statement: &str) -> Result<u64> {
    let n: i64 = sql.query_one(statement, &[]).await?.get(0);
    Ok(n as u64)
}

fn kafka_error(message: String) -> Error {
    Error::Kafka {
        message,
        transient: true,
    }
}
