//! `outboxd-bench`: measures outboxd against its limits on a local PostgreSQL and Kafka broker it starts
//! itself (the tests' scripts), and prints a markdown table; CSV files go to `--out`.
//!
//!     cargo run --release --bin outboxd-bench            # the full run (~25 minutes)
//!     cargo run --release --bin outboxd-bench -- --quick # a smoke run (CI)
//!     cargo run --release --bin outboxd-bench -- --only drain,sweep
//!
//! Scenarios: drain of a backlog built while outboxd was stopped, against the source limit (pg_recvlogical),
//! the sink limit (a plain rdkafka producer) and the backfill limit (batched UPDATEs by event_id); the same
//! backlog through `--mode poll` with 1 and 4 instances and through the plain `SKIP LOCKED` pollers (Rust,
//! Python); steady insert rates in each mode (latency percentiles, CPU per event of every component); one big transaction (duration, peak RSS); the sweep
//! (`sweep`: how the cost per event grows with payload size, aggregates, events per transaction, backlog and
//! outbox tables); the takeover (`takeover`: a standby leading after the leader is SIGKILLed). Each drain reports the whole system's cost per event (CPU of outboxd, PostgreSQL and the
//! broker, WAL bytes) next to the limits' own, after the stack was warmed up.
//!
//!     cargo run --release --bin outboxd-bench -- --soak  # memory over 10 million events per run (`soak`)

mod observe;
// The tests' port picker: ports below the ephemeral range (why: the file's doc comment).
#[path = "../../../tests/support/ports.rs"]
mod ports;
mod scenarios;
mod soak;
mod stack;
mod sweep;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;

use scenarios::{Bench, PlainPoller, Steady};
use stack::{BenchResult, Stack};

#[derive(Parser)]
#[command(about = "Benchmark outboxd against the limits of its source, sink and backfill")]
struct Args {
    /// Events in the drain backlog.
    #[arg(long, default_value_t = 200_000)]
    backlog: usize,
    /// Events in the big-transaction scenario.
    #[arg(long, default_value_t = 1_000_000)]
    big: usize,
    /// Seconds per steady rate.
    #[arg(long, default_value_t = 30)]
    steady_secs: u64,
    /// Steady insert rates (events/s); higher ones are tried after them to find the highest sustainable.
    #[arg(long, value_delimiter = ',', default_value = "500,2000,5000,10000")]
    rates: Vec<u64>,
    /// A small, fast run (CI smoke test): small backlog and big transaction, short steady runs.
    #[arg(long)]
    quick: bool,
    /// Only the drain scenarios (CDC with its limits, polling), e.g. while profiling: `--only drain`.
    #[arg(long)]
    drain_only: bool,
    /// Only these parts of the run, comma-separated [default: all].
    #[arg(long, value_enum, value_delimiter = ',')]
    only: Vec<Part>,
    /// Events per point of the sweep (fewer for large payloads; the backlog axis sets its own).
    #[arg(long, default_value_t = 100_000)]
    sweep_events: usize,
    /// An extra argument for every outboxd run, repeatable (e.g. `--outboxd-arg=--kafka-option=linger.ms=20`).
    #[arg(long, allow_hyphen_values = true)]
    outboxd_arg: Vec<String>,
    /// Only the soak: a steady load per mode, once with `/metrics` scraped and once never, with outboxd's
    /// memory, descriptors, threads and its PostgreSQL backends' memory sampled (`--quick`: 300,000 events).
    #[arg(long)]
    soak: bool,
    /// Events per soak run.
    #[arg(long, default_value_t = 10_000_000)]
    soak_events: u64,
    /// Offered events per second in the soak.
    #[arg(long, default_value_t = 10_000)]
    soak_rate: u64,
    /// Events per transaction in the soak.
    #[arg(long, default_value_t = 5)]
    soak_events_per_txn: u32,
    /// Aggregates the soak's events are spread over (at random).
    #[arg(long, default_value_t = 1_000_000)]
    soak_aggregates: u32,
    /// Modes to soak.
    #[arg(long, value_delimiter = ',', default_value = "cdc,poll")]
    soak_modes: Vec<String>,
    /// How often `/metrics` is scraped in each soak run (`never`: not at all).
    #[arg(long, value_delimiter = ',', default_value = "15s,never")]
    soak_scrape: Vec<String>,
    /// Fail (exit 1) when outboxd's RSS or its anonymous part grows faster than this after warm-up, in MiB
    /// per million events.
    #[arg(long)]
    max_growth: Option<f64>,
    /// Published events per `outboxd audit` (the audit part).
    #[arg(long, value_delimiter = ',', default_value = "10000,100000,1000000")]
    audit_sizes: Vec<usize>,
    /// Where the results (markdown, CSV) go.
    #[arg(long, default_value = "target/bench")]
    out: PathBuf,
}

