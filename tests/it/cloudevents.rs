//! `--format cloudevents` on Apache Kafka, read back by an independent CloudEvents SDK (the Python
//! `cloudevents` package's Kafka binding, `tests/support/cloudevents_read.py`): every attribute of every
//! record is checked against the row it came from, in binary and in structured content mode.

use std::collections::HashMap;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Duration;

use base64::Engine;
use serde_json::{json, Value};

use crate::support::*;

/// One row as the test inserted it and the database holds it.
struct Row {
    aggregate_id: String,
    event_type: String,
    payload: Value,
    traceparent: Option<String>,
    /// created_at, microseconds since the epoch.
    created_at_us: i64,
}

/// The CloudEvents the SDK read from the records outboxd published with `--cloudevents-mode mode`,
/// next to the rows they came from (by event id).
async fn published_and_read_by_the_sdk(mode: &str) -> (Vec<Value>, HashMap<String, Row>) {
    let (pg, broker) = migrated_stack();
    let (url, brokers) = (pg.url(), broker.addr());
    let client = pg.client().await;
    client
        .batch_execute("ALTER TABLE outbox_event ADD COLUMN traceparent text")
        .await
        .unwrap();
    for n in 0..20 {
        // Half with a trace context (an extension attribute), half without (NULL: no attribute).
        let traceparent = (n % 2 == 0).then(|| format!("00-{:032x}-{:016x}-01", n + 1, n + 1));
        client
            .execute(
                "INSERT INTO outbox_event (event_id, aggregate_type, aggregate_id, event_type, payload, traceparent)
                 VALUES ($1, 'Order', $2, $3, $4, $5)",
                &[
                    &uuid::Uuid::new_v4(),
                    &format!("order-{}", n % 4),
                    &format!("Order{}", ["Placed", "Confirmed"][n % 2]),
                    &json!({"n": n, "items": [{"sku": "A-1", "qty": n}], "note": "ünïcode"}),
                    &traceparent,
                ],
            )
            .await
            .unwrap();
    }
    let mut args = run_args(&url, &brokers);
    args.extend([
        "--format",
        "cloudevents",
        "--cloudevents-mode",
        mode,
        "--cloudevents-source",
        "/shop/{table}",
        "--header-column",
        "traceparent",
    ]);
    let outboxd = Outboxd::spawn(&args);
    wait_all_published(&client, Duration::from_secs(120)).await;
    let records = consume_all(&brokers, &[TOPIC], 20, Duration::from_secs(60));
    drop(outboxd);

    let rows = client
        .query(
            "SELECT event_id::text, aggregate_id, event_type, payload, traceparent,
                    (extract(epoch FROM created_at) * 1000000)::int8
             FROM outbox_event",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| {
            (
                r.get::<_, String>(0),
                Row {
                    aggregate_id: r.get(1),
                    event_type: r.get(2),
                    payload: r.get(3),
                    traceparent: r.get(4),
                    created_at_us: r.get(5),
                },
            )
        })
        .collect();
    (read_with_the_sdk(&records), rows)
}

/// Feeds `records` to the SDK reader; one parsed event per record.
fn read_with_the_sdk(records: &[Record]) -> Vec<Value> {
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut input = String::new();
    for record in records {
        let headers: serde_json::Map<String, Value> = record
            .headers
            .iter()
            .map(|(name, value)| (name.clone(), Value::from(b64.encode(value))))
            .collect();
        let line = json!({
            "headers": headers,
            "key": record.key,
            "value": record.value.as_ref().map(|v| b64.encode(v)),
        });
        input.push_str(&line.to_string());
        input.push('\n');
    }
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/support/cloudevents_read.py");
    let mut child = Command::new(python_tool("python"))
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("cannot run the CloudEvents reader");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "the CloudEvents SDK could not read the records: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

/// Every event the SDK read is one row's, once, with each attribute the row's.
fn check_every_attribute(events: &[Value], rows: &HashMap<String, Row>) {
    assert_eq!(events.len(), rows.len(), "one CloudEvent per row");
    let mut seen = std::collections::HashSet::new();
    for event in events {
        let attributes = &event["attributes"];
        let id = attributes["id"].as_str().expect("id");
        assert!(seen.insert(id.to_string()), "event {id} twice");
        let row = rows.get(id).unwrap_or_else(|| panic!("no row has id {id}"));
        assert_eq!(attributes["specversion"], "1.0");
        assert_eq!(attributes["source"], "/shop/outbox_event");
        assert_eq!(attributes["type"], row.event_type.as_str());
        assert_eq!(attributes["subject"], row.aggregate_id.as_str());
        assert_eq!(
            attributes["partitionkey"],
            row.aggregate_id.as_str(),
            "the record key"
        );
        assert_eq!(attributes["time"], row.created_at_us, "time of {id}");
        assert_eq!(attributes["datacontenttype"], "application/json");
        assert_eq!(event["data"], row.payload, "data of {id}");
        match &row.traceparent {
            Some(traceparent) => assert_eq!(attributes["traceparent"], traceparent.as_str()),
            None => assert!(
                attributes.get("traceparent").is_none(),
                "a NULL header column became an attribute"
            ),
        }
    }
    println!(
        "{} CloudEvents read by the SDK, every attribute as in its row",
        events.len()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn binary_mode_records_read_by_the_cloudevents_sdk_carry_every_attribute() {
    let (events, rows) = published_and_read_by_the_sdk("binary").await;
    check_every_attribute(&events, &rows);
}

#[tokio::test(flavor = "multi_thread")]
async fn structured_mode_records_read_by_the_cloudevents_sdk_carry_every_attribute() {
    let (events, rows) = published_and_read_by_the_sdk("structured").await;
    check_every_attribute(&events, &rows);
}
