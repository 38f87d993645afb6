//! Deliveries that fail after the producer accepted the event, on Apache Kafka: a record larger than the
//! topic's `max.message.bytes` (refused by the broker, not by librdkafka), a batch refused whole because of
//! one such record, and a topic deleted while outboxd runs. Each must take the road of a refusal at
//! hand-over (retried, dead-lettered after --max-attempts, later events of its aggregate after it, other
//! aggregates flowing) without restarting the stream more than a few times. And a topic Kafka refuses to
//! create (its name collides with an existing one's), refused before the producer takes the event: the same
//! road, not a stop.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::support::*;
use rdkafka::admin::{AdminOptions, NewTopic, TopicReplication};

/// What the topic accepts; librdkafka's own limit (message.max.bytes, 1 MB) is far above it, so the
/// producer accepts a bigger event and the broker refuses it.
const TOPIC_MAX_BYTES: &str = "4096";
const BIG_PAD: i32 = 8_000;
/// Two attempts, quick retries: a refused event is dead-lettered within seconds.
const QUICK_DEAD_LETTERS: &[&str] = &[
    "--max-attempts",
    "2",
    "--retry-base",
    "200ms",
    "--retry-cap",
    "500ms",
];

async fn create_small_topic(brokers: &str) {
    let topic = NewTopic::new(TOPIC, 1, TopicReplication::Fixed(1))
        .set("max.message.bytes", TOPIC_MAX_BYTES);
    create_topic(brokers, topic).await;
}

/// One event of `aggregate` inside `tx`, `pad` bytes of payload padding.
async fn insert(tx: &tokio_postgres::Transaction<'_>, aggregate: &str, pad: i32) -> uuid::Uuid {
    let id = uuid::Uuid::new_v4();
    tx.execute(
        "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
         VALUES ($1, 'Order', $2, 'E', jsonb_build_object('pad', repeat('x', $3::int)))",
        &[&id, &aggregate, &pad],
    )
    .await
    .unwrap();
    id
}

