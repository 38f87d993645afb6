//! The pipelines' delivery rules against a real PostgreSQL and an in-memory broker
//! (`outboxd::sink::memory`), in-process: the broker refuses events at hand-over, fails them after the
//! producer accepted them, holds delivery reports past the delivery timeout and releases them out of
//! order, exactly when the test says. What reached the broker is checked like a Kafka topic: nothing
//! committed missing, nothing rolled back, every aggregate in commit order.

use std::time::Duration;

use outboxd::sink::memory::{Fault, MemoryBroker, Release};

use crate::support::in_process::*;
use crate::support::*;

async fn slot_confirmed(client: &tokio_postgres::Client) -> Option<outboxd::lsn::Lsn> {
    let row = client
        .query_opt(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'outboxd'",
            &[],
        )
        .await
        .unwrap()?;
    row.get::<_, Option<String>>(0)
        .map(|lsn| lsn.parse().expect("an LSN"))
}

async fn current_lsn(client: &tokio_postgres::Client) -> outboxd::lsn::Lsn {
    let lsn: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    lsn.parse().expect("an LSN")
}

/// The failure after hand-over that once let a later event of its aggregate overtake it: the first event of
/// an aggregate is accepted and then refused by the broker (too large) while the next ones of its aggregate
/// are in flight behind it, and the reports come back last first. The next session hands the refused event
/// and its aggregate's later events to the polling path (refused once more there, then sent alone), in order:
/// they must wait for it, not overtake it.
#[tokio::test(flavor = "multi_thread")]
async fn a_refusal_after_acceptance_keeps_its_aggregate_in_order() {
    let broker = MemoryBroker::new();
    let (_pg, mut client, outboxd) = streaming(&broker, &["--retry-base", "3s"]).await;
    broker.hold_reports(true);
    broker.add_fault(
        Fault::FailAfterAcceptance(refused_for_now()),
        2,
        |_, event| seq_of(event) == Some(0),
    );
    let (committed, rolled_back) = insert_events(&mut client, 0, 20, 3, 4, Some(7)).await;
    wait_for("every event in flight", Duration::from_secs(60), || {
        (broker.held() >= committed.len()).then_some(())
    });
    broker.release(Release::Reversed);
    broker.hold_reports(false);
    wait_all_published(&client, Duration::from_secs(120)).await;
    assert_eq!(broker.faults_struck(), (0, 2), "the refusals struck");
    let through_polling: bool = client
        .query_one(
            "SELECT handoff_at IS NOT NULL FROM outbox_event WHERE event_id = $1",
            &[&committed[0].event_id],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        through_polling,
        "the polling path published the refused event"
    );
    let duplicates = assert_delivered(&broker, &committed, &rolled_back);
    println!("{} events, {duplicates} duplicates", committed.len());
    outboxd.stop().await.expect("clean stop");
}

/// An event refused at hand-over every time as too large is dead-lettered once refused alone (with its copy
/// in the dead-letter topic), and the later events of its aggregate are published after it, in order.
#[tokio::test(flavor = "multi_thread")]
async fn an_event_refused_every_time_is_dead_lettered_and_its_aggregate_goes_on() {
    let broker = MemoryBroker::new();
    let args = [
        "--max-attempts",
        "2",
        "--retry-base",
        "100ms",
        "--retry-cap",
        "200ms",
        "--dead-letter-topic",
        "outbox.dead",
    ];
    let (_pg, mut client, outboxd) = streaming(&broker, &args).await;
    broker.add_fault(
        Fault::RefuseAtHandOver(too_large()),
        usize::MAX,
        |topic, event| topic == TOPIC && seq_of(event) == Some(1),
    );
    let (committed, rolled_back) = insert_events(&mut client, 0, 10, 3, 2, None).await;
    let poison = committed[1].clone();
    wait_settled(&client, Duration::from_secs(120)).await;
    let dead: Vec<uuid::Uuid> = client
        .query(
            "SELECT event_id FROM outbox_event WHERE dead_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(
        dead,
        vec![poison.event_id],
        "only the refused event is dead"
    );
    let (refused, _) = broker.faults_struck();
    assert!(refused >= 2, "refused at every attempt ({refused})");
    let dead_letters: Vec<_> = broker
        .records()
        .into_iter()
        .filter(|r| r.topic == "outbox.dead")
        .collect();
    assert_eq!(dead_letters.len(), 1, "{dead_letters:?}");
    assert_eq!(dead_letters[0].event_id, poison.event_id);
    assert!(dead_letters[0]
        .error
        .as_deref()
        .is_some_and(|e| e.contains("too large")));
    let delivered: Vec<Inserted> = committed
        .iter()
        .filter(|e| e.event_id != poison.event_id)
        .cloned()
        .collect();
    assert_delivered(&broker, &delivered, &rolled_back);
    outboxd.stop().await.expect("clean stop");
}

