//! The benchmark scenarios (drain and its limits, polling drain, steady rates, one big transaction), each
//! returning figures; printing them is `main`'s job.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rdkafka::producer::{
    BaseRecord, DefaultProducerContext, FutureProducer, FutureRecord, Producer, ThreadedProducer,
};
use tokio_postgres::Client;

use crate::observe;
use crate::soak;
use crate::stack::{free_port, wait_until, BenchResult, Outboxd, Stack, SystemCpu, Usage};

/// Rows per backlog transaction (over 1,000 aggregates, ~200-byte payloads).
pub const EVENTS_PER_TXN: usize = 100;

pub struct Bench {
    pub stack: Stack,
    pub outboxd: PathBuf,
    pub sql: Client,
    /// Extra arguments for every outboxd run (e.g. `--kafka-option linger.ms=20`).
    pub outboxd_args: Vec<String>,
}

#[derive(Debug, Clone, Copy)]
pub struct Drain {
    pub events: usize,
    /// From starting outboxd until the last event was confirmed.
    pub seconds: f64,
    /// From the first to the last published_at: the rate once streaming, without start-up.
    pub streaming_seconds: f64,
    /// From starting outboxd to the first published_at: start-up.
    pub first_published_after: f64,
    pub usage: Usage,
    /// What PostgreSQL and the broker spent meanwhile, and the WAL written.
    pub system: SystemCost,
}

impl Drain {
    pub fn rate(&self) -> f64 {
        self.events as f64 / self.seconds
    }
    pub fn streaming_rate(&self) -> f64 {
        self.events as f64 / self.streaming_seconds
    }
    pub fn cpu_micros_per_event(&self) -> f64 {
        self.usage.cpu_seconds * 1e6 / self.events as f64
    }
    /// From the last published_at to the slot confirmed past the backlog: the end of the drain.
    pub fn tail_seconds(&self) -> f64 {
        self.seconds - self.first_published_after - self.streaming_seconds
    }
    /// CPU µs per event of outboxd, PostgreSQL and the broker, their sum, and WAL bytes per event.
    pub fn per_event(&self) -> PerEvent {
        PerEvent::of(self.usage.cpu_seconds, self.system, self.events)
    }
}

/// CPU seconds PostgreSQL (every process of the server) and the broker spent on a stretch of work, and the
/// WAL it wrote. The benchmark's own monitoring queries (a few per 10 ms) are included.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemCost {
    pub postgres_cpu: f64,
    pub broker_cpu: f64,
    pub wal_bytes: f64,
    /// Row updates of the outbox table, and how many of them were heap-only (HOT: no index touched).
    pub updates: TableUpdates,
}

/// `n_tup_upd` and `n_tup_hot_upd` of the outbox table (`pg_stat_user_tables`), or their growth.
#[derive(Debug, Clone, Copy, Default)]
pub struct TableUpdates {
    pub updates: i64,
    pub hot: i64,
}

impl TableUpdates {
    /// The share of updates that were heap-only, in percent (None without updates).
    pub fn hot_percent(&self) -> Option<f64> {
        (self.updates > 0).then(|| self.hot as f64 * 100.0 / self.updates as f64)
    }
}

/// A [`SystemCost`] (and the client's CPU) per event: CPU in µs, WAL in bytes.
#[derive(Debug, Clone, Copy)]
pub struct PerEvent {
    pub client_cpu: f64,
    pub postgres_cpu: f64,
    pub broker_cpu: f64,
    pub wal_bytes: f64,
}

impl PerEvent {
    pub fn of(client_cpu_seconds: f64, system: SystemCost, events: usize) -> Self {
        let per = |seconds: f64| seconds * 1e6 / events as f64;
        PerEvent {
            client_cpu: per(client_cpu_seconds),
            postgres_cpu: per(system.postgres_cpu),
            broker_cpu: per(system.broker_cpu),
            wal_bytes: system.wal_bytes / events as f64,
        }
    }
    pub fn total_cpu(&self) -> f64 {
        self.client_cpu + self.postgres_cpu + self.broker_cpu
    }
}

/// Where a [`SystemCost`] measurement started.
struct CostMeter {
    cpu: SystemCpu,
    wal: String,
    updates: TableUpdates,
}

#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub source: f64,
    pub sink: f64,
    pub backfill: f64,
    /// PostgreSQL's CPU for the source (the walsender decoding for pg_recvlogical), the broker's for the sink,
    /// PostgreSQL's and the WAL for the backfill.
    pub source_cost: SystemCost,
    pub sink_cost: SystemCost,
    pub backfill_cost: SystemCost,
}

/// One takeover after a SIGKILL of the leader (see [`Bench::takeover`]).
#[derive(Debug, Clone, Copy)]
pub struct Takeover {
    /// Seconds from the SIGKILL until the standby's `/readyz` said 200.
    pub ready_after: f64,
    /// Seconds from the SIGKILL until an event inserted right after it had `published_at`.
    pub published_after: f64,
}

/// One steady run. Latencies are seconds, as p50 / p99 / p99.9.
#[derive(Debug, Clone)]
pub struct Steady {
    pub mode: &'static str,
    pub offered: u64,
    /// The load generator's insert rate over the run.
    pub inserted_per_second: f64,
    /// Rows whose `published_at` falls inside the run, per second of it: outboxd's rate.
    pub published_per_second: f64,
    /// From the writer's COMMIT returning to a Kafka consumer receiving the event: what a reader feels.
    pub commit_to_consumer: [f64; 3],
    /// From the commit timestamp (pgoutput Begin) to the broker's ack and the `published_at` write, from
    /// outboxd's `outboxd_commit_to_ack_seconds` histogram (CDC only).
    pub commit_to_published_at_written: Option<[f64; 3]>,
    /// `published_at - created_at` per row (SQL): both are `now()`, the start of the inserting transaction
    /// and of the transaction writing `published_at`.
    pub created_to_published_at: [f64; 3],
    /// From the writer's COMMIT returning until the slot's confirmed position passed it (sampled every
    /// 10 ms; CDC only).
    pub commit_to_confirmed: Option<[f64; 3]>,
    pub backlog_at_end: i64,
    pub peak_rss_kib: u64,
    /// While the load ran, per event inserted: CPU of outboxd, PostgreSQL (the writers' sessions included)
    /// and the broker, and WAL.
    pub cost: PerEvent,
    /// CPU µs per event of the benchmark process: the writers and the consumer.
    pub load_cpu: f64,
    /// Cores kept busy by all of them together while the load ran (of the machine's).
    pub busy_cores: f64,
}

impl Steady {
    /// The backlog stayed within half a second of load: outboxd kept up.
    pub fn sustained(&self) -> bool {
        (self.backlog_at_end as f64) <= self.offered as f64 * 0.5
            && self.published_per_second >= self.offered as f64 * 0.95
    }
}

/// The CDC path with `--delivery exactly-once`, as a mode of the scenarios.
pub const EXACTLY_ONCE: &str = "cdc-eos";

/// Whether `mode` streams from the slot.
fn is_cdc(mode: &str) -> bool {
    mode == "cdc" || mode == EXACTLY_ONCE
}

