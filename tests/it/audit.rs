//! `outboxd audit` against Apache Kafka: each test makes the broker lose or gain data in one way and checks
//! that the audit finds exactly that (the event ids in `--details`, the JSON counts, the exit code), and,
//! where events are missing, that `--heal` and a run of outboxd leave nothing missing.
//!
//! - A clean topic audits clean; records deleted from a partition (the admin API's DeleteRecords) are
//!   missing, exactly those, and a record without an event id is unexplained; `--heal` brings them back,
//!   marked `outboxd-replay`, and the next audit is clean (a healed event is not reordered).
//! - Records written by hand: two events of one aggregate in reverse order (reordered), a copy on another
//!   partition than its key hashes to (misplaced and duplicated), a row marked published that no record
//!   holds (missing), and one marked published before the topic's retention whose partition lost no
//!   record (missing, not expired).
//! - A topic deleted (and then created again, empty) while outboxd was stopped: every event published
//!   before is missing, not expired (retention.ms is the default 7 days); `--heal` brings them back and the
//!   next audit is clean.
//! - A topic whose `retention.ms` was shortened below its records' age: the broker deletes them and the
//!   audit counts them expired, not missing (exit code 0), and `--heal` hands none back.
//! - A duplicate burst from a crash loop (records produced again with their key, partition and headers):
//!   duplicated and extra copies counted, exit code 0, and 1 with `--fail-on-duplicates`.
//! - Records of another producer, one with an event id no row has and one with none: unexplained, with
//!   the right sub-counts, their partitions and offsets in `--details`, nothing missing.

use std::collections::BTreeMap;
use std::time::Duration;

use rdkafka::admin::{
    AdminClient, AdminOptions, AlterConfig, NewTopic, ResourceSpecifier, TopicReplication,
};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{
    BaseRecord, DefaultProducerContext, FutureProducer, FutureRecord, Producer, ThreadedProducer,
};
use rdkafka::types::RDKafkaRespErr;
use rdkafka::{Offset, TopicPartitionList};

use crate::support::*;

fn audit(url: &str, brokers: &str, details: &std::path::Path) -> (i32, serde_json::Value) {
    audit_with(url, brokers, details, &[])
}

