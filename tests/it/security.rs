//! What comes from rows and from servers stays data, and secrets stay out of what outboxd prints (the
//! security review of 2026-12-03; TLS and authentication are in `tls`).

use std::time::Duration;

use crate::support::*;

/// A row's aggregate id holding a line break and a made-up log line, on an event outboxd logs (dead-lettered:
/// too large for any topic): the text log shows the value escaped, never a line of its own (review L3).
#[tokio::test(flavor = "multi_thread")]
async fn a_value_from_a_row_cannot_forge_a_log_line() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut args = run_args(&url, &brokers);
    args.extend(["--mode", "poll"]);
    let outboxd = Outboxd::spawn(&args);
    let client = pg.client().await;
    let forged = "x\n2026-12-03T00:00:00.000000Z  INFO outboxd: all events published";
    client
        .execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             VALUES (gen_random_uuid(), 'Order', $1, 'E', jsonb_build_object('pad', repeat('x', 1500000)))",
            &[&forged],
        )
        .await
        .unwrap();
    wait_settled(&client, Duration::from_secs(60)).await;
    assert_eq!(dead_count(&client).await, 1, "the oversize event died");
    let log = outboxd.log_text();
    assert!(
        log.contains("x\\n2026-12-03T00:00:00.000000Z"),
        "the value is in the log, escaped:\n{log}"
    );
    assert!(
        !log.lines()
            .any(|line| line.starts_with("2026-12-03T00:00:00")),
        "a row's value started a log line of its own:\n{log}"
    );
}

/// Any login may take an advisory lock: a session of another role holding outboxd's leadership lock (in
/// outboxd's keyspace) keeps every instance standing by. outboxd never ends it, and says at error level which
/// session it is and how to end it (review M4: it stood by silently, the slot keeping WAL).
#[tokio::test(flavor = "multi_thread")]
async fn a_session_squatting_on_the_leadership_lock_is_named_and_never_ended() {
    squat_on_the_leadership_lock("nightly report").await;
}

/// The same squatter naming its session as outboxd's leadership session (any login may set
/// `application_name`): its role may not update the outbox table, so it is not taken for a silent leader and
/// ended (outboxd runs as a superuser here, so it could), but named as above (review M4/L5).
#[tokio::test(flavor = "multi_thread")]
async fn a_squatter_naming_itself_outboxd_is_named_and_never_ended() {
    squat_on_the_leadership_lock("outboxd active outboxd").await;
}

async fn squat_on_the_leadership_lock(application_name: &str) {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    client
        .batch_execute("CREATE ROLE reporting LOGIN")
        .await
        .unwrap();
    let squatter = pg.client_as("reporting").await;
    squatter
        .execute(
            "SELECT set_config('application_name', $1, false)",
            &[&application_name],
        )
        .await
        .unwrap();
    squatter
        .batch_execute(
            "SELECT pg_advisory_lock(1869968482, hashtext('outboxd.leader.public.outbox_event.outboxd'))",
        )
        .await
        .unwrap();
    let pid: i32 = squatter
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let mut args = run_args(&url, &brokers);
    args.extend(["--mode", "cdc"]);
    let outboxd = Outboxd::spawn(&args);
    let named = format!("pid {pid} (user reporting, application_name {application_name:?})");
    wait_for(
        "outboxd to name the session holding its lock",
        Duration::from_secs(60),
        || {
            let log = outboxd.log_text();
            log.lines()
                .any(|line| line.contains(" ERROR ") && line.contains(&named))
                .then_some(())
        },
    );
    // Past the silence after which a standby ends a leader's session (liveness::SILENT_LEADER, 15 s), and
    // a standby round after it.
    let idle_for = "SELECT extract(epoch FROM now() - state_change)::float8 FROM pg_stat_activity WHERE pid = $1";
    wait_for_async(
        "the squatter to be idle for longer than a silent leader may be",
        Duration::from_secs(60),
        || async {
            let row = client.query_opt(idle_for, &[&pid]).await.unwrap();
            let idle: f64 = row.map_or(f64::MAX, |row| row.get(0));
            (idle > 18.0).then_some(())
        },
    )
    .await;
    let alive: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
            &[&pid],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(alive, 1, "outboxd ended a session that is not its own");
    squatter.query_one("SELECT 1", &[]).await.unwrap();
}

