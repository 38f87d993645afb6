//! The soak: a steady load for millions of events (compressed in time) against a running outboxd, with
//! what could grow sampled all along: outboxd's resident memory, open file descriptors and threads, the
//! private memory of its PostgreSQL backends (walsender and SQL sessions, from `/proc/PID/smaps_rollup`),
//! slot lag and backlog. `/metrics` is scraped on a schedule or never. The growth per million events after
//! warm-up is a least-squares slope over every sample, so a single outlier does not decide it (a lasting step
//! of h MiB in the middle of a window of L million events still counts as about 1.5·h/L).
//!
//! Owns the load, the sampling and the analysis; not the stack (the caller starts PostgreSQL, the broker
//! and outboxd and says where they are). Self-contained so that the CI test (`tests/it/soak.rs`) runs the same
//! code: it includes this file by path.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio_postgres::Client;

pub type SoakResult<T> = Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// `application_name` of the soak's own connections, so they are not counted as outboxd's backends.
const LOAD_APPLICATION: &str = "outboxd-soak";

/// What to run.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Events to insert in all.
    pub events: u64,
    /// Offered events per second.
    pub rate: u64,
    pub events_per_txn: u32,
    /// Aggregate ids are drawn at random from this many.
    pub aggregates: u32,
    /// `/metrics` scraped this often, or never.
    pub scrape_every: Option<Duration>,
    pub sample_every: Duration,
    /// A backlog inserted at once before the steady load (transactions of 100), so that outboxd's in-flight
    /// window fills once and the allocator reaches its high-water mark during warm-up: what follows then
    /// shows growth, not the first peak of a load spike.
    pub burst_events: u64,
    /// Samples before this many published events are left out of the growth (allocator and caches warm up).
    pub warmup_events: u64,
}

/// Where outboxd and its database are.
pub struct Target<'a> {
    pub outboxd_pid: u32,
    /// A monitoring connection (its own backend is not counted as outboxd's).
    pub sql: &'a Client,
    /// For the load's connections.
    pub pg_url: String,
    /// outboxd's `--metrics-addr` (scraped only when the plan says so).
    pub metrics_addr: Option<String>,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct Sample {
    pub seconds: f64,
    pub inserted: u64,
    /// Inserted minus backlog: the events outboxd has finished (`inserted` counts a transaction from just
    /// before it is sent, so this runs ahead by at most one transaction per load connection).
    pub published: u64,
    pub rss_kib: u64,
    /// The anonymous part of RSS (heap, stacks, allocator arenas); the rest is mostly the binary's pages.
    pub rss_anon_kib: u64,
    pub fds: u64,
    pub threads: u64,
    /// Private (anonymous) memory of outboxd's PostgreSQL backends, summed.
    pub backends_kib: u64,
    /// The walsender's part of it (logical decoding).
    pub walsender_kib: u64,
    pub backends: u64,
    pub slot_lag_bytes: i64,
    pub backlog: i64,
}

/// The samples of one soak and what they show.
#[derive(Debug, Clone)]
pub struct Soak {
    pub samples: Vec<Sample>,
    pub warmup_events: u64,
    pub seconds: f64,
}

/// A sampled quantity the soak reports growth for.
#[derive(Debug, Clone, Copy)]
pub enum Measure {
    RssMib,
    RssAnonMib,
    Fds,
    Threads,
    BackendsMib,
}

impl Measure {
    pub fn of(self, sample: &Sample) -> f64 {
        match self {
            Measure::RssMib => sample.rss_kib as f64 / 1024.0,
            Measure::RssAnonMib => sample.rss_anon_kib as f64 / 1024.0,
            Measure::Fds => sample.fds as f64,
            Measure::Threads => sample.threads as f64,
            Measure::BackendsMib => sample.backends_kib as f64 / 1024.0,
        }
    }
}

