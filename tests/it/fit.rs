//! Existing outbox tables (issue 7): Debezium's table, column mapping, header columns, payload types and
//! tombstones, partitioned tables with retention, and several tables through one slot. Real PostgreSQL 15
//! and a real Kafka-protocol broker.

use std::time::Duration;

use crate::support::*;

/// The in-flight window of the kill tests: each SIGKILL may re-send at most this many events.
const KILL_TEST_WINDOW: usize = 20;
/// Transactions per round of the kill tests: enough that a round takes many windows to stream.
const KILL_TEST_ROUND_TXNS: usize = 200;

/// A PostgreSQL cluster with `create` run in it, a broker, and a client.
async fn stack_with(create: &str) -> (Postgres, Broker, tokio_postgres::Client) {
    let pg = Postgres::start();
    let broker = Broker::start();
    let client = pg.client().await;
    client.batch_execute(create).await.unwrap();
    (pg, broker, client)
}

/// Migrates `orders.outbox_event` and `billing.outbox_event` (with `extra` mapping options) and returns the
/// `run` arguments that stream both through one slot, to `{schema}.{aggregate_type}` topics.
fn two_schema_args(pg: &Postgres, broker: &Broker, extra: &[&str]) -> Vec<String> {
    let mut tables = vec![
        "--table",
        "orders.outbox_event",
        "--table",
        "billing.outbox_event",
    ];
    tables.extend_from_slice(extra);
    let (url, brokers) = (pg.url(), broker.addr());
    migrate_with(&url, &tables);
    let mut args = run_args(&url, &brokers);
    args.extend(tables);
    args.extend(["--topic", "{schema}.{aggregate_type}"]);
    args.into_iter().map(String::from).collect()
}

