//! Parsing, merging and validation of the options, without I/O beyond temporary `--config` files.

use std::time::Duration;

use clap::Parser;

use super::parse::split_kafka_options;
use super::*;
use crate::table::TableName;

fn options(args: &[&str]) -> Options {
    let mut argv = vec!["outboxd", "run"];
    argv.extend_from_slice(args);
    match Cli::try_parse_from(argv).unwrap().command {
        Command::Run(options) => options,
        _ => unreachable!(),
    }
}

#[test]
fn defaults_fill_everything_but_urls() {
    let run = options(&[
        "--database-url",
        "postgres://u:p@localhost/db",
        "--brokers",
        "b:9092",
    ])
    .run()
    .unwrap();
    assert_eq!(
        run.database.tables[0].name,
        TableName {
            schema: "public".into(),
            name: "outbox_event".into()
        }
    );
    assert_eq!(run.database.slot, "outboxd");
    assert_eq!(run.database.publication, "outboxd");
    assert_eq!(run.kafka.topic_partitions, 6);
    assert_eq!(run.kafka.topic_replication_factor, None);
    assert!(run.kafka.create_topics);
    assert_eq!(run.startup_timeout, Duration::from_secs(60));
    assert_eq!(run.reconnect_timeout, Duration::from_secs(600));
    assert_eq!(run.shutdown_timeout, Duration::from_secs(30));
    assert_eq!(
        run.topic.render(&run.database.tables[0].name, "Order", "x"),
        "outbox.Order"
    );
}

#[test]
fn a_dead_letter_topic_is_one_fixed_name() {
    let with = |topic: &str| {
        options(&[
            "--database-url",
            "postgres://u:p@localhost/db",
            "--brokers",
            "b:9092",
            "--dead-letter-topic",
            topic,
        ])
        .run()
    };
    let run = with("outbox.dead-letters").unwrap();
    assert_eq!(
        run.poll.dead_letter_topic.as_deref(),
        Some("outbox.dead-letters")
    );
    for template in ["dlq.{aggregate_type}", "{table}.dead"] {
        let err = with(template).unwrap_err().to_string();
        assert!(
            err.contains("--dead-letter-topic") && err.contains("fixed name"),
            "{template}: {err}"
        );
    }
}

#[test]
fn missing_required_options_are_named() {
    let err = options(&["--brokers", "b:9092"])
        .run()
        .unwrap_err()
        .to_string();
    assert!(err.contains("--database-url"), "{err}");
    let err = options(&["--database-url", "postgres://localhost/db"])
        .run()
        .unwrap_err()
        .to_string();
    assert!(err.contains("--brokers"), "{err}");
}

#[test]
fn rejects_invalid_names_and_injection() {
    for (flag, value) in [
        ("--slot", "Bad-Slot"),
        ("--slot", "x\"; DROP TABLE t; --"),
        ("--publication", "pub'; drop"),
        ("--table", "public.outbox event"),
        ("--table", "a.b.c"),
    ] {
        let err = options(&[
            "--database-url",
            "postgres://localhost/db",
            "--brokers",
            "b",
            flag,
            value,
        ])
        .run()
        .unwrap_err()
        .to_string();
        assert!(err.contains(flag), "{flag} {value}: {err}");
    }
}

#[test]
fn parses_durations_and_names_the_setting() {
    assert_eq!(
        parse_duration("--x", "500ms").unwrap(),
        Duration::from_millis(500)
    );
    assert_eq!(
        parse_duration("--x", "7d").unwrap(),
        Duration::from_secs(7 * 86400)
    );
    let err = parse_duration("--startup-timeout", "soon")
        .unwrap_err()
        .to_string();
    assert!(err.contains("--startup-timeout"), "{err}");
}

#[test]
fn bad_url_error_hides_the_password() {
    let err = parse_postgres_url("--database-url", "postgres://u:secret@host:notaport/db")
        .unwrap_err()
        .to_string();
    assert!(err.contains("--database-url"), "{err}");
    assert!(!err.contains("secret"), "{err}");
    assert_eq!(
        redact_url("postgres://u:secret@h:5432/db"),
        "postgres://u:***@h:5432/db"
    );
}

