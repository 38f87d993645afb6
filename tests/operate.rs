//! Operating outboxd: the metrics endpoint, health and readiness, scraped during a real run.

mod support;

use std::time::Duration;

use support::*;

#[tokio::test(flavor = "multi_thread")]
async fn metrics_and_readiness_follow_a_real_run() {
    let pg = Postgres::start();
    migrate(&pg);
    let (_broker, proxy) = Broker::start_behind_proxy();
    let (url, brokers) = (pg.url(), Broker::proxied_addr(&proxy));
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut args = run_args(&url, &brokers);
    args.extend(["--metrics-addr", metrics_addr.as_str()]);
    let _outboxd = Outboxd::spawn(&args);

    let first = wait_for("/metrics to answer", Duration::from_secs(60), || {
        http_get(&metrics_addr, "/metrics")
    });
    assert_eq!(first.0, 200);
    for name in outboxd::metrics::ALL {
        if name == outboxd::metrics::COMMIT_TO_ACK {
            continue; // a histogram has samples once something was acknowledged
        }
        assert!(
            first
                .1
                .lines()
                .any(|l| l.starts_with(name) && !l.starts_with('#')),
            "{name} has no sample line from start-up on:\n{}",
            first.1
        );
    }
    assert_eq!(http_get(&metrics_addr, "/healthz").map(|r| r.0), Some(200));
    let ready = wait_for("/readyz to be 200", Duration::from_secs(60), || {
        http_get(&metrics_addr, "/readyz").filter(|r| r.0 == 200)
    });
    assert!(ready.1.contains("\"mode\":\"cdc\""), "{}", ready.1);

    let mut client = pg.client().await;
    let (committed, _) = insert_events(&mut client, 0, 20, 25, 10, None).await;
    let published = wait_for(
        "the published counter to reach 500",
        Duration::from_secs(60),
        || {
            let (_, text) = http_get(&metrics_addr, "/metrics")?;
            let value = metric_value(&text, "outboxd_events_published_total", "path=\"cdc\"")?;
            (value >= committed.len() as f64).then_some((value, text))
        },
    );
    assert_eq!(
        published.0,
        committed.len() as f64,
        "each acknowledged event is counted once"
    );
    assert!(
        metric_value(&published.1, "outboxd_commit_to_ack_seconds_count", "").unwrap_or(0.0)
            >= 500.0
    );
    assert_eq!(
        metric_value(&published.1, "outboxd_mode", "mode=\"cdc\""),
        Some(1.0)
    );
    wait_for(
        "slot lag to return near zero",
        Duration::from_secs(60),
        || {
            let (_, text) = http_get(&metrics_addr, "/metrics")?;
            let lag = metric_value(&text, "outboxd_slot_lag_bytes", "")?;
            let backlog = metric_value(&text, "outboxd_unpublished_events", "")?;
            (lag < 1_000_000.0 && backlog == 0.0).then_some(())
        },
    );

    // Streaming, caught up: `status` says OK and exits 0.
    let ok = run_outboxd(&["status", "--database-url", &url]);
    assert_eq!(
        ok.status.code(),
        Some(0),
        "{}",
        String::from_utf8_lossy(&ok.stdout)
    );
    assert!(String::from_utf8_lossy(&ok.stdout).contains("OK: "));

    // The broker goes away: not ready, and the oldest unpublished event ages; it comes back: ready again.
    proxy.cut();
    insert_events(&mut client, 20, 1, 5, 5, None).await;
    wait_for(
        "/readyz to be 503 while the broker is unreachable",
        Duration::from_secs(60),
        || http_get(&metrics_addr, "/readyz").filter(|r| r.0 == 503),
    );
    wait_for(
        "the oldest unpublished age to grow",
        Duration::from_secs(60),
        || {
            let (_, text) = http_get(&metrics_addr, "/metrics")?;
            (metric_value(&text, "outboxd_oldest_unpublished_age_seconds", "")? > 1.0).then_some(())
        },
    );
    proxy.restore();
    wait_for("/readyz to be 200 again", Duration::from_secs(90), || {
        http_get(&metrics_addr, "/readyz").filter(|r| r.0 == 200)
    });
    wait_for("the backlog to drain", Duration::from_secs(120), || {
        let (_, text) = http_get(&metrics_addr, "/metrics")?;
        (metric_value(&text, "outboxd_unpublished_events", "")? == 0.0).then_some(())
    });
}

#[test]
fn a_metrics_port_in_use_is_a_clear_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let output = run_outboxd(&[
        "run",
        "--database-url",
        "postgres://postgres@127.0.0.1:1/postgres",
        "--brokers",
        "127.0.0.1:1",
        "--metrics-addr",
        &addr,
    ]);
    assert!(!output.status.success());
    assert!(
        stderr_of(&output).contains("--metrics-addr"),
        "{}",
        stderr_of(&output)
    );
}