impl Bench {
    fn run_args<'a>(&'a self, url: &'a str, brokers: &'a str, mode: &'a str) -> Vec<&'a str> {
        let mut args = vec![
            "run",
            "--database-url",
            url,
            "--brokers",
            brokers,
            "--topic-replication-factor",
            "1",
            "--mode",
        ];
        if mode == EXACTLY_ONCE {
            args.extend(["cdc", "--delivery", "exactly-once"]);
        } else {
            args.push(mode);
        }
        args
    }

    pub fn spawn(&self, mode: &str, extra: &[&str], log: &str) -> BenchResult<Outboxd> {
        let (url, brokers) = (self.stack.pg_url(), self.stack.brokers());
        let mut args = self.run_args(&url, &brokers, mode);
        args.extend_from_slice(extra);
        args.extend(self.outboxd_args.iter().map(String::as_str));
        Outboxd::spawn(&self.outboxd, &args, &self.stack.log_dir().join(log))
    }

    async fn scalar_i64(&self, sql: &str) -> BenchResult<i64> {
        Ok(self.sql.query_one(sql, &[]).await?.get(0))
    }

    async fn cost_meter(&self) -> BenchResult<CostMeter> {
        Ok(CostMeter {
            cpu: self.stack.system_cpu()?,
            wal: self.wal_lsn().await?,
            updates: self.table_updates().await?,
        })
    }

    /// The outbox table's update counts as the statistics hold them now. A session reports its counts to
    /// them at most once a second, and at its end: read after the sessions that updated ended.
    async fn table_updates(&self) -> BenchResult<TableUpdates> {
        // This session's own counts (the backfill's) are reported at the end of the next statement (PG 15+).
        let _ = self
            .sql
            .batch_execute("SELECT pg_stat_force_next_flush()")
            .await;
        let row = self
            .sql
            .query_one(
                "SELECT coalesce(sum(n_tup_upd), 0)::int8, coalesce(sum(n_tup_hot_upd), 0)::int8
                 FROM pg_stat_user_tables WHERE relname = 'outbox_event'",
                &[],
            )
            .await?;
        Ok(TableUpdates {
            updates: row.get(0),
            hot: row.get(1),
        })
    }

    /// Waits until every other client session has ended (and so reported its statistics), at most 10 s;
    /// past that the update counts may fall short, and the run says so.
    async fn sessions_ended(&self) {
        let ended = wait_until(
            "the drain's sessions to end",
            Duration::from_secs(10),
            Duration::from_millis(10),
            || async {
                self.scalar_i64(
                    "SELECT count(*) FROM pg_stat_activity
                     WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
                )
                .await
                .is_ok_and(|n| n == 0)
            },
        )
        .await;
        if let Err(error) = ended {
            eprintln!("note: the update counts may be short: {error}");
        }
    }

    async fn cost_since(&self, meter: CostMeter) -> BenchResult<SystemCost> {
        let updates = self.table_updates().await?;
        let cpu = self.stack.system_cpu()? - meter.cpu;
        let wal_bytes: f64 = self
            .sql
            .query_one(
                "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::float8",
                &[&meter.wal],
            )
            .await?
            .get(0);
        Ok(SystemCost {
            postgres_cpu: cpu.postgres,
            broker_cpu: cpu.broker,
            wal_bytes,
            updates: TableUpdates {
                updates: updates.updates - meter.updates.updates,
                hot: updates.hot - meter.updates.hot,
            },
        })
    }

    async fn wal_lsn(&self) -> BenchResult<String> {
        Ok(self
            .sql
            .query_one("SELECT pg_current_wal_lsn()::text", &[])
            .await?
            .get(0))
    }

    async fn slot_reached(&self, slot: &str, lsn: &str) -> bool {
        self.sql
            .query_one(
                "SELECT coalesce(confirmed_flush_lsn >= $2::text::pg_lsn, false) FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot, &lsn],
            )
            .await
            .map(|row| row.get(0))
            .unwrap_or(false)
    }

    async fn slot_streaming(&self) -> bool {
        self.scalar_i64("SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'")
            .await
            .map(|n| n > 0)
            .unwrap_or(false)
    }

    /// Waits until outboxd streams from its slot.
    async fn wait_slot_streaming(&self) -> BenchResult<()> {
        wait_until(
            "the slot",
            Duration::from_secs(60),
            Duration::from_millis(50),
            || self.slot_streaming(),
        )
        .await
    }

    /// Every row has published_at (an error reads as not yet).
    async fn all_published(&self) -> bool {
        self.unpublished().await.is_ok_and(|n| n == 0)
    }

    async fn unpublished(&self) -> BenchResult<i64> {
        self.unpublished_in(ONE_TABLE).await
    }

    /// Rows of `tables` without published_at.
    async fn unpublished_in(&self, tables: &[&str]) -> BenchResult<i64> {
        let rows = published_at_of(tables);
        self.scalar_i64(&format!(
            "SELECT count(*) FROM {rows} WHERE published_at IS NULL"
        ))
        .await
    }

    /// Seconds from the first to the last published_at in `tables`.
    async fn publishing_seconds(&self, tables: &[&str]) -> BenchResult<f64> {
        let rows = published_at_of(tables);
        Ok(self
            .sql
            .query_one(
                &format!("SELECT EXTRACT(EPOCH FROM max(published_at) - min(published_at))::float8 FROM {rows}"),
                &[],
            )
            .await?
            .get(0))
    }

    /// The server's clock now.
    async fn db_now(&self) -> BenchResult<std::time::SystemTime> {
        Ok(self.sql.query_one("SELECT now()", &[]).await?.get(0))
    }

    /// Seconds from `start` to the first published_at in `tables`.
    async fn first_published_after(
        &self,
        start: std::time::SystemTime,
        tables: &[&str],
    ) -> BenchResult<f64> {
        let rows = published_at_of(tables);
        let first: std::time::SystemTime = self
            .sql
            .query_one(&format!("SELECT min(published_at) FROM {rows}"), &[])
            .await?
            .get(0);
        Ok(first.duration_since(start).map_or(0.0, |d| d.as_secs_f64()))
    }

    /// Empties the table and drops every slot (once the last walsender let go of them).
    pub async fn reset(&self) -> BenchResult<()> {
        wait_until(
            "slots to be free",
            Duration::from_secs(60),
            Duration::from_millis(50),
            || async {
                self.sql
                    .batch_execute(
                        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots",
                    )
                    .await
                    .is_ok()
            },
        )
        .await?;
        self.sql.batch_execute("TRUNCATE outbox_event").await?;
        Ok(())
    }

