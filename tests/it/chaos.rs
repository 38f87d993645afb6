//! Chaos suite. A load generator commits events continuously (100 aggregates, several events per
//! transaction, some transactions rolled back) and records what it committed, while a fault driver kills
//! outboxd at random moments, restarts the broker (sqlite storage, so records survive) and PostgreSQL
//! (`-m fast` and `-m immediate`), cuts the network between outboxd and each of them with a proxy the test
//! owns, and drops the replication slot. A verifier then reads every record back and reports loss,
//! rolled-back events, duplicates (in all and per fault), order violations, unpublished rows and slot lag,
//! as a table printed and written to `target/chaos/<profile>.md`.
//!
//! A second scenario, `broker_failover`, runs outboxd against a 3-node Apache Kafka cluster (KRaft,
//! replication factor 3, `min.insync.replicas=2`, `acks=all`, `message.timeout.ms=10000`) under the same
//! load: it SIGKILLs the leader of the busiest partition again and again (each time waiting for new leaders
//! and for outboxd to publish past the kill before starting the node again and waiting for the ISR), restarts
//! the three nodes one by one, keeps one node down longer than the message timeout, hangs the busiest
//! partition's leader (SIGSTOP, connections left open) for longer than that, and then keeps two nodes down
//! (no quorum, too few in-sync replicas: sends fail). It reports loss, rolled-back events, order violations (with an
//! example) and, per incident, duplicates (checked against the in-flight window), replication session
//! restarts and their reasons, in its own section of the same report file.
//!
//! Profiles (`OUTBOXD_CHAOS_PROFILE`): `short` (the default, run by CI with the other tests) and `full`:
//!
//! ```sh
//! OUTBOXD_CHAOS_PROFILE=full cargo test --release --test it chaos:: -- --nocapture
//! cargo test --test it chaos::broker_failover -- --nocapture     # only the cluster scenario (short profile)
//! ```
//!
//! The scenarios run one at a time. The short profile kills the busiest partition's leader 3 times and hangs
//! it 3 times, the full one 12 and 10 times.
//!
//! `OUTBOXD_CHAOS_SEED` replays a run's random choices (the seed is printed and in the report).

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::support::*;
use tokio::sync::watch;

/// Events per second the load generator offers (over all its connections).
const OFFERED_RATE: u64 = 1_200;
const AGGREGATES: usize = 100;
const EVENTS_PER_TXN: usize = 6;
/// Every this many transactions one rolls back.
const ROLLBACK_EVERY: u64 = 10;
/// Generator connections; each owns a disjoint set of aggregates, so its commit order is theirs.
const WRITERS: usize = 2;
/// `--max-in-flight-events` of outboxd: the most events one crash may duplicate.
const WINDOW: usize = 1_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    KillOutboxd,
    RestartBroker,
    RestartPostgresFast,
    RestartPostgresImmediate,
    CutPostgres,
    CutBroker,
    DropSlot,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::KillOutboxd => "SIGKILL outboxd, restart it",
            Fault::RestartBroker => "stop and restart the broker",
            Fault::RestartPostgresFast => "restart PostgreSQL -m fast",
            Fault::RestartPostgresImmediate => "restart PostgreSQL -m immediate",
            Fault::CutPostgres => "cut outboxd <-> PostgreSQL",
            Fault::CutBroker => "cut outboxd <-> broker",
            Fault::DropSlot => "drop the replication slot",
        }
    }
}

struct Profile {
    name: String,
    faults: Vec<(Fault, usize)>,
}

fn profile() -> Profile {
    let name = std::env::var("OUTBOXD_CHAOS_PROFILE").unwrap_or_else(|_| "short".into());
    let (kills, others) = match name.as_str() {
        "full" => (50, 3),
        "short" => (10, 1),
        other => panic!("OUTBOXD_CHAOS_PROFILE={other}: use short or full"),
    };
    Profile {
        name,
        faults: vec![
            (Fault::KillOutboxd, kills),
            (Fault::RestartBroker, others),
            (Fault::RestartPostgresFast, others),
            (Fault::RestartPostgresImmediate, others),
            (Fault::CutPostgres, others),
            (Fault::CutBroker, others),
            (Fault::DropSlot, 1),
        ],
    }
}

/// xorshift64*: the test's random choices, reproducible from the seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn millis(&mut self, from: u64, to: u64) -> Duration {
        Duration::from_millis(from + self.below(to - from))
    }
}

fn now_millis() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as i64
}

/// One transaction the generator ran, with what became of it.
struct Txn {
    events: Vec<Inserted>,
    outcome: Outcome,
    /// When its COMMIT (or ROLLBACK) was answered or failed, ms since the epoch.
    at: i64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Committed,
    RolledBack,
    /// COMMIT was sent but its answer was lost (the server went away): the table decides.
    InDoubt,
}

/// Inserts transactions of `EVENTS_PER_TXN` events at `rate` transactions per second on one connection,
/// over the aggregates `writer`, `writer + WRITERS`, ...; reconnects after failures. Runs until `stop`.
async fn write_load(
    url: String,
    writer: usize,
    rate: f64,
    mut stop: watch::Receiver<bool>,
) -> Vec<Txn> {
    let mut txns = Vec::new();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (writer as u64 + 1));
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0i64;
    'connect: while !*stop.borrow() {
        let mut client = match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
            Ok((client, connection)) => {
                tokio::spawn(connection);
                client
            }
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = stop.wait_for(|s| *s) => break 'connect,
            }
            let n = txns.len() as u64;
            let mut events = Vec::with_capacity(EVENTS_PER_TXN);
            for i in 0..EVENTS_PER_TXN {
                // Two or three events of one aggregate in a row inside a transaction, as an order does.
                if i % 3 == 0 || events.is_empty() {
                    let slot = rng.below((AGGREGATES / WRITERS) as u64) as usize;
                    events.push(Inserted {
                        event_id: uuid::Uuid::new_v4(),
                        aggregate_id: format!("order-{}", slot * WRITERS + writer),
                        seq,
                    });
                } else {
                    let aggregate_id = events[events.len() - 1].aggregate_id.clone();
                    events.push(Inserted {
                        event_id: uuid::Uuid::new_v4(),
                        aggregate_id,
                        seq,
                    });
                }
                seq += 1;
            }
            let rollback = n % ROLLBACK_EVERY == ROLLBACK_EVERY - 1;
            let outcome = run_txn(&mut client, &events, rollback).await;
            let broken = outcome.is_none();
            txns.push(Txn {
                events,
                outcome: outcome.unwrap_or(Outcome::InDoubt),
                at: now_millis(),
            });
            if broken {
                continue 'connect;
            }
        }
    }
    txns
}

/// Runs one transaction: `Some(outcome)` when the server answered, `None` when the connection broke (if it
/// broke before COMMIT was sent the caller's InDoubt resolves to "not committed" through the table).
async fn run_txn(
    client: &mut tokio_postgres::Client,
    events: &[Inserted],
    rollback: bool,
) -> Option<Outcome> {
    let tx = client.transaction().await.ok()?;
    let ids: Vec<uuid::Uuid> = events.iter().map(|e| e.event_id).collect();
    let aggregates: Vec<&str> = events.iter().map(|e| e.aggregate_id.as_str()).collect();
    let payloads: Vec<serde_json::Value> = events
        .iter()
        .map(|e| serde_json::json!({"order": e.aggregate_id, "seq": e.seq, "lines": [{"sku": "A-1", "qty": 2}]}))
        .collect();
    tx.execute(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
         SELECT id, 'Order', aggregate, 'OrderChanged', payload
         FROM unnest($1::uuid[], $2::text[], $3::jsonb[]) WITH ORDINALITY AS e(id, aggregate, payload, n)
         ORDER BY n",
        &[&ids, &aggregates, &payloads],
    )
    .await
    .ok()?;
    if rollback {
        tx.rollback().await.ok()?;
        Some(Outcome::RolledBack)
    } else {
        tx.commit().await.ok()?;
        Some(Outcome::Committed)
    }
}

/// Runs a blocking support call (scripts, waits) without stalling the runtime's other tasks.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

/// The scenarios of this file run one at a time: each loads the two cores on its own, and a run's figures
/// (rates, run time) are its own.
static SCENARIOS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What the generator's transactions came to, once those in doubt are resolved by the table.
struct Resolved {
    /// In commit order per writer (writers own disjoint aggregates, so per aggregate this is commit order).
    committed: Vec<Inserted>,
    rolled_back: Vec<Inserted>,
    in_doubt: usize,
    /// When each committed event's transaction committed (ms since the epoch, as the generator saw it).
    committed_at: HashMap<uuid::Uuid, i64>,
}

