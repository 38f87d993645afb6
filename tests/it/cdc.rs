//! End-to-end tests of the CDC fast path against a real PostgreSQL 15 and a real Kafka-protocol broker.

use std::time::{Duration, Instant};

use crate::support::*;
use outboxd::lsn::Lsn;

#[tokio::test(flavor = "multi_thread")]
async fn delivers_every_committed_event_in_order_with_headers() {
    let (pg, _broker) = migrated_stack();
    let (url, brokers) = (pg.url(), _broker.addr());
    let _outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    let mut client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;

    let started = Instant::now();
    // 200 committed transactions of 25 events over 50 aggregates, plus 20 rolled-back ones.
    let (committed, rolled_back) = insert_events(&mut client, 0, 220, 25, 50, Some(11)).await;
    assert_eq!(committed.len(), 5_000);
    assert_eq!(rolled_back.len(), 500);
    let last_commit_end = current_wal_lsn(&client).await;

    let (records, report) = verify_delivery(
        &brokers,
        &committed,
        &rolled_back,
        120,
        &format!("delivered in {:?}", started.elapsed()),
    );
    assert_eq!(
        report.duplicates, 0,
        "no failures happened, so nothing should be re-sent"
    );

    // Every record carries the key, value and headers a consumer relies on.
    let rows = client
        .query(
            "SELECT event_id::text, aggregate_id, event_type, payload FROM outbox_event",
            &[],
        )
        .await
        .unwrap();
    let by_id: std::collections::HashMap<String, (String, String, serde_json::Value)> = rows
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3))))
        .collect();
    for record in &records {
        let id = &record.headers["event_id"];
        assert_eq!(id, &id.to_lowercase());
        let (aggregate_id, event_type, payload) = &by_id[id];
        assert_eq!(record.key.as_deref(), Some(aggregate_id.as_str()));
        assert_eq!(&record.headers["event_type"], event_type);
        assert_eq!(record.headers["aggregate_type"], "Order");
        let created_at = &record.headers["created_at"];
        assert!(
            created_at.contains('T') && created_at.ends_with('Z'),
            "not RFC 3339: {created_at}"
        );
        let value: serde_json::Value =
            serde_json::from_slice(record.value.as_deref().unwrap()).unwrap();
        assert_eq!(&value, payload);
        // Keys land on the partition a Java producer (murmur2) would choose; the topic has 6 partitions.
        assert_eq!(
            record.partition,
            java_partition(aggregate_id.as_bytes(), 6),
            "key {aggregate_id}"
        );
    }

    wait_all_published(&client, Duration::from_secs(60)).await;
    let confirmed = wait_for_async(
        "the slot to confirm the last commit",
        Duration::from_secs(60),
        || async {
            let confirmed = confirmed_flush(&client, "outboxd").await;
            (confirmed >= last_commit_end).then_some(confirmed)
        },
    )
    .await;
    println!("confirmed_flush_lsn {confirmed} >= last commit end {last_commit_end}");
}

#[tokio::test(flavor = "multi_thread")]
async fn idle_outbox_does_not_hold_wal() {
    let (pg, _broker) = migrated_stack();
    let (url, brokers) = (pg.url(), _broker.addr());
    let _outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    let mut client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    let (committed, _) = insert_events(&mut client, 0, 2, 5, 5, None).await;
    consume_all(&brokers, &[TOPIC], committed.len(), Duration::from_secs(60));

    // 20 MB of writes to another table: the outbox sees no transaction at all.
    client
        .batch_execute("CREATE TABLE filler (id bigserial, body text)")
        .await
        .unwrap();
    client
        .batch_execute(
            "INSERT INTO filler (body) SELECT repeat('x', 1000) FROM generate_series(1, 20000)",
        )
        .await
        .unwrap();
    let wal_after_filler = current_wal_lsn(&client).await;
    let lag = |confirmed: Lsn| wal_after_filler.bytes_since(confirmed);
    let start_lag = lag(confirmed_flush(&client, "outboxd").await);
    println!("lag right after 20 MB of other writes: {start_lag} bytes");
    let lag_bytes: i64 = wait_for_async("slot lag under 1 MB", Duration::from_secs(10), || async {
        let row = client
            .query_one(
                "SELECT (pg_current_wal_lsn() - confirmed_flush_lsn)::int8 FROM pg_replication_slots WHERE slot_name = 'outboxd'",
                &[],
            )
            .await
            .unwrap();
        let lag: i64 = row.get(0);
        (lag < 1_000_000).then_some(lag)
    })
    .await;
    println!("slot lag settled at {lag_bytes} bytes");
}