/// Reports held past the delivery timeout: the session gives its deliveries up (the producer is purged)
/// and re-sends from the slot once reports flow again. Nothing is lost, nothing reordered.
#[tokio::test(flavor = "multi_thread")]
async fn reports_held_past_the_delivery_timeout_are_sent_again() {
    let broker = MemoryBroker::new();
    let args = ["--kafka-option", "message.timeout.ms=1000"];
    let (_pg, mut client, outboxd) = streaming(&broker, &args).await;
    broker.hold_reports(true);
    let (committed, rolled_back) = insert_events(&mut client, 0, 10, 3, 3, None).await;
    wait_for("every event in flight", Duration::from_secs(60), || {
        (broker.held() >= committed.len()).then_some(())
    });
    let producers = broker.sinks_made();
    // Past the timeout the session purges what it holds: the producer then holds nothing.
    wait_for("the session to give up", Duration::from_secs(60), || {
        (broker.held() < committed.len()).then_some(())
    });
    broker.hold_reports(false);
    wait_all_published(&client, Duration::from_secs(120)).await;
    assert!(
        broker.sinks_made() > producers,
        "a new session, with a new producer"
    );
    assert_delivered(&broker, &committed, &rolled_back);
    outboxd.stop().await.expect("clean stop");
}

/// Reports of a later transaction arriving before an earlier one's: the later one is marked published, but
/// the slot is not confirmed past the earlier, unfinished transaction until its report is in.
#[tokio::test(flavor = "multi_thread")]
async fn a_later_report_first_does_not_confirm_an_earlier_transaction() {
    let broker = MemoryBroker::new();
    let (_pg, client, outboxd) = streaming(&broker, &[]).await;
    broker.hold_reports(true);
    let before = current_lsn(&client).await;
    let insert = |aggregate: &'static str| {
        let client = &client;
        async move {
            let id = uuid::Uuid::new_v4();
            client
                .execute(
                    "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                     VALUES ($1, 'Order', $2, 'E', '{}')",
                    &[&id, &aggregate],
                )
                .await
                .unwrap();
            id
        }
    };
    let earlier = insert("earlier").await;
    let later = insert("later").await;
    let after = current_lsn(&client).await;
    wait_for("both in flight", Duration::from_secs(60), || {
        (broker.held() == 2).then_some(())
    });
    broker.release_key("later");
    let published = |id: uuid::Uuid| {
        let client = &client;
        async move {
            client
                .query_one(
                    "SELECT published_at IS NOT NULL FROM outbox_event WHERE event_id = $1",
                    &[&id],
                )
                .await
                .unwrap()
                .get::<_, bool>(0)
        }
    };
    wait_for_async(
        "the later event marked",
        Duration::from_secs(60),
        || async { published(later).await.then_some(()) },
    )
    .await;
    // Several status updates later (every 200 ms), the slot is still before the earlier transaction's end.
    let replies = || async {
        client
            .query_one(
                "SELECT reply_time::text FROM pg_stat_replication WHERE application_name <> 'walreceiver' LIMIT 1",
                &[],
            )
            .await
            .ok()
            .and_then(|row| row.get::<_, Option<String>>(0))
    };
    let first_reply = replies().await;
    for _ in 0..3 {
        let seen = replies().await;
        wait_for_async("another status update", Duration::from_secs(30), || async {
            (replies().await != seen).then_some(())
        })
        .await;
    }
    assert!(first_reply.is_some());
    let confirmed = slot_confirmed(&client).await.expect("the slot");
    assert!(
        confirmed < after,
        "confirmed {confirmed} past both transactions (ended by {after}) with the earlier one unreported"
    );
    assert!(!published(earlier).await);
    broker.release(Release::InOrder);
    broker.hold_reports(false);
    wait_for_async(
        "the slot confirmed past both",
        Duration::from_secs(60),
        || async {
            slot_confirmed(&client)
                .await
                .filter(|confirmed| *confirmed >= after)
        },
    )
    .await;
    assert!(published(earlier).await && before < after);
    outboxd.stop().await.expect("clean stop");
}