/// A part of the benchmark run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
enum Part {
    /// The drains, their limits and the whole system's cost per event.
    Drain,
    /// The steady rates in each mode.
    Steady,
    /// One big transaction.
    Big,
    /// How cost grows along each axis of a backlog's shape.
    Sweep,
    /// A standby taking over after the leader is SIGKILLed.
    Takeover,
    /// `outboxd audit` over 10k, 100k and 1M published events (`--audit-sizes`): time, peak RSS, records
    /// read per second.
    Audit,
}

#[tokio::main]
async fn main() {
    if let Err(error) = run(Args::parse()).await {
        let mut message = error.to_string();
        let mut source = error.source();
        while let Some(cause) = source {
            message = format!("{message}: {cause}");
            source = cause.source();
        }
        eprintln!("error: {message}");
        std::process::exit(1);
    }
}

async fn run(mut args: Args) -> BenchResult<()> {
    if args.quick {
        args.backlog = args.backlog.min(20_000);
        args.big = args.big.min(50_000);
        args.steady_secs = args.steady_secs.min(3);
        args.rates = vec![500, 2_000];
        args.sweep_events = args.sweep_events.min(5_000);
    }
    if args.quick && args.soak {
        args.soak_events = args.soak_events.min(300_000);
    }
    if args.drain_only {
        args.only = vec![Part::Drain];
    }
    let runs = |part: Part| args.only.is_empty() || args.only.contains(&part);
    std::fs::create_dir_all(&args.out)?;
    let (bench, machine) = start_stack(&args).await?;
    if args.soak {
        return soak_runs(&bench, &args, &machine).await;
    }

    let mut results = Results::default();
    if runs(Part::Drain) {
        eprintln!("drain: {} events ...", args.backlog);
        let (drain, limits) = bench.drain(args.backlog).await?;
        eprintln!("drain, exactly-once: {} events ...", args.backlog);
        let exactly_once_drain = bench.exactly_once_drain(args.backlog).await?;
        eprintln!("poll drain ...");
        results.drains = Some(Drains {
            drain,
            exactly_once_drain,
            limits,
            poll_one: bench.poll_drain(1).await?,
            poll_four: bench.poll_drain(4).await?,
            plain_rust: bench
                .plain_poll_drain(PlainPoller::Rust, PLAIN_POLLER_BATCH)
                .await?,
            plain_python: bench
                .plain_poll_drain(PlainPoller::Python, PLAIN_POLLER_BATCH)
                .await?,
        });
    }
    if runs(Part::Steady) {
        results.steady = steady_runs(&bench, &args).await?;
    }
    if runs(Part::Big) {
        eprintln!("big transaction: {} events ...", args.big);
        let (seconds, usage) = bench.big_transaction(args.big).await?;
        results.big = Some((args.big, seconds, usage));
    }
    if runs(Part::Sweep) {
        results.sweep = sweep::run(&bench, args.sweep_events, args.quick).await?;
    }
    if runs(Part::Takeover) {
        let rounds = if args.quick { 2 } else { 5 };
        eprintln!("takeover: {rounds} SIGKILLs of the leader ...");
        results.takeovers = bench.takeover(rounds).await?;
    }
    if runs(Part::Audit) {
        let sizes: &[usize] = if args.quick {
            &[2_000, 10_000]
        } else {
            &args.audit_sizes
        };
        for &events in sizes {
            eprintln!("audit: {events} published events ...");
            results.audits.push(bench.audit(events).await?);
        }
    }
    let table = results.table(&machine)?;
    println!("{table}");
    std::fs::write(args.out.join("results.md"), &table)?;
    std::fs::write(args.out.join("steady.csv"), results.steady_csv()?)?;
    if let Some(drains) = &results.drains {
        std::fs::write(args.out.join("drain.csv"), drains.csv(results.big))?;
    }
    std::fs::write(args.out.join("sweep.csv"), sweep::csv(&results.sweep))?;
    eprintln!(
        "wrote {}/results.md and its CSV files (chart: python3 examples/plot_bench.py {}/steady.csv examples/bench-latency.png)",
        args.out.display(),
        args.out.display()
    );
    Ok(())
}

