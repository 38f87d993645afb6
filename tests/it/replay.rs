//! `outboxd replay --published` (time travel) against Apache Kafka: 100,000 events replayed to a new topic
//! while the live stream runs (every event once, in each aggregate's order, at no more than the rate asked);
//! a replay to the live topic while the application keeps writing the same aggregates (no live event lands
//! between an aggregate's replayed ones); a claim under way while such a replay counts leases (waited for); a
//! replay to a topic SIGKILLed mid-way and resumed (nothing skipped, at most one batch sent twice).

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use crate::support::*;

const REPLAY_HEADER: &str = "outboxd-replay";

/// Inserts `count` published-to-be events of aggregate type `History` over `aggregates` aggregates in one
/// transaction, in order; returns each event id's place in that order.
async fn insert_history(
    client: &tokio_postgres::Client,
    count: i64,
    aggregates: i64,
) -> HashMap<String, i64> {
    client
        .query(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'History', 'history-' || (n % $2), 'Step', jsonb_build_object('n', n)
             FROM generate_series(1, $1::int8) AS n ORDER BY n
             RETURNING event_id::text, (payload->>'n')::int8",
            &[&count, &aggregates],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// Records written to `topic`, committed or not (the sum of its partitions' high watermarks, read
/// uncommitted: a `read_committed` reader gets the last stable offsets instead).
fn records_written(brokers: &str, topic: &str) -> i64 {
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let consumer: BaseConsumer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("isolation.level", "read_uncommitted")
        .create()
        .unwrap();
    let Ok(metadata) = consumer.fetch_metadata(Some(topic), Duration::from_secs(10)) else {
        return 0;
    };
    metadata
        .topics()
        .iter()
        .flat_map(|t| t.partitions())
        .filter_map(|p| {
            consumer
                .fetch_watermarks(topic, p.id(), Duration::from_secs(10))
                .ok()
        })
        .map(|(_, high)| high)
        .sum()
}

/// Waits (up to a minute) for a row of `outbox_event_replay` where `condition` holds; returns its replay id and
/// `column`.
async fn wait_replay_row(
    client: &tokio_postgres::Client,
    what: &str,
    column: &str,
    condition: &str,
) -> (String, i64) {
    let sql = format!("SELECT replay_id, {column} FROM outbox_event_replay WHERE {condition}");
    wait_for_async(what, Duration::from_secs(60), || async {
        client
            .query_opt(&sql, &[])
            .await
            .unwrap()
            .map(|row| (row.get(0), row.get(1)))
    })
    .await
}

/// The replay id a `replay` run printed first.
fn replay_id_of(stdout: &[u8]) -> String {
    let text = String::from_utf8_lossy(stdout);
    text.split_whitespace()
        .find(|word| word.starts_with("replay-"))
        .unwrap_or_else(|| panic!("replay printed no id: {text}"))
        .to_string()
}

/// Per key, in offset order (one partition per key), the first copies' places must only grow.
fn assert_in_order_per_aggregate(records: &[&Record], place: &HashMap<String, i64>) {
    let mut by_key: HashMap<&str, Vec<&Record>> = HashMap::new();
    for record in records {
        by_key
            .entry(record.key.as_deref().unwrap_or_default())
            .or_default()
            .push(record);
    }
    for (key, mut list) in by_key {
        list.sort_by_key(|r| (r.partition, r.offset));
        let mut seen = HashSet::new();
        let mut last = i64::MIN;
        for record in list {
            let id = &record.headers["event_id"];
            if !seen.insert(id.clone()) {
                continue;
            }
            let at = place[id];
            assert!(
                at > last,
                "{key}: event {id} (place {at}) after place {last}"
            );
            last = at;
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hundred_thousand_events_replay_to_a_new_topic_in_order_while_the_live_stream_runs() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    let outboxd = Outboxd::spawn_with_env(&run_args(&url, &brokers), &[("RUST_LOG", "warn")]);
    wait_slot_active(&client, "outboxd").await;
    let count = 100_000;
    let place = insert_history(&client, count, 500).await;
    wait_all_published(&client, Duration::from_secs(300)).await;

    let writer = Writer::start(url.clone(), 1, 20);
    writer.wait_more(5, "live writes before the replay").await;
    let rate = 5_000.0;
    let started = Instant::now();
    let output = run_outboxd_async(&[
        "replay",
        "--database-url",
        &url,
        "--brokers",
        &brokers,
        "--topic-replication-factor",
        "1",
        "--published",
        "--aggregate-type",
        "History",
        "--to-topic",
        "history.replayed",
        "--rate",
        "5000",
    ])
    .await;
    let took = started.elapsed();
    assert!(output.status.success(), "{}", stderr_of(&output));
    let replay_id = replay_id_of(&output.stdout);
    writer.wait_more(5, "live writes after the replay").await;
    writer.stop().await;
    wait_all_published(&client, Duration::from_secs(120)).await;
    drop(outboxd);

    let records = consume_all(
        &brokers,
        &["history.replayed"],
        count as usize,
        Duration::from_secs(300),
    );
    let ids: HashSet<&str> = records
        .iter()
        .map(|r| r.headers["event_id"].as_str())
        .collect();
    assert_eq!(
        ids.len(),
        count as usize,
        "every History event, once or more"
    );
    assert!(
        ids.iter().all(|id| place.contains_key(*id)),
        "nothing but the History events"
    );
    assert!(
        records
            .iter()
            .all(|r| r.headers.get(REPLAY_HEADER) == Some(&replay_id)),
        "every record carries the replay's header"
    );
    let all: Vec<&Record> = records.iter().collect();
    assert_in_order_per_aggregate(&all, &place);
    // Paced: it cannot have sent faster than the rate asked.
    assert!(
        took >= Duration::from_secs_f64(count as f64 / rate),
        "{count} events at {rate}/s in {took:?}"
    );
    println!(
        "replayed {count} events to a new topic in {took:?} ({:.0}/s, --rate {rate}), {} records",
        count as f64 / took.as_secs_f64(),
        records.len()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replay_to_the_live_topic_lets_no_live_event_between_an_aggregates_replayed_ones() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    let outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_slot_active(&client, "outboxd").await;
    insert_events(&mut client, 0, 100, 3, 10, None).await;
    wait_all_published(&client, Duration::from_secs(60)).await;

    // The application keeps writing the same aggregates (order-0..9) during the replay.
    let writer = Writer::start_at(url.clone(), 1_000, 1, 10);
    writer.wait_more(20, "live writes before the replay").await;
    let output = run_outboxd_async(&[
        "replay",
        "--database-url",
        &url,
        "--published",
        "--aggregate-type",
        "Order",
    ])
    .await;
    assert!(output.status.success(), "{}", stderr_of(&output));
    let replay_id = replay_id_of(&output.stdout);
    writer.wait_more(20, "live writes after the replay").await;
    writer.stop().await;
    wait_all_published(&client, Duration::from_secs(120)).await;
    drop(outboxd);

    let (selected, total): (i64, i64) = {
        let row = client
            .query_one(
                "SELECT total, done FROM outbox_event_replay WHERE replay_id = $1 AND state = 'done'",
                &[&replay_id],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!(selected, total);
    let place: HashMap<String, i64> = client
        .query("SELECT event_id::text, position FROM outbox_event", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let records = consume_all(
        &brokers,
        &[TOPIC],
        place.len() + selected as usize,
        Duration::from_secs(120),
    );
    let replayed: Vec<&Record> = records
        .iter()
        .filter(|r| r.headers.get(REPLAY_HEADER) == Some(&replay_id))
        .collect();
    let replayed_ids: HashSet<&str> = replayed
        .iter()
        .map(|r| r.headers["event_id"].as_str())
        .collect();
    assert_eq!(
        replayed_ids.len() as i64,
        selected,
        "every selected event republished"
    );
    assert_in_order_per_aggregate(&replayed, &place);
    // Per aggregate, between its first and last replayed record, only replayed records of it.
    let mut by_key: HashMap<&str, Vec<&Record>> = HashMap::new();
    for record in &records {
        by_key
            .entry(record.key.as_deref().unwrap_or_default())
            .or_default()
            .push(record);
    }
    let mut interleaved = Vec::new();
    for (key, mut list) in by_key {
        list.sort_by_key(|r| (r.partition, r.offset));
        let is_replayed = |r: &&Record| r.headers.get(REPLAY_HEADER) == Some(&replay_id);
        let (Some(first), Some(last)) = (
            list.iter().position(is_replayed),
            list.iter().rposition(is_replayed),
        ) else {
            continue;
        };
        interleaved.extend(
            list[first..=last]
                .iter()
                .filter(|r| !is_replayed(r))
                .map(|r| {
                    format!(
                        "{key}: live {} at offset {}",
                        r.headers["event_id"], r.offset
                    )
                }),
        );
    }
    assert!(
        interleaved.is_empty(),
        "live events between replayed ones: {interleaved:?}"
    );
    println!("replayed {selected} events to the live topic next to live writes; none interleaved");

    // What would let live events between replayed ones is refused, each with its fix.
    for (extra, says) in [
        (
            vec!["--to-topic", TOPIC, "--brokers", brokers.as_str()],
            "around the per-aggregate gate",
        ),
        (
            vec!["--slot", "elsewhere"],
            "no logical slot named elsewhere",
        ),
        (
            vec!["--poll-order", "none"],
            "--poll-order none keeps no order",
        ),
        // --where can read, never write: evaluated in a read-only transaction, inside parentheses.
        (
            vec!["--where", "nextval('outbox_event_position_seq') > 0"],
            "read-only transaction",
        ),
        (
            vec!["--where", "true); DELETE FROM outbox_event; SELECT (true"],
            "cannot select events",
        ),
    ] {
        let mut args = vec!["replay", "--database-url", url.as_str(), "--published"];
        args.extend(extra);
        let output = run_outboxd(&args);
        assert!(!output.status.success(), "{args:?} was accepted");
        assert!(
            stderr_of(&output).contains(says),
            "{args:?}: {}",
            stderr_of(&output)
        );
    }
    assert_eq!(
        events_in_table(&client, "position").await.len(),
        place.len(),
        "nothing deleted"
    );
    assert_eq!(unpublished(&client).await, 0, "nothing handed back");
    let status = run_outboxd(&["status", "--database-url", &url, "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(
        status["replays"],
        serde_json::json!([]),
        "a refused replay is not left under way: {status}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replay_waiting_for_the_stream_can_be_cancelled_and_its_events_count_as_published_again()
{
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    let mut outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_slot_active(&client, "outboxd").await;
    insert_events(&mut client, 0, 10, 3, 4, None).await;
    wait_all_published(&client, Duration::from_secs(60)).await;
    outboxd.kill();

    // No outboxd streams the slot: the replay holds the events and waits for the stream.
    let mut replay = Outboxd::spawn(&["replay", "--database-url", &url, "--published"]);
    let (replay_id, held) = wait_replay_row(
        &client,
        "the replay holding its events",
        "total",
        "state = 'held'",
    )
    .await;
    assert_eq!(unpublished(&client).await, held);
    let status = run_outboxd(&["status", "--database-url", &url, "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["replays"][0]["state"], "held", "{status}");

    // A second replay to the live topics is refused while this one is under way.
    let second = run_outboxd(&["replay", "--database-url", &url, "--published"]);
    assert!(!second.status.success());
    assert!(
        stderr_of(&second).contains(&format!(
            "replay {replay_id} to the live topics is under way"
        )),
        "{}",
        stderr_of(&second)
    );

    // Killed and resumed with another --mode: it still waits for the stream it was started with (taking
    // `--mode poll` at its word would release the events with nothing having passed the hand-back).
    replay.kill();
    let mut replay = Outboxd::spawn(&[
        "replay",
        "--database-url",
        &url,
        "--mode",
        "poll",
        "--resume",
        &replay_id,
    ]);
    wait_for(
        "the resumed replay waiting for the stream",
        Duration::from_secs(60),
        || {
            replay
                .log_text()
                .contains("no outboxd streams the slot")
                .then_some(())
        },
    );
    assert_eq!(
        unpublished(&client).await,
        held,
        "still held: nothing passed the hand-back"
    );

    let output = run_outboxd(&["replay", "--database-url", &url, "--cancel", &replay_id]);
    assert!(output.status.success(), "{}", stderr_of(&output));
    assert_eq!(
        unpublished(&client).await,
        0,
        "the held events count as published again"
    );
    let stopped = replay.wait_exit();
    assert!(!stopped.success(), "the waiting replay stops");
    assert!(
        replay.log_text().contains("was cancelled"),
        "{}",
        replay.log_text()
    );
    let status = run_outboxd(&["status", "--database-url", &url, "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["replays"], serde_json::json!([]), "{status}");
    let resumed = run_outboxd(&["replay", "--database-url", &url, "--resume", &replay_id]);
    assert!(
        stderr_of(&resumed).contains("was cancelled"),
        "{}",
        stderr_of(&resumed)
    );
}

/// A claim under way when the replay looks for leases (its snapshot taken before the hand-back, its lease on a
/// live event of a held aggregate not yet committed) is waited for: the replay counts the leases under the
/// claim lock. Counting without it, the replay missed that lease and released its events while the live one
/// was still on its way, so a replayed event of the aggregate could be claimed beside it.
#[tokio::test(flavor = "multi_thread")]
async fn a_replay_waits_for_a_claim_under_way_before_releasing_its_events() {
    let (pg, _broker) = migrated_stack();
    let url = pg.url();
    let mut client = pg.client().await;
    insert_events(&mut client, 0, 1, 3, 1, None).await;
    client
        .batch_execute("UPDATE outbox_event SET published_at = now()")
        .await
        .unwrap();
    let (live, _) = insert_events(&mut client, 1, 1, 1, 1, None).await;
    let live_id = live[0].event_id;

    // A claim under way: the claim lock held, the live event leased, not committed yet.
    let mut claimer = pg.client().await;
    let claim = claimer.transaction().await.unwrap();
    claim
        .execute(
            "SELECT pg_advisory_xact_lock(1869968482, hashtext('outboxd.claim.public.outbox_event'))",
            &[],
        )
        .await
        .unwrap();
    claim
        .execute(
            "UPDATE outbox_event SET lease_token = gen_random_uuid(), lease_until = now() + interval '1 hour'
             WHERE event_id = $1",
            &[&live_id],
        )
        .await
        .unwrap();

    let mut replay = Outboxd::spawn(&[
        "replay",
        "--database-url",
        &url,
        "--mode",
        "poll",
        "--published",
    ]);
    let released = "SELECT count(*) FROM outbox_event WHERE published_at IS NULL AND available_at <> 'infinity' AND event_id <> $1";
    // Polled until the replay waits for the claim lock; releasing its events, or ending, fails the test.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let freed: i64 = client
            .query_one(released, &[&live_id])
            .await
            .unwrap()
            .get(0);
        assert_eq!(
            freed, 0,
            "the replay released its events while a claim was under way"
        );
        assert!(
            replay.try_wait().is_none(),
            "the replay ended: {}",
            replay.log_text()
        );
        let waiting: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND wait_event = 'advisory'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if waiting > 0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the replay never waited for the claim lock"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // The claim commits: its lease now holds the replay back, until the live event is published.
    claim.commit().await.unwrap();
    client
        .execute(
            "UPDATE outbox_event SET published_at = now(), lease_token = NULL, lease_until = NULL WHERE event_id = $1",
            &[&live_id],
        )
        .await
        .unwrap();
    wait_for_async(
        "the replayed events released once the live one was published",
        Duration::from_secs(60),
        || async {
            let freed: i64 = client
                .query_one(released, &[&live_id])
                .await
                .unwrap()
                .get(0);
            (freed == 3).then_some(())
        },
    )
    .await;
    // Nothing runs the polling path here: the replay would wait for their republication.
    replay.kill();
}

#[tokio::test(flavor = "multi_thread")]
async fn a_replay_killed_mid_way_resumes_with_nothing_skipped_and_at_most_one_batch_again() {
    let again = kill_and_resume(&[]).await;
    assert!(
        again <= 1_000,
        "{again} records sent twice: more than one batch"
    );
}

/// With `--delivery exactly-once` each batch is a Kafka transaction with the replay's progress: a
/// `read_committed` reader sees every event once, however the replay was killed.
#[tokio::test(flavor = "multi_thread")]
async fn a_replay_killed_mid_way_under_exactly_once_resumes_with_every_event_once() {
    let again = kill_and_resume(&["--delivery", "exactly-once"]).await;
    assert_eq!(again, 0, "records a read_committed reader saw twice");
}

/// Replays 6,000 events to a topic at 200/s, SIGKILLs it in the middle of a batch, lets a live replay hand
/// events back meanwhile, resumes it; checks that nothing was skipped and the order per aggregate. Returns
/// how many records were read twice.
async fn kill_and_resume(delivery: &[&str]) -> usize {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    let outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_slot_active(&client, "outboxd").await;
    let count = 6_000;
    let place = insert_history(&client, count, 50).await;
    wait_all_published(&client, Duration::from_secs(120)).await;
    drop(outboxd);

    let mut common = vec![
        "--database-url",
        url.as_str(),
        "--brokers",
        brokers.as_str(),
        "--topic-replication-factor",
        "1",
    ];
    common.extend(delivery);
    let mut first = vec!["replay"];
    first.extend(&common);
    first.extend([
        "--published",
        "--to-topic",
        "history.again",
        "--rate",
        "200",
    ]);
    let mut replay = Outboxd::spawn(&first);
    let (replay_id, first_batch) = wait_replay_row(
        &client,
        "the replay past its first batch",
        "done",
        "done >= 1000",
    )
    .await;
    // Killed in the middle of a batch the broker already holds part of (under exactly-once: in a Kafka
    // transaction never committed).
    wait_for(
        "records of the next batch in the topic",
        Duration::from_secs(60),
        || (records_written(&brokers, "history.again") >= first_batch + 200).then_some(()),
    );
    replay.kill();
    let done_at_kill: i64 = client
        .query_one(
            "SELECT done FROM outbox_event_replay WHERE replay_id = $1",
            &[&replay_id],
        )
        .await
        .unwrap()
        .get(0);
    assert!(
        done_at_kill < count,
        "killed mid-way ({done_at_kill} of {count})"
    );
    assert!(
        records_written(&brokers, "history.again") >= done_at_kill + 100,
        "the broker holds records of the batch cut short"
    );
    // `status` names the interrupted replay and how far it got.
    let status = run_outboxd(&["status", "--database-url", &url, "--json"]);
    let status: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    let under_way = &status["replays"][0];
    assert_eq!(under_way["replay_id"], replay_id.as_str(), "{status}");
    assert_eq!(under_way["state"], "sending", "{status}");
    assert_eq!(under_way["done"], done_at_kill, "{status}");
    assert_eq!(under_way["to_topic"], "history.again", "{status}");

    // Meanwhile a replay to the live topics hands an aggregate's events back (`--mode poll`: outboxd is
    // stopped, and nothing publishes them): a replay to another topic must not skip them for being unpublished.
    let mut live = vec!["replay", "--database-url", url.as_str(), "--mode", "poll"];
    live.extend(["--published", "--aggregate-id", "history-7"]);
    let mut live = Outboxd::spawn(&live);
    let (_, handed_back) = wait_replay_row(
        &client,
        "the live replay released",
        "total",
        "state = 'released'",
    )
    .await;
    assert!(handed_back > 0);
    assert_eq!(unpublished(&client).await, handed_back);

    let mut resume = vec!["replay"];
    resume.extend(&common);
    resume.extend(["--resume", replay_id.as_str()]);
    let output = run_outboxd_async(&resume).await;
    assert!(output.status.success(), "{}", stderr_of(&output));
    live.kill();

    let records = consume_all(
        &brokers,
        &["history.again"],
        count as usize,
        Duration::from_secs(120),
    );
    let ids: HashSet<&str> = records
        .iter()
        .map(|r| r.headers["event_id"].as_str())
        .collect();
    assert_eq!(
        ids.len(),
        count as usize,
        "nothing skipped (not the events handed back meanwhile either)"
    );
    let again = records.len() - ids.len();
    let all: Vec<&Record> = records.iter().collect();
    assert_in_order_per_aggregate(&all, &place);
    println!(
        "killed at {done_at_kill} of {count} {delivery:?}; after --resume: {again} sent twice"
    );
    again
}

/// Events retention moved to its archive (`--archive-table`) replay from there to a topic, each once, in each
/// aggregate's order.
#[tokio::test(flavor = "multi_thread")]
async fn archived_events_replay_from_the_archive_to_a_topic() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    let mut args = run_args(&url, &brokers);
    args.extend([
        "--retention",
        "1s",
        "--retention-interval",
        "200ms",
        "--archive-table",
        "outbox_archive",
    ]);
    let outboxd = Outboxd::spawn(&args);
    wait_slot_active(&client, "outboxd").await;
    let count = 500;
    let place = insert_history(&client, count, 20).await;
    wait_for_async("every event archived", Duration::from_secs(120), || async {
        let archived: i64 = client
            .query_one("SELECT count(*) FROM outbox_archive", &[])
            .await
            .ok()?
            .get(0);
        let left: i64 = client
            .query_one("SELECT count(*) FROM outbox_event", &[])
            .await
            .ok()?
            .get(0);
        (archived == count && left == 0).then_some(())
    })
    .await;
    drop(outboxd);

    let output = run_outboxd(&[
        "replay",
        "--database-url",
        &url,
        "--brokers",
        &brokers,
        "--topic-replication-factor",
        "1",
        "--published",
        "--from-archive",
        "outbox_archive",
        "--to-topic",
        "history.archived",
    ]);
    assert!(output.status.success(), "{}", stderr_of(&output));
    let replay_id = replay_id_of(&output.stdout);
    let records = consume_all(
        &brokers,
        &["history.archived"],
        count as usize,
        Duration::from_secs(60),
    );
    let ids: HashSet<&str> = records
        .iter()
        .map(|r| r.headers["event_id"].as_str())
        .collect();
    assert_eq!(ids.len(), count as usize, "every archived event");
    assert_eq!(records.len(), count as usize, "each once");
    assert!(records
        .iter()
        .all(|r| r.headers.get(REPLAY_HEADER) == Some(&replay_id)));
    let all: Vec<&Record> = records.iter().collect();
    assert_in_order_per_aggregate(&all, &place);

    let missing_columns = run_outboxd(&[
        "replay",
        "--database-url",
        &url,
        "--brokers",
        &brokers,
        "--published",
        "--from-archive",
        "no_such_archive",
        "--to-topic",
        "history.none",
    ]);
    assert!(
        stderr_of(&missing_columns).contains("there is no table"),
        "{}",
        stderr_of(&missing_columns)
    );
}

/// An event a replay to the live topic hands back that the broker now refuses (the topic's
/// `max.message.bytes` lowered since) is dead-lettered, not republished: the replay names it and exits 1; its
/// aggregate's other events are republished.
#[tokio::test(flavor = "multi_thread")]
async fn a_replayed_event_the_broker_now_refuses_is_dead_lettered_and_the_replay_says_so() {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    let outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_slot_active(&client, "outboxd").await;
    let big: uuid::Uuid = client
        .query(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'Order', 'refused-later', 'Step',
                    jsonb_build_object('n', n, 'pad', repeat('x', CASE WHEN n = 2 THEN 5000 ELSE 10 END))
             FROM generate_series(1, 3) AS n ORDER BY n
             RETURNING event_id",
            &[],
        )
        .await
        .unwrap()[1]
        .get(0);
    wait_all_published(&client, Duration::from_secs(60)).await;
    let alter = rdkafka::admin::AlterConfig::new(rdkafka::admin::ResourceSpecifier::Topic(TOPIC))
        .set("max.message.bytes", "2000");
    for result in admin(&brokers)
        .alter_configs([&alter], &rdkafka::admin::AdminOptions::new())
        .await
        .unwrap()
    {
        result.unwrap();
    }

    let output = run_outboxd_async(&[
        "replay",
        "--database-url",
        &url,
        "--published",
        "--aggregate-id",
        "refused-later",
    ])
    .await;
    drop(outboxd);
    assert_eq!(output.status.code(), Some(1), "{}", stderr_of(&output));
    assert!(
        stderr_of(&output).contains("1 event(s) of the replay were dead-lettered"),
        "{}",
        stderr_of(&output)
    );
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("3 event(s) selected, 2 republished"),
        "{}",
        String::from_utf8_lossy(&output.stdout)
    );
    let dead: bool = client
        .query_one(
            "SELECT dead_at IS NOT NULL FROM outbox_event WHERE event_id = $1",
            &[&big],
        )
        .await
        .unwrap()
        .get(0);
    assert!(dead, "the refused event is dead-lettered");
}