/// A login without any privilege on the outbox table holds the fleet markers (any login may take an advisory
/// lock and name its session): the `--poll-order none` marker of the table, and the CDC marker in a session
/// named `outboxd active outboxd`. A poller neither stops (its peers' order differs) nor defers to that
/// "leader": it publishes (review M4, fleet markers).
#[tokio::test(flavor = "multi_thread")]
async fn a_login_holding_the_fleet_markers_neither_stops_nor_stalls_a_poller() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    client
        .batch_execute("CREATE ROLE reporting LOGIN")
        .await
        .unwrap();
    let squatter = pg.client_as("reporting").await;
    squatter
        .batch_execute(
            "SET application_name = 'outboxd active outboxd';
             SELECT pg_advisory_lock_shared(1869968482, hashtext('outboxd.poll-order.public.outbox_event.none'));
             SELECT pg_advisory_lock_shared(1869968482, hashtext('outboxd.cdc.public.outbox_event'));",
        )
        .await
        .unwrap();
    let mut args = run_args(&url, &brokers);
    args.extend(["--mode", "poll"]);
    let outboxd = Outboxd::spawn(&args);
    let (committed, _) = insert_events(&mut client, 0, 10, 5, 5, None).await;
    wait_all_published(&client, Duration::from_secs(120)).await;
    verify_delivery(&brokers, &committed, &[], 60, "poller beside a squatter");
    assert!(
        !outboxd
            .log_text()
            .contains("a CDC leader streams this table"),
        "the poller deferred to a session that only names itself as a leader"
    );
    // Nor does `status` count it as an active instance.
    let status = run_outboxd(&["status", "--json", "--database-url", &url]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["active_instances"], 0, "{status}");
    squatter.query_one("SELECT 1", &[]).await.unwrap();
}

/// A role that may create tables in `public` plants `outboxd_migrations` with a trigger that would make it a
/// superuser when migrate (run as a superuser) records a migration: migrate refuses, naming the table, the
/// owner and the fix, and the trigger never runs (review M2).
#[tokio::test(flavor = "multi_thread")]
async fn migrate_refuses_a_migrations_table_another_role_planted() {
    let pg = Postgres::start();
    let client = pg.client().await;
    let mallory = mallory_who_may_create_in_public(&pg, &client).await;
    mallory
        .batch_execute(
            "CREATE TABLE public.outboxd_migrations (target text NOT NULL, version integer NOT NULL,
                 name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (target, version));
             GRANT ALL ON public.outboxd_migrations TO PUBLIC;
             CREATE FUNCTION public.pwn() RETURNS trigger LANGUAGE plpgsql AS
                 $$ BEGIN EXECUTE 'ALTER ROLE mallory SUPERUSER'; RETURN NEW; END $$;
             CREATE TRIGGER pwn BEFORE INSERT ON public.outboxd_migrations
                 FOR EACH ROW EXECUTE FUNCTION public.pwn();",
        )
        .await
        .unwrap();
    let output = run_outboxd(&["migrate", "--database-url", &pg.url()]);
    let stderr = stderr_of(&output);
    assert!(
        !output.status.success(),
        "migrate used the planted table: {stderr}"
    );
    for expected in ["public.outboxd_migrations", "mallory", "DROP TABLE"] {
        assert!(stderr.contains(expected), "{expected:?} in {stderr}");
    }
    let superuser: bool = client
        .query_one(
            "SELECT rolsuper FROM pg_roles WHERE rolname = 'mallory'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!superuser, "the planted trigger ran with migrate's rights");
    // Once the planted table is gone, migrate runs.
    client
        .batch_execute("DROP TABLE public.outboxd_migrations")
        .await
        .unwrap();
    migrate(&pg);
}

/// Whoever reaches the metrics port opens 2,000 connections, half of them sending a header slowly and never
/// ending it, half a 400 KB header: outboxd's open files stay bounded, `/readyz` answers, events flow
/// (review M3: no header timeout, no connection limit, a large buffer per connection).
#[tokio::test(flavor = "multi_thread")]
async fn a_flood_of_slow_connections_to_the_metrics_port_takes_nothing_down() {
    use std::io::Write;
    raise_open_files_limit(4_096);
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let (outboxd, metrics_addr) = spawn_serving_metrics(&url, &brokers, &[]);
    let mut client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    let fd_dir = format!("/proc/{}/fd", outboxd.pid());
    let open_files = move || {
        std::fs::read_dir(&fd_dir)
            .map(|dir| dir.count())
            .unwrap_or(0)
    };
    let before = open_files();
    // The most files outboxd held at any moment of the flood, not only after it.
    let flooding = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(true));
    let peak = std::thread::spawn({
        let (flooding, open_files) = (flooding.clone(), open_files.clone());
        move || {
            let mut peak = 0;
            while flooding.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(open_files());
            }
            peak
        }
    });
    let flood: Vec<std::net::TcpStream> = (0..2_000)
        .filter_map(|n| {
            let mut stream = std::net::TcpStream::connect(&metrics_addr).ok()?;
            let header = if n % 2 == 0 {
                b"GET /metrics HTTP/1.1\r\nX: a".to_vec()
            } else {
                [b"GET / HTTP/1.1\r\nX: ".as_slice(), &[b'a'; 400_000]].concat()
            };
            stream.set_nonblocking(true).ok()?;
            let _ = stream.write(&header);
            Some(stream)
        })
        .collect();
    assert!(
        flood.len() > 1_000,
        "the flood opened {} connections",
        flood.len()
    );
    flooding.store(false, std::sync::atomic::Ordering::Relaxed);
    let most_open = peak.join().unwrap().max(open_files());
    assert!(
        most_open < before + 200,
        "outboxd holds {most_open} files under the flood (before: {before})"
    );
    let addr = metrics_addr.clone();
    wait_for(
        "/readyz to answer under the flood",
        Duration::from_secs(60),
        || http_get(&addr, "/readyz").filter(|(status, _)| *status == 200),
    );
    let (committed, _) = insert_events(&mut client, 0, 10, 5, 5, None).await;
    wait_all_published(&client, Duration::from_secs(60)).await;
    verify_delivery(&brokers, &committed, &[], 60, "under the flood");
    drop(flood);
}