/// The whole system's cost per event of each drain, next to the limits' own: CPU µs of outboxd (the client),
/// PostgreSQL and the broker, and WAL bytes; with the drain's start-up and end.
/// `drains`: CDC, CDC exactly-once, poll with 1 and with 4 instances, the plain pollers in Rust and Python.
fn whole_system_table(
    drains: [&scenarios::Drain; 6],
    limits: &scenarios::Limits,
) -> BenchResult<String> {
    const NAMES: [&str; 6] = [
        "drain, CDC",
        "drain, CDC exactly-once",
        "drain, poll, 1 instance",
        "drain, poll, 4 instances",
        "drain, the plain poller in Rust (client: the poller)",
        "drain, the plain poller in Python (client: the poller)",
    ];
    let mut table = String::new();
    writeln!(table, "| whole system, per event | events/s | start-up s | end s | outboxd µs CPU | PostgreSQL µs CPU | broker µs CPU | total µs CPU | WAL bytes | updates per event | HOT % |")?;
    writeln!(
        table,
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    )?;
    for (name, drain) in NAMES.iter().zip(drains) {
        let cost = drain.per_event();
        let updates = drain.system.updates;
        writeln!(
            table,
            "| {name} | {:.0} | {:.2} | {:.2} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.2} | {} |",
            drain.rate(),
            drain.first_published_after,
            drain.tail_seconds(),
            cost.client_cpu,
            cost.postgres_cpu,
            cost.broker_cpu,
            cost.total_cpu(),
            cost.wal_bytes,
            updates.updates as f64 / drain.events as f64,
            hot_percent(updates)
        )?;
    }
    let events = drains[0].events;
    let source = scenarios::PerEvent::of(0.0, limits.source_cost, events);
    let sink = scenarios::PerEvent::of(0.0, limits.sink_cost, events);
    let backfill = scenarios::PerEvent::of(0.0, limits.backfill_cost, events);
    writeln!(
        table,
        "| source limit (pg_recvlogical; its own CPU not counted) | {:.0} | | | | {:.1} | | | |",
        limits.source, source.postgres_cpu
    )?;
    writeln!(
        table,
        "| sink limit (rdkafka producer; its own CPU not counted) | {:.0} | | | | | {:.1} | | |",
        limits.sink, sink.broker_cpu
    )?;
    writeln!(
        table,
        "| backfill limit (UPDATE by event_id) | {:.0} | | | | {:.1} | | | {:.0} | | {} |",
        limits.backfill,
        backfill.postgres_cpu,
        backfill.wal_bytes,
        hot_percent(limits.backfill_cost.updates)
    )?;
    writeln!(
        table,
        "| the three alone, added up | | | | | {:.1} | {:.1} | {:.1} | {:.0} |",
        source.postgres_cpu + backfill.postgres_cpu,
        sink.broker_cpu,
        source.postgres_cpu + backfill.postgres_cpu + sink.broker_cpu,
        backfill.wal_bytes
    )?;
    Ok(table)
}

