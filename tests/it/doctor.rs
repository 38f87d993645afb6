//! `outboxd doctor` against real servers: a healthy set-up passes every check; each broken set-up fails its
//! check with the fix, while the other checks still run; what cannot be reached is UNKNOWN, never a pass.

use std::time::Duration;

use crate::support::*;

/// `outboxd doctor --json` with `run`'s arguments (and `extra`): its exit code and report.
fn doctor(url: &str, brokers: &str, extra: &[&str]) -> (i32, serde_json::Value) {
    let mut args = run_args(url, brokers);
    args[0] = "doctor";
    args.push("--json");
    args.extend(extra);
    let output = run_outboxd(&args);
    let stdout = String::from_utf8_lossy(&output.stdout);
    let report = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {stdout}\n{}", stderr_of(&output)));
    (output.status.code().unwrap_or(-1), report)
}

/// The finding of `check`; fails the test when there is none.
fn finding<'a>(report: &'a serde_json::Value, check: &str) -> &'a serde_json::Value {
    report["findings"]
        .as_array()
        .and_then(|all| all.iter().find(|f| f["check"] == check))
        .unwrap_or_else(|| panic!("no finding {check}: {report:#}"))
}

/// For `wait_for`: doctor's report once `check` comes out as `outcome`.
fn until_outcome(
    url: &str,
    brokers: &str,
    check: &str,
    outcome: &'static str,
) -> impl FnMut() -> Option<serde_json::Value> {
    let (url, brokers, check) = (url.to_string(), brokers.to_string(), check.to_string());
    move || {
        let (_, report) = doctor(&url, &brokers, &[]);
        (finding(&report, &check)["outcome"] == outcome).then_some(report)
    }
}

/// Asserts that `check` came out as `outcome` and that its `field` (`detail` or `fix`) says `needle`.
fn expect(report: &serde_json::Value, check: &str, outcome: &str, field: &str, needle: &str) {
    let found = finding(report, check);
    assert_eq!(found["outcome"], outcome, "{found}");
    assert!(
        found[field]
            .as_str()
            .is_some_and(|text| text.contains(needle)),
        "{check}: no {needle:?} in its {field}: {found}"
    );
}

fn outcomes_other_than_ok(report: &serde_json::Value) -> Vec<String> {
    report["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["outcome"] != "ok" && f["outcome"] != "note")
        .map(|f| f.to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_healthy_set_up_passes_and_each_broken_part_fails_with_its_fix() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let (code, report) = doctor(&url, &brokers, &[]);
    assert!(outcomes_other_than_ok(&report).is_empty(), "{report:#}");
    assert_eq!(
        (code, report["level"].as_str()),
        (0, Some("OK")),
        "{report:#}"
    );
    for check in [
        "postgres.connection",
        "postgres.server",
        "postgres.wal_level",
        "postgres.replication",
        "postgres.publication",
        "postgres.slot",
        "postgres.session",
        "postgres.indexes",
        "kafka.brokers",
    ] {
        assert_eq!(
            finding(&report, check)["outcome"],
            "ok",
            "{check}: {report:#}"
        );
    }

    assert_eq!(finding(&report, "postgres.wal_headroom")["outcome"], "note");
    // A bound on the WAL a slot keeps: then said, with the headroom left once the slot exists.
    let client = pg.client().await;
    client
        .batch_execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1GB'")
        .await
        .unwrap();
    client
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .unwrap();
    create_slot_then_stop(&url, &brokers, &client).await;
    let (code, report) = doctor(&url, &brokers, &[]);
    assert_eq!(code, 0, "{report:#}");
    expect(
        &report,
        "postgres.wal_headroom",
        "ok",
        "detail",
        "= 1GB; slot outboxd has",
    );

    // A topic that refuses every write with acks=all, and a publication gone.
    create_topic(
        &brokers,
        rdkafka::admin::NewTopic::new(
            "outbox.Order",
            1,
            rdkafka::admin::TopicReplication::Fixed(1),
        )
        .set("min.insync.replicas", "2"),
    )
    .await;
    client
        .batch_execute("DROP PUBLICATION outboxd")
        .await
        .unwrap();
    let (code, report) = doctor(&url, &brokers, &[]);
    assert_eq!(
        (code, report["level"].as_str()),
        (2, Some("CRITICAL")),
        "{report:#}"
    );
    let topic = "kafka.topic outbox.Order";
    expect(
        &report,
        topic,
        "failed",
        "detail",
        "min.insync.replicas = 2",
    );
    expect(&report, topic, "failed", "fix", "min.insync.replicas=1");
    expect(
        &report,
        "postgres.publication",
        "failed",
        "fix",
        "outboxd migrate",
    );
    // The other checks ran all the same.
    assert_eq!(finding(&report, "kafka.brokers")["outcome"], "ok");
    assert_eq!(finding(&report, "postgres.session")["outcome"], "ok");

    // The text form says the same, each fix under its finding.
    let mut args = run_args(&url, &brokers);
    args[0] = "doctor";
    let output = run_outboxd(&args);
    let text = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("FAILED") && l.contains("postgres.publication"))
            && text
                .lines()
                .any(|l| l.trim_start().starts_with("fix:") && l.contains("outboxd migrate"))
            && text
                .lines()
                .last()
                .is_some_and(|l| l.starts_with("CRITICAL: 2 failed")),
        "{text}"
    );
}