async fn wait_2020_partition_dropped(client: &tokio_postgres::Client) {
    wait_for_async(
        "retention to drop the 2020 partition",
        Duration::from_secs(60),
        || async {
            let left = count(
                client,
                "SELECT count(*) FROM pg_class WHERE relname = 'outbox_p_2020'",
            )
            .await;
            (left == 0).then_some(())
        },
    )
    .await;
}

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client.query_one(sql, &[]).await.unwrap().get(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_debezium_outbox_table_is_published_as_debeziums_router_publishes_it() {
    // Debezium's documented outbox table, as a team already runs it.
    let (pg, broker, client) = stack_with(
        "CREATE TABLE public.outboxevent (
                 id uuid NOT NULL PRIMARY KEY,
                 aggregatetype varchar(255) NOT NULL,
                 aggregateid varchar(255) NOT NULL,
                 type varchar(255) NOT NULL,
                 payload jsonb)",
    )
    .await;
    let (url, brokers) = (pg.url(), broker.addr());
    let table = ["--table", "public.outboxevent", "--table-style", "debezium"];
    let stderr = migrate_with(&url, &table);
    assert!(
        stderr.contains("CDC only") && stderr.contains("--add-polling-columns"),
        "migrate must say the existing table stays CDC only: {stderr}"
    );
    let columns = count(
        &client,
        "SELECT count(*) FROM information_schema.columns WHERE table_name = 'outboxevent'",
    )
    .await;
    assert_eq!(columns, 5, "migrate must not touch the table unasked");

    let mut args = run_args(&url, &brokers);
    args.extend(table);
    let mut outboxd = Outboxd::spawn(&args);
    wait_slot_active(&client, "outboxd").await;
    let insert = "INSERT INTO public.outboxevent (id, aggregatetype, aggregateid, type, payload)
                  VALUES ($1, 'Order', $2, 'OrderCreated', jsonb_build_object('n', $3::int8))";
    let mut ids = Vec::new();
    for n in 0..10i64 {
        let id = uuid::Uuid::new_v4();
        let aggregate = format!("order-{}", n % 3);
        client
            .execute(insert, &[&id, &aggregate, &n])
            .await
            .unwrap();
        ids.push((id, aggregate, n));
    }
    let records = consume_all(
        &brokers,
        &["outbox.event.Order"],
        10,
        Duration::from_secs(60),
    );
    assert_eq!(records.len(), 10);
    for (id, aggregate, n) in &ids {
        let record = records
            .iter()
            .find(|r| r.headers.get("id") == Some(&id.to_string()))
            .unwrap_or_else(|| panic!("no record for event {id}"));
        assert_eq!(record.key.as_deref(), Some(aggregate.as_str()));
        assert!(
            !record.headers.contains_key("created_at"),
            "no created_at column, no header"
        );
        let value: serde_json::Value =
            serde_json::from_slice(record.value.as_deref().unwrap()).unwrap();
        assert_eq!(value, serde_json::json!({ "n": n }));
    }
    for aggregate in ["order-0", "order-1", "order-2"] {
        let published: Vec<&String> = records
            .iter()
            .filter(|r| r.key.as_deref() == Some(aggregate))
            .map(|r| &r.headers["id"])
            .collect();
        let inserted: Vec<String> = ids
            .iter()
            .filter(|i| i.1 == aggregate)
            .map(|i| i.0.to_string())
            .collect();
        assert_eq!(
            published,
            inserted.iter().collect::<Vec<_>>(),
            "{aggregate} in order"
        );
    }
    assert!(
        outboxd.log_text().contains("running CDC only"),
        "start-up must say CDC only:\n{}",
        outboxd.log_text()
    );

    // `status` reads a CDC-only table too: the slot is there, no backlog to count.
    let mut status_args = vec!["status", "--database-url", &url, "--json"];
    status_args.extend(table);
    let status = run_outboxd(&status_args);
    let status_json: serde_json::Value = serde_json::from_slice(&status.stdout)
        .unwrap_or_else(|e| panic!("status is not JSON ({e}): {}", stderr_of(&status)));
    assert_eq!(status_json["slot_exists"], true, "{status_json}");
    assert_eq!(status_json["table"], "public.outboxevent", "{status_json}");

    // Adding the polling columns when asked: later events get published_at.
    outboxd.terminate();
    let mut with_polling = table.to_vec();
    with_polling.push("--add-polling-columns");
    migrate_with(&url, &with_polling);
    let late = uuid::Uuid::new_v4();
    client
        .execute(insert, &[&late, &"order-9", &99i64])
        .await
        .unwrap();
    let _outboxd = Outboxd::spawn(&args);
    wait_for_async("published_at of the later event", Duration::from_secs(60), || async {
        let published = count(
            &client,
            &format!("SELECT count(*) FROM public.outboxevent WHERE id = '{late}' AND published_at IS NOT NULL"),
        )
        .await;
        (published == 1).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn header_columns_become_headers_and_null_leaves_the_header_out() {
    let (pg, broker, client) = stack_with("CREATE TABLE public.traced_outbox (
                 event_id uuid PRIMARY KEY, kind text NOT NULL, aggregate_type text NOT NULL,
                 aggregate_id text NOT NULL, body jsonb NOT NULL, occurred_at timestamptz NOT NULL DEFAULT now(),
                 traceparent text, tenant_id integer)").await;
    let (url, brokers) = (pg.url(), broker.addr());
    let table = [
        "--table",
        "traced_outbox",
        "--column",
        "event_type=kind",
        "--column",
        "payload=body",
        "--column",
        "created_at=occurred_at",
        "--header-column",
        "traceparent",
        "--header-column",
        "tenant_id",
    ];
    migrate_with(&url, &[&table[..], &["--add-polling-columns"]].concat());
    let insert = "INSERT INTO traced_outbox (event_id, kind, aggregate_type, aggregate_id, body, traceparent, tenant_id)
                  VALUES ($1, 'Paid', 'Payment', $2, '{}', $3, $4)";
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    let mut args = run_args(&url, &brokers);
    args.extend(table);
    let mut expected = Vec::new();
    // The CDC path, then the polling path, must both copy the columns.
    for (phase, mode) in [(0, "cdc"), (1, "poll")] {
        let mut phase_args = args.clone();
        phase_args.extend(["--mode", mode]);
        let outboxd = Outboxd::spawn(&phase_args);
        if mode == "cdc" {
            wait_slot_active(&client, "outboxd").await;
        }
        for (n, (trace, tenant)) in [(Some(traceparent), Some(42)), (None, None)]
            .into_iter()
            .enumerate()
        {
            let id = uuid::Uuid::new_v4();
            let aggregate = format!("pay-{phase}-{n}");
            client
                .execute(insert, &[&id, &aggregate, &trace, &tenant])
                .await
                .unwrap();
            expected.push((aggregate, trace, tenant));
        }
        wait_all_published_in(&client, "traced_outbox").await;
        drop(outboxd);
    }
    let records = consume_all(&brokers, &["outbox.Payment"], 4, Duration::from_secs(60));
    assert_eq!(records.len(), 4, "each event once");
    for (aggregate, trace, tenant) in expected {
        let record = records
            .iter()
            .find(|r| r.key.as_deref() == Some(aggregate.as_str()))
            .unwrap();
        assert_eq!(
            record.headers.get("traceparent").map(String::as_str),
            trace,
            "{aggregate}"
        );
        assert_eq!(
            record.headers.get("tenant_id").cloned(),
            tenant.map(|t: i32| t.to_string()),
            "{aggregate}"
        );
        assert_eq!(record.headers["event_type"], "Paid");
        assert!(
            record.headers["created_at"].ends_with('Z'),
            "{:?}",
            record.headers
        );
    }
}

/// Waits until every row of `table` has `published_at`.
async fn wait_all_published_in(client: &tokio_postgres::Client, table: &str) {
    let sql = format!("SELECT count(*) FROM {table} WHERE published_at IS NULL");
    wait_for_async(
        &format!("every row of {table} published"),
        Duration::from_secs(60),
        || async { (count(client, &sql).await == 0).then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn json_text_and_bytea_payloads_go_out_as_stored_and_null_is_a_tombstone() {
    let pg = Postgres::start();
    let broker = Broker::start();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    let tables = "public.json_outbox,public.text_outbox,public.bytea_outbox";
    migrate_with(&url, &["--table", tables]);
    client
        .batch_execute(
            "ALTER TABLE json_outbox ALTER COLUMN payload TYPE json USING payload::json;
             ALTER TABLE text_outbox ALTER COLUMN payload TYPE text USING payload::text,
                                     ALTER COLUMN payload DROP NOT NULL;
             ALTER TABLE bytea_outbox ALTER COLUMN payload TYPE bytea USING convert_to(payload::text, 'UTF8'),
                                      ALTER COLUMN payload DROP NOT NULL;",
        )
        .await
        .unwrap();
    let mut args = run_args(&url, &brokers);
    args.extend(["--table", tables, "--topic", "{table}"]);
    let inserts = |phase: &'static str| {
        let client = &client;
        async move {
            let rows: [(&str, &str, &str); 5] = [
                ("json_outbox", "j", r#"'{"b":  2,   "a": [1]}'"#),
                ("text_outbox", "t", "'plain text, not JSON'"),
                ("text_outbox", "t-null", "NULL"),
                ("bytea_outbox", "b", r"'\x00ff7f41'::bytea"),
                ("bytea_outbox", "b-null", "NULL"),
            ];
            for (table, aggregate, payload) in rows {
                client
                    .batch_execute(&format!(
                        "INSERT INTO {table} (event_id, aggregate_type, aggregate_id, event_type, payload)
                         VALUES (gen_random_uuid(), 'Doc', '{aggregate}-{phase}', 'E', {payload})"
                    ))
                    .await
                    .unwrap();
            }
        }
    };
    // The CDC path, then the polling path.
    for mode in ["cdc", "poll"] {
        let mut phase_args = args.clone();
        phase_args.extend(["--mode", mode]);
        let outboxd = Outboxd::spawn(&phase_args);
        if mode == "cdc" {
            wait_slot_active(&client, "outboxd").await;
        }
        inserts(mode).await;
        for table in ["json_outbox", "text_outbox", "bytea_outbox"] {
            wait_all_published_in(&client, table).await;
        }
        drop(outboxd);
    }
    let records = consume_all(
        &brokers,
        &["json_outbox", "text_outbox", "bytea_outbox"],
        10,
        Duration::from_secs(60),
    );
    assert_eq!(records.len(), 10, "each event once");
    for mode in ["cdc", "poll"] {
        let value = |aggregate: &str| {
            let key = format!("{aggregate}-{mode}");
            records
                .iter()
                .find(|r| r.key.as_deref() == Some(key.as_str()))
                .unwrap_or_else(|| panic!("no record for {key}"))
                .value
                .clone()
        };
        // json keeps its text as written; jsonb would normalise it.
        assert_eq!(
            value("j").as_deref(),
            Some(&br#"{"b":  2,   "a": [1]}"#[..]),
            "{mode}"
        );
        assert_eq!(
            value("t").as_deref(),
            Some(&b"plain text, not JSON"[..]),
            "{mode}"
        );
        assert_eq!(
            value("b").as_deref(),
            Some(&[0x00, 0xff, 0x7f, 0x41][..]),
            "{mode}"
        );
        assert_eq!(value("t-null"), None, "{mode}: NULL payload is a tombstone");
        assert_eq!(value("b-null"), None, "{mode}: NULL payload is a tombstone");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_partitioned_table_streams_across_partitions_and_retention_drops_old_ones() {
    let (pg, broker, client) = stack_with(PARTITIONED_TABLE).await;
    let (url, brokers) = (pg.url(), broker.addr());
    migrate_with(&url, &["--table", "outbox_p", "--add-polling-columns"]);
    let via_root: bool = client
        .query_one(
            "SELECT pubviaroot FROM pg_publication WHERE pubname = 'outboxd'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        via_root,
        "the publication must publish via the partition root"
    );
    let mut args = run_args(&url, &brokers);
    args.extend(["--table", "outbox_p"]);
    let mut outboxd = Outboxd::spawn(&args);
    wait_slot_active(&client, "outboxd").await;
    // One aggregate's events alternate between the two partitions.
    let mut committed = Vec::new();
    for seq in 0..20i64 {
        let id = uuid::Uuid::new_v4();
        let created_at = if seq % 2 == 0 {
            "'2020-06-01 00:00:00+00'"
        } else {
            "now()"
        };
        client
            .batch_execute(&format!(
                "INSERT INTO outbox_p (event_id, aggregate_type, aggregate_id, event_type, payload, created_at)
                 VALUES ('{id}', 'Order', 'order-1', 'E', '{{\"seq\": {seq}}}', {created_at})"
            ))
            .await
            .unwrap();
        committed.push(Inserted {
            event_id: id,
            aggregate_id: "order-1".into(),
            seq,
        });
    }
    let (_, report) = verify_delivery(&brokers, &committed, &[], 60, "partitioned table");
    assert_eq!(report.duplicates, 0);
    wait_all_published_in(&client, "outbox_p").await;
    // Retention (started only now: it would drop the empty 2020 partition before the inserts).
    outboxd.terminate();
    args.extend(["--retention", "30d", "--retention-interval", "1s"]);
    let outboxd = Outboxd::spawn(&args);
    wait_2020_partition_dropped(&client).await;
    assert_eq!(
        count(&client, "SELECT count(*) FROM outbox_p").await,
        10,
        "the current partition keeps its rows"
    );
    // The drop commits before it is logged.
    let log = wait_for(
        "retention to log the dropped partition",
        Duration::from_secs(60),
        || {
            let log = outboxd.log_text();
            log.contains("outbox_p_2020").then_some(log)
        },
    );
    assert!(
        !log.contains("not an outbox table"),
        "partitions are no foreign tables:\n{log}"
    );
}

/// Retention of a partitioned table under README's role plus what README says it needs for partitions:
/// membership in the role that owns the table and its partitions (DETACH and DROP cannot be granted).
#[tokio::test(flavor = "multi_thread")]
async fn retention_drops_old_partitions_as_a_member_of_the_owner_role() {
    let (pg, broker, client) = stack_with(PARTITIONED_TABLE).await;
    migrate_with(&pg.url(), &["--table", "outbox_p", "--add-polling-columns"]);
    // The application's role owns the table and its partitions (and so the sequence migrate added).
    client
        .batch_execute(
            "CREATE ROLE app_owner;
             ALTER TABLE outbox_p OWNER TO app_owner;
             ALTER TABLE outbox_p_2020 OWNER TO app_owner;
             ALTER TABLE outbox_p_now OWNER TO app_owner;",
        )
        .await
        .unwrap();
    // Published long ago, in the 2020 partition; one recent row in the current one.
    client
        .batch_execute(
            "INSERT INTO outbox_p (event_id, aggregate_type, aggregate_id, event_type, payload, created_at, published_at)
             SELECT gen_random_uuid(), 'Order', 'o-' || i, 'E', '{}', '2020-06-01 00:00:00+00', now() - interval '1 year'
             FROM generate_series(1, 10) i;
             INSERT INTO outbox_p (event_id, aggregate_type, aggregate_id, event_type, payload, published_at)
             VALUES (gen_random_uuid(), 'Order', 'r-1', 'E', '{}', now());",
        )
        .await
        .unwrap();
    let url = readme_role(
        &pg,
        "partitions-secret",
        "outbox_p",
        "GRANT app_owner TO outboxd_app;",
    )
    .await;
    let brokers = broker.addr();
    let mut args = run_args(&url, &brokers);
    args.extend([
        "--table",
        "outbox_p",
        "--retention",
        "30d",
        "--retention-interval",
        "1s",
    ]);
    let outboxd = Outboxd::spawn(&args);
    wait_2020_partition_dropped(&client).await;
    assert_eq!(
        count(&client, "SELECT count(*) FROM outbox_p").await,
        1,
        "the current partition keeps its row"
    );
    assert!(
        !outboxd.log_text().contains("permission denied"),
        "{}",
        outboxd.log_text()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn two_schemas_tables_stream_through_one_slot_to_their_own_topics() {
    let pg = Postgres::start();
    let broker = Broker::start();
    let client = pg.client().await;
    // billing's table names its payload column `body`: each table is mapped with its own columns (migrate
    // creates it that way).
    let args = two_schema_args(
        &pg,
        &broker,
        &["--column", "billing.outbox_event:payload=body"],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let brokers = broker.addr();
    let _outboxd = Outboxd::spawn(&args);
    wait_slot_active(&client, "outboxd").await;
    let insert = |schema: &str, aggregate_type: &str, n: i64| {
        let payload = if schema == "billing" {
            "body"
        } else {
            "payload"
        };
        format!(
            "INSERT INTO {schema}.outbox_event (event_id, aggregate_type, aggregate_id, event_type, {payload})
             VALUES (gen_random_uuid(), '{aggregate_type}', 'agg-{n}', 'E', '{{\"n\": {n}}}');"
        )
    };
    // Every third transaction writes to both tables: one transaction, two tables.
    for n in 0..30i64 {
        let mut sql = format!("BEGIN; {}", insert("orders", "Order", n));
        if n % 3 == 0 {
            sql.push_str(&insert("billing", "Invoice", n));
        }
        sql.push_str("COMMIT;");
        client.batch_execute(&sql).await.unwrap();
    }
    let records = consume_all(
        &brokers,
        &["orders.Order", "billing.Invoice"],
        40,
        Duration::from_secs(60),
    );
    assert_eq!(records.len(), 40, "each event once");
    for record in &records {
        let value: serde_json::Value =
            serde_json::from_slice(record.value.as_deref().unwrap()).unwrap();
        let key = record.key.as_deref().unwrap();
        assert_eq!(format!("agg-{}", value["n"]), key, "{}", record.topic);
    }
    assert_eq!(
        records
            .iter()
            .filter(|r| r.topic == "billing.Invoice")
            .count(),
        10
    );
    assert_eq!(
        records.iter().filter(|r| r.topic == "orders.Order").count(),
        30
    );
    wait_all_published_in(&client, "orders.outbox_event").await;
    wait_all_published_in(&client, "billing.outbox_event").await;
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'logical'"
        )
        .await,
        1,
        "one slot for both tables"
    );
    let published: i64 = count(
        &client,
        "SELECT count(*) FROM pg_publication_tables WHERE pubname = 'outboxd'",
    )
    .await;
    assert_eq!(published, 2, "one publication covering both tables");
}

/// Events of an aggregate waiting for the polling path, whose rows their own transactions deleted, are written
/// back for it (not published from the stream ahead of the waiting event, as they once were).
#[tokio::test(flavor = "multi_thread")]
async fn deleted_rows_of_an_aggregate_waiting_for_the_polling_path_are_still_published() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    // An event older than the slot, held by another worker's lease: its aggregate waits for the polling path.
    let old = insert_events(&mut client, 0, 1, 1, 1, None).await.0;
    client
        .batch_execute(
            "UPDATE outbox_event SET lease_token = gen_random_uuid(), lease_until = now() + interval '1 hour'",
        )
        .await
        .unwrap();
    let mut args = run_args(&url, &brokers);
    // A small window: the aggregate's later events are soon handed to the polling path, not parked.
    args.extend(["--max-in-flight-events", "16"]);
    let outboxd = Outboxd::spawn(&args);
    wait_slot_active(&client, "outboxd").await;
    let mut committed = old.clone();
    for t in 1..=20 {
        let tx = client.transaction().await.unwrap();
        let events = insert_txn_events(&tx, t, 1, 1).await;
        tx.batch_execute("DELETE FROM outbox_event WHERE handoff_at IS NULL")
            .await
            .unwrap();
        tx.commit().await.unwrap();
        committed.extend(events);
    }
    wait_for(
        "a handed-off event without a row written back",
        Duration::from_secs(60),
        || {
            outboxd
                .log_text()
                .contains("were written back, handed off")
                .then_some(())
        },
    );
    // The lease ends: the polling path publishes the old event and the aggregate is unblocked.
    client
        .batch_execute("UPDATE outbox_event SET lease_token = NULL, lease_until = NULL")
        .await
        .unwrap();
    let records = consume_all(&brokers, &[TOPIC], committed.len(), Duration::from_secs(60));
    let report = check_delivery(&records, &committed, &[]);
    assert_eq!(report.missing, 0, "{report:?}");
    // Written back with their positions, the events wait behind the old one and keep their order.
    assert_eq!(report.order_violations, 0, "{report:?}");
    wait_all_published(&client, Duration::from_secs(60)).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cdc_only_table_emptied_by_its_writers_loses_nothing_when_outboxd_is_killed() {
    let (pg, broker, mut client) = stack_with(CDC_ONLY_TABLE).await;
    let (url, brokers) = (pg.url(), broker.addr());
    migrate_with(&url, &[]);
    let window = KILL_TEST_WINDOW.to_string();
    let mut args = run_args(&url, &brokers);
    args.extend(["--max-in-flight-events", &window]);
    create_slot_then_stop(&url, &brokers, &client).await;
    let mut committed = Vec::new();
    let mut txn = 0;
    for _ in 0..4 {
        // The round waits in the WAL while outboxd is down, so that the kill lands mid-round.
        let start = current_wal_lsn(&client).await;
        // An order service that keeps its outbox empty: insert and delete in one transaction.
        for _ in 0..KILL_TEST_ROUND_TXNS {
            let tx = client.transaction().await.unwrap();
            let events = insert_txn_events(&tx, txn, 5, 7).await;
            tx.batch_execute("DELETE FROM outbox_event").await.unwrap();
            tx.commit().await.unwrap();
            committed.extend(events);
            txn += 1;
        }
        let end = current_wal_lsn(&client).await;
        let mut outboxd = Outboxd::spawn(&args);
        kill_mid_round(&client, &mut outboxd, start, end).await;
    }
    let _outboxd = Outboxd::spawn(&args);
    let end = current_wal_lsn(&client).await;
    wait_confirmed_past(&client, "outboxd", end, "the slot to pass every insert").await;
    let (_, report) = verify_delivery(&brokers, &committed, &[], 60, "CDC-only, killed 4 times");
    println!(
        "CDC-only, 4 kills during {} events: {} duplicates (window {KILL_TEST_WINDOW})",
        committed.len(),
        report.duplicates
    );
    assert!(
        report.duplicates <= 4 * KILL_TEST_WINDOW,
        "re-sent more than the in-flight window per kill: {}",
        report.duplicates
    );
    assert_eq!(count(&client, "SELECT count(*) FROM outbox_event").await, 0);
}

/// A CDC-only table (no polling columns) cannot cover what an invalidated slot missed: outboxd refuses to start,
/// naming the slot, the cause and the fix, instead of replacing the slot and skipping the gap.
#[tokio::test(flavor = "multi_thread")]
async fn a_cdc_only_table_whose_slot_was_invalidated_refuses_to_start_with_the_fix() {
    let (pg, broker, mut client) = stack_with(CDC_ONLY_TABLE).await;
    let (url, brokers) = (pg.url(), broker.addr());
    migrate_with(&url, &[]);
    create_slot_then_stop(&url, &brokers, &client).await;
    insert_events(&mut client, 0, 5, 5, 5, None).await;
    lose_slot(&client, "outboxd").await;

    let mut args = run_args(&url, &brokers);
    args.extend(["--startup-timeout", "5s"]);
    let output = run_outboxd(&args);
    let stderr = stderr_of(&output);
    assert!(!output.status.success(), "{stderr}");
    for expected in [
        "replication slot outboxd is invalidated (wal_status = lost)",
        "pg_drop_replication_slot('outboxd')",
        "When the slot is lost",
    ] {
        assert!(stderr.contains(expected), "{expected:?} in:\n{stderr}");
    }
    assert_eq!(
        slot_count(&client, "outboxd").await,
        1,
        "the lost slot is left for the operator to decide"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_table_of_only_id_key_and_payload_is_published_with_what_it_has() {
    let (pg, broker, client) = stack_with(
        "CREATE TABLE public.lean_outbox (id uuid PRIMARY KEY, entity text NOT NULL, body jsonb NOT NULL)",
    )
    .await;
    let (url, brokers) = (pg.url(), broker.addr());
    let table = [
        "--table",
        "lean_outbox",
        "--column",
        "event_id=id",
        "--column",
        "aggregate_id=entity",
        "--column",
        "payload=body",
    ];
    // The default topic names {aggregate_type}, which this table lacks: refused with the fix.
    let mut refused = vec!["run", "--database-url", &url, "--brokers", "127.0.0.1:1"];
    refused.extend(table);
    let output = run_outboxd(&refused);
    let stderr = stderr_of(&output);
    assert!(!output.status.success());
    assert!(
        stderr.contains("--topic uses {aggregate_type}")
            && stderr.contains("no aggregate_type column"),
        "{stderr}"
    );
    migrate_with(&url, &[&table[..], &["--add-polling-columns"]].concat());
    let mut args = run_args(&url, &brokers);
    args.extend(table);
    args.extend(["--topic", "events.{table}"]);
    for (n, mode) in ["cdc", "poll"].into_iter().enumerate() {
        let mut phase_args = args.clone();
        phase_args.extend(["--mode", mode]);
        let outboxd = Outboxd::spawn(&phase_args);
        if mode == "cdc" {
            wait_slot_active(&client, "outboxd").await;
        }
        client
            .batch_execute(&format!(
                "INSERT INTO lean_outbox (id, entity, body) VALUES (gen_random_uuid(), 'e-{mode}', '{{\"n\": {n}}}')"
            ))
            .await
            .unwrap();
        wait_all_published_in(&client, "lean_outbox").await;
        drop(outboxd);
    }
    let records = consume_all(
        &brokers,
        &["events.lean_outbox"],
        2,
        Duration::from_secs(60),
    );
    assert_eq!(records.len(), 2, "each event once");
    for record in &records {
        let mut names: Vec<&str> = record.headers.keys().map(String::as_str).collect();
        names.sort();
        assert_eq!(
            names,
            ["event_id"],
            "{:?}: only what the table has",
            record.key
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn two_tables_through_one_slot_lose_nothing_when_outboxd_is_killed() {
    let pg = Postgres::start();
    let broker = Broker::start();
    let mut client = pg.client().await;
    let window = KILL_TEST_WINDOW.to_string();
    let args = two_schema_args(&pg, &broker, &["--max-in-flight-events", &window]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let brokers = broker.addr();
    let mut outboxd = Outboxd::spawn(&args);
    wait_slot_active(&client, "outboxd").await;
    outboxd.kill();
    let mut committed = Vec::new();
    for round in 0..4i64 {
        // The round waits in the WAL while outboxd is down, so that the kill lands mid-round.
        let start = current_wal_lsn(&client).await;
        // Each transaction writes one event to each table; the aggregate's events alternate tables.
        let txns = KILL_TEST_ROUND_TXNS as i64;
        for n in 0..txns {
            let seq = round * txns + n;
            let tx = client.transaction().await.unwrap();
            for schema in ["orders", "billing"] {
                let id = uuid::Uuid::new_v4();
                let aggregate = format!("agg-{}", seq % 5);
                tx.execute(
                    &format!(
                        "INSERT INTO {schema}.outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                         VALUES ($1, 'Order', $2, 'E', '{{}}')"
                    ),
                    &[&id, &aggregate],
                )
                .await
                .unwrap();
                committed.push((
                    schema,
                    Inserted {
                        event_id: id,
                        aggregate_id: aggregate,
                        seq,
                    },
                ));
            }
            tx.commit().await.unwrap();
        }
        let end = current_wal_lsn(&client).await;
        let mut outboxd = Outboxd::spawn(&args);
        kill_mid_round(&client, &mut outboxd, start, end).await;
    }
    let _outboxd = Outboxd::spawn(&args);
    wait_all_published_in(&client, "orders.outbox_event").await;
    wait_all_published_in(&client, "billing.outbox_event").await;
    let mut duplicates = 0;
    for schema in ["orders", "billing"] {
        let topic = format!("{schema}.Order");
        let mine: Vec<Inserted> = committed
            .iter()
            .filter(|(s, _)| *s == schema)
            .map(|(_, e)| e.clone())
            .collect();
        let records = consume_all(&brokers, &[&topic], mine.len(), Duration::from_secs(60));
        let report = check_delivery(&records, &mine, &[]);
        println!("{topic} after 4 kills: {report:?}");
        assert_eq!(report.missing, 0, "{topic}");
        assert_eq!(report.order_violations, 0, "{topic}");
        duplicates += report.duplicates;
    }
    assert!(
        duplicates <= 4 * KILL_TEST_WINDOW,
        "re-sent more than the in-flight window per kill: {duplicates}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_handed_off_row_with_null_aggregate_columns_is_dead_lettered_and_the_rest_flows() {
    // A fitted table whose aggregate columns are nullable; rows written before outboxd's slot exists are
    // handed to the polling path at slot creation, NULL ones included.
    let (pg, broker, client) = stack_with(
        "CREATE TABLE public.outbox_event (
            event_id uuid PRIMARY KEY, aggregate_type text, aggregate_id text,
            event_type text NOT NULL, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
    )
    .await;
    let (url, brokers) = (pg.url(), broker.addr());
    migrate_with(&url, &["--add-polling-columns"]);
    let insert =
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                  VALUES ($1, $2, $3, 'OrderPlaced', '{}')";
    let null_id = uuid::Uuid::new_v4();
    let null_type = uuid::Uuid::new_v4();
    let good = uuid::Uuid::new_v4();
    for (id, aggregate_type, aggregate_id) in [
        (null_id, Some("Order"), None),
        (null_type, None, Some("order-1")),
        (good, Some("Order"), Some("order-2")),
    ] {
        client
            .execute(insert, &[&id, &aggregate_type, &aggregate_id])
            .await
            .unwrap();
    }
    let mut outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_slot_active(&client, "outboxd").await;
    let later = uuid::Uuid::new_v4();
    client
        .execute(insert, &[&later, &Some("Order"), &Some("order-2")])
        .await
        .unwrap();
    let records = consume_all(&brokers, &[TOPIC], 2, Duration::from_secs(60));
    let ids: Vec<String> = records
        .iter()
        .filter_map(|r| r.headers.get("event_id").cloned())
        .collect();
    assert_eq!(
        ids,
        [good.to_string(), later.to_string()],
        "order-2 in order"
    );
    for (id, column) in [(null_id, "aggregate_id"), (null_type, "aggregate_type")] {
        let error: String = wait_for_async("the NULL row to be dead-lettered", Duration::from_secs(60), || async {
            client
                .query_opt(
                    "SELECT last_error FROM outbox_event WHERE event_id = $1 AND dead_at IS NOT NULL",
                    &[&id],
                )
                .await
                .unwrap()
                .map(|row| row.get(0))
        })
        .await;
        assert!(
            error.contains(column),
            "last_error of the NULL {column} row: {error}"
        );
    }
    assert!(outboxd.try_wait().is_none(), "outboxd kept running");
}

#[tokio::test(flavor = "multi_thread")]
async fn retention_never_drops_a_partition_while_a_row_is_being_written_into_it() {
    let (pg, broker, client) = stack_with(PARTITIONED_TABLE).await;
    let (url, brokers) = (pg.url(), broker.addr());
    migrate_with(&url, &["--table", "outbox_p", "--add-polling-columns"]);
    // The application writes a back-dated row into the old, empty partition and has not committed yet.
    let app = pg.client().await;
    let id = uuid::Uuid::new_v4();
    app.batch_execute(&format!(
        "BEGIN; INSERT INTO outbox_p (event_id, aggregate_type, aggregate_id, event_type, payload, created_at)
         VALUES ('{id}', 'Order', 'order-1', 'E', '{{}}', '2020-06-01 00:00:00+00')"
    ))
    .await
    .unwrap();
    let mut args = run_args(&url, &brokers);
    args.extend([
        "--table",
        "outbox_p",
        "--mode",
        "poll",
        "--retention",
        "30d",
        "--retention-interval",
        "1s",
    ]);
    let outboxd = Outboxd::spawn(&args);
    // Retention found the partition empty of committed rows and waits for the application's lock.
    wait_for_async("retention to wait for the partition's lock", Duration::from_secs(60), || async {
        let waiting = count(
            &client,
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query ILIKE '%outbox_p%'",
        )
        .await;
        (waiting > 0).then_some(())
    })
    .await;
    app.batch_execute("COMMIT").await.unwrap();
    let records = consume_all(&brokers, &[TOPIC], 1, Duration::from_secs(60));
    assert_eq!(
        records[0].headers.get("event_id"),
        Some(&id.to_string()),
        "the row committed during the check is published"
    );
    // Once it is published, the partition goes as usual.
    wait_2020_partition_dropped(&client).await;
    drop(outboxd);
}

/// A team's table without the polling columns gets ten single-row INSERTs and one five-row INSERT of one
/// aggregate in one transaction, then `migrate --add-polling-columns`: outboxd (in `mode`) publishes the
/// fifteen rows, which have no position, in insert order.
async fn rows_without_position_go_out_in_insert_order(mode: &str) {
    let (pg, broker, client) = stack_with(
        "CREATE TABLE public.outbox_event (
            event_id uuid PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
            event_type text NOT NULL, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
    )
    .await;
    let ids: Vec<uuid::Uuid> = (0..15).map(|_| uuid::Uuid::new_v4()).collect();
    let row = |i: usize| {
        format!(
            "('{}', 'Order', 'order-1', 'E', '{{\"seq\": {i}}}')",
            ids[i]
        )
    };
    let mut sql = String::from("BEGIN;");
    for i in 0..10 {
        sql.push_str(&format!(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES {};",
            row(i)
        ));
    }
    let multi: Vec<String> = (10..15).map(row).collect();
    sql.push_str(&format!(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES {}; COMMIT",
        multi.join(", ")
    ));
    client.batch_execute(&sql).await.unwrap();
    let (url, brokers) = (pg.url(), broker.addr());
    migrate_with(
        &url,
        &["--add-polling-columns", "--existing-rows", "unpublished"],
    );
    let mut args = run_args(&url, &brokers);
    args.extend(["--mode", mode]);
    let _outboxd = Outboxd::spawn(&args);
    let records = consume_all(&brokers, &[TOPIC], 15, Duration::from_secs(60));
    let published: Vec<String> = records
        .iter()
        .filter_map(|r| r.headers.get("event_id").cloned())
        .collect();
    let inserted: Vec<String> = ids.iter().map(|id| id.to_string()).collect();
    assert_eq!(published, inserted, "{mode}: insert order");
}

#[tokio::test(flavor = "multi_thread")]
async fn rows_without_position_are_handed_off_in_insert_order() {
    rows_without_position_go_out_in_insert_order("auto").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn rows_without_position_are_polled_in_insert_order() {
    rows_without_position_go_out_in_insert_order("poll").await;
}

/// The state of every row of `outbox_event`, for a failure message: event_id, aggregate_id, published,
/// dead, attempts, leased, last_error.
async fn row_states(client: &tokio_postgres::Client) -> String {
    client
        .query(
            "SELECT coalesce(event_id::text, 'NULL'), aggregate_id, published_at IS NOT NULL,
                    dead_at IS NOT NULL, attempts, lease_token IS NOT NULL, coalesce(last_error, '')
             FROM outbox_event ORDER BY position",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| {
            format!(
                "\n  event_id {} of {}: published {}, dead {}, attempts {}, leased {}, last_error {:?}",
                row.get::<_, String>(0),
                row.get::<_, String>(1),
                row.get::<_, bool>(2),
                row.get::<_, bool>(3),
                row.get::<_, i32>(4),
                row.get::<_, bool>(5),
                row.get::<_, String>(6),
            )
        })
        .collect()
}

/// A fitted table whose event_id column is nullable (the key is another column) gets a row with a NULL
/// event_id between two events of its aggregate, next to another aggregate's events. The polling path (with
/// the ordering rule `order`) cannot publish that row, nor address it by its id: the claim dead-letters it
/// in place without leasing it, says so, and every other event goes out, its aggregate's in order.
async fn a_polled_row_without_event_id_is_dead_lettered_and_the_rest_flows(order: &str) {
    let (pg, broker, client) = stack_with(
        "CREATE TABLE public.outbox_event (
            row_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, event_id uuid,
            aggregate_type text NOT NULL, aggregate_id text NOT NULL, event_type text NOT NULL,
            payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
    )
    .await;
    let (url, brokers) = (pg.url(), broker.addr());
    migrate_with(&url, &["--add-polling-columns"]);
    let insert =
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                  VALUES ($1, 'Order', $2, 'OrderPlaced', '{}')";
    let (first, second) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    let (other_first, other_second) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    for (id, aggregate_id) in [
        (Some(first), "order-1"),
        (None, "order-1"),
        (Some(other_first), "order-2"),
        (Some(second), "order-1"),
        (Some(other_second), "order-2"),
    ] {
        client.execute(insert, &[&id, &aggregate_id]).await.unwrap();
    }
    let mut args = run_args(&url, &brokers);
    args.extend(["--mode", "poll", "--poll-order", order]);
    let mut outboxd = Outboxd::spawn(&args);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let done = count(
            &client,
            "SELECT count(*) FROM outbox_event
             WHERE (event_id IS NOT NULL AND published_at IS NULL) OR (event_id IS NULL AND dead_at IS NULL)",
        )
        .await;
        if done == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{order}: every event published and the row without event_id dead-lettered within 60 s; the rows after a minute:{}",
            row_states(&client).await
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (attempts, leased, error): (i32, bool, String) = client
        .query_one(
            "SELECT attempts, lease_token IS NOT NULL, last_error FROM outbox_event WHERE event_id IS NULL",
            &[],
        )
        .await
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .unwrap();
    assert_eq!((attempts, leased), (0, false), "{order}: never leased");
    assert!(error.contains("event_id is NULL"), "{order}: {error}");
    let records = consume_all(&brokers, &[TOPIC], 4, Duration::from_secs(60));
    let published = |aggregate: &str| -> Vec<String> {
        records
            .iter()
            .filter(|r| r.key.as_deref() == Some(aggregate))
            .filter_map(|r| r.headers.get("event_id").cloned())
            .collect()
    };
    assert_eq!(
        published("order-1"),
        [first.to_string(), second.to_string()]
    );
    assert_eq!(
        published("order-2"),
        [other_first.to_string(), other_second.to_string()]
    );
    let log = wait_for(
        "the dead-lettered row in the log",
        Duration::from_secs(10),
        || {
            let log = outboxd.log_text();
            log.contains("no event_id").then_some(log)
        },
    );
    assert!(
        log.contains("order-1"),
        "the log names its aggregate:\n{log}"
    );
    // `replay` cannot re-queue it (nothing names it, and it could never be published): it stays dead.
    let replay = run_outboxd(&["replay", "--database-url", &url, "--all-dead"]);
    assert!(
        replay.status.success() && String::from_utf8_lossy(&replay.stdout).contains("re-queued 0"),
        "{order}: replay --all-dead: {}",
        stderr_of(&replay)
    );
    assert_eq!(
        count(
            &client,
            "SELECT count(*) FROM outbox_event WHERE event_id IS NULL AND dead_at IS NOT NULL"
        )
        .await,
        1,
        "{order}: still dead"
    );
    assert!(outboxd.try_wait().is_none(), "outboxd kept running");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_row_without_event_id_is_dead_lettered_by_the_per_aggregate_claim() {
    a_polled_row_without_event_id_is_dead_lettered_and_the_rest_flows("per-aggregate").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_row_without_event_id_is_dead_lettered_by_the_unordered_claim() {
    a_polled_row_without_event_id_is_dead_lettered_and_the_rest_flows("none").await;
}

/// Review F15: a role-level `statement_timeout` (as DBAs set for application roles) shorter than numbering a
/// large history of rows without a position: outboxd lifts it for that one piece of maintenance, on the
/// polling path and in the slot's hand-off, instead of failing and retrying it forever; and for its
/// other statements over that backlog (claims, hand-off lookups), which it bounds itself.
async fn a_role_statement_timeout_never_stops_the_numbering(mode: &str) {
    let (pg, broker, client) = stack_with(CDC_ONLY_TABLE).await;
    client
        .batch_execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'Order', 'order-' || i % 1000, 'E', '{}'
             FROM generate_series(1, 300000) AS i",
        )
        .await
        .unwrap();
    migrate_with(
        &pg.url(),
        &["--add-polling-columns", "--existing-rows", "unpublished"],
    );
    let url = readme_role(&pg, "Timeout-pass-1", "outbox_event", "").await;
    client
        .batch_execute("ALTER ROLE outboxd_app SET statement_timeout = '200ms'")
        .await
        .unwrap();
    let brokers = broker.addr();
    let mut args = run_args(&url, &brokers);
    args.extend(["--mode", mode]);
    let outboxd = Outboxd::spawn(&args);
    wait_for_async(
        "every row to have a position",
        Duration::from_secs(120),
        || async {
            let unnumbered: i64 = client
                .query_one(
                    "SELECT count(*) FROM outbox_event WHERE position IS NULL AND published_at IS NULL",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            (unnumbered == 0).then_some(())
        },
    )
    .await;
    let log = outboxd.log_text();
    assert!(!log.contains("statement timeout"), "{log}");
    // Nor is any other statement of outboxd's cut short and tried again (a claim or a hand-off lookup over
    // the 300,000 rows) while it publishes the first 20,000: the server logs each cancel.
    wait_for_async(
        "20,000 rows to be published",
        Duration::from_secs(120),
        || async {
            let published: i64 = client
                .query_one(
                    "SELECT count(*) FROM outbox_event WHERE published_at IS NOT NULL",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            (published >= 20_000).then_some(())
        },
    )
    .await;
    let server_log = std::fs::read_to_string(pg.dir.join("server.log")).unwrap_or_default();
    let cancelled: Vec<&str> = server_log
        .lines()
        .filter(|line| line.contains("canceling statement due to statement timeout"))
        .collect();
    assert!(cancelled.is_empty(), "{server_log}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_role_statement_timeout_never_stops_the_polling_paths_numbering() {
    a_role_statement_timeout_never_stops_the_numbering("poll").await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_role_statement_timeout_never_stops_the_hand_offs_numbering() {
    a_role_statement_timeout_never_stops_the_numbering("cdc").await;
}