/// PostgreSQL and the broker started (the tests' scripts), the outbox table migrated; with the machine's
/// description for the report.
async fn start_stack(args: &Args) -> BenchResult<(Bench, String)> {
    let outboxd = stack::outboxd_binary()?;
    // Under the temp dir, not the checkout: the server runs as `postgres`, which may not reach a home directory.
    let stack_dir = std::env::temp_dir().join(format!("outboxd-bench-{}", std::process::id()));
    eprintln!(
        "PostgreSQL, broker and outboxd logs: {}",
        stack_dir.display()
    );
    let stack = Stack::start(&stack_dir)?;
    scenarios::migrate(&outboxd, &stack.pg_url(), &["outbox_event"])?;
    let (sql, driver) = tokio_postgres::connect(&stack.pg_url(), tokio_postgres::NoTls).await?;
    tokio::spawn(driver);
    let machine = describe_machine(&sql).await?;
    let bench = Bench {
        stack,
        outboxd,
        sql,
        outboxd_args: args.outboxd_arg.clone(),
    };
    // Warm as in production: the broker's JVM compiled its hot paths, the events' topic exists, outboxd's
    // binary and PostgreSQL's caches are loaded. Otherwise the first scenario pays for all of it.
    eprintln!("warming up: the broker, then one drain ...");
    bench.warm_up_broker(args.backlog).await?;
    bench
        .shaped_drain(&scenarios::Shape::baseline(args.backlog))
        .await?;
    Ok((bench, machine))
}

/// The steady rates, both modes; beyond `--rates` (unless `--quick`), higher ones until outboxd falls behind.
async fn steady_runs(bench: &Bench, args: &Args) -> BenchResult<Vec<Steady>> {
    let secs = Duration::from_secs(args.steady_secs);
    let mut steady: Vec<Steady> = Vec::new();
    for mode in ["cdc", scenarios::EXACTLY_ONCE, "poll"] {
        for &rate in &args.rates {
            eprintln!("steady {mode} {rate}/s ...");
            steady.push(bench.steady(mode, rate, secs).await?);
        }
        // Exactly-once is measured at the given rates only (its cost next to at least once).
        if !args.quick && mode != scenarios::EXACTLY_ONCE {
            // The highest sustainable rate: climb until outboxd (or the load generator) falls behind.
            let mut rate = args.rates.iter().copied().max().unwrap_or(5_000);
            loop {
                rate = rate * 3 / 2;
                eprintln!("steady {mode} {rate}/s ...");
                let result = bench.steady(mode, rate, secs).await?;
                let sustained = result.sustained();
                steady.push(result);
                if !sustained || rate > 200_000 {
                    break;
                }
            }
        }
    }
    Ok(steady)
}

/// Every figure of a run, for the report and the CSV files; a part not run stays empty.
#[derive(Default)]
struct Results {
    drains: Option<Drains>,
    steady: Vec<Steady>,
    /// Events, seconds from commit to confirmed, outboxd's usage.
    big: Option<(usize, f64, stack::Usage)>,
    sweep: Vec<(sweep::Axis, Vec<sweep::Point>)>,
    takeovers: Vec<scenarios::Takeover>,
    audits: Vec<scenarios::Audited>,
}

/// The drain scenarios with the limits measured on their backlog.
struct Drains {
    drain: scenarios::Drain,
    exactly_once_drain: scenarios::Drain,
    limits: scenarios::Limits,
    poll_one: scenarios::Drain,
    poll_four: scenarios::Drain,
    /// The plain `FOR UPDATE SKIP LOCKED` relays, the polling path's yardsticks.
    plain_rust: scenarios::Drain,
    plain_python: scenarios::Drain,
}

/// Rows per batch of the plain poller: outboxd's `--poll-batch-size` default.
const PLAIN_POLLER_BATCH: i64 = 500;