/// Connections kept alive (each has had an answer and stays open, as a keep-alive client leaves it), more
/// of them than the endpoint takes: a probe arriving next is still answered at once, the oldest of them
/// closed to make room (review M3 follow-up: they held every place until their 60 s lifetime ran out).
#[test]
fn connections_kept_open_cannot_keep_a_probe_out() {
    use std::io::{Read, Write};
    raise_open_files_limit(4_096);
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    // Only the endpoint is needed: outboxd serves it while it waits for an unreachable database.
    let outboxd = Outboxd::spawn(&[
        "run",
        "--database-url",
        "postgres://outboxd@127.0.0.1:1/app",
        "--brokers",
        "127.0.0.1:1",
        "--metrics-addr",
        metrics_addr.as_str(),
    ]);
    let addr = metrics_addr.clone();
    wait_for("the endpoint to answer", Duration::from_secs(60), || {
        http_get(&addr, "/healthz")
    });
    let kept: Vec<std::net::TcpStream> = (0..300)
        .map(|_| {
            let mut stream = std::net::TcpStream::connect(&metrics_addr).unwrap();
            stream
                .set_read_timeout(Some(Duration::from_secs(10)))
                .unwrap();
            stream
                .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
                .unwrap();
            let mut answer = [0u8; 512];
            let read = stream.read(&mut answer).unwrap_or(0);
            assert!(
                answer[..read].starts_with(b"HTTP/1.1 200"),
                "{}",
                String::from_utf8_lossy(&answer[..read])
            );
            stream
        })
        .collect();
    let probe = http_get(&metrics_addr, "/readyz");
    assert!(
        probe.is_some(),
        "a probe found no place beside {} connections kept open",
        kept.len()
    );
    drop((kept, outboxd));
}

/// Raises this process's soft limit of open files to `wanted` (at most the hard limit): the flood needs
/// more than a fresh machine's 1,024.
fn raise_open_files_limit(wanted: u64) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct given.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        if limit.rlim_cur < wanted {
            limit.rlim_cur = wanted.min(limit.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
        }
    }
}

/// A secret given both as a variable and as a file (`OUTBOXD_X` and `OUTBOXD_X_FILE`) is refused before
/// anything starts, naming both and neither value; a file that cannot be read is named with the fix (review
/// L4: secrets from files, the container convention).
#[test]
fn a_secret_given_twice_or_from_a_missing_file_is_refused_without_its_value() {
    let file = scratch_dir("secrets").join("database-url");
    std::fs::write(&file, "postgres://outboxd:from-the-file@127.0.0.1:1/app\n").unwrap();
    let output = run_outboxd_with_env(
        &["migrate"],
        &[
            (
                "OUTBOXD_DATABASE_URL",
                "postgres://outboxd:from-the-env@127.0.0.1:1/app",
            ),
            ("OUTBOXD_DATABASE_URL_FILE", file.to_str().unwrap()),
        ],
    );
    let stderr = stderr_of(&output);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("OUTBOXD_DATABASE_URL_FILE"), "{stderr}");
    assert!(
        !stderr.contains("from-the-env") && !stderr.contains("from-the-file"),
        "a password reached the message: {stderr}"
    );
    let output = run_outboxd_with_env(
        &["migrate"],
        &[("OUTBOXD_DATABASE_URL_FILE", "/run/secrets/nowhere")],
    );
    let stderr = stderr_of(&output);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("/run/secrets/nowhere") && stderr.contains("mount the secret"),
        "{stderr}"
    );
}