/// Row level security that hides rows from outboxd's role fails the check and stops `run` (the polling path
/// and the figures would not see them); the role's `BYPASSRLS` fixes it.
#[tokio::test(flavor = "multi_thread")]
async fn row_level_security_hiding_rows_from_outboxd_fails() {
    let (pg, broker) = migrated_stack();
    let url = readme_role(&pg, "Rls-pass-1", "outbox_event", "").await;
    let admin = pg.client().await;
    admin
        .batch_execute(
            "ALTER TABLE outbox_event ENABLE ROW LEVEL SECURITY;
             ALTER TABLE outbox_event FORCE ROW LEVEL SECURITY;
             CREATE POLICY tenant ON outbox_event USING (aggregate_type = current_setting('app.tenant', true))",
        )
        .await
        .unwrap();
    let (code, report) = doctor(&url, &broker.addr(), &["--mode", "poll"]);
    let rls = finding(&report, "postgres.row_level_security");
    assert_eq!(
        (code, rls["outcome"].as_str()),
        (2, Some("failed")),
        "{report:#}"
    );
    assert!(rls["fix"].as_str().unwrap().contains("BYPASSRLS"), "{rls}");
    // `run` refuses to start (the polling path would leave the hidden rows unpublished), with the fix.
    let brokers = broker.addr();
    let mut args = run_args(&url, &brokers);
    args.extend(["--mode", "poll"]);
    let mut outboxd = Outboxd::spawn(&args);
    let exit = wait_for("run to refuse", Duration::from_secs(60), || {
        outboxd.try_wait()
    });
    assert!(!exit.success(), "run stops");
    let log = outboxd.log_text();
    assert!(
        log.contains("row level security") && log.contains("BYPASSRLS"),
        "{log}"
    );
    // Either fix: a policy letting the role see and update every row, or BYPASSRLS.
    admin
        .batch_execute("CREATE POLICY outboxd ON outbox_event TO outboxd_app USING (true)")
        .await
        .unwrap();
    let (_, report) = doctor(&url, &broker.addr(), &["--mode", "poll"]);
    assert_eq!(
        finding(&report, "postgres.row_level_security")["outcome"],
        "ok",
        "{report:#}"
    );
    admin
        .batch_execute("DROP POLICY outboxd ON outbox_event; ALTER ROLE outboxd_app BYPASSRLS")
        .await
        .unwrap();
    let (_, report) = doctor(&url, &broker.addr(), &["--mode", "poll"]);
    assert_eq!(
        finding(&report, "postgres.row_level_security")["outcome"],
        "ok",
        "{report:#}"
    );
}