impl Results {
    /// The markdown report (`results.md`).
    fn table(&self, machine: &str) -> BenchResult<String> {
        let mut table = String::new();
        writeln!(table, "{machine}\n")?;
        if self.drains.is_some() || self.big.is_some() {
            writeln!(
                table,
                "| scenario | events/s | events/s once streaming | CPU µs/event | peak RSS MiB | notes |"
            )?;
            writeln!(table, "| --- | ---: | ---: | ---: | ---: | --- |")?;
        }
        if let Some(drains) = &self.drains {
            drains.rows(&mut table)?;
        }
        if let Some((events, seconds, usage)) = self.big {
            writeln!(
                table,
                "| one transaction of {events} events | {:.0} | | {:.1} | {:.1} | {seconds:.1} s from commit to confirmed |",
                events as f64 / seconds,
                usage.cpu_seconds * 1e6 / events as f64,
                mib(usage.peak_rss_kib),
            )?;
        }
        if let Some(d) = &self.drains {
            writeln!(table)?;
            let drains = [
                &d.drain,
                &d.exactly_once_drain,
                &d.poll_one,
                &d.poll_four,
                &d.plain_rust,
                &d.plain_python,
            ];
            writeln!(table, "{}", whole_system_table(drains, &d.limits)?)?;
        }
        if !self.steady.is_empty() {
            self.steady_rows(&mut table)?;
        }
        for (axis, points) in &self.sweep {
            writeln!(table, "\n```\n{}```", sweep::chart(*axis, points))?;
        }
        if !self.audits.is_empty() {
            writeln!(
                table,
                "\n| outboxd audit of | seconds | records read/s | peak RSS MiB | peak RSS MiB by ¼, ½, ¾ of the run |"
            )?;
            writeln!(table, "| ---: | ---: | ---: | ---: | ---: |")?;
            for audit in &self.audits {
                let [q1, q2, q3, end] = audit.peak_rss_by_quarter_kib.map(mib);
                writeln!(
                    table,
                    "| {} events | {:.1} | {:.0} | {end:.1} | {q1:.1}, {q2:.1}, {q3:.1} |",
                    audit.events,
                    audit.seconds,
                    audit.records as f64 / audit.seconds,
                )?;
            }
        }
        if !self.takeovers.is_empty() {
            let seconds = |of: fn(&scenarios::Takeover) -> f64| {
                let all: Vec<String> = self
                    .takeovers
                    .iter()
                    .map(|t| format!("{:.2}", of(t)))
                    .collect();
                all.join(", ")
            };
            writeln!(
                table,
                "\n| takeover after a SIGKILL of the leader | seconds, each round |"
            )?;
            writeln!(table, "| --- | --- |")?;
            writeln!(
                table,
                "| the standby's /readyz is 200 | {} |",
                seconds(|t| t.ready_after)
            )?;
            writeln!(
                table,
                "| an event inserted right after the kill is published | {} |",
                seconds(|t| t.published_after)
            )?;
        }
        Ok(table)
    }

    /// The steady runs' table.
    fn steady_rows(&self, table: &mut String) -> BenchResult<()> {
        writeln!(table, "| mode | offered/s | inserted/s | published/s | commit → consumer p50 / p99 / p99.9 ms | commit → published_at written (histogram) | created_at → published_at (SQL) | commit → slot confirmed | backlog at end | peak RSS MiB | CPU µs/event: outboxd / PostgreSQL / broker / load | cores busy |")?;
        writeln!(
            table,
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
        )?;
        let ms = |v: [f64; 3]| format!("{:.1} / {:.1} / {:.1}", v[0] * 1e3, v[1] * 1e3, v[2] * 1e3);
        for s in &self.steady {
            writeln!(
                table,
                "| {} | {} | {:.0} | {:.0} | {} | {} | {} | {} | {} | {:.1} | {:.1} / {:.1} / {:.1} / {:.1} | {:.2} |",
                s.mode,
                s.offered,
                s.inserted_per_second,
                s.published_per_second,
                ms(s.commit_to_consumer),
                s.commit_to_published_at_written.map_or("-".into(), ms),
                ms(s.created_to_published_at),
                s.commit_to_confirmed.map_or("-".into(), ms),
                s.backlog_at_end,
                mib(s.peak_rss_kib),
                s.cost.client_cpu,
                s.cost.postgres_cpu,
                s.cost.broker_cpu,
                s.load_cpu,
                s.busy_cores
            )?;
        }
        Ok(())
    }

