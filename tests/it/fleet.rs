//! Fleets of outboxd instances on one database, of mixed modes, settings and versions: a poller next to a
//! CDC leader leaves the table to it (also while the leader's replication session restarts), mixed
//! `--poll-order`s are refused, the leadership key does not depend on the order of `--table`s (and is the
//! key text of earlier versions for one table), a leader of an earlier version is never joined by a second
//! one, and an application's bigint advisory lock neither stops outboxd nor is ended by it.

use std::time::Duration;

use crate::support::*;

/// Migrates `orders.outbox_event` and `billing.outbox_event`.
fn migrate_two_tables(url: &str) {
    let output = run_outboxd(&[
        "migrate",
        "--database-url",
        url,
        "--table",
        "orders.outbox_event",
        "--table",
        "billing.outbox_event",
    ]);
    assert!(
        output.status.success(),
        "migrate failed: {}",
        stderr_of(&output)
    );
}

/// Whether some session of this database holds outboxd's advisory lock for key text `key`:
/// `pg_advisory_lock(OUTBOXD_LOCK_CLASS, hashtext(key))`, objsubid 2.
async fn lock_held(client: &tokio_postgres::Client, key: &str) -> bool {
    client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted
                AND l.objsubid = 2 AND l.classid = $1::int8::oid AND l.objid = hashtext($2)::oid)",
            &[
                &i64::from(outboxd::pipeline::liveness::OUTBOXD_LOCK_CLASS),
                &key,
            ],
        )
        .await
        .unwrap()
        .get(0)
}

fn wait_for_log(outboxd: &Outboxd, text: &str, what: &str) {
    wait_for(what, Duration::from_secs(60), || {
        outboxd.log_text().contains(text).then_some(())
    });
}