/// A server without logical replication: `--mode cdc` fails `postgres.wal_level` with the setting that
/// fixes it, `--mode auto` (the table has the polling columns) only warns, since it polls instead. An event
/// larger than its one topic takes, or than the producer's `message.max.bytes`, fails; so does a topic
/// `--no-create-topics` keeps from being created.
#[tokio::test(flavor = "multi_thread")]
async fn replication_off_and_events_kafka_would_refuse_are_named() {
    let pg = Postgres::start_with_wal_level("replica");
    migrate(&pg);
    let broker = Broker::start();
    let (url, brokers) = (pg.url(), broker.addr());
    create_topic(
        &brokers,
        rdkafka::admin::NewTopic::new("orders", 1, rdkafka::admin::TopicReplication::Fixed(1))
            .set("max.message.bytes", "20000"),
    )
    .await;
    let client = pg.client().await;
    client
        .batch_execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             VALUES (gen_random_uuid(), 'Order', 'big', 'E', jsonb_build_object('blob', repeat('x', 50000)))",
        )
        .await
        .unwrap();
    let (code, report) = doctor(
        &url,
        &brokers,
        &[
            "--topic",
            "orders",
            "--kafka-option",
            "message.max.bytes=30000",
        ],
    );
    assert_eq!(code, 2, "{report:#}");
    expect(
        &report,
        "postgres.wal_level",
        "warning",
        "detail",
        "polls the table instead",
    );
    expect(
        &report,
        "kafka.topic orders",
        "failed",
        "detail",
        "max.message.bytes",
    );
    expect(
        &report,
        "kafka.record_size",
        "failed",
        "fix",
        "message.max.bytes=",
    );

    let (code, report) = doctor(
        &url,
        &brokers,
        &["--mode", "cdc", "--topic", "missing", "--no-create-topics"],
    );
    assert_eq!(code, 2, "{report:#}");
    expect(
        &report,
        "postgres.wal_level",
        "failed",
        "fix",
        "wal_level = logical",
    );
    expect(
        &report,
        "kafka.topic missing",
        "failed",
        "fix",
        "--no-create-topics",
    );
}

/// Nothing reachable: every check says it could not be made (UNKNOWN, exit 3), none passes.
#[test]
fn unreachable_servers_are_unknown_not_ok() {
    let (code, report) = doctor(
        "postgres://outboxd@127.0.0.1:1/app",
        "127.0.0.1:1",
        &["--startup-timeout", "1s"],
    );
    assert_eq!(
        (code, report["level"].as_str()),
        (3, Some("UNKNOWN")),
        "{report:#}"
    );
    assert_eq!(
        finding(&report, "postgres.connection")["outcome"],
        "unknown"
    );
    assert_eq!(finding(&report, "kafka.brokers")["outcome"], "unknown");
    assert!(
        !report["findings"]
            .as_array()
            .unwrap()
            .iter()
            .any(|f| f["check"].as_str().unwrap().starts_with("postgres.") && f["outcome"] == "ok"),
        "{report:#}"
    );
}