    /// One line per steady run (`steady.csv`).
    fn steady_csv(&self) -> BenchResult<String> {
        let mut csv = String::from("mode,offered,inserted_per_second,published_per_second");
        for figure in [
            "commit_to_consumer",
            "commit_to_published_at_written",
            "created_to_published_at",
            "commit_to_confirmed",
        ] {
            for quantile in ["p50", "p99", "p999"] {
                write!(csv, ",{figure}_{quantile}")?;
            }
        }
        csv.push_str(",backlog_at_end,peak_rss_kib,outboxd_cpu_us,postgres_cpu_us,broker_cpu_us,load_cpu_us,wal_bytes,busy_cores\n");
        for s in &self.steady {
            write!(
                csv,
                "{},{},{:.1},{:.1}",
                s.mode, s.offered, s.inserted_per_second, s.published_per_second
            )?;
            for figure in [
                Some(s.commit_to_consumer),
                s.commit_to_published_at_written,
                Some(s.created_to_published_at),
                s.commit_to_confirmed,
            ] {
                for value in figure.unwrap_or([f64::NAN; 3]) {
                    write!(csv, ",{value}")?;
                }
            }
            writeln!(
                csv,
                ",{},{},{:.2},{:.2},{:.2},{:.2},{:.0},{:.3}",
                s.backlog_at_end,
                s.peak_rss_kib,
                s.cost.client_cpu,
                s.cost.postgres_cpu,
                s.cost.broker_cpu,
                s.load_cpu,
                s.cost.wal_bytes,
                s.busy_cores
            )?;
        }
        Ok(csv)
    }
}

impl Drains {
    /// The drains' and the limits' lines of the scenario table.
    fn rows(&self, table: &mut String) -> BenchResult<()> {
        let limit = self
            .limits
            .source
            .min(self.limits.sink)
            .min(self.limits.backfill);
        writeln!(
            table,
            "| drain, CDC ({} events) | {:.0} | {:.0} | {:.1} | {:.1} | {:.2} × min(limits) ({:.2} once streaming); {:.1} × one poll instance |",
            self.drain.events,
            self.drain.rate(),
            self.drain.streaming_rate(),
            self.drain.cpu_micros_per_event(),
            mib(self.drain.usage.peak_rss_kib),
            self.drain.rate() / limit,
            self.drain.streaming_rate() / limit,
            self.drain.rate() / self.poll_one.rate()
        )?;
        writeln!(
            table,
            "| drain, CDC with --delivery exactly-once | {:.0} | {:.0} | {:.1} | {:.1} | {:.2} × the at-least-once drain |",
            self.exactly_once_drain.rate(),
            self.exactly_once_drain.streaming_rate(),
            self.exactly_once_drain.cpu_micros_per_event(),
            mib(self.exactly_once_drain.usage.peak_rss_kib),
            self.exactly_once_drain.rate() / self.drain.rate()
        )?;
        for (name, rate) in [
            ("source limit (pg_recvlogical)", self.limits.source),
            ("sink limit (rdkafka producer)", self.limits.sink),
            (
                "backfill limit (UPDATE by event_id, 2,000 per batch)",
                self.limits.backfill,
            ),
        ] {
            writeln!(table, "| {name} | {rate:.0} | | | | |")?;
        }
        for (name, d) in [
            ("drain, poll, 1 instance", self.poll_one),
            ("drain, poll, 4 instances", self.poll_four),
        ] {
            writeln!(
                table,
                "| {name} | {:.0} | {:.0} | {:.1} | {:.1} | CPU of all instances; {:.2} × the plain poller in Rust, {:.2} × in Python |",
                d.rate(),
                d.streaming_rate(),
                d.cpu_micros_per_event(),
                mib(d.usage.peak_rss_kib),
                d.rate() / self.plain_rust.rate(),
                d.rate() / self.plain_python.rate()
            )?;
        }
        for (language, d) in [("Rust", self.plain_rust), ("Python", self.plain_python)] {
            writeln!(
                table,
                "| drain, the plain poller in {language} (SKIP LOCKED, batches of {PLAIN_POLLER_BATCH}, no order or leases) | {:.0} | {:.0} | {:.1} | | |",
                d.rate(),
                d.streaming_rate(),
                d.cpu_micros_per_event(),
            )?;
        }
        Ok(())
    }

