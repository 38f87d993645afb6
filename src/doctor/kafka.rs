//! The Kafka half of `outboxd doctor`: the brokers accept outboxd (the check `run` makes), and each existing
//! topic outboxd writes to takes what outboxd sends: record batches up to the producer's `batch.size`, the
//! largest event waiting in the backlog, acknowledgements from enough replicas; Kafka transactions where
//! `--delivery exactly-once` needs them. Reads only (the transactions check uses an id of its own).

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
use rdkafka::config::FromClientConfigAndContext;

use super::report::{Finding, Outcome};
use crate::config::RunSettings;
use crate::kafka::secrets::RedactingContext;

/// How long each broker request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// librdkafka's default `batch.size`: the most one record batch (of one partition) holds.
const DEFAULT_BATCH_SIZE: i64 = 1_000_000;

/// What the backlog says about the events still to send, for the topic checks.
#[derive(Debug, Clone, Copy, Default)]
pub struct Waiting {
    /// The largest payload among the unpublished events (bytes, as text); `None`: none, or not read.
    pub largest_payload: Option<i64>,
    /// Age of the oldest unpublished event (seconds).
    pub oldest_age_seconds: Option<f64>,
}

/// Every Kafka check, in order: the brokers, transactions where needed, ACLs, each existing topic.
pub async fn examine(settings: &RunSettings, waiting: Waiting) -> Vec<Finding> {
    let mut findings = Vec::new();
    match crate::kafka::startup::check_brokers(settings, Duration::from_secs(5)).await {
        Ok(()) => findings.push(Finding::ok(
            "kafka.brokers",
            format!("{} answered and accepted outboxd", settings.kafka.brokers),
        )),
        Err(error) => {
            findings.push(Finding::of_error("kafka.brokers", &error));
            return findings;
        }
    }
    if settings.kafka.exactly_once.is_some() {
        findings.push(
            match crate::kafka::check_transactions(settings, REQUEST_TIMEOUT).await {
                Ok(()) => Finding::ok(
                    "kafka.transactions",
                    "the brokers let outboxd use Kafka transactions",
                ),
                Err(error) => Finding::of_error("kafka.transactions", &error),
            },
        );
    }
    findings.push(Finding::with_fix(
        "kafka.acls",
        Outcome::Note,
        "not checked: outboxd's Kafka client cannot describe ACLs; a missing permission shows at start-up or as TOPIC_AUTHORIZATION_FAILED in the log",
        "grant outboxd's principal WRITE and DESCRIBE on its topics (and CREATE, unless --no-create-topics)",
    ));
    findings.push(record_size(settings, waiting));
    match topics(settings, waiting).await {
        Ok(topic_findings) => findings.extend(topic_findings),
        Err(detail) => findings.push(Finding {
            check: "kafka.topics".into(),
            outcome: Outcome::Unknown,
            detail: format!("could not check: {detail}"),
            fix: None,
        }),
    }
    findings
}

/// librdkafka's default `message.max.bytes`: it refuses a larger record itself, before any broker sees it.
const DEFAULT_MESSAGE_MAX_BYTES: i64 = 1_000_000;
/// What a record carries besides its payload (key, headers, framing), as a margin for the size checks.
const RECORD_OVERHEAD: i64 = 1024;

/// The last value `--kafka-option` gives `property`, as a number.
fn numeric_option(settings: &RunSettings, property: &str) -> Option<i64> {
    settings
        .kafka
        .options
        .iter()
        .rev()
        .find(|(key, _)| key == property)
        .and_then(|(_, value)| value.trim().parse().ok())
}

/// The largest event waiting against the producer's own limit (`message.max.bytes`), whatever its topic.
fn record_size(settings: &RunSettings, waiting: Waiting) -> Finding {
    let check = "kafka.record_size";
    let limit = numeric_option(settings, "message.max.bytes").unwrap_or(DEFAULT_MESSAGE_MAX_BYTES);
    match waiting.largest_payload {
        Some(largest) if largest + RECORD_OVERHEAD > limit => Finding::with_fix(
            check,
            Outcome::Failed,
            format!("an event of {largest} bytes waits in the backlog, and outboxd's producer refuses records over message.max.bytes = {limit} (key and headers included): it will be dead-lettered"),
            format!("--kafka-option message.max.bytes={} (and a topic max.message.bytes at least as large)", largest + 2 * RECORD_OVERHEAD),
        ),
        Some(largest) => Finding::ok(check, format!("the largest waiting event ({largest} bytes) is within the producer's message.max.bytes = {limit}")),
        None => Finding::ok(check, format!("no event waits; the producer takes records up to message.max.bytes = {limit}")),
    }
}

