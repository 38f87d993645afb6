//! `outboxd audit` against Apache Kafka: a clean topic audits clean; records deleted from a partition (the
//! admin API's DeleteRecords) are found missing, exactly those; a record another producer wrote is named as
//! unexplained.

use std::time::Duration;

use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::producer::{BaseRecord, DefaultProducerContext, Producer, ThreadedProducer};
use rdkafka::{Offset, TopicPartitionList};

use crate::support::*;

fn audit(url: &str, brokers: &str, details: &std::path::Path) -> (i32, serde_json::Value) {
    let output = run_outboxd(&[
        "audit",
        "--database-url",
        url,
        "--brokers",
        brokers,
        "--json",
        "--details",
        details.to_str().unwrap(),
    ]);
    let json = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "audit printed no JSON ({e}): {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output.status.code().unwrap_or(-1), json)
}

/// The event ids of the findings of `kind` in a `--details` file.
fn findings(details: &std::path::Path, kind: &str) -> Vec<String> {
    std::fs::read_to_string(details)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
        .filter(|finding| finding["kind"] == kind)
        .map(|finding| finding["event_id"].as_str().unwrap_or_default().to_string())
        .collect()
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
    let (_, after) = audit(&url, &brokers, &details);
    assert_eq!(after["missing"], 0, "{after}");
    assert_eq!(after["present"], after["checked"], "{after}");
    println!(
        "after --heal: 0 missing, {} reordered (a healed event comes after its aggregate's later ones)",
        after["reordered"]
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
             SELECT gen_random_uuid(), 'Order', 'by-hand', 'Step' || n, '{}', now()
             FROM generate_series(1, 4) AS n ORDER BY n
             RETURNING event_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    let (first, second, misplaced, missing) = (ids[0], ids[1], ids[2], ids[3]);
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
        findings(&details, "missing"),
        vec![missing.to_string()],
        "{found}"
    );
    assert_eq!(found["unexplained_without_id"], 0, "{found}");
    assert_eq!(found["unexplained_foreign"], 0, "{found}");
}