    /// `events` rows in transactions of 100 over 1,000 aggregates, ~200-byte JSON payloads.
    pub async fn insert_backlog(&self, events: usize) -> BenchResult<()> {
        let statement = self
            .sql
            .prepare(
                "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                 SELECT gen_random_uuid(), 'Order', 'order-' || (($1::int + n) % 1000), 'OrderPlaced',
                        jsonb_build_object('orderId', 'order-' || (($1::int + n) % 1000), 'customer', 'c-' || n,
                                           'total', 99.5, 'lines', jsonb_build_array(jsonb_build_object('sku', 'SKU-12345', 'qty', 2)),
                                           'note', repeat('x', 60))
                 FROM generate_series(1, $2::int) AS n",
            )
            .await?;
        let per_txn = EVENTS_PER_TXN.min(events) as i32;
        let mut done = 0;
        while done < events {
            self.sql
                .execute(&statement, &[&(done as i32), &per_txn])
                .await?;
            done += per_txn as usize;
        }
        Ok(())
    }

    /// Drain: a backlog built while outboxd was stopped (its slot existed), then outboxd until every event
    /// is acknowledged, has published_at and the slot is confirmed past it. Also measures the three limits
    /// on the same backlog.
    pub async fn drain(&self, events: usize) -> BenchResult<(Drain, Limits)> {
        self.reset().await?;
        {
            let _first = self.spawn("cdc", &[], "drain-slot.log")?;
            self.wait_slot_streaming().await?;
        }
        self.sql
            .batch_execute("SELECT pg_create_logical_replication_slot('bench_source', 'pgoutput')")
            .await?;
        self.insert_backlog(events).await?;
        let end = self.wal_lsn().await?;

        let meter = self.cost_meter().await?;
        let source = self.source_limit(&end).await?;
        let source_cost = self.cost_since(meter).await?;
        let drain = self
            .measure_drain("cdc", events, &end, ONE_TABLE, &[])
            .await?;
        let meter = self.cost_meter().await?;
        let sink = self.sink_limit().await?;
        let sink_cost = self.cost_since(meter).await?;
        let (backfill, backfill_cost) = self.backfill_limit().await?;
        Ok((
            drain,
            Limits {
                source: events as f64 / source,
                sink: events as f64 / sink,
                backfill: events as f64 / backfill,
                source_cost,
                sink_cost,
                backfill_cost,
            },
        ))
    }

    /// pg_recvlogical with pgoutput proto 1 from the second slot to the backlog's end, to /dev/null.
    async fn source_limit(&self, end: &str) -> BenchResult<f64> {
        // Debian's PostgreSQL 15 client tools, which talk to every server major.
        let recvlogical = std::env::var("OUTBOXD_PG_CLIENT_BIN")
            .map(PathBuf::from)
            .unwrap_or_else(|_| PathBuf::from("/usr/lib/postgresql/15/bin"))
            .join("pg_recvlogical");
        let started = Instant::now();
        let mut command = std::process::Command::new(recvlogical);
        command.args([
            "-d",
            &self.stack.pg_url(),
            "--slot",
            "bench_source",
            "--start",
            "--endpos",
            end,
            "-o",
            "proto_version=1",
            "-o",
            "publication_names=outboxd",
            "-f",
            "/dev/null",
        ]);
        let status = tokio::task::spawn_blocking(move || command.status()).await??;
        if !status.success() {
            return Err("pg_recvlogical failed".into());
        }
        let seconds = started.elapsed().as_secs_f64();
        // Its walsender lets the slot go as it exits: from then on its CPU is the server's to report.
        wait_until(
            "pg_recvlogical's walsender to exit",
            Duration::from_secs(30),
            Duration::from_millis(5),
            || async {
                self.scalar_i64(
                    "SELECT count(*) FROM pg_replication_slots WHERE slot_name = 'bench_source' AND active",
                )
                .await
                .is_ok_and(|n| n == 0)
            },
        )
        .await?;
        Ok(seconds)
    }

    /// The same records through a plain rdkafka producer with outboxd's producer settings.
    async fn sink_limit(&self) -> BenchResult<f64> {
        let rows = self
            .sql
            .query(
                "SELECT event_id::text, aggregate_id, event_type, payload::text FROM outbox_event ORDER BY position",
                &[],
            )
            .await?;
        let records = rows
            .iter()
            .map(|row| (row.get(0), row.get(1), row.get(2), row.get(3)));
        self.produce_all("bench.sink", records).await
    }

    /// Warms the broker up before anything is measured: a JVM compiles its hot paths under the first real
    /// load, and that CPU would count against the first scenario (a broker in production has long been
    /// warm). `events` records like the backlog's through a producer with outboxd's settings.
    pub async fn warm_up_broker(&self, events: usize) -> BenchResult<()> {
        let payload = format!("{{\"note\": \"{}\"}}", "x".repeat(180));
        let ids: Vec<(String, String)> = (0..events)
            .map(|n| {
                (
                    uuid::Uuid::new_v4().to_string(),
                    format!("order-{}", n % 1000),
                )
            })
            .collect();
        let records = ids
            .iter()
            .map(|(id, key)| (id.as_str(), key.as_str(), "Warmup", payload.as_str()));
        self.produce_all("bench.warmup", records).await?;
        Ok(())
    }

