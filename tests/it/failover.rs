//! Failover, restore and switchover behind one address, on real PostgreSQL 15: outboxd keeps running
//! through a test-owned TCP proxy while the server behind it is replaced, an application keeps inserting
//! through the same proxy, and every event present in the database outboxd ends up on must be published,
//! in order per aggregate.

use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::support::*;
use outboxd::lsn::Lsn;

const SLOT: &str = "outboxd";
/// WAL written on the old server after the copy/standby stopped following it: far more than the new
/// server writes in the test afterwards, so a position carried over would skip all of it.
const FILLER_ROWS: i32 = 8_000;

/// One address (a proxy) whose server can be switched, as a DNS name or a load balancer would.
struct Address {
    target: Arc<AtomicU16>,
    proxy: Proxy,
}

impl Address {
    fn of(pg: &Postgres) -> Self {
        let target = Arc::new(AtomicU16::new(pg.port));
        let proxy = Proxy::start(target.clone());
        Address { target, proxy }
    }

    fn url(&self, database: &str) -> String {
        format!(
            "postgres://postgres@127.0.0.1:{}/{database}",
            self.proxy.port
        )
    }

    /// Points the address at `pg`, dropping every connection to the old server.
    fn switch_to(&self, pg: &Postgres) {
        self.target.store(pg.port, Ordering::SeqCst);
        self.proxy.cut();
        self.proxy.restore();
    }
}

async fn client_of(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .expect("cannot connect");
    tokio::spawn(connection);
    client
}

/// Writes WAL that carries no event (a table outside the publication) and waits until outboxd confirmed
/// it: the slot's position is then well past anything another server will write in the test.
async fn write_filler_and_wait_confirmed(client: &tokio_postgres::Client) -> Lsn {
    client
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS filler (x text);
             INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, {FILLER_ROWS})"
        ))
        .await
        .unwrap();
    let end = current_wal_lsn(client).await;
    wait_confirmed_past(
        client,
        SLOT,
        end,
        "outboxd to confirm the old server's WAL past the filler",
    )
    .await
}

fn wait_for_log(outboxd: &Outboxd, text: &str) {
    wait_for(
        &format!("outboxd to log {text:?}"),
        Duration::from_secs(60),
        || outboxd.log_text().contains(text).then_some(()),
    );
}

/// Every event in the final server's table is published (published_at and in Kafka), each aggregate in
/// commit order; returns the report for its duplicates.
async fn verify_final(
    client: &tokio_postgres::Client,
    brokers: &str,
    what: &str,
    started: Instant,
) -> DeliveryReport {
    wait_all_published(client, Duration::from_secs(120)).await;
    let recovered = started.elapsed();
    let committed = events_in_table(client, "(payload->>'seq')::int8").await;
    let records = consume_all(brokers, &[TOPIC], committed.len(), Duration::from_secs(90));
    let report = check_delivery(&records, &committed, &[]);
    println!(
        "{what}: {} events in the final database, {} records; every row published {recovered:?} after the switch; {report:?}",
        committed.len(),
        records.len()
    );
    if report.missing > 0 {
        // What the database says about them: published_at without a record is a delivery reported that
        // never happened; no published_at, an event nothing sent.
        let seqs: Vec<i64> = report.missing_sample.iter().map(|(seq, _)| *seq).collect();
        for row in client
            .query(
                "SELECT event_id::text, aggregate_id, (payload->>'seq')::int8, published_at::text,
                        handoff_at::text, attempts, last_error, position
                   FROM outbox_event WHERE (payload->>'seq')::int8 = ANY($1)",
                &[&seqs],
            )
            .await
            .unwrap()
        {
            println!(
                "missing: id {} aggregate {} seq {} published_at {:?} handoff_at {:?} attempts {} last_error {:?} position {:?}",
                row.get::<_, String>(0),
                row.get::<_, String>(1),
                row.get::<_, i64>(2),
                row.get::<_, Option<String>>(3),
                row.get::<_, Option<String>>(4),
                row.get::<_, i32>(5),
                row.get::<_, Option<String>>(6),
                row.get::<_, Option<i64>>(7),
            );
        }
    }
    assert_eq!(report.missing, 0, "{what}: events missing from Kafka");
    assert_eq!(report.order_violations, 0, "{what}: per-aggregate order");
    report
}

/// Stops a standby's WAL receiver (it keeps its data and stays in recovery): it lags from now on.
async fn stop_wal_receiver(standby: &Postgres) {
    let auto_conf = standby.dir.join("data/postgresql.auto.conf");
    let mut text = std::fs::read_to_string(&auto_conf).unwrap();
    text.push_str("primary_conninfo = ''\n");
    std::fs::write(&auto_conf, text).unwrap();
    let client = standby.client().await;
    client
        .execute("SELECT pg_reload_conf()", &[])
        .await
        .unwrap();
    wait_for_async(
        "the standby's WAL receiver to stop",
        Duration::from_secs(30),
        || async {
            let receivers: i64 = client
                .query_one("SELECT count(*) FROM pg_stat_wal_receiver", &[])
                .await
                .unwrap()
                .get(0);
            (receivers == 0).then_some(())
        },
    )
    .await;
}

/// outboxd is still running and logged the history change, naming `what` changed.
fn assert_history_change_survived(outboxd: &mut Outboxd, what: &str) {
    assert!(outboxd.try_wait().is_none(), "outboxd kept running");
    let log = outboxd.log_text();
    assert!(
        log.contains("database history changed") && log.contains(what),
        "the change is logged, naming {what:?}"
    );
}

fn spawn_outboxd(url: &str, brokers: &str) -> Outboxd {
    let mut args = run_args(url, brokers);
    args.extend(["--reconnect-timeout", "120s"]);
    Outboxd::spawn(&args)
}

/// A migrated primary with a running physical standby, a broker, and one address that reaches the primary.
struct PrimaryAndStandby {
    primary: Postgres,
    standby: Postgres,
    _broker: Broker,
    brokers: String,
    address: Address,
    url: String,
}