/// migrate runs as `deployer`, a member of role `mallory` (so `deployer` holds mallory's rights, not the other
/// way round). mallory plants `outboxd_migrations` with a column default calling a function of hers (no
/// trigger): recording a migration would run her code with deployer's rights. migrate refuses the table of a
/// role it is a member of (review M2 follow-up: the owner check went the wrong way round).
#[tokio::test(flavor = "multi_thread")]
async fn migrate_refuses_a_migrations_table_of_a_role_it_holds_the_rights_of() {
    let pg = Postgres::start();
    let client = pg.client().await;
    client
        .batch_execute(
            "CREATE ROLE mallory LOGIN;
             CREATE ROLE deployer LOGIN;
             GRANT mallory TO deployer;
             GRANT CREATE ON SCHEMA public TO mallory, deployer;
             GRANT CREATE ON DATABASE postgres TO deployer;",
        )
        .await
        .unwrap();
    let mallory = pg.client_as("mallory").await;
    mallory
        .batch_execute(
            "CREATE TABLE public.stolen (who text);
             GRANT INSERT ON public.stolen TO PUBLIC;
             CREATE FUNCTION public.when_applied() RETURNS timestamptz LANGUAGE plpgsql AS
                 $$ BEGIN INSERT INTO public.stolen VALUES (current_user); RETURN now(); END $$;
             CREATE TABLE public.outboxd_migrations (target text NOT NULL, version integer NOT NULL,
                 name text NOT NULL, applied_at timestamptz NOT NULL DEFAULT public.when_applied(),
                 PRIMARY KEY (target, version));
             GRANT ALL ON public.outboxd_migrations TO PUBLIC;",
        )
        .await
        .unwrap();
    let output = run_outboxd(&["migrate", "--database-url", &pg.url_for("deployer", None)]);
    let stderr = stderr_of(&output);
    for expected in ["public.outboxd_migrations", "mallory", "DROP TABLE"] {
        assert!(stderr.contains(expected), "{expected:?} in {stderr}");
    }
    assert!(!output.status.success(), "{stderr}");
    let stolen: i64 = client
        .query_one("SELECT count(*) FROM public.stolen", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(stolen, 0, "mallory's code ran with migrate's rights");
}

/// The `--poll-notify` trigger's function runs in every inserting transaction with the inserter's rights: its
/// `search_path` is pinned and what it calls is qualified (review M2: functions created with a pinned
/// `search_path`).
#[tokio::test(flavor = "multi_thread")]
async fn the_notify_function_runs_with_a_pinned_search_path() {
    let pg = Postgres::start();
    let output = run_outboxd(&["migrate", "--database-url", &pg.url(), "--poll-notify"]);
    assert!(output.status.success(), "{}", stderr_of(&output));
    let client = pg.client().await;
    let (config, body): (Option<Vec<String>>, String) = client
        .query_one(
            "SELECT p.proconfig, p.prosrc FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
             WHERE t.tgname = 'outboxd_notify' AND t.tgrelid = 'public.outbox_event'::regclass",
            &[],
        )
        .await
        .map(|row| (row.get(0), row.get(1)))
        .unwrap();
    assert_eq!(
        config,
        Some(vec!["search_path=pg_catalog, pg_temp".to_string()]),
        "{body}"
    );
    assert!(body.contains("pg_catalog.pg_notify("), "{body}");
}

/// Topic names come from rows. With a template the rows choose whole (asked for with
/// `--allow-unprefixed-topic`) and `--max-topics 2`: events of two aggregate types are published; a third
/// type's (one topic too many), one naming the dead-letter topic and one naming `_schemas` (a tool's topic)
/// are refused like a topic Kafka refuses, dead-lettered after `--max-attempts`, and nothing of theirs
/// reaches those topics (review L1).
#[tokio::test(flavor = "multi_thread")]
async fn rows_cannot_make_outboxd_create_topics_without_end_or_write_reserved_ones() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut args = run_args(&url, &brokers);
    args.extend([
        "--mode",
        "poll",
        "--topic",
        "{aggregate_type}",
        "--allow-unprefixed-topic",
        "--max-topics",
        "2",
        "--dead-letter-topic",
        "dlq",
        "--max-attempts",
        "2",
        "--retry-base",
        "100ms",
        "--retry-cap",
        "200ms",
    ]);
    let _outboxd = Outboxd::spawn(&args);
    let client = pg.client().await;
    let insert = |aggregate_type: &'static str| {
        let client = &client;
        async move {
            client
                .execute(
                    "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                     VALUES (gen_random_uuid(), $1, 'a-1', 'E', '{}')",
                    &[&aggregate_type],
                )
                .await
                .unwrap();
        }
    };
    insert("first").await;
    insert("second").await;
    wait_all_published(&client, Duration::from_secs(60)).await;
    for refused in ["third", "dlq", "_schemas"] {
        insert(refused).await;
    }
    wait_settled(&client, Duration::from_secs(60)).await;
    let rows = client
        .query(
            "SELECT aggregate_type, published_at IS NOT NULL, dead_at IS NOT NULL, coalesce(last_error, '')
             FROM outbox_event ORDER BY position",
            &[],
        )
        .await
        .unwrap();
    let outcome: Vec<(String, bool, bool, String)> = rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    for (aggregate_type, published, dead, error) in &outcome {
        let (want_published, want_error) = match aggregate_type.as_str() {
            "first" | "second" => (true, ""),
            "third" => (false, "--max-topics 2"),
            "dlq" => (false, "outboxd's own"),
            _ => (false, "starts with '_'"),
        };
        assert_eq!(
            (*published, *dead),
            (want_published, !want_published),
            "{aggregate_type}: {error}"
        );
        assert!(error.contains(want_error), "{aggregate_type}: {error}");
    }
    assert_eq!(outcome.len(), 5);
    // The dead-letter topic holds the three dead letters and nothing else.
    let dead_letters = consume_all(&brokers, &["dlq"], 3, Duration::from_secs(60));
    assert_eq!(dead_letters.len(), 3, "{dead_letters:?}");
}