impl Soak {
    /// Samples after warm-up.
    pub fn steady(&self) -> impl Iterator<Item = &Sample> {
        self.samples
            .iter()
            .filter(move |s| s.published >= self.warmup_events)
    }

    /// Growth of `measure` per million published events after warm-up (least-squares slope).
    pub fn growth_per_million(&self, measure: Measure) -> f64 {
        let points: Vec<(f64, f64)> = self
            .steady()
            .map(|s| (s.published as f64 / 1e6, measure.of(s)))
            .collect();
        slope(&points)
    }

    /// First and last value of `measure` after warm-up.
    pub fn steady_range(&self, measure: Measure) -> (f64, f64) {
        let mut steady = self.steady();
        let first = steady.next().map_or(f64::NAN, |s| measure.of(s));
        let last = self.steady().last().map_or(f64::NAN, |s| measure.of(s));
        (first, last)
    }

    pub fn max_of(&self, f: impl Fn(&Sample) -> f64) -> f64 {
        self.samples.iter().map(f).fold(f64::NAN, f64::max)
    }

    pub fn csv(&self) -> String {
        let mut csv = String::from("seconds,inserted,published,rss_kib,rss_anon_kib,fds,threads,backends_kib,walsender_kib,backends,slot_lag_bytes,backlog\n");
        for s in &self.samples {
            let _ = writeln!(
                csv,
                "{:.1},{},{},{},{},{},{},{},{},{},{},{}",
                s.seconds,
                s.inserted,
                s.published,
                s.rss_kib,
                s.rss_anon_kib,
                s.fds,
                s.threads,
                s.backends_kib,
                s.walsender_kib,
                s.backends,
                s.slot_lag_bytes,
                s.backlog
            );
        }
        csv
    }

    /// `measure` against published events as a text chart, `width` × `height` characters; `|` marks the
    /// end of warm-up.
    pub fn chart(&self, measure: Measure, width: usize, height: usize) -> String {
        let points: Vec<(f64, f64)> = self
            .samples
            .iter()
            .map(|s| (s.published as f64, measure.of(s)))
            .collect();
        chart(&points, self.warmup_events as f64, width, height)
    }
}

/// Least-squares slope of y over x; 0 with fewer than two distinct x.
pub fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    if points.len() < 2 {
        return 0.0;
    }
    let mean_x = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_y = points.iter().map(|p| p.1).sum::<f64>() / n;
    let (mut sxy, mut sxx) = (0.0, 0.0);
    for &(x, y) in points {
        sxy += (x - mean_x) * (y - mean_y);
        sxx += (x - mean_x) * (x - mean_x);
    }
    if sxx == 0.0 {
        0.0
    } else {
        sxy / sxx
    }
}

/// A text chart of `points` (x ascending): one column per x bucket, the highest y of the bucket drawn.
pub fn chart(points: &[(f64, f64)], mark_x: f64, width: usize, height: usize) -> String {
    let (width, height) = (width.max(2), height.max(2));
    let Some(x_max) = points.iter().map(|p| p.0).reduce(f64::max) else {
        return String::from("(no samples)\n");
    };
    let y_min = points.iter().map(|p| p.1).fold(f64::INFINITY, f64::min);
    let y_max = points.iter().map(|p| p.1).fold(f64::NEG_INFINITY, f64::max);
    let y_span = (y_max - y_min).max(1e-9);
    let x_max = x_max.max(1.0);
    let column = |x: f64| (((x / x_max) * (width - 1) as f64).round() as usize).min(width - 1);
    let mut top: Vec<Option<f64>> = vec![None; width];
    for &(x, y) in points {
        let c = column(x);
        top[c] = Some(top[c].map_or(y, |t: f64| t.max(y)));
    }
    let mark = column(mark_x);
    let mut out = String::new();
    for row in (0..height).rev() {
        let label = y_min + y_span * row as f64 / (height - 1) as f64;
        let decimals = if y_span < 2.0 { 2 } else { 1 };
        let _ = write!(out, "{label:>9.decimals$} ");
        for (c, value) in top.iter().enumerate() {
            let level =
                value.map(|y| (((y - y_min) / y_span) * (height - 1) as f64).round() as usize);
            out.push(match level {
                Some(l) if l == row => '*',
                Some(l) if l > row => ':',
                _ if c == mark => '|',
                _ => ' ',
            });
        }
        out.push('\n');
    }
    let _ = writeln!(
        out,
        "{:>9} 0{:>w$}",
        "",
        format!("{:.2}M events", x_max / 1e6),
        w = width - 1
    );
    out
}