/// `outboxd audit --json --details DETAILS` with `extra` flags: its exit code and its JSON.
fn audit_with(
    url: &str,
    brokers: &str,
    details: &std::path::Path,
    extra: &[&str],
) -> (i32, serde_json::Value) {
    let mut args = vec![
        "audit",
        "--database-url",
        url,
        "--brokers",
        brokers,
        "--json",
        "--details",
        details.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    let output = run_outboxd(&args);
    let json = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "audit printed no JSON ({e}): {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output.status.code().unwrap_or(-1), json)
}

/// Every finding in a `--details` file.
fn details_of(details: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(details)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
        .collect()
}

/// The event ids of the findings of `kind` in a `--details` file.
fn findings(details: &std::path::Path, kind: &str) -> Vec<String> {
    details_of(details)
        .into_iter()
        .filter(|finding| finding["kind"] == kind)
        .map(|finding| finding["event_id"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// [`findings`], sorted.
fn sorted_findings(details: &std::path::Path, kind: &str) -> Vec<String> {
    let mut ids = findings(details, kind);
    ids.sort();
    ids
}

/// The event ids of `events`, sorted.
fn ids_of(events: &[Inserted]) -> Vec<String> {
    let mut ids: Vec<String> = events.iter().map(|e| e.event_id.to_string()).collect();
    ids.sort();
    ids
}

/// `outboxd audit --heal --json`: its exit code and its JSON.
fn heal(url: &str, brokers: &str) -> (i32, serde_json::Value) {
    let output = run_outboxd(&[
        "audit",
        "--database-url",
        url,
        "--brokers",
        brokers,
        "--json",
        "--heal",
    ]);
    let json = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "audit --heal printed no JSON ({e}): {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output.status.code().unwrap_or(-1), json)
}

/// A consumer of no group (nothing is committed) for watermarks and reading partitions back.
fn plain_consumer(brokers: &str) -> BaseConsumer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "audit-test")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap()
}

/// (low, high) watermarks of each of `partitions` partitions of [`TOPIC`].
fn watermarks(consumer: &BaseConsumer, partitions: i32) -> Vec<(i64, i64)> {
    (0..partitions)
        .map(|p| {
            consumer
                .fetch_watermarks(TOPIC, p, Duration::from_secs(10))
                .unwrap()
        })
        .collect()
}

/// Every record [`TOPIC`]'s `partition` holds, first offset to the end.
fn records_of(brokers: &str, partition: i32) -> Vec<Record> {
    let consumer = plain_consumer(brokers);
    let (low, high) = consumer
        .fetch_watermarks(TOPIC, partition, Duration::from_secs(10))
        .unwrap();
    let mut records: Vec<Record> = Vec::new();
    if high <= low {
        return records;
    }
    let mut assignment = TopicPartitionList::new();
    assignment
        .add_partition_offset(TOPIC, partition, Offset::Offset(low))
        .unwrap();
    consumer.assign(&assignment).unwrap();
    while records.last().is_none_or(|r| r.offset + 1 < high) {
        let Some(message) = consumer.poll(Duration::from_secs(10)) else {
            panic!("partition {partition} ended before offset {high}");
        };
        records.push(Record::of(&message.unwrap()));
    }
    records
}

/// The leader of each partition of [`TOPIC`] (-1: none yet), as the brokers' metadata says; `None` when the
/// topic does not exist.
fn topic_leaders(brokers: &str) -> Option<Vec<i32>> {
    let admin = admin(brokers);
    let metadata = admin
        .inner()
        .fetch_metadata(Some(TOPIC), Duration::from_secs(10))
        .unwrap();
    let topic = metadata.topics().iter().find(|t| t.name() == TOPIC)?;
    match topic.error() {
        Some(RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART) => None,
        Some(_) => Some(Vec::new()),
        None => Some(topic.partitions().iter().map(|p| p.leader()).collect()),
    }
}

/// Writes one record to [`TOPIC`] as another producer would; returns its partition and offset.
async fn produce(
    producer: &FutureProducer,
    key: Option<&str>,
    payload: Option<&[u8]>,
    partition: Option<i32>,
    headers: &[(&str, &str)],
) -> (i32, i64) {
    let mut owned = OwnedHeaders::new();
    for (key, value) in headers {
        owned = owned.insert(Header {
            key,
            value: Some(value.as_bytes()),
        });
    }
    let mut record = FutureRecord::<str, [u8]>::to(TOPIC).headers(owned);
    record.key = key;
    record.payload = payload;
    record.partition = partition;
    let delivery = producer
        .send(record, Duration::from_secs(10))
        .await
        .unwrap_or_else(|(e, _)| panic!("cannot produce to {TOPIC}: {e}"));
    (delivery.partition, delivery.offset)
}

fn future_producer(brokers: &str) -> FutureProducer {
    ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .unwrap()
}

/// Publishes `txns` transactions of 3 events over 6 aggregates through outboxd, then stops it; returns the
/// events.
async fn publish_then_stop(
    client: &mut tokio_postgres::Client,
    url: &str,
    brokers: &str,
    txns: usize,
) -> Vec<Inserted> {
    let mut outboxd = Outboxd::spawn(&run_args(url, brokers));
    wait_slot_active(client, "outboxd").await;
    let (committed, _) = insert_events(client, 0, txns, 3, 6, None).await;
    wait_all_published(client, Duration::from_secs(60)).await;
    outboxd.kill();
    committed
}

#[tokio::test(flavor = "multi_thread")]
async fn audit_finds_exactly_the_deleted_records_and_a_foreign_one() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    let mut outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_slot_active(&client, "outboxd").await;
    let (committed, _) = insert_events(&mut client, 0, 20, 3, 12, None).await;
    wait_all_published(&client, Duration::from_secs(60)).await;
    outboxd.kill();
    let scratch = scratch_dir("audit");
    let details = scratch.join("details.jsonl");

    let (code, clean) = audit(&url, &brokers, &details);
    assert_eq!(code, 0, "a clean audit: {clean}");
    assert_eq!(clean["checked"], committed.len() as u64, "{clean}");
    // With message.max.bytes raised for large events (doctor's advice) above the audit's fetch size.
    let (code, large) = audit_with(
        &url,
        &brokers,
        &details,
        &["--kafka-option=message.max.bytes=10000000"],
    );
    assert_eq!(code, 0, "{large}");
    assert_eq!(large["present"], committed.len() as u64, "{large}");
    assert_eq!(clean["present"], committed.len() as u64, "{clean}");
    assert_eq!(clean["missing"], 0, "{clean}");

    // The first half of partition 0 deleted, as DeleteRecords (or a broker losing data) does.
    let config = {
        let mut config = ClientConfig::new();
        config.set("bootstrap.servers", &brokers);
        config
    };
    let consumer: BaseConsumer = config
        .clone()
        .set("group.id", "audit-test")
        .create()
        .unwrap();
    let (_, high) = consumer
        .fetch_watermarks(TOPIC, 0, Duration::from_secs(10))
        .unwrap();
    assert!(high >= 2, "partition 0 holds records to delete ({high})");
    let cut = high / 2;
    let mut deleted = Vec::new();
    let mut assignment = TopicPartitionList::new();
    assignment
        .add_partition_offset(TOPIC, 0, Offset::Beginning)
        .unwrap();
    consumer.assign(&assignment).unwrap();
    while deleted.len() < cut as usize {
        let Some(message) = consumer.poll(Duration::from_secs(10)) else {
            panic!("partition 0 ended before offset {cut}");
        };
        let message = message.unwrap();
        use rdkafka::message::{Headers, Message};
        let id = message
            .headers()
            .and_then(|h| h.iter().find(|h| h.key == "event_id"))
            .and_then(|h| h.value)
            .map(|v| String::from_utf8_lossy(v).into_owned())
            .expect("outboxd's records carry event_id");
        deleted.push(id);
    }
    let admin: AdminClient<DefaultClientContext> = config.create().unwrap();
    let mut up_to = TopicPartitionList::new();
    up_to
        .add_partition_offset(TOPIC, 0, Offset::Offset(cut))
        .unwrap();
    admin
        .delete_records(&up_to, &AdminOptions::new())
        .await
        .unwrap();
    // A record another producer wrote: no event id header.
    let producer: ThreadedProducer<DefaultProducerContext> = config.create().unwrap();
    producer
        .send(BaseRecord::to(TOPIC).key("stranger").payload("{}"))
        .unwrap();
    producer.flush(Duration::from_secs(10)).unwrap();

    let (code, found) = audit(&url, &brokers, &details);
    assert_eq!(code, 1, "findings: {found}");
    assert_eq!(found["missing"], cut as u64, "{found}");
    assert_eq!(found["unexplained_without_id"], 1, "{found}");
    assert_eq!(found["expired"], 0, "deleted, not expired: {found}");
    let mut missing = findings(&details, "missing");
    missing.sort();
    deleted.sort();
    assert_eq!(missing, deleted, "exactly the deleted records are missing");
    println!(
        "audit: {} events checked, {} records deleted and found missing",
        found["checked"], cut
    );

    // --heal hands them back to the polling path; outboxd publishes them again and nothing is missing.
    let output = run_outboxd(&[
        "audit",
        "--database-url",
        &url,
        "--brokers",
        &brokers,
        "--json",
        "--heal",
    ]);
    let healed: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(healed["healed"], cut as u64, "{healed}");
    assert_eq!(
        unpublished(&client).await,
        cut,
        "the healed rows wait for the polling path"
    );
    let outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_all_published(&client, Duration::from_secs(60)).await;
    drop(outboxd);
    let (code, after) = audit(&url, &brokers, &details);
    assert_eq!(after["missing"], 0, "{after}");
    assert_eq!(after["present"], after["checked"], "{after}");
    assert_eq!(
        after["replayed"], cut as u64,
        "the healed records carry outboxd-replay: {after}"
    );
    assert_eq!(
        after["reordered"], 0,
        "a healed record (after its aggregate's later events by design) is not reordered: {after}"
    );
    assert_eq!(
        (code, &after["unexplained_without_id"]),
        (1, &serde_json::json!(1)),
        "healed, only the stranger's record is left: {after}"
    );
}

/// Records written by hand next to outboxd's: two events of one aggregate in the reverse of their insert
/// order (reordered), a copy of an event on the wrong partition (misplaced and duplicated), and an event
/// whose row says published but that no topic holds (missing); the rest of the topic audits clean.
#[tokio::test(flavor = "multi_thread")]
async fn audit_names_reordered_misplaced_and_duplicated_events() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    let mut outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_slot_active(&client, "outboxd").await;
    insert_events(&mut client, 0, 5, 2, 4, None).await;
    wait_all_published(&client, Duration::from_secs(60)).await;
    outboxd.kill();

    // Rows outboxd never saw, marked published (as a bug or a hand-made mark would).
    let ids: Vec<uuid::Uuid> = client
        .query(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT gen_random_uuid(), 'Order', 'by-hand', 'Step' || n, '{}',
                    CASE WHEN n = 5 THEN now() - interval '8 days' ELSE now() END
             FROM generate_series(1, 5) AS n ORDER BY n
             RETURNING event_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    // The last one is older than the topic's retention (7 days), but the broker removed nothing from its
    // partition: missing, not expired.
    let (first, second, misplaced, missing, old) = (ids[0], ids[1], ids[2], ids[3], ids[4]);
    let partitions = 6;
    let home = java_partition(b"by-hand", partitions);
    let elsewhere = (home + 1) % partitions;
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &brokers);
    let producer: ThreadedProducer<DefaultProducerContext> = config.create().unwrap();
    let send = |id: uuid::Uuid, partition: i32| {
        let id = id.to_string();
        let headers = rdkafka::message::OwnedHeaders::new().insert(rdkafka::message::Header {
            key: "event_id",
            value: Some(id.as_bytes()),
        });
        producer
            .send(
                BaseRecord::to(TOPIC)
                    .key("by-hand")
                    .payload("{}")
                    .partition(partition)
                    .headers(headers),
            )
            .unwrap();
        producer.flush(Duration::from_secs(10)).unwrap();
    };
    send(second, home);
    send(first, home);
    send(misplaced, home);
    send(misplaced, elsewhere);
    // A replay's copy of the missing event (`outboxd-replay: replay-...`) does not make up for the loss: live
    // consumers never had it in its place.
    let id = missing.to_string();
    let headers = rdkafka::message::OwnedHeaders::new()
        .insert(rdkafka::message::Header {
            key: "event_id",
            value: Some(id.as_bytes()),
        })
        .insert(rdkafka::message::Header {
            key: "outboxd-replay",
            value: Some("replay-20261207T000000Z-abcdef".as_bytes()),
        });
    producer
        .send(
            BaseRecord::to(TOPIC)
                .key("by-hand")
                .payload("{}")
                .partition(home)
                .headers(headers),
        )
        .unwrap();
    producer.flush(Duration::from_secs(10)).unwrap();

    let details = scratch_dir("audit").join("details.jsonl");
    let (code, found) = audit(&url, &brokers, &details);
    assert_eq!(code, 1, "findings: {found}");
    assert_eq!(
        findings(&details, "reordered"),
        vec![first.to_string()],
        "{found}"
    );
    assert_eq!(
        findings(&details, "misplaced"),
        vec![misplaced.to_string()],
        "{found}"
    );
    assert_eq!(
        findings(&details, "duplicated"),
        vec![misplaced.to_string()],
        "{found}"
    );
    assert_eq!(
        sorted_findings(&details, "missing"),
        {
            let mut both = vec![missing.to_string(), old.to_string()];
            both.sort();
            both
        },
        "{found}"
    );
    assert_eq!(found["expired"], 0, "{found}");
    assert_eq!(found["unexplained_without_id"], 0, "{found}");
    assert_eq!(found["unexplained_foreign"], 0, "{found}");
}