/// Any login may emit a logical decoding message into every slot of its database. One of 200 MB, emitted
/// by a role with no privilege beyond CONNECT, is skipped as it streams: outboxd never holds it in memory
/// (it buffered all of it, and a pod's memory limit ended it on every start as the slot sent it again), and
/// the event after it is published (adversarial review of issue 34, finding 1).
#[tokio::test(flavor = "multi_thread")]
async fn a_huge_logical_decoding_message_from_any_login_is_skipped_unread() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut args = run_args(&url, &brokers);
    args.extend(["--mode", "cdc"]);
    let outboxd = Outboxd::spawn(&args);
    let mut client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    client
        .batch_execute("CREATE ROLE reporting LOGIN")
        .await
        .unwrap();
    let reporting = pg.client_as("reporting").await;
    reporting
        .batch_execute("SELECT pg_logical_emit_message(true, 'x', repeat('a', 200 * 1024 * 1024))")
        .await
        .unwrap();
    let (committed, _) = insert_events(&mut client, 0, 1, 3, 1, None).await;
    wait_all_published(&client, Duration::from_secs(120)).await;
    verify_delivery(&brokers, &committed, &[], 60, "after a huge message");
    let status = std::fs::read_to_string(format!("/proc/{}/status", outboxd.pid())).unwrap();
    let peak_kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    println!("outboxd's peak resident memory: {} MiB", peak_kib / 1024);
    assert!(
        peak_kib < 150 * 1024,
        "outboxd held {} MiB at its peak: the message was read into memory",
        peak_kib / 1024
    );
    assert!(outboxd
        .log_text()
        .contains("skipped a logical decoding message"));
}

/// `--help` says which variables are set, never the value of one holding a secret (clap prints
/// `[env: NAME=value]` by default; `kubectl exec ... outboxd run --help` printed the database password).
#[test]
fn help_never_shows_a_secret_from_the_environment() {
    let output = run_outboxd_with_env(
        &["run", "--help"],
        &[
            ("OUTBOXD_DATABASE_URL", "postgres://u:S3cret-db@h/db"),
            ("OUTBOXD_REPLICATION_URL", "postgres://u:S3cret-repl@h/db"),
            ("OUTBOXD_KAFKA_OPTION", "sasl.password=S3cret-kafka"),
        ],
    );
    let help = String::from_utf8_lossy(&output.stdout);
    assert!(help.contains("OUTBOXD_DATABASE_URL"), "{help}");
    assert!(!help.contains("S3cret"), "{help}");
}

/// `hostaddr` is the address connected to on the replication connection too, as on the SQL connections
/// (it resolved `host` by DNS instead: a spoofed name got exactly the connection that carries the events).
#[tokio::test(flavor = "multi_thread")]
async fn the_replication_connection_goes_to_hostaddr_without_a_name_lookup() {
    let (pg, broker) = migrated_stack();
    let brokers = broker.addr();
    let url = format!(
        "host=outboxd-test.invalid hostaddr=127.0.0.1 port={} user=postgres dbname=postgres",
        pg.port
    );
    let mut args = run_args(&url, &brokers);
    args.extend(["--mode", "cdc"]);
    let _outboxd = Outboxd::spawn(&args);
    let mut client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    let (committed, _) = insert_events(&mut client, 0, 2, 2, 1, None).await;
    wait_all_published(&client, Duration::from_secs(60)).await;
    verify_delivery(&brokers, &committed, &[], 60, "through hostaddr");
}