/// A hand-off that lands late: the leader's `handoff_at` write for event e1 (refused at hand-over) is held
/// by a row lock when its session ends, and commits only after the next session read which aggregates wait
/// in the polling path (so that snapshot misses e1). The next session meets e1 again in the slot and finds
/// it handed off: its aggregate must wait behind it, or the stream would publish a later event e2 of the
/// aggregate while e1 is still in the polling path (review finding #4).
#[tokio::test(flavor = "multi_thread")]
async fn a_hand_off_written_after_the_next_session_started_still_holds_its_aggregate() {
    const GETS_THROUGH: Duration = Duration::from_secs(90);
    let broker = MemoryBroker::new();
    let retry = [
        "--max-attempts",
        "100000",
        "--retry-base",
        "1s",
        "--retry-cap",
        "1s",
    ];
    let (pg, client, outboxd) = streaming(&broker, &retry).await;
    // e1 is refused while `refusing` is set: by the first session at hand-over, then by the polling path.
    let refusing = refuse_at_hand_over_while(&broker, |event| seq_of(event) == Some(1));
    // 1,000 events ahead of e1 stay unfinished in the first session (their reports held), so that the next
    // session looks them up and publishes them (slowly) before it looks e1 up.
    broker.hold_reports(true);
    broker.set_publish_delay(Some(Duration::from_millis(3)));
    client
        .batch_execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'Order', 'z' || g % 50, 'E', jsonb_build_object('seq', 1000 + g)
             FROM generate_series(1, 1000) g",
        )
        .await
        .unwrap();
    let e1 = uuid::Uuid::new_v4();
    client
        .execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             VALUES ($1, 'Order', 'A', 'E', '{\"seq\": 1}')",
            &[&e1],
        )
        .await
        .unwrap();
    let mut locker = pg.client().await;
    let lock = locker.transaction().await.unwrap();
    lock.execute(
        "SELECT 1 FROM outbox_event WHERE event_id = $1 FOR UPDATE",
        &[&e1],
    )
    .await
    .unwrap();
    wait_hand_off_waiting_on_a_lock(
        &client,
        "e1's hand-off to wait for the row lock",
        GETS_THROUGH,
    )
    .await;
    // The first session ends with its hand-off still waiting on the server.
    let first: i32 = client
        .query_one(
            "SELECT active_pid FROM pg_replication_slots WHERE slot_name = 'outboxd'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    client
        .execute("SELECT pg_terminate_backend($1)", &[&first])
        .await
        .unwrap();
    broker.hold_reports(false);
    let before = broker.records().len();
    wait_for_async("the next session to publish", GETS_THROUGH, || async {
        let now: Option<i32> = client
            .query_one(
                "SELECT active_pid FROM pg_replication_slots WHERE slot_name = 'outboxd'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        (now.is_some_and(|pid| pid != first) && broker.records().len() > before).then_some(())
    })
    .await;
    // Now, while the next session still publishes the events ahead of e1, the hand-off lands.
    lock.rollback().await.unwrap();
    drop(locker);
    wait_for_async("the 1,000 events ahead of e1 to be published", GETS_THROUGH, || async {
        let left: i64 = client
            .query_one(
                "SELECT count(*) FROM outbox_event WHERE aggregate_id LIKE 'z%' AND published_at IS NULL",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        (left == 0).then_some(())
    })
    .await;
    broker.set_publish_delay(None);
    let e2 = uuid::Uuid::new_v4();
    client
        .execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             VALUES ($1, 'Order', 'A', 'E', '{\"seq\": 2}')",
            &[&e2],
        )
        .await
        .unwrap();
    // Streamed (held back in memory, or published ahead of e1), while the polling path still refuses e1.
    wait_sent_up_to_now(&client).await;
    refusing.store(false, std::sync::atomic::Ordering::SeqCst);
    wait_all_published(&client, GETS_THROUGH).await;
    assert_eq!(first_seen(&broker, "A"), [e1, e2], "A's events in order");
    outboxd.stop().await.expect("clean stop");
}

/// `outboxd replay` of a dead event d of aggregate A while the CDC path streams: an event of A committed after
/// the replay must not reach Kafka before d (review finding #8: the running session's gate did not know).
#[tokio::test(flavor = "multi_thread")]
async fn a_replayed_event_is_not_overtaken_by_later_events_of_its_aggregate_under_cdc() {
    const GETS_THROUGH: Duration = Duration::from_secs(90);
    let broker = MemoryBroker::new();
    let retry = [
        "--max-attempts",
        "2",
        "--retry-base",
        "2s",
        "--retry-cap",
        "2s",
    ];
    let (pg, client, outboxd) = streaming(&broker, &retry).await;
    let refusing = refuse_at_hand_over_while(&broker, |event| seq_of(event) == Some(1));
    let insert = |seq: i32| {
        let client = &client;
        async move {
            let id = uuid::Uuid::new_v4();
            client
                .execute(
                    "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                     VALUES ($1, 'Order', 'A', 'E', jsonb_build_object('seq', $2::int))",
                    &[&id, &seq],
                )
                .await
                .unwrap();
            id
        }
    };
    let dead = insert(1).await;
    wait_for_async("the event to be dead-lettered", GETS_THROUGH, || async {
        dead_count(&client).await.eq(&1).then_some(())
    })
    .await;
    // Days later, a restarted outboxd streams: nothing of A waits in the polling path.
    outboxd.stop().await.expect("clean stop");
    let outboxd = InProcess::start(&pg, &broker, &retry);
    wait_slot_active(&client, "outboxd").await;
    let table = outbox_event_table(&client).await;
    let mut operator = pg.client().await;
    let requeued = outboxd::pg::outbox::replay_dead(
        &mut operator,
        &table,
        &outboxd::pg::outbox::ReplayFilter::EventId(dead),
    )
    .await
    .unwrap();
    assert_eq!(requeued, 1);
    // The polling path tries it once more (refused: it waits 2 s for the next try) ...
    wait_for_async(
        "the replayed event to be tried again",
        GETS_THROUGH,
        || async { attempts_of(&client, dead).await.eq(&1).then_some(()) },
    )
    .await;
    // ... meanwhile a later event of A is committed and streamed.
    let later = insert(2).await;
    wait_sent_up_to_now(&client).await;
    refusing.store(false, std::sync::atomic::Ordering::SeqCst);
    wait_all_published(&client, GETS_THROUGH).await;
    assert_eq!(
        first_seen(&broker, "A"),
        [dead, later],
        "A's events in order"
    );
    outboxd.stop().await.expect("clean stop");
}

/// Holds the write-back of event `e1` (whose row its own transaction deleted) with an uncommitted row of the
/// same event id, until the returned session rolls back; returns it and the pid of the waiting write-back.
async fn hold_write_back(
    pg: &Postgres,
    client: &tokio_postgres::Client,
    e1: uuid::Uuid,
) -> (tokio_postgres::Client, i32) {
    let blocker = pg.client().await;
    blocker
        .batch_execute(&format!(
            "BEGIN; INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             VALUES ('{e1}', 'Blocker', 'B', 'E', '{{}}')"
        ))
        .await
        .unwrap();
    let writer = wait_for_async(
        "the write-back to wait for the blocker",
        Duration::from_secs(90),
        || async {
            client
                .query_opt(
                    "SELECT pid FROM pg_stat_activity
                     WHERE wait_event_type = 'Lock' AND query LIKE 'INSERT INTO%handoff_at%'",
                    &[],
                )
                .await
                .unwrap()
                .map(|row| row.get(0))
        },
    )
    .await;
    (blocker, writer)
}

/// Two events of one aggregate go to the polling path together: E1, whose row its own transaction deleted
/// (written back), and E2 after it, whose row is kept. E2's hand-off must not become visible to the polling
/// path before E1 exists again as a row (the adversarial review: E2's `handoff_at` committed at once, E1's
/// write-back later, and the sweeper published E2 first). The test holds E1's write-back with an uncommitted
/// row of the same event id.
#[tokio::test(flavor = "multi_thread")]
async fn an_earlier_event_written_back_is_never_overtaken_by_a_later_one_handed_off_with_it() {
    const GETS_THROUGH: Duration = Duration::from_secs(90);
    let broker = MemoryBroker::new();
    let (pg, client, outboxd) = streaming(&broker, &[]).await;
    // E1 is refused once, at hand-over (so E1 and, behind it, E2 go to the polling path), slowly enough for the
    // test to put its blocker in place first.
    broker.add_fault(Fault::RefuseAtHandOver(refused_for_now()), 1, |_, event| {
        seq_of(event) == Some(1)
    });
    broker.set_publish_delay(Some(Duration::from_millis(500)));
    let (e1, e2) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    client
        .batch_execute(&format!(
            "BEGIN;
             INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('{e1}', 'Order', 'A', 'E', '{{\"seq\": 1}}');
             DELETE FROM outbox_event WHERE event_id = '{e1}';
             COMMIT;
             INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('{e2}', 'Order', 'A', 'E', '{{\"seq\": 2}}');"
        ))
        .await
        .unwrap();
    let (blocker, _) = hold_write_back(&pg, &client, e1).await;
    broker.set_publish_delay(None);
    // The sweeper claims every 100 ms: time enough for it to take E2 were its hand-off visible already.
    tokio::time::sleep(Duration::from_secs(1)).await;
    blocker.batch_execute("ROLLBACK").await.unwrap();
    wait_for_async("both events to be published", GETS_THROUGH, || async {
        let records = broker.records();
        (records.iter().any(|r| r.event_id == e1) && records.iter().any(|r| r.event_id == e2))
            .then_some(())
    })
    .await;
    assert_eq!(first_seen(&broker, "A"), [e1, e2], "A's events in order");
    outboxd.stop().await.expect("clean stop");
}

/// A write-back cut off by a failure that retrying fixes (here its connection ended by the server, as a
/// restart or failover would) is retried by the next session; it never stops outboxd (the adversarial
/// review: every write-back error was a set-up error, so outboxd exited).
#[tokio::test(flavor = "multi_thread")]
async fn a_write_back_cut_off_by_the_server_is_retried() {
    const GETS_THROUGH: Duration = Duration::from_secs(90);
    let broker = MemoryBroker::new();
    let (pg, client, outboxd) = streaming(&broker, &[]).await;
    broker.add_fault(Fault::RefuseAtHandOver(refused_for_now()), 1, |_, event| {
        seq_of(event) == Some(1)
    });
    broker.set_publish_delay(Some(Duration::from_millis(500)));
    let e1 = uuid::Uuid::new_v4();
    client
        .batch_execute(&format!(
            "BEGIN;
             INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                 VALUES ('{e1}', 'Order', 'A', 'E', '{{\"seq\": 1}}');
             DELETE FROM outbox_event WHERE event_id = '{e1}';
             COMMIT;"
        ))
        .await
        .unwrap();
    let (blocker, writer) = hold_write_back(&pg, &client, e1).await;
    broker.set_publish_delay(None);
    client
        .execute("SELECT pg_terminate_backend($1)", &[&writer])
        .await
        .unwrap();
    blocker.batch_execute("ROLLBACK").await.unwrap();
    wait_for_async("E1 to be published", GETS_THROUGH, || async {
        broker
            .records()
            .iter()
            .any(|r| r.event_id == e1)
            .then_some(())
    })
    .await;
    outboxd.stop().await.expect("outboxd kept running");
}

/// Any login may emit a logical decoding message with outboxd's hand-off prefix. One naming an aggregate that
/// has nothing waiting in the polling path (forged, or sent again after its events drained) is ignored: it
/// neither restarts the session while the aggregate has events in flight (duplicates, the aggregate sent
/// through the polling path) nor holds the aggregate's later events back.
#[tokio::test(flavor = "multi_thread")]
async fn a_forged_hand_off_notice_neither_restarts_the_session_nor_moves_its_aggregate() {
    let broker = MemoryBroker::new();
    let (pg, client, outboxd) = streaming(&broker, &[]).await;
    client
        .batch_execute("CREATE ROLE mallory LOGIN")
        .await
        .unwrap();
    let mallory = pg.client_as("mallory").await;
    broker.hold_reports(true);
    let insert = |seq: i32| {
        let client = &client;
        async move {
            let id = uuid::Uuid::new_v4();
            client
                .execute(
                    "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                     VALUES ($1, 'Order', 'A', 'E', jsonb_build_object('seq', $2::int))",
                    &[&id, &seq],
                )
                .await
                .unwrap();
            id
        }
    };
    let first = insert(1).await;
    wait_for("the first event in flight", Duration::from_secs(60), || {
        (broker.held() == 1).then_some(())
    });
    let sinks = broker.sinks_made();
    mallory
        .execute(
            "SELECT pg_logical_emit_message(true, 'outboxd.handoff',
                 '{\"table\":\"public.outbox_event\",\"aggregate_type\":\"Order\",\"aggregate_id\":\"A\"}')",
            &[],
        )
        .await
        .unwrap();
    let second = insert(2).await;
    wait_for(
        "the second event in flight behind the notice",
        Duration::from_secs(60),
        || (broker.held() == 2).then_some(()),
    );
    broker.release(Release::InOrder);
    broker.hold_reports(false);
    wait_all_published(&client, Duration::from_secs(60)).await;
    assert_eq!(
        first_seen(&broker, "A"),
        [first, second],
        "A's events in order"
    );
    let handed_off: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox_event WHERE handoff_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        handed_off, 0,
        "the forged notice sent A through the polling path"
    );
    assert_eq!(
        broker.sinks_made(),
        sinks,
        "the forged notice restarted the session"
    );
    assert_eq!(broker.records().len(), 2, "{:?}", broker.records());
    outboxd.stop().await.expect("clean stop");
}