/// Four SIGKILLs, each landing while a backlog is being published (some but not all of the round has
/// `published_at` when the process dies): nothing is lost, nothing rolled back appears, and each kill re-sends
/// at most the in-flight window.
#[tokio::test(flavor = "multi_thread")]
async fn sigkill_mid_stream_loses_nothing() {
    let (pg, _broker) = migrated_stack();
    let (url, brokers) = (pg.url(), _broker.addr());
    let window = WINDOW.to_string();
    let mut client = pg.client().await;
    create_slot_then_stop(&url, &brokers, &client).await;

    let mut committed = Vec::new();
    let mut rolled_back = Vec::new();
    const KILLS: usize = 4;
    for round in 0..KILLS {
        // The round waits in the WAL while outboxd is down, so the kill can land mid-round.
        let (round_events, r) =
            insert_events(&mut client, round * 100, 100, 25, 50, Some(13)).await;
        rolled_back.extend(r);
        let mut outboxd = Outboxd::spawn(&windowed_args(&url, &brokers, &window));
        wait_for_async(
            "part of the round to be published",
            Duration::from_secs(60),
            || async { (published_among(&client, &round_events).await > 0).then_some(()) },
        )
        .await;
        outboxd.kill();
        let published = published_among(&client, &round_events).await;
        assert!(
            published < round_events.len() as i64,
            "round {round}: the kill landed after the whole round ({published} events) was published"
        );
        committed.extend(round_events);
    }
    let _outboxd = Outboxd::spawn(&windowed_args(&url, &brokers, &window));
    wait_all_published(&client, Duration::from_secs(120)).await;
    let (_, report) = verify_delivery(&brokers, &committed, &rolled_back, 120, "after 4 SIGKILLs");
    assert!(
        report.duplicates <= KILLS * WINDOW,
        "re-sent more than the in-flight window per kill: {}",
        report.duplicates
    );
}

/// A small in-flight window slows outboxd down enough that a fault lands mid-stream, and bounds what a
/// fault may re-send.
const WINDOW: usize = 100;

fn windowed_args<'a>(pg: &'a str, brokers: &'a str, window: &'a str) -> Vec<&'a str> {
    let mut args = run_args(pg, brokers);
    args.extend(["--max-in-flight-events", window]);
    args
}