/// Rows the polling path claimed (a claim counts an attempt; the CDC path never does).
async fn claimed_rows(client: &tokio_postgres::Client) -> i64 {
    client
        .query_one("SELECT count(*) FROM outbox_event WHERE attempts > 0", &[])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_poller_leaves_the_table_to_a_live_cdc_leader_and_takes_over_when_it_stops() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut leader = Outboxd::spawn(&run_args(&url, &brokers));
    let mut client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    // The key text of earlier versions for one table, in outboxd's keyspace; and the lock earlier versions
    // take, held too: a rolling upgrade never has two leaders.
    assert!(
        lock_held(&client, "outboxd.leader.public.outbox_event.outboxd").await,
        "the leadership key for one table is the key text earlier versions used"
    );
    assert_eq!(
        former_leader_key_holders(&client).await,
        ["outboxd active outboxd"],
        "the leader holds the leadership lock of earlier versions too"
    );
    let mut args = run_args(&url, &brokers);
    args.extend(["--mode", "poll"]);
    let poller = Outboxd::spawn(&args);
    wait_for_log(&poller, "start-up checks passed", "the poller to start");

    let (mut committed, _) = insert_events(&mut client, 0, 200, 25, 50, None).await;
    wait_all_published(&client, Duration::from_secs(120)).await;
    assert_eq!(
        claimed_rows(&client).await,
        0,
        "the poller claimed rows the CDC leader streams"
    );
    assert!(
        poller.log_text().contains("a CDC leader streams"),
        "the poller says why it claims nothing"
    );

    leader.kill();
    wait_for_log(
        &poller,
        "no CDC leader streams",
        "the poller to poll once the leader is gone",
    );
    let (more, _) = insert_events(&mut client, 200, 20, 5, 10, None).await;
    committed.extend(more);
    wait_all_published(&client, Duration::from_secs(120)).await;
    verify_delivery(&brokers, &committed, &[], 90, "poller next to a leader");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_instance_with_another_poll_order_than_its_peers_is_refused() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut args = run_args(&url, &brokers);
    args.extend(["--mode", "poll"]);
    let running = Outboxd::spawn(&args);
    wait_for_log(
        &running,
        "start-up checks passed",
        "the first poller to start",
    );

    args.extend(["--poll-order", "none"]);
    let mut unordered = Outboxd::spawn(&args);
    let status = wait_for(
        "the instance with another --poll-order to stop",
        Duration::from_secs(60),
        || unordered.try_wait(),
    );
    assert!(!status.success());
    let log = unordered.log_text();
    assert!(
        log.contains("--poll-order per-aggregate") && log.contains("fix:"),
        "the error names the peers' order and the fix: {log}"
    );
    // An instance of the same order joins the fleet.
    let mut same = run_args(&url, &brokers);
    same.extend(["--mode", "poll", "--poll-order", "per-aggregate"]);
    let joined = Outboxd::spawn(&same);
    wait_for_log(
        &joined,
        "start-up checks passed",
        "the same-order poller to start",
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_leadership_key_does_not_depend_on_the_order_of_tables() {
    let pg = Postgres::start();
    let broker = Broker::start();
    let (url, brokers) = (pg.url(), broker.addr());
    migrate_two_tables(&url);
    let spawn = |first: &str, second: &str| {
        let mut args = run_args(&url, &brokers);
        args.extend(["--table", first, "--table", second]);
        Outboxd::spawn(&args)
    };
    let _leader = spawn("orders.outbox_event", "billing.outbox_event");
    let client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    let reversed = spawn("billing.outbox_event", "orders.outbox_event");
    wait_for_log(
        &reversed,
        "standing by",
        "the instance with the tables in another order to stand by",
    );
    assert!(
        lock_held(
            &client,
            "outboxd.leader.billing.outbox_event, orders.outbox_event.outboxd"
        )
        .await,
        "the key names the tables sorted"
    );
}

/// The leadership key of the default table and slot in the form every earlier version took it:
/// `pg_advisory_lock(hashtext('outboxd.leader.public.outbox_event.outboxd'))`, the bigint keyspace applications
/// use (`pg_advisory_lock(bigint)`, pg_locks objsubid 1).
const FORMER_LEADER_KEY: i64 = 19_094_275;

/// Seconds the session `pid` has run no statement, `None` once it is gone.
async fn idle_secs(client: &tokio_postgres::Client, pid: i32) -> Option<f64> {
    client
        .query_opt(
            "SELECT extract(epoch FROM now() - state_change)::float8 FROM pg_stat_activity WHERE pid = $1",
            &[&pid],
        )
        .await
        .unwrap()
        .map(|row| row.get(0))
}

/// The `application_name`s of the sessions holding `FORMER_LEADER_KEY`.
async fn former_leader_key_holders(client: &tokio_postgres::Client) -> Vec<String> {
    client
        .query(
            "SELECT a.application_name FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
               AND ((l.classid::int8 << 32) | l.objid::int8) = $1",
            &[&FORMER_LEADER_KEY],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

/// An application that locks its own entities by bigint id (a job queue locking job 19,094,275) holds the
/// key earlier versions led with, and idles (its worker runs the job) for longer than a silent leader is
/// given: outboxd leads all the same, and never ends the application's session. Once the application lets
/// go, the leader holds that key too (so that an instance of an earlier version cannot lead beside it).
#[tokio::test(flavor = "multi_thread")]
async fn an_application_holding_the_former_leadership_key_neither_keeps_outboxd_from_leading_nor_is_ended(
) {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    let former: i64 = client
        .query_one(
            "SELECT hashtext('outboxd.leader.public.outbox_event.outboxd')::int8",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(former, FORMER_LEADER_KEY, "the former leadership key");
    let application = pg.client().await;
    application
        .batch_execute(&format!("SELECT pg_advisory_lock({FORMER_LEADER_KEY})"))
        .await
        .unwrap();
    let application_pid: i32 = application
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);

    let outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    let (committed, _) = insert_events(&mut client, 0, 20, 5, 10, None).await;
    wait_all_published(&client, Duration::from_secs(60)).await;
    let silent_leader = outboxd::pipeline::liveness::SILENT_LEADER.as_secs_f64();
    wait_for_async(
        "the application's session to idle past the silent-leader bound",
        Duration::from_secs(60),
        || async {
            let idle = idle_secs(&client, application_pid)
                .await
                .expect("outboxd ended the application's session (pg_terminate_backend)");
            (idle > silent_leader + 3.0).then_some(())
        },
    )
    .await;
    application
        .simple_query("SELECT 1")
        .await
        .expect("the application's session is alive");
    assert_eq!(
        former_leader_key_holders(&client).await,
        [String::new()],
        "the application still holds its lock, and only it"
    );
    assert!(
        !outboxd.log_text().contains("ended it"),
        "outboxd ended no session"
    );
    verify_delivery(
        &brokers,
        &committed,
        &[],
        60,
        "next to an application's lock",
    );

    application
        .batch_execute(&format!("SELECT pg_advisory_unlock({FORMER_LEADER_KEY})"))
        .await
        .unwrap();
    wait_for_async(
        "the leader to hold the former leadership key once the application let go",
        Duration::from_secs(30),
        || async {
            (former_leader_key_holders(&client).await == ["outboxd active outboxd"]).then_some(())
        },
    )
    .await;
}

/// A rolling upgrade: an instance of an earlier version leads (it holds only the bigint key, on a session
/// named `outboxd active <slot>` that runs a health query every couple of seconds). A new instance stands by
/// for as long as that leader lives, well past the silent-leader bound (never two leaders), and leads once it
/// is gone.
#[tokio::test(flavor = "multi_thread")]
async fn a_new_instance_stands_by_while_a_leader_of_an_earlier_version_lives_and_leads_after_it() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    let earlier = pg.client().await;
    earlier
        .batch_execute(&format!(
            "SELECT set_config('application_name', 'outboxd active outboxd', false);
             SELECT pg_advisory_lock({FORMER_LEADER_KEY})"
        ))
        .await
        .unwrap();
    let earlier_pid: i32 = earlier
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    let health = tokio::spawn(async move {
        loop {
            earlier.simple_query("SELECT 1").await.unwrap();
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    });

    let outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_for_log(&outboxd, "standing by", "the new instance to stand by");
    let (committed, _) = insert_events(&mut client, 0, 20, 5, 10, None).await;
    let silent_leader = outboxd::pipeline::liveness::SILENT_LEADER.as_secs_f64();
    wait_for_async(
        "the new instance to stand by past the silent-leader bound",
        Duration::from_secs(60),
        || async {
            assert!(
                slot_active(&client, "outboxd").await.is_none(),
                "the new instance streams beside a live leader of an earlier version: two leaders"
            );
            let age: f64 = client
                .query_opt(
                    "SELECT extract(epoch FROM now() - backend_start)::float8 FROM pg_stat_activity WHERE pid = $1",
                    &[&earlier_pid],
                )
                .await
                .unwrap()
                .expect("the new instance ended the live earlier leader's session")
                .get(0);
            (age > silent_leader + 5.0).then_some(())
        },
    )
    .await;
    assert_eq!(
        unpublished(&client).await,
        committed.len() as i64,
        "nothing streams while the earlier leader (simulated) leads"
    );

    health.abort(); // its client goes with the task: the session ends, and its lock with it
    wait_for_log(&outboxd, "took over", "the new instance to take over");
    wait_all_published(&client, Duration::from_secs(60)).await;
    verify_delivery(
        &brokers,
        &committed,
        &[],
        60,
        "after an earlier version's leader",
    );
}

/// A live CDC leader's replication session restarts (its walsender ended, as by a broker refusal, a network
/// blip or a server-side kill), several times, each with rows committed while its slot is inactive: the
/// poller next to it claims none of them. The leader is alive and marked throughout, so the slot publishes
/// them once the leader reconnects.
#[tokio::test(flavor = "multi_thread")]
async fn a_poller_claims_nothing_while_the_leaders_replication_session_restarts() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let _leader = Outboxd::spawn(&run_args(&url, &brokers));
    let mut client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    let mut args = run_args(&url, &brokers);
    args.extend(["--mode", "poll"]);
    let poller = Outboxd::spawn(&args);
    wait_for_log(
        &poller,
        "a CDC leader streams",
        "the poller to defer to the leader",
    );

    let mut committed = Vec::new();
    for restart in 0..5 {
        let walsender = wait_for_async("the leader to stream", Duration::from_secs(60), || {
            slot_walsender(&client, "outboxd")
        })
        .await;
        client
            .execute("SELECT pg_terminate_backend($1)", &[&walsender])
            .await
            .unwrap();
        let (more, _) = insert_events(&mut client, restart * 10, 10, 5, 10, None).await;
        committed.extend(more);
        wait_for_async(
            "the leader to stream again",
            Duration::from_secs(60),
            || async {
                slot_walsender(&client, "outboxd")
                    .await
                    .filter(|pid| *pid != walsender)
            },
        )
        .await;
        wait_all_published(&client, Duration::from_secs(60)).await;
    }
    assert_eq!(
        claimed_rows(&client).await,
        0,
        "the poller claimed rows while the live leader's replication session restarted"
    );
    verify_delivery(&brokers, &committed, &[], 60, "leader's session restarts");
}