/// The topic deleted and created again (empty, with as many partitions) while outboxd was stopped: every
/// event published before is missing (retention.ms is the default 7 days: not expired), exactly those, both
/// while the topic is gone and once it is back; `--heal` and a run of outboxd publish them again.
#[tokio::test(flavor = "multi_thread")]
async fn a_topic_deleted_and_created_again_loses_every_earlier_event_until_healed() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    // 2,502 events: the missing ones come back in more than two fetches of findings.
    let committed = publish_then_stop(&mut client, &url, &brokers, 834).await;
    let n = committed.len() as u64;
    assert!(n > 2_000);
    let details = scratch_dir("audit").join("details.jsonl");
    let (code, clean) = audit(&url, &brokers, &details);
    assert_eq!(code, 0, "a clean audit before the deletion: {clean}");
    assert_eq!(clean["present"], n, "{clean}");

    let partitions = topic_leaders(&brokers)
        .expect("outboxd created the topic")
        .len();
    assert!(partitions > 0, "the topic has partitions");
    let results = admin(&brokers)
        .delete_topics(&[TOPIC], &AdminOptions::new())
        .await
        .expect("cannot delete topic");
    for result in results {
        result.expect("cannot delete topic");
    }
    wait_for("the topic to be deleted", Duration::from_secs(60), || {
        topic_leaders(&brokers).is_none().then_some(())
    });

    // While it is gone: the audit still audits, and finds every event missing.
    let (code, gone) = audit(&url, &brokers, &details);
    assert_eq!(code, 1, "findings while the topic is gone: {gone}");
    assert_eq!(gone["checked"], n, "{gone}");
    assert_eq!(gone["missing"], n, "{gone}");
    assert_eq!(gone["expired"], 0, "{gone}");
    assert_eq!(gone["present"], 0, "{gone}");
    assert_eq!(gone["records"], 0, "{gone}");
    assert_eq!(sorted_findings(&details, "missing"), ids_of(&committed));

    create_topic(
        &brokers,
        NewTopic::new(TOPIC, partitions as i32, TopicReplication::Fixed(1)),
    )
    .await;
    wait_for(
        "the topic created again to have a leader for each partition",
        Duration::from_secs(60),
        || {
            topic_leaders(&brokers)
                .filter(|leaders| leaders.len() == partitions && leaders.iter().all(|&l| l >= 0))
        },
    );

    let (code, found) = audit(&url, &brokers, &details);
    assert_eq!(code, 1, "findings: {found}");
    assert_eq!(found["checked"], n, "{found}");
    assert_eq!(found["missing"], n, "{found}");
    assert_eq!(
        found["expired"], 0,
        "deleted with the topic, not expired: {found}"
    );
    assert_eq!(found["present"], 0, "{found}");
    assert_eq!(
        found["records"], 0,
        "the topic created again is empty: {found}"
    );
    assert_eq!(found["unexplained_without_id"], 0, "{found}");
    assert_eq!(found["unexplained_foreign"], 0, "{found}");
    assert_eq!(
        sorted_findings(&details, "missing"),
        ids_of(&committed),
        "exactly the events published before the deletion are missing"
    );
    assert_eq!(
        details_of(&details).len(),
        committed.len(),
        "no other finding"
    );

    let (code, healed) = heal(&url, &brokers);
    assert_eq!(code, 1, "the heal's own audit found them missing: {healed}");
    assert_eq!(healed["healed"], n, "{healed}");
    assert_eq!(
        unpublished(&client).await,
        n as i64,
        "the healed rows wait for the polling path"
    );
    let mut outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_all_published(&client, Duration::from_secs(60)).await;
    outboxd.kill();
    let (code, after) = audit(&url, &brokers, &details);
    assert_eq!(after["checked"], n, "{after}");
    assert_eq!(after["missing"], 0, "{after}");
    assert_eq!(after["present"], after["checked"], "{after}");
    assert!(findings(&details, "missing").is_empty(), "{after}");
    assert_eq!(
        after["replayed"], n,
        "every healed record carries outboxd-replay: {after}"
    );
    assert_eq!(code, 0, "healed, the audit is clean: {after}");
}

