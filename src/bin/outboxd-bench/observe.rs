//! What a user sees from outside outboxd: a Kafka consumer timing each event from its transaction's commit to
//! its arrival, a sampler timing the slot's confirmation, and the number of records a topic holds. Owns no
//! load and no outboxd process (that is `scenarios`); the figures are computed by the pure functions at the
//! bottom.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use outboxd::lsn::Lsn;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};

use crate::stack::BenchResult;

/// One transaction of the load generator: its number (in each event's payload as `txn`), when its COMMIT
/// returned to the writer, and a WAL position at or after its commit record (read right after the commit).
#[derive(Debug, Clone, Copy)]
pub struct Commit {
    pub txn: i32,
    pub at: SystemTime,
    pub wal_after: Lsn,
}

/// An event read back from Kafka: its transaction, its index in it, and when the consumer received it.
#[derive(Debug, Clone, Copy)]
pub struct Arrival {
    pub txn: i32,
    pub index: i32,
    pub at: SystemTime,
}

/// Records of `topic` now: the sum of its partitions' high watermarks.
pub fn topic_end(brokers: &str, topic: &str) -> BenchResult<i64> {
    Ok(partition_ends(&consumer(brokers)?, topic)?
        .iter()
        .map(|(_, high)| high)
        .sum())
}

/// A `read_committed` consumer (librdkafka's default, said here) that asks again every 10 ms at most: the
/// broker does not end a fetch waiting for data when a transaction marker arrives, so with the default
/// `fetch.wait.max.ms` (500 ms) exactly-once records would look up to half a second later than they are
/// readable.
fn consumer(brokers: &str) -> BenchResult<BaseConsumer> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", "outboxd-bench")
        .set("enable.auto.commit", "false")
        .set("isolation.level", "read_committed")
        .set("fetch.wait.max.ms", "10")
        .create()?)
}

fn partition_ends(consumer: &BaseConsumer, topic: &str) -> BenchResult<Vec<(i32, i64)>> {
    let metadata = consumer.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    let partitions: Vec<i32> = metadata
        .topics()
        .iter()
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    partitions
        .into_iter()
        .map(|p| {
            let (_, high) = consumer.fetch_watermarks(topic, p, Duration::from_secs(10))?;
            Ok((p, high))
        })
        .collect()
}

/// A consumer reading `topic` from its current end on a thread of its own, noting when each event of the
/// load generator arrives.
pub struct ArrivalConsumer {
    expected: Arc<AtomicUsize>,
    give_up: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<BenchResult<Vec<Arrival>>>,
}

impl ArrivalConsumer {
    /// Starts reading; returns once every partition is assigned at its current end.
    pub fn start(brokers: &str, topic: &str) -> BenchResult<Self> {
        let consumer = consumer(brokers)?;
        let mut assignment = TopicPartitionList::new();
        for (partition, end) in partition_ends(&consumer, topic)? {
            assignment.add_partition_offset(topic, partition, Offset::Offset(end))?;
        }
        consumer.assign(&assignment)?;
        let expected = Arc::new(AtomicUsize::new(usize::MAX));
        let give_up = Arc::new(AtomicBool::new(false));
        let (until, stop) = (expected.clone(), give_up.clone());
        let thread = std::thread::spawn(move || {
            let mut arrivals = Vec::new();
            while arrivals.len() < until.load(Ordering::Relaxed) && !stop.load(Ordering::Relaxed) {
                let Some(message) = consumer.poll(Duration::from_millis(100)) else {
                    continue;
                };
                let at = SystemTime::now();
                let message = message?;
                if let Some((txn, index)) = message.payload().and_then(load_identity) {
                    arrivals.push(Arrival { txn, index, at });
                }
            }
            Ok(arrivals)
        });
        Ok(ArrivalConsumer {
            expected,
            give_up,
            thread,
        })
    }

    /// Waits until `expected` events arrived (copies count) or `timeout` passed; returns what arrived.
    pub async fn finish(self, expected: usize, timeout: Duration) -> BenchResult<Vec<Arrival>> {
        self.expected.store(expected, Ordering::Relaxed);
        let deadline = Instant::now() + timeout;
        while !self.thread.is_finished() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.give_up.store(true, Ordering::Relaxed);
        self.thread
            .join()
            .map_err(|_| "the arrival consumer panicked")?
    }
}

/// `txn` and `i` of a load-generator payload.
fn load_identity(payload: &[u8]) -> Option<(i32, i32)> {
    let value: serde_json::Value = serde_json::from_slice(payload).ok()?;
    Some((
        i32::try_from(value.get("txn")?.as_i64()?).ok()?,
        i32::try_from(value.get("i")?.as_i64()?).ok()?,
    ))
}

/// Samples the slot's `confirmed_flush_lsn` every 10 ms until stopped.
pub struct ConfirmSampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<BenchResult<Vec<(SystemTime, Lsn)>>>,
}

