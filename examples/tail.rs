//! Prints the records of Kafka topics from the beginning: key, headers and value, one line each.
//! Used by `examples/demo.sh` to show events arriving; handy against any broker.
//!
//!     cargo run --example tail -- --brokers 127.0.0.1:9092 --topic outbox.Order --count 10

use std::time::{Duration, Instant};

use clap::Parser;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "127.0.0.1:9092")]
    brokers: String,
    /// Topic to read (repeatable).
    #[arg(long, required = true)]
    topic: Vec<String>,
    /// Stop after this many records.
    #[arg(long, default_value_t = 10)]
    count: usize,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 60)]
    timeout_secs: u64,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        .set("group.id", "outboxd-tail")
        .set("enable.auto.commit", "false")
        .set("session.timeout.ms", "6000")
        .create()?;
    let deadline = Instant::now() + Duration::from_secs(args.timeout_secs);
    let mut assignment = TopicPartitionList::new();
    for topic in &args.topic {
        // outboxd creates the topic with its first event: wait for it to exist.
        loop {
            let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
            let partitions: Vec<i32> = metadata
                .topics()
                .iter()
                .filter(|t| t.error().is_none())
                .flat_map(|t| t.partitions().iter().map(|p| p.id()))
                .collect();
            if !partitions.is_empty() {
                for partition in partitions {
                    assignment.add_partition_offset(topic, partition, Offset::Beginning)?;
                }
                break;
            }
            if Instant::now() > deadline {
                return Err(
                    format!("topic {topic} did not appear within {}s", args.timeout_secs).into(),
                );
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    consumer.assign(&assignment)?;
    let mut seen = 0;
    while seen < args.count {
        if Instant::now() > deadline {
            return Err(format!(
                "only {seen} of {} records arrived within {}s",
                args.count, args.timeout_secs
            )
            .into());
        }
        let Some(message) = consumer.poll(Duration::from_millis(500)) else {
            continue;
        };
        let message = message?;
        let headers: Vec<String> = message
            .headers()
            .map(|h| {
                h.iter()
                    .map(|x| {
                        format!(
                            "{}={}",
                            x.key,
                            String::from_utf8_lossy(x.value.unwrap_or_default())
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        println!(
            "{}[{}]@{} key={} {} value={}",
            message.topic(),
            message.partition(),
            message.offset(),
            String::from_utf8_lossy(message.key().unwrap_or_default()),
            headers.join(" "),
            String::from_utf8_lossy(message.payload().unwrap_or_default())
        );
        seen += 1;
    }
    Ok(())
}