/// `retention.ms` shortened below the age of the topic's records: the broker deletes them (its retention
/// check runs every 200 ms on this broker) and the audit counts them expired, not missing: exit code 0, and
/// `--heal` hands none of them back. (An event that old whose partition lost no record is missing, not
/// expired: `audit_names_reordered_misplaced_and_duplicated_events`.)
#[tokio::test(flavor = "multi_thread")]
async fn records_deleted_by_a_shortened_retention_are_expired_not_missing() {
    let pg = Postgres::start();
    let broker = Broker::start_with_properties(&[
        "log.retention.check.interval.ms=200",
        "log.initial.task.delay.ms=0",
    ]);
    migrate(&pg);
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    let committed = publish_then_stop(&mut client, &url, &brokers, 10).await;
    let n = committed.len() as u64;
    let partitions = topic_leaders(&brokers)
        .expect("outboxd created the topic")
        .len() as i32;
    let consumer = plain_consumer(&brokers);
    let before = watermarks(&consumer, partitions);
    assert_eq!(
        before.iter().map(|(low, high)| high - low).sum::<i64>(),
        committed.len() as i64,
        "the topic holds every event once: {before:?}"
    );

    // The records are older than the retention about to be set (their timestamps come before published_at):
    // the broker may delete them as soon as it is set, and by the audit's rule they are past retention.
    let retention_ms = 1000_i64;
    wait_for_async(
        "every event to be older than the retention",
        Duration::from_secs(30),
        || async {
            let row = client
                .query_one(
                    "SELECT max(published_at) < now() - $1::int8 * interval '1 millisecond' FROM outbox_event",
                    &[&retention_ms],
                )
                .await
                .unwrap();
            row.get::<_, bool>(0).then_some(())
        },
    )
    .await;
    let retention = retention_ms.to_string();
    let alter = AlterConfig::new(ResourceSpecifier::Topic(TOPIC)).set("retention.ms", &retention);
    for result in admin(&brokers)
        .alter_configs([&alter], &AdminOptions::new())
        .await
        .expect("cannot alter the topic's config")
    {
        result.expect("cannot alter the topic's config");
    }
    wait_for(
        "retention to delete every record (each partition's low watermark at its old end)",
        Duration::from_secs(60),
        || {
            let now = watermarks(&consumer, partitions);
            now.iter()
                .zip(&before)
                .all(|(&(low, _), &(_, old_high))| low >= old_high)
                .then_some(())
        },
    );

    let details = scratch_dir("audit").join("details.jsonl");
    let (code, found) = audit(&url, &brokers, &details);
    assert_eq!(code, 0, "expired events are no finding: {found}");
    assert_eq!(found["checked"], n, "{found}");
    assert_eq!(found["expired"], n, "{found}");
    assert_eq!(
        found["missing"], 0,
        "deleted by retention, not missing: {found}"
    );
    assert_eq!(found["present"], 0, "{found}");
    assert_eq!(found["records"], 0, "{found}");
    assert_eq!(sorted_findings(&details, "expired"), ids_of(&committed));
    assert_eq!(
        details_of(&details).len(),
        committed.len(),
        "no other finding"
    );

    // Expired events are the topic's retention at work: --heal hands none of them back.
    let (code, healed) = heal(&url, &brokers);
    assert_eq!(code, 0, "{healed}");
    assert_eq!(healed["expired"], n, "{healed}");
    assert_eq!(healed["healed"], 0, "{healed}");
    assert_eq!(unpublished(&client).await, 0, "no row was handed back");
}