/// Slot names are cluster-wide. Another database's logical slot named like outboxd's, with a creation marker
/// beside it (as while another outboxd there creates it): outboxd neither drops that slot nor its marker, and
/// stops naming the slot's database (it dropped the slot as one of its own interrupted creations).
#[tokio::test(flavor = "multi_thread")]
async fn a_slot_of_the_same_name_in_another_database_is_never_dropped() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    client.batch_execute("CREATE DATABASE other").await.unwrap();
    let (other, connection) = tokio_postgres::connect(
        &format!("postgres://postgres@127.0.0.1:{}/other", pg.port),
        tokio_postgres::NoTls,
    )
    .await
    .unwrap();
    tokio::spawn(connection);
    other
        .batch_execute(
            "SELECT pg_create_logical_replication_slot('outboxd', 'pgoutput');
             SELECT pg_create_physical_replication_slot('outboxd_creating');",
        )
        .await
        .unwrap();
    let mut args = run_args(&url, &brokers);
    args.extend(["--mode", "cdc", "--startup-timeout", "5s"]);
    let output = run_outboxd(&args);
    let stderr = stderr_of(&output);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("belongs to database other"), "{stderr}");
    let slots: Vec<(String, Option<String>)> = client
        .query(
            "SELECT slot_name::text, database::text FROM pg_replication_slots ORDER BY slot_name",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert_eq!(
        slots,
        [
            ("outboxd".to_string(), Some("other".to_string())),
            ("outboxd_creating".to_string(), None)
        ]
    );
}

/// A role that may create in `public` plants the outbox table before the first migrate (run as a
/// superuser), or the function the `--poll-notify` trigger calls: migrate would adopt them (the table is
/// hers, so are the events outboxd publishes from it; the function's body runs in every insert). migrate
/// refuses each, naming the owner and the fix (adversarial review of issue 34, finding 3).
#[tokio::test(flavor = "multi_thread")]
async fn migrate_refuses_an_outbox_table_or_notify_function_another_role_planted() {
    let pg = Postgres::start();
    let client = pg.client().await;
    let mallory = mallory_who_may_create_in_public(&pg, &client).await;
    mallory
        .batch_execute(
            "CREATE TABLE public.outbox_event (event_id uuid PRIMARY KEY, aggregate_type text NOT NULL,
                 aggregate_id text NOT NULL, event_type text NOT NULL, payload jsonb,
                 created_at timestamptz NOT NULL DEFAULT now());",
        )
        .await
        .unwrap();
    let output = run_outboxd(&["migrate", "--database-url", &pg.url()]);
    let stderr = stderr_of(&output);
    assert!(!output.status.success(), "{stderr}");
    for expected in ["public.outbox_event", "mallory"] {
        assert!(stderr.contains(expected), "{expected:?} in {stderr}");
    }

    mallory
        .batch_execute(
            "DROP TABLE public.outbox_event;
             CREATE FUNCTION public.outboxd_public_outbox_event_2843650bfe0a9fc4() RETURNS trigger
                 LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$;",
        )
        .await
        .unwrap();
    let output = run_outboxd(&["migrate", "--database-url", &pg.url(), "--poll-notify"]);
    let stderr = stderr_of(&output);
    assert!(!output.status.success(), "{stderr}");
    for expected in ["outboxd_public_outbox_event_2843650bfe0a9fc4", "mallory"] {
        assert!(stderr.contains(expected), "{expected:?} in {stderr}");
    }
    let triggers: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_trigger WHERE tgname = 'outboxd_notify'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(triggers, 0, "the trigger calls mallory's function");
}

/// What migrate creates next to the table only when missing is checked like the table: a schema, the inbox
/// table `consumed_event` or the position sequence that another role created first would be that role's (it
/// could drop and replace the outbox table in its schema, read or forge the consumers' inbox, or move the
/// polling path's order). A schema of the database's owner (`public` on PostgreSQL 15+, owned by
/// `pg_database_owner`) is trusted: "the application owns the database, migrate runs as a superuser" works.
#[tokio::test(flavor = "multi_thread")]
async fn migrate_refuses_a_schema_inbox_table_or_sequence_another_role_planted() {
    let pg = Postgres::start();
    let client = pg.client().await;
    let mallory = mallory_who_may_create_in_public(&pg, &client).await;
    client
        .batch_execute("GRANT CREATE ON DATABASE postgres TO mallory")
        .await
        .unwrap();
    let refused = |args: &[&str], expected: &[&str]| {
        let mut all = vec!["migrate", "--database-url"];
        let url = pg.url();
        all.push(&url);
        all.extend(args);
        let output = run_outboxd(&all);
        let stderr = stderr_of(&output);
        assert!(!output.status.success(), "{args:?}: {stderr}");
        for expected in expected {
            assert!(stderr.contains(expected), "{expected:?} in {stderr}");
        }
    };
    mallory.batch_execute("CREATE SCHEMA shop").await.unwrap();
    refused(
        &["--table", "shop.outbox_event"],
        &["schema \"shop\"", "mallory"],
    );
    mallory
        .batch_execute("CREATE TABLE public.consumed_event (consumer_name text, event_id uuid)")
        .await
        .unwrap();
    refused(&[], &["consumed_event", "mallory"]);
    mallory
        .batch_execute(
            "DROP TABLE public.consumed_event; CREATE SEQUENCE public.outbox_event_position_seq",
        )
        .await
        .unwrap();
    refused(&[], &["outbox_event_position_seq", "mallory"]);
    let tables: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_class WHERE relname IN ('outbox_event', 'consumed_event')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 0, "migrate created tables before refusing");

    // The application owns a database (and so its schema public); a superuser migrates it.
    for statement in ["CREATE ROLE app LOGIN", "CREATE DATABASE appdb OWNER app"] {
        client.batch_execute(statement).await.unwrap();
    }
    let appdb = format!("{}/appdb", pg.url().rsplit_once('/').unwrap().0);
    let output = run_outboxd(&["migrate", "--database-url", &appdb]);
    assert!(output.status.success(), "{}", stderr_of(&output));
}