/// Privileges outboxd's role lacks (SELECT on only some columns, UPDATE, INSERT for writing deleted rows back),
/// no free replication slot for the one to create, and a slot `--mode poll`
/// leaves behind (keeping WAL without end) are each named with the statement that fixes them, and pass once
/// fixed (review findings 8e, 8f, 8h: doctor said nothing of them).
#[tokio::test(flavor = "multi_thread")]
async fn missing_privileges_no_free_slot_and_a_slot_left_behind_are_named() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    client
        .batch_execute(
            "CREATE ROLE doctor_reader LOGIN REPLICATION; GRANT SELECT (event_id, payload) ON outbox_event TO doctor_reader;",
        )
        .await
        .unwrap();
    let reader = pg.url_for("doctor_reader", None);
    let check = "postgres.privileges";
    // SELECT on two columns is not SELECT on what outboxd reads.
    let (_, report) = doctor(&reader, &brokers, &[]);
    expect(
        &report,
        check,
        "failed",
        "fix",
        "GRANT SELECT (aggregate_id, aggregate_type, attempts",
    );
    client
        .batch_execute("GRANT SELECT ON outbox_event TO doctor_reader")
        .await
        .unwrap();
    let (_, report) = doctor(&reader, &brokers, &[]);
    let columns = "published_at, available_at, attempts, lease_token, lease_until, last_error, dead_at, handoff_at, position";
    expect(
        &report,
        check,
        "failed",
        "fix",
        &format!("GRANT UPDATE ({columns}) ON public.outbox_event TO doctor_reader"),
    );
    // Column by column is enough (least privilege).
    client
        .batch_execute(&format!(
            "GRANT UPDATE ({columns}) ON outbox_event TO doctor_reader"
        ))
        .await
        .unwrap();
    // Writing a deleted row back to the polling path needs INSERT: a warning, as only tables whose rows the
    // application deletes need it.
    let (_, report) = doctor(&reader, &brokers, &[]);
    expect(
        &report,
        check,
        "warning",
        "fix",
        "GRANT INSERT ON public.outbox_event TO doctor_reader",
    );
    let (_, report) = doctor(&reader, &brokers, &["--mode", "poll"]);
    expect(&report, check, "ok", "detail", "doctor_reader may read");
    client
        .batch_execute("GRANT INSERT ON outbox_event TO doctor_reader")
        .await
        .unwrap();
    let (_, report) = doctor(&reader, &brokers, &[]);
    expect(&report, check, "ok", "detail", "doctor_reader may read");
    // Granted INSERT after migrate, the role may not draw a position from the sequence. Its own inserts (the
    // write-back) carry the position, so doctor run as it says nothing; run as another role, it names it.
    expect(
        &report,
        "postgres.inserting_roles",
        "ok",
        "detail",
        "may draw its position",
    );
    let (_, report) = doctor(&url, &brokers, &[]);
    expect(
        &report,
        "postgres.inserting_roles",
        "warning",
        "detail",
        "doctor_reader",
    );
    client
        .batch_execute("REVOKE INSERT ON outbox_event FROM doctor_reader")
        .await
        .unwrap();

    // Every slot taken: the one outboxd would create cannot be.
    let free: i64 = client
        .query_one(
            "SELECT current_setting('max_replication_slots')::int8 - count(*) FROM pg_replication_slots",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    for i in 0..free {
        client
            .execute(
                "SELECT pg_create_physical_replication_slot($1)",
                &[&format!("filler_{i}")],
            )
            .await
            .unwrap();
    }
    let (code, report) = doctor(&url, &brokers, &[]);
    assert_eq!(code, 2, "{report:#}");
    expect(
        &report,
        "postgres.slot",
        "failed",
        "fix",
        "max_replication_slots",
    );
    client
        .batch_execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name LIKE 'filler_%'",
        )
        .await
        .unwrap();
    let (_, report) = doctor(&url, &brokers, &[]);
    expect(
        &report,
        "postgres.slot",
        "ok",
        "detail",
        "outboxd creates it",
    );

    // A slot --mode poll never reads.
    client
        .execute(
            "SELECT pg_create_logical_replication_slot('outboxd', 'pgoutput')",
            &[],
        )
        .await
        .unwrap();
    let (code, report) = doctor(&url, &brokers, &["--mode", "poll"]);
    assert_eq!(code, 1, "{report:#}");
    expect(
        &report,
        "postgres.slot",
        "warning",
        "fix",
        "SELECT pg_drop_replication_slot('outboxd')",
    );
    client
        .execute("SELECT pg_drop_replication_slot('outboxd')", &[])
        .await
        .unwrap();
    let (code, report) = doctor(&url, &brokers, &["--mode", "poll"]);
    assert_eq!(code, 0, "{report:#}");
    expect(
        &report,
        "postgres.slot",
        "ok",
        "detail",
        "--mode poll needs none",
    );
}