/// Resolves transactions whose COMMIT answer was lost: the table holds their rows or none.
async fn resolve(client: &tokio_postgres::Client, per_writer: Vec<Vec<Txn>>) -> Resolved {
    let mut resolved = Resolved {
        committed: Vec::new(),
        rolled_back: Vec::new(),
        in_doubt: 0,
        committed_at: HashMap::new(),
    };
    for txns in per_writer {
        for txn in txns {
            let outcome = match txn.outcome {
                Outcome::InDoubt => {
                    resolved.in_doubt += 1;
                    let ids: Vec<uuid::Uuid> = txn.events.iter().map(|e| e.event_id).collect();
                    let present: i64 = client
                        .query_one(
                            "SELECT count(*) FROM outbox_event WHERE event_id = ANY($1)",
                            &[&ids],
                        )
                        .await
                        .unwrap()
                        .get(0);
                    assert!(
                        present == 0 || present as usize == ids.len(),
                        "a transaction half committed"
                    );
                    if present > 0 {
                        Outcome::Committed
                    } else {
                        Outcome::RolledBack
                    }
                }
                outcome => outcome,
            };
            match outcome {
                Outcome::Committed => {
                    for event in &txn.events {
                        resolved.committed_at.insert(event.event_id, txn.at);
                    }
                    resolved.committed.extend(txn.events)
                }
                _ => resolved.rolled_back.extend(txn.events),
            }
        }
    }
    resolved
}

/// Puts `text` into `target/chaos/<profile>.md` as the section `section`, replacing that section of an
/// earlier run and keeping the other scenarios' sections. Returns the file's path.
fn write_report(profile: &str, section: &str, text: &str) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/chaos");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{profile}.md"));
    let (begin, end) = (
        format!("<!-- chaos:{section} -->"),
        format!("<!-- /chaos:{section} -->"),
    );
    let block = format!("{begin}\n\n{text}\n{end}\n");
    let current = std::fs::read_to_string(&path).unwrap_or_default();
    // A report from before sections (one table, no markers) is replaced whole.
    let current = if current.contains("<!-- chaos:") {
        current
    } else {
        String::new()
    };
    let updated = match (current.find(&begin), current.find(&end)) {
        (Some(from), Some(to)) if from < to => {
            let to = to + end.len();
            let to = to + usize::from(current[to..].starts_with('\n'));
            format!("{}{block}{}", &current[..from], &current[to..])
        }
        _ if current.is_empty() => block,
        _ => format!("{current}\n{block}"),
    };
    std::fs::write(&path, updated).unwrap();
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos() {
    let _one_scenario_at_a_time = SCENARIOS.lock().await;
    let profile = profile();
    let seed = std::env::var("OUTBOXD_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| now_millis() as u64 | 1);
    let mut rng = Rng(seed);
    let mut schedule: Vec<Fault> = profile
        .faults
        .iter()
        .flat_map(|&(fault, n)| std::iter::repeat_n(fault, n))
        .collect();
    for i in (1..schedule.len()).rev() {
        schedule.swap(i, rng.below(i as u64 + 1) as usize);
    }
    println!(
        "chaos profile {} seed {seed}: {} faults",
        profile.name,
        schedule.len()
    );

    let pg = Postgres::start();
    migrate(&pg);
    let pg_proxy = Proxy::start(Arc::new(std::sync::atomic::AtomicU16::new(pg.port)));
    let (broker, broker_proxy) = Broker::start_persistent_behind_proxy();
    let (outboxd_url, brokers) = (
        pg.url_via(pg_proxy.port),
        Broker::proxied_addr(&broker_proxy),
    );
    let window = WINDOW.to_string();
    let mut args = run_args(&outboxd_url, &brokers);
    args.extend([
        "--max-in-flight-events",
        &window,
        "--startup-timeout",
        "300s",
    ]);
    let mut outboxd = Connector::spawn(&args, &[]);
    wait_slot_active(&pg.client().await, "outboxd").await;

    let (stop_tx, stop) = watch::channel(false);
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let rate = OFFERED_RATE as f64 / EVENTS_PER_TXN as f64 / WRITERS as f64;
            tokio::spawn(write_load(pg.url(), w, rate, stop.clone()))
        })
        .collect();
    let started = Instant::now();

    // Fault driver: one fault at a time, each at a random moment, healed before the next.
    let mut fault_times: Vec<(i64, Fault)> = Vec::new();
    for fault in &schedule {
        tokio::time::sleep(rng.millis(300, 2_500)).await;
        outboxd.check();
        fault_times.push((now_millis(), *fault));
        match fault {
            Fault::KillOutboxd => {
                // A kill lands on a process that streamed (one that is still starting up, as a loaded
                // machine makes them, would take every kill: see the assertion at the end).
                let current = &outboxd.current;
                blocking(|| current.wait_streaming());
                outboxd.kill_and_restart(rng.millis(0, 1_000)).await
            }
            Fault::RestartBroker => {
                blocking(|| broker.stop());
                tokio::time::sleep(rng.millis(1_000, 4_000)).await;
                blocking(|| broker.start_again());
            }
            Fault::RestartPostgresFast => blocking(|| pg.restart("fast")),
            Fault::RestartPostgresImmediate => blocking(|| pg.restart("immediate")),
            Fault::CutPostgres => {
                pg_proxy.cut();
                tokio::time::sleep(rng.millis(1_000, 4_000)).await;
                pg_proxy.restore();
            }
            Fault::CutBroker => {
                broker_proxy.cut();
                tokio::time::sleep(rng.millis(1_000, 4_000)).await;
                broker_proxy.restore();
            }
            Fault::DropSlot => drop_slot_while_streaming(&pg).await,
        }
        println!(
            "{:>6.1}s  {}",
            started.elapsed().as_secs_f64(),
            fault.name()
        );
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_tx.send(true).unwrap();
    let mut per_writer = Vec::new();
    for writer in writers {
        per_writer.push(writer.await.unwrap());
    }
    let load_seconds = started.elapsed().as_secs_f64();

    let client = pg.client().await;
    let Resolved {
        committed,
        rolled_back,
        in_doubt,
        ..
    } = resolve(&client, per_writer).await;
    let table_rows: i64 = client
        .query_one("SELECT count(*) FROM outbox_event", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        table_rows as usize,
        committed.len(),
        "the generator's record matches the table"
    );

    // Drain: every row published, the slot confirmed up to the end of the load.
    outboxd.check();
    // Settled, not published: a dead letter is reported with the rest, then fails the run.
    wait_settled(&client, Duration::from_secs(600)).await;
    let end_of_load = current_wal_lsn(&client).await;
    wait_confirmed_past(
        &client,
        "outboxd",
        end_of_load,
        "the slot to confirm the end of the load",
    )
    .await;
    let final_lag = final_slot_lag(&client).await;
    let unpublished = unpublished(&client).await;
    let dead = dead_count(&client).await;
    let handed_off = handed_off_count(&client).await;

    let records = blocking(|| {
        consume_all(
            &brokers,
            &[TOPIC],
            committed.len(),
            Duration::from_secs(600),
        )
    });
    let report = check_delivery(&records, &committed, &rolled_back);
    let (logs, unexpected_exits) = outboxd.stop();

    // Duplicates by the fault they followed: a copy's CreateTime falls after the fault that caused it.
    let mut copies: HashMap<&str, Vec<i64>> = HashMap::new();
    for record in &records {
        if let Some(id) = record.headers.get("event_id") {
            copies
                .entry(id)
                .or_default()
                .push(record.timestamp.unwrap_or(0));
        }
    }
    let mut per_fault: BTreeMap<usize, usize> = BTreeMap::new();
    for times in copies.values_mut().filter(|t| t.len() > 1) {
        times.sort_unstable();
        for &copy in &times[1..] {
            let after = fault_times.partition_point(|(t, _)| *t <= copy);
            *per_fault.entry(after).or_default() += 1;
        }
    }
    let (worst_index, worst) = per_fault
        .iter()
        .map(|(&i, &n)| (i, n))
        .max_by_key(|&(_, n)| n)
        .unwrap_or((0, 0));
    let worst_fault = worst_index
        .checked_sub(1)
        .map_or("before any fault", |i| fault_times[i].1.name());

    let mut faults_done: BTreeMap<Fault, usize> = BTreeMap::new();
    for (_, fault) in &fault_times {
        *faults_done.entry(*fault).or_default() += 1;
    }
    let rolled_back_txns = rolled_back.len() / EVENTS_PER_TXN;
    let mut table = String::new();
    let _ = writeln!(
        table,
        "| chaos run | {} profile, seed {seed} |",
        profile.name
    );
    let _ = writeln!(table, "| --- | --- |");
    for (fault, n) in &faults_done {
        let _ = writeln!(table, "| {} | {n} |", fault.name());
    }
    let rows: Vec<(&str, String)> = vec![
        (
            "load",
            format!(
                "{:.0} s, {} events committed ({:.0}/s offered {OFFERED_RATE}/s), {} aggregates",
                load_seconds,
                committed.len(),
                committed.len() as f64 / load_seconds,
                AGGREGATES
            ),
        ),
        (
            "rolled-back transactions",
            format!(
                "{rolled_back_txns} ({} events; {in_doubt} in doubt, resolved by the table)",
                rolled_back.len()
            ),
        ),
        ("records read back", records.len().to_string()),
        ("**committed events missing**", report.missing.to_string()),
        (
            "**events from rolled-back transactions**",
            report.from_rolled_back.to_string(),
        ),
        ("duplicates", report.duplicates.to_string()),
        (
            "most duplicates after one fault",
            format!("{worst} ({worst_fault}; in-flight window {WINDOW})"),
        ),
        (
            "**per-aggregate order violations**",
            report.order_violations.to_string(),
        ),
        ("**rows without published_at**", unpublished.to_string()),
        ("dead-lettered rows", dead.to_string()),
        (
            "rows published by the sweeper (handed off)",
            handed_off.to_string(),
        ),
        (
            "outboxd exits not caused by the test",
            unexpected_exits.to_string(),
        ),
        ("final slot lag (bytes)", final_lag.to_string()),
    ];
    for (what, value) in rows {
        let _ = writeln!(table, "| {what} | {value} |");
    }
    println!("\n{table}");
    let path = write_report(&profile.name, "faults", &table);
    println!("report: {}\noutboxd logs: {}", path.display(), logs.len());

    assert_eq!(report.missing, 0, "committed events missing");
    assert_eq!(report.from_rolled_back, 0, "rolled-back events published");
    assert_eq!(report.order_violations, 0, "per-aggregate order violated");
    assert_eq!(unpublished, 0, "rows without published_at");
    assert_eq!(dead, 0, "no event here deserves a dead letter");
    assert_eq!(
        unexpected_exits, 0,
        "outboxd exited on its own; see its logs"
    );
    assert!(
        worst <= WINDOW,
        "{worst} duplicates after one fault exceed the in-flight window {WINDOW}"
    );
    // The kills must land on a streaming process, not only on start-ups (the driver waits for the current
    // process to stream before it kills it): most of the killed processes streamed.
    let kills = faults_done.get(&Fault::KillOutboxd).copied().unwrap_or(0);
    let streamed = logs
        .iter()
        .filter(|log| {
            std::fs::read_to_string(log)
                .unwrap_or_default()
                .contains("streaming from replication slot")
        })
        .count();
    assert!(
        streamed > kills / 2,
        "only {streamed} of {} outboxd processes streamed ({kills} killed)",
        logs.len()
    );
}