/// When the event's row was dead-lettered; `None` while it is not (or has no row).
async fn dead_at(client: &tokio_postgres::Client, id: uuid::Uuid) -> Option<SystemTime> {
    client
        .query_opt(
            "SELECT dead_at FROM outbox_event WHERE event_id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .and_then(|row| row.get(0))
}

/// Deletes the rows of `ids` inside `tx`: the application keeps its outbox table empty (Debezium style).
async fn delete_rows(tx: &tokio_postgres::Transaction<'_>, ids: &[uuid::Uuid]) {
    tx.execute("DELETE FROM outbox_event WHERE event_id = ANY($1)", &[&ids])
        .await
        .unwrap();
}

/// Event ids of `aggregate` in partition order, first occurrences only.
fn first_occurrences(records: &[Record], aggregate: &str) -> Vec<String> {
    let mut ids: Vec<String> = Vec::new();
    for record in records
        .iter()
        .filter(|r| r.key.as_deref() == Some(aggregate))
    {
        let id = record.headers["event_id"].clone();
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}

/// The CreateTime (ms) of the first record of `id`.
fn reached_kafka_ms(records: &[Record], id: uuid::Uuid) -> i64 {
    records
        .iter()
        .find(|r| r.headers["event_id"] == id.to_string())
        .and_then(|r| r.timestamp)
        .expect("record without a timestamp")
}

fn millis(time: SystemTime) -> i64 {
    time.duration_since(UNIX_EPOCH).unwrap().as_millis() as i64
}

/// At most 2 sessions the CDC path ended and restarted for `what`.
fn assert_few_restarts(log: &str, what: &str) {
    let restarts = log
        .matches("replication session ended; reconnecting")
        .count();
    println!("{what}: {restarts} session restarts");
    assert!(
        restarts <= 2,
        "{restarts} session restarts for {what}:
{log}"
    );
}

/// The scenario of both paths: in one transaction A1, A2 (larger than the topic accepts), A3 and B1, all in
/// one partition (so the broker refuses the batch they share whole); then A4 and B2. A2 is dead-lettered
/// once refused alone; everything else is published, A's later events only after A2 died. `deleted`: each
/// transaction deletes its own rows (the application keeps the table empty): the stream alone has them.
async fn a_refused_event_dies_alone_and_its_aggregate_waits(
    mode: &[&str],
    deleted: bool,
) -> String {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    create_small_topic(&brokers).await;
    let mut args = run_args(&url, &brokers);
    args.extend_from_slice(mode);
    args.extend_from_slice(QUICK_DEAD_LETTERS);
    let outboxd = Outboxd::spawn(&args);
    let mut client = pg.client().await;
    if !mode.contains(&"poll") {
        wait_slot_active(&client, "outboxd").await;
    }
    let tx = client.transaction().await.unwrap();
    let a1 = insert(&tx, "A", 10).await;
    let a2 = insert(&tx, "A", BIG_PAD).await;
    let a3 = insert(&tx, "A", 10).await;
    let b1 = insert(&tx, "B", 10).await;
    if deleted {
        delete_rows(&tx, &[a1, a2, a3, b1]).await;
    }
    tx.commit().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let a4 = insert(&tx, "A", 10).await;
    let b2 = insert(&tx, "B", 10).await;
    if deleted {
        delete_rows(&tx, &[a4, b2]).await;
    }
    tx.commit().await.unwrap();

    if deleted {
        // Nothing is in the table until outboxd writes the refused events back for the polling path.
        wait_for_async(
            "A2 to be dead-lettered",
            Duration::from_secs(120),
            || async { dead_at(&client, a2).await.map(|_| ()) },
        )
        .await;
    }
    wait_settled(&client, Duration::from_secs(120)).await;
    let log = outboxd.log_text();
    let died = dead_at(&client, a2)
        .await
        .unwrap_or_else(|| panic!("A2 was not dead-lettered:\n{log}"));
    assert_eq!(
        attempts_of(&client, a2).await,
        1,
        "A2, refused alone for its size, died at once (its batch-mates were delivered)"
    );
    for (name, id) in [("A1", a1), ("A3", a3), ("A4", a4), ("B1", b1), ("B2", b2)] {
        assert!(
            dead_at(&client, id).await.is_none(),
            "{name} was dead-lettered, though only A2 is too large:\n{log}"
        );
    }
    let records = consume_all(&brokers, &[TOPIC], 5, Duration::from_secs(60));
    assert_eq!(
        first_occurrences(&records, "A"),
        [a1.to_string(), a3.to_string(), a4.to_string()],
        "A's events in order, without the refused one"
    );
    assert_eq!(
        first_occurrences(&records, "B"),
        [b1.to_string(), b2.to_string()]
    );
    // A later event of A reached Kafka only once A2 had died (not while A2 was still being retried).
    assert!(
        reached_kafka_ms(&records, a3) >= millis(died),
        "A3 reached Kafka before A2 was dead-lettered"
    );
    log
}

#[tokio::test(flavor = "multi_thread")]
async fn an_event_the_broker_refuses_after_hand_over_is_dead_lettered_in_order_by_the_stream() {
    let log = a_refused_event_dies_alone_and_its_aggregate_waits(&[], false).await;
    assert_few_restarts(&log, "one refused event");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_batch_whose_rows_their_own_transaction_deleted_is_delivered_but_the_event_too_large(
) {
    let log = a_refused_event_dies_alone_and_its_aggregate_waits(&[], true).await;
    assert_few_restarts(&log, "one refused event, rows deleted");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_batch_whose_rows_are_gone_is_delivered_in_order_under_exactly_once() {
    let log =
        a_refused_event_dies_alone_and_its_aggregate_waits(&["--delivery", "exactly-once"], true)
            .await;
    assert_few_restarts(&log, "one refused event, rows deleted, exactly once");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_refused_whole_for_one_event_dead_letters_only_that_event_when_polling() {
    a_refused_event_dies_alone_and_its_aggregate_waits(&["--mode", "poll"], false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_topic_deleted_while_running_is_created_again() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    let mut client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    insert_events(&mut client, 0, 5, 4, 5, None).await;
    wait_all_published(&client, Duration::from_secs(60)).await;

    let results = admin(&brokers)
        .delete_topics(&[TOPIC], &AdminOptions::new())
        .await
        .expect("cannot delete topic");
    for result in results {
        result.expect("cannot delete topic");
    }
    let (committed, _) = insert_events(&mut client, 5, 10, 4, 5, None).await;
    wait_all_published(&client, Duration::from_secs(180)).await;
    // What reached the topic before it was deleted is gone with it; everything after is in the new one.
    verify_delivery(&brokers, &committed, &[], 60, "after the topic was deleted");
    let log = outboxd.log_text();
    assert_few_restarts(&log, "one deleted topic");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_topic_the_principal_may_not_write_is_retried_then_dead_lettered_while_others_flow() {
    let pg = Postgres::start();
    migrate(&pg);
    let broker = SecureBroker::start();
    let password = "outboxd-pw-3c9d";
    broker.add_user("outboxd", password);
    // It may write outbox.Order, which exists, but not create it (outboxd's CreateTopics is refused).
    create_topic(
        &broker.plaintext_addr(),
        NewTopic::new(TOPIC, 3, TopicReplication::Fixed(1)),
    )
    .await;
    broker.allow("outboxd", &["WRITE"], "TOPIC", TOPIC);
    // It may create outbox.Forbidden (so nothing fails before the producer accepts the events), not write it.
    broker.allow("outboxd", &["CREATE"], "TOPIC", "outbox.Forbidden");
    let (url, brokers) = (pg.url(), broker.addr());
    let options = SecureBroker::kafka_options("outboxd", password, &broker.ca);
    let mut args = run_args(&url, &brokers);
    args.extend(options.iter().map(String::as_str));
    args.extend_from_slice(QUICK_DEAD_LETTERS);
    let outboxd = Outboxd::spawn(&args);
    let mut client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    let insert = |aggregate_type: &'static str, aggregate: &'static str| {
        let client = &client;
        async move {
            let id = uuid::Uuid::new_v4();
            client
                .execute(
                    "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
                     VALUES ($1, $2, $3, 'E', '{}')",
                    &[&id, &aggregate_type, &aggregate],
                )
                .await
                .unwrap();
            id
        }
    };
    let (mut o1, mut o2) = (Vec::new(), Vec::new());
    let mut forbidden = Vec::new();
    for round in 0..3 {
        o1.push(insert("Order", "o1").await.to_string());
        forbidden.push(insert("Forbidden", "f1").await);
        forbidden.push(insert("Forbidden", if round == 0 { "f1" } else { "f2" }).await);
        o2.push(insert("Order", "o2").await.to_string());
    }
    let (committed, _) = insert_events(&mut client, 0, 10, 4, 5, None).await;
    wait_settled(&client, Duration::from_secs(120)).await;
    let log = outboxd.log_text();
    for id in &forbidden {
        assert!(
            dead_at(&client, *id).await.is_some(),
            "an event for the forbidden topic was not dead-lettered:\n{log}"
        );
    }
    verify_delivery(
        &broker.plaintext_addr(),
        &committed,
        &[],
        120,
        "the writable topic",
    );
    // The writable topic's events interleaved with the refused ones: delivered, each aggregate in order.
    let records = consume_all(
        &broker.plaintext_addr(),
        &[TOPIC],
        o1.len() + o2.len() + committed.len(),
        Duration::from_secs(60),
    );
    assert_eq!(first_occurrences(&records, "o1"), o1, "{log}");
    assert_eq!(first_occurrences(&records, "o2"), o2, "{log}");
    assert_few_restarts(&log, "a topic the principal may not write");
}

/// Inserts one event of `aggregate_type`/`aggregate` per id, each transaction deleting its own rows (the
/// application keeps its outbox table empty).
async fn insert_deleted(
    client: &tokio_postgres::Client,
    aggregate_type: &str,
    ids: &[(uuid::Uuid, String)],
) {
    let values: Vec<String> = ids
        .iter()
        .map(|(id, aggregate)| format!("('{id}', '{aggregate_type}', '{aggregate}', 'E', '{{}}')"))
        .collect();
    let list: Vec<String> = ids.iter().map(|(id, _)| format!("'{id}'")).collect();
    client
        .batch_execute(&format!(
            "BEGIN;
             INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload) VALUES {};
             DELETE FROM outbox_event WHERE event_id IN ({});
             COMMIT;",
            values.join(", "),
            list.join(", ")
        ))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn an_event_of_a_refused_topic_whose_row_is_gone_holds_only_its_topic() {
    // The application deletes its outbox rows in the inserting transaction. Events of a topic the principal
    // may not write are written back for the polling path, which retries them; the slot keeps moving, and
    // every other topic keeps flowing.
    let pg = Postgres::start();
    migrate(&pg);
    let broker = SecureBroker::start();
    let password = "outboxd-pw-8e1f";
    broker.add_user("outboxd", password);
    broker.allow("outboxd", &["WRITE", "CREATE"], "TOPIC", TOPIC);
    broker.allow("outboxd", &["CREATE"], "TOPIC", "outbox.Forbidden");
    let (url, brokers) = (pg.url(), broker.addr());
    let options = SecureBroker::kafka_options("outboxd", password, &broker.ca);
    let mut args = run_args(&url, &brokers);
    args.extend(options.iter().map(String::as_str));
    // Retried often and never dead-lettered within the test, so that the grant below is what delivers them.
    args.extend_from_slice(&[
        "--max-attempts",
        "1000",
        "--retry-base",
        "200ms",
        "--retry-cap",
        "1s",
    ]);
    let outboxd = Outboxd::spawn(&args);
    let client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    let forbidden: Vec<(uuid::Uuid, String)> = (0..3)
        .map(|_| (uuid::Uuid::new_v4(), "f1".to_string()))
        .collect();
    for event in &forbidden {
        insert_deleted(&client, "Forbidden", std::slice::from_ref(event)).await;
    }
    // 10,000 events of another topic, 50 per transaction, rows deleted too.
    let mut orders = Vec::new();
    for txn in 0..200 {
        let batch: Vec<(uuid::Uuid, String)> = (0..50)
            .map(|n| (uuid::Uuid::new_v4(), format!("o{}", (txn * 50 + n) % 500)))
            .collect();
        insert_deleted(&client, "Order", &batch).await;
        orders.extend(batch);
    }
    let records = consume_all(
        &broker.plaintext_addr(),
        &[TOPIC],
        orders.len(),
        Duration::from_secs(240),
    );
    let mut seen: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for record in &records {
        *seen.entry(record.headers["event_id"].as_str()).or_default() += 1;
    }
    let log = outboxd.log_text();
    let missing = orders
        .iter()
        .filter(|(id, _)| !seen.contains_key(id.to_string().as_str()))
        .count();
    assert_eq!(missing, 0, "events of the writable topic missing:\n{log}");
    let most = seen.values().copied().max().unwrap_or(0);
    assert!(
        most <= 2,
        "an event of the writable topic is in Kafka {most} times"
    );
    // The slot confirmed past the refused events: its lag is back under 1 MiB.
    wait_for_async(
        "the slot's lag to drop under 1 MiB",
        Duration::from_secs(60),
        || async {
            let lag: i64 = client
                .query_one(
                    "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::int8
                 FROM pg_replication_slots WHERE slot_name = 'outboxd'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            (lag < 1 << 20).then_some(())
        },
    )
    .await;
    assert_few_restarts(&log, "a refused topic whose events have no rows");
    // The refused events wait in the polling path; once the principal may write their topic, they arrive.
    broker.allow("outboxd", &["WRITE"], "TOPIC", "outbox.Forbidden");
    let records = consume_all(
        &broker.plaintext_addr(),
        &["outbox.Forbidden"],
        forbidden.len(),
        Duration::from_secs(180),
    );
    let log = outboxd.log_text();
    let ids: Vec<String> = records
        .iter()
        .map(|r| r.headers["event_id"].clone())
        .collect();
    for (id, _) in &forbidden {
        assert!(
            ids.contains(&id.to_string()),
            "event {id} (row deleted by its own transaction) never reached Kafka:\n{log}"
        );
    }
    assert_eq!(
        first_occurrences(&records, "f1"),
        forbidden
            .iter()
            .map(|(id, _)| id.to_string())
            .collect::<Vec<_>>(),
        "in order"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_aborted_transaction_never_lets_a_later_batch_mate_overtake_under_exactly_once() {
    // Eight rounds of: e1 of aggregate A_i, then (a batch apart) e2 of A_i in one transaction with an event
    // of B_i too large for the topic, so that the broker refuses the batch {e2, B_i} whole and the Kafka
    // transaction holding e1 aborts. A read_committed reader must see each A_i's e1 before its e2 (the
    // review saw e2 first for 4 of 20 aggregates).
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    create_small_topic(&brokers).await;
    let mut args = run_args(&url, &brokers);
    args.extend_from_slice(&["--delivery", "exactly-once", "--poll-interval", "10ms"]);
    args.extend_from_slice(QUICK_DEAD_LETTERS);
    let outboxd = Outboxd::spawn(&args);
    let mut client = pg.client().await;
    wait_slot_active(&client, "outboxd").await;
    // A first transaction registers the topic with the producer's transactions (until then librdkafka
    // holds every event back, and the rounds below would go out in one batch).
    let tx = client.transaction().await.unwrap();
    insert(&tx, "warm-up", 10).await;
    tx.commit().await.unwrap();
    wait_all_published(&client, Duration::from_secs(60)).await;
    let mut expected = Vec::new();
    for round in 0..8 {
        let aggregate = format!("A{round}");
        let tx = client.transaction().await.unwrap();
        let e1 = insert(&tx, &aggregate, 10).await;
        tx.commit().await.unwrap();
        // Longer than librdkafka's linger (5 ms), shorter than --transaction-interval (100 ms): e1 goes
        // out in a batch of its own, in the same Kafka transaction as the next one.
        tokio::time::sleep(Duration::from_millis(30)).await;
        let tx = client.transaction().await.unwrap();
        let e2 = insert(&tx, &aggregate, 10).await;
        insert(&tx, &format!("B{round}"), BIG_PAD).await;
        tx.commit().await.unwrap();
        // Each round meets a streaming session (not a backlog re-sent after the last round's refusal,
        // which would go out in one batch with e1).
        wait_for_async("the round's events to be published", Duration::from_secs(120), || async {
            let published: i64 = client
                .query_one(
                    "SELECT count(*) FROM outbox_event WHERE event_id = ANY($1) AND published_at IS NOT NULL",
                    &[&vec![e1, e2]],
                )
                .await
                .unwrap()
                .get(0);
            (published == 2).then_some(())
        })
        .await;
        expected.push((aggregate, vec![e1.to_string(), e2.to_string()]));
    }
    wait_settled(&client, Duration::from_secs(180)).await;
    let records = consume_all(&brokers, &[TOPIC], 17, Duration::from_secs(60));
    let log = outboxd.log_text();
    let reordered: Vec<&String> = expected
        .iter()
        .filter(|(aggregate, ids)| first_occurrences(&records, aggregate) != *ids)
        .map(|(aggregate, _)| aggregate)
        .collect();
    assert!(
        reordered.is_empty(),
        "aggregates whose e2 a read_committed reader saw before e1 (or missing): {reordered:?}\n{log}"
    );
}

/// One event of `aggregate_type` and `aggregate`, committed on its own.
async fn insert_typed(
    client: &tokio_postgres::Client,
    aggregate_type: &str,
    aggregate: &str,
) -> uuid::Uuid {
    let id = uuid::Uuid::new_v4();
    client
        .execute(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             VALUES ($1, $2, $3, 'E', '{}')",
            &[&id, &aggregate_type, &aggregate],
        )
        .await
        .unwrap();
    id
}

/// Waits until every row is published or dead-lettered, failing at once when outboxd exits meanwhile.
async fn wait_settled_while_running(client: &tokio_postgres::Client, outboxd: &mut Outboxd) {
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(status) = outboxd.try_wait() {
            panic!(
                "outboxd exited ({status}) instead of dead-lettering:\n{}",
                outboxd.log_text()
            );
        }
        let waiting: i64 = client
            .query_one(
                "SELECT count(*) FROM outbox_event WHERE published_at IS NULL AND dead_at IS NULL",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if waiting == 0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "rows still waiting after 120 s:\n{}",
            outboxd.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Aggregate types `Order Line` and `Order.Line` give topics `outbox.Order_Line` and `outbox.Order.Line`, which
/// Kafka takes for one name ('.' and '_' collide): once the first exists, the second cannot be created.
/// Its events are retried and dead-lettered (into the dead-letter topic too), while outboxd keeps running and
/// every other topic flows, `outbox.Order_Line` included.
async fn a_topic_kafka_refuses_to_create_is_dead_lettered_while_others_flow(
    mode: &[&str],
) -> String {
    const DEAD_LETTERS: &str = "outbox.dead";
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut args = run_args(&url, &brokers);
    args.extend_from_slice(mode);
    args.extend_from_slice(QUICK_DEAD_LETTERS);
    args.extend(["--dead-letter-topic", DEAD_LETTERS]);
    let mut outboxd = Outboxd::spawn(&args);
    let mut client = pg.client().await;
    if mode.is_empty() {
        wait_slot_active(&client, "outboxd").await;
    }
    let line = insert_typed(&client, "Order Line", "l1").await;
    wait_for_async(
        "the first Order Line event to be published (its topic created)",
        Duration::from_secs(60),
        || async { (unpublished(&client).await == 0).then_some(()) },
    )
    .await;

    let colliding = [
        insert_typed(&client, "Order.Line", "c1").await,
        insert_typed(&client, "Order.Line", "c1").await,
        insert_typed(&client, "Order.Line", "c2").await,
    ];
    let (committed, rolled_back) = insert_events(&mut client, 0, 10, 4, 5, Some(7)).await;
    let line_after = insert_typed(&client, "Order Line", "l1").await;
    wait_settled_while_running(&client, &mut outboxd).await;
    let log = outboxd.log_text();

    for id in colliding {
        assert!(
            dead_at(&client, id).await.is_some(),
            "an event of the topic Kafka refuses to create was not dead-lettered:\n{log}"
        );
        assert_eq!(
            attempts_of(&client, id).await,
            2,
            "tried --max-attempts times before it died"
        );
    }
    assert_eq!(dead_count(&client).await, colliding.len() as i64, "{log}");
    verify_delivery(&brokers, &committed, &rolled_back, 60, "the other topic");
    let lines = consume_all(&brokers, &["outbox.Order_Line"], 2, Duration::from_secs(60));
    assert_eq!(
        first_occurrences(&lines, "l1"),
        [line.to_string(), line_after.to_string()],
        "the topic it collides with flows"
    );
    let dead_letters = consume_all(
        &brokers,
        &[DEAD_LETTERS],
        colliding.len(),
        Duration::from_secs(60),
    );
    for id in colliding {
        let record = dead_letters
            .iter()
            .find(|r| r.headers["event_id"] == id.to_string())
            .unwrap_or_else(|| panic!("event {id} is not in the dead-letter topic:\n{log}"));
        assert!(
            record.headers["error"].contains("outbox.Order.Line"),
            "{:?}",
            record.headers
        );
    }
    assert!(outboxd.try_wait().is_none(), "outboxd stopped:\n{log}");
    log
}

#[tokio::test(flavor = "multi_thread")]
async fn a_topic_kafka_refuses_to_create_is_dead_lettered_by_the_stream_while_others_flow() {
    let log = a_topic_kafka_refuses_to_create_is_dead_lettered_while_others_flow(&[]).await;
    println!("{log}");
    assert_few_restarts(&log, "a topic Kafka refuses to create");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_topic_kafka_refuses_to_create_is_dead_lettered_when_polling_while_others_flow() {
    a_topic_kafka_refuses_to_create_is_dead_lettered_while_others_flow(&["--mode", "poll"]).await;
}

/// On a table without polling columns nothing can retry or dead-letter such an event: outboxd stops, naming
/// the event, the topic and what to fix.
#[tokio::test(flavor = "multi_thread")]
async fn a_topic_kafka_refuses_to_create_stops_outboxd_on_a_table_without_polling_columns() {
    let pg = Postgres::start();
    let broker = Broker::start();
    let client = pg.client().await;
    client.batch_execute(CDC_ONLY_TABLE).await.unwrap();
    let (url, brokers) = (pg.url(), broker.addr());
    migrate_with(&url, &[]);
    let mut outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_slot_active(&client, "outboxd").await;
    insert_typed(&client, "Order Line", "l1").await;
    wait_for(
        "topic outbox.Order_Line to be created",
        Duration::from_secs(60),
        || {
            outboxd
                .log_text()
                .contains("outbox.Order_Line")
                .then_some(())
        },
    );
    let colliding = insert_typed(&client, "Order.Line", "c1").await;
    let status = outboxd.wait_exit();
    let log = outboxd.log_text();
    assert!(!status.success(), "{log}");
    for expected in [
        colliding.to_string().as_str(),
        "outbox.Order.Line",
        "--topic",
    ] {
        assert!(log.contains(expected), "{expected:?} in:\n{log}");
    }
}