/// The other checks with something to fail, each failing with its fix: a role without the replication
/// permission, the claim index gone, a topic that keeps records for less time than the oldest event has
/// waited, and a table without the polling columns (a warning under `auto`, which then streams CDC only).
#[tokio::test(flavor = "multi_thread")]
async fn replication_permission_claim_index_topic_retention_and_polling_columns_are_named() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    client
        .batch_execute(
            "CREATE ROLE doctor_plain LOGIN;
             GRANT SELECT, UPDATE ON outbox_event TO doctor_plain;
             DROP INDEX outbox_event_claim_idx;
             INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, created_at)
             VALUES (gen_random_uuid(), 'Order', 'o-1', 'E', '{}', now() - interval '1 hour');",
        )
        .await
        .unwrap();
    create_topic(
        &brokers,
        rdkafka::admin::NewTopic::new(
            "outbox.Order",
            1,
            rdkafka::admin::TopicReplication::Fixed(1),
        )
        .set("retention.ms", "60000"),
    )
    .await;
    let (code, report) = doctor(
        &pg.url_for("doctor_plain", None),
        &brokers,
        &["--mode", "cdc"],
    );
    assert_eq!(code, 2, "{report:#}");
    expect(
        &report,
        "postgres.replication",
        "failed",
        "fix",
        "REPLICATION",
    );
    expect(
        &report,
        "postgres.indexes",
        "failed",
        "fix",
        "outboxd migrate --add-polling-columns",
    );

    // The permission granted and the index rebuilt: the backlog is counted again, its oldest event older
    // than the topic keeps records.
    client
        .batch_execute("ALTER ROLE doctor_plain REPLICATION")
        .await
        .unwrap();
    migrate_with(&url, &["--add-polling-columns"]);
    let plain = pg.url_for("doctor_plain", None);
    let (_, report) = doctor(&plain, &brokers, &["--mode", "cdc"]);
    for check in ["postgres.replication", "postgres.indexes"] {
        assert_eq!(
            finding(&report, check)["outcome"],
            "ok",
            "{check}: {report:#}"
        );
    }
    let topic = "kafka.topic outbox.Order";
    expect(
        &report,
        topic,
        "warning",
        "fix",
        "raise retention.ms of outbox.Order",
    );
    client
        .batch_execute("UPDATE outbox_event SET published_at = now()")
        .await
        .unwrap();
    let (_, report) = doctor(&plain, &brokers, &["--mode", "cdc"]);
    // One replica is a note for production, no warning.
    assert_eq!(finding(&report, topic)["outcome"], "note", "{report:#}");

    // A table without the polling columns: auto streams it CDC only, and says what that lacks.
    client
        .batch_execute(
            "CREATE TABLE public.cdc_only (
                 event_id uuid PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
                 event_type text NOT NULL, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
        )
        .await
        .unwrap();
    migrate_with(&url, &["--table", "public.cdc_only"]);
    let (code, report) = doctor(&url, &brokers, &["--table", "public.cdc_only"]);
    assert_eq!(code, 1, "{report:#}");
    expect(
        &report,
        "postgres.table public.cdc_only",
        "warning",
        "fix",
        "--add-polling-columns",
    );
}

/// A topic whose partitions lost an in-sync replica (a broker down) is a warning naming the command that
/// lists them, and ok again once the broker is back (review finding 8d: doctor judged only the settings).
#[tokio::test(flavor = "multi_thread")]
async fn an_under_replicated_topic_is_a_warning_until_its_broker_is_back() {
    let pg = Postgres::start();
    migrate(&pg);
    let cluster = tokio::task::spawn_blocking(Cluster::launch).await.unwrap();
    let (url, brokers) = (pg.url(), cluster.addrs());
    let topic = "outbox.Order";
    create_topic(
        &brokers,
        rdkafka::admin::NewTopic::new(topic, 3, rdkafka::admin::TopicReplication::Fixed(3))
            .set("min.insync.replicas", "2"),
    )
    .await;
    let check = format!("kafka.topic {topic}");
    let outcome_is = |outcome| until_outcome(&url, &brokers, &check, outcome);
    wait_for(
        "the topic to be ok",
        Duration::from_secs(60),
        outcome_is("ok"),
    );
    cluster.stop(3);
    let report = wait_for(
        "doctor to see the topic under-replicated",
        Duration::from_secs(120),
        outcome_is("warning"),
    );
    expect(
        &report,
        &check,
        "warning",
        "detail",
        "fewer in-sync replicas",
    );
    expect(
        &report,
        &check,
        "warning",
        "fix",
        "--under-replicated-partitions",
    );
    cluster.start(3);
    wait_for(
        "the topic to be ok again",
        Duration::from_secs(120),
        outcome_is("ok"),
    );
}

