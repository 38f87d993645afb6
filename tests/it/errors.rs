//! Every configuration and permission error exits non-zero at once with one message naming the problem and
//! the fix; passwords never appear. Also: migrations and `status`.

use std::time::Duration;

use crate::support::*;

/// Runs `outboxd run` against `url` expecting failure; returns stderr.
fn run_expecting_failure(url: &str, brokers: &str, extra: &[&str]) -> String {
    let mut args = vec![
        "run",
        "--database-url",
        url,
        "--brokers",
        brokers,
        "--startup-timeout",
        "2s",
    ];
    args.extend_from_slice(extra);
    let output = run_outboxd(&args);
    let stderr = stderr_of(&output);
    assert!(
        !output.status.success(),
        "outboxd {extra:?} should have failed:\n{stderr}"
    );
    stderr
}

fn assert_mentions(stderr: &str, needles: &[&str]) {
    for needle in needles {
        assert!(stderr.contains(needle), "expected {needle:?} in:\n{stderr}");
    }
}

fn migrated() -> Postgres {
    let pg = Postgres::start();
    let output = run_outboxd(&["migrate", "--database-url", &pg.url()]);
    assert!(output.status.success(), "{}", stderr_of(&output));
    pg
}

const NO_BROKER: &str = "127.0.0.1:1";

