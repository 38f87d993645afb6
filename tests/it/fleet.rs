//! Fleets of outboxd instances on one database, of mixed modes, settings and versions: a poller next to a
//! CDC leader leaves the table to it, mixed `--poll-order`s are refused, and the leadership key does not
//! depend on the order of `--table`s (and is the key of earlier versions for one table).

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

/// Whether some session of this database holds the advisory lock `hashtext(key)`.
async fn lock_held(client: &tokio_postgres::Client, key: &str) -> bool {
    client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_locks l WHERE l.locktype = 'advisory' AND l.granted
                AND l.objsubid = 1 AND ((l.classid::int8 << 32) | l.objid::int8) = hashtext($1)::int8)",
            &[&key],
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
    // The key of earlier versions for one table: a rolling upgrade never has two leaders.
    assert!(
        lock_held(&client, "outboxd.leader.public.outbox_event.outboxd").await,
        "the leadership key for one table is the one earlier versions used"
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
