//! Operating outboxd: the metrics endpoint, health and readiness, scraped during a real run.

use std::time::Duration;

use outboxd::config::PollOrder;
use outboxd::pg::outbox;

use crate::support::*;

#[tokio::test(flavor = "multi_thread")]
async fn metrics_and_readiness_follow_a_real_run() {
    let pg = Postgres::start();
    migrate(&pg);
    let (_broker, proxy) = Broker::start_behind_proxy();
    let (url, brokers) = (pg.url(), Broker::proxied_addr(&proxy));
    let (mut outboxd, metrics_addr) = spawn_serving_metrics(&url, &brokers, &[]);

    let first = wait_for("/metrics to answer", Duration::from_secs(60), || {
        http_get(&metrics_addr, "/metrics")
    });
    assert_eq!(first.0, 200);
    for name in outboxd::metrics::ALL {
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
    assert_eq!(
        metric_value(&published.1, "outboxd_commit_to_ack_seconds_count", ""),
        Some(committed.len() as f64),
        "one commit-to-ack sample per acknowledged event"
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
    let mut last_answer = None;
    wait_for(
        "/readyz to be 503 while the broker is unreachable",
        Duration::from_secs(60),
        || {
            let answer = http_get(&metrics_addr, "/readyz");
            if let Some(status) = outboxd.try_wait() {
                panic!("outboxd exited ({status}) while the broker was unreachable");
            }
            if answer != last_answer {
                // Shown when the wait times out: whether /readyz answered, and what.
                println!("/readyz while the broker is unreachable: {answer:?}");
                last_answer = answer.clone();
            }
            answer.filter(|r| r.0 == 503)
        },
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
    wait_for(
        "the backlog to drain and its age to fall to 0",
        Duration::from_secs(120),
        || {
            let (_, text) = http_get(&metrics_addr, "/metrics")?;
            let backlog = metric_value(&text, "outboxd_unpublished_events", "")?;
            let age = metric_value(&text, "outboxd_oldest_unpublished_age_seconds", "")?;
            (backlog == 0.0 && age == 0.0).then_some(())
        },
    );

    // PostgreSQL goes away: not ready; it comes back: ready again.
    pg.stop();
    wait_for(
        "/readyz to be 503 while PostgreSQL is down",
        Duration::from_secs(60),
        || http_get(&metrics_addr, "/readyz").filter(|r| r.0 == 503 && r.1.contains("PostgreSQL")),
    );
    pg.start_again();
    wait_for(
        "/readyz to be 200 after PostgreSQL is back",
        Duration::from_secs(90),
        || http_get(&metrics_addr, "/readyz").filter(|r| r.0 == 200),
    );
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

/// Under README's role with what it says `--retention` needs on top: `DELETE` on the table, and `INSERT` on an
/// archive table created beforehand.
async fn retention_removes_only_old_published_rows(archive: Option<&str>) {
    let (pg, broker) = migrated_stack();
    let grants = match archive {
        Some(table) => format!(
            "GRANT DELETE ON outbox_event TO outboxd_app;
             CREATE TABLE {table} (LIKE outbox_event); GRANT INSERT ON {table} TO outboxd_app;"
        ),
        None => "GRANT DELETE ON outbox_event TO outboxd_app;".into(),
    };
    let url = readme_role(&pg, "retention-secret", "outbox_event", &grants).await;
    let brokers = broker.addr();
    let mut args = run_args(&url, &brokers);
    args.extend(["--retention", "10m", "--retention-interval", "200ms"]);
    if let Some(table) = archive {
        args.extend(["--archive-table", table]);
    }
    let _outboxd = Outboxd::spawn(&args);
    let mut client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    // Old published rows (published an hour ago), recent ones, and rows the connector publishes now.
    client
        .batch_execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT gen_random_uuid(), 'Old', 'o-' || i, 'E', '{}', now() - interval '1 hour' FROM generate_series(1, 30) i;
             INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT gen_random_uuid(), 'Recent', 'r-' || i, 'E', '{}', now() FROM generate_series(1, 20) i;",
        )
        .await
        .unwrap();
    let (fresh, _) = insert_events(&mut client, 0, 2, 10, 5, None).await;
    wait_all_published(&client, Duration::from_secs(60)).await;
    let count = |sql: &'static str| {
        let client = &client;
        async move { client.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    wait_for_async(
        "old published rows to go",
        Duration::from_secs(60),
        || async {
            (count("SELECT count(*) FROM outbox_event WHERE aggregate_type = 'Old'").await == 0)
                .then_some(())
        },
    )
    .await;
    assert_eq!(
        count("SELECT count(*) FROM outbox_event WHERE aggregate_type = 'Recent'").await,
        20
    );
    assert_eq!(
        count("SELECT count(*) FROM outbox_event WHERE aggregate_type = 'Order'").await,
        fresh.len() as i64
    );
    if let Some(table) = archive {
        let archived: i64 = client
            .query_one(
                &format!("SELECT count(*) FROM {table} WHERE aggregate_type = 'Old'"),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(archived, 30, "archived instead of deleted");
    }
    // Deletes are not streamed (publish = 'insert'): each insert appears once, and nothing for the deletes.
    let records = consume_all(
        &brokers,
        &[TOPIC, "outbox.Old"],
        fresh.len() + 30,
        Duration::from_secs(30),
    );
    assert_eq!(
        records.iter().filter(|r| r.topic == TOPIC).count(),
        fresh.len()
    );
    assert_eq!(
        records.iter().filter(|r| r.topic == "outbox.Old").count(),
        30
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn retention_deletes_only_published_rows_older_than_the_window() {
    retention_removes_only_old_published_rows(None).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn retention_can_archive_instead_of_delete() {
    retention_removes_only_old_published_rows(Some("public.outbox_archive")).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn json_logs_are_one_object_per_line_without_secrets() {
    let (pg, broker) = migrated_stack();
    pg.client()
        .await
        .batch_execute("ALTER ROLE postgres PASSWORD 'hunter2-secret'")
        .await
        .unwrap();
    let url = pg.url_for("postgres", Some("hunter2-secret"));
    let brokers = broker.addr();
    let mut args = run_args(&url, &brokers);
    args.extend(["--log-format", "json"]);
    let outboxd = Outboxd::spawn(&args);
    let client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    let log = wait_for(
        "the mode switch to be logged",
        Duration::from_secs(30),
        || {
            let log = outboxd.log_text();
            log.contains("mode switch").then_some(log)
        },
    );
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let value: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            value["level"].is_string() && value["fields"].is_object(),
            "{line}"
        );
    }
    assert!(
        !log.contains("hunter2-secret"),
        "a password reached the log"
    );
}

/// README's minimal grants are enough for `run` and `status`; and no password (PostgreSQL's or a Kafka
/// option's) appears in any output of a successful run, a failing run, `status` or `/metrics`.
#[tokio::test(flavor = "multi_thread")]
async fn least_privilege_role_runs_everything_and_no_secret_leaks() {
    const PG_SECRET: &str = "pg-secret-7f3a";
    const KAFKA_SECRET: &str = "kafka-secret-91bc";
    let (pg, broker) = migrated_stack();
    let mut admin = pg.client().await;
    // Exactly what README's "A role" step grants: nothing owned, no superuser.
    let url = readme_role(&pg, PG_SECRET, "outbox_event", "").await;
    let brokers = broker.addr();
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let kafka_option = format!("sasl.password={KAFKA_SECRET}");
    let mut args = run_args(&url, &brokers);
    args.extend([
        "--metrics-addr",
        &metrics_addr,
        "--kafka-option",
        &kafka_option,
    ]);
    let outboxd = Outboxd::spawn(&args);
    wait_slot_active(&admin, "outboxd").await;
    let (committed, rolled_back) = insert_events(&mut admin, 0, 20, 10, 5, Some(5)).await;
    verify_fault_free_delivery(&brokers, &committed, &rolled_back, 60, "least privilege");
    wait_all_published(&admin, Duration::from_secs(60)).await;

    let mut output = outboxd.log_text();
    output += &http_get(&metrics_addr, "/metrics").expect("/metrics").1;
    for extra in [&[][..], &["--json"][..]] {
        let mut status_args = vec!["status", "--database-url", &url];
        status_args.extend_from_slice(extra);
        let status = run_outboxd(&status_args);
        assert_eq!(status.status.code(), Some(0), "{}", stderr_of(&status));
        output += &String::from_utf8_lossy(&status.stdout);
        output += &stderr_of(&status);
    }
    // Failing runs: a wrong password, and the right one with brokers that never answer.
    let wrong = pg.url_for("outboxd_app", Some("wrong-secret-5d2e"));
    let unreachable = format!("127.0.0.1:{}", free_port());
    for (url, brokers) in [(&wrong, &brokers), (&url, &unreachable)] {
        let mut args = run_args(url, brokers);
        args.extend(["--kafka-option", &kafka_option, "--startup-timeout", "1s"]);
        let failed = run_outboxd(&args);
        assert!(!failed.status.success());
        output += &stderr_of(&failed);
        output += &String::from_utf8_lossy(&failed.stdout);
    }
    assert!(
        output.contains("fix:"),
        "the failing runs said why:\n{output}"
    );
    for secret in [PG_SECRET, KAFKA_SECRET, "wrong-secret-5d2e"] {
        assert!(!output.contains(secret), "{secret} leaked:\n{output}");
    }
}

/// README's role, nothing more, through the other paths: rows older than the slot (the sweeper), a standby
/// that takes over, and the polling path (`--mode poll`), each publishing what it should.
#[tokio::test(flavor = "multi_thread")]
async fn readme_role_runs_the_sweeper_a_standby_and_the_polling_path() {
    let (pg, broker) = migrated_stack();
    let mut admin = pg.client().await;
    let url = readme_role(&pg, "paths-secret", "outbox_event", "").await;
    let brokers = broker.addr();
    // Older than the slot: the hand-off at slot creation gives them to the sweeper.
    let (mut committed, _) = insert_events(&mut admin, 0, 5, 10, 5, None).await;
    let mut leader = Outboxd::spawn(&run_args(&url, &brokers));
    wait_slot_active(&admin, "outboxd").await;
    let standby = Outboxd::spawn(&run_args(&url, &brokers));
    wait_for(
        "the standby to wait for the lock",
        Duration::from_secs(60),
        || standby.log_text().contains("standing by").then_some(()),
    );
    let (streamed, _) = insert_events(&mut admin, 5, 5, 10, 5, None).await;
    committed.extend(streamed);
    wait_all_published(&admin, Duration::from_secs(60)).await;
    assert_eq!(
        handed_off_count(&admin).await,
        50,
        "the sweeper published the old rows"
    );

    leader.kill();
    wait_for("the standby to take over", Duration::from_secs(60), || {
        standby.log_text().contains("took over").then_some(())
    });
    wait_slot_active(&admin, "outboxd").await;
    let (after_takeover, _) = insert_events(&mut admin, 10, 5, 10, 5, None).await;
    committed.extend(after_takeover);
    wait_all_published(&admin, Duration::from_secs(60)).await;
    drop(standby);

    let mut poll_args = run_args(&url, &brokers);
    poll_args.extend(["--mode", "poll"]);
    let _poller = Outboxd::spawn(&poll_args);
    let (polled, _) = insert_events(&mut admin, 15, 5, 10, 5, None).await;
    committed.extend(polled);
    wait_all_published(&admin, Duration::from_secs(60)).await;
    verify_fault_free_delivery(&brokers, &committed, &[], 60, "README's role on every path");
}

/// A row behind a row of its aggregate that waits for its retry is due only where `--poll-order none` would
/// claim it: the stall watchdog judged every table as if ordered per aggregate, so a stall of such a row
/// under `--poll-order none` went unseen.
#[tokio::test(flavor = "multi_thread")]
async fn which_rows_are_due_follows_the_poll_order() {
    let pg = Postgres::start();
    migrate(&pg);
    let client = pg.client().await;
    client
        .batch_execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, available_at)
             VALUES (gen_random_uuid(), 'Order', 'a', 'first', '{}', now() + interval '1 hour');
             INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             VALUES (gen_random_uuid(), 'Order', 'a', 'second', '{}');",
        )
        .await
        .unwrap();
    let table = outbox_event_table(&client).await;
    let mut due = Vec::new();
    for order in [PollOrder::PerAggregate, PollOrder::None] {
        let backlog = outbox::backlog(&client, std::slice::from_ref(&table), order)
            .await
            .unwrap();
        due.push(backlog.activity[0].due);
    }
    assert_eq!(due, [false, true], "due per aggregate, and without order");
    // Once its first try failed, the waiting row is owed work in either order: a broker refusing every
    // event keeps every row waiting for its retry, which read as an idle table (never stalled).
    client
        .batch_execute("UPDATE outbox_event SET attempts = 1 WHERE event_type = 'first'")
        .await
        .unwrap();
    for order in [PollOrder::PerAggregate, PollOrder::None] {
        let backlog = outbox::backlog(&client, std::slice::from_ref(&table), order)
            .await
            .unwrap();
        assert!(
            backlog.activity[0].due,
            "{order:?}: a failed row waiting for its retry is owed"
        );
    }
}

/// The periodic figures (backlog, oldest age, dead letters) and the lease renewal read an index, not the table:
/// on a table of a million published rows each used to be a sequential scan, every 5 s on every instance.
#[tokio::test(flavor = "multi_thread")]
async fn periodic_queries_read_an_index_not_the_table() {
    let pg = Postgres::start();
    migrate(&pg);
    let client = pg.client().await;
    client
        .batch_execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT gen_random_uuid(), 'Order', 'order-' || (i % 1000), 'E', '{}', now()
             FROM generate_series(1, 1000000) AS i;
             INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, dead_at)
             SELECT gen_random_uuid(), 'Order', 'order-' || i, 'E', '{}', CASE WHEN i <= 5 THEN now() END
             FROM generate_series(1, 100) AS i",
        )
        .await
        .unwrap();
    client
        .batch_execute("VACUUM ANALYZE outbox_event")
        .await
        .unwrap();
    let table = outbox_event_table(&client).await;
    let statements = outbox::backlog_statements(&table, PollOrder::PerAggregate);
    let unordered = outbox::backlog_statements(&table, PollOrder::None);
    client
        .batch_execute(&format!(
            "PREPARE renew(uuid, float8, uuid[]) AS {}",
            outbox::renew_statement(&table)
        ))
        .await
        .unwrap();
    let queries = [
        ("backlog", statements.count.clone()),
        ("oldest age", statements.oldest.clone().unwrap()),
        ("a row claimable now", statements.due.clone().unwrap()),
        (
            "a row claimable now, --poll-order none",
            unordered.due.clone().unwrap(),
        ),
        (
            "newest publication",
            statements.newest_published.clone().unwrap(),
        ),
        ("dead letters", statements.dead.clone().unwrap()),
        (
            "lease renewal",
            "EXECUTE renew(gen_random_uuid(), 30, ARRAY[gen_random_uuid()])".into(),
        ),
    ];
    for (what, sql) in queries {
        let plan = plan_of(&client, &sql).await;
        assert!(
            !plan.contains("Seq Scan"),
            "{what} scans the table:\n{sql}\n{plan}"
        );
    }
    let backlog = outbox::backlog(&client, std::slice::from_ref(&table), PollOrder::default())
        .await
        .unwrap();
    assert_eq!(
        backlog.unpublished_events, 95,
        "dead letters are no backlog"
    );
    assert!(backlog.oldest_unpublished_age_seconds.is_some());
    assert_eq!(outbox::dead_count(&client, &table).await.unwrap(), 5);
}

/// The other table shapes outboxd accepts, on a million rows each, also have their figures read through an
/// index: `published_at` without the polling columns (once the index outboxd names exists), and a partitioned
/// table with the polling columns. (A Debezium-style table, without `published_at`, has no backlog figures:
/// its measure is the slot lag; a table whose figures no index serves is not counted at all, see
/// `a_backlog_no_index_serves_is_not_counted_by_reading_the_table`.)
#[tokio::test(flavor = "multi_thread")]
async fn every_table_shape_reads_its_figures_through_an_index() {
    let pg = Postgres::start();
    let client = pg.client().await;
    client
        .batch_execute(
            "CREATE TABLE public.plain_outbox (
                 event_id uuid PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
                 event_type text NOT NULL, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now(),
                 published_at timestamptz)",
        )
        .await
        .unwrap();
    client.batch_execute(PARTITIONED_TABLE).await.unwrap();
    migrate_with(&pg.url(), &["--table", "outbox_p", "--add-polling-columns"]);
    for (table, created_at) in [
        ("plain_outbox", "now()"),
        (
            "outbox_p",
            "'2020-06-01'::timestamptz + make_interval(secs => i)",
        ),
    ] {
        client
            .batch_execute(&format!(
                "INSERT INTO {table} (event_id, aggregate_type, aggregate_id, event_type, payload, created_at, published_at)
                 SELECT gen_random_uuid(), 'Order', 'order-' || (i % 1000), 'E', '{{}}', {created_at}, now()
                 FROM generate_series(1, 1000000) AS i;
                 INSERT INTO {table} (event_id, aggregate_type, aggregate_id, event_type, payload)
                 SELECT gen_random_uuid(), 'Order', 'order-' || i, 'E', '{{}}' FROM generate_series(1, 100) AS i;"
            ))
            .await
            .unwrap();
    }
    let plain = outbox_table(&client, "plain_outbox").await;
    client
        .batch_execute(&outbox::backlog_index_fix(&plain))
        .await
        .unwrap();
    client.batch_execute("VACUUM ANALYZE").await.unwrap();
    for name in ["plain_outbox", "outbox_p"] {
        let table = outbox_table(&client, name).await;
        let countable = outbox::countable(&client, &table).await.unwrap();
        assert!(countable.backlog, "{name}: its backlog is not countable");
        let statements = outbox::backlog_statements(&table, PollOrder::PerAggregate);
        let unordered = outbox::backlog_statements(&table, PollOrder::None);
        let queries = std::iter::once(statements.count)
            .chain(statements.oldest)
            .chain(statements.due)
            .chain(unordered.due)
            .chain(statements.newest_published)
            .chain(statements.dead);
        for sql in queries {
            // The million rows are in `plain_outbox` and in the partition `outbox_p_2020`.
            let plan = plan_of(&client, &sql).await;
            assert!(
                !plan.contains("Seq Scan on plain_outbox")
                    && !plan.contains("Seq Scan on outbox_p_2020"),
                "{name}: a figure reads the table:\n{sql}\n{plan}"
            );
        }
        let backlog = outbox::backlog(&client, std::slice::from_ref(&table), PollOrder::default())
            .await
            .unwrap();
        assert_eq!(backlog.unpublished_events, 100, "{name}");
    }
}

/// `/readyz` while the CDC pipeline cannot stream (its walsender is ended again and again) but PostgreSQL and
/// the broker answer: 503 "reconnecting", not "cdc" (it stayed 200 through any reconnect loop).
#[tokio::test(flavor = "multi_thread")]
async fn readyz_is_not_ready_while_the_pipeline_reconnects() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let (_outboxd, metrics_addr) = spawn_serving_metrics(&url, &brokers, &["--mode", "cdc"]);
    wait_ready(&metrics_addr);
    let client = pg.client().await;
    let reason = wait_for_async("/readyz to be 503", Duration::from_secs(60), || async {
        client
            .execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
                 WHERE slot_name = 'outboxd' AND active_pid IS NOT NULL",
                &[],
            )
            .await
            .unwrap();
        http_get(&metrics_addr, "/readyz")
            .filter(|r| r.0 == 503)
            .map(|r| r.1)
    })
    .await;
    assert!(reason.contains("reconnecting"), "{reason}");
    let (_, ready) = wait_for("/readyz to be 200 again", Duration::from_secs(60), || {
        http_get(&metrics_addr, "/readyz").filter(|r| r.0 == 200)
    });
    assert!(ready.contains("\"mode\":\"cdc\""), "{ready}");
}