    /// The drains, the limits and the big transaction if it ran (`drain.csv`).
    fn csv(&self, big: Option<(usize, f64, stack::Usage)>) -> String {
        let mut csv = String::from(
            "scenario,events,seconds,events_per_second,cpu_us_per_event,peak_rss_kib\n",
        );
        let mut drain = |name: &str, d: &scenarios::Drain| {
            let _ = writeln!(
                csv,
                "{name},{},{:.3},{:.0},{:.2},{}",
                d.events,
                d.seconds,
                d.rate(),
                d.cpu_micros_per_event(),
                d.usage.peak_rss_kib
            );
        };
        drain("drain_cdc", &self.drain);
        drain("drain_cdc_exactly_once", &self.exactly_once_drain);
        drain("drain_poll_1", &self.poll_one);
        drain("drain_poll_4", &self.poll_four);
        drain("drain_plain_poller_rust", &self.plain_rust);
        drain("drain_plain_poller_python", &self.plain_python);
        let events = self.drain.events;
        let _ = writeln!(
            csv,
            "drain_cdc_once_streaming,{events},{:.3},{:.0},,",
            self.drain.streaming_seconds,
            self.drain.streaming_rate()
        );
        for (name, rate) in [
            ("source_limit", self.limits.source),
            ("sink_limit", self.limits.sink),
            ("backfill_limit", self.limits.backfill),
        ] {
            let _ = writeln!(csv, "{name},{events},,{rate:.0},,");
        }
        if let Some((events, seconds, usage)) = big {
            let _ = writeln!(
                csv,
                "big_transaction,{events},{seconds:.3},{:.0},{:.2},{}",
                events as f64 / seconds,
                usage.cpu_seconds * 1e6 / events as f64,
                usage.peak_rss_kib
            );
        }
        csv
    }
}

/// The share of heap-only updates, or a dash without updates.
fn hot_percent(updates: scenarios::TableUpdates) -> String {
    updates
        .hot_percent()
        .map_or("–".to_string(), |p| format!("{p:.0}"))
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// What each soak run does (`--soak-*`), and how often each run scrapes `/metrics` (`None`: never).
fn soak_plan(args: &Args) -> BenchResult<(Vec<Option<Duration>>, soak::Plan)> {
    let mut scrapes = Vec::new();
    for scrape in &args.soak_scrape {
        scrapes.push(match scrape.as_str() {
            "never" => None,
            every => Some(humantime::parse_duration(every).map_err(|e| {
                format!("--soak-scrape {every}: {e} (a duration such as 15s, or never)")
            })?),
        });
    }
    let duration = args.soak_events as f64 / args.soak_rate.max(1) as f64;
    let plan = soak::Plan {
        events: args.soak_events,
        rate: args.soak_rate.max(1),
        events_per_txn: args.soak_events_per_txn.max(1),
        aggregates: args.soak_aggregates.max(1),
        scrape_every: None,
        // About 300 samples a run.
        sample_every: Duration::from_secs_f64((duration / 300.0).clamp(1.0, 10.0)),
        burst_events: 2 * outboxd::config::DEFAULT_MAX_IN_FLIGHT_EVENTS as u64,
        warmup_events: (args.soak_events / 10)
            .max(100_000)
            .min(args.soak_events / 2),
    };
    Ok((scrapes, plan))
}

/// Every soak run the arguments name; prints and writes the table, the charts and one CSV per run.
async fn soak_runs(bench: &Bench, args: &Args, machine: &str) -> BenchResult<()> {
    let (scrapes, plan) = soak_plan(args)?;
    let mut report = format!(
        "{machine}\n\nSoak: {} events per run at {}/s offered, {} per transaction, {} aggregates at random; \
         warm-up {} events; growth is the least-squares slope after warm-up.\n\n\
         | mode | /metrics | events/s | RSS MiB idle | RSS MiB after warm-up → end (max) | RSS growth MiB per M events | anon RSS growth MiB per M | fds | threads | PG backends MiB after warm-up → end | PG growth MiB per M | max slot lag MiB | max backlog |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
        plan.events, plan.rate, plan.events_per_txn, plan.aggregates, plan.warmup_events
    );
    let mut charts = String::new();
    let mut too_fast = Vec::new();
    for mode in &args.soak_modes {
        let mode: &'static str = match mode.as_str() {
            "cdc" => "cdc",
            "poll" => "poll",
            other => return Err(format!("--soak-modes {other}: the modes are cdc and poll").into()),
        };
        for &scrape_every in &scrapes {
            let scraped = scenarios::scrape_label(scrape_every);
            eprintln!(
                "soak {mode}, /metrics scraped {scraped}: {} events ...",
                plan.events
            );
            let result = bench
                .soak(
                    mode,
                    &soak::Plan {
                        scrape_every,
                        ..plan.clone()
                    },
                )
                .await?;
            let name = format!("soak-{mode}-{}", scraped.replace(' ', "-"));
            let scraped = if scrape_every.is_some() {
                format!("every {scraped}")
            } else {
                scraped
            };
            std::fs::write(args.out.join(format!("{name}.csv")), result.csv())?;
            let (growth, anon_growth) =
                soak_row(&mut report, &mut charts, mode, &scraped, &plan, &result)?;
            if args
                .max_growth
                .is_some_and(|bound| growth.max(anon_growth) > bound)
            {
                too_fast.push(format!(
                    "{mode} (scraped {scraped}): RSS {growth:.2}, anonymous {anon_growth:.2} MiB per million events"
                ));
            }
        }
    }
    report.push_str(&charts);
    println!("{report}");
    std::fs::write(args.out.join("soak.md"), &report)?;
    eprintln!("wrote {}/soak.md and soak-*.csv", args.out.display());
    if let Some(bound) = args.max_growth {
        if !too_fast.is_empty() {
            return Err(format!(
                "outboxd's memory grew faster than {bound} MiB per million events: {}",
                too_fast.join("; ")
            )
            .into());
        }
    }
    Ok(())
}