// ======================================================================================================
// Broker failover: outboxd against a 3-node Apache Kafka cluster (replication factor 3,
// min.insync.replicas=2, acks=all) under the same load, while the leader of the busiest partition is
// SIGKILLed again and again, all three nodes are restarted one by one, one node stays down longer than the
// producer's message.timeout.ms, the leader hangs (SIGSTOP) for longer than that, and then two nodes stay
// down (no quorum and no two in-sync replicas: sends fail).
// ======================================================================================================

/// Events per second the generator offers in the broker-failover scenario.
const FAILOVER_RATE: u64 = 1_000;
const FAILOVER_PARTITIONS: &str = "6";
/// outboxd's `message.timeout.ms` here (`--kafka-option`): librdkafka's default, 300 s, would make each long
/// outage five minutes.
const MESSAGE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long the long outages last: past the message timeout by 2 s up to one more timeout, at random, so the
/// moment the cluster takes writes again falls at a different point of librdkafka's timeouts each run.
fn outage_length(rng: &mut Rng) -> Duration {
    let timeout = MESSAGE_TIMEOUT.as_millis() as u64;
    rng.millis(timeout + 2_000, 2 * timeout)
}

/// How long outboxd may take to publish past a point once the cluster can take writes.
const PROGRESS_TIMEOUT: Duration = Duration::from_secs(180);
const CLUSTER_TIMEOUT: Duration = Duration::from_secs(180);