/// A replayed event's age is its first publication, not the replay's. Events published two hours ago, whose
/// records a one-hour retention removed, are replayed to the live topic: the polling path marks their rows
/// published again (now), yet the audit still counts them expired (by the first publication the table of
/// replayed events keeps), not missing, and `--heal` hands none back. By the rows' own `published_at` they
/// would be an hour too young for retention to have taken them.
#[tokio::test(flavor = "multi_thread")]
async fn events_replayed_after_retention_removed_them_are_expired_by_their_first_publication() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    let committed = publish_then_stop(&mut client, &url, &brokers, 10).await;
    let n = committed.len() as u64;
    client
        .execute(
            "UPDATE outbox_event SET published_at = published_at - interval '2 hours'",
            &[],
        )
        .await
        .unwrap();
    let alter = AlterConfig::new(ResourceSpecifier::Topic(TOPIC)).set("retention.ms", "3600000");
    for result in admin(&brokers)
        .alter_configs([&alter], &AdminOptions::new())
        .await
        .expect("cannot alter the topic's config")
    {
        result.expect("cannot alter the topic's config");
    }
    // What that retention did to records that old: removed them (DeleteRecords up to each partition's end).
    let partitions = topic_leaders(&brokers)
        .expect("outboxd created the topic")
        .len() as i32;
    let consumer = plain_consumer(&brokers);
    let mut up_to = TopicPartitionList::new();
    for (partition, (_, high)) in watermarks(&consumer, partitions).into_iter().enumerate() {
        up_to
            .add_partition_offset(TOPIC, partition as i32, Offset::Offset(high))
            .unwrap();
    }
    admin(&brokers)
        .delete_records(&up_to, &AdminOptions::new())
        .await
        .expect("cannot delete records");
    let details = scratch_dir("audit").join("details.jsonl");
    let (code, before) = audit(&url, &brokers, &details);
    assert_eq!(code, 0, "{before}");
    assert_eq!(before["expired"], n, "{before}");

    // A consumer team replays them to the live topic.
    let outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_slot_active(&client, "outboxd").await;
    let output = run_outboxd_async(&[
        "replay",
        "--database-url",
        &url,
        "--published",
        "--aggregate-type",
        "Order",
    ])
    .await;
    drop(outboxd);
    assert!(output.status.success(), "{}", stderr_of(&output));
    let republished: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox_event WHERE published_at > now() - interval '1 hour'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        republished, n as i64,
        "the rows are marked published again, now"
    );

    let (code, after) = audit(&url, &brokers, &details);
    assert_eq!(after["replayed"], n, "{after}");
    assert_eq!(
        after["expired"], n,
        "expired by their first publication: {after}"
    );
    assert_eq!(after["missing"], 0, "{after}");
    assert_eq!(code, 0, "{after}");
    assert_eq!(sorted_findings(&details, "expired"), ids_of(&committed));
    let (code, healed) = heal(&url, &brokers);
    assert_eq!(code, 0, "{healed}");
    assert_eq!(healed["healed"], 0, "{healed}");
}

