//! The pattern's own order service, as a Java shop writes it (`examples/java-order-service/`): a Spring Boot
//! order API whose `@Transactional` methods write the order and its outbox event with
//! `NamedParameterJdbcTemplate`, and an inventory consumer on plain kafka-clients that applies each event's
//! effect with its inbox row in one transaction of its own database. Driven over HTTP against PostgreSQL,
//! Apache Kafka and outboxd, with outboxd and the consumer SIGKILLed mid-way: every confirmed order's effect
//! is applied exactly once, and no declined (rolled-back) confirmation is ever seen.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::support::*;

/// Orders placed over HTTP; phases of traffic, each with one kill in it.
const ORDERS: usize = 240;
const PHASES: usize = 6;
const TRAFFIC_THREADS: usize = 4;
/// The test card the example's payment gateway declines (`PaymentGateway.DECLINED_CARD`).
const DECLINED_CARD: &str = "4000000000000002";
const CONSUMER_GROUP: &str = "inventory";

fn example_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/java-order-service")
}

/// Builds the example with Maven (dependencies from Maven Central, cached in ~/.m2); returns the jar.
fn build_example() -> PathBuf {
    let output = Command::new("mvn")
        .args(["-q", "-B", "package", "-DskipTests"])
        .current_dir(example_dir())
        .output()
        .expect("cannot run mvn: install Maven (tests/support/install-deps.sh does)");
    assert!(
        output.status.success(),
        "the Java example does not build: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    example_dir().join("target/order-service.jar")
}

/// A Java process of the example, logging to a file; SIGKILLed on drop.
struct Java {
    child: Child,
    log: PathBuf,
}

impl Java {
    fn spawn(args: &[&str], env: &[(&str, String)], log: PathBuf) -> Self {
        let file = std::fs::File::create(&log).unwrap();
        let child = Command::new("java")
            .args(args)
            .envs(env.iter().map(|(k, v)| (k, v.as_str())))
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .expect("cannot start java");
        Java { child, log }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Java {
    fn drop(&mut self) {
        self.kill();
        if std::thread::panicking() {
            eprintln!("--- {} ---\n{}", self.log.display(), self.log_text());
        }
    }
}

fn start_consumer(jar: &Path, brokers: &str, inventory_jdbc: &str, log: PathBuf) -> Java {
    Java::spawn(
        &[
            "-Dloader.main=dev.outboxd.example.inventory.InventoryConsumer",
            "-cp",
            jar.to_str().unwrap(),
            "org.springframework.boot.loader.launch.PropertiesLauncher",
            "--brokers",
            brokers,
            "--database-url",
            inventory_jdbc,
            "--group",
            CONSUMER_GROUP,
            "--instance-id",
            "inventory-1",
            // Offsets every 2 s: a kill soon after the consumer applied something re-delivers it.
            "--commit-interval-ms",
            "2000",
        ],
        &[],
        log,
    )
}

/// What the order API answered for one order.
#[derive(Debug, Clone)]
struct Outcome {
    order_id: String,
    lines: Vec<(String, i32)>,
    /// 200 on confirm; false: 402, the payment declined and the confirmation rolled back.
    confirmed: bool,
    cancelled: bool,
}

/// Order `n`'s request: one to three lines over eight SKUs; every fifth card declined; every fourth order
/// cancelled after its confirmation (or its decline).
fn order_request(n: usize) -> (String, Vec<(String, i32)>, bool) {
    let lines: Vec<(String, i32)> = (0..1 + n % 3)
        .map(|k| {
            (
                format!("sku-{}", (n * 7 + k * 3) % 8),
                1 + ((n + k) % 4) as i32,
            )
        })
        .collect();
    let card = if n % 5 == 3 {
        DECLINED_CARD
    } else {
        "4242424242424242"
    };
    let body = serde_json::json!({
        "customerId": format!("customer-{}", n % 17),
        "card": card,
        "lines": lines.iter().map(|(sku, q)| serde_json::json!({"sku": sku, "quantity": q})).collect::<Vec<_>>(),
    });
    (body.to_string(), lines, n % 4 == 1)
}

fn post(api: &str, path: &str, body: Option<&str>) -> (u16, String) {
    http_request("POST", api, path, body)
        .unwrap_or_else(|| panic!("the order API did not answer POST {path}"))
}

/// One order through the API: place, confirm (or be declined), maybe cancel.
fn run_order(api: &str, n: usize) -> Outcome {
    let (body, lines, cancel) = order_request(n);
    let (status, placed) = post(api, "/orders", Some(&body));
    assert_eq!(status, 201, "placing order {n}: {placed}");
    let placed: serde_json::Value = serde_json::from_str(&placed).unwrap();
    let order_id = placed["orderId"].as_str().unwrap().to_string();
    let (status, answer) = post(api, &format!("/orders/{order_id}/confirm"), None);
    assert!(
        status == 200 || status == 402,
        "confirming order {n}: {status} {answer}"
    );
    let cancelled = cancel && {
        let (status, answer) = post(api, &format!("/orders/{order_id}/cancel"), None);
        assert_eq!(status, 200, "cancelling order {n}: {answer}");
        true
    };
    Outcome {
        order_id,
        lines,
        confirmed: status == 200,
        cancelled,
    }
}

/// Traffic threads taking order numbers below `allowed` (the test raises it phase by phase).
struct Traffic {
    allowed: Arc<AtomicUsize>,
    done: Arc<AtomicUsize>,
    outcomes: Arc<Mutex<Vec<Outcome>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Traffic {
    fn start(api: String) -> Self {
        let allowed = Arc::new(AtomicUsize::new(0));
        let done = Arc::new(AtomicUsize::new(0));
        let next = Arc::new(AtomicUsize::new(0));
        let outcomes = Arc::new(Mutex::new(Vec::new()));
        let threads = (0..TRAFFIC_THREADS)
            .map(|_| {
                let (api, allowed, done, next, outcomes) = (
                    api.clone(),
                    allowed.clone(),
                    done.clone(),
                    next.clone(),
                    outcomes.clone(),
                );
                std::thread::spawn(move || loop {
                    let n = next.fetch_add(1, Ordering::SeqCst);
                    if n >= ORDERS {
                        return;
                    }
                    wait_for("the next traffic phase", Duration::from_secs(600), || {
                        (n < allowed.load(Ordering::SeqCst)).then_some(())
                    });
                    let outcome = run_order(&api, n);
                    outcomes.lock().unwrap().push(outcome);
                    done.fetch_add(1, Ordering::SeqCst);
                })
            })
            .collect();
        Traffic {
            allowed,
            done,
            outcomes,
            threads,
        }
    }

    fn allow(&self, orders: usize) {
        self.allowed.store(orders, Ordering::SeqCst);
    }

    /// Waits until `orders` are through; a traffic thread that failed fails the test at once.
    fn wait_done(&mut self, orders: usize) {
        wait_for("orders through the API", Duration::from_secs(300), || {
            if let Some(at) = self.threads.iter().position(|t| t.is_finished()) {
                if let Err(panic) = self.threads.remove(at).join() {
                    std::panic::resume_unwind(panic);
                }
            }
            (self.done.load(Ordering::SeqCst) >= orders).then_some(())
        });
    }

    fn finish(self) -> Vec<Outcome> {
        self.allow(ORDERS);
        for thread in self.threads {
            thread.join().expect("a traffic thread failed");
        }
        Arc::try_unwrap(self.outcomes)
            .unwrap()
            .into_inner()
            .unwrap()
    }
}

async fn count(client: &tokio_postgres::Client, sql: &str) -> i64 {
    client
        .query_one(sql, &[])
        .await
        .map(|row| row.get(0))
        .unwrap_or(0)
}

async fn consumed(inventory: &tokio_postgres::Client) -> i64 {
    count(inventory, "SELECT count(*) FROM consumed_event").await
}

/// Lines the consumers logged after their transactions committed: (applied, duplicates).
fn logged_outcomes(logs: &[PathBuf]) -> (usize, usize) {
    let text: String = logs
        .iter()
        .map(|log| std::fs::read_to_string(log).unwrap_or_default())
        .collect();
    let of = |word: &str| text.lines().filter(|l| l.starts_with(word)).count();
    (of("applied "), of("duplicate "))
}

// Long: one scenario, set-up, phased traffic with kills, then the checks of each promise.
#[tokio::test(flavor = "multi_thread")]
async fn the_java_order_service_and_inventory_consumer_apply_every_confirmed_order_once_through_kills(
) {
    let jar = build_example();
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let orders_db = pg.client().await;
    orders_db
        .batch_execute("CREATE DATABASE inventory")
        .await
        .unwrap();
    let (inventory, connection) =
        tokio_postgres::connect(&pg.url_of_database("inventory"), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    let jdbc = |db: &str| format!("jdbc:postgresql://127.0.0.1:{}/{db}?user=postgres", pg.port);
    let logs = scratch_dir("java-order-service");

    let mut outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    let api_port = free_port();
    let api = format!("127.0.0.1:{api_port}");
    let _service = Java::spawn(
        &["-jar", jar.to_str().unwrap()],
        &[
            ("ORDERS_DATABASE_URL", jdbc("postgres")),
            ("PORT", api_port.to_string()),
        ],
        logs.join("order-service.log"),
    );
    wait_for("the order API", Duration::from_secs(120), || {
        http_get(&api, "/orders/00000000-0000-0000-0000-000000000000")
            .filter(|(status, _)| *status == 404)
    });
    let mut consumer_logs = vec![logs.join("consumer-0.log")];
    let mut consumer = start_consumer(&jar, &brokers, &jdbc("inventory"), consumer_logs[0].clone());

    // Each phase lets its orders go, and once half of them are through, kills outboxd (even phases) or the
    // consumer (odd ones, once it has applied something since its start) while the rest are in flight.
    let mut traffic = Traffic::start(api.clone());
    let (mut outboxd_kills, mut consumer_kills) = (0, 0);
    for phase in 0..PHASES {
        let phase_end = ORDERS * (phase + 1) / PHASES;
        traffic.allow(phase_end);
        traffic.wait_done(phase_end - ORDERS / PHASES / 2);
        if phase % 2 == 0 {
            outboxd.kill();
            outboxd_kills += 1;
            outboxd = Outboxd::spawn(&run_args(&url, &brokers));
        } else {
            let before = consumed(&inventory).await;
            wait_for_async(
                "the consumer to apply events",
                Duration::from_secs(120),
                || async { (consumed(&inventory).await > before).then_some(()) },
            )
            .await;
            consumer.kill();
            consumer_kills += 1;
            consumer_logs.push(logs.join(format!("consumer-{}.log", consumer_logs.len())));
            consumer = start_consumer(
                &jar,
                &brokers,
                &jdbc("inventory"),
                consumer_logs.last().unwrap().clone(),
            );
        }
    }
    let outcomes = traffic.finish();
    wait_all_published(&orders_db, Duration::from_secs(120)).await;
    let events = count(&orders_db, "SELECT count(*) FROM outbox_event").await;
    wait_for_async(
        "the consumer to record every event",
        Duration::from_secs(180),
        || async { (consumed(&inventory).await >= events).then_some(()) },
    )
    .await;
    consumer.kill();
    drop(outboxd);

    // What Kafka holds: every committed event, nothing else, each aggregate's in commit order.
    let committed = events_in_table(
        &orders_db,
        "(extract(epoch FROM created_at) * 1000000)::int8",
    )
    .await;
    let records = consume_all(
        &brokers,
        &[TOPIC],
        committed.len(),
        Duration::from_secs(120),
    );
    let report = check_delivery(&records, &committed, &[]);
    let known: HashSet<String> = committed.iter().map(|e| e.event_id.to_string()).collect();
    let unknown = records
        .iter()
        .filter(|r| !known.contains(r.headers.get("event_id").map_or("", String::as_str)))
        .count();
    assert_eq!(report.missing, 0, "committed events missing from Kafka");
    assert_eq!(unknown, 0, "records in Kafka of no committed event");
    assert_eq!(report.order_violations, 0, "an order's events out of order");

    // Declined confirmations rolled back with their events: no OrderConfirmed of theirs anywhere.
    let declined: HashSet<&str> = outcomes
        .iter()
        .filter(|o| !o.confirmed)
        .map(|o| o.order_id.as_str())
        .collect();
    let confirmed_of_declined = records
        .iter()
        .filter(|r| r.headers.get("event_type").map(String::as_str) == Some("OrderConfirmed"))
        .filter(|r| declined.contains(r.key.as_deref().unwrap_or("")))
        .count();
    assert_eq!(
        confirmed_of_declined, 0,
        "an OrderConfirmed of a declined (rolled-back) confirmation reached Kafka"
    );

    // The inventory: every event in the inbox once; each confirmed order's lines reserved exactly once,
    // released exactly when it was cancelled; nothing reserved for a declined order.
    let inbox = count(
        &inventory,
        "SELECT count(DISTINCT event_id) FROM consumed_event",
    )
    .await;
    assert_eq!(inbox, events, "the inbox does not hold every event once");
    let rows = inventory
        .query(
            "SELECT order_id::text, sku, quantity, released_by IS NOT NULL FROM reservation",
            &[],
        )
        .await
        .unwrap();
    let mut reservations: HashMap<String, Vec<(String, i32, bool)>> = HashMap::new();
    for row in &rows {
        reservations
            .entry(row.get(0))
            .or_default()
            .push((row.get(1), row.get(2), row.get(3)));
    }
    let mut expected_stock: HashMap<String, i64> = HashMap::new();
    for outcome in &outcomes {
        let mut got = reservations.remove(&outcome.order_id).unwrap_or_default();
        got.sort();
        let mut want: Vec<(String, i32, bool)> = if outcome.confirmed {
            outcome
                .lines
                .iter()
                .map(|(sku, q)| (sku.clone(), *q, outcome.cancelled))
                .collect()
        } else {
            vec![]
        };
        want.sort();
        assert_eq!(
            got, want,
            "order {} (confirmed {}, cancelled {}): reservations (sku, quantity, released)",
            outcome.order_id, outcome.confirmed, outcome.cancelled
        );
        if outcome.confirmed && !outcome.cancelled {
            for (sku, q) in &outcome.lines {
                *expected_stock.entry(sku.clone()).or_default() += i64::from(*q);
            }
        }
    }
    assert!(
        reservations.is_empty(),
        "reservations of orders never placed: {reservations:?}"
    );
    let stock: HashMap<String, i64> = inventory
        .query(
            "SELECT sku, reserved::int8 FROM stock WHERE reserved <> 0",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert_eq!(stock, expected_stock, "stock reserved per SKU");

    // Every record the consumers read was applied once and absorbed by the inbox after: each copy in Kafka
    // past the first is a logged duplicate (more, where a consumer was killed before its offset commit; with
    // offsets committed every 2 s and each kill soon after an effect, some kill always was).
    let (applied_logged, duplicates_logged) = logged_outcomes(&consumer_logs);
    let confirmed = outcomes.iter().filter(|o| o.confirmed).count();
    let cancelled = outcomes.iter().filter(|o| o.cancelled).count();
    println!(
        "{ORDERS} orders ({confirmed} confirmed, {} declined and rolled back, {cancelled} cancelled), {events} \
         events; outboxd SIGKILLed {outboxd_kills}x, the consumer {consumer_kills}x; Kafka: {} records, {} \
         duplicates; consumers: {applied_logged} applied and logged, {duplicates_logged} duplicates absorbed by \
         the inbox; {} reservations, 0 applied twice",
        ORDERS - confirmed,
        records.len(),
        report.duplicates,
        rows.len()
    );
    assert!(
        duplicates_logged > 0,
        "no consumer ever saw a record again: the inbox was not exercised"
    );
    assert!(
        duplicates_logged >= report.duplicates,
        "{} copies in Kafka past the first, but the consumers logged {duplicates_logged} duplicates",
        report.duplicates
    );
}

/// The inventory consumer with `--inbox-retention-hours 1`: an inbox row consumed two hours ago is pruned, a
/// new event is applied, and an event created two hours ago that the inbox lacks (its row may have been pruned
/// after it was applied) is reported as beyond the retention and not applied.
#[tokio::test(flavor = "multi_thread")]
async fn the_inventory_consumer_prunes_its_inbox_and_reports_an_event_older_than_its_retention() {
    let jar = build_example();
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let orders_db = pg.client().await;
    orders_db
        .batch_execute("CREATE DATABASE inventory")
        .await
        .unwrap();
    let (inventory, connection) =
        tokio_postgres::connect(&pg.url_of_database("inventory"), tokio_postgres::NoTls)
            .await
            .unwrap();
    tokio::spawn(connection);
    // The consumer's inbox, with a row consumed two hours ago.
    inventory
        .batch_execute(
            "CREATE TABLE consumed_event (
                 consumer_name text NOT NULL, event_id uuid NOT NULL,
                 consumed_at timestamptz NOT NULL DEFAULT now(), PRIMARY KEY (consumer_name, event_id));
             INSERT INTO consumed_event VALUES ('inventory', gen_random_uuid(), now() - interval '2 hours');",
        )
        .await
        .unwrap();
    let outboxd = Outboxd::spawn(&run_args(&url, &brokers));
    wait_slot_active(&orders_db, "outboxd").await;
    let ids: Vec<uuid::Uuid> = orders_db
        .query(
            "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, created_at)
             VALUES (gen_random_uuid(), 'Order', 'o-1', 'OrderPlaced', '{}', now()),
                    (gen_random_uuid(), 'Order', 'o-2', 'OrderPlaced', '{}', now() - interval '2 hours')
             RETURNING event_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    wait_all_published(&orders_db, Duration::from_secs(60)).await;
    drop(outboxd);

    let jdbc = format!(
        "jdbc:postgresql://127.0.0.1:{}/inventory?user=postgres",
        pg.port
    );
    let log = scratch_dir("java-inbox-retention").join("consumer.log");
    let mut consumer = Java::spawn(
        &[
            "-Dloader.main=dev.outboxd.example.inventory.InventoryConsumer",
            "-cp",
            jar.to_str().unwrap(),
            "org.springframework.boot.loader.launch.PropertiesLauncher",
            "--brokers",
            &brokers,
            "--database-url",
            &jdbc,
            "--group",
            CONSUMER_GROUP,
            "--idle-exit-secs",
            "5",
            "--inbox-retention-hours",
            "1",
        ],
        &[],
        log,
    );
    let status = wait_for("the consumer to exit", Duration::from_secs(120), || {
        consumer.child.try_wait().unwrap()
    });
    let text = consumer.log_text();
    assert!(status.success(), "{text}");
    assert!(
        text.contains(&format!("applied OrderPlaced {}", ids[0])),
        "{text}"
    );
    assert!(
        text.contains(&format!("beyond-retention OrderPlaced {}", ids[1])),
        "{text}"
    );
    assert!(text.contains("\"beyond_retention\": 1"), "{text}");
    let inbox: Vec<uuid::Uuid> = inventory
        .query("SELECT event_id FROM consumed_event", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(
        inbox,
        vec![ids[0]],
        "the old row pruned, the old event not recorded"
    );
}