/// (SIGKILLs of the busiest partition's leader, hangs of it): at least 10 kills in the full profile, a few
/// in CI's short one. A hang costs no broker start, a kill one.
fn failover_counts(profile: &str) -> (usize, usize) {
    match profile {
        "full" => (12, 10),
        _ => (3, 3),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Failure {
    KillLeader,
    RollingRestart,
    OneDownPastTimeout,
    HungPastTimeout,
    TwoDownPastTimeout,
}

impl Failure {
    fn name(self) -> &'static str {
        match self {
            Failure::KillLeader => "SIGKILL the busiest partition's leader, start it again",
            Failure::RollingRestart => "rolling restart (stop, start), one node at a time",
            Failure::OneDownPastTimeout => "one node down longer than message.timeout.ms",
            Failure::HungPastTimeout => {
                "the busiest partition's leader hung (SIGSTOP) longer than message.timeout.ms"
            }
            Failure::TwoDownPastTimeout => "two nodes down longer than message.timeout.ms",
        }
    }
}

/// One injected failure: when it began, what it was, how long until the cluster was whole again.
struct Incident {
    kind: Failure,
    what: String,
    /// ms since the epoch.
    at: i64,
    /// Seconds since the load started.
    offset_secs: f64,
    began: Instant,
    back_in_sync_secs: f64,
    /// (what, seconds it took), printed as the incident heals.
    steps: Vec<(&'static str, f64)>,
    step_began: Instant,
}

impl Incident {
    fn begin(kind: Failure, what: String, load_started: Instant) -> Self {
        Incident {
            kind,
            what,
            at: now_millis(),
            offset_secs: load_started.elapsed().as_secs_f64(),
            began: Instant::now(),
            back_in_sync_secs: 0.0,
            steps: Vec::new(),
            step_began: Instant::now(),
        }
    }

    fn step(&mut self, what: &'static str) {
        self.steps
            .push((what, self.step_began.elapsed().as_secs_f64()));
        self.step_began = Instant::now();
    }

    /// The incident is over; `last` names its last step.
    fn healed(mut self, last: &'static str) -> Self {
        self.step(last);
        self.back_in_sync_secs = self.began.elapsed().as_secs_f64();
        let steps: Vec<String> = self
            .steps
            .iter()
            .map(|(what, secs)| format!("{what} +{secs:.1}s"))
            .collect();
        println!(
            "{:>6.1}s  {} (cluster in sync again after {:.1}s: {})",
            self.offset_secs,
            self.what,
            self.back_in_sync_secs,
            steps.join(", ")
        );
        self
    }
}

/// Which incident a moment (ms since the epoch) follows: 0 before the first, i for incident i - 1.
fn after_incident(incidents: &[Incident], at: i64) -> usize {
    incidents.partition_point(|i| i.at <= at)
}

/// outboxd under test; restarted, and counted, when it exits on its own; every process's log kept.
struct Connector {
    args: Vec<String>,
    env: &'static [(&'static str, &'static str)],
    current: Outboxd,
    logs: Vec<std::path::PathBuf>,
    unexpected_exits: usize,
}

impl Connector {
    /// Info-level logs: trace logging at this rate only costs CPU the cluster needs.
    const INFO_LOGS: &'static [(&'static str, &'static str)] =
        &[("RUST_LOG", "info,rdkafka=warn,tokio_postgres=warn")];

    fn spawn(args: &[&str], env: &'static [(&'static str, &'static str)]) -> Self {
        let current = Outboxd::spawn_with_env(args, env);
        Connector {
            args: args.iter().map(|a| a.to_string()).collect(),
            env,
            logs: vec![current.log.clone()],
            current,
            unexpected_exits: 0,
        }
    }

    fn respawn(&mut self) {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        self.current = Outboxd::spawn_with_env(&args, self.env);
        self.logs.push(self.current.log.clone());
    }

    /// Restarts outboxd, counting it, if it exited on its own.
    fn check(&mut self) {
        if let Some(status) = self.current.try_wait() {
            self.unexpected_exits += 1;
            eprintln!(
                "outboxd exited on its own ({status}); log {}",
                self.current.log.display()
            );
            self.respawn();
        }
    }

    /// Stops outboxd; returns every process's log and how often it exited on its own.
    fn stop(self) -> (Vec<std::path::PathBuf>, usize) {
        (self.logs, self.unexpected_exits)
    }

    /// SIGKILL, and a start again after `pause`.
    async fn kill_and_restart(&mut self, pause: Duration) {
        self.current.kill();
        tokio::time::sleep(pause).await;
        self.respawn();
    }
}

/// Waits until the slot confirmed `lsn`: every event committed before it was acknowledged by the cluster
/// and has `published_at`.
async fn wait_published_past(
    client: &tokio_postgres::Client,
    outboxd: &mut Connector,
    lsn: outboxd::lsn::Lsn,
    what: &str,
) {
    let deadline = Instant::now() + PROGRESS_TIMEOUT;
    loop {
        outboxd.check();
        let confirmed = confirmed_flush(client, "outboxd").await;
        if confirmed >= lsn {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {PROGRESS_TIMEOUT:?} waiting for {what}: the slot confirmed {confirmed}, not yet {lsn}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until `until` (the end of a broker outage: its length is the fault itself), watching outboxd.
async fn hold(outboxd: &mut Connector, until: Instant) {
    while Instant::now() < until {
        outboxd.check();
        tokio::time::sleep(Duration::from_millis(200).min(until - Instant::now())).await;
    }
}

/// A replication session that ended and was started again, from outboxd's JSON log.
struct SessionRestart {
    at: i64,
    reason: String,
}

/// outboxd's "replication session ended" lines: (sessions that ended after streaming, the restarts with their
/// reasons from "replication session ended; reconnecting").
fn session_restarts(logs: &[std::path::PathBuf]) -> (usize, Vec<SessionRestart>) {
    let mut ended = 0;
    let mut restarts = Vec::new();
    for log in logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        for line in text.lines() {
            let Ok(entry) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            let fields = &entry["fields"];
            match fields["message"].as_str() {
                Some("replication session ended") => ended += 1,
                Some("replication session ended; reconnecting") => {
                    let at = entry["timestamp"]
                        .as_str()
                        .and_then(|t| humantime::parse_rfc3339_weak(t).ok())
                        .map(|t| t.duration_since(UNIX_EPOCH).unwrap().as_millis() as i64)
                        .unwrap_or_else(|| panic!("no timestamp in outboxd's log line {line}"));
                    restarts.push(SessionRestart {
                        at,
                        reason: fields["error"].as_str().unwrap_or("?").to_string(),
                    });
                }
                _ => {}
            }
        }
    }
    (ended, restarts)
}

/// `text` with each UUID (an event id) replaced by `<id>`, so reasons that differ only in the event group.
fn without_ids(text: &str) -> String {
    text.split(' ')
        .map(|word| {
            let bare = word.trim_matches(|c: char| !c.is_ascii_alphanumeric() && c != '-');
            if uuid::Uuid::parse_str(bare).is_ok() {
                word.replace(bare, "<id>")
            } else {
                word.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// An event whose first appearance came after the first appearance of a later event of its aggregate.
struct Violation {
    aggregate: String,
    /// (seq, partition, offset, CreateTime) of the event committed earlier but first seen later.
    late: (i64, i32, i64, i64),
    /// The same of the previous first appearance of the aggregate, committed after it.
    ahead: (i64, i32, i64, i64),
}

/// The order violations `check_delivery` counts, with what each one is (same walk: first appearances in
/// partition order, each against the aggregate's previous first appearance).
fn order_violations(records: &[Record], committed: &[Inserted]) -> Vec<Violation> {
    let commit_position: HashMap<String, usize> = committed
        .iter()
        .enumerate()
        .map(|(i, e)| (e.event_id.to_string(), i))
        .collect();
    let mut ordered: Vec<&Record> = records.iter().collect();
    ordered.sort_by_key(|r| (r.topic.clone(), r.partition, r.offset));
    let mut seen = std::collections::HashSet::new();
    let mut last: HashMap<String, (usize, &Record)> = HashMap::new();
    let mut violations = Vec::new();
    let describe = |position: usize, record: &Record| {
        (
            committed[position].seq,
            record.partition,
            record.offset,
            record.timestamp.unwrap_or(0),
        )
    };
    for record in ordered {
        let id = record.headers.get("event_id").cloned().unwrap_or_default();
        if !seen.insert(id.clone()) {
            continue;
        }
        let Some(&position) = commit_position.get(&id) else {
            continue;
        };
        let key = record.key.clone().unwrap_or_default();
        if let Some(&(previous, previous_record)) = last.get(&key) {
            if position < previous {
                violations.push(Violation {
                    aggregate: key.clone(),
                    late: describe(position, record),
                    ahead: describe(previous, previous_record),
                });
            }
        }
        last.insert(key, (position, record));
    }
    violations
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_failover() {
    let _one_scenario_at_a_time = SCENARIOS.lock().await;
    let began = Instant::now();
    let profile = profile().name;
    let (kills, hangs) = failover_counts(&profile);
    let seed = std::env::var("OUTBOXD_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| now_millis() as u64 | 1);
    let mut rng = Rng(seed);
    println!(
        "broker failover, {profile} profile, seed {seed}: {kills} SIGKILLs of the busiest partition's leader, \
         a rolling restart, one node down, {hangs} hangs of the leader and two nodes down, each past \
         message.timeout.ms ({MESSAGE_TIMEOUT:?})"
    );

    let pg = Postgres::start();
    migrate(&pg);
    let cluster = blocking(Cluster::launch);
    let client = pg.client().await;
    let (url, brokers, window) = (pg.url(), cluster.addrs(), WINDOW.to_string());
    let message_timeout = format!("message.timeout.ms={}", MESSAGE_TIMEOUT.as_millis());
    let mut outboxd = Connector::spawn(
        &[
            "run",
            "--database-url",
            &url,
            "--brokers",
            &brokers,
            "--topic-partitions",
            FAILOVER_PARTITIONS,
            "--topic-replication-factor",
            "3",
            "--kafka-option",
            &message_timeout,
            "--max-in-flight-events",
            &window,
            "--status-interval",
            "200ms",
            "--startup-timeout",
            "300s",
            "--log-format",
            "json",
        ],
        Connector::INFO_LOGS,
    );
    wait_slot_active(&client, "outboxd").await;

    let (stop_tx, stop) = watch::channel(false);
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let rate = FAILOVER_RATE as f64 / EVENTS_PER_TXN as f64 / WRITERS as f64;
            tokio::spawn(write_load(pg.url(), w, rate, stop.clone()))
        })
        .collect();
    let load_started = Instant::now();
    let t0 = now_millis();
    // outboxd creates the topic with its first event.
    let partitions = blocking(|| cluster.wait_in_sync(TOPIC, CLUSTER_TIMEOUT));
    assert_eq!(
        partitions.len().to_string(),
        FAILOVER_PARTITIONS,
        "the topic's partitions"
    );
    assert!(
        partitions.iter().all(|p| p.replicas.len() == 3),
        "replication factor 3: {partitions:?}"
    );
    let lsn = current_wal_lsn(&client).await;
    wait_published_past(&client, &mut outboxd, lsn, "the first events").await;
    let setup_secs = began.elapsed().as_secs_f64();
    let pause = |rng: &mut Rng| rng.millis(300, 2_500);

    let mut incidents: Vec<Incident> = Vec::new();
    // (a) The leader of the busiest partition, SIGKILLed; outboxd must publish through the election.
    for k in 1..=kills {
        tokio::time::sleep(pause(&mut rng)).await;
        outboxd.check();
        let (partition, leader, _) = blocking(|| cluster.leader_of_busiest_partition(TOPIC));
        let mut incident = Incident::begin(
            Failure::KillLeader,
            format!("SIGKILL node {leader}, leader of busiest partition {partition} ({k}/{kills})"),
            load_started,
        );
        blocking(|| cluster.kill(leader));
        let lsn = current_wal_lsn(&client).await;
        blocking(|| cluster.wait_leaders_elected(TOPIC, &[leader], CLUSTER_TIMEOUT));
        incident.step("new leaders");
        wait_published_past(
            &client,
            &mut outboxd,
            lsn,
            "outboxd to publish with the leader killed",
        )
        .await;
        incident.step("published past the kill");
        blocking(|| cluster.start(leader));
        incident.step("node started");
        blocking(|| cluster.wait_in_sync(TOPIC, CLUSTER_TIMEOUT));
        incidents.push(incident.healed("in sync"));
    }

    // (b) Rolling restart: each node stopped (controlled shutdown) and started, waiting for the ISR each time.
    for node in Cluster::NODES {
        tokio::time::sleep(pause(&mut rng)).await;
        outboxd.check();
        let mut incident = Incident::begin(
            Failure::RollingRestart,
            format!("rolling restart: stop node {node}, start it again ({node}/3)"),
            load_started,
        );
        blocking(|| cluster.stop(node));
        incident.step("stopped");
        let lsn = current_wal_lsn(&client).await;
        blocking(|| cluster.wait_leaders_elected(TOPIC, &[node], CLUSTER_TIMEOUT));
        incident.step("new leaders");
        wait_published_past(
            &client,
            &mut outboxd,
            lsn,
            "outboxd to publish with a node stopped",
        )
        .await;
        incident.step("published past the stop");
        blocking(|| cluster.start(node));
        incident.step("node started");
        blocking(|| cluster.wait_in_sync(TOPIC, CLUSTER_TIMEOUT));
        incidents.push(incident.healed("in sync"));
    }

    // (c) One node down for longer than the producer's message timeout: the other two keep taking writes.
    tokio::time::sleep(pause(&mut rng)).await;
    outboxd.check();
    let (partition, leader, _) = blocking(|| cluster.leader_of_busiest_partition(TOPIC));
    // Down at least this long (longer when outboxd takes longer to publish past the kill); the label
    // gets the length it had.
    let down_for = outage_length(&mut rng);
    let mut incident = Incident::begin(Failure::OneDownPastTimeout, String::new(), load_started);
    let down_since = Instant::now();
    blocking(|| cluster.kill(leader));
    let lsn = current_wal_lsn(&client).await;
    blocking(|| cluster.wait_leaders_elected(TOPIC, &[leader], CLUSTER_TIMEOUT));
    incident.step("new leaders");
    wait_published_past(
        &client,
        &mut outboxd,
        lsn,
        "outboxd to publish with one node down",
    )
    .await;
    incident.step("published past the kill");
    hold(&mut outboxd, down_since + down_for).await;
    let lsn = current_wal_lsn(&client).await;
    wait_published_past(
        &client,
        &mut outboxd,
        lsn,
        "outboxd to publish at the end of the outage",
    )
    .await;
    incident.step("held down, published");
    incident.what = format!(
        "SIGKILL node {leader}, leader of busiest partition {partition}; started again after {:.1}s",
        down_since.elapsed().as_secs_f64()
    );
    blocking(|| cluster.start(leader));
    incident.step("node started");
    blocking(|| cluster.wait_in_sync(TOPIC, CLUSTER_TIMEOUT));
    incidents.push(incident.healed("in sync"));

    // (c'') The busiest partition's leader hung (SIGSTOP) for longer than the message timeout: its
    // connections stay open, so produce requests in flight to it time out there (possibly written, so
    // librdkafka bumps its epoch) while the controller fences it and the other two take over.
    for k in 1..=hangs {
        tokio::time::sleep(pause(&mut rng)).await;
        outboxd.check();
        let (partition, leader, _) = blocking(|| cluster.leader_of_busiest_partition(TOPIC));
        let down_for = outage_length(&mut rng);
        let mut incident = Incident::begin(Failure::HungPastTimeout, String::new(), load_started);
        let down_since = Instant::now();
        blocking(|| cluster.pause(leader));
        let lsn = current_wal_lsn(&client).await;
        blocking(|| cluster.wait_leaders_elected(TOPIC, &[leader], CLUSTER_TIMEOUT));
        incident.step("new leaders");
        wait_published_past(
            &client,
            &mut outboxd,
            lsn,
            "outboxd to publish with the leader hung",
        )
        .await;
        incident.step("published past the hang");
        hold(&mut outboxd, down_since + down_for).await;
        incident.what = format!(
            "SIGSTOP node {leader}, leader of busiest partition {partition}; SIGCONT after {:.1}s ({k}/{hangs})",
            down_since.elapsed().as_secs_f64()
        );
        blocking(|| cluster.resume(leader));
        incident.step("held, resumed");
        blocking(|| cluster.wait_in_sync(TOPIC, CLUSTER_TIMEOUT));
        incidents.push(incident.healed("in sync"));
    }

    // (c') Two nodes down for longer than the message timeout: one node left, no controller quorum and fewer
    // than min.insync.replicas, so sends fail with a timeout while the load goes on.
    tokio::time::sleep(pause(&mut rng)).await;
    outboxd.check();
    let (partition, leader, _) = blocking(|| cluster.leader_of_busiest_partition(TOPIC));
    let others: Vec<i32> = Cluster::NODES
        .into_iter()
        .filter(|&n| n != leader)
        .collect();
    let second = others[rng.below(2) as usize];
    let down_for = outage_length(&mut rng);
    let mut incident = Incident::begin(Failure::TwoDownPastTimeout, String::new(), load_started);
    let down_since = Instant::now();
    blocking(|| {
        cluster.kill(leader);
        cluster.kill(second);
    });
    let lsn = current_wal_lsn(&client).await;
    hold(&mut outboxd, down_since + down_for).await;
    incident.step("held down");
    incident.what = format!(
        "SIGKILL nodes {leader} (leader of busiest partition {partition}) and {second}; started again after {:.1}s",
        down_since.elapsed().as_secs_f64()
    );
    // One node back restores the quorum and two in-sync replicas: writes resume before the last one is up.
    blocking(|| cluster.start(leader));
    incident.step("first node started");
    blocking(|| cluster.start(second));
    incident.step("second node started");
    blocking(|| cluster.wait_in_sync(TOPIC, CLUSTER_TIMEOUT));
    incident.step("in sync");
    wait_published_past(
        &client,
        &mut outboxd,
        lsn,
        "outboxd to publish after two nodes were back",
    )
    .await;
    incidents.push(incident.healed("published past the outage"));
    let incidents_secs = began.elapsed().as_secs_f64() - setup_secs;

    // Stop the load, let everything be published, read it all back.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_tx.send(true).unwrap();
    let mut per_writer = Vec::new();
    for writer in writers {
        per_writer.push(writer.await.unwrap());
    }
    let load_seconds = load_started.elapsed().as_secs_f64();
    let Resolved {
        committed,
        rolled_back,
        in_doubt,
        committed_at,
    } = resolve(&client, per_writer).await;
    let table_rows: i64 = client
        .query_one("SELECT count(*) FROM outbox_event", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        table_rows as usize,
        committed.len(),
        "the generator's record matches the table"
    );
    outboxd.check();
    // Settled, not published: a dead letter is reported with the rest, then fails the run.
    wait_settled(&client, Duration::from_secs(600)).await;
    let end_of_load = current_wal_lsn(&client).await;
    wait_published_past(
        &client,
        &mut outboxd,
        end_of_load,
        "the slot to confirm the end of the load",
    )
    .await;
    let final_lag = final_slot_lag(&client).await;
    let unpublished = unpublished(&client).await;
    let dead = dead_count(&client).await;
    let handed_off = handed_off_count(&client).await;
    let records = blocking(|| cluster.read_all(TOPIC, Duration::from_secs(600)));
    outboxd.check();
    let (logs, unexpected_exits) = outboxd.stop();
    let report = check_delivery(&records, &committed, &rolled_back);
    let violations = order_violations(&records, &committed);
    assert_eq!(
        violations.len(),
        report.order_violations,
        "the two walks agree"
    );
    let (sessions_ended, restarts) = session_restarts(&logs);

    // Per incident: duplicates (a copy's CreateTime falls after the incident that caused it), session
    // restarts, order violations (by the late event's CreateTime) and missing events (by commit time).
    let slots = incidents.len() + 1;
    let (mut duplicates, mut restarts_per, mut violations_per, mut missing_per) = (
        vec![0usize; slots],
        vec![0usize; slots],
        vec![0usize; slots],
        vec![0usize; slots],
    );
    let mut reasons: Vec<BTreeMap<String, usize>> = vec![BTreeMap::new(); slots];
    let mut copies: HashMap<&str, Vec<i64>> = HashMap::new();
    for record in &records {
        if let Some(id) = record.headers.get("event_id") {
            copies
                .entry(id)
                .or_default()
                .push(record.timestamp.unwrap_or(0));
        }
    }
    for times in copies.values_mut().filter(|t| t.len() > 1) {
        times.sort_unstable();
        for &copy in &times[1..] {
            duplicates[after_incident(&incidents, copy)] += 1;
        }
    }
    for restart in &restarts {
        let i = after_incident(&incidents, restart.at);
        restarts_per[i] += 1;
        let reason: String = without_ids(&restart.reason).chars().take(160).collect();
        *reasons[i].entry(reason).or_default() += 1;
    }
    for violation in &violations {
        violations_per[after_incident(&incidents, violation.late.3)] += 1;
    }
    let missing_events: Vec<&Inserted> = committed
        .iter()
        .filter(|e| !copies.contains_key(e.event_id.to_string().as_str()))
        .collect();
    for event in &missing_events {
        missing_per[after_incident(&incidents, committed_at[&event.event_id])] += 1;
    }
    let (worst_index, worst) = duplicates
        .iter()
        .copied()
        .enumerate()
        .max_by_key(|&(_, n)| n)
        .unwrap_or((0, 0));
    let worst_incident = worst_index
        .checked_sub(1)
        .map_or("before any incident".to_string(), |i| {
            incidents[i].what.clone()
        });
    let rel = |ms: i64| (ms - t0) as f64 / 1000.0;
    let example = violations.first().map(|v| {
        format!(
            "{}: seq {} (committed first) first at partition {} offset {} (produced at {:.1}s), after seq {} at offset {} (produced at {:.1}s)",
            v.aggregate,
            v.late.0,
            v.late.1,
            v.late.2,
            rel(v.late.3),
            v.ahead.0,
            v.ahead.2,
            rel(v.ahead.3)
        )
    });
    let aggregates_out_of_order: std::collections::BTreeSet<&str> =
        violations.iter().map(|v| v.aggregate.as_str()).collect();
    let missing_example = missing_events.first().map(|e| {
        format!(
            "{} seq {} committed at {:.1}s",
            e.aggregate_id,
            e.seq,
            rel(committed_at[&e.event_id])
        )
    });
    let total_secs = began.elapsed().as_secs_f64();

    let mut table = String::new();
    let _ = writeln!(
        table,
        "| broker failover (3 nodes, RF 3, min.insync.replicas 2, acks=all) | {profile} profile, seed {seed} |"
    );
    let _ = writeln!(table, "| --- | --- |");
    let mut done: BTreeMap<Failure, usize> = BTreeMap::new();
    for incident in &incidents {
        *done.entry(incident.kind).or_default() += 1;
    }
    for (kind, n) in &done {
        let _ = writeln!(table, "| {} | {n} |", kind.name());
    }
    let rows: Vec<(&str, String)> = vec![
        (
            "load",
            format!(
                "{load_seconds:.0} s, {} events committed ({:.0}/s offered {FAILOVER_RATE}/s), {AGGREGATES} aggregates, {FAILOVER_PARTITIONS} partitions",
                committed.len(),
                committed.len() as f64 / load_seconds,
            ),
        ),
        (
            "outboxd",
            format!(
                "--max-in-flight-events {WINDOW}, --kafka-option {message_timeout}"
            ),
        ),
        (
            "rolled-back transactions",
            format!(
                "{} ({} events; {in_doubt} in doubt, resolved by the table)",
                rolled_back.len() / EVENTS_PER_TXN,
                rolled_back.len()
            ),
        ),
        ("records read back", records.len().to_string()),
        (
            "**committed events missing**",
            match &missing_example {
                Some(e) => format!("{} (e.g. {e})", report.missing),
                None => report.missing.to_string(),
            },
        ),
        (
            "**events from rolled-back transactions**",
            report.from_rolled_back.to_string(),
        ),
        ("duplicates", report.duplicates.to_string()),
        (
            "most duplicates after one incident",
            format!("{worst} ({worst_incident}; in-flight window {WINDOW})"),
        ),
        (
            "**per-aggregate order violations**",
            match &example {
                Some(e) => format!(
                    "{} in {} aggregates (first: {e})",
                    report.order_violations,
                    aggregates_out_of_order.len()
                ),
                None => report.order_violations.to_string(),
            },
        ),
        ("**rows without published_at**", unpublished.to_string()),
        ("dead-lettered rows", dead.to_string()),
        (
            "rows published by the sweeper (handed off)",
            handed_off.to_string(),
        ),
        (
            "replication session restarts (\"replication session ended\")",
            format!(
                "{} ({sessions_ended} sessions ended after streaming)",
                restarts.len()
            ),
        ),
        (
            "outboxd exits not caused by the test",
            unexpected_exits.to_string(),
        ),
        ("final slot lag (bytes)", final_lag.to_string()),
        (
            "run time",
            format!(
                "{total_secs:.0} s (cluster and outboxd start {setup_secs:.0} s, incidents {incidents_secs:.0} s, drain and read back {:.0} s)",
                total_secs - setup_secs - incidents_secs
            ),
        ),
    ];
    for (what, value) in rows {
        let _ = writeln!(table, "| {what} | {value} |");
    }
    let _ = writeln!(table);
    let _ = writeln!(
        table,
        "| # | at | incident | in sync again after | session restarts | duplicates | order violations | missing | restart reasons |"
    );
    let _ = writeln!(
        table,
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"
    );
    for i in 0..slots {
        let (at, what, healed) = match i.checked_sub(1).map(|i| &incidents[i]) {
            Some(incident) => (
                format!("{:.1}s", incident.offset_secs),
                incident.what.clone(),
                format!("{:.1}s", incident.back_in_sync_secs),
            ),
            None => ("0.0s".into(), "before the first incident".into(), "".into()),
        };
        let why = reasons[i]
            .iter()
            .map(|(reason, n)| format!("{n} × {}", reason.replace('|', "/")))
            .collect::<Vec<_>>()
            .join("; ");
        let _ = writeln!(
            table,
            "| {i} | {at} | {what} | {healed} | {} | {} | {} | {} | {why} |",
            restarts_per[i], duplicates[i], violations_per[i], missing_per[i]
        );
    }
    println!("\n{table}");
    let path = write_report(&profile, "broker-failover", &table);
    println!("report: {}\noutboxd logs: {logs:?}", path.display());

    assert_eq!(
        report.missing, 0,
        "committed events missing: {missing_example:?}"
    );
    assert_eq!(report.from_rolled_back, 0, "rolled-back events published");
    assert_eq!(
        report.order_violations,
        0,
        "per-aggregate order violated in {} aggregates; first: {example:?}",
        aggregates_out_of_order.len()
    );
    assert_eq!(unpublished, 0, "rows without published_at");
    assert_eq!(dead, 0, "no event here deserves a dead letter");
    assert_eq!(
        unexpected_exits, 0,
        "outboxd exited on its own; see its logs"
    );
    assert!(
        worst <= WINDOW,
        "{worst} duplicates after one incident ({worst_incident}) exceed the in-flight window {WINDOW}"
    );
}

// The verifier's own checks: each of them can fail.

fn record(id: uuid::Uuid, key: &str, partition: i32, offset: i64, at: i64) -> Record {
    Record {
        topic: TOPIC.into(),
        partition,
        offset,
        key: Some(key.into()),
        value: None,
        headers: HashMap::from([("event_id".to_string(), id.to_string())]),
        timestamp: Some(at),
    }
}

#[test]
fn the_verifier_sees_an_aggregate_out_of_order() {
    let event = |aggregate: &str, seq| Inserted {
        event_id: uuid::Uuid::new_v4(),
        aggregate_id: aggregate.into(),
        seq,
    };
    let committed = vec![
        event("order-1", 0),
        event("order-1", 1),
        event("order-2", 2),
    ];
    let (a1, a2, b1) = (
        committed[0].event_id,
        committed[1].event_id,
        committed[2].event_id,
    );
    // a2 reached the partition before a1 (a1 lost, then re-sent after a2), a2 again as the re-send's copy.
    let records = vec![
        record(a1, "order-1", 0, 1, 2_000),
        record(a2, "order-1", 0, 0, 1_000),
        record(a2, "order-1", 0, 2, 3_000),
        record(b1, "order-2", 1, 0, 1_500),
    ];
    let report = check_delivery(&records, &committed, &[]);
    assert_eq!(
        (report.missing, report.duplicates, report.order_violations),
        (0, 1, 1)
    );
    let violations = order_violations(&records, &committed);
    assert_eq!(violations.len(), 1);
    let v = &violations[0];
    assert_eq!(v.aggregate, "order-1");
    assert_eq!(v.late, (0, 0, 1, 2_000), "a1 came late");
    assert_eq!(v.ahead, (1, 0, 0, 1_000), "a2 came first");
    // In commit order nothing is reported.
    let in_order = vec![
        record(a1, "order-1", 0, 0, 1_000),
        record(a2, "order-1", 0, 1, 1_100),
        record(b1, "order-2", 1, 0, 1_500),
    ];
    assert!(order_violations(&in_order, &committed).is_empty());
    assert_eq!(
        check_delivery(&in_order, &committed, &[]).order_violations,
        0
    );
    // A missing event is counted.
    assert_eq!(check_delivery(&in_order[..2], &committed, &[]).missing, 1);
}

#[test]
fn duplicates_and_restarts_go_to_the_incident_before_them() {
    let start = Instant::now();
    let mut incidents = Vec::new();
    for at in [1_000, 5_000] {
        let mut incident = Incident::begin(Failure::KillLeader, format!("at {at}"), start);
        incident.at = at;
        incidents.push(incident);
    }
    assert_eq!(after_incident(&incidents, 999), 0, "before any incident");
    assert_eq!(after_incident(&incidents, 1_000), 1);
    assert_eq!(after_incident(&incidents, 4_999), 1);
    assert_eq!(after_incident(&incidents, 5_000), 2);
}

#[test]
fn restart_reasons_group_without_event_ids() {
    let id = uuid::Uuid::new_v4();
    assert_eq!(
        without_ids(&format!(
            "Kafka: delivery of event {id} failed: MessageTimedOut (Local: Message timed out)"
        )),
        "Kafka: delivery of event <id> failed: MessageTimedOut (Local: Message timed out)"
    );
    assert_eq!(without_ids(&format!("({id})")), "(<id>)");
}

#[test]
fn report_sections_replace_only_themselves() {
    let profile = format!("selftest-{}", std::process::id());
    let path = write_report(&profile, "faults", "| a | 1 |\n");
    write_report(&profile, "broker-failover", "| b | 1 |\n");
    write_report(&profile, "faults", "| a | 2 |\n");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert!(
        text.contains("| a | 2 |") && !text.contains("| a | 1 |"),
        "{text}"
    );
    assert!(text.contains("| b | 1 |"), "{text}");
    assert!(
        text.find("| a | 2 |") < text.find("| b | 1 |"),
        "sections keep their place: {text}"
    );
}

/// Bytes of WAL between the server's position and what the slot confirmed.
async fn final_slot_lag(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = 'outboxd'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

// ======================================================================================================
// Refusals: the broker refuses events after outboxd's producer accepted them. Two outbox tables, one keeping
// its rows and one deleting them in the inserting transaction (Debezium style); both topics accept at most
// `SMALL_TOPIC_BYTES` per batch, and every `OVERSIZE_EVERY`-th transaction carries one event larger than that
// (refused with its batch-mates); the fault driver SIGKILLs outboxd and takes the principal's WRITE on one
// topic away and gives it back (TOPIC_AUTHORIZATION_FAILED). Every oversize event must be dead-lettered (a
// row an operator finds, and a record in the dead-letter topic), every other committed event delivered, in
// order, duplicates within the window per fault, and the slot must confirm the end of the load.
// `refusals_at_least_once` and `refusals_exactly_once` run it in both delivery modes.
// ======================================================================================================

/// Events per second the generator offers, over its two writers.
const REFUSALS_RATE: u64 = 600;
/// Both topics' `max.message.bytes`: small events batch under it (`batch.size` below it), an oversize one not.
const SMALL_TOPIC_BYTES: usize = 65_536;
const OVERSIZE_PAD: usize = 100_000;
/// Every this many transactions of a writer, one event is oversize.
const OVERSIZE_EVERY: u64 = 100;
const DEAD_LETTER_TOPIC: &str = "outbox.dead";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Refusal {
    KillOutboxd,
    RevokeWrite,
}

impl Refusal {
    fn name(self) -> &'static str {
        match self {
            Refusal::KillOutboxd => "SIGKILL outboxd, restart it",
            Refusal::RevokeWrite => "revoke WRITE on one topic, grant it again",
        }
    }
}

/// (kills, revocations, `--max-attempts`) of a profile. Revocations need attempts enough to outlive them
/// (the admin tool takes seconds to give WRITE back); CI's short profile leaves them to `tests/it/refusals.rs`
/// and dead-letters the oversize events quickly.
fn refusal_counts(profile: &str) -> (usize, usize, &'static str) {
    match profile {
        "full" => (20, 6, "25"),
        _ => (3, 0, "6"),
    }
}

/// One writer of the refusals scenario: its table, aggregate type and whether it deletes its rows.
#[derive(Debug, Clone, Copy)]
struct RefusalWriter {
    table: &'static str,
    aggregate_type: &'static str,
    deletes_rows: bool,
}

const REFUSAL_WRITERS: [RefusalWriter; 2] = [
    RefusalWriter {
        table: "outbox_event",
        aggregate_type: "Order",
        deletes_rows: false,
    },
    RefusalWriter {
        table: "outbox_deleted",
        aggregate_type: "Payment",
        deletes_rows: true,
    },
];

/// A transaction of the refusals scenario: its events, which of them is oversize, its xid (rows deleted by
/// the transaction cannot resolve a lost COMMIT answer: `txid_status` does) and what became of it.
struct RefusalTxn {
    events: Vec<Inserted>,
    oversize: Option<uuid::Uuid>,
    xid: Option<i64>,
    outcome: Outcome,
}

async fn write_refusal_load(
    url: String,
    writer: RefusalWriter,
    rate: f64,
    mut stop: watch::Receiver<bool>,
) -> Vec<RefusalTxn> {
    let mut txns = Vec::new();
    let prefix = writer.aggregate_type.to_lowercase();
    let mut rng = Rng(0x51_7cc1_b727_220a ^ writer.table.len() as u64);
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut seq = 0i64;
    'connect: while !*stop.borrow() {
        let Ok((mut client, connection)) =
            tokio_postgres::connect(&url, tokio_postgres::NoTls).await
        else {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        };
        tokio::spawn(connection);
        loop {
            tokio::select! {
                _ = ticker.tick() => {}
                _ = stop.wait_for(|s| *s) => break 'connect,
            }
            let n = txns.len() as u64;
            let mut events: Vec<Inserted> = Vec::with_capacity(EVENTS_PER_TXN);
            for i in 0..EVENTS_PER_TXN {
                let aggregate_id = match events.last() {
                    Some(last) if i % 3 != 0 => last.aggregate_id.clone(),
                    _ => format!("{prefix}-{}", rng.below(AGGREGATES as u64 / 2)),
                };
                events.push(Inserted {
                    event_id: uuid::Uuid::new_v4(),
                    aggregate_id,
                    seq,
                });
                seq += 1;
            }
            let oversize = (n % OVERSIZE_EVERY == OVERSIZE_EVERY / 2)
                .then(|| events[rng.below(EVENTS_PER_TXN as u64) as usize].event_id);
            let rollback = n % ROLLBACK_EVERY == ROLLBACK_EVERY - 1;
            let (xid, outcome) =
                run_refusal_txn(&mut client, writer, &events, oversize, rollback).await;
            let broken = outcome.is_none();
            txns.push(RefusalTxn {
                events,
                oversize,
                xid,
                outcome: outcome.unwrap_or(Outcome::InDoubt),
            });
            if broken {
                continue 'connect;
            }
        }
    }
    txns
}

async fn run_refusal_txn(
    client: &mut tokio_postgres::Client,
    writer: RefusalWriter,
    events: &[Inserted],
    oversize: Option<uuid::Uuid>,
    rollback: bool,
) -> (Option<i64>, Option<Outcome>) {
    let Ok(tx) = client.transaction().await else {
        return (None, None);
    };
    let Ok(row) = tx.query_one("SELECT txid_current()", &[]).await else {
        return (None, None);
    };
    let xid: i64 = row.get(0);
    let ids: Vec<uuid::Uuid> = events.iter().map(|e| e.event_id).collect();
    let aggregates: Vec<&str> = events.iter().map(|e| e.aggregate_id.as_str()).collect();
    let payloads: Vec<serde_json::Value> = events
        .iter()
        .map(|e| {
            let pad = if Some(e.event_id) == oversize {
                OVERSIZE_PAD
            } else {
                0
            };
            serde_json::json!({"aggregate": e.aggregate_id, "seq": e.seq, "pad": "x".repeat(pad)})
        })
        .collect();
    let inserted = tx
        .execute(
            &format!(
                "INSERT INTO {} (event_id, aggregate_type, aggregate_id, event_type, payload)
                 SELECT id, $4, aggregate, 'Changed', payload
                 FROM unnest($1::uuid[], $2::text[], $3::jsonb[]) WITH ORDINALITY AS e(id, aggregate, payload, n)
                 ORDER BY n",
                writer.table
            ),
            &[&ids, &aggregates, &payloads, &writer.aggregate_type],
        )
        .await;
    if inserted.is_err() {
        return (Some(xid), None);
    }
    if writer.deletes_rows
        && tx
            .execute(
                &format!("DELETE FROM {} WHERE event_id = ANY($1)", writer.table),
                &[&ids],
            )
            .await
            .is_err()
    {
        return (Some(xid), None);
    }
    let outcome = if rollback {
        tx.rollback().await.ok().map(|()| Outcome::RolledBack)
    } else {
        tx.commit().await.ok().map(|()| Outcome::Committed)
    };
    (Some(xid), outcome)
}

async fn refusals(delivery: &str) {
    let _one_scenario_at_a_time = SCENARIOS.lock().await;
    let profile = profile().name;
    let (kills, revocations, max_attempts) = refusal_counts(&profile);
    let seed = std::env::var("OUTBOXD_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| now_millis() as u64 | 1);
    let mut rng = Rng(seed);
    let mut schedule: Vec<Refusal> = std::iter::repeat_n(Refusal::KillOutboxd, kills)
        .chain(std::iter::repeat_n(Refusal::RevokeWrite, revocations))
        .collect();
    for i in (1..schedule.len()).rev() {
        schedule.swap(i, rng.below(i as u64 + 1) as usize);
    }
    println!("refusals, {delivery}, {profile} profile, seed {seed}: {kills} kills, {revocations} revocations");

    let pg = Postgres::start();
    let tables = [
        "--table",
        "public.outbox_event",
        "--table",
        "public.outbox_deleted",
    ];
    let mut migrate_args = vec!["migrate", "--database-url"];
    let url = pg.url();
    migrate_args.push(&url);
    migrate_args.extend_from_slice(&tables);
    let migrated = run_outboxd(&migrate_args);
    assert!(migrated.status.success(), "{}", stderr_of(&migrated));
    let broker = blocking(SecureBroker::start);
    let password = "outboxd-chaos-7f2c";
    blocking(|| broker.add_user("outboxd", password));
    let topics: Vec<String> = REFUSAL_WRITERS
        .iter()
        .map(|w| format!("outbox.{}", w.aggregate_type))
        .collect();
    for topic in &topics {
        create_topic(
            &broker.plaintext_addr(),
            rdkafka::admin::NewTopic::new(topic, 3, rdkafka::admin::TopicReplication::Fixed(1))
                .set("max.message.bytes", &SMALL_TOPIC_BYTES.to_string()),
        )
        .await;
        blocking(|| broker.allow("outboxd", &["WRITE", "CREATE"], "TOPIC", topic));
    }
    blocking(|| {
        broker.allow("outboxd", &["WRITE", "CREATE"], "TOPIC", DEAD_LETTER_TOPIC);
        broker.allow(
            "outboxd",
            &["READ", "WRITE", "CREATE", "DESCRIBE"],
            "TOPIC",
            "outboxd.progress",
        );
        broker.allow("outboxd", &["READ"], "GROUP", "outboxd-progress-reader");
        broker.allow_prefixed(
            "outboxd",
            &["WRITE", "DESCRIBE"],
            "TRANSACTIONAL_ID",
            "outboxd-",
        );
    });
    let options = SecureBroker::kafka_options("outboxd", password, &broker.ca);
    let brokers = broker.addr();
    let window = WINDOW.to_string();
    let batch_size = format!("batch.size={}", SMALL_TOPIC_BYTES / 2);
    let mut args = run_args(&url, &brokers);
    args.extend(options.iter().map(String::as_str));
    args.extend_from_slice(&tables);
    args.extend_from_slice(&[
        "--delivery",
        delivery,
        "--kafka-option",
        &batch_size,
        "--max-in-flight-events",
        &window,
        "--dead-letter-topic",
        DEAD_LETTER_TOPIC,
        "--max-attempts",
        max_attempts,
        "--retry-base",
        "200ms",
        "--retry-cap",
        "1s",
        "--startup-timeout",
        "300s",
    ]);
    let mut outboxd = Connector::spawn(&args, &[]);
    let client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;

    let (stop_tx, stop) = watch::channel(false);
    let writers: Vec<_> = REFUSAL_WRITERS
        .iter()
        .map(|&w| {
            let rate = REFUSALS_RATE as f64 / EVENTS_PER_TXN as f64 / REFUSAL_WRITERS.len() as f64;
            tokio::spawn(write_refusal_load(pg.url(), w, rate, stop.clone()))
        })
        .collect();
    let started = Instant::now();
    let mut fault_times: Vec<(i64, Refusal)> = Vec::new();
    for fault in &schedule {
        tokio::time::sleep(rng.millis(1_000, 4_000)).await;
        outboxd.check();
        fault_times.push((now_millis(), *fault));
        match fault {
            Refusal::KillOutboxd => outboxd.kill_and_restart(rng.millis(0, 1_000)).await,
            Refusal::RevokeWrite => {
                let topic = &topics[rng.below(topics.len() as u64) as usize];
                blocking(|| broker.revoke("outboxd", &["WRITE"], "TOPIC", topic));
                tokio::time::sleep(rng.millis(2_000, 6_000)).await;
                blocking(|| broker.allow("outboxd", &["WRITE"], "TOPIC", topic));
            }
        }
        println!(
            "{:>6.1}s  {}",
            started.elapsed().as_secs_f64(),
            fault.name()
        );
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop_tx.send(true).unwrap();
    let mut txns = Vec::new();
    for writer in writers {
        txns.extend(writer.await.unwrap());
    }
    let load_seconds = started.elapsed().as_secs_f64();

    // Resolve lost COMMIT answers by the transaction's status (the deleting table keeps no rows).
    let (mut committed, mut rolled_back, mut oversize) = (Vec::new(), Vec::new(), Vec::new());
    let mut in_doubt = 0;
    for txn in txns {
        let committed_for_sure = match (txn.outcome, txn.xid) {
            (Outcome::InDoubt, Some(xid)) => {
                in_doubt += 1;
                let status: Option<String> = client
                    .query_one("SELECT txid_status($1)", &[&xid])
                    .await
                    .unwrap()
                    .get(0);
                status.as_deref() == Some("committed")
            }
            (Outcome::InDoubt, None) => false,
            (outcome, _) => outcome == Outcome::Committed,
        };
        if committed_for_sure {
            oversize.extend(txn.oversize);
            committed.extend(
                txn.events
                    .into_iter()
                    .filter(|e| Some(e.event_id) != txn.oversize),
            );
        } else {
            rolled_back.extend(txn.events);
        }
    }

    outboxd.check();
    // Every oversize event dead-lettered (its row written back where the transaction deleted it), every
    // other row published or dead.
    wait_for_async("every oversize event to be dead-lettered", Duration::from_secs(600), || async {
        let dead: i64 = client
            .query_one(
                "SELECT (SELECT count(*) FROM outbox_event WHERE event_id = ANY($1) AND dead_at IS NOT NULL)
                      + (SELECT count(*) FROM outbox_deleted WHERE event_id = ANY($1) AND dead_at IS NOT NULL)",
                &[&oversize],
            )
            .await
            .unwrap()
            .get(0);
        (dead as usize == oversize.len()).then_some(())
    })
    .await;
    let settled = |table: &'static str| {
        let client = &client;
        async move {
            client
                .query_one(
                    &format!("SELECT count(*) FROM {table} WHERE published_at IS NULL AND dead_at IS NULL"),
                    &[],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    wait_for_async(
        "every row to be published or dead-lettered",
        Duration::from_secs(600),
        || async {
            (settled("outbox_event").await + settled("outbox_deleted").await == 0).then_some(())
        },
    )
    .await;
    let end_of_load = current_wal_lsn(&client).await;
    wait_confirmed_past(
        &client,
        "outboxd",
        end_of_load,
        "the slot to confirm the end of the load",
    )
    .await;
    let final_lag = final_slot_lag(&client).await;
    let wrongly_dead: i64 = client
        .query_one(
            "SELECT (SELECT count(*) FROM outbox_event WHERE dead_at IS NOT NULL AND NOT event_id = ANY($1))
                  + (SELECT count(*) FROM outbox_deleted WHERE dead_at IS NOT NULL AND NOT event_id = ANY($1))",
            &[&oversize],
        )
        .await
        .unwrap()
        .get(0);
    let written_back: i64 = client
        .query_one("SELECT count(*) FROM outbox_deleted", &[])
        .await
        .unwrap()
        .get(0);

    let topic_names: Vec<&str> = topics.iter().map(String::as_str).collect();
    let records = blocking(|| {
        consume_all(
            &broker.plaintext_addr(),
            &topic_names,
            committed.len(),
            Duration::from_secs(600),
        )
    });
    let dead_letters = blocking(|| {
        consume_all(
            &broker.plaintext_addr(),
            &[DEAD_LETTER_TOPIC],
            oversize.len(),
            Duration::from_secs(120),
        )
    });
    let report = check_delivery(&records, &committed, &rolled_back);
    let oversize_published = records
        .iter()
        .filter(|r| {
            oversize
                .iter()
                .any(|id| r.headers.get("event_id") == Some(&id.to_string()))
        })
        .count();
    let not_in_dead_letters = oversize
        .iter()
        .filter(|id| {
            !dead_letters
                .iter()
                .any(|r| r.headers.get("event_id") == Some(&id.to_string()))
        })
        .count();
    let (logs, unexpected_exits) = outboxd.stop();
    let restarts: usize = logs
        .iter()
        .map(|log| {
            std::fs::read_to_string(log)
                .unwrap_or_default()
                .matches("replication session ended; reconnecting")
                .count()
        })
        .sum();

    let mut copies: HashMap<&str, Vec<i64>> = HashMap::new();
    for record in &records {
        if let Some(id) = record.headers.get("event_id") {
            copies
                .entry(id)
                .or_default()
                .push(record.timestamp.unwrap_or(0));
        }
    }
    let mut per_fault: BTreeMap<usize, usize> = BTreeMap::new();
    for times in copies.values_mut().filter(|t| t.len() > 1) {
        times.sort_unstable();
        for &copy in &times[1..] {
            let after = fault_times.partition_point(|(t, _)| *t <= copy);
            *per_fault.entry(after).or_default() += 1;
        }
    }
    let (worst_index, worst) = per_fault
        .iter()
        .map(|(&i, &n)| (i, n))
        .max_by_key(|&(_, n)| n)
        .unwrap_or((0, 0));
    let worst_fault = worst_index
        .checked_sub(1)
        .map_or("before any fault (refusals)", |i| fault_times[i].1.name());

    let mut table = String::new();
    let _ = writeln!(
        table,
        "| refusals, {delivery} | {profile} profile, seed {seed} |"
    );
    let _ = writeln!(table, "| --- | --- |");
    let rows: Vec<(&str, String)> = vec![
        ("SIGKILL outboxd, restart it", kills.to_string()),
        ("revoke WRITE on one topic for 2-6 s, grant it again", revocations.to_string()),
        (
            "load",
            format!(
                "{load_seconds:.0} s, {} events committed ({:.0}/s), half into a table that deletes its rows in the inserting transaction",
                committed.len() + oversize.len(),
                (committed.len() + oversize.len()) as f64 / load_seconds
            ),
        ),
        (
            "oversize events (refused after acceptance, with their batch-mates)",
            format!("{} ({} in the deleting table's rows written back)", oversize.len(), written_back),
        ),
        ("rolled-back events", format!("{} ({in_doubt} transactions in doubt, resolved)", rolled_back.len())),
        ("**committed events missing**", report.missing.to_string()),
        ("**events from rolled-back transactions**", report.from_rolled_back.to_string()),
        ("**per-aggregate order violations**", report.order_violations.to_string()),
        ("**oversize events not dead-lettered / not in the dead-letter topic**", format!("0 / {not_in_dead_letters}")),
        ("**events dead-lettered that were not oversize**", wrongly_dead.to_string()),
        ("duplicates", format!("{} (bound: window {WINDOW} per kill or session restart)", report.duplicates)),
        ("most duplicates after one fault", format!("{worst} ({worst_fault}; the session restarts until the next fault included)")),
        ("replication session restarts (one per refusal)", restarts.to_string()),
        ("outboxd exits not caused by the test", unexpected_exits.to_string()),
        ("final slot lag (bytes)", final_lag.to_string()),
    ];
    for (what, value) in rows {
        let _ = writeln!(table, "| {what} | {value} |");
    }
    println!("\n{table}");
    let path = write_report(&profile, &format!("refusals-{delivery}"), &table);
    println!("report: {}", path.display());

    assert_eq!(
        report.missing, 0,
        "committed events missing: {:?}",
        report.missing_sample
    );
    assert_eq!(report.from_rolled_back, 0, "rolled-back events published");
    assert_eq!(report.order_violations, 0, "per-aggregate order violated");
    assert_eq!(oversize_published, 0, "an oversize event reached its topic");
    assert_eq!(
        not_in_dead_letters, 0,
        "oversize events missing from the dead-letter topic"
    );
    assert_eq!(
        wrongly_dead, 0,
        "events dead-lettered that the broker would take"
    );
    assert_eq!(
        unexpected_exits, 0,
        "outboxd exited on its own; see its logs"
    );
    // Every refusal costs a session restart, which re-sends the window like a crash does (the deleting
    // table's rows cannot be skipped by their published_at): the bound is the window per kill or restart.
    let bound = WINDOW * (kills + restarts);
    assert!(
        report.duplicates <= bound,
        "{} duplicates exceed the in-flight window {WINDOW} per kill or session restart ({kills} kills, {restarts} restarts)",
        report.duplicates
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refusals_at_least_once() {
    refusals("at-least-once").await;
}

/// Full profile only: CI's short profile runs the scenario at least once (exactly-once refusals are covered
/// by `tests/it/refusals.rs` and `tests/it/transactions.rs`), to keep the suite's serialised chaos time short.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refusals_exactly_once() {
    if profile().name != "full" {
        println!("refusals, exactly-once: full profile only (OUTBOXD_CHAOS_PROFILE=full)");
        return;
    }
    refusals("exactly-once").await;
}