/// Runs the load until `plan.events` are inserted and outboxd has caught up, sampling all along.
pub async fn run(target: &Target<'_>, plan: &Plan) -> SoakResult<Soak> {
    let inserted = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let txns_per_second = plan.rate.max(1) as f64 / plan.events_per_txn.max(1) as f64;
    // One connection commits a few hundred small transactions a second with room to spare.
    let connections = (txns_per_second / 400.0).ceil().max(1.0) as u64;
    let started = Instant::now();
    // Idle: connected, streaming (CDC), nothing to do yet.
    let mut samples = vec![sample(target, started, 0).await?];
    if plan.burst_events > 0 {
        insert_burst(&application_url(&target.pg_url), plan).await?;
        inserted.store(plan.burst_events, Ordering::Relaxed);
    }
    let mut writers = Vec::new();
    for c in 0..connections {
        let load = Load {
            url: application_url(&target.pg_url),
            txns_per_second: txns_per_second / connections as f64,
            events_per_txn: plan.events_per_txn,
            aggregates: plan.aggregates,
            budget: plan.events,
        };
        let (inserted, stop) = (inserted.clone(), stop.clone());
        writers.push(tokio::spawn(
            async move { load.run(c, inserted, stop).await },
        ));
    }
    let cleanup = tokio::spawn(delete_published(
        application_url(&target.pg_url),
        stop.clone(),
    ));
    let scraper = match (plan.scrape_every, &target.metrics_addr) {
        (Some(every), Some(addr)) => Some(tokio::spawn(scrape(addr.clone(), every, stop.clone()))),
        (Some(_), None) => return Err("scraping needs outboxd's --metrics-addr".into()),
        _ => None,
    };

    let mut ticker = tokio::time::interval(plan.sample_every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // Generous: three times the planned duration, plus five minutes to drain.
    let deadline = started
        + Duration::from_secs_f64(3.0 * plan.events as f64 / plan.rate.max(1) as f64 + 300.0);
    let result = loop {
        ticker.tick().await;
        if Instant::now() > deadline {
            let backlog = samples.last().map_or(0, |s: &Sample| s.backlog);
            break Err(format!("the soak did not finish in time (backlog {backlog})").into());
        }
        let sample = match sample(target, started, inserted.load(Ordering::Relaxed)).await {
            Ok(sample) => sample,
            Err(e) => break Err(e),
        };
        samples.push(sample);
        // A connection stops when the budget is spent, or on an error (found when it is joined below).
        let stopped = writers.iter().any(|w| w.is_finished());
        let budget_spent =
            inserted.load(Ordering::Relaxed) + plan.events_per_txn as u64 > plan.events;
        if stopped && !budget_spent {
            break Err("a load connection stopped early".into());
        }
        if writers.iter().all(|w| w.is_finished()) && sample.backlog == 0 {
            break Ok(());
        }
    };
    stop.store(true, Ordering::Relaxed);
    for writer in writers {
        writer.await??;
    }
    cleanup.await??;
    if let Some(scraper) = scraper {
        scraper.await?;
    }
    result?;
    Ok(Soak {
        samples,
        warmup_events: plan.warmup_events,
        seconds: started.elapsed().as_secs_f64(),
    })
}

fn application_url(url: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}application_name={LOAD_APPLICATION}")
}