/// One finding per existing topic outboxd writes to (by `--topic` and `--dead-letter-topic`); topics not
/// there yet are created by outboxd with `--topic-replication-factor`.
async fn topics(settings: &RunSettings, waiting: Waiting) -> Result<Vec<Finding>, String> {
    let config = crate::kafka::client_config(settings);
    let admin =
        AdminClient::from_config_and_context(&config, RedactingContext::for_config(&config))
            .map_err(|e| e.to_string())?;
    let metadata =
        tokio::task::block_in_place(|| admin.inner().fetch_metadata(None, REQUEST_TIMEOUT))
            .map_err(|e| format!("the brokers' metadata: {e}"))?;
    let dead_letter_topic = settings.poll.dead_letter_topic.as_deref();
    let progress_topic = settings
        .kafka
        .exactly_once
        .as_ref()
        .map(|e| e.progress_topic.as_str());
    let ours: Vec<(String, Replication)> = metadata
        .topics()
        .iter()
        .filter(|topic| {
            Some(topic.name()) == dead_letter_topic
                // Kafka's own topics (`__consumer_offsets`) and outboxd's progress topic are never events'.
                || !topic.name().starts_with('_') && Some(topic.name()) != progress_topic
                && settings
                    .database
                    .tables
                    .iter()
                    .any(|table| settings.topic.could_render(&table.name, topic.name()))
        })
        .map(|topic| {
            let partitions = topic.partitions();
            let count = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
            let replication = Replication {
                replicas: count(partitions.first().map_or(0, |p| p.replicas().len())),
                fewest_in_sync: count(partitions.iter().map(|p| p.isr().len()).min().unwrap_or(0)),
                under_replicated: partitions
                    .iter()
                    .filter(|p| p.isr().len() < p.replicas().len())
                    .count(),
                leaderless: partitions.iter().filter(|p| p.leader() < 0).count(),
            };
            (topic.name().to_string(), replication)
        })
        .collect();
    let mut findings = Vec::new();
    if !settings.kafka.create_topics {
        let literal = settings.topic.is_literal().then(|| {
            settings
                .database
                .tables
                .iter()
                .map(|table| settings.topic.render(&table.name, "", ""))
                .collect::<Vec<_>>()
        });
        let needed = literal
            .into_iter()
            .flatten()
            .chain(dead_letter_topic.map(String::from));
        for topic in needed {
            if !ours.iter().any(|(name, _)| *name == topic) {
                findings.push(Finding::with_fix(
                    format!("kafka.topic {topic}"),
                    Outcome::Failed,
                    format!("topic {topic} does not exist, and --no-create-topics keeps outboxd from creating it: its events would wait"),
                    format!("create it (kafka-topics --create --topic {topic} ...), or drop --no-create-topics"),
                ));
            }
        }
    }
    if ours.is_empty() {
        findings.push(Finding::ok(
            "kafka.topics",
            if settings.kafka.create_topics {
                "no topic of --topic exists yet: outboxd creates them as events arrive"
            } else {
                "no topic of --topic exists yet (with --no-create-topics, each must exist before its first event)"
            },
        ));
        return Ok(findings);
    }
    let specifiers: Vec<ResourceSpecifier> = ours
        .iter()
        .map(|(name, _)| ResourceSpecifier::Topic(name))
        .collect();
    let described = admin
        .describe_configs(
            &specifiers,
            &AdminOptions::new().request_timeout(Some(REQUEST_TIMEOUT)),
        )
        .await
        .map_err(|e| format!("describing the topics: {e}"))?;
    let batch_size = numeric_option(settings, "batch.size").unwrap_or(DEFAULT_BATCH_SIZE);
    for ((name, replication), result) in ours.iter().zip(described) {
        let check = format!("kafka.topic {name}");
        let resource = match result {
            Ok(resource) => resource,
            Err(error) => {
                findings.push(Finding {
                    check,
                    outcome: Outcome::Unknown,
                    detail: format!("could not describe it: {error}"),
                    fix: None,
                });
                continue;
            }
        };
        let setting = |key: &str| -> Option<i64> {
            resource
                .get(key)
                .and_then(|entry| entry.value.as_deref())
                .and_then(|value| value.parse().ok())
        };
        let topic = TopicFacts {
            replication: *replication,
            min_insync_replicas: setting("min.insync.replicas").unwrap_or(1),
            max_message_bytes: setting("max.message.bytes"),
            retention_ms: setting("retention.ms"),
        };
        findings.push(judge_topic(
            check,
            name,
            &topic,
            batch_size,
            waiting,
            settings.topic.is_literal(),
        ));
    }
    Ok(findings)
}