#[test]
fn kafka_options_must_be_key_value() {
    let run = options(&[
        "--database-url",
        "postgres://h/db",
        "--brokers",
        "b",
        "--kafka-option",
        "linger.ms=5",
    ])
    .run()
    .unwrap();
    assert_eq!(
        run.kafka.options,
        vec![("linger.ms".to_string(), "5".to_string())]
    );
    let err = options(&[
        "--database-url",
        "postgres://h/db",
        "--brokers",
        "b",
        "--kafka-option",
        "nonsense",
    ])
    .run()
    .unwrap_err()
    .to_string();
    assert!(err.contains("--kafka-option"), "{err}");
    assert!(!err.contains("nonsense"), "the text is never echoed: {err}");
}

#[test]
fn kafka_option_values_keep_their_commas() {
    let given = [
        "sasl.password=p,ss w=rd,,x".to_string(),
        "acks=all,linger.ms=5".to_string(),
        "sasl.jaas.config=x required user=\"u\",pw".to_string(),
    ];
    assert_eq!(
        split_kafka_options(given.iter()).unwrap(),
        [
            ("sasl.password", "p,ss w=rd,,x"),
            ("acks", "all"),
            ("linger.ms", "5"),
            ("sasl.jaas.config", "x required user=\"u\",pw"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()))
    );
    // Within a secret's value a comma starts a new option only where a property librdkafka knows follows:
    // a password's ",z9=Q" is the password's (librdkafka would name "z9", a piece of it, as unknown).
    let after_a_secret = [
        "sasl.password=Xy,z9=Q".to_string(),
        "sasl.username=u,sasl.password=p,ssl.ca.location=/x".to_string(),
        "ssl.key.location=/k.pem,ssl.certificate.location=/c.pem".to_string(),
    ];
    assert_eq!(
        split_kafka_options(after_a_secret.iter()).unwrap(),
        [
            ("sasl.password", "Xy,z9=Q"),
            ("sasl.username", "u"),
            ("sasl.password", "p"),
            ("ssl.ca.location", "/x"),
            ("ssl.key.location", "/k.pem"),
            ("ssl.certificate.location", "/c.pem"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()))
    );
    let secret = ["hunter2,sasl.username=me".to_string()];
    let err = split_kafka_options(secret.iter()).unwrap_err().to_string();
    assert!(!err.contains("hunter2"), "{err}");
}

/// Every option a file can set, each with a value no default has.
const EVERY_OPTION: &str = r#"
database-url = "postgres://file/db"
replication-url = "postgres://file-replication/db"
brokers = "file:9092"
topic = "file.{aggregate_type}"
table = ["file.outbox"]
table-style = "debezium"
column = ["event_id=eid"]
header-column = ["trace"]
add-polling-columns = true
existing-rows = "unpublished"
slot = "file_slot"
publication = "file_publication"
no-failover-slot = true
standby-url = ["postgres://file-standby/db"]
database-password-command = "file-token-helper"
kafka-option = ["acks=all"]
topic-partitions = 9
topic-replication-factor = 3
no-create-topics = true
startup-timeout = "61s"
reconnect-timeout = "11m"
shutdown-timeout = "31s"
max-in-flight-events = 1234
max-in-flight-bytes = 4096
status-interval = "2s"
mode = "poll"
poll-interval = "300ms"
poll-batch-size = 77
lease = "31s"
poll-order = "none"
retry-base = "2s"
retry-cap = "6m"
max-attempts = 11
poll-notify = true
dead-letter-topic = "file.dead"
retention = "8d"
archive-table = "file.archive"
retention-interval = "2m"
audit-interval = "15m"
metrics-addr = "127.0.0.1:9999"
log-format = "json"
delivery = "exactly-once"
format = "cloudevents"
cloudevents-mode = "structured"
cloudevents-source = "/file/source"
progress-topic = "file.progress"
transaction-interval = "250ms"
max-topics = 9
allow-unprefixed-topic = true
auto-drop-slot-after = "3m"
"#;