fn primary_and_standby() -> PrimaryAndStandby {
    let primary = Postgres::start();
    migrate(&primary);
    let broker = Broker::start();
    let brokers = broker.addr();
    let standby = primary.basebackup(true);
    standby.start_again();
    let address = Address::of(&primary);
    let url = address.url("postgres");
    PrimaryAndStandby {
        primary,
        standby,
        _broker: broker,
        brokers,
        address,
        url,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn failover_to_a_lagging_standby_publishes_what_was_committed_on_it() {
    let PrimaryAndStandby {
        primary,
        standby,
        _broker,
        brokers,
        address,
        url,
    } = primary_and_standby();
    let outboxd = spawn_outboxd(&url, &brokers);
    let primary_client = primary.client().await;
    wait_slot_active(&primary_client, SLOT).await;

    let writer = Writer::start(url.clone(), 3, 20);
    writer.wait_more(100, "writes on the primary").await;
    stop_wal_receiver(&standby).await;
    writer
        .wait_more(100, "writes the standby does not receive")
        .await;
    let confirmed = write_filler_and_wait_confirmed(&primary_client).await;
    let standby_client = standby.client().await;
    let replayed: String = standby_client
        .query_one("SELECT pg_last_wal_replay_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let replayed: Lsn = replayed.parse().unwrap();
    assert!(
        confirmed.bytes_since(replayed) > 4_000_000,
        "the standby must lag behind what outboxd confirmed: confirmed {confirmed}, standby at {replayed}"
    );

    // Only the standby's rows without published_at can go out again after the switch.
    let unpublished_on_standby = unpublished(&standby_client).await;

    // The primary dies; the address reaches the standby while it is still in recovery.
    primary.stop_immediate();
    let switched = Instant::now();
    address.switch_to(&standby);
    wait_for_log(&outboxd, "the standby to be promoted");
    standby.promote();
    writer
        .wait_more(300, "writes on the promoted standby")
        .await;
    let total = writer.stop().await;
    let report = verify_final(&standby_client, &brokers, "failover", switched).await;
    println!("failover: {total} transactions committed by the application in all");
    let log = outboxd.log_text();
    assert!(
        log.contains("database history changed") && log.contains("new timeline"),
        "the change is logged"
    );
    assert!(
        report.duplicates <= unpublished_on_standby as usize,
        "duplicates are the events whose published_at the standby never received: {} duplicates, {unpublished_on_standby} rows without it on the standby",
        report.duplicates
    );
}

/// A running stack whose database was backed up (cold: a file copy, replication slot included) while the
/// application wrote, and which then went on past the backup by far more than the tests write afterwards.
struct Restore {
    pg: Postgres,
    broker: Broker,
    brokers: String,
    address: Address,
    outboxd: Outboxd,
    writer: Writer,
    backup: Postgres,
    /// What outboxd confirmed on `pg` after the backup.
    old_position: Lsn,
}

async fn stream_then_back_up() -> Restore {
    let pg = Postgres::start();
    migrate(&pg);
    let broker = Broker::start();
    let brokers = broker.addr();
    let address = Address::of(&pg);
    let url = address.url("postgres");
    let outboxd = spawn_outboxd(&url, &brokers);
    wait_slot_active(&pg.client().await, SLOT).await;
    let writer = Writer::start(url.clone(), 3, 20);
    writer.wait_more(100, "writes before the backup").await;
    pg.stop();
    let backup = pg.cold_copy();
    pg.start_again();
    writer.wait_more(100, "writes after the backup").await;
    let old_position = write_filler_and_wait_confirmed(&pg.client().await).await;
    Restore {
        pg,
        broker,
        brokers,
        address,
        outboxd,
        writer,
        backup,
        old_position,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn restore_of_an_earlier_backup_publishes_what_is_committed_after_it() {
    let Restore {
        pg,
        broker: _broker,
        brokers,
        address,
        mut outboxd,
        writer,
        backup,
        ..
    } = stream_then_back_up().await;

    // The database is restored from the backup, behind the same address: it goes back in time.
    pg.stop_immediate();
    backup.start_again();
    let switched = Instant::now();
    address.switch_to(&backup);
    writer
        .wait_more(300, "writes on the restored database")
        .await;
    writer.stop().await;
    let restored = backup.client().await;
    verify_final(&restored, &brokers, "restore", switched).await;
    assert_history_change_survived(&mut outboxd, "before the position");
}

#[tokio::test(flavor = "multi_thread")]
async fn restore_of_a_snapshot_that_writes_past_the_old_position_before_outboxd_reconnects() {
    let Restore {
        pg,
        broker: _broker,
        brokers,
        address,
        mut outboxd,
        writer,
        backup: snapshot,
        old_position,
    } = stream_then_back_up().await;
    writer.stop().await;

    // Restored from the snapshot while outboxd cannot reach it; the application, already on the restored
    // server, writes past the position outboxd confirmed on the old one before outboxd gets through.
    address.proxy.cut();
    pg.stop_immediate();
    snapshot.start_again();
    let restored = snapshot.client().await;
    let writer = Writer::start_at(snapshot.url(), 1_000_000, 3, 20);
    writer.wait_more(100, "writes on the restored server").await;
    restored
        .batch_execute(&format!(
            "CREATE TABLE IF NOT EXISTS filler (x text);
             INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, {})",
            2 * FILLER_ROWS
        ))
        .await
        .unwrap();
    let wal_end = current_wal_lsn(&restored).await;
    assert!(
        wal_end > old_position,
        "the restored server must be past the old position: {wal_end} vs {old_position}"
    );
    let switched = Instant::now();
    address.switch_to(&snapshot);
    writer.wait_more(100, "writes after outboxd is back").await;
    writer.stop().await;
    verify_final(&restored, &brokers, "restore caught up", switched).await;
    assert!(outboxd.try_wait().is_none(), "outboxd kept running");
}

#[tokio::test(flavor = "multi_thread")]
async fn switchover_to_another_cluster_waits_for_its_database_and_publishes_everything() {
    let blue = Postgres::start();
    blue.client()
        .await
        .batch_execute("CREATE DATABASE shop")
        .await
        .unwrap();
    let migrate_db = |pg: &Postgres, database: &str| {
        let output = run_outboxd(&["migrate", "--database-url", &pg.url_of_database(database)]);
        assert!(output.status.success(), "{}", stderr_of(&output));
    };
    migrate_db(&blue, "shop");
    let broker = Broker::start();
    let brokers = broker.addr();
    let address = Address::of(&blue);
    let url = address.url("shop");
    let mut outboxd = spawn_outboxd(&url, &brokers);
    let blue_client = client_of(&blue.url_of_database("shop")).await;
    wait_slot_active(&blue_client, SLOT).await;
    let writer = Writer::start(url.clone(), 3, 20);
    writer.wait_more(150, "writes on blue").await;
    write_filler_and_wait_confirmed(&blue_client).await;

    // Green is a new cluster; the address switches to it before its database exists.
    let green = Postgres::start();
    blue.stop();
    let switched = Instant::now();
    address.switch_to(&green);
    wait_for_log(&outboxd, "the database to exist");
    // The database appears whole (created and migrated under another name, then renamed).
    green
        .client()
        .await
        .batch_execute("CREATE DATABASE shop_new")
        .await
        .unwrap();
    migrate_db(&green, "shop_new");
    green
        .client()
        .await
        .batch_execute("ALTER DATABASE shop_new RENAME TO shop")
        .await
        .unwrap();
    writer.wait_more(300, "writes on green").await;
    writer.stop().await;
    let green_client = client_of(&green.url_of_database("shop")).await;
    verify_final(&green_client, &brokers, "switchover", switched).await;
    assert_history_change_survived(&mut outboxd, "another PostgreSQL cluster");
}

#[tokio::test(flavor = "multi_thread")]
async fn gives_up_after_the_reconnect_timeout_saying_what_it_waited_for() {
    let (pg, broker) = migrated_stack();
    let brokers = broker.addr();
    let address = Address::of(&pg);
    let url = address.url("postgres");
    let mut args = run_args(&url, &brokers);
    args.extend(["--reconnect-timeout", "3s"]);
    let mut outboxd = Outboxd::spawn(&args);
    wait_slot_active(&pg.client().await, SLOT).await;
    address.proxy.cut();
    let status = wait_for("outboxd to give up", Duration::from_secs(90), || {
        outboxd.try_wait()
    });
    assert!(!status.success());
    let log = outboxd.log_text();
    assert!(
        log.contains(
            "gave up after --reconnect-timeout 3s waiting for PostgreSQL to accept connections"
        ),
        "{log}"
    );
    assert!(log.contains("raise --reconnect-timeout"), "{log}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cdc_only_table_on_another_history_stops_with_what_may_be_missing() {
    const TABLE: &str = "CREATE TABLE outbox_event (
        event_id uuid PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
        event_type text NOT NULL, payload jsonb NOT NULL, created_at timestamptz NOT NULL DEFAULT now())";
    let prepare = |pg: &Postgres| {
        let url = pg.url();
        async move {
            client_of(&url).await.batch_execute(TABLE).await.unwrap();
            let output = run_outboxd(&["migrate", "--database-url", &url]);
            assert!(output.status.success(), "{}", stderr_of(&output));
        }
    };
    let blue = Postgres::start();
    prepare(&blue).await;
    let green = Postgres::start();
    prepare(&green).await;
    let broker = Broker::start();
    let address = Address::of(&blue);
    let mut outboxd = spawn_outboxd(&address.url("postgres"), &broker.addr());
    let mut client = blue.client().await;
    wait_slot_active(&client, SLOT).await;
    let (committed, _) = insert_events(&mut client, 0, 10, 2, 3, None).await;
    consume_all(
        &broker.addr(),
        &[TOPIC],
        committed.len(),
        Duration::from_secs(60),
    );

    address.switch_to(&green);
    let status = wait_for(
        "outboxd to stop on the history change",
        Duration::from_secs(60),
        || outboxd.try_wait(),
    );
    assert!(!status.success());
    let log = outboxd.log_text();
    assert!(log.contains("another history"), "{log}");
    assert!(log.contains("another PostgreSQL cluster"), "{log}");
    assert!(log.contains("has no polling columns"), "{log}");
    assert!(log.contains("since outboxd last streamed"), "{log}");
    assert!(log.contains("--add-polling-columns"), "{log}");
}

/// The leader's network goes silent (a node lost, a partition: its connections stay open and nothing
/// arrives, as through a load balancer or a dropped link): a standby streams within the takeover bound
/// README states, the old leader notices on its own that it lost the lock, and once the network is back it
/// stands by instead of leading too.
#[tokio::test(flavor = "multi_thread")]
async fn a_standby_takes_over_from_a_leader_whose_network_went_silent() {
    let pg = Postgres::start();
    migrate(&pg);
    let broker = Broker::start();
    let brokers = broker.addr();
    let address = Address::of(&pg);
    let leader = spawn_outboxd(&address.url("postgres"), &brokers);
    let mut client = pg.client().await;
    wait_slot_active(&client, SLOT).await;
    let standby = spawn_outboxd(&pg.url(), &brokers);
    wait_for(
        "the second instance to stand by",
        Duration::from_secs(30),
        || standby.log_text().contains("standing by").then_some(()),
    );
    let (mut committed, _) = insert_events(&mut client, 0, 20, 5, 10, None).await;
    wait_all_published(&client, Duration::from_secs(60)).await;
    let old_walsender = slot_walsender(&client, SLOT)
        .await
        .expect("the leader streams");

    address.proxy.stall();
    let silent = Instant::now();
    let bound = outboxd::pipeline::leader::TAKEOVER_BOUND;
    wait_for_async(
        &format!("a standby to stream within the takeover bound ({bound:?})"),
        bound,
        || async {
            slot_walsender(&client, SLOT)
                .await
                .filter(|pid| *pid != old_walsender)
        },
    )
    .await;
    println!(
        "standby streaming {:?} after the leader's network went silent",
        silent.elapsed()
    );
    assert!(
        standby.log_text().contains("took over"),
        "the standby leads"
    );
    assert!(
        leader.log_text().contains("lost the leadership lock"),
        "the silent leader noticed by itself that it no longer leads"
    );
    let (more, _) = insert_events(&mut client, 20, 20, 5, 10, None).await;
    committed.extend(more);
    wait_all_published(&client, Duration::from_secs(60)).await;

    address.proxy.resume();
    wait_for(
        "the old leader to stand by once its network is back",
        Duration::from_secs(60),
        || {
            leader
                .log_text()
                .contains("another outboxd instance is active")
                .then_some(())
        },
    );
    let walsenders: i64 = client
        .query_one("SELECT count(*) FROM pg_stat_replication", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(walsenders, 1, "exactly one instance streams");
    verify_delivery(
        &brokers,
        &committed,
        &[],
        60,
        "leader's network went silent",
    );
}

/// A server that kills idle sessions (`idle_session_timeout`) does not kill the leadership session (which
/// idles between health queries): the same session keeps the lock, with no flapping.
#[tokio::test(flavor = "multi_thread")]
async fn idle_session_kills_leave_the_leadership_session_alone() {
    let (pg, broker) = migrated_stack();
    let client = pg.client().await;
    for statement in [
        "ALTER SYSTEM SET idle_session_timeout = '500ms'",
        "SELECT pg_reload_conf()",
    ] {
        client.batch_execute(statement).await.unwrap();
    }
    let client = pg.client().await; // the first one is killed while idle from now on
    let _outboxd = spawn_outboxd(&pg.url(), &broker.addr());
    wait_for_async(
        "one leadership session to keep the lock for 20 idle-session timeouts",
        Duration::from_secs(60),
        || async {
            let alive: Option<f64> = client
                .query_opt(
                    "SELECT extract(epoch FROM now() - backend_start)::float8 FROM pg_stat_activity
                     WHERE application_name = 'outboxd active outboxd'",
                    &[],
                )
                .await
                .ok()
                .flatten()
                .map(|row| row.get(0));
            alive.filter(|secs| *secs > 10.0)
        },
    )
    .await;
}

/// A standby whose role may not see the leader's session state (another role, no `pg_read_all_stats`: in
/// `pg_stat_activity` the state is NULL) cannot tell a silent leader from a live one, so it cannot fence: it
/// says so, as README promises, instead of falling back to TCP keepalives without a word.
#[tokio::test(flavor = "multi_thread")]
async fn a_standby_that_may_not_see_the_leaders_session_says_it_cannot_fence() {
    let (pg, broker) = migrated_stack();
    let brokers = broker.addr();
    let url = readme_role(&pg, "fence-secret", "outbox_event", "").await;
    let _leader = spawn_outboxd(&pg.url(), &brokers);
    let client = pg.client().await;
    wait_slot_active(&client, SLOT).await;
    let standby = spawn_outboxd(&url, &brokers);
    wait_for_log(&standby, "standing by");
    wait_for_log(&standby, "cannot end a silent leader's session");
    assert!(
        standby.log_text().contains("pg_read_all_stats"),
        "the warning names the grant"
    );
}

/// The major of the server `client` is connected to.
async fn server_major(client: &tokio_postgres::Client) -> i32 {
    let number: String = client
        .query_one("SHOW server_version_num", &[])
        .await
        .unwrap()
        .get(0);
    number.parse::<i32>().unwrap() / 10_000
}

/// The slot's `failover` flag (PostgreSQL 17+).
async fn slot_failover(client: &tokio_postgres::Client) -> bool {
    client
        .query_one(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = $1",
            &[&SLOT],
        )
        .await
        .unwrap()
        .get(0)
}

/// On 17 and later outboxd creates its slot as a failover slot, and turns failover on for an existing slot
/// made without it; `--no-failover-slot` keeps (and makes) it a plain one. Before 17 the slot is created
/// with the syntax the server knows (14 has only the legacy one).
#[tokio::test(flavor = "multi_thread")]
async fn the_slot_is_a_failover_slot_from_17_on_unless_opted_out() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    let major = server_major(&client).await;
    create_slot_then_stop(&url, &brokers, &client).await;
    assert_eq!(slot_count(&client, SLOT).await, 1, "the slot was created");
    if major < 17 {
        println!(
            "PostgreSQL {major}: no failover slots; the slot was created with this major's syntax"
        );
        return;
    }
    assert!(slot_failover(&client).await, "created as a failover slot");

    let mut args = run_args(&url, &brokers);
    args.push("--no-failover-slot");
    let mut opted_out = Outboxd::spawn(&args);
    wait_for_log(
        &opted_out,
        "changed the replication slot's failover setting",
    );
    wait_slot_active(&client, SLOT).await;
    opted_out.kill();
    assert!(
        !slot_failover(&client).await,
        "--no-failover-slot turned it off"
    );

    let mut again = Outboxd::spawn(&run_args(&url, &brokers));
    wait_slot_active(&client, SLOT).await;
    wait_for_log(&again, "changed the replication slot's failover setting");
    again.kill();
    assert!(slot_failover(&client).await, "failover turned on again");
}

/// `status --json` against `url`, with `standby` as its `--standby-url`.
fn status_json(url: &str, standby: &str) -> (i32, serde_json::Value) {
    let output = run_outboxd(&[
        "status",
        "--json",
        "--database-url",
        url,
        "--standby-url",
        standby,
    ]);
    let json = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "status --json printed no JSON ({e}): {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output.status.code().unwrap_or(-1), json)
}

/// A primary with a physical standby, outboxd streaming under load through one address, the primary killed
/// and the standby promoted behind the same address. On 17 and later the standby keeps a synchronised copy
/// of the failover slot (`sync_replication_slots`, `synchronized_standby_slots`) and outboxd carries on from
/// it: no history change, no hand-off, duplicates within the in-flight window. Before 17 the promotion is a
/// history change: a new slot, and the gap swept through the polling path. Both: 0 lost, order kept. Prints
/// the figures README reports.
#[tokio::test(flavor = "multi_thread")]
async fn a_promoted_standby_continues_from_the_failover_slot_synchronised_to_it() {
    promotion(true).await;
}

/// The same promotion on 17 and later with a standby that holds no copy of the slot (`sync_replication_slots`
/// off: as a standby promoted before its copy was persisted, which PostgreSQL drops at promotion): the
/// history-change path covers it, a new slot and the gap swept through the polling path, 0 lost.
#[tokio::test(flavor = "multi_thread")]
async fn a_promoted_standby_without_a_copy_of_the_slot_hands_the_gap_off() {
    promotion(false).await;
}

/// Makes a (stopped) standby keep synchronised copies of failover slots (17+).
fn keep_synced_copies(standby: &Postgres) {
    let conf = standby.dir.join("data/postgresql.conf");
    let mut text = std::fs::read_to_string(&conf).unwrap();
    text.push_str("sync_replication_slots = on\nhot_standby_feedback = on\n");
    std::fs::write(&conf, text).unwrap();
}

/// The standby's physical slot (the primary's only one).
async fn physical_slot(primary_client: &tokio_postgres::Client) -> String {
    primary_client
        .query_one(
            "SELECT slot_name::text FROM pg_replication_slots WHERE slot_type = 'physical'",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// Names the standby's physical slot (the primary's only one) in `synchronized_standby_slots`; returns it.
async fn protect_with_the_standby_slot(primary_client: &tokio_postgres::Client) -> String {
    let physical = physical_slot(primary_client).await;
    for statement in [
        format!("ALTER SYSTEM SET synchronized_standby_slots = '{physical}'"),
        "SELECT pg_reload_conf()".to_string(),
    ] {
        primary_client.batch_execute(&statement).await.unwrap();
    }
    physical
}

async fn wait_synced_copy(standby_client: &tokio_postgres::Client) {
    wait_for_async(
        "the standby to hold a synchronised, persistent copy of the slot",
        Duration::from_secs(120),
        || async {
            standby_client
                .query_opt(
                    "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND synced
                       AND NOT temporary AND invalidation_reason IS NULL",
                    &[&SLOT],
                )
                .await
                .unwrap()
                .map(|_| ())
        },
    )
    .await;
}

/// The promotion of both tests above; `synced_copy`: the standby keeps a copy of the failover slot (17+).
async fn promotion(synced_copy: bool) {
    const WINDOW: usize = 100;
    let primary = Postgres::start();
    migrate(&primary);
    let broker = Broker::start();
    let brokers = broker.addr();
    let primary_client = primary.client().await;
    let major = server_major(&primary_client).await;
    if major < 17 && !synced_copy {
        println!("PostgreSQL {major}: no failover slots, every promotion is the history-change path (the other test)");
        return;
    }
    let with_copy = synced_copy && major >= 17;
    let standby = primary.basebackup(true);
    if with_copy {
        keep_synced_copies(&standby);
    }
    standby.start_again();
    let standby_client = standby.client().await;
    let address = Address::of(&primary);
    let url = address.url("postgres");
    let window = WINDOW.to_string();
    let mut args = run_args(&url, &brokers);
    args.extend([
        "--reconnect-timeout",
        "120s",
        "--max-in-flight-events",
        &window,
    ]);
    let mut outboxd = Outboxd::spawn(&args);
    wait_slot_active(&primary_client, SLOT).await;
    let writer = Writer::start(url.clone(), 3, 20);
    writer.wait_more(200, "writes on the primary").await;

    if with_copy {
        let (code, status) = status_json(&url, &standby.url());
        assert_eq!(
            code, 1,
            "an unprotected failover slot is a warning: {status}"
        );
        assert!(
            status["verdict"]["reason"]
                .as_str()
                .unwrap_or_default()
                .contains("synchronized_standby_slots is empty"),
            "{status}"
        );
        protect_with_the_standby_slot(&primary_client).await;
        wait_synced_copy(&standby_client).await;
        let (code, status) = status_json(&url, &standby.url());
        assert_eq!(
            code, 0,
            "a protected, synced failover slot is healthy: {status}"
        );
        assert_eq!(
            status["failover"]["standbys"][0]["synced"], true,
            "{status}"
        );
    }
    writer.wait_more(300, "writes while the copy follows").await;

    // The primary dies under load; the address reaches the standby, which is promoted.
    primary.stop_immediate();
    let switched = Instant::now();
    address.switch_to(&standby);
    standby.promote();
    let published_at_promotion: i64 = standby_client
        .query_one(
            "SELECT count(*) FROM outbox_event WHERE published_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    wait_for_async(
        "the first event published after the promotion",
        Duration::from_secs(120),
        || async {
            let published: i64 = standby_client
                .query_one(
                    "SELECT count(*) FROM outbox_event WHERE published_at IS NOT NULL",
                    &[],
                )
                .await
                .ok()?
                .get(0);
            (published > published_at_promotion).then_some(())
        },
    )
    .await;
    let first_published = switched.elapsed();
    writer
        .wait_more(300, "writes on the promoted standby")
        .await;
    let total = writer.stop().await;
    let report = verify_final(&standby_client, &brokers, "promotion", switched).await;
    println!(
        "promotion on PostgreSQL {major} (synchronised copy of the slot: {with_copy}): {total} transactions; first event published {first_published:?} after the primary died; {} duplicates",
        report.duplicates
    );
    let log = outboxd.log_text();
    if with_copy {
        assert!(
            log.contains("continuing from the failover slot synchronised to it"),
            "the synced slot was used"
        );
        assert!(
            !log.contains("database history changed"),
            "no history change"
        );
        assert_eq!(
            log.matches("created replication slot").count(),
            1,
            "no new slot after the promotion"
        );
        assert!(
            report.duplicates <= WINDOW,
            "duplicates within one in-flight window: {}",
            report.duplicates
        );
        // A process started on the promoted standby afterwards (a restart) finds outboxd's mark of the new
        // timeline, so it keeps the slot it continued from.
        outboxd.kill();
        let restarted = Outboxd::spawn(&args);
        let mut standby_client = standby.client().await;
        wait_slot_active(&standby_client, SLOT).await;
        insert_events(&mut standby_client, 1_000_000, 5, 2, 2, None).await;
        wait_all_published(&standby_client, Duration::from_secs(60)).await;
        let log = restarted.log_text();
        assert!(
            !log.contains("created replication slot")
                && !log.contains("dropping the replication slot"),
            "the restarted process kept the slot"
        );
    } else {
        assert!(
            log.contains("database history changed") && log.contains("new timeline"),
            "without a copy of the slot a promotion is a history change"
        );
        assert_eq!(
            log.matches("created replication slot").count(),
            2,
            "a new slot after the promotion"
        );
    }
}

/// A primary (17+) whose physical standby keeps a synchronised copy of the failover slot (protected by
/// `synchronized_standby_slots`, or left out of it), with a gate on the primary: a trigger holds every
/// hand-off (an UPDATE that sets `handoff_at`) while a session holds the gate's advisory lock (no
/// transaction: a slot being created waits for every running one). `None` before 17.
struct ProtectedStandby {
    primary: Postgres,
    standby: Postgres,
    primary_client: tokio_postgres::Client,
    standby_client: tokio_postgres::Client,
    /// The standby's physical slot on the primary.
    physical: String,
    broker: Broker,
}

async fn standby_with_hand_off_gate(protected: bool) -> Option<ProtectedStandby> {
    let primary = Postgres::start();
    migrate(&primary);
    let primary_client = primary.client().await;
    let major = server_major(&primary_client).await;
    if major < 17 {
        println!("PostgreSQL {major}: no failover slots");
        return None;
    }
    let broker = Broker::start();
    let standby = primary.basebackup(true);
    keep_synced_copies(&standby);
    standby.start_again();
    let standby_client = standby.client().await;
    let physical = if protected {
        protect_with_the_standby_slot(&primary_client).await
    } else {
        physical_slot(&primary_client).await
    };
    primary_client
        .batch_execute(
            "CREATE FUNCTION hold_hand_off() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN PERFORM pg_advisory_xact_lock_shared(1919, 2929); RETURN NEW; END $$;
             CREATE TRIGGER hold_hand_off BEFORE UPDATE ON outbox_event FOR EACH ROW
               WHEN (OLD.handoff_at IS NULL AND NEW.handoff_at IS NOT NULL) EXECUTE FUNCTION hold_hand_off();",
        )
        .await
        .unwrap();
    Some(ProtectedStandby {
        primary,
        standby,
        primary_client,
        standby_client,
        physical,
        broker,
    })
}

/// Inserts `n` events of aggregate `Order` `aggregate_id`, type `event_type`, in one transaction; their ids.
async fn insert_orders(
    client: &tokio_postgres::Client,
    aggregate_id: &str,
    event_type: &str,
    n: i32,
) -> Vec<uuid::Uuid> {
    client
        .query(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'Order', $1, $2, '{}' FROM generate_series(1, $3)
             RETURNING event_id",
            &[&aggregate_id, &event_type, &n],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

impl ProtectedStandby {
    /// outboxd through `address`, with a window of 8: one event of a blocked aggregate parks (an eighth of
    /// it), the next hands them off.
    fn spawn_outboxd(&self, address: &Address) -> Outboxd {
        let (url, brokers) = (address.url("postgres"), self.broker.addr());
        let mut args = run_args(&url, &brokers);
        args.extend(["--reconnect-timeout", "120s", "--max-in-flight-events", "8"]);
        Outboxd::spawn(&args)
    }

    /// An event of aggregate `held` waits in the polling path (a retry an hour away): the CDC path hands the
    /// aggregate's next events off.
    async fn hold_in_polling_path(&self) {
        self.primary_client
            .batch_execute(
                "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, handoff_at, available_at)
                 VALUES (gen_random_uuid(), 'Order', 'held', 'Waiting', '{}', now(), now() + interval '1 hour')",
            )
            .await
            .unwrap();
    }

    /// Two events of aggregate `held` (see [`ProtectedStandby::hold_in_polling_path`]) whose hand-off waits
    /// at the closed gate until their transaction is on the standby, whose walsender is then stopped: the
    /// standby will lack the hand-off. Returns the gate's session (open it to let the hand-off commit), the
    /// events and a position past their transaction.
    async fn hand_off_the_standby_lacks(&self) -> (tokio_postgres::Client, Vec<uuid::Uuid>, Lsn) {
        let gate = self.close_gate().await;
        let events = insert_orders(&self.primary_client, "held", "Next", 2).await;
        let committed = current_wal_lsn(&self.primary_client).await;
        self.wait_hand_off_at_gate().await;
        self.wait_standby_flushed(committed, "the events' transaction")
            .await;
        self.stop_standby_walsender().await;
        (gate, events, committed)
    }

    /// Closes the gate: hand-offs wait until the returned session opens it (or ends).
    async fn close_gate(&self) -> tokio_postgres::Client {
        let gate = self.primary.client().await;
        gate.batch_execute("SELECT pg_advisory_lock(1919, 2929)")
            .await
            .unwrap();
        gate
    }

    async fn wait_hand_off_at_gate(&self) {
        wait_hand_off_waiting_on_a_lock(
            &self.primary_client,
            "outboxd's hand-off to wait at the gate",
            Duration::from_secs(60),
        )
        .await;
    }

    /// Waits until every one of `events` is handed off or published on the (promoted) standby: owed to
    /// the polling path, or delivered.
    async fn wait_owed_on_the_promoted_standby(&self, events: &[uuid::Uuid], what: &str) {
        wait_for_async(
            &format!("{what} on the promoted standby"),
            Duration::from_secs(120),
            || async {
                let owed: i64 = self
                    .standby_client
                    .query_one(
                        "SELECT count(*) FROM outbox_event WHERE event_id = ANY($1)
                           AND (handoff_at IS NOT NULL OR published_at IS NOT NULL)",
                        &[&events],
                    )
                    .await
                    .ok()?
                    .get(0);
                (owed == events.len() as i64).then_some(())
            },
        )
        .await;
    }

    /// Waits until the standby has flushed the WAL up to `position` (`what` ends there).
    async fn wait_standby_flushed(&self, position: Lsn, what: &str) {
        wait_for_async(
            &format!("the standby to flush {what}"),
            Duration::from_secs(60),
            || async {
                let flushed: bool = self
                    .standby_client
                    .query_one(
                        "SELECT pg_last_wal_receive_lsn() >= $1::text::pg_lsn",
                        &[&position.to_string()],
                    )
                    .await
                    .unwrap()
                    .get(0);
                flushed.then_some(())
            },
        )
        .await;
    }

    /// The standby receives no more WAL from here on: its walsender on the primary is stopped (the slot
    /// sync worker's connection is another one, and goes on).
    async fn stop_standby_walsender(&self) {
        let walsender: i32 = self
            .primary_client
            .query_one(
                "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1",
                &[&self.physical],
            )
            .await
            .unwrap()
            .get(0);
        stop_process(walsender, "-STOP");
    }

    /// The primary dies (a stopped walsender with it) and the standby is promoted behind `address`.
    fn fail_over(&self, address: &Address) {
        self.primary.stop_immediate();
        address.switch_to(&self.standby);
        self.standby.promote();
    }
}

/// A hand-off is the only record that its event is still owed (the sweeper next to CDC takes handed-off rows
/// only), so no standby's copy of the failover slot may move past the event before that standby holds the
/// hand-off (17+). Staged: an earlier event of aggregate `held` waits in the polling path (a retry an hour
/// away), so the CDC path hands the next ones off; that hand-off waits at the gate until the events'
/// transaction is on the standby, whose walsender is then stopped, and the gate opened; the primary dies and
/// the standby is promoted behind the address. Before the fix outboxd confirmed the events once the hand-off
/// committed on the primary, the copy followed, and on the promoted standby the rows had neither
/// `handoff_at` nor `published_at`: nothing ever published them. Now outboxd confirms nothing between the
/// events and their hand-off's end, the copy stays behind them, and they are handed off again.
#[tokio::test(flavor = "multi_thread")]
async fn a_hand_off_the_standby_lacks_keeps_the_copy_of_the_slot_behind_its_event() {
    let Some(pair) = standby_with_hand_off_gate(true).await else {
        return;
    };
    let (primary_client, standby_client) = (&pair.primary_client, &pair.standby_client);
    pair.hold_in_polling_path().await;
    let address = Address::of(&pair.primary);
    let mut outboxd = pair.spawn_outboxd(&address);
    wait_slot_active(primary_client, SLOT).await;
    wait_synced_copy(standby_client).await;

    let (gate, events, committed) = pair.hand_off_the_standby_lacks().await;
    const HOLDING: &str =
        "hand-offs written: confirming nothing before the stream passes their end";
    let holds_before = outboxd.log_text().matches(HOLDING).count();
    gate.batch_execute("SELECT pg_advisory_unlock(1919, 2929)")
        .await
        .unwrap();
    wait_for_async(
        "the copy of the slot to pass the events, or outboxd to hold its confirmations behind their hand-off",
        Duration::from_secs(120),
        || async {
            let copy = confirmed_flush(standby_client, SLOT).await;
            (copy >= committed || outboxd.log_text().matches(HOLDING).count() > holds_before)
                .then_some(())
        },
    )
    .await;
    println!(
        "before the promotion: the copy of the slot at {}, the events' transaction committed by {committed}",
        confirmed_flush(standby_client, SLOT).await
    );

    pair.fail_over(&address);
    pair.wait_owed_on_the_promoted_standby(&events, "the events handed to the polling path")
        .await;
    assert!(
        outboxd
            .log_text()
            .contains("continuing from the failover slot synchronised to it"),
        "the synced copy was used"
    );
    outboxd.kill();
}

/// A new slot hands the unpublished rows older than it to the polling path in a write committed after its
/// consistent point; a standby's copy of the slot resting in between, on a standby that lacks the hand-off,
/// would be promoted with those rows owed to nobody (17+). Staged: the hand-off waits at the gate while an
/// event E commits and reaches the standby, whose walsender is then stopped; the gate opens and the
/// hand-off commits on the primary only. Before the fix the slot was a failover slot from its creation,
/// resting at its consistent point. Now it is a plain slot until confirmed past the hand-off (which a copy
/// cannot follow on a standby without it); on the promoted standby, without a copy, outboxd hands the older
/// rows off again.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_slot_fails_over_only_once_confirmed_past_the_hand_off_of_the_rows_older_than_it() {
    let Some(pair) = standby_with_hand_off_gate(true).await else {
        return;
    };
    let primary_client = &pair.primary_client;
    let older = insert_orders(primary_client, "older", "Placed", 3).await;
    let gate = pair.close_gate().await;
    let address = Address::of(&pair.primary);
    let outboxd = pair.spawn_outboxd(&address);
    pair.wait_hand_off_at_gate().await;
    primary_client
        .batch_execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             VALUES (gen_random_uuid(), 'Order', 'e', 'Placed', '{}')",
        )
        .await
        .unwrap();
    let e_committed = current_wal_lsn(primary_client).await;
    pair.wait_standby_flushed(e_committed, "E").await;
    pair.stop_standby_walsender().await;
    gate.batch_execute("SELECT pg_advisory_unlock(1919, 2929)")
        .await
        .unwrap();
    wait_for_async(
        "the hand-off of the older rows to commit on the primary",
        Duration::from_secs(60),
        || async {
            let handed_off: i64 = primary_client
                .query_one(
                    "SELECT count(*) FROM outbox_event WHERE event_id = ANY($1) AND handoff_at IS NOT NULL",
                    &[&older],
                )
                .await
                .unwrap()
                .get(0);
            (handed_off == 3).then_some(())
        },
    )
    .await;
    let hand_off_end = current_wal_lsn(primary_client).await;
    wait_for_async(
        "a failover slot confirmed past the hand-off",
        Duration::from_secs(120),
        || async {
            let failover: bool = primary_client
                .query_one(
                    "SELECT failover FROM pg_replication_slots WHERE slot_name = $1",
                    &[&SLOT],
                )
                .await
                .unwrap()
                .get(0);
            (failover && confirmed_flush(primary_client, SLOT).await >= hand_off_end).then_some(())
        },
    )
    .await;
    let log = outboxd.log_text();
    assert!(
        log.contains("failover=false failover_once_confirmed_past=Some("),
        "created as a plain slot"
    );
    assert!(
        log.contains("reconnecting to make it a failover slot"),
        "the session that confirmed past the hand-off ended for it"
    );

    pair.fail_over(&address);
    pair.wait_owed_on_the_promoted_standby(
        &older,
        "the rows older than the slot handed off (or published)",
    )
    .await;
    drop(outboxd);
}

/// A server on a new timeline whose copy of the slot moved on the old timeline past where the new one began.
/// A synchronised copy (17+) can be ahead of the WAL its standby replayed (PostgreSQL copies a position
/// straight when a serialized snapshot exists at its restart_lsn, checking only the WAL the standby
/// flushed), so a standby promoted at a recovery target, or a restored copy of one, starts a timeline behind
/// its slot; streaming from the slot would skip the new timeline's transactions in between. Stood in for here
/// on any major: an earlier copy of the cluster, recovered to `target` on a new timeline, with the slot as
/// the old server last saved it (past `target`). outboxd compares the slot with the timeline history, drops
/// it, and a new slot hands the unpublished rows to the polling path: 0 lost, order kept.
#[tokio::test(flavor = "multi_thread")]
async fn a_slot_past_where_the_new_timeline_began_is_replaced() {
    let pg = Postgres::start();
    migrate(&pg);
    let broker = Broker::start();
    let brokers = broker.addr();
    let client = pg.client().await;
    // The old server keeps its WAL: the copy recovers from it.
    for statement in [
        "ALTER SYSTEM SET wal_keep_size = '1GB'",
        "SELECT pg_reload_conf()",
    ] {
        client.batch_execute(statement).await.unwrap();
    }
    let address = Address::of(&pg);
    let url = address.url("postgres");
    let mut outboxd = spawn_outboxd(&url, &brokers);
    wait_slot_active(&client, SLOT).await;
    let writer = Writer::start(url.clone(), 3, 20);
    writer.wait_more(100, "writes before the copy").await;
    pg.stop();
    let copy = pg.cold_copy();
    pg.start_again();
    let client = pg.client().await;
    writer.wait_more(100, "writes after the copy").await;
    let target = current_wal_lsn(&client).await;
    writer.wait_more(100, "writes past the target").await;
    write_filler_and_wait_confirmed(&client).await;
    // PostgreSQL saves a logical slot when its restart_lsn moves (a checkpoint's running-xacts record lets it
    // move once outboxd confirmed past it); from 17 on a clean stop saves it as well.
    wait_for_async(
        "the slot to be saved past the target",
        Duration::from_secs(60),
        || async {
            client.batch_execute("CHECKPOINT").await.unwrap();
            let restart: String = client
                .query_one(
                    "SELECT restart_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
                    &[&SLOT],
                )
                .await
                .unwrap()
                .get(0);
            (restart.parse::<Lsn>().unwrap() > target).then_some(())
        },
    )
    .await;
    pg.stop();
    let slot_state = std::path::Path::new("data/pg_replslot")
        .join(SLOT)
        .join("state");
    std::fs::copy(pg.dir.join(&slot_state), copy.dir.join(&slot_state)).unwrap();
    let conf = copy.dir.join("data/postgresql.conf");
    let mut text = std::fs::read_to_string(&conf).unwrap();
    text.push_str(&format!(
        "restore_command = 'cp {}/%f \"%p\"'\nrecovery_target_lsn = '{target}'\nrecovery_target_action = 'promote'\n",
        pg.dir.join("data/pg_wal").display()
    ));
    std::fs::write(&conf, text).unwrap();
    std::fs::write(copy.dir.join("data/recovery.signal"), "").unwrap();
    let _ = std::process::Command::new("chown")
        .args(["-R", "postgres:"])
        .arg(&copy.dir)
        .status();
    copy.start_again();
    let copy_client = copy.client().await;
    wait_for_async(
        "the copy to end recovery at the target on a new timeline",
        Duration::from_secs(60),
        || async {
            let recovering: bool = copy_client
                .query_one("SELECT pg_is_in_recovery()", &[])
                .await
                .ok()?
                .get(0);
            (!recovering).then_some(())
        },
    )
    .await;
    let copy_slot: String = copy_client
        .query_one(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&SLOT],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        copy_slot.parse::<Lsn>().unwrap() > target,
        "the copy's slot ({copy_slot}) lies past the target {target}"
    );
    let switched = Instant::now();
    address.switch_to(&copy);
    writer.wait_more(300, "writes on the new timeline").await;
    let total = writer.stop().await;
    let report = verify_final(&copy_client, &brokers, "slot past the fork", switched).await;
    println!(
        "a new timeline from {target} with the slot at {copy_slot}: {total} transactions; {} duplicates",
        report.duplicates
    );
    let log = outboxd.log_text();
    assert!(
        log.contains("dropping the replication slot so a new slot hands"),
        "the slot was found past the new timeline's start"
    );
    assert_eq!(
        log.matches("created replication slot").count(),
        2,
        "a new slot on the new timeline"
    );
    assert_history_change_survived(&mut outboxd, "new timeline");
}

/// A process that streamed on a promoted standby's timeline reaches the old primary again (not fenced yet,
/// on the older timeline): that server does not descend from the timeline the slot moved on, and what it
/// holds past the fork is bound to be rewound. outboxd waits for the server of the slot's history, streams
/// nothing from the old primary, and carries on when the address reaches the promoted server again. The old
/// primary is on timeline 2 (itself a promoted copy), where outboxd marked streaming: before the mark was
/// judged after the timelines, outboxd took the mark for the slot's history and streamed from the old
/// primary.
#[tokio::test(flavor = "multi_thread")]
async fn an_old_primary_on_an_older_timeline_is_waited_out() {
    let origin = Postgres::start();
    migrate(&origin);
    let primary = origin.basebackup(true);
    primary.start_again();
    primary.promote();
    origin.stop();
    let _broker = Broker::start();
    let brokers = _broker.addr();
    let standby = primary.basebackup(true);
    standby.start_again();
    let address = Address::of(&primary);
    let url = address.url("postgres");
    let mut outboxd = spawn_outboxd(&url, &brokers);
    let mut primary_client = primary.client().await;
    wait_slot_active(&primary_client, SLOT).await;
    insert_events(&mut primary_client, 0, 5, 2, 2, None).await;
    wait_all_published(&primary_client, Duration::from_secs(60)).await;
    let primary_wal = current_wal_lsn(&primary_client).await;
    let mut standby_client = standby.client().await;
    wait_for_async(
        "the standby to replay the primary's WAL",
        Duration::from_secs(60),
        || async {
            let replayed: String = standby_client
                .query_one("SELECT pg_last_wal_replay_lsn()::text", &[])
                .await
                .unwrap()
                .get(0);
            (replayed.parse::<Lsn>().unwrap() >= primary_wal).then_some(())
        },
    )
    .await;
    // The standby is promoted while the primary keeps running; the address moves to the standby.
    standby.promote();
    address.switch_to(&standby);
    wait_slot_active(&standby_client, SLOT).await;
    insert_events(&mut standby_client, 5, 5, 2, 2, None).await;
    wait_all_published(&standby_client, Duration::from_secs(60)).await;

    // The address reaches the old primary again.
    address.switch_to(&primary);
    wait_for_log(&outboxd, "which does not descend from timeline 3");
    insert_events(&mut primary_client, 10, 2, 2, 2, None).await;
    let active: bool = primary_client
        .query_one(
            "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
            &[&SLOT],
        )
        .await
        .unwrap()
        .get(0);
    assert!(!active, "nothing streams from the old primary's slot");
    assert!(outboxd.try_wait().is_none(), "outboxd waits");

    address.switch_to(&standby);
    insert_events(&mut standby_client, 20, 5, 2, 2, None).await;
    wait_all_published(&standby_client, Duration::from_secs(60)).await;
    let committed = events_in_table(&standby_client, "(payload->>'seq')::int8").await;
    let records = consume_all(&brokers, &[TOPIC], committed.len(), Duration::from_secs(60));
    let report = check_delivery(&records, &committed, &[]);
    assert_eq!(report.missing, 0, "{report:?}");
    assert_eq!(report.order_violations, 0, "{report:?}");
    assert_eq!(
        unpublished(&primary_client).await,
        4,
        "the old primary's writes after the promotion were not published"
    );
}

/// A multi-host URL as Patroni and managed services hand out (`host=a,b`, `target_session_attrs=read-write`):
/// the replication connection, as libpq, goes on to the next host when one answers with a read-only session
/// (a standby), so outboxd streams from the primary whatever the order of the hosts.
#[tokio::test(flavor = "multi_thread")]
async fn a_multi_host_url_streams_from_the_read_write_host() {
    let (primary, broker) = migrated_stack();
    let brokers = broker.addr();
    let standby = primary.basebackup(true);
    standby.start_again();
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/postgres?target_session_attrs=read-write",
        standby.port, primary.port
    );
    let outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    let mut client = primary.client().await;
    wait_slot_active(&client, SLOT).await;
    let (committed, _) = insert_events(&mut client, 0, 5, 2, 2, None).await;
    wait_all_published(&client, Duration::from_secs(60)).await;
    let records = consume_all(&brokers, &[TOPIC], committed.len(), Duration::from_secs(60));
    let report = check_delivery(&records, &committed, &[]);
    assert_eq!(report.missing, 0, "{report:?}");
    assert!(!outboxd.log_text().contains("decoding on a standby"));
}

/// During a switchover the old primary can still answer while its standby is promoted: `--database-url` and
/// `--replication-url` then reach two writable servers of one cluster (one system identifier). outboxd reads
/// the slot over SQL and streams over replication, so it waits until both reach one server, saying so, and
/// streams from neither meanwhile; once they do, it streams.
#[tokio::test(flavor = "multi_thread")]
async fn connections_that_reach_two_servers_of_one_cluster_wait_for_one() {
    let (primary, broker) = migrated_stack();
    let brokers = broker.addr();
    let promoted = primary.basebackup(true);
    promoted.start_again();
    promoted.promote();
    let replication = Address::of(&promoted);
    let primary_url = primary.url();
    let mut args = run_args(&primary_url, &brokers);
    let replication_url = replication.url("postgres");
    args.extend([
        "--replication-url",
        &replication_url,
        "--reconnect-timeout",
        "120s",
    ]);
    let outboxd = Outboxd::spawn(&args);
    wait_for_log(&outboxd, "reached two servers");
    assert!(
        outboxd
            .log_text()
            .contains("both connections to reach one server"),
        "says what it waits for"
    );
    let slots: i64 = promoted
        .client()
        .await
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'logical'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        slots, 0,
        "no slot on the server the SQL connection does not reach"
    );
    // The switchover completes: both reach the primary.
    replication.switch_to(&primary);
    let client = primary.client().await;
    wait_slot_active(&client, SLOT).await;
    let (committed, _) = insert_events(&mut primary.client().await, 0, 5, 2, 2, None).await;
    wait_all_published(&client, Duration::from_secs(60)).await;
    assert_eq!(committed.len(), 10);
}

/// `--replication-url` at a physical standby while `--database-url` reaches the primary (decoding on a
/// standby, PostgreSQL 16+): refused at start-up and by doctor, naming the topology, why, and the fix (README
/// "Decoding on a standby"), instead of a slot on the standby that the primary's hand-off and figures cannot see.
#[tokio::test(flavor = "multi_thread")]
async fn decoding_on_a_standby_is_refused_with_the_reason() {
    let (primary, broker) = migrated_stack();
    let brokers = broker.addr();
    let standby = primary.basebackup(true);
    standby.start_again();
    let primary_url = primary.url();
    let mut args = run_args(&primary_url, &brokers);
    let standby_url = standby.url();
    args.extend(["--replication-url", &standby_url, "--mode", "cdc"]);
    let mut outboxd = Outboxd::spawn(&args);
    let exit = wait_for("run to refuse", Duration::from_secs(60), || {
        outboxd.try_wait()
    });
    assert!(!exit.success());
    let log = outboxd.log_text();
    assert!(
        log.contains("decoding on a standby")
            && log.contains("point --replication-url at the primary"),
        "{log}"
    );
    let slots: i64 = standby
        .client()
        .await
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'logical'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(slots, 0, "no slot was made on the standby");
    let doctor = run_outboxd(&[
        "doctor",
        "--json",
        "--database-url",
        &primary_url,
        "--replication-url",
        &standby_url,
        "--brokers",
        &brokers,
        "--mode",
        "cdc",
    ]);
    let report = String::from_utf8_lossy(&doctor.stdout);
    assert_eq!(doctor.status.code(), Some(2), "{report}");
    assert!(report.contains("decoding on a standby"), "{report}");
}

/// Finding B of the review of the hold: a process killed after its hand-off committed, before it confirmed
/// past it, leaves the next one to meet the events again and find them handed off, without knowing where
/// the hand-off ended. A standby left out of `synchronized_standby_slots` that flushed the events'
/// transaction but not the hand-off must not get a copy of the slot between the two (17+). Staged: the
/// hand-off of two events of a blocked aggregate waits at the gate until the events are on the standby,
/// whose walsender is then stopped; outboxd's own walsender is stopped too (it never streams past the
/// hand-off), the gate opens, the hand-off commits, and outboxd is killed. Six later events are inserted,
/// whose `published_at` writes wait at a second gate, so the next process's window (8) fills with the
/// events and them, and it looks them up together: the later ones stay unfinished, the two found handed off
/// are finished. Before the fix it confirmed their transaction's end at once, the copy followed, and on the
/// promoted standby the two events had neither `handoff_at` nor `published_at`. Now it waits for their
/// hand-off (its message) in the stream and confirms nothing before its end: the copy stays behind the
/// events, and they are handed off again.
#[tokio::test(flavor = "multi_thread")]
async fn a_process_that_meets_events_handed_off_before_it_keeps_the_copy_of_the_slot_behind_them() {
    let Some(pair) = standby_with_hand_off_gate(false).await else {
        return;
    };
    let (primary_client, standby_client) = (&pair.primary_client, &pair.standby_client);
    pair.hold_in_polling_path().await;
    primary_client
        .batch_execute(
            "CREATE FUNCTION hold_marks() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN PERFORM pg_advisory_xact_lock_shared(1919, 3939); RETURN NEW; END $$;
             CREATE TRIGGER hold_marks BEFORE UPDATE ON outbox_event FOR EACH ROW
               WHEN (OLD.published_at IS NULL AND NEW.published_at IS NOT NULL AND NEW.aggregate_id = 'later')
               EXECUTE FUNCTION hold_marks();",
        )
        .await
        .unwrap();
    let address = Address::of(&pair.primary);
    let mut first = pair.spawn_outboxd(&address);
    wait_slot_active(primary_client, SLOT).await;
    wait_synced_copy(standby_client).await;

    let (gate, events, committed) = pair.hand_off_the_standby_lacks().await;
    let walsender = slot_walsender(primary_client, SLOT)
        .await
        .expect("outboxd's walsender");
    stop_process(walsender, "-STOP");
    gate.batch_execute("SELECT pg_advisory_unlock(1919, 2929)")
        .await
        .unwrap();
    wait_for_async(
        "the hand-off to commit on the primary",
        Duration::from_secs(60),
        || async {
            let handed_off: i64 = primary_client
                .query_one(
                    "SELECT count(*) FROM outbox_event WHERE event_id = ANY($1) AND handoff_at IS NOT NULL",
                    &[&events],
                )
                .await
                .unwrap()
                .get(0);
            (handed_off == 2).then_some(())
        },
    )
    .await;
    first.kill();
    // The stopped walsender ends once it runs again (its client is gone).
    primary_client
        .execute("SELECT pg_terminate_backend($1)", &[&walsender])
        .await
        .unwrap();
    stop_process(walsender, "-CONT");
    let before = confirmed_flush(primary_client, SLOT).await;
    assert!(
        before < committed,
        "the killed process confirmed nothing past the events ({before}, committed by {committed})"
    );

    let marks = pair.primary.client().await;
    marks
        .batch_execute("SELECT pg_advisory_lock(1919, 3939)")
        .await
        .unwrap();
    insert_orders(primary_client, "later", "Placed", 6).await;
    let mut second = pair.spawn_outboxd(&address);
    const WAITS: &str = "events met again were found handed off before";
    wait_for_async(
        "the copy of the slot to pass the events, or the next process to wait for their hand-off",
        Duration::from_secs(120),
        || async {
            let copy = confirmed_flush(standby_client, SLOT).await;
            let waited = second.log_text().contains(WAITS)
                && confirmed_flush(primary_client, SLOT).await >= committed;
            (copy > before || waited).then_some(())
        },
    )
    .await;
    println!(
        "before the promotion: the copy of the slot at {}, the events' transaction committed by {committed}",
        confirmed_flush(standby_client, SLOT).await
    );

    pair.fail_over(&address);
    pair.wait_owed_on_the_promoted_standby(&events, "the events handed to the polling path")
        .await;
    assert!(
        second
            .log_text()
            .contains("continuing from the failover slot synchronised to it"),
        "the synced copy was used"
    );
    second.kill();
    drop(marks);
}

/// Sends `signal` (`-STOP`, `-CONT`) to a server process the test stopped or resumes.
fn stop_process(pid: i32, signal: &str) {
    let sent = std::process::Command::new("kill")
        .args([signal, &pid.to_string()])
        .status()
        .unwrap();
    assert!(sent.success(), "kill {signal} {pid}");
}

/// How far the standbys flushed, as a hold's early end reads it: outboxd's own marks (physical slots that
/// reserve no WAL) are no standbys, a reserved physical slot counts at its position, and a walsender
/// streaming without a slot whose position is not known yet makes the answer unknown (zero).
#[tokio::test(flavor = "multi_thread")]
async fn the_standbys_a_hold_waits_for_are_the_physical_slots_and_walsenders_the_primary_knows() {
    let pg = Postgres::start();
    let client = pg.client().await;
    let flushed = || async { outboxd::pg::standbys_flushed(&client).await.unwrap() };
    assert_eq!(flushed().await, None, "no standby");
    client
        .batch_execute(
            "SELECT pg_create_physical_replication_slot('outboxd_tl2');
             SELECT pg_create_physical_replication_slot('outboxd_creating');",
        )
        .await
        .unwrap();
    assert_eq!(flushed().await, None, "outboxd's marks are no standbys");
    client
        .batch_execute("SELECT pg_create_physical_replication_slot('standby_a', true)")
        .await
        .unwrap();
    let reserved: String = client
        .query_one(
            "SELECT restart_lsn::text FROM pg_replication_slots WHERE slot_name = 'standby_a'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(flushed().await, Some(reserved.parse::<Lsn>().unwrap()));
    client
        .batch_execute("SELECT pg_create_physical_replication_slot('standby_b')")
        .await
        .unwrap();
    assert_eq!(
        flushed().await,
        Some(Lsn::ZERO),
        "a standby slot not reserved yet"
    );
    client
        .batch_execute("SELECT pg_drop_replication_slot('standby_b')")
        .await
        .unwrap();
    let url = outboxd::pg::PgUrl::parse("test", &pg.url()).unwrap();
    let _walsender = outboxd::pg::replication::ReplicationConnection::connect(&url)
        .await
        .unwrap();
    assert_eq!(
        flushed().await,
        Some(Lsn::ZERO),
        "a walsender without a slot that reported no position"
    );
}

/// A copy of the slot kept by other means than PostgreSQL's slot synchronisation (Patroni's permanent slots,
/// pg_failover_slots) follows the primary's slot only as far as its standby *replayed*: it can rest between
/// an event and its hand-off on a standby that lacks the hand-off, whatever outboxd confirms. Staged as
/// Patroni does it: a plain slot on the primary, a slot of the same name created on the standby and advanced
/// to the lesser of the primary's confirmed position and the standby's replay position, once the standby has
/// the events' transaction but (its walsender stopped) not their hand-off. After the promotion, the code
/// before streamed from the copy and the events were owed to nobody (`timed out after 120s waiting for the
/// events handed to the polling path on the promoted standby`); now a slot copied from an earlier timeline
/// that PostgreSQL did not synchronise has every unpublished row handed to the polling path. The copy is then
/// given the failover flag (a file copy keeps it): it is a plain slot until confirmed past that hand-off
/// (the code before kept the flag, and a standby of the new primary could sync a copy resting before it).
#[tokio::test(flavor = "multi_thread")]
async fn a_slot_copied_by_other_means_between_an_event_and_its_hand_off_has_the_event_swept() {
    let Some(pair) = standby_with_hand_off_gate(false).await else {
        return;
    };
    let (primary_client, standby_client) = (&pair.primary_client, &pair.standby_client);
    pair.hold_in_polling_path().await;
    let address = Address::of(&pair.primary);
    let (url, brokers) = (address.url("postgres"), pair.broker.addr());
    let mut args = run_args(&url, &brokers);
    // As `ProtectedStandby::spawn_outboxd`: a window of 8 hands the blocked aggregate's events off.
    args.extend([
        "--reconnect-timeout",
        "120s",
        "--max-in-flight-events",
        "8",
        "--no-failover-slot",
    ]);
    let mut first = Outboxd::spawn(&args);
    wait_slot_active(primary_client, SLOT).await;
    // The copy on the standby (creating a logical slot there waits for the primary's next snapshot record).
    let creating = {
        let standby = pair.standby.client().await;
        tokio::spawn(async move {
            standby
                .batch_execute("SELECT pg_create_logical_replication_slot('outboxd', 'pgoutput')")
                .await
        })
    };
    wait_for_async(
        "the copy to be created on the standby",
        Duration::from_secs(60),
        || async {
            primary_client
                .batch_execute("SELECT pg_log_standby_snapshot()")
                .await
                .unwrap();
            creating.is_finished().then_some(())
        },
    )
    .await;
    creating.await.unwrap().unwrap();

    let (gate, events, committed) = pair.hand_off_the_standby_lacks().await;
    gate.batch_execute("SELECT pg_advisory_unlock(1919, 2929)")
        .await
        .unwrap();
    // Later events move the primary's slot past the hand-off.
    insert_orders(primary_client, "later", "Placed", 3).await;
    let past_the_hand_off = current_wal_lsn(primary_client).await;
    wait_for_async(
        "the primary's slot to be confirmed past the hand-off",
        Duration::from_secs(60),
        || async {
            (confirmed_flush(primary_client, SLOT).await >= past_the_hand_off).then_some(())
        },
    )
    .await;
    // Patroni's step: the copy goes to min(the primary's confirmed position, the standby's replay position).
    let copy: String = standby_client
        .query_one(
            "SELECT (pg_replication_slot_advance('outboxd', pg_last_wal_replay_lsn())).end_lsn::text",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let copy: Lsn = copy.parse().unwrap();
    assert!(
        copy >= committed && copy < past_the_hand_off,
        "the copy at {copy}: past the events ({committed}), before the hand-off"
    );
    first.kill();

    pair.fail_over(&address);
    // A copy of a failover slot's file keeps its flag: made so here, and outboxd runs with failover slots.
    let url_of_standby = outboxd::pg::PgUrl::parse("test", &pair.standby.url()).unwrap();
    outboxd::pg::replication::ReplicationConnection::connect(&url_of_standby)
        .await
        .unwrap()
        .alter_slot_failover(SLOT, true)
        .await
        .unwrap();
    let without_the_opt_out = &args[..args.len() - 1];
    let mut second = Outboxd::spawn(without_the_opt_out);
    pair.wait_owed_on_the_promoted_standby(&events, "the events handed to the polling path")
        .await;
    let logged = |text: &'static str| {
        let second = &second;
        move || second.log_text().contains(text).then_some(())
    };
    wait_for(
        "the copy to be recognised in the log",
        Duration::from_secs(30),
        logged("copied from an earlier timeline without PostgreSQL's slot synchronisation"),
    );
    // The sweep is a hand-off like any other: the slot is no failover slot before it is confirmed past it
    // (a standby of this server could otherwise sync a copy resting before it). On the code before, it
    // stayed a failover slot.
    wait_for(
        "the slot to be a plain slot until confirmed past the sweep",
        Duration::from_secs(30),
        logged("a plain slot until confirmed past the rows just handed off"),
    );
    // It becomes one again once confirmed past the sweep and the events waiting in the polling path have
    // drained (here an event a retry an hour away keeps waiting: not within this test).
    assert!(
        !slot_failover(standby_client).await,
        "no failover slot before the swept rows are published"
    );
    second.kill();
}