/// The plan's burst, in transactions of 100 events.
async fn insert_burst(url: &str, plan: &Plan) -> SoakResult<()> {
    let (client, driver) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
    tokio::spawn(driver);
    let insert = client.prepare(INSERT).await?;
    let aggregates = plan.aggregates as i32;
    let mut left = plan.burst_events;
    while left > 0 {
        let n = left.min(100);
        client
            .execute(&insert, &[&-1i64, &aggregates, &(n as i32)])
            .await?;
        left -= n;
    }
    Ok(())
}

/// `$3` events of random aggregates among `$2`, from load connection `$1`, ~200-byte JSON payloads.
const INSERT: &str = "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
     SELECT gen_random_uuid(), 'Order', 'order-' || floor(random() * $2::int)::int, 'OrderPlaced',
            jsonb_build_object('connection', $1::int8, 'n', n, 'total', 99.5, 'note', repeat('x', 120))
     FROM generate_series(1, $3::int) AS n";

/// One load connection: transactions of `events_per_txn` at its share of the rate, the way an order service
/// inserts (one INSERT per transaction, random aggregates), until the shared budget is spent.
struct Load {
    url: String,
    txns_per_second: f64,
    events_per_txn: u32,
    aggregates: u32,
    budget: u64,
}

impl Load {
    async fn run(
        self,
        connection: u64,
        inserted: Arc<AtomicU64>,
        stop: Arc<AtomicBool>,
    ) -> SoakResult<()> {
        let (client, driver) = tokio_postgres::connect(&self.url, tokio_postgres::NoTls).await?;
        tokio::spawn(driver);
        let insert = client.prepare(INSERT).await?;
        let per_txn = self.events_per_txn as u64;
        let mut ticker = tokio::time::interval(Duration::from_secs_f64(1.0 / self.txns_per_second));
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
        let (connection, aggregates, events_per_txn) = (
            connection as i64,
            self.aggregates as i32,
            self.events_per_txn as i32,
        );
        while !stop.load(Ordering::Relaxed) {
            ticker.tick().await;
            // Claim the events before inserting so the connections together never exceed the budget.
            if inserted.fetch_add(per_txn, Ordering::Relaxed) + per_txn > self.budget {
                inserted.fetch_sub(per_txn, Ordering::Relaxed);
                break;
            }
            client
                .execute(&insert, &[&connection, &aggregates, &events_per_txn])
                .await?;
        }
        Ok(())
    }
}

/// What a retention job does: deletes published rows older than 10 s, every 10 s (the table stays small,
/// as in a deployment that keeps its outbox trimmed).
async fn delete_published(url: String, stop: Arc<AtomicBool>) -> SoakResult<()> {
    let (client, driver) = tokio_postgres::connect(&url, tokio_postgres::NoTls).await?;
    tokio::spawn(driver);
    let mut waited = Duration::ZERO;
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        waited += Duration::from_millis(200);
        if waited >= Duration::from_secs(10) {
            waited = Duration::ZERO;
            client
                .batch_execute(
                    "DELETE FROM outbox_event WHERE published_at < now() - interval '10 seconds'",
                )
                .await?;
        }
    }
    Ok(())
}

/// GET /metrics every `every` (the body is read and dropped), as Prometheus would.
async fn scrape(addr: String, every: Duration, stop: Arc<AtomicBool>) {
    let mut next = Instant::now() + every;
    while !stop.load(Ordering::Relaxed) {
        tokio::time::sleep(Duration::from_millis(200)).await;
        if Instant::now() < next {
            continue;
        }
        next += every;
        let _ = http_get(&addr, "/metrics").await;
    }
}

/// `GET path` over HTTP/1.0: the whole answer (status line, headers, body), or `None` when it fails.
pub async fn http_get(addr: &str, path: &str) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr).await.ok()?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    stream.write_all(request.as_bytes()).await.ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).await.ok()?;
    Some(answer)
}