/// Every option, as a TOML table (how the merge sees it).
fn as_table(options: &Options) -> toml::Table {
    toml::Table::try_from(options).unwrap()
}

#[test]
fn the_file_fills_every_option_and_flags_win_over_every_one() {
    let file: Options = toml::from_str(EVERY_OPTION).unwrap();
    let from_file = as_table(&file);
    assert_eq!(
        from_file.len(),
        EVERY_OPTION.lines().filter(|l| l.contains('=')).count(),
        "every option of the file is read: {from_file:?}"
    );
    // Nothing given by flag or environment: the file's value, for every option.
    let merged = Options::default().or(file.clone()).unwrap();
    assert_eq!(as_table(&merged), from_file);
    let flags: Options = toml::from_str(
        &EVERY_OPTION
            .replace("file", "flag")
            .replace("= 9\n", "= 8\n")
            .replace("= 3\n", "= 2\n"),
    )
    .unwrap();
    let merged = flags.clone().or(file.clone()).unwrap();
    // Everything given: the flag's value, for every option; Kafka options add up, the file's first.
    let mut expected = as_table(&flags);
    let kafka_options = [&file, &flags]
        .iter()
        .flat_map(|o| o.kafka_option.clone().unwrap_or_default())
        .map(toml::Value::String)
        .collect();
    expected.insert("kafka-option".into(), toml::Value::Array(kafka_options));
    assert_eq!(as_table(&merged), expected);
}

