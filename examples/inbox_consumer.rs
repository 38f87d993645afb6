//! An inventory consumer of the outbox topics, as the pattern prescribes: it reads with `read_committed`
//! (so, with `--delivery exactly-once`, never a record of an aborted Kafka transaction), applies each event's
//! effect and its inbox row (`consumed_event`, see `outboxd::inbox`) in one PostgreSQL transaction, and commits
//! its Kafka offset only after that transaction committed. A duplicate delivery (outboxd at least once, or
//! this consumer killed between its database commit and its offset commit) finds the inbox row and skips the
//! effect: each effect is applied once.
//!
//!     cargo run --example inbox_consumer -- --brokers 127.0.0.1:9092 \
//!         --database-url postgres://app@localhost/app --topic outbox.Order --group inventory
//!
//! The effect here is a row in `inventory_effect` per event (created if missing, no unique key: an effect
//! applied twice would show as two rows). It exits after `--idle-exit-secs` without a record, printing what
//! it applied and how many duplicates the inbox absorbed.

use std::time::{Duration, Instant};

use clap::Parser;
use outboxd::inbox::{Consumed, Inbox};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::message::{Headers, Message};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "127.0.0.1:9092")]
    brokers: String,
    /// PostgreSQL URL of the consumer's database (it holds the inbox and the effect).
    #[arg(long)]
    database_url: String,
    /// Topic to read (repeatable).
    #[arg(long, required = true)]
    topic: Vec<String>,
    /// Consumer group (its committed offsets are where a restarted consumer resumes).
    #[arg(long, default_value = "inventory")]
    group: String,
    /// Exit after this many seconds without a record.
    #[arg(long, default_value_t = 10)]
    idle_exit_secs: u64,
}

fn event_id_of(message: &impl Message) -> Option<uuid::Uuid> {
    let headers = message.headers()?;
    headers
        .iter()
        .find(|h| h.key == "event_id" || h.key == "id")
        .and_then(|h| std::str::from_utf8(h.value?).ok()?.parse().ok())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let (mut client, connection) =
        tokio_postgres::connect(&args.database_url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS inventory_effect (
                 event_id uuid NOT NULL, aggregate_id text, applied_at timestamptz NOT NULL DEFAULT now())",
        )
        .await?;
    let inbox = Inbox::new(&args.group);
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        .set("group.id", &args.group)
        .set("enable.auto.commit", "false")
        .set("auto.offset.reset", "earliest")
        .set("isolation.level", "read_committed")
        .set("session.timeout.ms", "6000")
        .create()?;
    let topics: Vec<&str> = args.topic.iter().map(String::as_str).collect();
    consumer.subscribe(&topics)?;
    let (mut applied, mut duplicates) = (0u64, 0u64);
    let mut last_record = Instant::now();
    while last_record.elapsed() < Duration::from_secs(args.idle_exit_secs) {
        let Some(message) = consumer.poll(Duration::from_millis(200)) else {
            continue;
        };
        let message = message?;
        last_record = Instant::now();
        let Some(event_id) = event_id_of(&message) else {
            eprintln!(
                "skipping a record without an event_id header at {}/{}",
                message.partition(),
                message.offset()
            );
            consumer.commit_message(&message, CommitMode::Sync)?;
            continue;
        };
        let aggregate_id = message
            .key()
            .map(|k| String::from_utf8_lossy(k).into_owned());
        // The effect and the inbox row commit together, or neither does.
        let tx = client.transaction().await?;
        match inbox.record(&tx, event_id).await? {
            Consumed::Applied => {
                tx.execute(
                    "INSERT INTO inventory_effect (event_id, aggregate_id) VALUES ($1, $2)",
                    &[&event_id, &aggregate_id],
                )
                .await?;
                applied += 1;
            }
            Consumed::Duplicate => duplicates += 1,
            // Only with `Inbox::with_retention` and `record_created_at`: an event older than the inbox keeps.
            Consumed::BeyondRetention => {
                eprintln!(
                    "event {event_id} is older than the inbox's retention: not applied, reported"
                );
            }
        }
        tx.commit().await?;
        // Only now: a crash before this line re-delivers the record, and the inbox absorbs it.
        consumer.commit_message(&message, CommitMode::Sync)?;
    }
    println!("{{\"applied\": {applied}, \"duplicates\": {duplicates}}}");
    Ok(())
}