/// A crash loop: a producer that crashed before its acknowledgements were recorded sends the same records
/// again (same key, partition, payload and headers), twice for the first half of the burst. The audit counts
/// each such event duplicated once and every copy past the first, exits 0 (consumers dedupe by event id),
/// and exits 1 with `--fail-on-duplicates`.
#[tokio::test(flavor = "multi_thread")]
async fn a_duplicate_burst_from_a_crash_loop_is_counted_and_fails_only_when_asked() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    let committed = publish_then_stop(&mut client, &url, &brokers, 10).await;
    let n = committed.len() as u64;
    let partitions = topic_leaders(&brokers)
        .expect("outboxd created the topic")
        .len() as i32;
    let consumer = plain_consumer(&brokers);
    let fullest = watermarks(&consumer, partitions)
        .iter()
        .enumerate()
        .max_by_key(|(_, (low, high))| high - low)
        .map(|(partition, _)| partition as i32)
        .unwrap();
    let burst: Vec<Record> = records_of(&brokers, fullest).into_iter().take(6).collect();
    assert!(
        burst.len() >= 4,
        "partition {fullest} holds a burst: {}",
        burst.len()
    );
    let again = burst.len() / 2;

    let producer = future_producer(&brokers);
    for record in burst.iter().chain(&burst[..again]) {
        let headers: Vec<(&str, &str)> = record
            .headers
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        assert!(
            record.headers.contains_key("event_id"),
            "{:?}",
            record.headers
        );
        let (partition, _) = produce(
            &producer,
            record.key.as_deref(),
            record.value.as_deref(),
            Some(record.partition),
            &headers,
        )
        .await;
        assert_eq!(partition, fullest);
    }
    let copies: BTreeMap<String, String> = burst
        .iter()
        .enumerate()
        .map(|(i, record)| {
            let copies = if i < again { 3 } else { 2 };
            (
                record.headers["event_id"].clone(),
                format!("{copies} copies"),
            )
        })
        .collect();

    let details = scratch_dir("audit").join("details.jsonl");
    let (code, found) = audit(&url, &brokers, &details);
    assert_eq!(code, 0, "duplicates alone do not fail the audit: {found}");
    assert_eq!(found["duplicated"], burst.len() as u64, "{found}");
    assert_eq!(
        found["extra_copies"],
        (burst.len() + again) as u64,
        "{found}"
    );
    assert_eq!(found["checked"], n, "{found}");
    assert_eq!(found["present"], n, "{found}");
    assert_eq!(found["missing"], 0, "{found}");
    assert_eq!(
        found["misplaced"], 0,
        "copies on their own partition: {found}"
    );
    assert_eq!(
        found["reordered"], 0,
        "each event's first copy is in order: {found}"
    );
    assert_eq!(found["unexplained_without_id"], 0, "{found}");
    assert_eq!(found["unexplained_foreign"], 0, "{found}");
    assert_eq!(
        found["records"],
        n + (burst.len() + again) as u64,
        "{found}"
    );
    let named: BTreeMap<String, String> = details_of(&details)
        .iter()
        .map(|finding| {
            assert_eq!(finding["kind"], "duplicated", "no other finding: {finding}");
            (
                finding["event_id"].as_str().unwrap().to_string(),
                finding["detail"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        named, copies,
        "exactly the resent events, with their copies"
    );

    let (code, strict) = audit_with(&url, &brokers, &details, &["--fail-on-duplicates"]);
    assert_eq!(code, 1, "--fail-on-duplicates: {strict}");
    assert_eq!(strict["duplicated"], burst.len() as u64, "{strict}");
    assert_eq!(strict["exit_code"], 1, "{strict}");
}

/// Records another producer wrote next to outboxd's: one with an event id (a uuid header) that no row has,
/// one with no event id at all. Both are unexplained, each in its own sub-count, named by partition and
/// offset in `--details`; nothing is missing.
#[tokio::test(flavor = "multi_thread")]
async fn records_of_another_producer_are_unexplained_by_kind_and_nothing_is_missing() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    let committed = publish_then_stop(&mut client, &url, &brokers, 10).await;
    let n = committed.len() as u64;
    let partitions = topic_leaders(&brokers)
        .expect("outboxd created the topic")
        .len() as i32;

    let producer = future_producer(&brokers);
    let foreign = uuid::Uuid::new_v4();
    // Keyed like one of outboxd's aggregates and on its partition: only the event id tells it apart.
    let aggregate = &committed[0].aggregate_id;
    let with_id = produce(
        &producer,
        Some(aggregate),
        Some(b"{}"),
        Some(java_partition(aggregate.as_bytes(), partitions)),
        &[("event_id", &foreign.to_string())],
    )
    .await;
    let without_id = produce(&producer, Some("stranger"), Some(b"{}"), None, &[]).await;

    let details = scratch_dir("audit").join("details.jsonl");
    let (code, found) = audit(&url, &brokers, &details);
    assert_eq!(code, 1, "unexplained records are findings: {found}");
    assert_eq!(found["unexplained_foreign"], 1, "{found}");
    assert_eq!(found["unexplained_without_id"], 1, "{found}");
    assert_eq!(found["unexplained_deleted"], 0, "{found}");
    assert_eq!(found["checked"], n, "{found}");
    assert_eq!(found["present"], n, "{found}");
    assert_eq!(found["missing"], 0, "{found}");
    assert_eq!(found["expired"], 0, "{found}");
    assert_eq!(found["duplicated"], 0, "{found}");
    assert_eq!(found["misplaced"], 0, "{found}");
    assert_eq!(found["reordered"], 0, "{found}");
    assert_eq!(found["records"], n + 2, "{found}");
    let mut named: Vec<(String, i64, i64)> = details_of(&details)
        .iter()
        .map(|finding| {
            assert_eq!(
                finding["kind"], "unexplained",
                "no other finding: {finding}"
            );
            (
                finding["event_id"].as_str().unwrap_or_default().to_string(),
                finding["partition"].as_i64().unwrap(),
                finding["offset"].as_i64().unwrap(),
            )
        })
        .collect();
    named.sort();
    let mut expected = vec![
        (foreign.to_string(), i64::from(with_id.0), with_id.1),
        (String::new(), i64::from(without_id.0), without_id.1),
    ];
    expected.sort();
    assert_eq!(named, expected, "exactly the two foreign records");
}

/// `run --audit-interval`: each audit checks the events created in the interval before the settling time,
/// and exports what it found. Events created a minute ago (their `created_at` set so) audit clean; events
/// whose records were deleted make `outboxd_audit_missing_events` and `outboxd_audit_findings` rise.
#[tokio::test(flavor = "multi_thread")]
async fn run_with_an_audit_interval_exports_clean_audits_and_then_the_missing_events() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    let (_outboxd, metrics_addr) =
        spawn_serving_metrics(&url, &brokers, &["--audit-interval", "10s"]);
    wait_slot_active(&client, "outboxd").await;
    let scrape = |metric: &'static str, labels: &'static str| {
        let addr = metrics_addr.clone();
        move || {
            http_get(&addr, "/metrics").and_then(|(_, text)| metric_value(&text, metric, labels))
        }
    };
    assert_eq!(
        scrape("outboxd_audit_findings", "")(),
        Some(0.0),
        "exported from start-up on"
    );
    // One event per second of creation time, from 55 to 15 s ago: the audit windows (10 s, ending 60 s before
    // each audit) of the next half minute hold some.
    let spread = |prefix: &str| {
        format!(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, created_at)
             SELECT gen_random_uuid(), 'Order', '{prefix}' || n, 'Step', '{{}}', now() - make_interval(secs => 55 - n)
             FROM generate_series(0, 40) AS n ORDER BY n"
        )
    };
    client.execute(&spread("audited-"), &[]).await.unwrap();
    wait_all_published(&client, Duration::from_secs(60)).await;
    let checked = wait_for(
        "a clean audit of published events",
        Duration::from_secs(90),
        || {
            let clean = scrape("outboxd_audit_runs_total", "result=\"clean\"")()?;
            let checked = scrape("outboxd_audit_checked_events", "")()?;
            (clean >= 1.0 && checked > 0.0).then_some(checked)
        },
    );
    assert!(
        scrape("outboxd_audit_last_clean_timestamp_seconds", "")().unwrap_or_default() > 0.0,
        "the end of the clean range is exported"
    );
    assert_eq!(scrape("outboxd_audit_missing_events", "")(), Some(0.0));

    // More events, published, then every record of the topic deleted (DeleteRecords up to each partition's
    // end): the audits whose window holds the new events find them missing.
    client.execute(&spread("lost-"), &[]).await.unwrap();
    wait_all_published(&client, Duration::from_secs(60)).await;
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("group.id", "audit-test")
        .create()
        .unwrap();
    let mut up_to = TopicPartitionList::new();
    for partition in 0..6 {
        let (_, high) = consumer
            .fetch_watermarks(TOPIC, partition, Duration::from_secs(10))
            .unwrap();
        up_to
            .add_partition_offset(TOPIC, partition, Offset::Offset(high))
            .unwrap();
    }
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .unwrap();
    admin
        .delete_records(&up_to, &AdminOptions::new())
        .await
        .unwrap();
    let missing = wait_for(
        "an audit that finds the missing events",
        Duration::from_secs(90),
        || {
            let missing = scrape("outboxd_audit_missing_events", "")()?;
            let findings = scrape("outboxd_audit_findings", "")()?;
            let runs = scrape("outboxd_audit_runs_total", "result=\"findings\"")()?;
            (missing > 0.0 && findings >= missing && runs >= 1.0).then_some(missing)
        },
    );
    println!("a clean audit checked {checked} events; a later one found {missing} missing");
}