#[test]
fn malformed_url_names_the_flag_and_hides_the_password() {
    let stderr = run_expecting_failure(
        "postgres://u:hunter2secret@host:notaport/db",
        NO_BROKER,
        &[],
    );
    assert_mentions(&stderr, &["--database-url"]);
    assert!(!stderr.contains("hunter2secret"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn wrong_password_is_a_clear_error() {
    let pg = migrated();
    pg.client()
        .await
        .batch_execute("CREATE ROLE app LOGIN REPLICATION PASSWORD 'right-password'")
        .await
        .unwrap();
    pg.prepend_hba("host all app 127.0.0.1/32 scram-sha-256")
        .await;
    let stderr = run_expecting_failure(&pg.url_for("app", Some("hunter2wrong")), NO_BROKER, &[]);
    assert_mentions(&stderr, &["password", "fix"]);
    assert!(!stderr.contains("hunter2wrong"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn replication_connection_authenticates_with_scram_md5_and_cleartext() {
    let pg = migrated();
    let broker = Broker::start();
    let client = pg.client().await;
    client
        .batch_execute(
            "SET password_encryption = 'scram-sha-256';
             CREATE ROLE scram_user LOGIN REPLICATION PASSWORD 'pw-scram';
             SET password_encryption = 'md5';
             CREATE ROLE md5_user LOGIN REPLICATION PASSWORD 'pw-md5';
             CREATE ROLE plain_user LOGIN REPLICATION PASSWORD 'pw-plain';
             GRANT SELECT, UPDATE ON outbox_event TO scram_user, md5_user, plain_user;",
        )
        .await
        .unwrap();
    pg.prepend_hba("host all scram_user 127.0.0.1/32 scram-sha-256\nhost all md5_user 127.0.0.1/32 md5\nhost all plain_user 127.0.0.1/32 password").await;
    for (user, password, slot) in [
        ("scram_user", "pw-scram", "s_scram"),
        ("md5_user", "pw-md5", "s_md5"),
        ("plain_user", "pw-plain", "s_plain"),
    ] {
        let url = pg.url_for(user, Some(password));
        let brokers = broker.addr();
        let outboxd = Outboxd::spawn(&[
            "run",
            "--database-url",
            &url,
            "--brokers",
            &brokers,
            "--slot",
            slot,
        ]);
        wait_slot_active(&client, slot).await;
        assert!(
            !outboxd.log_text().contains(password),
            "password leaked into the log"
        );
    }
}

#[test]
fn unreachable_database_gives_up_after_startup_timeout() {
    let url = format!("postgres://postgres@127.0.0.1:{}/postgres", free_port());
    let stderr = run_expecting_failure(&url, NO_BROKER, &[]);
    assert_mentions(&stderr, &["startup-timeout", "reachable"]);
}

#[test]
fn unknown_database() {
    let pg = Postgres::start();
    let url = format!("postgres://postgres@127.0.0.1:{}/no_such_db", pg.port);
    let stderr = run_expecting_failure(&url, NO_BROKER, &[]);
    assert_mentions(&stderr, &["no_such_db", "does not exist"]);
}

#[test]
fn wal_level_replica_is_named() {
    let pg = Postgres::start_with_wal_level("replica");
    // migrate works without logical decoding.
    let output = run_outboxd(&["migrate", "--database-url", &pg.url()]);
    assert!(output.status.success(), "{}", stderr_of(&output));
    // `auto` would poll instead; `cdc` must refuse clearly.
    let stderr = run_expecting_failure(&pg.url(), NO_BROKER, &["--mode", "cdc"]);
    assert_mentions(&stderr, &["wal_level", "logical"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_replication_permission_names_the_grant() {
    let pg = migrated();
    pg.client()
        .await
        .batch_execute("CREATE ROLE norepl LOGIN; GRANT SELECT, UPDATE ON outbox_event TO norepl")
        .await
        .unwrap();
    let stderr = run_expecting_failure(&pg.url_for("norepl", None), NO_BROKER, &["--mode", "cdc"]);
    assert_mentions(&stderr, &["replication", "REPLICATION"]);
}

#[test]
fn missing_table() {
    let pg = migrated();
    let stderr = run_expecting_failure(&pg.url(), NO_BROKER, &["--table", "public.no_such_table"]);
    assert_mentions(
        &stderr,
        &["public.no_such_table", "does not exist", "outboxd migrate"],
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn missing_or_mistyped_column() {
    let pg = Postgres::start();
    pg.client()
        .await
        .batch_execute(
            "CREATE TABLE no_agg (event_id uuid PRIMARY KEY, aggregate_type text, event_type text, payload jsonb,
                                  created_at timestamptz DEFAULT now(), published_at timestamptz);
             CREATE TABLE int_payload (event_id uuid PRIMARY KEY, aggregate_type text, aggregate_id text, event_type text,
                                  payload integer, created_at timestamptz DEFAULT now(), published_at timestamptz);",
        )
        .await
        .unwrap();
    let stderr = run_expecting_failure(&pg.url(), NO_BROKER, &["--table", "no_agg"]);
    assert_mentions(&stderr, &["no column aggregate_id"]);
    let stderr = run_expecting_failure(&pg.url(), NO_BROKER, &["--table", "int_payload"]);
    assert_mentions(
        &stderr,
        &["payload", "type integer", "jsonb or json or text or bytea"],
    );
    let stderr = run_expecting_failure(
        &pg.url(),
        NO_BROKER,
        &["--table", "no_agg", "--column", "aggregate_id=agg"],
    );
    assert_mentions(&stderr, &["no column agg", "--column aggregate_id="]);
}

#[tokio::test(flavor = "multi_thread")]
async fn retention_on_a_table_without_published_at() {
    let pg = Postgres::start();
    pg.client()
        .await
        .batch_execute(
            "CREATE TABLE cdc_only (event_id uuid PRIMARY KEY, aggregate_type text, aggregate_id text,
                                    event_type text, payload jsonb);
             CREATE PUBLICATION outboxd FOR TABLE cdc_only WITH (publish = 'insert');",
        )
        .await
        .unwrap();
    let stderr = run_expecting_failure(
        &pg.url(),
        NO_BROKER,
        &["--table", "cdc_only", "--retention", "7d"],
    );
    assert_mentions(
        &stderr,
        &[
            "--retention needs the published_at column",
            "public.cdc_only",
            "--add-polling-columns",
        ],
    );
}

#[test]
fn missing_publication() {
    let pg = migrated();
    let stderr = run_expecting_failure(&pg.url(), NO_BROKER, &["--publication", "nopub"]);
    assert_mentions(
        &stderr,
        &["publication nopub does not exist", "CREATE PUBLICATION"],
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn slot_with_another_plugin() {
    let pg = migrated();
    pg.client()
        .await
        .batch_execute("SELECT pg_create_logical_replication_slot('outboxd', 'test_decoding')")
        .await
        .unwrap();
    let stderr = run_expecting_failure(&pg.url(), NO_BROKER, &[]);
    assert_mentions(
        &stderr,
        &["test_decoding", "pgoutput", "pg_drop_replication_slot"],
    );
}

#[test]
fn invalid_names_and_injection_attempts() {
    let url = "postgres://postgres@127.0.0.1:1/postgres";
    for (flag, value) in [
        ("--slot", "outboxd\"; DROP TABLE outbox_event; --"),
        ("--slot", "UpperCase"),
        ("--publication", "pub'; DROP TABLE x; --"),
        ("--table", "public.outbox_event; DROP TABLE x"),
        ("--topic", "outbox.{nope}"),
        ("--topic", "bad topic"),
        ("--startup-timeout", "soon"),
        ("--kafka-option", "no-equals-sign"),
    ] {
        let stderr = run_expecting_failure(url, NO_BROKER, &[flag, value]);
        assert_mentions(&stderr, &[flag]);
    }
    let stderr = run_expecting_failure(url, NO_BROKER, &["--topic", "outbox.{nope}"]);
    assert_mentions(&stderr, &["{nope}", "{aggregate_type}"]);
}

#[test]
fn unknown_librdkafka_property() {
    let pg = migrated();
    let stderr = run_expecting_failure(
        &pg.url(),
        NO_BROKER,
        &["--kafka-option", "no.such.property=1"],
    );
    assert_mentions(&stderr, &["no.such.property", "--kafka-option"]);
}

/// A mistyped secret property, a secret given as an invalid value, a secret with a comma in it given through
/// the environment: the error names the property, never the secret or a fragment of it.
#[test]
fn kafka_option_errors_never_show_the_value() {
    let pg = migrated();
    for option in [
        "sasl.pasword=Hunter2-secret",
        "acks=Hunter2-secret",
        "Hunter2-secret,sasl.username=me",
    ] {
        let stderr = run_expecting_failure(&pg.url(), NO_BROKER, &["--kafka-option", option]);
        assert_mentions(&stderr, &["--kafka-option"]);
        assert!(!stderr.contains("Hunter2"), "{option}: {stderr}");
    }
    // A comma inside a secret's value keeps it whole, also before `name=` where librdkafka knows no such
    // property (it would name that piece of the password as unknown).
    let url = pg.url();
    let mut args = run_args(&url, NO_BROKER);
    // Valid options: outboxd fails on the missing broker, after this timeout.
    args.extend(["--startup-timeout", "2s"]);
    let output = outboxd_command(&args)
        .env("OUTBOXD_KAFKA_OPTION", "sasl.password=Hunter2,secret,z9=Q")
        .output()
        .unwrap();
    let stderr = stderr_of(&output);
    assert!(!output.status.success());
    assert!(
        !stderr.contains("Hunter2") && !stderr.contains("secret") && !stderr.contains("z9"),
        "a comma inside a value keeps it whole: {stderr}"
    );
    // A mistyped property of its own is named, the password given before it is not shown.
    let mut args = run_args(&url, NO_BROKER);
    args.extend([
        "--startup-timeout",
        "2s",
        "--kafka-option",
        "sasl.password=Hunter2,secret",
        "--kafka-option",
        "sasl.pasword=x",
    ]);
    let output = outboxd_command(&args).output().unwrap();
    let stderr = stderr_of(&output);
    assert!(!output.status.success());
    assert_mentions(&stderr, &["sasl.pasword"]);
    assert!(
        !stderr.contains("Hunter2") && !stderr.contains("secret"),
        "{stderr}"
    );
}

#[test]
fn unreachable_brokers_give_up_after_startup_timeout() {
    let pg = migrated();
    let brokers = format!("127.0.0.1:{}", free_port());
    let stderr = run_expecting_failure(&pg.url(), &brokers, &[]);
    assert_mentions(&stderr, &["--brokers", "startup-timeout"]);
}

#[test]
fn toml_unknown_key_or_wrong_type() {
    let dir = std::env::temp_dir().join(format!("outboxd-toml-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("outboxd.toml");
    for (content, needle) in [
        ("brokers = \"b:9092\"\nslott = \"x\"\n", "slott"),
        ("topic-partitions = \"six\"\n", "topic-partitions"),
    ] {
        std::fs::write(&path, content).unwrap();
        let output = run_outboxd(&["run", "--config", path.to_str().unwrap()]);
        let stderr = stderr_of(&output);
        assert!(!output.status.success());
        assert_mentions(&stderr, &["--config", needle]);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn no_create_topics_names_the_missing_topic() {
    let pg = migrated();
    let broker = Broker::start();
    let url = pg.url();
    let brokers = broker.addr();
    let args = [
        "run",
        "--database-url",
        &url,
        "--brokers",
        &brokers,
        "--no-create-topics",
    ];
    let mut outboxd = Outboxd::spawn(&args);
    let client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    client
        .execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES (gen_random_uuid(), 'Invoice', 'i-1', 'Issued', '{}')",
            &[],
        )
        .await
        .unwrap();
    let status = wait_for("outboxd to exit", Duration::from_secs(60), || {
        outboxd.try_wait()
    });
    assert!(!status.success());
    assert_mentions(
        &outboxd.log_text(),
        &["outbox.Invoice", "--no-create-topics"],
    );
    let unpublished: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox_event WHERE published_at IS NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        unpublished, 1,
        "the event must stay unpublished, not be skipped"
    );

    // The operator creates the topic and starts outboxd again: the event goes out, once.
    create_topic(
        &brokers,
        rdkafka::admin::NewTopic::new(
            "outbox.Invoice",
            1,
            rdkafka::admin::TopicReplication::Fixed(1),
        ),
    )
    .await;
    let _again = Outboxd::spawn(&args);
    wait_all_published(&client, Duration::from_secs(60)).await;
    let records = consume_all(&brokers, &["outbox.Invoice"], 1, Duration::from_secs(30));
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0].key.as_deref(), Some("i-1"));
}

#[tokio::test(flavor = "multi_thread")]
async fn migrate_is_idempotent_and_safe_concurrently() {
    let pg = Postgres::start();
    let url = pg.url();
    let children: Vec<_> = (0..3)
        .map(|_| {
            outboxd_command(&["migrate", "--database-url", &url])
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for child in children {
        let output = child.wait_with_output().unwrap();
        assert!(
            output.status.success(),
            "concurrent migrate failed: {}",
            stderr_of(&output)
        );
    }
    let again = run_outboxd(&["migrate", "--database-url", &url]);
    assert!(again.status.success(), "{}", stderr_of(&again));
    let client = pg.client().await;
    let versions: i64 = client
        .query_one("SELECT count(*) FROM outboxd_migrations", &[])
        .await
        .unwrap()
        .get(0);
    let files = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .unwrap()
        .filter(|entry| {
            entry
                .as_ref()
                .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "sql"))
        })
        .count();
    assert_eq!(versions as usize, files, "one row per migration file");
    let publishes: String = client
        .query_one(
            "SELECT concat_ws(',', pubinsert, pubupdate, pubdelete) FROM pg_publication p JOIN pg_publication_tables t USING (pubname)
             WHERE pubname = 'outboxd' AND tablename = 'outbox_event'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(publishes, "t,f,f", "publish = insert only");
    for table in ["outbox_event", "consumed_event"] {
        let exists: bool = client
            .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table])
            .await
            .unwrap()
            .get(0);
        assert!(exists, "{table} missing");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn status_reports_slot_and_backlog_as_json() {
    let pg = migrated();
    let client = pg.client().await;
    client
        .batch_execute("SELECT pg_create_logical_replication_slot('outboxd', 'pgoutput')")
        .await
        .unwrap();
    client
        .execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES (gen_random_uuid(), 'A', '1', 'E', '{}')",
            &[],
        )
        .await
        .unwrap();
    let output = run_outboxd(&[
        "status",
        "--json",
        "--database-url",
        &pg.url_for("postgres", Some("pw-not-shown")),
    ]);
    // A slot nobody streams from: WARNING, exit code 1 (as monitoring plugins expect).
    assert_eq!(output.status.code(), Some(1), "{}", stderr_of(&output));
    let stdout = String::from_utf8(output.stdout).unwrap();
    let status: serde_json::Value =
        serde_json::from_str(&stdout).expect("stdout must be only JSON");
    assert_eq!(status["verdict"]["level"], "WARNING");
    assert!(status["verdict"]["reason"]
        .as_str()
        .unwrap()
        .contains("not in use"));
    assert_eq!(status["slot_name"], "outboxd");
    assert_eq!(status["slot_exists"], true);
    assert_eq!(status["active"], false);
    assert_eq!(status["unpublished_events"], 1);
    assert!(status["lag_bytes"].as_i64().unwrap() > 0);
    assert!(status["retained_wal_bytes"].as_i64().is_some());
    assert!(status["confirmed_flush_lsn"]
        .as_str()
        .unwrap()
        .contains('/'));
    assert!(!stdout.contains("pw-not-shown"));
    let table = run_outboxd(&["status", "--database-url", &pg.url()]);
    assert!(String::from_utf8_lossy(&table.stdout).contains("unpublished events"));
    assert!(String::from_utf8_lossy(&table.stdout).contains("WARNING: "));
    // Lag above --crit-lag: CRITICAL, exit 2.
    let critical = run_outboxd(&["status", "--database-url", &pg.url(), "--crit-lag", "1"]);
    assert_eq!(
        critical.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&critical.stdout)
    );
    assert!(String::from_utf8_lossy(&critical.stdout).contains("CRITICAL: slot lag"));
    // Cannot reach the database: UNKNOWN, exit 3.
    let unreachable = format!("postgres://postgres@127.0.0.1:{}/postgres", free_port());
    let unknown = run_outboxd(&["status", "--database-url", &unreachable]);
    assert_eq!(unknown.status.code(), Some(3));
    assert!(String::from_utf8_lossy(&unknown.stdout).contains("UNKNOWN: cannot tell"));
}

#[tokio::test(flavor = "multi_thread")]
async fn flags_override_the_environment_and_the_environment_overrides_the_file() {
    let pg = migrated();
    let dir = scratch_dir("config");
    let file = dir.join("outboxd.toml");
    std::fs::write(&file, "slot = \"from_file\"\n").unwrap();
    let file = file.to_str().unwrap();
    let status = |extra: &[&str], env_slot: Option<&str>| {
        let mut args = vec!["status", "--json"];
        args.extend_from_slice(extra);
        let mut command = outboxd_command(&args);
        command.env("OUTBOXD_DATABASE_URL", pg.url());
        if let Some(slot) = env_slot {
            command.env("OUTBOXD_SLOT", slot);
        }
        let output = command.output().unwrap();
        let json: serde_json::Value = serde_json::from_slice(&output.stdout)
            .unwrap_or_else(|_| panic!("{}", stderr_of(&output)));
        json["slot_name"].as_str().unwrap().to_string()
    };
    assert_eq!(status(&["--config", file], None), "from_file");
    assert_eq!(status(&["--config", file], Some("from_env")), "from_env");
    assert_eq!(status(&[], Some("from_env")), "from_env");
    assert_eq!(
        status(&["--config", file, "--slot", "from_flag"], Some("from_env")),
        "from_flag"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn slot_held_by_another_client_is_a_clear_error_after_startup_timeout() {
    let pg = migrated();
    let broker = Broker::start();
    pg.client()
        .await
        .batch_execute("SELECT pg_create_logical_replication_slot('outboxd', 'pgoutput')")
        .await
        .unwrap();
    // Another client streams from the slot.
    let other = OtherSlotClient::start(&pg, "outboxd");
    let client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    let stderr = run_expecting_failure(&pg.url(), &broker.addr(), &[]);
    drop(other);
    assert_mentions(&stderr, &["in use by another client", "--slot"]);
}
