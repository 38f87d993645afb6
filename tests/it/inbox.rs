//! The consumer's inbox, the way a service meets it: `examples/inbox_consumer.rs` reads outboxd's topic,
//! fed every event twice, and is SIGKILLed twice mid-way; each effect is applied exactly once.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::ClientConfig;

use crate::support::*;

/// The example binary, built (incrementally) as this test binary was.
fn inbox_consumer() -> PathBuf {
    let me = std::env::current_exe().unwrap();
    let profile_dir = me.parent().and_then(|deps| deps.parent()).unwrap();
    let mut build = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    build
        .args(["build", "--quiet", "--example", "inbox_consumer"])
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    if profile_dir.ends_with("release") {
        build.arg("--release");
    }
    assert!(
        build.status().unwrap().success(),
        "cannot build the example"
    );
    profile_dir.join("examples/inbox_consumer")
}

fn start(binary: &PathBuf, url: &str, brokers: &str, log: &str) -> Child {
    Command::new(binary)
        .args([
            "--brokers",
            brokers,
            "--database-url",
            url,
            "--topic",
            TOPIC,
            "--group",
            "inventory",
            "--idle-exit-secs",
            "8",
        ])
        .stdout(std::fs::File::create(log).unwrap())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("cannot start the example consumer")
}

async fn effects(client: &tokio_postgres::Client) -> (i64, i64) {
    let row = client
        .query_one(
            "SELECT count(*), count(DISTINCT event_id) FROM inventory_effect",
            &[],
        )
        .await
        .unwrap_or_else(|_| panic!("no inventory_effect table yet"));
    (row.get(0), row.get(1))
}

#[tokio::test(flavor = "multi_thread")]
async fn the_example_consumer_applies_each_effect_once_through_duplicates_and_kills() {
    let binary = inbox_consumer();
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let mut client = pg.client().await;
    let (committed, _) = insert_events(&mut client, 0, 40, 10, 20, None).await;
    let outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_all_published(&client, Duration::from_secs(60)).await;
    drop(outboxd);
    // Every event once more, as a redelivery would bring it.
    let records = consume_all(&brokers, &[TOPIC], committed.len(), Duration::from_secs(60));
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .create()
        .unwrap();
    for record in &records {
        let mut headers = OwnedHeaders::new();
        for (key, value) in &record.headers {
            headers = headers.insert(Header {
                key,
                value: Some(value.as_str()),
            });
        }
        let key = record.key.clone().unwrap_or_default();
        let payload = record.value.clone().unwrap_or_default();
        producer
            .send(
                FutureRecord::to(TOPIC)
                    .key(&key)
                    .payload(&payload)
                    .headers(headers),
                Duration::from_secs(30),
            )
            .await
            .unwrap();
    }
    let events = committed.len() as i64;
    let log_dir = scratch_dir("inbox");
    let log = |n: usize| {
        log_dir
            .join(format!("consumer-{n}.out"))
            .display()
            .to_string()
    };
    // Killed twice mid-way (between some database commit and its offset commit, at random).
    for (n, at_least) in [(0, events / 4), (1, events * 3 / 4)] {
        let mut consumer = start(&binary, &url, &brokers, &log(n));
        wait_for_async("effects applied", Duration::from_secs(120), || async {
            let applied = client
                .query_one("SELECT count(*) FROM consumed_event", &[])
                .await
                .map(|row| row.get::<_, i64>(0))
                .unwrap_or(0);
            (applied >= at_least).then_some(())
        })
        .await;
        consumer.kill().unwrap();
        consumer.wait().unwrap();
    }
    let mut last = start(&binary, &url, &brokers, &log(2));
    let status = wait_for(
        "the consumer to go idle and exit",
        Duration::from_secs(180),
        || last.try_wait().unwrap(),
    );
    assert!(status.success(), "the example consumer failed");
    let summary = std::fs::read_to_string(log(2)).unwrap();
    let (rows, distinct) = effects(&client).await;
    println!(
        "{events} events, each delivered twice, consumer killed twice: {rows} effects for {distinct} events; last run: {}",
        summary.trim()
    );
    assert_eq!(distinct, events, "an event's effect is missing");
    assert_eq!(rows, events, "an effect was applied twice");
    assert!(
        summary.contains("\"duplicates\": ") && !summary.contains("\"duplicates\": 0}"),
        "the last run saw no duplicate: the inbox was not exercised ({summary})"
    );
}

async fn record(
    client: &mut tokio_postgres::Client,
    inbox: &outboxd::inbox::Inbox,
    event_id: uuid::Uuid,
    age: Duration,
) -> outboxd::inbox::Consumed {
    let tx = client.transaction().await.unwrap();
    let consumed = inbox
        .record_created_at(&tx, event_id, std::time::SystemTime::now() - age)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    consumed
}

/// An inbox with a retention: `prune` deletes rows consumed longer ago than it, and an event re-read after
/// its row was pruned is told apart (`BeyondRetention`, nothing recorded), never applied as new; an event
/// within the retention is recorded as before.
#[tokio::test(flavor = "multi_thread")]
async fn an_event_re_read_after_its_inbox_row_expired_is_reported_not_applied_again() {
    use outboxd::inbox::{Consumed, Inbox};
    let pg = Postgres::start();
    migrate(&pg);
    let mut client = pg.client().await;
    let inbox = Inbox::new("inventory").with_retention(Duration::from_secs(3600));
    let old = uuid::Uuid::new_v4();
    assert_eq!(
        record(&mut client, &inbox, old, Duration::from_secs(60)).await,
        Consumed::Applied
    );
    assert_eq!(
        record(&mut client, &inbox, old, Duration::from_secs(60)).await,
        Consumed::Duplicate
    );
    assert_eq!(
        inbox.prune(&client, 1000).await.unwrap(),
        0,
        "consumed a minute ago"
    );
    // Two hours pass (the row is made two hours old).
    client
        .execute(
            "UPDATE consumed_event SET consumed_at = now() - interval '2 hours' WHERE event_id = $1",
            &[&old],
        )
        .await
        .unwrap();
    assert_eq!(
        record(&mut client, &inbox, old, Duration::from_secs(7260)).await,
        Consumed::Duplicate,
        "its row is still there: a duplicate"
    );
    assert_eq!(inbox.prune(&client, 1000).await.unwrap(), 1);
    assert_eq!(
        record(&mut client, &inbox, old, Duration::from_secs(7260)).await,
        Consumed::BeyondRetention,
        "re-read after its row expired"
    );
    let held: i64 = client
        .query_one(
            "SELECT count(*) FROM consumed_event WHERE event_id = $1",
            &[&old],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(held, 0, "nothing recorded for it");
    let new = uuid::Uuid::new_v4();
    assert_eq!(
        record(&mut client, &inbox, new, Duration::from_secs(5)).await,
        Consumed::Applied
    );
    assert_eq!(
        Inbox::new("other").prune(&client, 1000).await.unwrap(),
        0,
        "without a retention nothing is pruned"
    );
}