/// A slot another client streams from (not an outboxd leading it) fails with the client named and the fix;
/// the slot streamed to by a running outboxd is fine (review finding 8c).
#[tokio::test(flavor = "multi_thread")]
async fn a_slot_held_by_another_client_is_named_and_outboxds_own_is_not() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    client
        .execute(
            "SELECT pg_create_logical_replication_slot('outboxd', 'pgoutput')",
            &[],
        )
        .await
        .unwrap();
    let slot_outcome = |outcome| until_outcome(&url, &brokers, "postgres.slot", outcome);
    let other = OtherSlotClient::start(&pg, "outboxd");
    let report = wait_for(
        "doctor to name the other client",
        Duration::from_secs(60),
        slot_outcome("failed"),
    );
    expect(
        &report,
        "postgres.slot",
        "failed",
        "detail",
        "pg_recvlogical",
    );
    expect(
        &report,
        "postgres.slot",
        "failed",
        "fix",
        "pg_terminate_backend(",
    );
    drop(other);
    wait_for(
        "the slot to be free",
        Duration::from_secs(60),
        slot_outcome("ok"),
    );
    let mut args = run_args(&url, &brokers);
    args.extend(["--metrics-addr", "off"]);
    let outboxd = Outboxd::spawn(&args);
    outboxd.wait_streaming();
    let (_, report) = doctor(&url, &brokers, &[]);
    expect(&report, "postgres.slot", "ok", "detail", "pgoutput, in use");
}

/// A role granted INSERT on the outbox table after `migrate` cannot draw `position` from its sequence, so
/// every insert of theirs fails: doctor names the role and the fix, and passes once migrate granted it.
#[tokio::test(flavor = "multi_thread")]
async fn a_role_that_may_insert_but_not_number_its_rows_is_named() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    client
        .batch_execute("CREATE ROLE late LOGIN; GRANT INSERT ON public.outbox_event TO late")
        .await
        .unwrap();
    let (code, report) = doctor(&url, &brokers, &[]);
    expect(
        &report,
        "postgres.inserting_roles",
        "warning",
        "detail",
        "late",
    );
    expect(
        &report,
        "postgres.inserting_roles",
        "warning",
        "fix",
        "GRANT USAGE ON SEQUENCE public.outbox_event_position_seq TO late",
    );
    assert_eq!(code, 1, "{report:#}");
    migrate_with(&url, &[]);
    let (_, report) = doctor(&url, &brokers, &[]);
    expect(
        &report,
        "postgres.inserting_roles",
        "ok",
        "detail",
        "may draw its position",
    );
}

/// A publication that filters the outbox table's rows (`WHERE`) or columns (a column list, PostgreSQL 15+):
/// an insert outside the filter was never streamed, the slot confirmed past it, and its row stayed
/// unpublished for good (an outside review's finding; both passed doctor and `run`'s start-up before).
#[tokio::test(flavor = "multi_thread")]
async fn a_publication_that_filters_rows_or_columns_fails() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    for (publication, left_out) in [
        (
            "ALTER PUBLICATION outboxd SET TABLE public.outbox_event WHERE (aggregate_type <> 'Audit')",
            "WHERE (aggregate_type <> 'Audit'::text)",
        ),
        (
            "ALTER PUBLICATION outboxd SET TABLE public.outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)",
            "leaves the columns",
        ),
    ] {
        client.batch_execute(publication).await.unwrap();
        let (code, report) = doctor(&url, &brokers, &[]);
        assert_eq!(code, 2, "{report:#}");
        expect(&report, "postgres.publication", "failed", "detail", left_out);
        expect(
            &report,
            "postgres.publication",
            "failed",
            "fix",
            "ALTER PUBLICATION outboxd DROP TABLE public.outbox_event",
        );
        let refused = run_outboxd(&run_args(&url, &brokers));
        assert!(!refused.status.success());
        assert!(stderr_of(&refused).contains(left_out), "{}", stderr_of(&refused));
    }
    client
        .batch_execute("ALTER PUBLICATION outboxd SET TABLE public.outbox_event")
        .await
        .unwrap();
    let (_, report) = doctor(&url, &brokers, &[]);
    expect(&report, "postgres.publication", "ok", "detail", "outboxd");
}
