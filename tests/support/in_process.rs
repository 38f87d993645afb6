//! outboxd's pipeline in this process, publishing into an in-memory broker (`outboxd::sink::memory`)
//! whose faults the test sets; and what reached that broker, checked like a Kafka topic.

use std::collections::HashMap;

use clap::Parser;
use outboxd::config::{Cli, Command};
use outboxd::sink::memory::{Fault, MemoryBroker};
use outboxd::sink::Rejection;
use tokio::sync::watch;

use super::*;

/// outboxd's pipeline running in this process, publishing into a [`MemoryBroker`].
pub struct InProcess {
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<outboxd::Result<()>>,
}

impl InProcess {
    pub fn start(pg: &Postgres, broker: &MemoryBroker, extra: &[&str]) -> Self {
        let url = pg.url();
        let mut argv = vec![
            "outboxd",
            "run",
            "--database-url",
            &url,
            "--brokers",
            "in-memory",
            "--status-interval",
            "200ms",
            "--poll-interval",
            "100ms",
        ];
        argv.extend_from_slice(extra);
        let Command::Run(options) = Cli::try_parse_from(argv).expect("arguments").command else {
            panic!("not a run command");
        };
        let settings = options.run().expect("valid settings");
        let (stop, shutdown) = watch::channel(false);
        let task = tokio::spawn(outboxd::pipeline::run_with(
            settings,
            broker.clone(),
            shutdown,
        ));
        InProcess { stop, task }
    }

    /// Stops it (SIGTERM's way) and returns how it ended.
    pub async fn stop(self) -> outboxd::Result<()> {
        let _ = self.stop.send(true);
        self.task.await.expect("the pipeline task panicked")
    }

    /// Stops it (SIGTERM's way); fails the test unless it ended within `bound`.
    pub async fn stop_within(self, bound: std::time::Duration) -> outboxd::Result<()> {
        let _ = self.stop.send(true);
        self.ended_within(bound).await
    }

    /// How it ended by itself (without being stopped); fails the test unless it did within `bound`.
    pub async fn ended_within(self, bound: std::time::Duration) -> outboxd::Result<()> {
        match tokio::time::timeout(bound, self.task).await {
            Ok(ended) => ended.expect("the pipeline task panicked"),
            Err(_) => panic!("outboxd was still running after {bound:?}"),
        }
    }
}

/// The broker's log as Kafka records of one partition, for [`check_delivery`].
pub fn as_records(broker: &MemoryBroker, topic: &str) -> Vec<Record> {
    broker
        .records()
        .into_iter()
        .filter(|r| r.topic == topic)
        .enumerate()
        .map(|(offset, r)| Record {
            topic: r.topic,
            partition: 0,
            offset: offset as i64,
            key: Some(r.key),
            value: r.payload,
            headers: HashMap::from([("event_id".to_string(), r.event_id.to_string())]),
            timestamp: None,
        })
        .collect()
}

/// Nothing committed missing, nothing rolled back present, no aggregate out of commit order; returns the
/// duplicates.
pub fn assert_delivered(
    broker: &MemoryBroker,
    committed: &[Inserted],
    rolled_back: &[Inserted],
) -> usize {
    let report = check_delivery(&as_records(broker, TOPIC), committed, rolled_back);
    assert_eq!(report.missing, 0, "missing: {:?}", report.missing_sample);
    assert_eq!(
        report.from_rolled_back, 0,
        "events of rolled-back transactions"
    );
    assert_eq!(report.order_violations, 0, "aggregates out of commit order");
    report.duplicates
}

/// The `seq` the test wrote into an event's payload (see [`insert_events`]): known before the event exists,
/// so a fault can be set before the stream meets it.
pub fn seq_of(event: &outboxd::event::OutboxEvent) -> Option<i64> {
    let payload: serde_json::Value = serde_json::from_slice(event.payload.as_deref()?).ok()?;
    payload.get("seq")?.as_i64()
}

/// The event ids of `aggregate` in the order the broker's log first shows them (duplicates left out): the
/// order a `read_committed` reader meets them.
pub fn first_seen(broker: &MemoryBroker, aggregate: &str) -> Vec<uuid::Uuid> {
    let mut seen = Vec::new();
    for record in broker.records().into_iter().filter(|r| r.key == aggregate) {
        if !seen.contains(&record.event_id) {
            seen.push(record.event_id);
        }
    }
    seen
}

/// What Kafka says of an event larger than the topic accepts: sent alone, it is dead-lettered at once.
pub fn too_large() -> Rejection {
    Rejection {
        permanent: true,
        of_the_event: true,
        ..Rejection::transient("Broker: Message size too large".into())
    }
}

/// A refusal for good that is not of the event's bytes (as a topic's ACL, but of this event only): the
/// polling path retries it with backoff up to `--max-attempts`, so a test decides how long it holds. (A real
/// size refusal of an event sent alone is dead-lettered at once: `Rejection::of_the_event`.)
pub fn refused_for_now() -> Rejection {
    Rejection {
        permanent: true,
        ..Rejection::transient("Broker: refused (by the test)".into())
    }
}

/// While the returned flag is set, every event `refused` picks is refused at hand-over for now, in the
/// CDC session and in the polling path: it waits in the polling path, and later events of its aggregate
/// with it. Clear the flag to let it through.
pub fn refuse_at_hand_over_while(
    broker: &MemoryBroker,
    refused: impl Fn(&outboxd::event::OutboxEvent) -> bool + Send + Sync + 'static,
) -> std::sync::Arc<std::sync::atomic::AtomicBool> {
    let refusing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let flag = refusing.clone();
    broker.add_fault(
        Fault::RefuseAtHandOver(refused_for_now()),
        usize::MAX,
        move |_, event| flag.load(std::sync::atomic::Ordering::SeqCst) && refused(event),
    );
    refusing
}

/// Starts outboxd on a fresh, migrated PostgreSQL and waits until its slot streams (what is inserted from
/// then on comes through the slot).
pub async fn streaming(
    broker: &MemoryBroker,
    extra: &[&str],
) -> (Postgres, tokio_postgres::Client, InProcess) {
    let pg = Postgres::start();
    migrate(&pg);
    let client = pg.client().await;
    let outboxd = InProcess::start(&pg, broker, extra);
    wait_slot_active(&client, "outboxd").await;
    (pg, client, outboxd)
}