/// An event published longer ago than the topic's retention is expired only where its partition no longer
/// holds anything as old: here the partition lost a prefix (DeleteRecords), but its first record left is older
/// than the event, so the event's absence is a loss (missing), not retention at work.
#[tokio::test(flavor = "multi_thread")]
async fn an_old_event_whose_partition_still_holds_older_records_is_missing_not_expired() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    let mut outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_slot_active(&client, "outboxd").await;
    insert_events(&mut client, 0, 4, 3, 4, None).await;
    wait_all_published(&client, Duration::from_secs(60)).await;
    outboxd.kill();

    let key = "old-order";
    let partition = java_partition(key.as_bytes(), 6);
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", &brokers);
    // A record ten days old (its CreateTime), then everything before it deleted: it is the partition's
    // first record left.
    let producer: ThreadedProducer<DefaultProducerContext> = config.create().unwrap();
    let ten_days_ago = std::time::SystemTime::now() - Duration::from_secs(10 * 86_400);
    let millis = ten_days_ago
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64;
    producer
        .send(
            BaseRecord::to(TOPIC)
                .key("someone-else")
                .payload("{}")
                .partition(partition)
                .timestamp(millis),
        )
        .unwrap();
    producer.flush(Duration::from_secs(10)).unwrap();
    let consumer: BaseConsumer = config
        .clone()
        .set("group.id", "audit-test")
        .create()
        .unwrap();
    let (_, high) = consumer
        .fetch_watermarks(TOPIC, partition, Duration::from_secs(10))
        .unwrap();
    let mut up_to = TopicPartitionList::new();
    up_to
        .add_partition_offset(TOPIC, partition, Offset::Offset(high - 1))
        .unwrap();
    let admin: AdminClient<DefaultClientContext> = config.create().unwrap();
    admin
        .delete_records(&up_to, &AdminOptions::new())
        .await
        .unwrap();
    // An event of that partition marked published eight days ago (beyond the default seven days'
    // retention) that no record holds.
    let old: uuid::Uuid = client
        .query_one(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, published_at)
             VALUES (gen_random_uuid(), 'Order', $1, 'Step', '{}', now() - interval '8 days')
             RETURNING event_id",
            &[&key],
        )
        .await
        .unwrap()
        .get(0);

    let details = scratch_dir("audit").join("details.jsonl");
    let (code, found) = audit(&url, &brokers, &details);
    assert_eq!(code, 1, "{found}");
    assert!(
        findings(&details, "missing").contains(&old.to_string()),
        "{found}"
    );
    assert!(
        !findings(&details, "expired").contains(&old.to_string()),
        "{found}"
    );
}