async fn restart_postgres_mid_stream(mode: &str) {
    let (pg, _broker) = migrated_stack();
    let (url, brokers) = (pg.url(), _broker.addr());
    let window = WINDOW.to_string();
    // Create the slot, then stop outboxd so that a backlog builds up and the restart lands mid-stream.
    let mut outboxd = Outboxd::spawn(&windowed_args(&url, &brokers, &window));
    let mut client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    outboxd.kill();
    let (mut committed, mut rolled_back) =
        insert_events(&mut client, 0, 100, 25, 50, Some(17)).await;
    let _outboxd = Outboxd::spawn(&windowed_args(&url, &brokers, &window));
    let total = committed.len() as i64;
    let published_before = wait_for_async(
        "some events to be published",
        Duration::from_secs(60),
        || async {
            let published = total - unpublished(&client).await;
            (published > 0).then_some(published)
        },
    )
    .await;
    pg.restart(mode);
    let mut client = pg.client().await;
    let published_at_restart = total - unpublished(&client).await;
    println!(
        "restarted PostgreSQL (-m {mode}) with {published_before} of {total} events published ({published_at_restart} once it was back)"
    );
    assert!(
        published_at_restart < total,
        "the restart landed after the whole backlog was published"
    );
    let (c, r) = insert_events(&mut client, 100, 100, 25, 50, Some(17)).await;
    committed.extend(c);
    rolled_back.extend(r);

    let (_, report) = verify_delivery(
        &brokers,
        &committed,
        &rolled_back,
        180,
        &format!("after restart -m {mode}"),
    );
    assert!(
        report.duplicates <= WINDOW,
        "re-sent more than the in-flight window: {}",
        report.duplicates
    );
    wait_all_published(&client, Duration::from_secs(60)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_fast_restart_mid_stream_loses_nothing() {
    restart_postgres_mid_stream("fast").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn postgres_immediate_restart_mid_stream_loses_nothing() {
    restart_postgres_mid_stream("immediate").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn decodes_a_table_with_extra_and_reordered_columns() {
    let pg = Postgres::start();
    let broker = Broker::start();
    let client = pg.client().await;
    client
        .batch_execute(
            "CREATE TABLE public.custom_outbox (
                 note text, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now(),
                 event_type text NOT NULL, tenant int, aggregate_id text NOT NULL, published_at timestamptz,
                 aggregate_type text NOT NULL, event_id uuid PRIMARY KEY);
             CREATE PUBLICATION custom_pub FOR TABLE public.custom_outbox WITH (publish = 'insert');",
        )
        .await
        .unwrap();
    let url = pg.url();
    let brokers = broker.addr();
    let mut args = run_args(&url, &brokers);
    args.extend([
        "--table",
        "public.custom_outbox",
        "--publication",
        "custom_pub",
        "--slot",
        "custom_slot",
        "--topic",
        "custom.{aggregate_type}.{event_type}",
    ]);
    let _outboxd = Outboxd::spawn(&args);
    wait_slot_active(&client, "custom_slot").await;
    let id = uuid::Uuid::new_v4();
    client
        .execute(
            "INSERT INTO public.custom_outbox (note, payload, event_type, tenant, aggregate_id, aggregate_type, event_id)
             VALUES ('n', '{\"k\": [1, 2]}', 'Shipped', 7, 'ship-1', 'Shipment', $1)",
            &[&id],
        )
        .await
        .unwrap();
    let records = consume_all(
        &brokers,
        &["custom.Shipment.Shipped"],
        1,
        Duration::from_secs(60),
    );
    assert_eq!(records.len(), 1);
    let record = &records[0];
    assert_eq!(record.key.as_deref(), Some("ship-1"));
    assert_eq!(record.headers["event_id"], id.to_string());
    assert_eq!(record.headers["event_type"], "Shipped");
    assert_eq!(record.headers["aggregate_type"], "Shipment");
    let value: serde_json::Value =
        serde_json::from_slice(record.value.as_deref().unwrap()).unwrap();
    assert_eq!(value, serde_json::json!({"k": [1, 2]}));
    wait_for_async(
        "published_at on the custom table",
        Duration::from_secs(30),
        || async {
            let n: i64 = client
                .query_one(
                    "SELECT count(*) FROM public.custom_outbox WHERE published_at IS NOT NULL",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            (n == 1).then_some(())
        },
    )
    .await;
}

/// outboxd on a CDC-only table (re-sends show as duplicates) behind a proxy, with `--shutdown-timeout`, after
/// a first batch was delivered; then the broker stalls and one more transaction is committed, its events in
/// flight. Holds what was committed and an LSN inside the last transaction, which no acknowledgement covers.
struct StallAtShutdown {
    _pg: Postgres,
    _broker: Broker,
    proxy: Proxy,
    client: tokio_postgres::Client,
    outboxd: Outboxd,
    args: Vec<String>,
    committed: Vec<Inserted>,
    inside_last: Lsn,
}

impl StallAtShutdown {
    async fn start(shutdown_timeout: &str) -> Self {
        let pg = Postgres::start();
        let mut client = pg.client().await;
        client.batch_execute(CDC_ONLY_TABLE).await.unwrap();
        migrate_with(&pg.url(), &[]);
        let (broker, proxy) = Broker::start_behind_proxy();
        let metrics_addr = format!("127.0.0.1:{}", free_port());
        let mut args: Vec<String> = run_args(&pg.url(), &Broker::proxied_addr(&proxy))
            .into_iter()
            .map(String::from)
            .collect();
        args.extend(["--shutdown-timeout".into(), shutdown_timeout.into()]);
        args.extend(["--metrics-addr".into(), metrics_addr.clone()]);
        let outboxd = Outboxd::spawn(&args.iter().map(String::as_str).collect::<Vec<_>>());
        wait_slot_active(&client, "outboxd").await;
        let (mut committed, _) = insert_events(&mut client, 0, 10, 10, 10, None).await;
        consume_all(
            &Broker::proxied_addr(&proxy),
            &[TOPIC],
            committed.len(),
            Duration::from_secs(60),
        );

        proxy.stall();
        let tx = client.transaction().await.unwrap();
        committed.extend(insert_txn_events(&tx, 10, 10, 10).await);
        let inside_last: String = tx
            .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
            .await
            .unwrap()
            .get(0);
        tx.commit().await.unwrap();
        wait_for(
            "the last events to be in flight",
            Duration::from_secs(60),
            || in_flight_events(&metrics_addr).filter(|&n| n >= 10.0),
        );
        StallAtShutdown {
            _pg: pg,
            _broker: broker,
            proxy,
            client,
            outboxd,
            args,
            committed,
            inside_last: inside_last.parse().unwrap(),
        }
    }

    /// Starts outboxd again, commits one more transaction and reads everything back.
    async fn restart_and_read_back(mut self) -> DeliveryReport {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        let _again = Outboxd::spawn(&args);
        wait_slot_active(&self.client, "outboxd").await;
        let (more, _) = insert_events(&mut self.client, 11, 1, 5, 5, None).await;
        self.committed.extend(more);
        let records = consume_all(
            &Broker::proxied_addr(&self.proxy),
            &[TOPIC],
            self.committed.len(),
            Duration::from_secs(60),
        );
        let report = check_delivery(&records, &self.committed, &[]);
        assert_eq!(report.missing, 0, "{report:?}");
        assert_eq!(report.order_violations, 0, "{report:?}");
        report
    }
}

/// SIGTERM or SIGINT while events wait for the broker: outboxd keeps waiting for them (up to
/// `--shutdown-timeout`), exits 0 once they are acknowledged, and confirms the slot to the last acknowledged
/// commit, so the next start re-sends nothing.
async fn a_stop_signal_drains_what_is_in_flight_then_confirms_it(signal: &str) {
    let mut stack = StallAtShutdown::start("120s").await;
    stack.outboxd.signal(signal);
    wait_for("outboxd to start draining", Duration::from_secs(60), || {
        stack
            .outboxd
            .log_text()
            .contains("shutting down: draining in-flight events")
            .then_some(())
    });
    assert!(
        stack.outboxd.try_wait().is_none(),
        "outboxd exited with events unacknowledged"
    );
    stack.proxy.resume();
    let status = stack.outboxd.wait_exit();
    assert!(
        status.success(),
        "exit status {status:?}\n{}",
        stack.outboxd.log_text()
    );
    let confirmed = confirmed_flush(&stack.client, "outboxd").await;
    assert!(
        confirmed > stack.inside_last,
        "the slot was confirmed to {confirmed}, before the last acknowledged commit (inside it: {})",
        stack.inside_last
    );
    let report = stack.restart_and_read_back().await;
    assert_eq!(
        report.duplicates, 0,
        "a clean stop confirms everything it delivered"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_drains_what_is_in_flight_then_confirms_it() {
    a_stop_signal_drains_what_is_in_flight_then_confirms_it("TERM").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sigint_drains_what_is_in_flight_then_confirms_it() {
    a_stop_signal_drains_what_is_in_flight_then_confirms_it("INT").await;
}

/// The broker does not answer within `--shutdown-timeout`: outboxd exits anyway, confirms nothing it was not
/// acknowledged, and the next start delivers the rest.
#[tokio::test(flavor = "multi_thread")]
async fn a_shutdown_timeout_leaves_the_unacknowledged_events_to_the_next_start() {
    let mut stack = StallAtShutdown::start("2s").await;
    stack.outboxd.signal("TERM");
    let status = stack.outboxd.wait_exit();
    let log = stack.outboxd.log_text();
    assert!(status.success(), "exit status {status:?}\n{log}");
    assert!(log.contains("shutdown timeout reached"), "{log}");
    let confirmed = confirmed_flush(&stack.client, "outboxd").await;
    assert!(
        confirmed < stack.inside_last,
        "the slot was confirmed to {confirmed}, past events the broker never acknowledged"
    );
    stack.proxy.resume();
    stack.restart_and_read_back().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn restart_skips_replayed_rows_that_already_have_published_at() {
    let (pg, _broker) = migrated_stack();
    let (url, brokers) = (pg.url(), _broker.addr());
    let mut client = pg.client().await;
    create_slot_then_stop(&url, &brokers, &client).await;

    // As if an earlier run had published half of these and died before confirming them to the slot.
    let (committed, _) = insert_events(&mut client, 0, 10, 10, 10, None).await;
    let (already, fresh): (Vec<_>, Vec<_>) =
        committed.iter().cloned().partition(|e| e.seq % 2 == 0);
    let already_ids: Vec<uuid::Uuid> = already.iter().map(|e| e.event_id).collect();
    client
        .execute(
            "UPDATE outbox_event SET published_at = now() WHERE event_id = ANY($1)",
            &[&already_ids],
        )
        .await
        .unwrap();

    // A window of one event: buffered replayed rows must never block reading.
    let _outboxd = Outboxd::spawn(&windowed_args(&url, &brokers, "1"));
    wait_all_published(&client, Duration::from_secs(60)).await;
    let records = consume_all(&brokers, &[TOPIC], fresh.len(), Duration::from_secs(60));
    let report = check_delivery(&records, &fresh, &already);
    assert_eq!(records.len(), fresh.len());
    assert_eq!(report.missing, 0);
    assert_eq!(
        report.from_rolled_back, 0,
        "rows with published_at were published again"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn one_instance_streams_and_a_standby_takes_over_when_it_dies() {
    let (pg, _broker) = migrated_stack();
    let (url, brokers) = (pg.url(), _broker.addr());
    let metrics = [
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    ];
    let window = WINDOW.to_string();
    let spawn = |metrics_addr: &str| {
        let mut args = windowed_args(&url, &brokers, &window);
        args.extend(["--metrics-addr", metrics_addr]);
        Outboxd::spawn(&args)
    };
    let mut first = spawn(&metrics[0]);
    let mut client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    let second = spawn(&metrics[1]);
    wait_for(
        "the second instance to stand by",
        Duration::from_secs(30),
        || second.log_text().contains("standing by").then_some(()),
    );
    let standby = wait_for("/readyz of the standby", Duration::from_secs(30), || {
        http_get(&metrics[1], "/readyz")
    });
    assert_eq!(standby.0, 503);
    assert!(standby.1.contains("standby"), "{}", standby.1);
    let walsenders: i64 = client
        .query_one("SELECT count(*) FROM pg_stat_replication", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(walsenders, 1, "exactly one instance streams");
    let status = run_outboxd(&["status", "--json", "--database-url", &url]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(
        (&status["active_instances"], &status["standby_instances"]),
        (&1.into(), &1.into()),
        "{status}"
    );

    let (mut committed, _) = insert_events(&mut client, 0, 20, 25, 10, None).await;
    first.kill();
    let killed = std::time::Instant::now();
    wait_for("the standby to take over", Duration::from_secs(10), || {
        second.log_text().contains("took over").then_some(())
    });
    wait_slot_active(&client, "outboxd").await;
    println!(
        "standby streaming {:?} after the leader was killed",
        killed.elapsed()
    );
    let (more, _) = insert_events(&mut client, 20, 20, 25, 10, None).await;
    committed.extend(more);
    wait_all_published(&client, Duration::from_secs(60)).await;
    let (_, report) = verify_delivery(
        &brokers,
        &committed,
        &[],
        60,
        "leader killed, standby took over",
    );
    assert!(
        report.duplicates <= WINDOW,
        "the takeover re-sent more than the in-flight window: {}",
        report.duplicates
    );
}

/// An aggregate_type that is no legal topic name is made legal (as Debezium does: `_` for each illegal
/// character, cut at 249 characters), so the event is routed, not lost or refused.
#[tokio::test(flavor = "multi_thread")]
async fn aggregate_types_that_are_no_legal_topic_name_are_sanitised() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let _outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    let client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    let long = "x".repeat(300);
    let cases = [
        ("Order Line/ü", "outbox.Order_Line__".to_string()),
        ("", "outbox.".to_string()),
        (long.as_str(), format!("outbox.{}", "x".repeat(242))),
    ];
    for (aggregate_type, _) in &cases {
        client
            .execute(
                "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                 VALUES (gen_random_uuid(), $1, 'a-1', 'Created', '{}')",
                &[aggregate_type],
            )
            .await
            .unwrap();
    }
    wait_all_published(&client, Duration::from_secs(60)).await;
    let topics: Vec<&str> = cases.iter().map(|(_, topic)| topic.as_str()).collect();
    let records = consume_all(&brokers, &topics, cases.len(), Duration::from_secs(30));
    for topic in topics {
        assert_eq!(
            records.iter().filter(|r| r.topic == topic).count(),
            1,
            "one record on {topic:?}: {records:?}"
        );
    }
}

/// The broker is unreachable for longer than wal_sender_timeout: the replication connection stays up
/// (status updates keep flowing), memory stays bounded by the in-flight window, and the slot is never
/// confirmed past what the broker acknowledged. Everything arrives once the broker is back.
#[tokio::test(flavor = "multi_thread")]
async fn broker_down_longer_than_wal_sender_timeout_keeps_the_stream_and_confirms_nothing() {
    let pg = Postgres::start();
    migrate(&pg);
    let mut client = pg.client().await;
    client
        .batch_execute("ALTER SYSTEM SET wal_sender_timeout = '3s'")
        .await
        .unwrap();
    client
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .unwrap();
    let (_broker, proxy) = Broker::start_behind_proxy();
    let (url, brokers) = (pg.url(), Broker::proxied_addr(&proxy));
    let window = "200".to_string();
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut args = windowed_args(&url, &brokers, &window);
    args.extend(["--metrics-addr", metrics_addr.as_str()]);
    let outboxd = Outboxd::spawn(&args);
    wait_slot_active(&client, "outboxd").await;
    let (mut committed, _) = insert_events(&mut client, 0, 10, 10, 10, None).await;
    wait_all_published(&client, Duration::from_secs(60)).await;
    let observer = pg.client().await;
    let walsender = || async {
        observer
            .query_one("SELECT pid FROM pg_stat_replication", &[])
            .await
            .ok()
            .map(|row| row.get::<_, i32>(0))
    };
    let pid_before = walsender().await.expect("a walsender");

    proxy.cut();
    // An LSN inside the first transaction the broker cannot acknowledge: confirmed must stay below it.
    let tx = client.transaction().await.unwrap();
    let first = insert_txn_events(&tx, 10, 10, 10).await;
    let unacknowledged: String = tx
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    tx.commit().await.unwrap();
    let unacknowledged: Lsn = unacknowledged.parse().unwrap();
    committed.extend(first);
    // About 80 MiB of events: buffering them (instead of holding the window) would blow the RSS bound.
    for txn in 0..10 {
        committed.extend(insert_big_events(&client, 110 + txn * 2_000, 2_000).await);
    }
    // Four times wal_sender_timeout: a connection that sent no status update would be gone by now.
    let outage = Instant::now();
    let mut peak_rss = 0;
    let mut peak_in_flight = 0.0f64;
    while outage.elapsed() < Duration::from_secs(12) {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            confirmed_flush(&client, "outboxd").await < unacknowledged,
            "the slot was confirmed past what the broker acknowledged"
        );
        assert_eq!(
            walsender().await,
            Some(pid_before),
            "the replication connection was dropped"
        );
        peak_rss = peak_rss.max(memory_kib(outboxd.pid(), "VmRSS"));
        if let Some(in_flight) = in_flight_events(&metrics_addr) {
            peak_in_flight = peak_in_flight.max(in_flight);
        }
    }
    assert!(
        peak_in_flight > 0.0 && peak_in_flight <= 200.0,
        "the window held the backlog back: {peak_in_flight} events in flight at most (window 200)"
    );
    assert_eq!(
        unpublished(&client).await,
        20_010,
        "nothing published while the broker was away"
    );
    println!(
        "broker down 12 s: walsender kept, RSS peak {peak_rss} KiB with 20,000 events (80 MiB) waiting"
    );
    assert!(
        peak_rss < 64 * 1024,
        "RSS {peak_rss} KiB while back-pressured"
    );

    proxy.restore();
    wait_all_published(&client, Duration::from_secs(120)).await;
    verify_delivery(&brokers, &committed, &[], 120, "after a long broker outage");
}

/// `--max-in-flight-bytes` bounds by size what waits for a stalled broker: 1 MiB holds at most 257 events of
/// over 4 KiB each (the window closes once it is full, after the event that filled it), far below the events
/// window (10,000 by default) that would otherwise let all 1,000 through.
#[tokio::test(flavor = "multi_thread")]
async fn the_byte_window_bounds_what_waits_for_a_stalled_broker() {
    let pg = Postgres::start();
    migrate(&pg);
    let (_broker, proxy) = Broker::start_behind_proxy();
    let (url, brokers) = (pg.url(), Broker::proxied_addr(&proxy));
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let mut args = run_args(&url, &brokers);
    args.extend([
        "--max-in-flight-bytes",
        "1048576",
        "--metrics-addr",
        metrics_addr.as_str(),
    ]);
    let _outboxd = Outboxd::spawn(&args);
    let client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    let (warm_up, _) = {
        let mut warm = pg.client().await;
        insert_events(&mut warm, 0, 1, 1, 1, None).await
    };
    wait_all_published(&client, Duration::from_secs(60)).await;

    proxy.stall();
    let mut committed = warm_up;
    committed.extend(insert_big_events(&client, 1, 1_000).await);
    let in_flight = || in_flight_events(&metrics_addr);
    wait_for("the byte window to fill", Duration::from_secs(60), || {
        in_flight().filter(|&n| n >= 200.0)
    });
    let mut most = 0.0f64;
    let sampled = Instant::now();
    while sampled.elapsed() < Duration::from_secs(3) {
        most = most.max(in_flight().unwrap_or(0.0));
        std::thread::sleep(Duration::from_millis(100)); // sampling the stall, not a synchronisation
    }
    assert!(
        most <= 257.0,
        "{most} events of over 4 KiB in flight with --max-in-flight-bytes 1 MiB"
    );
    proxy.resume();
    wait_all_published(&client, Duration::from_secs(120)).await;
    verify_delivery(&brokers, &committed, &[], 120, "byte window");
}

/// Inserts `rows` events of 4 KiB of incompressible payload each, in one transaction; returned in commit
/// order, with `seq` from `first_seq` on.
async fn insert_big_events(
    client: &tokio_postgres::Client,
    first_seq: usize,
    rows: usize,
) -> Vec<Inserted> {
    let rows = client
        .query(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'Order', 'order-' || (n % 50), 'OrderPlaced',
                    jsonb_build_object('seq', $1::bigint + n, 'pad',
                        (SELECT string_agg(md5(random()::text || k || n), '') FROM generate_series(1, 128) AS k))
             FROM generate_series(0, $2::bigint - 1) AS n
             RETURNING event_id, aggregate_id, (payload->>'seq')::bigint",
            &[&(first_seq as i64), &(rows as i64)],
        )
        .await
        .unwrap();
    rows.iter()
        .map(|row| Inserted {
            event_id: row.get(0),
            aggregate_id: row.get(1),
            seq: row.get(2),
        })
        .collect()
}

/// One transaction of 200,000 events streams through without being buffered whole: peak RSS stays under
/// 64 MiB.
#[tokio::test(flavor = "multi_thread")]
async fn a_200k_event_transaction_streams_in_bounded_memory() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    let client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    client
        .batch_execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'Order', 'order-' || (n % 1000), 'OrderPlaced',
                    jsonb_build_object('n', n, 'pad', repeat('x', 400))
             FROM generate_series(1, 200000) AS n",
        )
        .await
        .unwrap();
    wait_all_published(&client, Duration::from_secs(600)).await;
    let peak = memory_kib(outboxd.pid(), "VmHWM");
    println!("200,000-event transaction: peak RSS {peak} KiB");
    assert!(peak < 64 * 1024, "peak RSS {peak} KiB");
    let records = consume_all(&brokers, &[TOPIC], 200_000, Duration::from_secs(300));
    let distinct: std::collections::HashSet<_> = records
        .iter()
        .filter_map(|r| r.headers.get("event_id"))
        .collect();
    assert_eq!(distinct.len(), 200_000);
}

/// The application deletes its outbox row in the same transaction that inserted it (keeping the table
/// empty): the insert is in the WAL, so the event is still published, and the missing row is no error.
#[tokio::test(flavor = "multi_thread")]
async fn rows_deleted_in_their_own_transaction_are_still_published() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    let mut client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    let mut committed = Vec::new();
    for t in 0..20 {
        let tx = client.transaction().await.unwrap();
        let events = insert_txn_events(&tx, t, 5, 4).await;
        tx.batch_execute("DELETE FROM outbox_event").await.unwrap();
        tx.commit().await.unwrap();
        committed.extend(events);
    }
    let end = current_wal_lsn(&client).await;
    wait_confirmed_past(&client, "outboxd", end, "the slot to pass the deletes").await;
    let (_, report) = verify_delivery(&brokers, &committed, &[], 60, "insert-then-delete");
    assert_eq!(report.duplicates, 0);
    let rows: i64 = client
        .query_one("SELECT count(*) FROM outbox_event", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0);
    // outboxd's own lines about rows only: librdkafka may warn about a freshly started broker (its
    // coordinator loading), and start-up advisories about the server's set-up (the failover slot's
    // protection, on 17+) come before or after the slot exists, as the machine's load has it.
    let log = outboxd.log_text();
    let own_complaints: Vec<&str> = log
        .lines()
        .filter(|line| {
            (line.contains("ERROR") || line.contains("WARN"))
                && !line.contains("librdkafka")
                && !line.contains("outboxd::doctor")
        })
        .collect();
    assert!(
        own_complaints.is_empty(),
        "errors or warnings for rows that are gone:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hand_off_of_more_aggregates_than_are_tracked_holds_the_table_and_keeps_order() {
    // 60,000 unpublished rows of 60,000 aggregates before the slot exists: more blocked aggregates than
    // outboxd tracks one by one (50,000), so the table is held whole while the sweeper drains them.
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    client
        .batch_execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'Order', 'order-' || i, 'OrderPlaced', jsonb_build_object('seq', i)
             FROM generate_series(0, 59999) AS i",
        )
        .await
        .unwrap();
    let mut committed = events_in_table(&client, "position").await;
    let outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_slot_active(&client, "outboxd").await;
    // Later events of some of those aggregates, while they wait in the polling path.
    let (later, _) = insert_events(&mut client, 0, 200, 5, 100, None).await;
    committed.extend(later);
    wait_all_published(&client, Duration::from_secs(180)).await;
    let log = wait_for(
        "the table to be tracked again",
        Duration::from_secs(60),
        || {
            let log = outboxd.log_text();
            log.contains("tracking them one by one again")
                .then_some(log)
        },
    );
    assert!(
        log.contains("handing it every event of the table"),
        "held at start"
    );
    let records = consume_all(
        &brokers,
        &[TOPIC],
        committed.len(),
        Duration::from_secs(180),
    );
    let report = check_delivery(&records, &committed, &[]);
    println!(
        "{} events, {} records: {report:?}",
        committed.len(),
        records.len()
    );
    assert_eq!(report.missing, 0);
    assert_eq!(report.order_violations, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_handed_off_event_re_sent_after_a_postgres_restart_stays_the_polling_paths() {
    // An event the producer refuses (too large) is handed to the polling path and its transaction
    // confirmed. PostgreSQL then restarts without saving the slot's position, so it re-sends that
    // transaction: the row must stay the polling path's (dead-lettered: refused alone for its size), never
    // be taken for published.
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut args = run_args(&url, &brokers);
    args.extend([
        "--max-attempts",
        "2",
        "--retry-base",
        "1s",
        "--retry-cap",
        "2s",
    ]);
    let outboxd = Outboxd::spawn(&args);
    let client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    // The slot's saved position stays before the poison event's transaction: the checkpoint saves it, and a
    // transaction left open from before the poison event keeps the slot's restart_lsn and catalog_xmin where
    // they are, so confirming the poison event never saves the slot again before the crash (the bgwriter's
    // running-xacts record every 15 s would otherwise advance both, and PostgreSQL would save the slot).
    client
        .batch_execute("CREATE TABLE hold_the_slot (x int)")
        .await
        .unwrap();
    let holder = pg.client().await;
    holder
        .batch_execute("BEGIN; INSERT INTO hold_the_slot VALUES (1)")
        .await
        .unwrap();
    client.batch_execute("CHECKPOINT").await.unwrap();
    let poison = uuid::Uuid::new_v4();
    client
        .execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             VALUES ($1, 'Order', 'order-1', 'E', jsonb_build_object('pad', repeat('x', 1500000)))",
            &[&poison],
        )
        .await
        .unwrap();
    let end = current_wal_lsn(&client).await;
    wait_confirmed_past(
        &client,
        "outboxd",
        end,
        "the poison event's transaction to be confirmed",
    )
    .await;
    pg.restart("immediate");
    drop(holder);
    let client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    wait_for(
        "the server to re-send the transaction",
        Duration::from_secs(60),
        || {
            outboxd
                .log_text()
                .contains("re-sent transaction")
                .then_some(())
        },
    );
    let (published, dead): (Option<std::time::SystemTime>, Option<std::time::SystemTime>) =
        wait_for_async(
            "the poison event to be dead-lettered",
            Duration::from_secs(60),
            || async {
                let row = client
                    .query_one(
                        "SELECT published_at, dead_at FROM outbox_event WHERE event_id = $1",
                        &[&poison],
                    )
                    .await
                    .unwrap();
                let dead: Option<std::time::SystemTime> = row.get(1);
                dead.map(|d| (row.get(0), Some(d)))
            },
        )
        .await;
    assert_eq!(published, None, "never produced, so never published");
    assert!(dead.is_some());
    assert_eq!(
        attempts_of(&client, poison).await,
        1,
        "refused alone for its size, then dead-lettered at once"
    );
}

/// An event parked behind an earlier event of its aggregate waiting in the polling path (as a refused event
/// waits for its retry) must not stop the stream once the window fills with acknowledged events behind it
/// (they cannot be confirmed past the parked one): it is handed to the polling path after its predecessor,
/// and every other aggregate keeps flowing.
/// (Found by review: with the window counting acknowledged events until confirmed, the stream stalled until
/// the refused event was dead-lettered.)
#[tokio::test(flavor = "multi_thread")]
async fn an_event_parked_behind_a_refused_one_never_stalls_other_aggregates() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let args = windowed_args(&url, &brokers, "50");
    let _outboxd = Outboxd::spawn(&args);
    let mut client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    let insert = |id: uuid::Uuid, pad: i32| {
        let client = &client;
        async move {
            client
                .execute(
                    "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                     VALUES ($1, 'Order', 'X', 'E', jsonb_build_object('pad', repeat('x', $2::int)))",
                    &[&id, &pad],
                )
                .await
                .unwrap();
        }
    };
    // X's first event waits in the polling path for the whole test, as a refused event waiting for its
    // retry: written handed off, due in an hour. The stream blocks X behind it.
    let refused = uuid::Uuid::new_v4();
    client
        .execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, handoff_at, available_at)
             VALUES ($1, 'Order', 'X', 'E', '{}', now(), now() + interval '1 hour')",
            &[&refused],
        )
        .await
        .unwrap();
    // X's next event is parked (X still waits in the polling path); then far more than the window of others.
    let parked = uuid::Uuid::new_v4();
    insert(parked, 10).await;
    let (others, _) = insert_events(&mut client, 0, 40, 10, 20, None).await;
    let ids: Vec<uuid::Uuid> = others.iter().map(|e| e.event_id).collect();
    wait_for_async("the other aggregates to be published", Duration::from_secs(60), || async {
        let left: i64 = client
            .query_one(
                "SELECT count(*) FROM outbox_event WHERE event_id = ANY($1) AND published_at IS NULL",
                &[&ids],
            )
            .await
            .unwrap()
            .get(0);
        (left == 0).then_some(())
    })
    .await;
    let row = client
        .query_one(
            "SELECT published_at IS NULL, handoff_at IS NOT NULL FROM outbox_event WHERE event_id = $1",
            &[&parked],
        )
        .await
        .unwrap();
    assert_eq!(
        (row.get::<_, bool>(0), row.get::<_, bool>(1)),
        (true, true),
        "X's later event waits in the polling path behind the refused one"
    );
    let records = consume_all(&brokers, &[TOPIC], others.len(), Duration::from_secs(30));
    let report = check_delivery(&records, &others, &[]);
    assert_eq!(
        (report.missing, report.order_violations),
        (0, 0),
        "{report:?}"
    );
    assert!(
        records.iter().all(|r| r.key.as_deref() != Some("X")),
        "nothing of X reached Kafka ahead of its refused event"
    );
}

/// Rows that share one commit LSN (a `COPY` of 10,000 rows, one multi-row `INSERT` of 1,000), with outboxd
/// SIGKILLed while it streams each of them: the slot cannot confirm part of a transaction, so every restart
/// streams the whole transaction again and the rows already published are recognised. Nothing is lost, order
/// is kept, and each kill re-sends at most what was in flight. (Another connector lost rows of such
/// transactions.) Runs on every major of the matrix.
#[tokio::test(flavor = "multi_thread")]
async fn rows_sharing_one_commit_survive_sigkills_mid_transaction() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let window = WINDOW.to_string();
    let client = pg.client().await;
    create_slot_then_stop(&url, &brokers, &client).await;

    let new_events = |first_seq: usize, count: usize| -> Vec<Inserted> {
        (first_seq..first_seq + count)
            .map(|seq| Inserted {
                event_id: uuid::Uuid::new_v4(),
                aggregate_id: format!("order-{}", seq % 40),
                seq: seq as i64,
            })
            .collect()
    };
    let payload = |e: &Inserted| {
        serde_json::json!({"order": e.aggregate_id, "seq": e.seq, "pad": "x".repeat(100)})
            .to_string()
    };
    // A COPY of 10,000 rows, from a file the server reads (the test's role is a superuser).
    let copied = new_events(0, 10_000);
    let csv_path = pg.dir.join("outbox.csv");
    let mut csv = String::new();
    for e in &copied {
        let json = payload(e).replace('"', "\"\"");
        csv.push_str(&format!(
            "{},Order,{},OrderCopied,\"{json}\"\n",
            e.event_id, e.aggregate_id
        ));
    }
    std::fs::write(&csv_path, csv).unwrap();
    let copy = client
        .execute(
            &format!(
                "COPY outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload) FROM '{}' WITH (FORMAT csv)",
                csv_path.display()
            ),
            &[],
        )
        .await
        .expect("COPY");
    assert_eq!(copy, 10_000);
    // One INSERT of 1,000 rows.
    let inserted = new_events(10_000, 1_000);
    let ids: Vec<uuid::Uuid> = inserted.iter().map(|e| e.event_id).collect();
    let aggregates: Vec<String> = inserted.iter().map(|e| e.aggregate_id.clone()).collect();
    let payloads: Vec<serde_json::Value> = inserted
        .iter()
        .map(|e| serde_json::from_str(&payload(e)).unwrap())
        .collect();
    let rows = client
        .execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             SELECT id, 'Order', aggregate, 'OrderInserted', payload
             FROM unnest($1::uuid[], $2::text[], $3::jsonb[]) WITH ORDINALITY AS t(id, aggregate, payload, n)
             ORDER BY n",
            &[&ids, &aggregates, &payloads],
        )
        .await
        .expect("multi-row INSERT");
    assert_eq!(rows, 1_000);

    // Kill while each transaction is part published (the first kills land in the COPY, the last ones in the
    // INSERT).
    let mut kills = 0;
    for (what, events) in [("COPY", &copied), ("INSERT", &inserted)] {
        for _ in 0..2 {
            let before = published_among(&client, events).await;
            let mut outboxd = Outboxd::spawn(&windowed_args(&url, &brokers, &window));
            wait_for_async(
                &format!("more of the {what} to be published"),
                Duration::from_secs(120),
                || async { (published_among(&client, events).await > before).then_some(()) },
            )
            .await;
            outboxd.kill();
            kills += 1;
            let published = published_among(&client, events).await;
            println!(
                "kill {kills}: {published} of the {what}'s {} rows published",
                events.len()
            );
            // The COPY is too long to drain between two polls; the INSERT may not be.
            assert!(
                what == "INSERT" || published < events.len() as i64,
                "kill {kills} landed after the whole {what} was published"
            );
        }
    }
    let _outboxd = Outboxd::spawn(&windowed_args(&url, &brokers, &window));
    wait_all_published(&client, Duration::from_secs(180)).await;
    let committed: Vec<Inserted> = copied.into_iter().chain(inserted).collect();
    let (_, report) = verify_delivery(&brokers, &committed, &[], 180, "COPY and multi-row INSERT");
    assert!(
        report.duplicates <= kills * WINDOW,
        "re-sent more than the in-flight window per kill: {}",
        report.duplicates
    );
}