    /// Sends (event id, key, event type, payload) records to `topic` (created first) through a producer with
    /// outboxd's settings, as fast as it takes them; returns the seconds until every one was acknowledged.
    async fn produce_all<'a>(
        &self,
        topic: &str,
        records: impl Iterator<Item = (&'a str, &'a str, &'a str, &'a str)>,
    ) -> BenchResult<f64> {
        let settings = outboxd_settings(&self.stack)?;
        let producer: ThreadedProducer<DefaultProducerContext> =
            outboxd::kafka::producer_config(&settings).create()?;
        create_topic(&settings, topic).await?;
        let started = Instant::now();
        for (id, key, event_type, payload) in records {
            let mut record = BaseRecord::to(topic)
                .key(key)
                .payload(payload)
                .headers(event_headers(id, event_type));
            loop {
                match producer.send(record) {
                    Ok(()) => break,
                    Err((_, returned)) => {
                        record = returned;
                        producer.poll(Duration::from_millis(1));
                    }
                }
            }
        }
        let flushed =
            tokio::task::spawn_blocking(move || producer.flush(Duration::from_secs(600))).await?;
        flushed?;
        Ok(started.elapsed().as_secs_f64())
    }

    /// published_at for the same rows by event_id, 2,000 per UPDATE (outboxd's backfill batch); with what
    /// the UPDATEs alone cost.
    async fn backfill_limit(&self) -> BenchResult<(f64, SystemCost)> {
        self.sql
            .batch_execute("UPDATE outbox_event SET published_at = NULL")
            .await?;
        self.sql
            .batch_execute("VACUUM ANALYZE outbox_event")
            .await?;
        let ids: Vec<uuid::Uuid> = self
            .sql
            .query("SELECT event_id FROM outbox_event ORDER BY position", &[])
            .await?
            .iter()
            .map(|row| row.get(0))
            .collect();
        let update = self
            .sql
            .prepare("UPDATE outbox_event SET published_at = now() WHERE event_id = ANY($1) AND published_at IS NULL")
            .await?;
        let meter = self.cost_meter().await?;
        let started = Instant::now();
        for chunk in ids.chunks(2_000) {
            self.sql.execute(&update, &[&chunk]).await?;
        }
        let seconds = started.elapsed().as_secs_f64();
        Ok((seconds, self.cost_since(meter).await?))
    }

    /// The same drain with `--delivery exactly-once` (no limits: they are the same).
    pub async fn exactly_once_drain(&self, events: usize) -> BenchResult<Drain> {
        self.reset().await?;
        {
            let _first = self.spawn(EXACTLY_ONCE, &[], "drain-eos-slot.log")?;
            self.wait_slot_streaming().await?;
        }
        self.insert_backlog(events).await?;
        let end = self.wal_lsn().await?;
        self.measure_drain(EXACTLY_ONCE, events, &end, ONE_TABLE, &[])
            .await
    }

    /// A CDC drain of a backlog of `shape` (see [`Shape`]), built while outboxd was stopped: the sweep's point.
    /// The outbox tables are (re)migrated so the publication holds exactly the shape's tables.
    pub async fn shaped_drain(&self, shape: &Shape) -> BenchResult<Drain> {
        let tables = shape.table_names();
        let tables: Vec<&str> = tables.iter().map(String::as_str).collect();
        self.reset().await?;
        self.publish_tables(&tables).await?;
        let table_list = tables.join(",");
        let extra = ["--table", table_list.as_str()];
        {
            let _first = self.spawn("cdc", &extra, "sweep-slot.log")?;
            self.wait_slot_streaming().await?;
        }
        self.insert_shaped(shape, &tables).await?;
        let end = self.wal_lsn().await?;
        self.measure_drain("cdc", shape.events, &end, &tables, &extra)
            .await
    }

    /// Makes `tables` the outbox tables: migrated (created where missing), emptied, and the only ones in
    /// outboxd's publication. A publication with other tables would be refused by outboxd run with these.
    pub async fn publish_tables(&self, tables: &[&str]) -> BenchResult<()> {
        self.sql
            .batch_execute("DROP PUBLICATION IF EXISTS outboxd")
            .await?;
        migrate(&self.outboxd, &self.stack.pg_url(), tables)?;
        self.sql
            .batch_execute(&format!("TRUNCATE {}", tables.join(", ")))
            .await?;
        Ok(())
    }

    /// `shape.events` rows in transactions of `shape.events_per_txn`, each transaction in the next of
    /// `tables` in turn; the aggregates taken in turn, the payload padded to `shape.payload_bytes`.
    async fn insert_shaped(&self, shape: &Shape, tables: &[&str]) -> BenchResult<()> {
        let mut statements = Vec::new();
        for table in tables {
            statements.push(
                self.sql
                    .prepare(&format!(
                        "INSERT INTO {table} (event_id, aggregate_type, aggregate_id, event_type, payload)
                         SELECT gen_random_uuid(), 'Order', 'order-' || (($1::bigint + n) % $3::bigint), 'OrderPlaced',
                                jsonb_build_object('orderId', 'order-' || (($1::bigint + n) % $3::bigint),
                                                   'total', 99.5, 'note', $4::text)
                         FROM generate_series(1, $2::int) AS n"
                    ))
                    .await?,
            );
        }
        let note = shape.padding();
        let aggregates = shape.aggregates as i64;
        let mut done = 0;
        let mut txn = 0;
        while done < shape.events {
            let rows = shape.events_per_txn.min(shape.events - done);
            self.sql
                .execute(
                    &statements[txn % statements.len()],
                    &[&(done as i64), &(rows as i32), &aggregates, &note],
                )
                .await?;
            done += rows;
            txn += 1;
        }
        Ok(())
    }

    /// Starts outboxd in `mode` (with `extra` arguments) on a backlog of `events` in `tables` ending at
    /// `end`, and times it until the slot is confirmed there, every row is marked and Kafka holds every event.
    async fn measure_drain(
        &self,
        mode: &str,
        events: usize,
        end: &str,
        tables: &[&str],
        extra: &[&str],
    ) -> BenchResult<Drain> {
        let in_kafka = self.records_in_kafka()?;
        let meter = self.cost_meter().await?;
        let start = self.db_now().await?;
        let started = Instant::now();
        let outboxd = self.spawn(mode, extra, &format!("drain-{mode}.log"))?;
        wait_until(
            "the drain",
            Duration::from_secs(1800),
            Duration::from_millis(10),
            || self.slot_reached("outboxd", end),
        )
        .await?;
        let seconds = started.elapsed().as_secs_f64();
        let usage = outboxd.usage()?;
        drop(outboxd);
        self.sessions_ended().await;
        let system = self.cost_since(meter).await?;
        let left = self.unpublished_in(tables).await?;
        if left != 0 {
            return Err(
                format!("{left} rows without published_at after the drain ({mode})").into(),
            );
        }
        self.kafka_received(in_kafka, events, &format!("the {mode} drain"))?;
        Ok(Drain {
            events,
            seconds,
            streaming_seconds: self.publishing_seconds(tables).await?,
            first_published_after: self.first_published_after(start, tables).await?,
            usage,
            system,
        })
    }

    /// The drain backlog made unpublished again (and vacuumed), for a polling drain; returns its events.
    async fn unpublish_backlog(&self) -> BenchResult<usize> {
        self.sql
            .batch_execute(
                "UPDATE outbox_event SET published_at = NULL, attempts = 0, lease_token = NULL, lease_until = NULL, handoff_at = NULL",
            )
            .await?;
        self.sql
            .batch_execute("VACUUM ANALYZE outbox_event")
            .await?;
        Ok(self.scalar_i64("SELECT count(*) FROM outbox_event").await? as usize)
    }

    /// The drain backlog again, through `instances` outboxd processes in `--mode poll`.
    pub async fn poll_drain(&self, instances: usize) -> BenchResult<Drain> {
        let events = self.unpublish_backlog().await?;
        let in_kafka = self.records_in_kafka()?;
        let meter = self.cost_meter().await?;
        let start = self.db_now().await?;
        let started = Instant::now();
        let workers: Vec<Outboxd> = (0..instances)
            .map(|i| self.spawn("poll", &[], &format!("poll-{instances}-{i}.log")))
            .collect::<BenchResult<_>>()?;
        wait_until(
            "the polling drain",
            Duration::from_secs(1800),
            Duration::from_millis(20),
            || self.all_published(),
        )
        .await?;
        let seconds = started.elapsed().as_secs_f64();
        let mut usage = Usage::default();
        for worker in &workers {
            usage = usage + worker.usage()?;
        }
        drop(workers);
        self.sessions_ended().await;
        let system = self.cost_since(meter).await?;
        self.kafka_received(in_kafka, events, "the polling drain")?;
        Ok(Drain {
            events,
            seconds,
            streaming_seconds: self.publishing_seconds(ONE_TABLE).await?,
            first_published_after: self.first_published_after(start, ONE_TABLE).await?,
            usage,
            system,
        })
    }

    /// The drain backlog again, through a plain poller of the pattern's articles (see [`PlainPoller`]): the
    /// yardstick of the polling path. Its CPU is the poller process's over the drain.
    pub async fn plain_poll_drain(&self, poller: PlainPoller, batch: i64) -> BenchResult<Drain> {
        let events = self.unpublish_backlog().await?;
        let in_kafka = self.records_in_kafka()?;
        let meter = self.cost_meter().await?;
        let start = self.db_now().await?;
        let started = Instant::now();
        let cpu_seconds = match poller {
            PlainPoller::Rust => self.rust_plain_poller(batch).await?,
            PlainPoller::Python => self.python_plain_poller(batch).await?,
        };
        let seconds = started.elapsed().as_secs_f64();
        self.sessions_ended().await;
        let system = self.cost_since(meter).await?;
        self.kafka_received(
            in_kafka,
            events,
            &format!("the {poller:?} plain poller's drain"),
        )?;
        Ok(Drain {
            events,
            seconds,
            streaming_seconds: self.publishing_seconds(ONE_TABLE).await?,
            first_published_after: self.first_published_after(start, ONE_TABLE).await?,
            usage: Usage {
                cpu_seconds,
                peak_rss_kib: 0,
            },
            system,
        })
    }

    /// [`plain_poller`] in this process, with outboxd's producer settings; returns the CPU seconds it took.
    async fn rust_plain_poller(&self, batch: i64) -> BenchResult<f64> {
        let settings = outboxd_settings(&self.stack)?;
        let producer: FutureProducer = outboxd::kafka::producer_config(&settings).create()?;
        let (client, driver) =
            tokio_postgres::connect(&self.stack.pg_url(), tokio_postgres::NoTls).await?;
        let driver = tokio::spawn(driver);
        let before = crate::stack::usage(std::process::id())?;
        plain_poller(client, &producer, batch).await?;
        let cpu_seconds = crate::stack::usage(std::process::id())?.cpu_seconds - before.cpu_seconds;
        driver.await??;
        Ok(cpu_seconds)
    }

    /// `examples/plain_poller.py` in the tests' Python environment; returns the CPU seconds it reported.
    async fn python_plain_poller(&self, batch: i64) -> BenchResult<f64> {
        let cache = std::env::var("OUTBOXD_CACHE").unwrap_or_else(|_| "/var/cache/outboxd".into());
        let python = PathBuf::from(cache).join("python-tools/bin/python");
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/plain_poller.py");
        if !python.exists() {
            return Err(format!(
                "{} is missing: run tests/support/install-deps.sh (it installs the plain poller's Python clients)",
                python.display()
            )
            .into());
        }
        let mut command = std::process::Command::new(&python);
        command.args([
            script.as_os_str(),
            self.stack.pg_url().as_ref(),
            self.stack.brokers().as_ref(),
            EVENTS_TOPIC.as_ref(),
            batch.to_string().as_ref(),
        ]);
        let output = tokio::task::spawn_blocking(move || command.output()).await??;
        let stdout = String::from_utf8_lossy(&output.stdout);
        if !output.status.success() {
            return Err(format!(
                "examples/plain_poller.py failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            )
            .into());
        }
        stdout
            .lines()
            .find_map(|line| line.strip_prefix("cpu_seconds "))
            .and_then(|seconds| seconds.trim().parse().ok())
            .ok_or_else(|| {
                format!("examples/plain_poller.py printed no cpu_seconds: {stdout}").into()
            })
    }

    /// `rate` events/s (transactions of 10 on several connections) for `duration`, with outboxd in `mode`.
    // Long: one scenario in the order it runs (start, warm up, load and consume, drain, read the figures).
    pub async fn steady(
        &self,
        mode: &'static str,
        rate: u64,
        duration: Duration,
    ) -> BenchResult<Steady> {
        self.reset().await?;
        let metrics_addr = format!("127.0.0.1:{}", free_port()?);
        let outboxd = self.spawn(
            mode,
            &["--metrics-addr", &metrics_addr],
            &format!("steady-{mode}-{rate}.log"),
        )?;
        if is_cdc(mode) {
            self.wait_slot_streaming().await?;
        }
        // Warm up (producer connected, topic known, first batch through) and measure from here on.
        self.insert_backlog(10).await?;
        wait_until(
            "the warm-up events",
            Duration::from_secs(60),
            Duration::from_millis(20),
            || self.all_published(),
        )
        .await?;
        let consumer = observe::ArrivalConsumer::start(&self.stack.brokers(), EVENTS_TOPIC)?;
        let confirmations = match is_cdc(mode) {
            true => Some(observe::ConfirmSampler::start(&self.stack.pg_url(), "outboxd").await?),
            false => None,
        };
        let measured_from: std::time::SystemTime =
            self.sql.query_one("SELECT now()", &[]).await?.get(0);
        let before = scrape_histogram(&metrics_addr).await.unwrap_or_default();
        let meter = self.cost_meter().await?;
        let outboxd_before = outboxd.usage()?;
        let load_before = crate::stack::usage(std::process::id())?;
        let load_started = Instant::now();
        let connections = rate.div_ceil(2_500).max(1);
        let txns_per_second = rate as f64 / STEADY_EVENTS_PER_TXN as f64 / connections as f64;
        let stop_at = Instant::now() + duration;
        let mut writers = Vec::new();
        for c in 0..connections {
            let url = self.stack.pg_url();
            writers.push(tokio::spawn(async move {
                write_at_rate(&url, c as i32, txns_per_second, stop_at).await
            }));
        }
        let mut commits = Vec::new();
        for writer in writers {
            commits.extend(writer.await??);
        }
        let inserted = commits.len() * STEADY_EVENTS_PER_TXN;
        let load_seconds = load_started.elapsed().as_secs_f64();
        let system = self.cost_since(meter).await?;
        let outboxd_cpu = outboxd.usage()?.cpu_seconds - outboxd_before.cpu_seconds;
        let load_cpu =
            crate::stack::usage(std::process::id())?.cpu_seconds - load_before.cpu_seconds;
        let cost = PerEvent::of(outboxd_cpu, system, inserted.max(1));
        let busy_cores =
            (outboxd_cpu + system.postgres_cpu + system.broker_cpu + load_cpu) / load_seconds;
        let backlog_at_end = self.unpublished().await?;
        wait_until(
            "the steady run to drain",
            Duration::from_secs(600),
            Duration::from_millis(50),
            || self.all_published(),
        )
        .await?;
        let arrivals = consumer.finish(inserted, Duration::from_secs(120)).await?;
        let visible = observe::commit_to_visible(&commits, &arrivals, STEADY_EVENTS_PER_TXN);
        if visible.missing > 0 {
            return Err(format!(
                "Kafka holds {} of the {inserted} events published at {rate}/s ({mode})",
                inserted - visible.missing
            )
            .into());
        }
        let commit_to_confirmed = match confirmations {
            Some(sampler) => {
                let last = commits
                    .iter()
                    .map(|c| c.wal_after)
                    .max()
                    .unwrap_or_default();
                let last = last.to_string();
                wait_until(
                    "the slot to confirm the last commit",
                    Duration::from_secs(60),
                    Duration::from_millis(10),
                    || self.slot_reached("outboxd", &last),
                )
                .await?;
                let samples = sampler.finish().await?;
                Some(observe::percentiles(observe::commit_to_confirmed(
                    &commits, &samples,
                )))
            }
            None => None,
        };
        let after = scrape_histogram(&metrics_addr).await.unwrap_or_default();
        let peak_rss_kib = outboxd.usage()?.peak_rss_kib;
        drop(outboxd);
        let row = self
            .sql
            .query_one(
                "SELECT percentile_cont(ARRAY[0.5, 0.99, 0.999]) WITHIN GROUP (ORDER BY EXTRACT(EPOCH FROM published_at - created_at)),
                        count(*) FILTER (WHERE published_at < $1::timestamptz + make_interval(secs => $2::float8))
                 FROM outbox_event WHERE published_at >= $1",
                &[&measured_from, &duration.as_secs_f64()],
            )
            .await?;
        let created_to_published_at: Vec<f64> = row.get(0);
        let published_in_run: i64 = row.get(1);
        let commit_to_published_at_written = is_cdc(mode).then(|| {
            let delta: Vec<(f64, f64)> = after
                .iter()
                .zip(before.iter().chain(std::iter::repeat(&(0.0, 0.0))))
                .map(|(&(le, a), &(_, b))| (le, a - b))
                .collect();
            [0.5, 0.99, 0.999].map(|q| histogram_quantile(&delta, q))
        });
        Ok(Steady {
            mode,
            offered: rate,
            inserted_per_second: inserted as f64 / duration.as_secs_f64(),
            published_per_second: published_in_run as f64 / duration.as_secs_f64(),
            commit_to_consumer: observe::percentiles(visible.latencies),
            commit_to_published_at_written,
            created_to_published_at: [
                created_to_published_at[0],
                created_to_published_at[1],
                created_to_published_at[2],
            ],
            commit_to_confirmed,
            backlog_at_end,
            peak_rss_kib,
            cost,
            load_cpu: load_cpu * 1e6 / inserted.max(1) as f64,
            busy_cores,
        })
    }

    /// A soak of outboxd in `mode` (see `soak`): a fresh table and slot, outboxd with a metrics listener
    /// (scraped or not, as the plan says), the plan's load until it is all published.
    pub async fn soak(&self, mode: &'static str, plan: &soak::Plan) -> BenchResult<soak::Soak> {
        self.reset().await?;
        let metrics_addr = format!("127.0.0.1:{}", free_port()?);
        let scraped = scrape_label(plan.scrape_every);
        let outboxd = self.spawn(
            mode,
            &["--metrics-addr", &metrics_addr],
            &format!("soak-{mode}-{scraped}.log"),
        )?;
        // Idle is measured once outboxd is ready (connected, its pipeline running).
        wait_until(
            "outboxd to be ready",
            Duration::from_secs(60),
            Duration::from_millis(50),
            || ready(&metrics_addr),
        )
        .await?;
        if mode == "cdc" {
            self.wait_slot_streaming().await?;
        }
        let target = soak::Target {
            outboxd_pid: outboxd.pid(),
            sql: &self.sql,
            pg_url: self.stack.pg_url(),
            metrics_addr: Some(metrics_addr),
        };
        soak::run(&target, plan).await
    }

    /// One transaction of `events` rows: seconds from its commit until the slot is confirmed past it, and
    /// outboxd's peak RSS.
    /// Takeover: two `cdc` instances on one slot, one leading and one standing by. Each round SIGKILLs the
    /// leader, inserts one event at once and measures until the standby is ready and until that event is
    /// published; the killed instance is started again as the next standby.
    pub async fn takeover(&self, rounds: usize) -> BenchResult<Vec<Takeover>> {
        self.reset().await?;
        let addrs = [
            format!("127.0.0.1:{}", free_port()?),
            format!("127.0.0.1:{}", free_port()?),
        ];
        let spawn = |i: usize, round: usize| {
            self.spawn(
                "cdc",
                &["--metrics-addr", &addrs[i]],
                &format!("takeover-{i}-{round}.log"),
            )
        };
        let mut instances = [Some(spawn(0, 0)?), Some(spawn(1, 0)?)];
        let mut takeovers = Vec::new();
        for round in 1..=rounds {
            wait_until(
                "a leader and a standby",
                Duration::from_secs(120),
                Duration::from_millis(50),
                || async {
                    (ready(&addrs[0]).await && standing_by(&addrs[1]).await)
                        || (ready(&addrs[1]).await && standing_by(&addrs[0]).await)
                },
            )
            .await?;
            let leader = if ready(&addrs[0]).await { 0 } else { 1 };
            let standby = &addrs[1 - leader];
            let killed_at = Instant::now();
            if let Some(mut killed) = instances[leader].take() {
                killed.kill();
            }
            self.insert_backlog(1).await?;
            wait_until(
                "the standby to lead",
                Duration::from_secs(120),
                Duration::from_millis(10),
                || ready(standby),
            )
            .await?;
            let ready_after = killed_at.elapsed().as_secs_f64();
            wait_until(
                "the event inserted after the kill",
                Duration::from_secs(120),
                Duration::from_millis(10),
                || self.all_published(),
            )
            .await?;
            takeovers.push(Takeover {
                ready_after,
                published_after: killed_at.elapsed().as_secs_f64(),
            });
            instances[leader] = Some(spawn(leader, round)?);
        }
        Ok(takeovers)
    }

    pub async fn big_transaction(&self, events: usize) -> BenchResult<(f64, Usage)> {
        self.reset().await?;
        let outboxd = self.spawn("cdc", &[], "big.log")?;
        self.wait_slot_streaming().await?;
        let in_kafka = self.records_in_kafka()?;
        self.sql
            .execute(
                "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                 SELECT gen_random_uuid(), 'Order', 'order-' || (n % 1000), 'OrderPlaced',
                        jsonb_build_object('orderId', 'order-' || (n % 1000), 'note', repeat('x', 150))
                 FROM generate_series(1, $1::int) AS n",
                &[&(events as i32)],
            )
            .await?;
        let end = self.wal_lsn().await?;
        let started = Instant::now();
        wait_until(
            "the big transaction",
            Duration::from_secs(1800),
            Duration::from_millis(20),
            || self.slot_reached("outboxd", &end),
        )
        .await?;
        let seconds = started.elapsed().as_secs_f64();
        self.kafka_received(in_kafka, events, "the big transaction")?;
        Ok((seconds, outboxd.usage()?))
    }

    /// `events` published events of their own aggregate type (their own topic), then `outboxd audit` over
    /// them, its memory sampled while it runs. Fails unless the audit is clean and checked every event.
    pub async fn audit(&self, events: usize) -> BenchResult<Audited> {
        self.reset().await?;
        let aggregate_type = format!("Audit{events}");
        let mut outboxd = self.spawn("cdc", &[], &format!("audit-{events}.log"))?;
        self.wait_slot_streaming().await?;
        for first in (0..events).step_by(100_000) {
            let count = (events - first).min(100_000) as i32;
            self.sql
                .execute(
                    "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                     SELECT gen_random_uuid(), $3, 'order-' || (($1::int + n) % 1000), 'OrderPlaced',
                            jsonb_build_object('orderId', 'order-' || (($1::int + n) % 1000), 'note', repeat('x', 150))
                     FROM generate_series(1, $2::int) AS n",
                    &[&(first as i32), &count, &aggregate_type],
                )
                .await?;
        }
        wait_until(
            "every event published",
            Duration::from_secs(1800),
            Duration::from_millis(200),
            || async {
                self.sql
                    .query_one(
                        "SELECT count(*) = 0 FROM outbox_event WHERE published_at IS NULL",
                        &[],
                    )
                    .await
                    .is_ok_and(|row| row.get(0))
            },
        )
        .await?;
        outboxd.stop();
        let (url, brokers) = (self.stack.pg_url(), self.stack.brokers());
        let started = Instant::now();
        let mut child = std::process::Command::new(&self.outboxd)
            .args([
                "audit",
                "--database-url",
                &url,
                "--brokers",
                &brokers,
                "--aggregate-type",
                &aggregate_type,
                "--json",
            ])
            .env("OUTBOXD_METRICS_ADDR", "off")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        // (seconds since the start, VmHWM then)
        let mut samples = Vec::new();
        while child.try_wait()?.is_none() {
            if let Ok(usage) = crate::stack::usage(child.id()) {
                samples.push((started.elapsed().as_secs_f64(), usage.peak_rss_kib));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let seconds = started.elapsed().as_secs_f64();
        let peak_until = |fraction: f64| {
            samples
                .iter()
                .filter(|(at, _)| *at <= seconds * fraction)
                .map(|(_, kib)| *kib)
                .max()
                .unwrap_or_default()
        };
        let output = child.wait_with_output()?;
        let summary: serde_json::Value = serde_json::from_slice(&output.stdout)?;
        if summary["exit_code"] != 0 || summary["checked"] != events as u64 {
            return Err(format!("the audit of {events} events was not clean: {summary}").into());
        }
        Ok(Audited {
            events,
            seconds,
            records: summary["records"].as_u64().unwrap_or_default(),
            peak_rss_by_quarter_kib: [0.25, 0.5, 0.75, 1.0].map(peak_until),
        })
    }

    /// Records the events' topic holds now.
    fn records_in_kafka(&self) -> BenchResult<i64> {
        observe::topic_end(&self.stack.brokers(), EVENTS_TOPIC)
    }

    /// Fails the run unless the topic gained at least `events` records since it held `before`: a figure is
    /// only reported for events Kafka really holds.
    fn kafka_received(&self, before: i64, events: usize, what: &str) -> BenchResult<()> {
        let gained = self.records_in_kafka()? - before;
        if gained < events as i64 {
            return Err(format!(
                "Kafka holds {gained} new records after {what} of {events} events"
            )
            .into());
        }
        Ok(())
    }
}

/// One `outboxd audit` of the benchmark.
pub struct Audited {
    /// Published events audited.
    pub events: usize,
    /// Wall time of the whole audit.
    pub seconds: f64,
    /// Records it read from the topic.
    pub records: u64,
    /// outboxd's peak resident memory (VmHWM, sampled every 50 ms) by the end of each quarter of its wall
    /// time: flat when the later quarters add nothing to the first.
    pub peak_rss_by_quarter_kib: [u64; 4],
}

/// A plain poller of the pattern's articles, the yardstick of the polling path.
#[derive(Debug, Clone, Copy)]
pub enum PlainPoller {
    /// [`plain_poller`], in the benchmark's process (tokio-postgres, rdkafka with outboxd's settings).
    Rust,
    /// `examples/plain_poller.py` (psycopg, confluent-kafka), as the articles write it.
    Python,
}

/// The relay the transactional outbox articles describe, written plainly: in one transaction, lock the oldest
/// `batch` unpublished rows (`FOR UPDATE SKIP LOCKED`), send them, wait for every acknowledgement, mark them
/// published, commit; until none is left. No leases, retries, dead letters or per-aggregate holds: a failed
/// send rolls the batch back. It reads by the claim index's order, so that it pays no sort. It awaits each
/// send's delivery future rather than `flush()`, which rust-rdkafka serves in 100 ms polls.
async fn plain_poller(
    mut client: Client,
    producer: &FutureProducer,
    batch: i64,
) -> BenchResult<()> {
    let select = client
        .prepare(
            "SELECT event_id, aggregate_id, event_type, payload::text FROM outbox_event
             WHERE published_at IS NULL AND dead_at IS NULL
             ORDER BY position NULLS FIRST, created_at, event_id LIMIT $1 FOR UPDATE SKIP LOCKED",
        )
        .await?;
    let mark = client
        .prepare("UPDATE outbox_event SET published_at = now() WHERE event_id = ANY($1)")
        .await?;
    loop {
        let tx = client.transaction().await?;
        let rows = tx.query(&select, &[&batch]).await?;
        if rows.is_empty() {
            tx.commit().await?;
            return Ok(());
        }
        let mut ids = Vec::with_capacity(rows.len());
        let mut deliveries = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: uuid::Uuid = row.get(0);
            let id_text = id.to_string();
            let (key, event_type, payload): (&str, &str, &str) =
                (row.get(1), row.get(2), row.get(3));
            let mut record = FutureRecord::to(EVENTS_TOPIC)
                .key(key)
                .payload(payload)
                .headers(event_headers(&id_text, event_type));
            loop {
                match producer.send_result(record) {
                    Ok(delivery) => break deliveries.push(delivery),
                    Err((_, returned)) => {
                        record = returned;
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                }
            }
            ids.push(id);
        }
        for delivery in deliveries {
            delivery
                .await
                .map_err(|_| "the producer dropped a delivery")?
                .map_err(|(error, _)| error)?;
        }
        tx.execute(&mark, &[&ids]).await?;
        tx.commit().await?;
    }
}

/// The headers outboxd gives a record (the ones the benchmark's other producers copy).
fn event_headers(event_id: &str, event_type: &str) -> rdkafka::message::OwnedHeaders {
    rdkafka::message::OwnedHeaders::new()
        .insert(rdkafka::message::Header {
            key: "event_id",
            value: Some(event_id),
        })
        .insert(rdkafka::message::Header {
            key: "event_type",
            value: Some(event_type),
        })
}

/// How often a soak run scrapes `/metrics`, for file names and the report: `15s`, or `never`.
pub fn scrape_label(every: Option<Duration>) -> String {
    every.map_or("never".to_string(), |every| {
        humantime::format_duration(every).to_string()
    })
}

/// Settings outboxd would run with against this stack (for its producer configuration).
pub fn outboxd_settings(
    stack: &Stack,
) -> BenchResult<outboxd::config::RunSettings<outboxd::table::TableSpec>> {
    use clap::Parser;
    let cli = outboxd::config::Cli::try_parse_from([
        "outboxd",
        "run",
        "--database-url",
        &stack.pg_url(),
        "--brokers",
        &stack.brokers(),
    ])?;
    match cli.command {
        outboxd::config::Command::Run(options) => Ok(options.run()?),
        _ => Err("unexpected command".into()),
    }
}

async fn create_topic(
    settings: &outboxd::config::RunSettings<outboxd::table::TableSpec>,
    topic: &str,
) -> BenchResult<()> {
    use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
    let admin: AdminClient<rdkafka::client::DefaultClientContext> =
        outboxd::kafka::client_config(settings).create()?;
    let new = NewTopic::new(
        topic,
        settings.kafka.topic_partitions,
        TopicReplication::Fixed(1),
    );
    let _ = admin.create_topics([&new], &AdminOptions::new()).await?;
    Ok(())
}

/// What a backlog is made of, for the sweep: each axis varies one of these from the baseline.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    pub events: usize,
    /// The JSON payload's size in bytes (random text padding it; PostgreSQL cannot compress it).
    pub payload_bytes: usize,
    /// Aggregates the events go to in turn.
    pub aggregates: usize,
    pub events_per_txn: usize,
    /// Outbox tables, every one in the publication, transactions going to each in turn.
    pub tables: usize,
}

impl Shape {
    /// The drain scenario's shape: ~200-byte payloads, 1,000 aggregates, 100 events per transaction, one
    /// table.
    pub fn baseline(events: usize) -> Shape {
        Shape {
            events,
            payload_bytes: 200,
            aggregates: 1_000,
            events_per_txn: EVENTS_PER_TXN,
            tables: 1,
        }
    }

    /// `outbox_event`, then `outbox_event_2` ... for more tables.
    pub fn table_names(&self) -> Vec<String> {
        (1..=self.tables.max(1))
            .map(|n| match n {
                1 => "outbox_event".to_string(),
                n => format!("outbox_event_{n}"),
            })
            .collect()
    }

    /// Random hexadecimal text making the payload `payload_bytes` long (the rest of it is ~45 bytes).
    fn padding(&self) -> String {
        let length = self.payload_bytes.saturating_sub(45);
        let mut text = String::with_capacity(length + 32);
        while text.len() < length {
            text.push_str(&uuid::Uuid::new_v4().simple().to_string());
        }
        text.truncate(length);
        text
    }
}

/// `outboxd migrate` of `tables` (their publication created with them).
pub fn migrate(outboxd: &std::path::Path, url: &str, tables: &[&str]) -> BenchResult<()> {
    let output = std::process::Command::new(outboxd)
        .args([
            "migrate",
            "--database-url",
            url,
            "--table",
            &tables.join(","),
        ])
        .output()?;
    if !output.status.success() {
        return Err(format!("migrate: {}", String::from_utf8_lossy(&output.stderr)).into());
    }
    Ok(())
}

/// The outbox table of every scenario but the sweep's tables axis.
const ONE_TABLE: &[&str] = &["outbox_event"];

/// `published_at` of every row of `tables`, as a FROM item.
fn published_at_of(tables: &[&str]) -> String {
    let selects: Vec<String> = tables
        .iter()
        .map(|table| format!("SELECT published_at FROM {table}"))
        .collect();
    format!("({}) AS rows", selects.join(" UNION ALL "))
}

/// The topic of every scenario's events (outboxd's default template, aggregate type `Order`).
const EVENTS_TOPIC: &str = "outbox.Order";
const STEADY_EVENTS_PER_TXN: usize = 10;

/// Inserts transactions of 10 events at `txns_per_second` until `stop_at`, each event's payload naming its
/// transaction (`txn`) and index (`i`); returns when each transaction's COMMIT returned.
async fn write_at_rate(
    url: &str,
    connection: i32,
    txns_per_second: f64,
    stop_at: Instant,
) -> BenchResult<Vec<observe::Commit>> {
    let (client, driver) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(driver);
    let insert = client
        .prepare(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'Order', 'order-' || (($1::int * 7 + n) % 1000), 'OrderPlaced',
                    jsonb_build_object('txn', $1::int, 'i', n, 'orderId', 'order-' || n, 'total', 99.5,
                                       'note', repeat('x', 100))
             FROM generate_series(1, 10) AS n",
        )
        .await?;
    let wal_position = client
        .prepare("SELECT pg_current_wal_insert_lsn()::text")
        .await?;
    let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / txns_per_second));
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut commits = Vec::new();
    let mut txn = connection * 1_000_000;
    while Instant::now() < stop_at {
        ticker.tick().await;
        client.execute(&insert, &[&txn]).await?;
        let at = std::time::SystemTime::now();
        let wal_after: String = client.query_one(&wal_position, &[]).await?.get(0);
        commits.push(observe::Commit {
            txn,
            at,
            wal_after: wal_after.parse()?,
        });
        txn += 1;
    }
    Ok(commits)
}