/// Role `mallory`, who may create in schema `public` (as every role could before PostgreSQL 15), connected.
async fn mallory_who_may_create_in_public(
    pg: &Postgres,
    client: &tokio_postgres::Client,
) -> tokio_postgres::Client {
    client
        .batch_execute(
            "CREATE ROLE mallory LOGIN;
             GRANT CREATE ON SCHEMA public TO mallory;",
        )
        .await
        .unwrap();
    pg.client_as("mallory").await
}

/// librdkafka checks `sasl.oauthbearer.config` only when it first needs a token, and then quotes what it
/// could not parse, the rest of the value ("Unrecognized sasl.oauthbearer.config beginning at: ..."), in its
/// log and errors: outboxd takes every secret option's value, and each part of it, out of what librdkafka says.
#[test]
fn librdkafka_never_gets_to_quote_a_secret_option() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut args = run_args(&url, &brokers);
    args.extend([
        "--kafka-option",
        "security.protocol=SASL_PLAINTEXT",
        "--kafka-option",
        "sasl.mechanism=OAUTHBEARER",
        "--kafka-option",
        "enable.sasl.oauthbearer.unsecure.jwt=true",
        "--kafka-option",
        "sasl.oauthbearer.config=principal=svc bogus=1 extension_traceId=Tr4ceS3cret",
        "--startup-timeout",
        "10s",
    ]);
    let output = run_outboxd_with_env(&args, &[("RUST_LOG", "debug")]);
    let stderr = stderr_of(&output);
    assert!(
        stderr.contains("sasl.oauthbearer.config"),
        "librdkafka did not complain about the value: {stderr}"
    );
    assert!(!stderr.contains("Tr4ceS3cret"), "{stderr}");
    for line in stderr
        .lines()
        .filter(|l| l.contains("sasl.oauthbearer.config"))
        .take(2)
    {
        eprintln!("{line}");
    }
}