/// A topic's replicas as the brokers' metadata shows them now.
#[derive(Debug, Clone, Copy)]
struct Replication {
    /// Replicas per partition (the first partition's).
    replicas: i64,
    /// The fewest in-sync replicas of any partition.
    fewest_in_sync: i64,
    /// Partitions with fewer in-sync replicas than replicas.
    under_replicated: usize,
    /// Partitions without a leader.
    leaderless: usize,
}

/// A topic's settings and state that decide whether it takes outboxd's records.
#[derive(Debug, Clone, Copy)]
struct TopicFacts {
    replication: Replication,
    min_insync_replicas: i64,
    max_message_bytes: Option<i64>,
    retention_ms: Option<i64>,
}

/// The worst of what a topic's settings mean for outboxd's records. Pure. `one_topic`: every event goes to
/// this topic (a literal `--topic`), so the backlog's largest event surely does.
fn judge_topic(
    check: String,
    name: &str,
    topic: &TopicFacts,
    batch_size: i64,
    waiting: Waiting,
    one_topic: bool,
) -> Finding {
    let TopicFacts {
        replication,
        min_insync_replicas: min_insync,
        ..
    } = *topic;
    let replicas = replication.replicas;
    if min_insync > replicas {
        return Finding::with_fix(
            check,
            Outcome::Failed,
            format!("min.insync.replicas = {min_insync} but the topic has {replicas} replicas: the brokers refuse every write with acks=all (NOT_ENOUGH_REPLICAS)"),
            format!("kafka-configs --alter --entity-type topics --entity-name {name} --add-config min.insync.replicas={replicas} (or add replicas)"),
        );
    }
    let describe = format!("kafka-topics --describe --topic {name} --under-replicated-partitions (and --unavailable-partitions)");
    if replication.leaderless > 0 {
        return Finding::with_fix(
            check,
            Outcome::Failed,
            format!(
                "{} partitions of {name} have no leader: their events wait until one is elected",
                replication.leaderless
            ),
            format!("bring the brokers holding their replicas back; {describe} lists them"),
        );
    }
    if replication.fewest_in_sync < min_insync {
        return Finding::with_fix(
            check,
            Outcome::Failed,
            format!("a partition of {name} has {} in-sync replicas, below min.insync.replicas = {min_insync}: the brokers refuse its writes (NOT_ENOUGH_REPLICAS) until replicas catch up", replication.fewest_in_sync),
            format!("bring the missing brokers back; {describe} lists the partitions"),
        );
    }
    if replication.under_replicated > 0 {
        return Finding::with_fix(
            check,
            Outcome::Warning,
            format!("{} partitions of {name} have fewer in-sync replicas than their {replicas} (a broker down or behind): writes go on, one more loss may stop them", replication.under_replicated),
            format!("bring the missing brokers back; {describe} lists the partitions"),
        );
    }
    if let (Some(max), Some(largest)) = (topic.max_message_bytes, waiting.largest_payload) {
        if largest > max {
            return Finding::with_fix(
                check,
                if one_topic { Outcome::Failed } else { Outcome::Warning },
                format!("an event of {largest} bytes waits in the backlog, and {name} takes records of at most {max} bytes (max.message.bytes): {} refused for good (dead-lettered)", if one_topic { "it will be" } else { "if it goes to this topic, it will be" }),
                format!("kafka-configs --alter --entity-type topics --entity-name {name} --add-config max.message.bytes={}", largest + 1024),
            );
        }
    }
    if let Some(max) = topic.max_message_bytes.filter(|max| *max < batch_size) {
        return Finding::with_fix(
            check,
            Outcome::Warning,
            format!("max.message.bytes = {max} is below the producer's batch.size = {batch_size}: a full batch of small events is refused (MSG_SIZE_TOO_LARGE) and retried"),
            format!("--kafka-option batch.size={max}, or raise the topic's max.message.bytes"),
        );
    }
    if let (Some(retention), Some(age)) = (topic.retention_ms, waiting.oldest_age_seconds) {
        if retention >= 0 && age * 1000.0 > retention as f64 {
            return Finding::with_fix(
                check,
                Outcome::Warning,
                format!("the oldest unpublished event has waited {age:.0} s, longer than {name} keeps records (retention.ms = {retention}): a consumer as far behind as outboxd is would find records deleted before it read them"),
                format!("raise retention.ms of {name}, or let outboxd catch up (outboxd status)"),
            );
        }
    }
    if replicas > 1 && min_insync == replicas {
        return Finding::with_fix(
            check,
            Outcome::Warning,
            format!("min.insync.replicas = {min_insync} = its {replicas} replicas: one broker down stops every write"),
            format!("kafka-configs --alter --entity-type topics --entity-name {name} --add-config min.insync.replicas={}", replicas - 1),
        );
    }
    let detail = format!(
        "{replicas} replicas, min.insync.replicas = {min_insync}, max.message.bytes = {}, retention.ms = {}",
        topic.max_message_bytes.map_or("?".into(), |v| v.to_string()),
        topic.retention_ms.map_or("?".into(), |v| v.to_string()),
    );
    if replicas == 1 {
        return Finding::with_fix(
            check,
            Outcome::Note,
            format!("{detail}: one broker's loss loses its records"),
            "for production, topics of 3 replicas with min.insync.replicas = 2 (--topic-replication-factor 3 for topics outboxd creates)",
        );
    }
    Finding::ok(check, detail)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(replicas: i64, min_insync: i64, max: i64) -> TopicFacts {
        TopicFacts {
            replication: Replication {
                replicas,
                fewest_in_sync: replicas,
                under_replicated: 0,
                leaderless: 0,
            },
            min_insync_replicas: min_insync,
            max_message_bytes: Some(max),
            retention_ms: Some(604_800_000),
        }
    }

    fn judge(topic: TopicFacts, waiting: Waiting) -> Outcome {
        judge_topic(
            "kafka.topic t".into(),
            "t",
            &topic,
            DEFAULT_BATCH_SIZE,
            waiting,
            true,
        )
        .outcome
    }

    #[test]
    fn topic_settings_that_refuse_outboxds_records_fail_and_risky_ones_warn() {
        let none = Waiting::default();
        assert_eq!(judge(facts(3, 2, 1_048_588), none), Outcome::Ok);
        assert_eq!(judge(facts(1, 2, 1_048_588), none), Outcome::Failed);
        assert_eq!(judge(facts(3, 3, 1_048_588), none), Outcome::Warning);
        assert_eq!(judge(facts(1, 1, 1_048_588), none), Outcome::Note);
        // A broker down: one partition short of a replica, then below min.insync.replicas, then leaderless.
        let mut down = facts(3, 2, 1_048_588);
        down.replication.under_replicated = 1;
        down.replication.fewest_in_sync = 2;
        assert_eq!(judge(down, none), Outcome::Warning);
        down.replication.fewest_in_sync = 1;
        assert_eq!(judge(down, none), Outcome::Failed);
        down.replication.leaderless = 1;
        assert_eq!(judge(down, none), Outcome::Failed);
        assert_eq!(
            judge(facts(3, 2, 500_000), none),
            Outcome::Warning,
            "batch.size"
        );
        let large = Waiting {
            largest_payload: Some(2_000_000),
            oldest_age_seconds: None,
        };
        assert_eq!(judge(facts(3, 2, 1_048_588), large), Outcome::Failed);
        let old = Waiting {
            largest_payload: None,
            oldest_age_seconds: Some(700_000.0),
        };
        assert_eq!(judge(facts(3, 2, 1_048_588), old), Outcome::Warning);
    }
}