/// `/readyz` answers 503 `standby`.
async fn standing_by(addr: &str) -> bool {
    soak::http_get(addr, "/readyz")
        .await
        .is_some_and(|answer| answer.contains("standby"))
}

/// `/readyz` answers 200.
async fn ready(addr: &str) -> bool {
    soak::http_get(addr, "/readyz").await.is_some_and(|answer| {
        answer.starts_with("HTTP/1.1 200") || answer.starts_with("HTTP/1.0 200")
    })
}

/// `outboxd_commit_to_ack_seconds` buckets as (upper bound, cumulative count).
async fn scrape_histogram(addr: &str) -> Option<Vec<(f64, f64)>> {
    let body = soak::http_get(addr, "/metrics").await?;
    let mut buckets = Vec::new();
    for line in body.lines() {
        let Some(rest) = line.strip_prefix("outboxd_commit_to_ack_seconds_bucket{le=\"") else {
            continue;
        };
        let (le, count) = rest.split_once("\"} ")?;
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().ok()?
        };
        buckets.push((le, count.trim().parse().ok()?));
    }
    Some(buckets)
}

/// Prometheus' histogram_quantile: linear interpolation inside the bucket holding the quantile.
pub fn histogram_quantile(buckets: &[(f64, f64)], q: f64) -> f64 {
    let Some(&(_, total)) = buckets.last() else {
        return f64::NAN;
    };
    if total <= 0.0 {
        return f64::NAN;
    }
    let rank = q * total;
    let (mut lower, mut below) = (0.0, 0.0);
    for &(upper, cumulative) in buckets {
        if cumulative >= rank {
            if upper.is_infinite() {
                return lower;
            }
            let inside = cumulative - below;
            return if inside > 0.0 {
                lower + (upper - lower) * (rank - below) / inside
            } else {
                upper
            };
        }
        (lower, below) = (upper, cumulative);
    }
    lower
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_inside_buckets() {
        let buckets = [
            (0.01, 50.0),
            (0.02, 90.0),
            (0.05, 100.0),
            (f64::INFINITY, 100.0),
        ];
        assert!((histogram_quantile(&buckets, 0.5) - 0.01).abs() < 1e-9);
        assert!((histogram_quantile(&buckets, 0.7) - 0.015).abs() < 1e-9);
        assert!((histogram_quantile(&buckets, 0.95) - 0.035).abs() < 1e-9);
        assert!(histogram_quantile(&[], 0.5).is_nan());
    }
}