/// Adversarial review 2: a commit is decoded once it is on disk, which can be before other sessions see
/// it (while it waits for a synchronous standby). `outboxd replay`'s notice was then checked against rows
/// not visible yet, ignored, and a later event of the aggregate overtook the replayed one. Now the
/// aggregate stays blocked until the notice's transaction has ended (without the stream waiting for it).
#[tokio::test(flavor = "multi_thread")]
async fn a_replay_waiting_for_a_synchronous_standby_still_goes_before_later_events() {
    use outboxd::pg::outbox::{self, ReplayFilter};
    let broker = MemoryBroker::new();
    let pg = Postgres::start();
    migrate(&pg);
    let client = pg.client().await;
    // Every commit waits for a standby that never comes, but outboxd's and this client's commit locally.
    for statement in [
        "ALTER SYSTEM SET synchronous_standby_names = 'nobody'",
        "ALTER DATABASE postgres SET synchronous_commit = local",
        "SELECT pg_reload_conf()",
        "SET synchronous_commit = local",
    ] {
        client.batch_execute(statement).await.unwrap();
    }
    let outboxd = InProcess::start(&pg, &broker, &[]);
    wait_slot_active(&client, "outboxd").await;
    let first = uuid::Uuid::new_v4();
    client
        .execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             VALUES ($1, 'Order', 'A', 'E', '{\"seq\": 1}')",
            &[&first],
        )
        .await
        .unwrap();
    wait_all_published(&client, Duration::from_secs(60)).await;
    // Dead-lettered since, as the polling path does with an event refused for good.
    client
        .execute(
            "UPDATE outbox_event SET published_at = NULL, dead_at = now(), attempts = 10, last_error = 'refused'
             WHERE event_id = $1",
            &[&first],
        )
        .await
        .unwrap();
    // Sessions whose commits wait for the standby, as the application's do under synchronous replication.
    let waiting_session = || async {
        let session = pg.client().await;
        session
            .batch_execute("SET synchronous_commit = on")
            .await
            .unwrap();
        let pid: i32 = session
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        (session, pid)
    };
    let waits_for_the_standby = |pid: i32| {
        let client = &client;
        async move {
            let waits: bool = client
                .query_one(
                    "SELECT coalesce((SELECT wait_event = 'SyncRep' FROM pg_stat_activity WHERE pid = $1), false)",
                    &[&pid],
                )
                .await
                .unwrap()
                .get(0);
            waits.then_some(())
        }
    };
    let table = outbox_event_table(&client).await;
    let (mut replayer, replayer_pid) = waiting_session().await;
    let replay = tokio::spawn(async move {
        outbox::replay_dead(&mut replayer, &table, &ReplayFilter::EventId(first)).await
    });
    wait_for_async(
        "the replay's commit to wait for the standby",
        Duration::from_secs(60),
        || waits_for_the_standby(replayer_pid),
    )
    .await;
    let (writer, writer_pid) = waiting_session().await;
    let second = uuid::Uuid::new_v4();
    let insert = tokio::spawn(async move {
        writer
            .execute(
                "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                 VALUES ($1, 'Order', 'A', 'E', '{\"seq\": 2}')",
                &[&second],
            )
            .await
    });
    wait_for_async(
        "the second event's commit to wait for the standby",
        Duration::from_secs(60),
        || waits_for_the_standby(writer_pid),
    )
    .await;
    // Either the stream published the second event past the notice, or it asked whether the replay ended.
    wait_for_async(
        "the second event published or the replay's end asked for",
        Duration::from_secs(60),
        || async {
            let asked: bool = client
                .query_one(
                    "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                     WHERE query LIKE '%locktype = ''transactionid''%' AND pid <> pg_backend_pid())",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            let published = broker.records().iter().any(|r| r.event_id == second);
            (asked || published).then_some(())
        },
    )
    .await;
    // The standby "answers" in commit order.
    for pid in [replayer_pid, writer_pid] {
        client
            .execute("SELECT pg_cancel_backend($1)", &[&pid])
            .await
            .unwrap();
    }
    assert_eq!(replay.await.unwrap().unwrap(), 1, "one event re-queued");
    insert.await.unwrap().unwrap();
    wait_all_published(&client, Duration::from_secs(60)).await;
    let records = broker.records();
    let replayed = records.iter().rposition(|r| r.event_id == first).unwrap();
    let later = records.iter().position(|r| r.event_id == second).unwrap();
    assert!(
        replayed < later,
        "the second event of A went out before the replayed first: {:?}",
        records
            .iter()
            .map(|r| (r.event_id == first, r.event_id == second))
            .collect::<Vec<_>>()
    );
    outboxd.stop().await.expect("clean stop");
}