/// Adversarial review: an `--archive-table` another role created first (it may create in the schema,
/// which README's set-up grants outboxd for creating the archive) had its trigger run as outboxd's role on
/// every retention pass: with REPLICATION and UPDATE on the outbox. Refused at start-up (and every pass),
/// as is an archive to be created in a schema such a role owns.
#[tokio::test(flavor = "multi_thread")]
async fn retention_never_archives_into_a_table_another_role_planted() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    let mallory = mallory_who_may_create_in_public(&pg, &client).await;
    mallory
        .batch_execute(
            "CREATE TABLE public.loot (who text);
             GRANT INSERT ON public.loot TO PUBLIC;
             CREATE TABLE public.outbox_archive (event_id uuid, aggregate_type text, aggregate_id text,
                 event_type text, payload jsonb, created_at timestamptz, published_at timestamptz);
             GRANT INSERT, SELECT ON public.outbox_archive TO PUBLIC;
             CREATE FUNCTION public.steal() RETURNS trigger LANGUAGE plpgsql
                 AS $$ BEGIN INSERT INTO public.loot VALUES (current_user); RETURN NULL; END $$;
             CREATE TRIGGER steal AFTER INSERT ON public.outbox_archive
                 FOR EACH STATEMENT EXECUTE FUNCTION public.steal();",
        )
        .await
        .unwrap();
    client
        .batch_execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, published_at)
             SELECT gen_random_uuid(), 'Order', 'order-' || i, 'E', '{}', now() - interval '2 days'
             FROM generate_series(1, 10) AS i",
        )
        .await
        .unwrap();
    let run = |archive: &'static str| {
        let mut args: Vec<String> = run_args(&url, &brokers)
            .into_iter()
            .map(String::from)
            .collect();
        args.extend(
            [
                "--retention",
                "1d",
                "--retention-interval",
                "1s",
                "--archive-table",
                archive,
            ]
            .map(String::from),
        );
        Outboxd::spawn(&args.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let mut outboxd = run("public.outbox_archive");
    let archived = || async {
        client
            .query_one("SELECT count(*) FROM public.outbox_archive", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
            > 0
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while outboxd.try_wait().is_none() && !archived().await {
        assert!(
            std::time::Instant::now() < deadline,
            "outboxd neither refused the archive nor archived into it"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let loot: i64 = client
        .query_one("SELECT count(*) FROM public.loot", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(loot, 0, "mallory's trigger ran as outboxd's role");
    let status = outboxd.wait_exit();
    let log = outboxd.log_text();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(
        log.contains("--archive-table public.outbox_archive") && log.contains("mallory"),
        "{log}"
    );

    client
        .batch_execute("GRANT CREATE ON DATABASE postgres TO mallory")
        .await
        .unwrap();
    mallory.batch_execute("CREATE SCHEMA shop").await.unwrap();
    let mut outboxd = run("shop.archive");
    let status = outboxd.wait_exit();
    let log = outboxd.log_text();
    assert_eq!(status.code(), Some(1), "{log}");
    assert!(log.contains("schema") && log.contains("mallory"), "{log}");
}

/// Adversarial review 2: a publication named like outboxd's that another role created first was adopted
/// (a superuser's migrate added the outbox table to it); its owner could later stop it publishing inserts
/// (`SET (publish = 'update')`) without owning the table, and the slot would confirm past events it never
/// streamed. migrate and run refuse it, naming the owner and the fix.
#[tokio::test(flavor = "multi_thread")]
async fn a_publication_another_role_created_is_never_adopted() {
    let pg = Postgres::start();
    let broker = Broker::start();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    let mallory = mallory_who_may_create_in_public(&pg, &client).await;
    client
        .batch_execute("GRANT CREATE ON DATABASE postgres TO mallory")
        .await
        .unwrap();
    mallory
        .batch_execute(
            "CREATE TABLE public.decoy (id int); CREATE PUBLICATION outboxd FOR TABLE public.decoy",
        )
        .await
        .unwrap();
    let output = run_outboxd(&["migrate", "--database-url", &url]);
    let stderr = stderr_of(&output);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("publication outboxd is owned by role mallory")
            && stderr.contains("DROP PUBLICATION outboxd"),
        "{stderr}"
    );
    let adopted: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_publication_tables WHERE pubname = 'outboxd' AND tablename = 'outbox_event'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        adopted, 0,
        "migrate added the outbox table to mallory's publication"
    );

    // Made by an earlier migrate, then given away: run refuses it too.
    client
        .batch_execute("DROP PUBLICATION outboxd")
        .await
        .unwrap();
    migrate(&pg);
    client
        .batch_execute("ALTER PUBLICATION outboxd OWNER TO mallory")
        .await
        .unwrap();
    let mut args = run_args(&url, &brokers);
    args.extend(["--startup-timeout", "10s"]);
    let output = run_outboxd(&args);
    let stderr = stderr_of(&output);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("publication outboxd is owned by role mallory"),
        "{stderr}"
    );
}

/// Adversarial review 2: `CREATE INDEX IF NOT EXISTS` goes by name, so an index of that name on another
/// table (planted by a role that may create in the schema) stood in for the outbox table's claim index: every
/// claim then read the whole table. migrate refuses it, naming it.
#[tokio::test(flavor = "multi_thread")]
async fn migrate_never_takes_another_tables_index_for_its_own() {
    let pg = Postgres::start();
    let client = pg.client().await;
    let mallory = mallory_who_may_create_in_public(&pg, &client).await;
    mallory
        .batch_execute(
            "CREATE TABLE public.decoy (position bigint);
             CREATE INDEX outbox_event_claim_idx ON public.decoy (position NULLS FIRST)",
        )
        .await
        .unwrap();
    let url = pg.url();
    let output = run_outboxd(&["migrate", "--database-url", &url]);
    let stderr = stderr_of(&output);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("outbox_event_claim_idx") && stderr.contains("mallory"),
        "{stderr}"
    );
    mallory
        .batch_execute("DROP INDEX public.outbox_event_claim_idx")
        .await
        .unwrap();
    let output = run_outboxd(&["migrate", "--database-url", &url]);
    assert!(output.status.success(), "{}", stderr_of(&output));
    let on_the_outbox: bool = client
        .query_one(
            "SELECT indrelid = 'public.outbox_event'::regclass FROM pg_index
             WHERE indexrelid = 'public.outbox_event_claim_idx'::regclass",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(on_the_outbox);
}