async fn sample(target: &Target<'_>, started: Instant, inserted: u64) -> SoakResult<Sample> {
    let pid = target.outboxd_pid;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let state = status
        .lines()
        .find_map(|l| l.strip_prefix("State:"))
        .map(str::trim);
    if state.is_none_or(|s| s.starts_with('Z') || s.starts_with('X')) {
        return Err(format!("outboxd (pid {pid}) is no longer running: see its log").into());
    }
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .unwrap_or(0)
    };
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count() as u64;
    let row = target
        .sql
        .query_one(
            "SELECT (SELECT count(*) FROM outbox_event WHERE published_at IS NULL),
                    (SELECT coalesce(max(pg_current_wal_lsn() - confirmed_flush_lsn), 0)::int8 FROM pg_replication_slots),
                    (SELECT coalesce(array_agg(pid), '{}') FROM pg_stat_activity
                      WHERE backend_type IN ('client backend', 'walsender') AND pid <> pg_backend_pid()
                        AND application_name <> $1),
                    (SELECT coalesce(array_agg(pid), '{}') FROM pg_stat_activity WHERE backend_type = 'walsender')",
            &[&LOAD_APPLICATION],
        )
        .await?;
    let backlog: i64 = row.get(0);
    let backend_pids: Vec<i32> = row.get(2);
    let walsender_pids: Vec<i32> = row.get(3);
    let backends_kib = backend_pids.iter().map(|&p| private_kib(p)).sum();
    let walsender_kib = walsender_pids.iter().map(|&p| private_kib(p)).sum();
    Ok(Sample {
        seconds: started.elapsed().as_secs_f64(),
        inserted,
        published: inserted.saturating_sub(backlog.max(0) as u64),
        rss_kib: field("VmRSS:"),
        rss_anon_kib: field("RssAnon:"),
        fds,
        threads: field("Threads:"),
        backends_kib,
        walsender_kib,
        backends: backend_pids.len() as u64,
        slot_lag_bytes: row.get(1),
        backlog,
    })
}

/// A backend's private memory: anonymous pages only, so the shared buffers it touched are not counted (0 when
/// its `/proc` is unreadable: run as root or as the server's user).
fn private_kib(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Anonymous:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slope_is_growth_per_unit() {
        assert!((slope(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]) - 2.0).abs() < 1e-9);
        assert_eq!(slope(&[(1.0, 1.0)]), 0.0);
        assert_eq!(slope(&[(1.0, 1.0), (1.0, 2.0)]), 0.0);
        // A one-sample spike in the middle of a flat line counts far less than a steady climb to its height.
        let step: Vec<(f64, f64)> = (0..100)
            .map(|i| (i as f64, if i == 50 { 10.0 } else { 0.0 }))
            .collect();
        assert!(slope(&step).abs() < 0.01);
    }

    #[test]
    fn growth_leaves_out_warm_up() {
        let samples = (0..=10u64)
            .map(|i| Sample {
                published: i * 100_000,
                // Climbs 10 MiB during warm-up, then flat.
                rss_kib: if i < 3 { i * 5 * 1024 } else { 10 * 1024 },
                ..Sample::default()
            })
            .collect();
        let soak = Soak {
            samples,
            warmup_events: 300_000,
            seconds: 1.0,
        };
        assert!(soak.growth_per_million(Measure::RssMib).abs() < 1e-9);
        assert_eq!(soak.steady_range(Measure::RssMib), (10.0, 10.0));
    }

    #[test]
    fn chart_draws_every_column_and_the_warm_up_mark() {
        let points: Vec<(f64, f64)> = (0..=9).map(|i| (i as f64 * 1e5, i as f64)).collect();
        let text = chart(&points, 3e5, 10, 5);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 6);
        // The top row holds only the highest point, in the last column.
        assert!(lines[0].ends_with('*'), "{text}");
        assert_eq!(lines[4].matches('*').count(), 2, "{text}");
        assert!(lines[1].contains('|'), "{text}");
        assert!(lines[5].contains("0.90M events"), "{text}");
    }
}
