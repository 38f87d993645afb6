//! outboxd's memory stays flat under a steady load, in both paths, with nobody scraping `/metrics`: a short
//! version of the benchmark's soak (`outboxd-bench --soak`, same code), against a real PostgreSQL 15 and a
//! real broker. The bound is 2 MiB of RSS growth per million events after warm-up (least-squares slope over
//! the samples): the growth this test was written against was 17-19 MiB per million (every commit-to-ack
//! sample kept until a scrape); a flat process measures within ±1.

mod support;

#[path = "../src/bin/outboxd-bench/soak.rs"]
#[allow(dead_code)]
mod soak;

use std::time::Duration;

use support::*;

/// MiB of RSS per million events after warm-up.
const MAX_GROWTH: f64 = 2.0;

async fn soak_without_scrapes(mode: &str) {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut args = run_args(&url, &brokers);
    args.extend_from_slice(&["--mode", mode, "--metrics-addr", &metrics_addr]);
    let outboxd = Outboxd::spawn_with_env(&args, &[("RUST_LOG", "warn")]);
    let client = pg.client().await;
    if mode == "cdc" {
        wait_slot_active(&client, "outboxd").await;
    }
    let target = soak::Target {
        outboxd_pid: outboxd.pid(),
        sql: &client,
        pg_url: url.clone(),
        metrics_addr: Some(metrics_addr.clone()),
    };
    let plan = soak::Plan {
        events: 500_000,
        rate: 5_000,
        events_per_txn: 5,
        aggregates: 1_000_000,
        scrape_every: None,
        sample_every: Duration::from_secs(1),
        burst_events: 20_000,
        warmup_events: 150_000,
    };
    let result = soak::run(&target, &plan).await.unwrap();
    let growth = result.growth_per_million(soak::Measure::RssMib);
    println!(
        "{mode}: RSS {:?} MiB after warm-up, growth {growth:.2} MiB per million events, {} samples\n{}",
        result.steady_range(soak::Measure::RssMib),
        result.steady().count(),
        result.chart(soak::Measure::RssMib, 60, 10)
    );
    assert!(
        result.steady().count() >= 20,
        "{mode}: too few samples after warm-up to judge growth"
    );
    assert!(
        growth < MAX_GROWTH,
        "{mode}: outboxd's RSS grew {growth:.2} MiB per million events without scrapes (bound {MAX_GROWTH}):\n{}",
        result.chart(soak::Measure::RssMib, 60, 10)
    );
    let (fds_first, fds_last) = result.steady_range(soak::Measure::Fds);
    assert!(
        fds_last <= fds_first + 2.0,
        "{mode}: open descriptors grew from {fds_first} to {fds_last}"
    );
}

/// One test so the two soaks do not share the two cores (and so skew each other's rates).
#[tokio::test(flavor = "multi_thread")]
async fn memory_stays_flat_without_metrics_scrapes() {
    soak_without_scrapes("cdc").await;
    soak_without_scrapes("poll").await;
}