/// A lock holds the pipeline back while events wait (here every UPDATE of the outbox table waits for a
/// lock the test holds: the claim's lease and the write-back of `published_at` alike): `/readyz` says the
/// pipeline stalled, on both paths, and is ready again once the events are delivered. It said 200 before.
#[tokio::test(flavor = "multi_thread")]
async fn readyz_says_stalled_while_a_lock_holds_events_back() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    client
        .batch_execute(
            "CREATE FUNCTION public.wait_for_the_test() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NEW; END $$;
             CREATE TRIGGER wait_for_the_test BEFORE UPDATE ON outbox_event
                 FOR EACH ROW EXECUTE FUNCTION public.wait_for_the_test();",
        )
        .await
        .unwrap();
    for (round, mode) in ["poll", "cdc"].into_iter().enumerate() {
        let (outboxd, metrics_addr) = spawn_serving_metrics(&url, &brokers, &["--mode", mode]);
        wait_ready(&metrics_addr);
        let holder = pg.client().await;
        holder
            .execute("SELECT pg_advisory_lock(4242)", &[])
            .await
            .unwrap();
        insert_events(&mut client, round * 10, 3, 2, 2, None).await;
        let (_, reason) = wait_for(
            &format!("/readyz to say the {mode} pipeline stalled"),
            Duration::from_secs(180),
            || {
                http_get(&metrics_addr, "/readyz")
                    .filter(|(status, body)| *status == 503 && body.contains("stalled"))
            },
        );
        assert!(
            reason.contains("a lock held on the outbox table"),
            "{reason}"
        );
        assert!(unpublished(&client).await > 0, "the events were published");
        holder
            .execute("SELECT pg_advisory_unlock(4242)", &[])
            .await
            .unwrap();
        wait_for_async(
            "every event published",
            Duration::from_secs(120),
            || async { (unpublished(&client).await == 0).then_some(()) },
        )
        .await;
        wait_ready(&metrics_addr);
        let log = outboxd.log_text();
        assert!(log.contains("the pipeline stalled"), "{log}");
        assert!(log.contains("the stall is over"), "{log}");
        drop(outboxd);
    }
}