/// One soak run's line of the report, and its chart; returns its RSS growth and anonymous RSS growth (MiB
/// per million events).
fn soak_row(
    report: &mut String,
    charts: &mut String,
    mode: &str,
    scraped: &str,
    plan: &soak::Plan,
    result: &soak::Soak,
) -> BenchResult<(f64, f64)> {
    use soak::Measure::*;
    let (rss_from, rss_to) = result.steady_range(RssMib);
    let (fds_from, fds_to) = result.steady_range(Fds);
    let (threads_from, threads_to) = result.steady_range(Threads);
    let (pg_from, pg_to) = result.steady_range(BackendsMib);
    let growth = result.growth_per_million(RssMib);
    let anon_growth = result.growth_per_million(RssAnonMib);
    writeln!(
        report,
        "| {mode} | {scraped} | {:.0} | {:.1} | {rss_from:.1} → {rss_to:.1} ({:.1}) | {growth:.2} | {:.2} | {fds_from} → {fds_to} | {threads_from} → {threads_to} | {pg_from:.1} → {pg_to:.1} | {:.2} | {:.1} | {:.0} |",
        plan.events as f64 / result.seconds,
        result.samples.first().map_or(f64::NAN, |s| RssMib.of(s)),
        result.max_of(|s| RssMib.of(s)),
        anon_growth,
        result.growth_per_million(BackendsMib),
        result.max_of(|s| s.slot_lag_bytes as f64) / 1048576.0,
        result.max_of(|s| s.backlog as f64),
    )?;
    writeln!(
        charts,
        "\noutboxd RSS (MiB) against published events, {mode}, /metrics scraped {scraped}:\n```\n{}```",
        result.chart(RssMib, 60, 12)
    )?;
    Ok((growth, anon_growth))
}

/// Cores, CPU model, memory and versions, for the report's first line.
async fn describe_machine(sql: &tokio_postgres::Client) -> BenchResult<String> {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|m| m.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let memory_gib = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        })
        .map_or(0.0, |kib| kib / 1024.0 / 1024.0);
    let postgres: String = sql.query_one("SHOW server_version", &[]).await?.get(0);
    let (_, librdkafka) = rdkafka::util::get_rdkafka_version();
    Ok(format!(
        "Measured {} on {cores} cores ({model}), {memory_gib:.0} GiB; PostgreSQL {postgres}, {}, librdkafka {librdkafka}, outboxd {}; everything on one machine.",
        std::process::Command::new("date")
            .arg("+%Y-%m-%d")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .unwrap_or_default()
            .trim(),
        // The broker tests/support/broker.sh starts.
        if std::env::var("OUTBOXD_TEST_BROKER").as_deref() == Ok("tansu") {
            "tansu 0.6.0"
        } else {
            "Apache Kafka 4.1.1 (one KRaft node)"
        },
        env!("CARGO_PKG_VERSION"),
    ))
}
