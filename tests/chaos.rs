//! Chaos suite. A load generator commits events continuously (100 aggregates, several events per
//! transaction, some transactions rolled back) and records what it committed, while a fault driver kills
//! outboxd at random moments, restarts the broker (sqlite storage, so records survive) and PostgreSQL
//! (`-m fast` and `-m immediate`), cuts the network between outboxd and each of them with a proxy the test
//! owns, and drops the replication slot. A verifier then reads every record back and reports loss,
//! rolled-back events, duplicates (in all and per fault), order violations, unpublished rows and slot lag,
//! as a table printed and written to `target/chaos/<profile>.md`.
//!
//! Profiles (`OUTBOXD_CHAOS_PROFILE`): `short` (the default, run by CI with the other tests) and `full`:
//!
//! ```sh
//! OUTBOXD_CHAOS_PROFILE=full cargo test --release --test chaos -- --nocapture
//! ```
//!
//! `OUTBOXD_CHAOS_SEED` replays a run's random choices (the seed is printed and in the report).

mod support;

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use support::*;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chaos() {
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
    let mut outboxd = Outboxd::spawn(&args);
    let mut logs = vec![outboxd.log.clone()];
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
    let mut unexpected_exits = 0;
    for fault in &schedule {
        tokio::time::sleep(rng.millis(300, 2_500)).await;
        if let Some(status) = outboxd.try_wait() {
            unexpected_exits += 1;
            eprintln!(
                "outboxd exited on its own ({status}); log {}",
                outboxd.log.display()
            );
            outboxd = Outboxd::spawn(&args);
            logs.push(outboxd.log.clone());
        }
        fault_times.push((now_millis(), *fault));
        match fault {
            Fault::KillOutboxd => {
                outboxd.kill();
                tokio::time::sleep(rng.millis(0, 1_000)).await;
                outboxd = Outboxd::spawn(&args);
                logs.push(outboxd.log.clone());
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

    // Resolve transactions whose COMMIT answer was lost: the table holds their rows or none.
    let client = pg.client().await;
    let mut committed = Vec::new();
    let mut rolled_back = Vec::new();
    let mut in_doubt = 0;
    for txns in per_writer {
        for txn in txns {
            let outcome = match txn.outcome {
                Outcome::InDoubt => {
                    in_doubt += 1;
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
                Outcome::Committed => committed.extend(txn.events),
                _ => rolled_back.extend(txn.events),
            }
        }
    }
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
    if let Some(status) = outboxd.try_wait() {
        unexpected_exits += 1;
        eprintln!("outboxd exited on its own ({status})");
        outboxd = Outboxd::spawn(&args);
        logs.push(outboxd.log.clone());
    }
    wait_all_published(&client, Duration::from_secs(600)).await;
    let end_of_load = current_wal_lsn(&client).await;
    wait_confirmed_past(
        &client,
        "outboxd",
        end_of_load,
        "the slot to confirm the end of the load",
    )
    .await;
    let final_lag: i64 = client
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = 'outboxd'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let unpublished = unpublished(&client).await;
    let dead: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox_event WHERE dead_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
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
    drop(outboxd);

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
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/chaos");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(format!("{}.md", profile.name));
    std::fs::write(&path, &table).unwrap();
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
    assert!(
        faults_done.get(&Fault::KillOutboxd).copied().unwrap_or(0)
            >= if profile.name == "full" { 50 } else { 10 }
    );
}