/// One table held back while another flows is a stall of that table: the events published from the other
/// (which made the whole pipeline look alive) do not hide it, and the log names it.
#[tokio::test(flavor = "multi_thread")]
async fn a_table_held_back_stalls_while_another_flows() {
    let pg = Postgres::start();
    let broker = Broker::start();
    let (url, brokers) = (pg.url(), broker.addr());
    let tables = [
        "--table",
        "orders.outbox_event",
        "--table",
        "billing.outbox_event",
    ];
    migrate_with(&url, &tables);
    let client = pg.client().await;
    client
        .batch_execute(
            "CREATE FUNCTION public.wait_for_the_test() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NEW; END $$;
             CREATE TRIGGER wait_for_the_test BEFORE UPDATE ON billing.outbox_event
                 FOR EACH ROW EXECUTE FUNCTION public.wait_for_the_test();",
        )
        .await
        .unwrap();
    let (outboxd, metrics_addr) =
        spawn_serving_metrics(&url, &brokers, &[&["--mode", "poll"][..], &tables].concat());
    wait_ready(&metrics_addr);
    let holder = pg.client().await;
    holder
        .execute("SELECT pg_advisory_lock(4242)", &[])
        .await
        .unwrap();
    let insert = |table: &str| {
        format!(
            "INSERT INTO {table} (event_id, aggregate_type, aggregate_id, event_type, payload)
             VALUES (gen_random_uuid(), 'Order', 'a', 'E', '{{}}')"
        )
    };
    client
        .batch_execute(&insert("billing.outbox_event"))
        .await
        .unwrap();
    // Orders keep flowing meanwhile, an event each time /readyz is asked.
    let (_, reason) = wait_for_async(
        "/readyz to say the pipeline stalled",
        Duration::from_secs(180),
        || async {
            client
                .batch_execute(&insert("orders.outbox_event"))
                .await
                .unwrap();
            http_get(&metrics_addr, "/readyz")
                .filter(|(status, body)| *status == 503 && body.contains("stalled"))
        },
    )
    .await;
    assert!(reason.contains("stalled"), "{reason}");
    let published: i64 = client
        .query_one(
            "SELECT count(*) FROM orders.outbox_event WHERE published_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(published > 0, "the orders did not flow");
    let log = outboxd.log_text();
    let stalled = log
        .lines()
        .find(|line| line.contains("the pipeline stalled"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(
        stalled.contains("billing.outbox_event") && !stalled.contains("orders.outbox_event"),
        "{stalled}"
    );
    holder
        .execute("SELECT pg_advisory_unlock(4242)", &[])
        .await
        .unwrap();
    wait_ready(&metrics_addr);
    assert!(outboxd.log_text().contains("the stall is over"));
}

/// A database that stops answering without closing the connection (a blackholed network): `/readyz` says
/// PostgreSQL is unreachable instead of keeping the last answer (the periodic queries had no timeout).
#[tokio::test(flavor = "multi_thread")]
async fn readyz_notices_a_database_that_stopped_answering() {
    let (pg, broker) = migrated_stack();
    let proxy = Proxy::start(std::sync::Arc::new(std::sync::atomic::AtomicU16::new(
        pg.port,
    )));
    let (url, brokers) = (pg.url_via(proxy.port), broker.addr());
    let (_outboxd, metrics_addr) = spawn_serving_metrics(&url, &brokers, &["--mode", "poll"]);
    wait_ready(&metrics_addr);
    proxy.stall();
    let (_, reason) = wait_for("/readyz to be 503", Duration::from_secs(60), || {
        http_get(&metrics_addr, "/readyz").filter(|r| r.0 == 503)
    });
    assert!(reason.contains("PostgreSQL"), "{reason}");
    proxy.resume();
    wait_for("/readyz to be 200 again", Duration::from_secs(60), || {
        http_get(&metrics_addr, "/readyz").filter(|r| r.0 == 200)
    });
}

/// A `timestamp without time zone` created_at holds UTC wall-clock time (as outboxd reads it on every path):
/// its age is measured in UTC, not in the server's time zone (which put it hours off).
#[tokio::test(flavor = "multi_thread")]
async fn ages_of_timestamps_without_time_zone_are_read_as_utc() {
    let pg = Postgres::start();
    let url = pg.url();
    let client = pg.client().await;
    client
        .batch_execute(
            "ALTER DATABASE postgres SET timezone = 'America/New_York';
             CREATE TABLE public.local_outbox (
                 event_id uuid PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
                 event_type text NOT NULL, payload jsonb NOT NULL,
                 created_at timestamp NOT NULL DEFAULT (now() AT TIME ZONE 'UTC'))",
        )
        .await
        .unwrap();
    let migrate = run_outboxd(&[
        "migrate",
        "--database-url",
        &url,
        "--table",
        "public.local_outbox",
        "--add-polling-columns",
    ]);
    assert!(migrate.status.success(), "{}", stderr_of(&migrate));
    client
        .batch_execute(
            "INSERT INTO public.local_outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
             VALUES (gen_random_uuid(), 'Order', 'a', 'E', '{}')",
        )
        .await
        .unwrap();
    let status = run_outboxd(&[
        "status",
        "--database-url",
        &url,
        "--table",
        "public.local_outbox",
        "--json",
    ]);
    let json: serde_json::Value = serde_json::from_slice(&status.stdout)
        .unwrap_or_else(|e| panic!("status is not JSON ({e}): {}", stderr_of(&status)));
    let age = json["oldest_unpublished_age_seconds"]
        .as_f64()
        .unwrap_or_else(|| panic!("{json}"));
    assert!(
        (0.0..600.0).contains(&age),
        "an event inserted just now is {age} s old"
    );
}

/// Times outboxd writes into `timestamp without time zone` columns hold UTC wall-clock time on every path,
/// as it reads them: the CDC write-back wrote `published_at` in the server's time zone (here 14 hours
/// ahead), the polling path in UTC, so retention and ages judged one path's rows hours off.
#[tokio::test(flavor = "multi_thread")]
async fn times_written_without_time_zone_are_utc_on_every_path() {
    let pg = Postgres::start();
    let broker = Broker::start();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    client
        .batch_execute(
            "ALTER DATABASE postgres SET timezone = 'Pacific/Kiritimati';
             CREATE TABLE public.local_outbox (
                 event_id uuid PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
                 event_type text NOT NULL, payload jsonb NOT NULL,
                 created_at timestamp NOT NULL DEFAULT (now() AT TIME ZONE 'UTC'), published_at timestamp)",
        )
        .await
        .unwrap();
    let table = ["--table", "public.local_outbox"];
    migrate_with(&url, &[&table[..], &["--add-polling-columns"]].concat());
    for (event, mode) in [("cdc", "cdc"), ("poll", "poll")] {
        let mut args = run_args(&url, &brokers);
        args.extend(table);
        args.extend(["--mode", mode, "--metrics-addr", "off"]);
        let outboxd = Outboxd::spawn(&args);
        // The event must come through the slot: a row inserted before it exists is handed to polling.
        if mode == "cdc" {
            outboxd.wait_streaming();
        }
        client
            .execute(
                "INSERT INTO public.local_outbox (event_id, aggregate_type, aggregate_id, event_type, payload)
                 VALUES (gen_random_uuid(), 'Order', $1, 'E', '{}')",
                &[&event],
            )
            .await
            .unwrap();
        let hours_from_utc: f64 = wait_for_async(
            &format!("the {mode} path to publish its event"),
            Duration::from_secs(60),
            || async {
                client
                    .query_one(
                        "SELECT extract(epoch FROM published_at - (now() AT TIME ZONE 'UTC'))::float8 / 3600
                           FROM public.local_outbox WHERE aggregate_id = $1 AND published_at IS NOT NULL",
                        &[&event],
                    )
                    .await
                    .ok()
                    .map(|row| row.get(0))
            },
        )
        .await;
        assert!(
            hours_from_utc.abs() < 1.0,
            "the {mode} path wrote published_at {hours_from_utc:.1} hours from UTC"
        );
    }
}

/// Review F2: an unpublished row whose `created_at` is NULL (a nullable column is allowed) panicked the
/// figures task: the gauges froze and `/readyz` kept its last 200 after PostgreSQL went away; `status`
/// exited 101. Now its age is unknown, the figures go on, and readiness follows the database.
#[tokio::test(flavor = "multi_thread")]
async fn a_row_without_created_at_neither_freezes_readiness_nor_breaks_status() {
    let pg = Postgres::start();
    let broker = Broker::start();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    client
        .batch_execute(
            "CREATE TABLE public.nullable_outbox (
                 event_id uuid PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
                 event_type text NOT NULL, payload jsonb NOT NULL, created_at timestamptz NULL)",
        )
        .await
        .unwrap();
    let table = ["--table", "public.nullable_outbox"];
    let mut migrate = vec!["migrate", "--database-url", &url, "--add-polling-columns"];
    migrate.extend(table);
    let migrated = run_outboxd(&migrate);
    assert!(migrated.status.success(), "{}", stderr_of(&migrated));
    // Not claimable for an hour: it stays the first unpublished row.
    client
        .batch_execute(
            "INSERT INTO public.nullable_outbox (event_id, aggregate_type, aggregate_id, event_type, payload, created_at, available_at)
             VALUES (gen_random_uuid(), 'Order', 'a', 'E', '{}', NULL, now() + interval '1 hour')",
        )
        .await
        .unwrap();
    let (_outboxd, metrics_addr) =
        spawn_serving_metrics(&url, &brokers, &[&["--mode", "poll"][..], &table].concat());
    wait_for(
        "the backlog gauge to count the row",
        Duration::from_secs(60),
        || {
            let (_, text) = http_get(&metrics_addr, "/metrics")?;
            (metric_value(&text, "outboxd_unpublished_events", "")? == 1.0).then_some(())
        },
    );
    wait_ready(&metrics_addr);
    // A row an hour old behind it: the oldest age is its, not 0 for the first row's unknown age (review
    // finding 14: the gauge read 0).
    client
        .batch_execute(
            "INSERT INTO public.nullable_outbox (event_id, aggregate_type, aggregate_id, event_type, payload, created_at, available_at)
             VALUES (gen_random_uuid(), 'Order', 'b', 'E', '{}', now() - interval '1 hour', now() + interval '1 hour')",
        )
        .await
        .unwrap();
    wait_for(
        "the oldest age to be the hour-old row's",
        Duration::from_secs(60),
        || {
            let (_, text) = http_get(&metrics_addr, "/metrics")?;
            let oldest = metric_value(&text, "outboxd_oldest_unpublished_age_seconds", "")?;
            (metric_value(&text, "outboxd_unpublished_events", "")? == 2.0 && oldest >= 3600.0)
                .then_some(())
        },
    );
    let mut status = vec!["status", "--database-url", &url, "--mode", "poll", "--json"];
    status.extend(table);
    let output = run_outboxd(&status);
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "status exited {:?} without JSON ({e}): {}",
            output.status.code(),
            stderr_of(&output)
        )
    });
    assert_eq!(json["unpublished_events"], 2, "{json}");
    assert!(
        json["oldest_unpublished_age_seconds"].as_f64() >= Some(3600.0),
        "{json}"
    );
    pg.stop();
    let (_, reason) = wait_for("/readyz to be 503", Duration::from_secs(60), || {
        http_get(&metrics_addr, "/readyz").filter(|r| r.0 == 503)
    });
    assert!(
        reason.contains("PostgreSQL") || reason.contains("reconnecting"),
        "{reason}"
    );
}