#[test]
fn file_fills_gaps_and_flags_win() {
    let dir = std::env::temp_dir().join(format!("outboxd-config-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("outboxd.toml");
    std::fs::write(
        &path,
        "brokers = \"file:9092\"\nslot = \"from_file\"\nkafka-option = [\"acks=all\"]\n",
    )
    .unwrap();
    let merged = options(&[
        "--config",
        path.to_str().unwrap(),
        "--slot",
        "from_flag",
        "--database-url",
        "postgres://h/db",
    ])
    .with_file()
    .unwrap();
    assert_eq!(merged.brokers.as_deref(), Some("file:9092"));
    assert_eq!(merged.slot.as_deref(), Some("from_flag"));
    assert_eq!(merged.kafka_option, Some(vec!["acks=all".to_string()]));
    // Kafka options add up, the file's first (review L4: a secret given by the environment dropped every
    // option of the file).
    let merged = options(&[
        "--config",
        path.to_str().unwrap(),
        "--kafka-option",
        "sasl.password=from-a-secret",
    ])
    .with_file()
    .unwrap();
    assert_eq!(
        merged.kafka_option,
        Some(vec![
            "acks=all".to_string(),
            "sasl.password=from-a-secret".to_string()
        ])
    );

    std::fs::write(&path, "brokers = \"b\"\nbogus-key = 1\n").unwrap();
    let err = options(&["--config", path.to_str().unwrap()])
        .with_file()
        .unwrap_err()
        .to_string();
    assert!(err.contains("bogus-key"), "{err}");
    std::fs::write(&path, "topic-partitions = \"six\"\n").unwrap();
    let err = options(&["--config", path.to_str().unwrap()])
        .with_file()
        .unwrap_err()
        .to_string();
    assert!(err.contains("topic-partitions"), "{err}");
    // One table or a list of tables.
    for (text, expected) in [
        ("table = \"app.outbox\"\n", 1),
        ("table = [\"a.outbox\", \"b.outbox\"]\n", 2),
    ] {
        std::fs::write(&path, text).unwrap();
        let merged = options(&["--config", path.to_str().unwrap()])
            .with_file()
            .unwrap();
        assert_eq!(merged.table.map(|t| t.len()), Some(expected), "{text}");
    }
    std::fs::write(
        &path,
        "column = \"event_id=id\"\nheader-column = [\"a\", \"b\"]\n",
    )
    .unwrap();
    let merged = options(&["--config", path.to_str().unwrap()])
        .with_file()
        .unwrap();
    assert_eq!(merged.column, Some(vec!["event_id=id".to_string()]));
    assert_eq!(merged.header_column.map(|h| h.len()), Some(2));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn table_mapping_options() {
    let base = ["--database-url", "postgres://h/db", "--brokers", "b:9092"];
    let run = options(
        &[
            &base[..],
            &[
                "--table",
                "orders.outboxevent",
                "--table",
                "billing.outboxevent",
                "--table-style",
                "debezium",
                "--column",
                "billing.outboxevent:created_at=occurred_at",
                "--header-column",
                "traceparent",
            ],
        ]
        .concat(),
    )
    .run()
    .unwrap();
    let tables = &run.database.tables;
    assert_eq!(tables.len(), 2);
    assert_eq!(tables[1].name.schema, "billing");
    assert_eq!(
        tables[0].as_created().required(crate::table::Role::EventId),
        "id"
    );
    assert_eq!(
        tables[1].as_created().column(crate::table::Role::CreatedAt),
        Some("occurred_at")
    );
    assert_eq!(
        tables[0].as_created().column(crate::table::Role::CreatedAt),
        Some("created_at"),
        "a TABLE: prefix maps that table only"
    );
    assert_eq!(tables[0].header_columns, vec!["traceparent".to_string()]);
    assert_eq!(
        run.topic.render(&tables[0].name, "Order", "x"),
        "outbox.event.Order"
    );
    for (flag, value, expected) in [
        ("--column", "event_id", "ROLE=COLUMN"),
        ("--column", "key=id", "unknown role"),
        ("--column", "payload=bo dy", "not a valid identifier"),
        ("--header-column", "x\"y", "not a valid identifier"),
        ("--table", "public.outbox_event,outbox_event", "given twice"),
        (
            "--column",
            "other:payload=body",
            "not one of the --table values",
        ),
    ] {
        let err = options(&[&base[..], &[flag, value]].concat())
            .run()
            .unwrap_err()
            .to_string();
        assert!(err.contains(expected), "{flag} {value}: {err}");
    }
}

#[test]
fn exactly_once_is_off_by_default_and_its_options_need_it() {
    let base = [
        "--database-url",
        "postgres://u:p@localhost/db",
        "--brokers",
        "b:9092",
    ];
    assert!(options(&base).run().unwrap().kafka.exactly_once.is_none());
    let mut args = base.to_vec();
    args.extend(["--delivery", "exactly-once"]);
    let eos = options(&args).run().unwrap().kafka.exactly_once.unwrap();
    assert_eq!(eos.progress_topic, "outboxd.progress");
    assert_eq!(eos.transaction_interval, Duration::from_millis(100));
    for (extra, expected) in [
        (
            &["--progress-topic", "p"][..],
            "--progress-topic needs --delivery exactly-once",
        ),
        (
            &["--transaction-interval", "1s"][..],
            "--transaction-interval needs --delivery exactly-once",
        ),
    ] {
        let mut args = base.to_vec();
        args.extend_from_slice(extra);
        let err = options(&args).run().unwrap_err().to_string();
        assert!(err.contains(expected), "{err}");
    }
}

#[test]
fn exactly_once_refuses_what_would_undo_it() {
    let eos = [
        "--database-url",
        "postgres://u:p@localhost/db",
        "--brokers",
        "b:9092",
        "--delivery",
        "exactly-once",
    ];
    for (extra, expected) in [
        (&["--mode", "poll"][..], "use --mode cdc or auto"),
        (
            &["--kafka-option", "transactional.id=mine"][..],
            "transactional.id cannot be set",
        ),
        (
            &["--kafka-option", "enable.idempotence=false"][..],
            "enable.idempotence cannot be set",
        ),
        (&["--transaction-interval", "0s"][..], "between 1ms and 10s"),
        (&["--transaction-interval", "1m"][..], "between 1ms and 10s"),
        (
            &["--progress-topic", "bad topic"][..],
            "not a valid Kafka topic name",
        ),
    ] {
        let mut args = eos.to_vec();
        args.extend_from_slice(extra);
        let err = options(&args).run().unwrap_err().to_string();
        assert!(err.contains(expected), "{extra:?}: {err}");
    }
}

#[test]
fn a_header_column_never_takes_a_name_the_format_sets() {
    // Review L2: a row's `source` column overwrote the CloudEvent's source (and its id, its type).
    let base = ["--database-url", "postgres://h/db", "--brokers", "b:9092"];
    for (format, column) in [
        ("cloudevents", "source"),
        ("cloudevents", "id"),
        ("cloudevents", "type"),
        ("cloudevents", "data"),
        ("outboxd", "event_id"),
        ("outboxd", "id"),
        ("outboxd", "event_type"),
    ] {
        let args = [&base[..], &["--format", format, "--header-column", column]].concat();
        let error = options(&args).run().err().map(|e| e.to_string());
        assert!(
            error
                .as_deref()
                .is_some_and(|e| e.contains("would overwrite")),
            "--format {format} --header-column {column}: {error:?}"
        );
    }
    for format in ["cloudevents", "outboxd"] {
        let args = [
            &base[..],
            &["--format", format, "--header-column", "traceparent"],
        ]
        .concat();
        assert!(options(&args).run().is_ok(), "{format}");
    }
}

#[test]
fn a_topic_the_rows_choose_whole_is_refused_unless_asked_for() {
    let base = [
        "--database-url",
        "postgres://u:p@h/db",
        "--brokers",
        "b:9092",
    ];
    for template in ["{aggregate_type}", "{event_type}.events"] {
        let args = [&base[..], &["--topic", template]].concat();
        let error = options(&args).run().unwrap_err().to_string();
        assert!(error.contains("--allow-unprefixed-topic"), "{error}");
        let allowed = [&args[..], &["--allow-unprefixed-topic"]].concat();
        assert!(options(&allowed).run().is_ok(), "{template}");
    }
    for template in [
        "outbox.{aggregate_type}",
        "{schema}.{aggregate_type}",
        "{table}",
    ] {
        let args = [&base[..], &["--topic", template]].concat();
        assert!(options(&args).run().is_ok(), "{template}");
    }
    let run = options(&base).run().unwrap();
    assert_eq!(run.kafka.max_topics, 1000);
    let zero = [&base[..], &["--max-topics", "0"]].concat();
    assert!(options(&zero).run().is_err());
}

#[test]
fn a_debug_of_the_settings_never_shows_a_secret() {
    // Review L4: Options and KafkaSettings derived Debug, URL and sasl.password included.
    let given = options(&[
        "--database-url",
        "postgres://outboxd:S3cret-db@h/db",
        "--replication-url",
        "postgres://repl:S3cret-repl@h/db",
        "--brokers",
        "b:9092",
        "--kafka-option",
        "security.protocol=SASL_SSL,sasl.password=S3cret-kafka",
        "--kafka-option",
        "ssl.key.password=S3cret-key",
        // Review follow-up: a private key in PEM, an OAUTHBEARER assertion key and its passphrase, the
        // unsecured OAUTHBEARER configuration.
        "--kafka-option",
        "ssl.key.pem=S3cret-pem",
        "--kafka-option",
        "sasl.oauthbearer.assertion.private.key.pem=S3cret-assertion",
        "--kafka-option",
        "sasl.oauthbearer.assertion.private.key.passphrase=S3cret-phrase",
        "--kafka-option",
        "sasl.oauthbearer.config=principal=admin S3cret-config",
    ]);
    let shown = format!("{given:?}");
    let run = given.run().unwrap();
    let shown = format!("{shown} {:?} {:?}", run.kafka, run.database);
    for secret in [
        "S3cret-db",
        "S3cret-repl",
        "S3cret-kafka",
        "S3cret-key",
        "S3cret-pem",
        "S3cret-assertion",
        "S3cret-phrase",
        "S3cret-config",
    ] {
        assert!(!shown.contains(secret), "{secret} in {shown}");
    }
    assert!(shown.contains("b:9092"), "{shown}");
}

/// README's options table, as (option cell, default cell) of each row whose option starts with `--` or names a
/// subcommand's own flag (`status --json`).
fn readme_options() -> Vec<(String, String)> {
    let readme = include_str!("../../README.md");
    let table = readme
        .split("| option | default | meaning |")
        .nth(1)
        .expect("README has the options table");
    table
        .lines()
        .skip(2)
        .take_while(|line| line.starts_with('|'))
        .map(|line| {
            let cells: Vec<&str> = line.split(" | ").collect();
            (
                cells[0].trim_start_matches("| ").to_string(),
                cells[1].replace('`', ""),
            )
        })
        .collect()
}

/// `--name` as clap has it.
fn long_flags(command: &clap::Command) -> Vec<&clap::Arg> {
    command
        .get_arguments()
        .filter(|arg| {
            arg.get_long()
                .is_some_and(|l| l != "help" && l != "version")
        })
        .collect()
}

/// README's options table and the CLI cannot drift: every flag of `run` (and of `status` and `doctor`) has a
/// row and every row a flag; each option's environment variable is `OUTBOXD_` + its name in upper snake
/// case, as README says; each is a key of the `--config` file but `config` itself; and where `--help` states
/// a default, README states the same.
#[test]
fn readme_options_table_matches_the_cli() {
    use clap::CommandFactory;
    let cli = Cli::command();
    let rows = readme_options();
    let run = cli.find_subcommand("run").unwrap();
    let mut named = Vec::new();
    for arg in long_flags(run) {
        let long = arg.get_long().unwrap();
        let cell = format!("`--{long}`");
        named.push(cell.clone());
        let Some((_, default)) = rows.iter().find(|(option, _)| *option == cell) else {
            panic!("README's options table has no row {cell}");
        };
        let env = arg.get_env().map(|e| e.to_string_lossy().into_owned());
        let expected_env = format!("OUTBOXD_{}", long.to_uppercase().replace('-', "_"));
        assert_eq!(env.as_deref(), Some(expected_env.as_str()), "--{long}");
        if long != "config" {
            assert!(
                EVERY_OPTION
                    .lines()
                    .any(|line| line.starts_with(&format!("{long} ="))),
                "--{long} is no key of the --config file (EVERY_OPTION)"
            );
        }
        let help = arg.get_help().map(|h| h.to_string()).unwrap_or_default();
        if let Some(stated) = help.split("[default: ").nth(1) {
            let stated = stated.split([']', ';']).next().unwrap_or_default();
            assert_eq!(
                default, stated,
                "--{long}: README's default against --help's"
            );
        }
    }
    for (option, _) in &rows {
        let subcommand_flag = ["status ", "doctor "].iter().find_map(|sub| {
            option
                .strip_prefix(&format!("`{sub}"))
                .map(|rest| (sub.trim(), rest))
        });
        match subcommand_flag {
            Some((sub, rest)) => {
                let command = cli.find_subcommand(sub).unwrap();
                for flag in rest
                    .split(" / ")
                    .map(|f| f.trim_matches('`').trim_start_matches("--"))
                {
                    assert!(
                        long_flags(command)
                            .iter()
                            .any(|a| a.get_long() == Some(flag)),
                        "README names {sub} --{flag}, which {sub} does not have"
                    );
                }
            }
            None => assert!(
                named.contains(option),
                "README names {option}, which is no option of run"
            ),
        }
    }
    for sub in ["status", "doctor"] {
        let command = cli.find_subcommand(sub).unwrap();
        for arg in long_flags(command) {
            let long = arg.get_long().unwrap();
            if long_flags(run).iter().any(|a| a.get_long() == Some(long)) {
                continue;
            }
            assert!(
                rows.iter()
                    .any(|(option, _)| option.starts_with(&format!("`{sub} "))
                        && option.contains(&format!("--{long}"))),
                "README's options table has no row for {sub} --{long}"
            );
        }
    }
}