impl ConfirmSampler {
    pub async fn start(url: &str, slot: &str) -> BenchResult<Self> {
        let (client, driver) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
        tokio::spawn(driver);
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let slot = slot.to_string();
        let task = tokio::spawn(async move {
            let query = client
                .prepare("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1")
                .await?;
            let mut samples = Vec::new();
            while !stopped.load(Ordering::Relaxed) {
                let row = client.query_opt(&query, &[&slot]).await?;
                if let Some(confirmed) = row.and_then(|r| r.get::<_, Option<String>>(0)) {
                    samples.push((SystemTime::now(), confirmed.parse()?));
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Ok(samples)
        });
        Ok(ConfirmSampler { stop, task })
    }

    pub async fn finish(self) -> BenchResult<Vec<(SystemTime, Lsn)>> {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await?
    }
}

/// What the consumer saw of the committed events.
#[derive(Debug, Default)]
pub struct Visible {
    /// Seconds from each event's commit to its first arrival.
    pub latencies: Vec<f64>,
    /// Committed events that never arrived.
    pub missing: usize,
    /// Arrivals beyond the first of an event.
    pub duplicates: usize,
}

/// Joins arrivals with the commits of `events_per_txn`-event transactions.
pub fn commit_to_visible(
    commits: &[Commit],
    arrivals: &[Arrival],
    events_per_txn: usize,
) -> Visible {
    let committed: HashMap<i32, SystemTime> = commits.iter().map(|c| (c.txn, c.at)).collect();
    let mut first: HashMap<(i32, i32), SystemTime> = HashMap::new();
    let mut visible = Visible::default();
    for arrival in arrivals {
        if !committed.contains_key(&arrival.txn) {
            continue;
        }
        match first.entry((arrival.txn, arrival.index)) {
            std::collections::hash_map::Entry::Occupied(_) => visible.duplicates += 1,
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(arrival.at);
            }
        }
    }
    visible.missing = (commits.len() * events_per_txn).saturating_sub(first.len());
    visible.latencies = first
        .iter()
        .map(|((txn, _), at)| seconds_between(committed[txn], *at))
        .collect();
    visible
}

/// Seconds from each commit until the first sample whose confirmed position reached `wal_after`; commits
/// never confirmed while sampling are left out.
pub fn commit_to_confirmed(commits: &[Commit], samples: &[(SystemTime, Lsn)]) -> Vec<f64> {
    commits
        .iter()
        .filter_map(|commit| {
            samples
                .iter()
                .find(|(at, confirmed)| *at >= commit.at && *confirmed >= commit.wal_after)
                .map(|(at, _)| seconds_between(commit.at, *at))
        })
        .collect()
}

fn seconds_between(from: SystemTime, to: SystemTime) -> f64 {
    to.duration_since(from).map_or(0.0, |d| d.as_secs_f64())
}

/// p50, p99 and p99.9 (nearest rank); NaN when there is nothing to rank.
pub fn percentiles(mut values: Vec<f64>) -> [f64; 3] {
    if values.is_empty() {
        return [f64::NAN; 3];
    }
    values.sort_by(f64::total_cmp);
    [0.5, 0.99, 0.999].map(|q| {
        let rank = ((q * values.len() as f64).ceil() as usize).clamp(1, values.len());
        values[rank - 1]
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_millis(ms)
    }

    #[test]
    fn latency_counts_first_arrivals_and_names_missing_and_duplicate_events() {
        let commits = [
            Commit {
                txn: 1,
                at: at(1_000),
                wal_after: Lsn(100),
            },
            Commit {
                txn: 2,
                at: at(2_000),
                wal_after: Lsn(200),
            },
        ];
        let arrivals = [
            Arrival {
                txn: 1,
                index: 1,
                at: at(1_010),
            },
            Arrival {
                txn: 1,
                index: 2,
                at: at(1_020),
            },
            Arrival {
                txn: 1,
                index: 1,
                at: at(1_500),
            },
            Arrival {
                txn: 2,
                index: 1,
                at: at(2_005),
            },
            // Not a measured transaction (warm-up).
            Arrival {
                txn: 9,
                index: 1,
                at: at(9_000),
            },
        ];
        let visible = commit_to_visible(&commits, &arrivals, 2);
        assert_eq!((visible.missing, visible.duplicates), (1, 1));
        let mut latencies = visible.latencies;
        latencies.sort_by(f64::total_cmp);
        assert_eq!(latencies, [0.005, 0.010, 0.020]);
    }

    #[test]
    fn a_commit_is_confirmed_at_the_first_sample_past_it() {
        let commits = [Commit {
            txn: 1,
            at: at(1_000),
            wal_after: Lsn(150),
        }];
        let samples = [
            (at(900), Lsn(500)),
            (at(1_010), Lsn(140)),
            (at(1_030), Lsn(150)),
        ];
        assert_eq!(commit_to_confirmed(&commits, &samples), [0.030]);
    }

    #[test]
    fn percentiles_by_nearest_rank() {
        let values: Vec<f64> = (1..=1000).map(f64::from).collect();
        assert_eq!(percentiles(values), [500.0, 990.0, 999.0]);
        assert!(percentiles(Vec::new())[0].is_nan());
    }
}