/// Review F7 (shape): a table with `published_at` but without the polling columns has no index for its
/// backlog; the 5-s count read the whole table every time (and timed out on a big one, reading as
/// "PostgreSQL is unreachable"). Now it is not counted, the log names the index that fixes it, and once
/// that index exists the table is counted again.
#[tokio::test(flavor = "multi_thread")]
async fn a_backlog_no_index_serves_is_not_counted_by_reading_the_table() {
    let pg = Postgres::start();
    let broker = Broker::start();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    client
        .batch_execute(
            "CREATE TABLE public.marked_outbox (
                 event_id uuid PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
                 event_type text NOT NULL, payload jsonb NOT NULL,
                 created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz);
             INSERT INTO public.marked_outbox (event_id, aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT gen_random_uuid(), 'Order', 'order-' || (i % 1000), 'E', '{}', now()
             FROM generate_series(1, 1000000) AS i",
        )
        .await
        .unwrap();
    client
        .batch_execute("VACUUM ANALYZE public.marked_outbox")
        .await
        .unwrap();
    let table = ["--table", "public.marked_outbox"];
    let mut migrate = vec!["migrate", "--database-url", &url];
    migrate.extend(table);
    let migrated = run_outboxd(&migrate);
    assert!(migrated.status.success(), "{}", stderr_of(&migrated));
    let (outboxd, metrics_addr) =
        spawn_serving_metrics(&url, &brokers, &[&["--mode", "cdc"][..], &table].concat());
    wait_ready(&metrics_addr);
    wait_for(
        "the log to name the missing index",
        Duration::from_secs(60),
        || {
            let log = outboxd.log_text();
            (log.contains("not counted") && log.contains("CREATE INDEX CONCURRENTLY")).then_some(())
        },
    );
    let seq_scans = || async {
        client
            .query_one(
                "SELECT seq_scan FROM pg_stat_user_tables WHERE relid = 'public.marked_outbox'::regclass",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    let refreshes = || outboxd.log_text().matches("readiness refreshed").count();
    let (scans_before, refreshed_before) = (seq_scans().await, refreshes());
    wait_for("three more refreshes", Duration::from_secs(60), || {
        (refreshes() >= refreshed_before + 3).then_some(())
    });
    // A backend reports its scans at the end of its next statement a second or more later: the third
    // refresh reports those of the first two.
    assert_eq!(
        seq_scans().await,
        scans_before,
        "a periodic query read the whole table"
    );
    assert_eq!(
        http_get(&metrics_addr, "/readyz").map(|r| r.0),
        Some(200),
        "an uncounted backlog is no unreachable database"
    );
    // Nor do `outboxd status` and `outboxd doctor` (status read the whole table at every monitoring run).
    let scans_before = seq_scans().await;
    for command in ["status", "doctor"] {
        let mut args = vec![
            command,
            "--database-url",
            &url,
            "--brokers",
            &brokers,
            "--mode",
            "cdc",
        ];
        args.extend(table);
        let output = run_outboxd(&args);
        assert!(
            output.status.code().is_some_and(|code| code < 3),
            "{command}: {}",
            stderr_of(&output)
        );
    }
    let refreshed_before = refreshes();
    wait_for("two more refreshes", Duration::from_secs(60), || {
        (refreshes() >= refreshed_before + 2).then_some(())
    });
    assert_eq!(
        seq_scans().await,
        scans_before,
        "status or doctor read the whole table"
    );
    client
        .batch_execute(
            "CREATE INDEX CONCURRENTLY ON public.marked_outbox (created_at) WHERE published_at IS NULL",
        )
        .await
        .unwrap();
    wait_for(
        "the table to be counted again",
        Duration::from_secs(60),
        || outboxd.log_text().contains("counted again").then_some(()),
    );
}

/// Review F7 (slow): figures that take longer than their 4 s (here: the table locked by another session)
/// are a warning in the log; `/readyz` stays 200, since PostgreSQL answers (it said "PostgreSQL is
/// unreachable").
#[tokio::test(flavor = "multi_thread")]
async fn slow_figures_are_not_an_unreachable_database() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let (outboxd, metrics_addr) = spawn_serving_metrics(&url, &brokers, &["--mode", "cdc"]);
    wait_ready(&metrics_addr);
    let mut locker = pg.client().await;
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute("LOCK TABLE outbox_event IN ACCESS EXCLUSIVE MODE")
        .await
        .unwrap();
    let mut answers = Vec::new();
    wait_for(
        "the log to say the figures could not be refreshed",
        Duration::from_secs(60),
        || {
            answers.extend(http_get(&metrics_addr, "/readyz"));
            let said = outboxd
                .log_text()
                .contains("backlog figures could not be refreshed");
            (said || answers.iter().any(|(code, _)| *code != 200)).then_some(())
        },
    );
    answers.extend(http_get(&metrics_addr, "/readyz"));
    lock.rollback().await.unwrap();
    let not_ready: Vec<_> = answers.iter().filter(|(code, _)| *code != 200).collect();
    assert!(not_ready.is_empty(), "{not_ready:?}");
    wait_for(
        "the figures to be refreshed again",
        Duration::from_secs(60),
        || outboxd.log_text().contains("refreshed again").then_some(()),
    );
}

/// Review F9: dead letters stay visible in `/metrics` for as long as they wait in the table, whichever
/// process dead-lettered them (the only metric was a counter of this process's dead-letterings).
#[tokio::test(flavor = "multi_thread")]
async fn dead_letters_stay_visible_in_metrics_across_restarts() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    // Dead-lettered by an earlier process.
    client
        .batch_execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, dead_at, attempts, last_error)
             SELECT gen_random_uuid(), 'Order', 'order-' || i, 'E', '{}', now(), 10, 'refused'
             FROM generate_series(1, 3) AS i",
        )
        .await
        .unwrap();
    let (_outboxd, metrics_addr) = spawn_serving_metrics(&url, &brokers, &["--mode", "poll"]);
    wait_for(
        "outboxd_dead_events to be 3",
        Duration::from_secs(60),
        || {
            let (_, text) = http_get(&metrics_addr, "/metrics")?;
            (metric_value(&text, "outboxd_dead_events", "")? == 3.0).then_some(())
        },
    );
}

/// Adversarial review of readiness (1): while the pipeline cannot stream (another client holds the slot, so
/// its session retries), the backlog grows and `/metrics` says so; it said 0 whenever the instance was not
/// streaming, which kept the backlog alerts from ever firing.
#[tokio::test(flavor = "multi_thread")]
async fn the_backlog_shows_while_the_pipeline_cannot_stream() {
    let (pg, broker) = migrated_stack();
    let client = pg.client().await;
    client
        .batch_execute("SELECT pg_create_logical_replication_slot('outboxd', 'pgoutput')")
        .await
        .unwrap();
    let _other = OtherSlotClient::start(&pg, "outboxd");
    wait_slot_active(&client, "outboxd").await;
    let (url, brokers) = (pg.url(), broker.addr());
    let (outboxd, metrics_addr) = spawn_serving_metrics(
        &url,
        &brokers,
        &["--mode", "cdc", "--startup-timeout", "10m"],
    );
    let mut client = client;
    insert_events(&mut client, 0, 5, 1, 5, None).await;
    wait_for(
        "outboxd_unpublished_events to count the 5 waiting events",
        Duration::from_secs(60),
        || {
            let (_, text) = http_get(&metrics_addr, "/metrics")?;
            (metric_value(&text, "outboxd_unpublished_events", "")? == 5.0).then_some(())
        },
    );
    let (_, text) = http_get(&metrics_addr, "/metrics").unwrap();
    assert_eq!(
        metric_value(&text, "outboxd_events_published_total", "path=\"cdc\"").unwrap_or(0.0),
        0.0,
        "{text}"
    );
    drop(outboxd);
}
